"""TensorBoard scalars (tensorboardX), the console progress line, and device-memory stats.

Every scalar also goes, one JSON object per step, to WORKDIR/metrics.jsonl
(`{"step": 3, "reward/total": 0.41, ...}`), for scripts that do not want to parse event files.

Only JAX process 0 writes; the other processes get a writer that does nothing, so the loop
calls the same methods everywhere.
"""
import json
import math
import os
import time

from absl import logging
import jax
import numpy as np


class MetricWriter:
  """Scalars to WORKDIR (TensorBoard events) from process 0; a no-op elsewhere."""

  def __init__(self, logdir: str, *, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._writer = None
    self._jsonl = None
    if self.enabled:
      from tensorboardX import SummaryWriter
      self._writer = SummaryWriter(logdir=logdir, flush_secs=30)
      self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")

  def write_scalars(self, step: int, scalars: dict):
    if not self._writer:
      return
    row = {"step": int(step)}
    for name, value in scalars.items():
      value = float(value)
      if math.isfinite(value):
        self._writer.add_scalar(name, value, global_step=step)
      row[name] = value if math.isfinite(value) else str(value)
    self._jsonl.write(json.dumps(row) + "\n")

  def write_text(self, step: int, name: str, text: str):
    if self._writer:
      self._writer.add_text(name, text, global_step=step)

  def flush(self):
    if self._writer:
      self._writer.flush()
      self._jsonl.flush()

  def close(self):
    if self._writer:
      self._writer.close()
      self._jsonl.close()
      self._writer = None


def device_memory_gib() -> dict[str, float]:
  """`memory/hbm_in_use_gib` (and peak, limit) summed over local devices, where reported.

  TPU and GPU backends report `memory_stats()`; the CPU backend returns None, so the dict is
  empty there rather than holding a made-up zero.
  """
  in_use = peak = limit = 0
  seen = False
  for d in jax.local_devices():
    try:
      stats = d.memory_stats()
    except Exception:  # Some backends raise instead of returning None.
      stats = None
    if not stats:
      continue
    seen = True
    in_use += stats.get("bytes_in_use", 0)
    peak += stats.get("peak_bytes_in_use", 0)
    limit += stats.get("bytes_limit", 0)
  if not seen:
    return {}
  gib = float(1 << 30)
  out = {"memory/hbm_in_use_gib": in_use / gib, "memory/hbm_peak_gib": peak / gib}
  if limit:
    out["memory/hbm_limit_gib"] = limit / gib
  return out


class Progress:
  """Step/total, a few key metrics, step time and ETA as one console line."""

  def __init__(self, total_steps: int, start_step: int = 0, what: str = "grpo"):
    self.total = total_steps
    self.start_step = start_step
    self.what = what
    self._t0 = time.time()

  def eta_sec(self, step: int) -> float:
    done = step - self.start_step
    if done <= 0:
      return float("nan")
    return (time.time() - self._t0) / done * (self.total - step)

  def line(self, step: int, scalars: dict, keys: tuple[str, ...]) -> str:
    parts = [f"[{self.what}] step {step}/{self.total}"]
    for key in keys:
      if key in scalars:
        parts.append(f"{key.split('/')[-1]}={_fmt(scalars[key])}")
    eta = self.eta_sec(step)
    parts.append(f"eta={_fmt_time(eta)}")
    return "  ".join(parts)

  def log(self, step: int, scalars: dict, keys: tuple[str, ...]):
    if jax.process_index() == 0:
      logging.info("%s", self.line(step, scalars, keys))


def _fmt(v) -> str:
  v = float(np.asarray(v))
  if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
    return f"{v:.3e}"
  return f"{v:.4g}"


def _fmt_time(sec: float) -> str:
  if not math.isfinite(sec):
    return "?"
  sec = int(round(sec))
  h, rem = divmod(sec, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
