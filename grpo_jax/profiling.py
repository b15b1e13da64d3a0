"""A `jax.profiler.trace` window over chosen steps, written to WORKDIR/profile (Perfetto).

With a cloud workdir (gs://) the trace is written to a local temporary folder and copied to
WORKDIR/profile when the window closes.
"""
import os
import shutil
import tempfile

from absl import logging
import jax

from grpo_jax import paths


class StepProfiler:
  """Starts a trace at `start_step` and stops it after `num_steps` steps; start < 0 disables.

  Call `step_begin(step)` before and `step_end(step, block_on)` after each step; `block_on`
  (any pytree of arrays) is waited on before the trace stops so the window holds the device
  work of its steps, not just their dispatch.
  """

  def __init__(self, workdir: str, start_step: int, num_steps: int):
    self.logdir = paths.path(workdir) / "profile"
    self._tracedir = None  # where the profiler writes (a local copy for cloud workdirs)
    self.start = start_step
    self.stop = start_step + max(num_steps, 1)
    self.active = False

  def step_begin(self, step: int):
    if self.start >= 0 and step == self.start and not self.active:
      logging.info("profiler: tracing steps %d..%d into %s", self.start, self.stop - 1,
                   self.logdir)
      self._tracedir = (tempfile.mkdtemp(prefix="grpo_profile_") if paths.is_remote(self.logdir)
                        else os.fspath(self.logdir))
      jax.profiler.start_trace(self._tracedir, create_perfetto_trace=True)
      self.active = True

  def step_end(self, step: int, block_on=None):
    if self.active and step + 1 >= self.stop:
      if block_on is not None:
        jax.block_until_ready(block_on)
      self._finish()
      logging.info("profiler: trace written to %s (open the .perfetto-trace in ui.perfetto.dev)",
                   self.logdir)

  def _finish(self):
    jax.profiler.stop_trace()
    self.active = False
    if paths.is_remote(self.logdir):  # copy the local trace up, then drop it
      for root, _, files in os.walk(self._tracedir):
        for name in files:
          src = os.path.join(root, name)
          dst = self.logdir / os.path.relpath(src, self._tracedir)
          dst.parent.mkdir(parents=True, exist_ok=True)
          with open(src, "rb") as f:
            dst.write_bytes(f.read())
      shutil.rmtree(self._tracedir, ignore_errors=True)

  def close(self):
    if self.active:
      self._finish()
