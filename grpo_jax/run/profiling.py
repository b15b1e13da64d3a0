"""A `jax.profiler.trace` window over chosen steps, written to WORKDIR/profile (Perfetto).

The loop names its phases in the trace: each GRPO step is a `StepTraceAnnotation`
"grpo_step" (with `step_num`), and inside it `phase(name)` spans, PHASES in order.
benchmarks/trace_analysis.py reads them back. Spans are host time: a phase that only
dispatches device work ends before that work does; the wait is in the phase that blocks
("update" blocks on the new state, "rollout" on the completions it copies to the host).

A span is also the one clock of its region: `phase(name).sec` once it ends, and the open step
span (`step_span`) adds up its phases' seconds by name, which the loop logs as perf/* figures
(perf/update_sec: UPDATE_PHASES; perf/step_time_sec: the step span so far).

With a cloud workdir (gs://) the trace is written to a local temporary folder and copied to
WORKDIR/profile when the window closes.
"""

import collections
import os
import shutil
import tempfile
import time

from absl import logging
import jax

from grpo_jax.run import paths

# The named spans of one GRPO step, in loop order (train.py). "log" is the step's bookkeeping.
PHASES = (
    "prompts",
    "rollout",
    "rewards",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "kl_in_reward",
    "update",
    "ref_refresh",
    "log",
)
# Phases only some configs have (kl_in_reward, reference.refresh_every_steps).
OPTIONAL_PHASES = ("kl_in_reward", "ref_refresh")
# perf/update_sec: GRPO steps 4-6, the advantages to the weights following the update (the
# host's work for the next step meanwhile, source.while_updating, is not in it).
UPDATE_PHASES = (
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "kl_in_reward",
    "update",
    "weight_sync",
    "ref_refresh",
)
STEP_SPAN = "grpo_step"
PHASE_PREFIX = "phase/"


def device_memory() -> dict | None:
  """{in_use, peak, limit} bytes, the largest over this process's devices; None where the
  backend keeps no statistics (XLA:CPU)."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  if not all(stats):
    return None
  return {
      k: max(s.get(key, 0) for s in stats)
      for k, key in (
          ("in_use", "bytes_in_use"),
          ("peak", "peak_bytes_in_use"),
          ("limit", "bytes_limit"),
      )
  }


def log_memory(stage: str):
  """One line with the device memory after a load stage (policy, optimizer, reference, the
  first step with its sampler cache), where the backend reports memory."""
  m = device_memory()
  if m is not None:
    gib = 1 << 30
    logging.info(
        "memory after %s: %.2f GiB in use, peak %.2f GiB, of %.2f GiB per device",
        stage,
        m["in_use"] / gib,
        m["peak"] / gib,
        m["limit"] / gib,
    )


class MemoryProfile:
  """`config.profile.memory_profile`: WORKDIR/memory_profile.pprof (live device buffers, `pprof
  -http` or `go tool pprof` reads it) saved after the step at which the device's peak memory
  last grew, i.e. the peak step; without memory statistics (CPU), after the first step."""

  def __init__(self, workdir: str, enabled: bool):
    self.path = paths.path(workdir) / "memory_profile.pprof"
    self.enabled = enabled and jax.process_index() == 0
    self._peak = -1

  def step_end(self, step: int):
    if not self.enabled:
      return
    m = device_memory()
    peak = m["peak"] if m is not None else 0
    if peak > self._peak:
      self._peak = peak
      paths.write_atomic(self.path, jax.profiler.device_memory_profile())
      logging.info(
          "memory profile of step %d (peak %.2f GiB) in %s", step, peak / (1 << 30), self.path
      )


class Span:
  """A named region: an annotation in the trace (nearly free when no trace is being written)
  and its host seconds, `sec` once it ends, added to the open step span's `phases`."""

  def __init__(self, name: str):
    self.name, self.sec = name, 0.0

  def __enter__(self):
    self._annotation = jax.profiler.TraceAnnotation(PHASE_PREFIX + self.name)
    self._annotation.__enter__()
    self._t0 = time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.sec = time.perf_counter() - self._t0
    self._annotation.__exit__(*exc)
    if _open_steps:
      _open_steps[-1].phases[self.name] += self.sec


class StepSpan:
  """One GRPO step in the trace (`grpo_step`, with its number) and the seconds of the phases
  run inside it, by name (`phases`; a phase entered twice counts twice)."""

  def __init__(self, step: int):
    self.step = step
    self.phases = collections.Counter()

  def __enter__(self):
    self._annotation = jax.profiler.StepTraceAnnotation(STEP_SPAN, step_num=self.step)
    self._annotation.__enter__()
    self._t0 = time.perf_counter()
    _open_steps.append(self)
    return self

  def __exit__(self, *exc):
    _open_steps.remove(self)
    self._annotation.__exit__(*exc)

  def elapsed(self) -> float:
    """Host seconds since the step began."""
    return time.perf_counter() - self._t0

  def seconds(self, names) -> float:
    """The seconds of the phases `names` so far in this step."""
    return sum(self.phases[name] for name in names)


_open_steps: list[StepSpan] = []  # the step span phases add to (the main thread's)


def phase(name: str) -> Span:
  """`with phase("update"):` a named span in the trace that times itself (Span)."""
  return Span(name)


def step_span(step: int) -> StepSpan:
  """`with step_span(step) as span:` the step in the trace; span.phases: its phases' seconds."""
  return StepSpan(step)


def trace_options(python_tracer: bool = False) -> jax.profiler.ProfileOptions:
  """The profiler's options: the Python tracer (every Python call a trace event) only on
  request (profile.python_tracer). It is off by default because it distorts what the trace
  measures: in the CPU demo it made the host's reward phase (pure Python) 15 ms per step
  instead of the 2-3 ms it takes untraced, so the host looked like a quarter of the step."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 1 if python_tracer else 0
  return options


class StepProfiler:
  """Starts a trace at `start_step` and stops it after `num_steps` steps; start < 0 disables.

  Call `step_begin(step)` before and `step_end(step, block_on)` after each step; `block_on`
  (any pytree of arrays) is waited on before the trace stops so the window holds the device
  work of its steps, not just their dispatch.
  """

  def __init__(self, workdir: str, start_step: int, num_steps: int, python_tracer: bool = False):
    self.logdir = paths.path(workdir) / "profile"
    self.python_tracer = python_tracer
    self._tracedir = None  # where the profiler writes (a local copy for cloud workdirs)
    self.start = start_step
    self.stop = start_step + max(num_steps, 1)
    self.active = False

  def step_begin(self, step: int):
    if self.start >= 0 and step == self.start and not self.active:
      logging.info("profiler: tracing steps %d..%d into %s", self.start, self.stop - 1, self.logdir)
      self._tracedir = (
          tempfile.mkdtemp(prefix="grpo_profile_")
          if paths.is_remote(self.logdir)
          else os.fspath(self.logdir)
      )
      jax.profiler.start_trace(
          self._tracedir,
          create_perfetto_trace=True,
          profiler_options=trace_options(self.python_tracer),
      )
      self.active = True

  def step_end(self, step: int, block_on=None):
    if self.active and step + 1 >= self.stop:
      if block_on is not None:
        jax.block_until_ready(block_on)
      self._finish()
      logging.info(
          "profiler: trace written to %s (open perfetto_trace.json.gz in "
          "ui.perfetto.dev; a summary: python benchmarks/trace_analysis.py %s)",
          self.logdir,
          self.logdir,
      )

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
