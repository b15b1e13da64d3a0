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

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import metrics as metrics_lib
from grpo_jax import multihost
from grpo_jax import paths
from grpo_jax import sharding

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
    self.ckpt = ckpt_lib.Checkpointer(paths.path(workdir) / "checkpoints",
                                      max_to_keep=config.checkpoint.max_to_keep,
                                      async_save=config.checkpoint.async_save)
    stack.callback(self.ckpt.close)
    self.writer = self.closing(metrics_lib.MetricWriter(workdir))
    self.preempt = Preemption()
    stack.callback(self.preempt.restore)
    # Replicated over the mesh: every process holds it, steps fold it in without moving it.
    self.mesh = mesh
    self.rng = jax.random.wrap_key_data(multihost.replicated(
        jax.random.key_data(jax.random.key(config.seed)), mesh))
    self.resume_step = self.ckpt.latest_step()
    self.meta = dict(phase="sft" if config.sft_steps > 0 else "grpo", sft_step=0, grpo_step=0,
                     eval_initial=None, eval_before=None, wall_time_sec=0.0, history=[])
    self.resume_phase = None
    if self.resume_step is not None:
      logging.info("resuming from %s/%d", self.ckpt.directory, self.resume_step)
      self.meta = self.ckpt.restore_meta(self.resume_step)
      self.resume_phase = self.meta["phase"]
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
    target = dict(target, rng=jax.ShapeDtypeStruct((2,), jnp.uint32,
                                                   sharding=sharding.replicated(self.mesh)))
    restored, _ = self.ckpt.restore(self.resume_step, target, data_iterator)
    self.rng = jax.random.wrap_key_data(restored.pop("rng"))
    return restored

  def save(self, step: int, state: dict, data_iterator, *, force: bool = False):
    if step == self._last_saved:
      return  # this step is already written (an interval save right before a stop)
    self.meta["wall_time_sec"] = self.wall_time()
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
    why = "preempted" if self.preempt.requested else (
        f"max_steps_per_run={self.config.max_steps_per_run} reached")
    logging.warning("%s: checkpoint %d written, exiting with status 0; run the same command "
                    "again to resume", why, step)
    raise SystemExit(0)

  def write_summary(self, summary: dict):
    if self.is_main:
      paths.write_atomic(paths.path(self.workdir) / "summary.json",
                         json.dumps(summary, indent=2))
