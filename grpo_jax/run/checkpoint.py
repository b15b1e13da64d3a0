"""Orbax checkpoints of everything a run needs to continue as if never stopped.

One checkpoint (WORKDIR/checkpoints/<step>/) holds three items:
  state  the train state pytree (params, optimizer state, RNG key data), sharded arrays
         written by every process and restored straight into their shardings;
  data   the grain iterator state of every JAX process (grain's own Orbax handler writes one
         file per process, so each host resumes its own shard of the data);
  meta   JSON: the phase ("sft" or "grpo"), step counters, evaluation results so far, and
         anything else the loop wants back (written by process 0).
Saves are asynchronous: the loop continues while Orbax writes, and `wait()` blocks only before
exit or the next save of the same step.

A damaged checkpoint (an empty or unparsable metadata file, a missing item, array data that
fails to read) is never resumed from: `problem(directory, step)` finds what can be seen without
reading arrays, a failed restore raises `DamagedCheckpoint`, and `move_aside` puts the step
under WORKDIR/checkpoints_damaged/ so the previous checkpoint becomes the latest.
"""

import contextlib
import json
import os

import grain
import jax
import orbax.checkpoint as ocp

from grpo_jax.parallel import multihost
from grpo_jax.run import paths


class DamagedCheckpoint(RuntimeError):
  """A checkpoint that cannot be restored; `step` and one-line `reason`."""

  def __init__(self, step: int, reason: str):
    super().__init__(f"checkpoint {step} is damaged: {reason}")
    self.step, self.reason = step, reason


ITEMS = ("state", "data", "meta")
DAMAGED_DIR = "checkpoints_damaged"


def steps_in(directory) -> list[int]:
  """Committed step folders under `directory` (Orbax's temporary folders are not digits)."""
  d = paths.path(directory)
  if not d.exists():
    return []
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit())


def problem(directory, step: int) -> str | None:
  """What makes checkpoint `step` unusable as far as can be seen without reading its arrays
  (metadata files present, non-empty and parsable; every item there); None when it looks whole.
  """
  d = paths.path(directory) / str(step)
  json_files = [d / "_CHECKPOINT_METADATA", d / "state" / "_METADATA", d / "meta" / "metadata"]
  for item in ITEMS:
    if not (d / item).is_dir():
      return f"its {item!r} item is missing ({d / item})"
  data_files = [p for p in (d / "data").iterdir() if p.name.endswith(".json")]
  if not data_files:
    return f"no data-iterator state in {d / 'data'}"
  for f in json_files + data_files:
    if not f.exists():
      return f"{f} is missing"
    text = f.read_text()
    if not text.strip():
      return f"{f} is empty"
    try:
      json.loads(text)
    except ValueError as e:
      return f"{f} is not valid JSON ({e})"
  manifests = [d / "state" / "manifest.ocdbt"]
  for m in manifests:
    if m.exists() and m.stat().length == 0:
      return f"{m} is empty"
  return None


def move_aside(directory, step: int) -> str:
  """Moves checkpoint `step` to <workdir>/checkpoints_damaged/<step>[.n]; -> where it went.
  Call from one process."""
  src = paths.path(directory) / str(step)
  dst_dir = paths.path(directory).parent / DAMAGED_DIR
  dst_dir.mkdir(parents=True, exist_ok=True)
  dst, n = dst_dir / str(step), 1
  while dst.exists():
    dst, n = dst_dir / f"{step}.{n}", n + 1
  if paths.is_remote(src):  # object stores: a recursive copy + delete under the new prefix
    from etils.epath import backend

    backend.fsspec_backend.fs(os.fspath(src)).mv(os.fspath(src), os.fspath(dst), recursive=True)
  else:
    src.rename(dst)
  return os.fspath(dst)


class Checkpointer:
  """A thin wrapper over `ocp.CheckpointManager` with the three items above."""

  def __init__(self, directory: str, *, max_to_keep: int, async_save: bool = True):
    self.directory = os.fspath(paths.path(directory))  # local: absolute; gs://: as given
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,
        enable_async_checkpointing=async_save,
        # A save a kill -9 / preemption cut short leaves its temporary folder (a whole
        # checkpoint's bytes, e.g. ~100 GB for 8B): the next launch removes it.
        cleanup_tmp_directories=True,
    )
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state, data_iterator, meta: dict, *, force: bool = False) -> bool:
    """Starts an (async) save of `state` (pytree of jax arrays), the iterator and `meta`."""
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(jax.tree.map(multihost.savable, state)),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        meta=ocp.args.JsonSave(meta),
    )
    with self._write_errors(step):
      return self._manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract_state, data_iterator):
    """Restores into `abstract_state`'s shapes/shardings and sets the iterator's position.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `.sharding` (e.g. from
    `jax.eval_shape` plus the shardings of the live state). Returns (state, meta).
    """
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(jax.tree.map(multihost.readable, abstract_state)),
            data=grain.checkpoint.CheckpointRestore(data_iterator),
            meta=ocp.args.JsonRestore(),
        ),
    )
    return jax.tree.map(multihost.placed, restored["state"], abstract_state), restored["meta"]

  def restore_meta(self, step: int) -> dict:
    """Only the JSON item (cheap: tells the loop which phase and state shapes to expect)."""
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore_params(self, step: int, abstract_params):
    """Only the policy parameters of a checkpoint (no optimizer state, reference or data), for
    inference and export. `abstract_params` gives shapes/dtypes/shardings as in `restore`."""
    phase = self.restore_meta(step)["phase"]
    target = {"sft" if phase == "sft" else "train": {"params": abstract_params}}
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    restored = ocp.PyTreeCheckpointer().restore(
        paths.path(self.directory) / str(step) / "state",
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
    )
    return next(iter(restored.values()))["params"]

  def wait(self):
    with self._write_errors(None):
      self._manager.wait_until_finished()

  def close(self):
    try:
      self.wait()
    finally:
      self._manager.close()

  @contextlib.contextmanager
  def _write_errors(self, step):
    """An (async) write that failed, as one line with the fix; earlier checkpoints stay."""
    try:
      yield
    except Exception as e:
      msg = " ".join(str(e).split())[:240]
      raise OSError(
          f"writing a checkpoint under {self.directory} failed"
          f"{'' if step is None else f' (at step {step})'}: {msg}. Fix: free space "
          "or fix write access there (complete earlier checkpoints are kept; the "
          "same command resumes from the newest)"
      ) from e


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a live pytree of arrays, for restoring into."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
