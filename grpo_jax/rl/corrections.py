"""Off-policy corrections: per-token weights from the trainer's and the sampler's log-probs.

When the tokens were drawn by another policy than the one the trainer scores them with (a
rollout engine's numerics, or stale weights: streaming generation, weights changing under a
row), the policy-gradient token loss is multiplied by a weight built from the log-ratio
`log_r = logp - old` of the trainer's log-probs `logp` [B, T] (the proximal policy: the
update's old log-probs) over the sampler's `old` [B, T] (the behaviour policy). Every weight is
stop-gradient (it changes the measure, not the objective) and 0 where `mask == 0` or where the
variant rejects the token. `r = exp(clip(log_r, -MAX_LOG_RATIO, MAX_LOG_RATIO))`, the clamp
verl and SkyRL apply too (exp(+-20)); a sequence's log-ratio is clamped the same way.

  kind            weight at token t of sequence i
  tis             min(r_t, cap)                      token TIS, losses.tis_weights
  sequence_is     min(exp(sum_t log_r_t), cap)       one weight per sequence, at all its tokens
  icepop          r_t if low <= r_t <= high else 0   tokens outside the band are masked
  geometric_mask  1 if low <= exp(mean_t log_r_t) <= high else 0   whole sequences masked

With `cap > 0` the two masks keep token TIS on their kept tokens, `min(r_t, cap)` (verl:
rollout_is="token" with rollout_rs="token" / "geometric"); `tis` with `cap == 0` is no
correction at all (`active`). Which to use: docs/design.md. Sums and means per sequence go
through `seqs` (losses.ROWS, or packed rows' losses.Segments), so packing changes no weight.

    w_bt, metrics = correction_weights("icepop", logp_bt, sampler_bt, mask_bt,
                                       cap=0.0, low=0.5, high=5.0)
    loss, _ = losses.policy_loss(..., tis_weights=w_bt)
"""

import jax
import jax.numpy as jnp

from grpo_jax.rl import losses
from grpo_jax.rl.registry import OFFPOLICY_CORRECTIONS


def active(kind: str, cap: float) -> bool:
  """Whether `kind` weights the loss at all (and so needs the sampler's log-probs): every
  variant does, except `tis` with `cap == 0` (today's default: no correction)."""
  return kind != "tis" or cap > 0


def _ratio(log_r):
  return jnp.exp(jnp.clip(log_r, -losses.MAX_LOG_RATIO, losses.MAX_LOG_RATIO))


def _masked(w, mask):
  return jax.lax.stop_gradient(jnp.where(mask.astype(bool), w, 0.0))


def sequence_log_ratio(logp, old, mask, *, mean: bool = False, seqs=losses.ROWS):
  """sum_t m*(logp - old) per sequence (mean=True: divided by its token count, the log of the
  geometric-mean ratio), at every token of the sequence (broadcastable to [B, T]). Masked
  positions may hold anything, NaN included."""
  m = mask.astype(bool)
  s = seqs.sums(jnp.where(m, logp - old, 0.0))
  if mean:
    s = s / jnp.maximum(seqs.sums(m.astype(jnp.float32)), 1.0)
  return seqs.spread(s)


@OFFPOLICY_CORRECTIONS.register("tis")
def token_tis(logp, old, mask, *, cap, low, high, seqs=losses.ROWS):
  """Token TIS, min(r_t, cap) (losses.tis_weights: Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training"; verl rollout_is="token", OpenRLHF
  --vllm_is_correction_type tis, SkyRL tis_ratio_type="token")."""
  del low, high, seqs
  return _masked(losses.tis_weights(logp, old, cap), mask)


@OFFPOLICY_CORRECTIONS.register("sequence_is")
def sequence_is(logp, old, mask, *, cap, low, high, seqs=losses.ROWS):
  """Truncated sequence-level importance weight min(prod_t r_t, cap) = min(exp(sum_t log_r_t),
  cap), the same at every token of the sequence (verl rollout_is="sequence" with its
  rollout_is_threshold as the cap, SkyRL tis_ratio_type="sequence"). Unbiased up to the cap, but
  its variance grows with the length: verl suggests caps of 2-10."""
  del low, high
  return _masked(jnp.minimum(_ratio(sequence_log_ratio(logp, old, mask, seqs=seqs)), cap), mask)


