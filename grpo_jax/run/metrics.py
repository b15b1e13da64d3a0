"""Per-step bookkeeping: scalars assembled and read once per log interval, TensorBoard, ETA.

`StepLog` keeps each GRPO step's figures where they are (device scalars on the device,
process-local sums on the host) and reads them once per log interval: one `jax.device_get`
of all pending device scalars (replicated, so every process can read them) and one
cross-process sum of one stacked [steps, k] matrix of host sums, instead of a transfer or an
allgather per scalar per step. The non-finite-update streak stop is checked there, as the
values arrive (`NonFiniteError`).

Every scalar also goes, one JSON object per step, to WORKDIR/metrics.jsonl
(`{"step": 3, "reward/total": 0.41, ...}`), for scripts that do not want to parse event files.
Names are stable (docs/design.md) and metrics.jsonl keeps them as they are; TensorBoard gets
`tensorboard_tag(name)`, since its tags allow only letters, digits and `_ - / .`:
`eval/pass@1/standard` shows there as `eval/pass_at_1/standard`.

Only JAX process 0 writes; the other processes get a writer that does nothing, so the loop
calls the same methods everywhere.
"""

import json
import math
import os
import re
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import multihost
from grpo_jax.run import paths


class NonFiniteError(RuntimeError):
  """max_consecutive_nonfinite GRPO updates in a row had a non-finite loss or gradients."""


# Update-metric keys of rl/step.py -> logged names (anything else logs as loss/<key>).
_UPDATE_NAMES = {
    "loss": "loss/total",
    "pg_loss": "loss/policy_loss",
    "kl": "loss/kl_divergence",
    "clip_frac": "loss/clip_fraction",
    "clip_frac_low": "loss/clip_fraction_low",
    "clip_frac_high": "loss/clip_fraction_high",
    "skipped": "loss/skipped_updates",
}
_PROGRESS_KEYS = (
    "reward/total",
    "loss/kl_divergence",
    "loss/policy_loss",
    "completions/mean_length",
    "perf/step_time_sec",
)


def rollout_stats(
    rewards_n,
    advantages_n,
    mask_nc,
    *,
    group_size: int,
    sampler_logp_nc=None,
    trainer_logp_nc=None,
    advantage_clip: float = 0.0,
    kl_rewards_n=None,
) -> dict:
  """Scalars over the global rollout batch, computed where the arrays live (jit this with
  replicated outputs). With both log-prob arrays: the sampler/trainer gap on sampled tokens.
  advantage_clip > 0: how often the clip binds (advantages sitting at +-clip). kl_rewards_n
  (kl_in_reward): the rewards after the KL penalty."""
  std_b = rewards_n.reshape(-1, group_size).std(-1)
  out = {
      "reward/std_within_group": std_b.mean(),
      "reward/zero_std_group_fraction": (std_b == 0).astype(jnp.float32).mean(),
      "advantages/mean": advantages_n.mean(),
      "advantages/std": advantages_n.std(),
  }
  if advantage_clip > 0:
    out["advantages/clip_fraction"] = (
        (jnp.abs(advantages_n) >= advantage_clip).astype(jnp.float32).mean()
    )
  if kl_rewards_n is not None:
    out["reward/kl_penalty"] = (rewards_n - kl_rewards_n).mean()
    out["reward/total_with_kl"] = kl_rewards_n.mean()
  if trainer_logp_nc is not None:
    m = mask_nc.astype(jnp.float32)
    gap_nc = jnp.abs(sampler_logp_nc - trainer_logp_nc) * m
    out["rollout/logprob_abs_diff_mean"] = gap_nc.sum() / jnp.maximum(m.sum(), 1.0)
    out["rollout/logprob_abs_diff_max"] = gap_nc.max()
  return out


