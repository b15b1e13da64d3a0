"""What the stages of one run share: checkpoints, metrics, preemption, time, and one teardown.

    with session_lib.open_session(config, workdir, mesh) as session:
      reward_fn = session.closing(rewards.build_reward_computer(...))
      ...
      session.save(step, {"train": state}, data_iter)
      if session.stop_requested():                                    # SIGTERM on any host
        session.stop(step, {"train": state}, data_iter)               # save, exit 0

`open_session` owns an ExitStack: everything the session opens (the checkpointer, which waits
for async writes, the metric writer, the SIGTERM handler) and everything registered with
`closing` (reward worker pool, profiler, rollout engines) is closed on every exit path: a
normal return, `SystemExit(0)` after a preemption save, or an error such as NonFiniteError.

`meta` (JSON, saved with every checkpoint) holds the phase ("sft" or "grpo"), both step
counters, the evaluations so far and the wall time of earlier runs. `resume_phase` is the
phase of the checkpoint this run resumes from (None for a fresh run); each stage restores
its own state with `restore` when it is the one that was interrupted.
"""

import contextlib
import json
import signal
import time

from absl import logging
import jax
import jax.numpy as jnp

from grpo_jax.run import checkpoint as ckpt_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.parallel import multihost
from grpo_jax.run import paths
from grpo_jax.parallel import sharding

_PROCESS_START = time.time()


class Preemption:
  """SIGTERM sets a flag; the stages save a checkpoint at the next step boundary and exit 0."""

  def __init__(self):
    self.requested = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    logging.warning("SIGTERM: saving a checkpoint at the end of this step, then exiting")
    self.requested = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)


@contextlib.contextmanager
def open_session(config, workdir: str, mesh):
  with contextlib.ExitStack() as stack:
    yield Session(config, workdir, mesh, stack)


class Session:
  """Checkpoints, metric writer, preemption flag, run metadata and wall time of one run."""

  def __init__(self, config, workdir: str, mesh, stack: contextlib.ExitStack):
    self.config = config
    self.workdir = workdir
    self.is_main = jax.process_index() == 0
    self._stack = stack
    if self.is_main:
      paths.makedirs(workdir)
    ckpt_dir = paths.path(workdir) / "checkpoints"
    resume_step = _intact_latest(ckpt_dir)  # damaged newer ones are moved aside
    self.ckpt = ckpt_lib.Checkpointer(
        ckpt_dir, max_to_keep=config.checkpoint.max_to_keep, async_save=config.checkpoint.async_save
    )
    stack.callback(self.ckpt.close)
    self.meta = dict(
        phase="sft" if config.sft_steps > 0 else "grpo",
        sft_step=0,
        grpo_step=0,
        eval_initial=None,
        eval_before=None,
        wall_time_sec=0.0,
        history=[],
        config=resume_fields(config),
        metrics_rows=0,
    )
    self.resume_step, self.resume_phase = resume_step, None
    if resume_step is not None:
      logging.info("resuming from %s/%d", self.ckpt.directory, resume_step)
      meta = self.ckpt.restore_meta(resume_step)
      check_resumable(meta.get("config"), config, resume_step, workdir)
      self.meta = dict(meta, config=resume_fields(config))
      self.resume_phase = meta["phase"]
    if self.is_main:
      paths.write_atomic(
          paths.path(workdir) / "config.json", config.to_json_best_effort(indent=2, sort_keys=True)
      )
    # Rows logged after the checkpoint we resume from are dropped: they are logged again.
    resuming = resume_step is not None
    self.writer = self.closing(
        metrics_lib.MetricWriter(
            workdir,
            keep_rows=self.meta.get("metrics_rows") if resuming else None,
            purge_step=resume_step + 1 if resuming else None,
        )
    )
    self.preempt = Preemption()
    stack.callback(self.preempt.restore)
    # Replicated over the mesh: every process holds it, steps fold it in without moving it.
    self.mesh = mesh
    self.rng = jax.random.wrap_key_data(
        multihost.replicated(jax.random.key_data(jax.random.key(config.seed)), mesh)
    )
    self._wall_offset = self.meta["wall_time_sec"]  # time spent by earlier (preempted) runs
    self._last_saved = None

  def closing(self, thing):
    """Registers `thing.close()` (if it has one) with the session's teardown; -> `thing`."""
    if hasattr(thing, "close"):
      self._stack.callback(thing.close)
    return thing

  def wall_time(self) -> float:
    return self._wall_offset + (time.time() - _PROCESS_START)

  # ------------------------------------------------------------------------- checkpoints

  def restore(self, target: dict, data_iterator) -> dict:
    """The interrupted stage's state (`target`: abstract arrays with shardings) and its data
    iterator's position, from the checkpoint this run resumes from."""
    target = dict(
        target, rng=jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(self.mesh))
    )
    error = None
    try:
      restored, _ = self.ckpt.restore(self.resume_step, target, data_iterator)
    except Exception as e:  # arrays that do not read back: a damaged checkpoint
      error = " ".join(str(e).split())[:300] or type(e).__name__
    if multihost.any_process(error is not None):  # every process takes the same path
      if self.is_main:
        where = ckpt_lib.move_aside(self.ckpt.directory, self.resume_step)
        logging.warning(
            "checkpoint %d does not restore (%s); moved to %s",
            self.resume_step,
            error or "on another process",
            where,
        )
      multihost.barrier("moved_damaged_checkpoint")
      raise ckpt_lib.DamagedCheckpoint(self.resume_step, error or "failed on another process")
    self.rng = jax.random.wrap_key_data(restored.pop("rng"))
    return restored

  def save(self, step: int, state: dict, data_iterator, *, force: bool = False):
    if step == self._last_saved:
      return  # this step is already written (an interval save right before a stop)
    self.meta["wall_time_sec"] = self.wall_time()
    self.writer.flush()
    self.meta["metrics_rows"] = self.writer.rows
    tree = dict(state, rng=jax.random.key_data(self.rng))
    self.ckpt.save(step, tree, data_iterator, dict(self.meta), force=force)
    self._last_saved = step

  def stop_requested(self, *, budget_spent: bool = False) -> bool:
    """True on every process when any process got SIGTERM (or this run's step budget is
    spent): all processes then take the same path, collectives included."""
    return multihost.any_process(self.preempt.requested) or budget_spent

  def stop(self, step: int, state: dict, data_iterator):
    """Saves `state` as checkpoint `step` and exits with status 0; the same command resumes."""
    self.save(step, state, data_iterator, force=True)
    why = (
        "preempted"
        if self.preempt.requested
        else (f"max_steps_per_run={self.config.max_steps_per_run} reached")
    )
    logging.warning(
        "%s: checkpoint %d written, exiting with status 0; run the same command " "again to resume",
        why,
        step,
    )
    raise SystemExit(0)

  def write_summary(self, summary: dict):
    if self.is_main:
      paths.write_atomic(paths.path(self.workdir) / "summary.json", json.dumps(summary, indent=2))


