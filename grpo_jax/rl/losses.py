"""GRPO-family policy losses, KL estimators and loss aggregation (pure jnp).

Shapes: `logp`, `old_logp`, `ref_logp`, `mask` are [B, T] over completion tokens; advantages
are [B] (one per sequence, broadcast over tokens) or [B, T]. Which tokens make a sequence is
`seqs`: `ROWS` (the padded layout: row b is sequence b) or `Segments` (packed rows, rl/packing.py:
each token carries its sequence's index), and every per-sequence quantity (the seq-mean
aggregations, GSPO's sequence ratio) is a sum per sequence either way, so a loss is the same in
both layouts. Positions where `mask == 0` may hold
anything, NaN included: every input is passed through `jnp.where(mask, x, 0)` first, so masked
garbage never reaches a loss value or a gradient.

Definitions (docs/design.md):
  ratio = exp(logp - old)
  PPO-clip token loss = -min(ratio*A, clip(ratio, 1-eps_low, 1+eps_high)*A)
  k1 = logp - ref;  k2 = 0.5*(logp - ref)^2;  k3 = exp(ref - logp) - (ref - logp) - 1
  token loss = PPO-clip token loss (x TIS weight) + beta * KL token value, then aggregated.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from grpo_jax.rl.registry import KL_ESTIMATORS
from grpo_jax.rl.registry import LOSS_AGG_MODES
from grpo_jax.rl.registry import POLICY_LOSSES

# Log-ratios are clamped to this before exp() in the policy ratio (as verl does): exp(20) ~ 5e8
# is far outside any clip range, and without the clamp exp() of a corrupt log-prob overflows
# to inf, whose zero cotangent then becomes 0 * inf = NaN in the backward pass.
MAX_LOG_RATIO = 20.0


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Mean of x over mask (0 where the mask is empty, never NaN)."""
  m = mask.astype(bool)
  total = jnp.where(m, x, 0).sum(axis)
  count = m.sum(axis)
  return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


# ----------------------------------------------------------------------------- KL estimators


@KL_ESTIMATORS.register("k1")
def _k1(logp, ref_logp):
  return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def _k2(logp, ref_logp):
  return 0.5 * (logp - ref_logp) ** 2


@KL_ESTIMATORS.register("k3", "low_var_kl")
def _k3(logp, ref_logp):
  d = ref_logp - logp
  # exp(d) - d - 1 cancels in f32 for small |d| (policy close to reference, the common case):
  # relative error ~1.2e-7 / |d| in the direct form (2e-5 at |d| = 0.01, which expm1's own
  # last-bit differences between XLA versions push past 1e-5). Below |d| = 0.5 use its Taylor
  # series to d^9/9! (truncation < 2e-9 relative); above it the direct form is within 4e-7.
  small = jnp.abs(d) < 0.5
  ds = jnp.where(small, d, 0.0)
  series = (
      ds
      * ds
      * (
          1 / 2
          + ds
          * (
              1 / 6
              + ds
              * (
                  1 / 24
                  + ds
                  * (1 / 120 + ds * (1 / 720 + ds * (1 / 5040 + ds * (1 / 40320 + ds / 362880))))
              )
          )
      )
  )
  return jnp.where(small, series, jnp.expm1(jnp.where(small, 1.0, d)) - d)


