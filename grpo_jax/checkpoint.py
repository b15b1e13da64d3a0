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
"""
import os

import grain
import jax
import orbax.checkpoint as ocp

from grpo_jax import paths


class Checkpointer:
  """A thin wrapper over `ocp.CheckpointManager` with the three items above."""

  def __init__(self, directory: str, *, max_to_keep: int, async_save: bool = True):
    self.directory = os.fspath(paths.path(directory))  # local: absolute; gs://: as given
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        })

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state, data_iterator, meta: dict, *, force: bool = False) -> bool:
    """Starts an (async) save of `state` (pytree of jax arrays), the iterator and `meta`."""
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iterator),
        meta=ocp.args.JsonSave(meta))
    return self._manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract_state, data_iterator):
    """Restores into `abstract_state`'s shapes/shardings and sets the iterator's position.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with `.sharding` (e.g. from
    `jax.eval_shape` plus the shardings of the live state). Returns (state, meta).
    """
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iterator),
        meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]

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
        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                    partial_restore=True))
    return next(iter(restored.values()))["params"]

  def wait(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a live pytree of arrays, for restoring into."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