# ------------------------------------------------------------------------- resume checks

# Fields a checkpoint's state and data order depend on. Changing one of the first group makes
# the saved arrays unusable (or the step numbering wrong); the rest change what "continue
# exactly" means and may be allowed with --config.checkpoint.allow_changes=field,field.
_SHAPE_FIELDS = (
    "model.impl",
    "model.vocab_size",
    "model.hidden_size",
    "model.intermediate_size",
    "model.num_layers",
    "model.num_heads",
    "model.num_kv_heads",
    "model.head_dim",
    "model.tie_embeddings",
    "model.param_dtype",
    "model.scan_layers",
    "reference_model",
    "sft_steps",
    "lora.rank",
    "lora.target_modules",
    "lora.quantize_base",
)
_ORDER_FIELDS = (
    "seed",
    "batch_size",
    "num_generations",
    "sft.batch_size",
    "tokenizer.kind",
    "tokenizer.path",
    "data.train_source",
    "data.train_path",
    "data.template",
    "max_prompt_length",
)


def resume_fields(config) -> dict:
  """The config values a checkpoint records so a later run can tell whether it may resume."""
  out = {}
  for name in _SHAPE_FIELDS + _ORDER_FIELDS:
    if name == "reference_model":
      out[name] = bool(config.beta > 0)
      continue
    node = config
    for part in name.split("."):
      node = getattr(node, part)
    out[name] = node
  return out


def check_resumable(saved: dict | None, config, step: int, workdir: str):
  """Raises a one-line ValueError when `config` differs from the run that wrote checkpoint
  `step` in a field the checkpoint depends on (checkpoints from before this check pass)."""
  if not saved:
    return
  now = resume_fields(config)
  allowed = {f.strip() for f in config.checkpoint.allow_changes.split(",") if f.strip()}
  changed = [k for k in now if k in saved and saved[k] != now[k] and k not in allowed]
  if not changed:
    return
  fixed = [k for k in changed if k in _SHAPE_FIELDS]
  diff = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
  fix = (
      "use a new --workdir (these fields fix the checkpoint's shapes)"
      if fixed
      else "use a new --workdir, or resume anyway with --config.checkpoint.allow_changes="
      f"{','.join(changed)}"
  )
  raise ValueError(
      f"{workdir}: checkpoint {step} was written with other settings ({diff}). " f"Fix: {fix}."
  )


def _intact_latest(ckpt_dir) -> int | None:
  """The newest checkpoint that looks whole; newer damaged ones are reported and moved to
  checkpoints_damaged/ (never silently: if none is intact, a one-line error)."""
  steps = ckpt_lib.steps_in(ckpt_dir)
  damaged = []
  for step in reversed(steps):
    why = ckpt_lib.problem(ckpt_dir, step)
    if why is None:
      break
    damaged.append((step, why))
  else:
    step = None
  earlier = ckpt_dir.parent / ckpt_lib.DAMAGED_DIR
  if damaged and step is None or step is None and earlier.exists() and any(earlier.iterdir()):
    listed = "; ".join(f"{s}: {w}" for s, w in damaged) or f"see {earlier}"
    raise ValueError(
        f"no intact checkpoint is left under {ckpt_dir} ({listed}). Fix: a new "
        "--workdir to start over, or put back a copy of the checkpoints"
    )
  # Every process has looked before any checkpoint moves: a process that lists the folder
  # after process 0 moved a damaged one aside would see no damage, skip the barrier below and
  # fall out of step with the others (seen once on 2 processes after a hard kill).
  multihost.barrier("inspected_checkpoints")
  if damaged:
    if jax.process_index() == 0:
      for s, why in damaged:
        where = ckpt_lib.move_aside(ckpt_dir, s)
        logging.warning(
            "checkpoint %d is damaged (%s): moved to %s; resuming from %d", s, why, where, step
        )
    multihost.barrier("moved_damaged_checkpoints")
  return step