def token_kl(
    logp: jax.Array, ref_logp: jax.Array, kind: str = "k3", clamp: float | None = None
) -> jax.Array:
  """Per-token estimate of KL(policy || ref) (Schulman 2020, "Approximating KL Divergence").

  k1 is unbiased but high variance and can be negative; k2 = 0.5 * log-ratio^2; k3
  ("low_var_kl", used by GRPO, DeepSeekMath eq. 4) is unbiased and non-negative.
  `clamp=None` gives the exact formulas (k3 overflows to inf when ref - logp > ~88 in f32).
  With `clamp=c` (verl uses 10 for low_var_kl): the log-ratio is first clamped to
  [-MAX_LOG_RATIO, MAX_LOG_RATIO] (so exp cannot overflow and gradients stay finite), then the
  value is clamped to [-c, c].
  """
  fn = KL_ESTIMATORS.get(kind)
  if clamp is None:
    return fn(logp, ref_logp)
  d = jnp.clip(ref_logp - logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  return jnp.clip(fn(-d, jnp.zeros_like(d)), -clamp, clamp)


# ------------------------------------------------------------------------------ sequences


class Rows:
  """The padded layout: sequence b is row b of a [B, T] token array."""

  def sums(self, x_bt: jax.Array) -> jax.Array:
    """Per-sequence sums [B]."""
    return x_bt.sum(-1)

  def spread(self, s_b: jax.Array) -> jax.Array:
    """A per-sequence value back at every token of its sequence (broadcastable to [B, T])."""
    return s_b[:, None]

  def per_sequence(self, lm_bt: jax.Array, m_bt: jax.Array):
    """(loss, mask) as the aggregations reduce them: [B, T] as they are."""
    return lm_bt, m_bt


ROWS = Rows()


@dataclasses.dataclass(frozen=True)
class Segments:
  """The packed layout: several sequences per row. ids [R, L] int: the index in [0, count) of
  each token's sequence (masked tokens may hold any index in range); count (static): the number
  of sequences, those with no token included (they still count in B, as an empty row does)."""

  ids: jax.Array
  count: int

  def sums(self, x_rl: jax.Array) -> jax.Array:
    """Per-sequence sums [count]."""
    return jax.ops.segment_sum(x_rl.reshape(-1), self.ids.reshape(-1), self.count)

  def spread(self, s_n: jax.Array) -> jax.Array:
    """A per-sequence value back at every token of its sequence [R, L]."""
    return s_n[self.ids]

  def per_sequence(self, lm_rl: jax.Array, m_rl: jax.Array):
    """(loss, mask) as the aggregations reduce them: [count, 1] sums per sequence. Every mode
    of LOSS_AGG_MODES is a function of these per-sequence sums and of B = count."""
    return self.sums(lm_rl)[:, None], self.sums(m_rl)[:, None]


# ----------------------------------------------------------------------- loss aggregation
# A mode registers its reduction together with its micro-batch weight, so exact gradient
# accumulation (rl/step.py) never meets a mode whose denominator it does not know how to split.


@dataclasses.dataclass(frozen=True)
class AggMode:
  """A loss aggregation mode, as LOSS_AGG_MODES stores it.

  reduce(lm_bt, m_bt, max_len) -> scalar: the masked [B, T] token loss to one number.
  weight(mask_bt, total_tokens, total_rows) -> scalar: a micro-batch's share of the
    batch-level denominator, so that sum over micro-batches of weight * reduce(micro) equals
    reduce(whole batch).
  """

  reduce: Callable
  weight: Callable


def register_agg_mode(*names: str, weight: Callable):
  """Decorator: registers a reduction under `names` with its (required) micro-batch weight."""
  if not callable(weight):
    raise TypeError(
        f"loss aggregation mode {', '.join(names)}: weight must be a function "
        "(mask_bt, total_tokens, total_rows) -> scalar, e.g. losses.row_share"
    )

  def deco(reduce):
    LOSS_AGG_MODES.register(*names)(AggMode(reduce, weight))
    return reduce

  return deco


def _agg_mode(name: str) -> AggMode:
  mode = LOSS_AGG_MODES.get(name)
  if not isinstance(mode, AggMode):
    raise TypeError(
        f"loss aggregation mode '{name}' was registered without a micro-batch "
        "weight: register it with losses.register_agg_mode(name, weight=...)"
    )
  return mode


def token_share(mask_bt, total_tokens, total_rows):
  """Denominator = the batch's token count: a micro-batch holds its tokens' share."""
  del total_rows
  return mask_bt.sum() / jnp.maximum(total_tokens, 1.0)


def row_share(mask_bt, total_tokens, total_rows):
  """Denominator = the batch's row count B (or B * L, L fixed): a micro-batch of b rows has
  b / B of it."""
  del total_tokens
  return mask_bt.shape[0] / total_rows


@register_agg_mode("token-mean", weight=token_share)
def _token_mean(lm, m, max_len):
  del max_len
  return lm.sum() / jnp.maximum(m.sum(), 1)


@register_agg_mode("seq-mean-token-mean", weight=row_share)
def _seq_mean_token_mean(lm, m, max_len):
  del max_len
  return (lm.sum(-1) / jnp.maximum(m.sum(-1), 1)).mean()


@register_agg_mode("seq-mean-token-sum", weight=row_share)
def _seq_mean_token_sum(lm, m, max_len):
  del m, max_len
  return lm.sum(-1).mean()


# sum(l*m) / (B*L): a micro-batch of b rows computes sum_mb / (b*L), so its weight is b / B.
@register_agg_mode("seq-mean-token-sum-norm", weight=row_share)
def _seq_mean_token_sum_norm(lm, m, max_len):
  del m
  if max_len is None:
    raise ValueError(
        "loss_agg_mode 'seq-mean-token-sum-norm' (Dr.GRPO) divides by the "
        "configured max completion length: pass max_completion_length"
    )
  return lm.sum() / (lm.shape[0] * max_len)


def aggregate(
    loss_bt: jax.Array,
    mask_bt: jax.Array,
    mode: str = "seq-mean-token-mean",
    max_completion_length: int | None = None,
    seqs: Rows | Segments = ROWS,
) -> jax.Array:
  """Reduces a [B, T] token loss to a scalar (docs/design.md's definitions).

  token-mean               sum(l*m) / sum(m)
  seq-mean-token-mean      mean_b( sum_t(l*m) / sum_t(m) )
  seq-mean-token-sum       mean_b( sum_t(l*m) )
  seq-mean-token-sum-norm  sum(l*m) / (B * L), L = max_completion_length (Dr.GRPO)
  Empty masks contribute 0 (a row with no tokens still counts in B for the seq-mean modes;
  an all-empty batch gives 0), never NaN. `seqs`: which tokens make each sequence (packed rows:
  `Segments`, B = its count).
  """
  m = mask_bt.astype(bool)
  lm = jnp.where(m, loss_bt, 0.0)
  lm, mf = seqs.per_sequence(lm, m.astype(jnp.float32))
  return _agg_mode(mode).reduce(lm, mf, max_completion_length)


def micro_batch_weight(
    mode: str,
    mask_bt: jax.Array,
    total_tokens: jax.Array,
    total_rows: int,
    seqs: Rows | Segments = ROWS,
) -> jax.Array:
  """This micro-batch's share of the batch-level aggregation's denominator.

  `mask_bt` [b, T] is the micro-batch's completion mask; `total_tokens` (sum of the whole
  batch's mask) and `total_rows` (its B) describe the whole batch. Summing
  `micro_batch_weight * aggregate(micro)` over a partition of the rows gives
  `aggregate(whole)`, so accumulated gradients do not depend on the micro-batch size. Packed
  rows (`seqs` a `Segments`): `total_rows` is the batch's sequence count N and so is
  `seqs.count` in every micro-batch (rl/packing.py: a micro-batch may hold any sequences; those
  it lacks sum to 0), so the seq-mean modes weigh each micro-batch 1 and divide by N.
  """
  m = mask_bt.astype(jnp.float32)
  w = _agg_mode(mode).weight(seqs.per_sequence(m, m)[1], total_tokens, total_rows)
  return jnp.asarray(w, jnp.float32)


# ------------------------------------------------------------------------- policy losses


def _clipped_surrogate(log_ratio, adv, eps_low, eps_high, clip_ratio_c):
  """-min(r*A, clip(r)*A), optionally dual-clipped; returns (token loss, ratio, diagnostics)."""
  ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
  pg1 = -adv * ratio
  pg2 = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  pg = jnp.maximum(pg1, pg2)
  clipped = pg2 > pg1  # the clipped branch binds (its gradient is 0)
  diag = {
      "clip_low": clipped & (ratio < 1.0 - eps_low),
      "clip_high": clipped & (ratio > 1.0 + eps_high),
  }
  if clip_ratio_c is not None:
    pg3 = -adv * clip_ratio_c
    dual = (adv < 0) & (pg3 < pg)
    pg = jnp.where(adv < 0, jnp.minimum(pg, pg3), pg)
    diag["dual_clip"] = dual
  return pg, ratio, diag


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(logp, old_logp, adv, mask, *, eps_low, eps_high, clip_ratio_c, seqs=ROWS):
  """PPO-clip (Schulman et al. 2017) on token ratios, as in GRPO (DeepSeekMath eq. 3), with
  DAPO's decoupled clip-higher (eps_high != eps_low, Yu et al. 2025) and optional dual-clip
  (Ye et al. 2020): for A < 0 the token loss is capped at -A * clip_ratio_c."""
  del mask, seqs
  return _clipped_surrogate(logp - old_logp, adv, eps_low, eps_high, clip_ratio_c)


@POLICY_LOSSES.register("gspo")
def gspo(logp, old_logp, adv, mask, *, eps_low, eps_high, clip_ratio_c, seqs=ROWS):
  """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", GSPO-token, eq. 13-14).

  The importance ratio is per sequence, s_i = exp(mean_t(logp - old)) over its tokens, used at
  every token as sg[s_i] * exp(logp - sg[logp]) so the value is s_i and the gradient is
  s_i * grad(logp) / |y_i| summed per sequence (with seq-mean-token-mean aggregation). It is
  clipped like PPO; GSPO uses much smaller ranges (e.g. eps_low 3e-4, eps_high 4e-4).
  """
  m = mask.astype(jnp.float32)
  seq_log_ratio = seqs.spread(
      seqs.sums(jnp.where(mask, logp - old_logp, 0)) / jnp.maximum(seqs.sums(m), 1)
  )
  token_log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logp - jax.lax.stop_gradient(logp)
  return _clipped_surrogate(token_log_ratio, adv, eps_low, eps_high, clip_ratio_c)


def tis_weights(trainer_logp: jax.Array, sampler_logp: jax.Array, cap: float) -> jax.Array:
  """Truncated importance sampling weights min(p_trainer / p_sampler, cap), no gradient.

  Corrects the mismatch between the rollout engine's and the trainer's token probabilities
  (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training").
  """
  log_w = jnp.clip(trainer_logp - sampler_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_w), cap))