class StepLog:
  """Per-step scalars of the GRPO loop, flushed once per log interval (module docstring).

  add(step, means=, totals=, host=, device=):
    means   process-local sums over rows, summed over processes and divided by `num_rows`
    totals  process-local counts, summed over processes
    host    values of this process (timings), logged as they are
    device  jax scalars (replicated): rollout_stats and the update's metrics, which carry
            `skipped` and `nonfinite_streak` for the stop check

  max_logprob_gap > 0: each flush whose steps' mean rollout/logprob_abs_diff_mean (the
  sampler/trainer gap, logged when the sampler is another program) exceeds it logs a warning;
  `gap_patience` such flushes in a row raise RuntimeError (the sampler has drifted from the
  trained weights, so the run would optimize off-policy data).
  """

  GAP_KEY = "rollout/logprob_abs_diff_mean"  # what max_logprob_gap bounds

  def __init__(
      self,
      writer: "MetricWriter",
      progress: "Progress",
      *,
      num_rows: int,
      max_consecutive_nonfinite: int,
      max_logprob_gap: float = 0.0,
      gap_patience: int = 3,
      step_offset: int = 0,
      mesh=None,
  ):
    """`step_offset`: TensorBoard puts GRPO step s at s + step_offset (the checkpoint's global
    step, after the SFT steps); metrics.jsonl keeps the GRPO step. `mesh`: the one the device
    figures live on (a process without devices there reads them from process 0)."""
    self.step_offset, self.mesh = step_offset, mesh
    self.writer = writer
    self.progress = progress
    self.num_rows = num_rows
    self.max_nonfinite = max_consecutive_nonfinite
    self.max_logprob_gap = float(max_logprob_gap)
    self.gap_patience = max(1, int(gap_patience))
    self.gap_streak = 0  # consecutive flushes over max_logprob_gap
    self._pending = []

  def add(self, step: int, *, means: dict, totals: dict, host: dict, device: dict):
    self._pending.append((step, means, totals, host, device))

  def flush(self) -> dict:
    """Reads and writes every pending step; returns the last step's scalars. Raises
    NonFiniteError (after writing the steps up to it) when the update streak hits the limit."""
    if not self._pending:
      return {}
    device = (
        multihost.read([p[4] for p in self._pending], self.mesh)
        if self.mesh is not None
        else jax.device_get([p[4] for p in self._pending])
    )
    keys = list(self._pending[0][1]) + list(self._pending[0][2])
    sums = multihost.sum_over_processes(
        np.asarray([[*p[1].values(), *p[2].values()] for p in self._pending], np.float64)
    )
    memory = device_memory_gib()
    pending, self._pending = self._pending, []
    scalars = {}
    gaps = []
    for (step, means, _, host, _), dev, row in zip(pending, device, sums):
      scalars = {k: v / self.num_rows if k in means else v for k, v in zip(keys, row)}
      scalars.update(host)
      if "completions/tokens" in scalars:
        scalars["perf/rollout_tokens_per_sec"] = scalars["completions/tokens"] / max(
            host["perf/rollout_sec"], 1e-9
        )
      streak = int(dev.pop("nonfinite_streak"))
      for k, v in dev.items():
        scalars[_UPDATE_NAMES.get(k, k if "/" in k else f"loss/{k}")] = float(v)
      scalars.update(memory)
      if self.GAP_KEY in scalars:
        gaps.append(scalars[self.GAP_KEY])
      self.writer.write_scalars(step, scalars, global_step=step + self.step_offset)
      if scalars.get("loss/skipped_updates"):
        logging.warning(
            "step %d: non-finite loss or gradients; update skipped (%d in a row)", step, streak
        )
      if streak >= self.max_nonfinite:
        self.writer.flush()
        raise NonFiniteError(
            f"{streak} consecutive GRPO updates had a non-finite loss or gradients (last at "
            f"step {step}); stopping. Check rewards (reward/errors), the learning rate, and "
            "param/compute dtypes; lower optimizer.learning_rate or raise "
            "max_consecutive_nonfinite to keep going."
        )
    self.writer.flush()
    self.progress.log(pending[-1][0], scalars, _PROGRESS_KEYS)
    if self.max_logprob_gap > 0 and gaps:
      self._check_gap(pending[0][0], pending[-1][0], float(np.mean(gaps)))
    return scalars

  def _check_gap(self, first: int, last: int, gap: float):
    """The sampler/trainer log-prob gap stop (class docstring)."""
    if not (gap > self.max_logprob_gap or math.isnan(gap)):
      self.gap_streak = 0
      return
    self.gap_streak += 1
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    fixes = (
        "check the weight sync (rollout.vllm.verify_sync, perf/weight_sync_sec), the "
        "engine's dtype vs model.dtype, and correct what remains with truncated importance "
        "sampling (loss.tis_cap, e.g. 2.0)"
    )
    if self.gap_streak >= self.gap_patience:
      raise RuntimeError(
          f"sampler/trainer log-prob gap {self.GAP_KEY}={gap:.4g} > rollout.max_logprob_gap="
          f"{self.max_logprob_gap:g} on {self.gap_streak} log intervals in a row (last at "
          f"{steps}); stopping: the rollouts no longer come from the weights being trained. "
          f"Fix: {fixes}; or raise rollout.max_logprob_gap (0 = off)."
      )
    logging.warning(
        "%s: sampler/trainer log-prob gap %s=%.4g > rollout.max_logprob_gap=%g "
        "(%d/%d in a row before the run stops). Fix: %s.",
        steps,
        self.GAP_KEY,
        gap,
        self.max_logprob_gap,
        self.gap_streak,
        self.gap_patience,
        fixes,
    )


