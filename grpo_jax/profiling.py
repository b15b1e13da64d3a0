"""A `jax.profiler.trace` window over chosen steps, written to WORKDIR/profile (Perfetto)."""
import os

from absl import logging
import jax


class StepProfiler:
  """Starts a trace at `start_step` and stops it after `num_steps` steps; start < 0 disables.

  Call `step_begin(step)` before and `step_end(step, block_on)` after each step; `block_on`
  (any pytree of arrays) is waited on before the trace stops so the window holds the device
  work of its steps, not just their dispatch.
  """

  def __init__(self, workdir: str, start_step: int, num_steps: int):
    self.logdir = os.path.join(workdir, "profile")
    self.start = start_step
    self.stop = start_step + max(num_steps, 1)
    self.active = False

  def step_begin(self, step: int):
    if self.start >= 0 and step == self.start and not self.active:
      logging.info("profiler: tracing steps %d..%d into %s", self.start, self.stop - 1,
                   self.logdir)
      jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
      self.active = True

  def step_end(self, step: int, block_on=None):
    if self.active and step + 1 >= self.stop:
      if block_on is not None:
        jax.block_until_ready(block_on)
      jax.profiler.stop_trace()
      self.active = False
      logging.info("profiler: trace written to %s (open the .perfetto-trace in ui.perfetto.dev)",
                   self.logdir)

  def close(self):
    if self.active:
      jax.profiler.stop_trace()
      self.active = False