def policy_loss(
    logp,
    old_logp,
    ref_logp,
    advantages,
    mask,
    *,
    clip_eps,
    clip_eps_high=None,
    beta,
    kl_kind="k3",
    loss_agg_mode="seq-mean-token-mean",
    max_completion_length=None,
    policy_loss_kind="ppo_clip",
    clip_ratio_c=None,
    kl_clamp=None,
    tis_weights=None,
    seqs: Rows | Segments = ROWS,
):
  """The GRPO objective on one batch: aggregate(PG token loss * TIS + beta * KL). -> (loss, metrics)

  `ref_logp` may be None when beta == 0 (no KL term). `tis_weights` [B, T] (see `tis_weights`)
  multiply the policy-gradient part only. Metrics (scalars): pg_loss (aggregated like the
  loss), kl (masked token mean), clip_frac / clip_frac_low / clip_frac_high (fraction of tokens
  whose clipped branch binds, split by side), dual_clip_frac, ppo_kl (masked mean of
  old - logp, an estimate of KL(old || new)), ratio_mean, ratio_max. `seqs`: which tokens make
  each sequence (`ROWS`: the rows; packed rows: `Segments`).
  """
  m = mask.astype(bool)
  logp = jnp.where(m, logp, 0.0)
  old_logp = jnp.where(m, old_logp, 0.0)
  adv = advantages[:, None] if advantages.ndim == 1 else advantages
  adv = jnp.where(m, jnp.broadcast_to(adv, m.shape), 0.0)
  eps_high = clip_eps if clip_eps_high is None else clip_eps_high

  pg_fn = POLICY_LOSSES.get(policy_loss_kind)
  pg_bt, ratio_bt, diag = pg_fn(
      logp,
      old_logp,
      adv,
      m,
      eps_low=clip_eps,
      eps_high=eps_high,
      clip_ratio_c=clip_ratio_c,
      seqs=seqs,
  )
  if tis_weights is not None:
    pg_bt = pg_bt * jnp.where(m, tis_weights, 0.0)
  loss_bt = pg_bt
  if beta != 0 or ref_logp is not None:
    if ref_logp is None:
      raise ValueError("beta != 0 needs ref_logp (log-probs under the reference model)")
    kl_bt = token_kl(logp, jnp.where(m, ref_logp, 0.0), kl_kind, kl_clamp)
    loss_bt = loss_bt + beta * kl_bt
    kl = masked_mean(kl_bt, m)
  else:
    kl = jnp.zeros((), jnp.float32)

  loss = aggregate(loss_bt, m, loss_agg_mode, max_completion_length, seqs)
  metrics = {
      "pg_loss": aggregate(pg_bt, m, loss_agg_mode, max_completion_length, seqs),
      "kl": kl,
      "clip_frac_low": masked_mean(diag["clip_low"], m),
      "clip_frac_high": masked_mean(diag["clip_high"], m),
      "ppo_kl": masked_mean(old_logp - logp, m),
      "ratio_mean": masked_mean(ratio_bt, m),
      "ratio_max": jnp.where(m, ratio_bt, 0.0).max(initial=0.0),
  }
  metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
  if "dual_clip" in diag:
    metrics["dual_clip_frac"] = masked_mean(diag["dual_clip"], m)
  return loss, metrics