# A character TensorBoard does not allow in a tag (tensorboardX replaces each by "_", with an INFO
# line per call: three per evaluation with pass@k).
_TAG_INVALID = re.compile(r"[^-/\w.]")


def tensorboard_tag(name: str) -> str:
  """A metric's name as TensorBoard shows it: "@" -> "_at_", any other character a tag does not
  allow -> "_" (eval/pass@1/standard -> eval/pass_at_1/standard). metrics.jsonl keeps `name`."""
  return _TAG_INVALID.sub("_", name.replace("@", "_at_")).lstrip("/")


class MetricWriter:
  """Scalars to WORKDIR (TensorBoard events, under `tensorboard_tag` names, and metrics.jsonl,
  under the names as given) from process 0; a no-op elsewhere."""

  def __init__(
      self,
      logdir: str,
      *,
      enabled: bool | None = None,
      keep_rows: int | None = None,
      purge_step: int | None = None,
  ):
    """`keep_rows`: keep only the first rows of an existing metrics.jsonl, and `purge_step`:
    TensorBoard hides the earlier event files' points from this (global) step on. A resumed run
    drops what was logged after its checkpoint, which it logs again: no step appears twice."""
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._writer = None
    self._jsonl = None
    self.rows = 0  # rows in metrics.jsonl (recorded with each checkpoint)
    if self.enabled:
      from tensorboardX import SummaryWriter

      paths.register_tensorboard_schemes()
      logdir = os.fspath(paths.path(logdir))
      self._writer = SummaryWriter(logdir=logdir, flush_secs=30, purge_step=purge_step)
      self._jsonl = paths.AppendLog(paths.path(logdir) / "metrics.jsonl", keep_lines=keep_rows)
      self.rows = self._jsonl.lines

  def write_scalars(self, step: int, scalars: dict, *, global_step: int | None = None):
    """metrics.jsonl row at `step`; TensorBoard points at `global_step` (default `step`)."""
    if not self._writer:
      return
    tb_step = step if global_step is None else global_step
    row = {"step": int(step)}
    for name, value in scalars.items():
      value = float(value)
      if math.isfinite(value):
        self._writer.add_scalar(tensorboard_tag(name), value, global_step=tb_step)
      row[name] = value if math.isfinite(value) else str(value)
    self._jsonl.write(json.dumps(row) + "\n")
    self.rows += 1

  def write_text(self, step: int, name: str, text: str):
    if self._writer:
      self._writer.add_text(tensorboard_tag(name), text, global_step=step)

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