@OFFPOLICY_CORRECTIONS.register("icepop")
def icepop(logp, old, mask, *, cap, low, high, seqs=losses.ROWS):
  """IcePop's token mask (Ling Team, Ring-1T report 2025): M(r_t) = r_t when low <= r_t <= high,
  else 0, so a kept token carries its ratio and a token the two policies disagree on leaves the
  gradient (IcePop's band [0.5, 5]; OpenRLHF --vllm_is_correction_type icepop with
  --vllm_is_truncated_threshold low high). With cap > 0 a kept token's weight is min(r_t, cap):
  verl's rollout_rs="token" mask with rollout_is="token" weights (SkyRL token_mask_is_threshold_*
  with tis_ratio_type="token")."""
  del seqs
  r = _ratio(jnp.where(mask.astype(bool), logp - old, 0.0))
  w = jnp.minimum(r, cap) if cap > 0 else r
  return _masked(jnp.where((r >= low) & (r <= high), w, 0.0), mask)


@OFFPOLICY_CORRECTIONS.register("geometric_mask")
def geometric_mask(logp, old, mask, *, cap, low, high, seqs=losses.ROWS):
  """Geometric sequence mask: a sequence whose geometric-mean ratio exp(mean_t log_r_t) lies
  outside [low, high] leaves the loss entirely, the others weigh 1 (verl rollout_rs="geometric"
  with rollout_is=None, its geo_rs preset; SkyRL sequence_mask_metric="geometric" with
  geo_mask_low / geo_mask_high). The mean does not grow with the length, so the band is tight:
  verl suggests an upper end of 1.0001-1.001. With cap > 0 kept tokens weigh min(r_t, cap)
  (verl rollout_is="token" with rollout_rs="geometric"; OpenRLHF's seq-mask-tis is this with
  the ratio untruncated)."""
  g = _ratio(sequence_log_ratio(logp, old, mask, mean=True, seqs=seqs))
  w = losses.tis_weights(logp, old, cap) if cap > 0 else jnp.ones(mask.shape, jnp.float32)
  return _masked(jnp.where((g >= low) & (g <= high), w, 0.0), mask)


def correction_weights(kind, logp, old, mask, *, cap, low, high, seqs=losses.ROWS):
  """The `kind` correction's weights [B, T] and its metrics, or (None, {}) when it is off
  (`active`). `logp` [B, T]: the trainer's log-probs; `old` [B, T]: the sampler's; `mask`
  [B, T]; `cap`, `low`, `high`: Python floats (module docstring).

  Metrics (scalars): correction_weight_mean (masked mean of the weights),
  correction_masked_frac (fraction of tokens rejected, weight 0), correction_masked_seq_frac
  (fraction of sequences with a token rejected, among those with a token), and with cap > 0
  correction_capped_frac (fraction of tokens whose weight sits at the cap)."""
  if not active(kind, cap):
    return None, {}
  w = OFFPOLICY_CORRECTIONS.get(kind)(logp, old, mask, cap=cap, low=low, high=high, seqs=seqs)
  m = mask.astype(bool)
  rejected = m & (w == 0)  # a weight is exp(>= -MAX_LOG_RATIO) > 0 unless masked or rejected
  has_tokens = seqs.sums(m.astype(jnp.float32)) > 0
  seq_rejected = has_tokens & (seqs.sums(rejected.astype(jnp.float32)) > 0)
  metrics = {
      "correction_weight_mean": losses.masked_mean(w, m),
      "correction_masked_frac": losses.masked_mean(rejected, m),
      "correction_masked_seq_frac": seq_rejected.sum() / jnp.maximum(has_tokens.sum(), 1),
  }
  if cap > 0:
    metrics["correction_capped_frac"] = losses.masked_mean(m & (w >= cap), m)
  return w, metrics
