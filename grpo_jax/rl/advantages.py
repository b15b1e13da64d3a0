"""Group-relative advantage estimators (pure jnp) and DAPO's group/length helpers.

Rewards arrive flat, group-major: `rewards` [B*G] where rows i*G .. i*G+G-1 are the G samples of
prompt i. Every estimator returns one advantage per row (broadcast over tokens by the loss).
Groups of size 1 and groups whose rewards are all equal get advantage 0, never NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.rl.registry import ADVANTAGE_ESTIMATORS

# std_kind -> delta degrees of freedom of the group std: population (divide by G) or sample
# (divide by G-1, torch.std's default, as TRL and verl use).
STD_KINDS = {"population": 0, "sample": 1}


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards_bg: jax.Array, *, eps: float = 1e-6, std_kind: str = "population"):
  """GRPO (Shao et al. 2024, DeepSeekMath, eq. 3 outcome supervision): (r - mean_g) / (std_g + eps).

  `std_kind="population"` uses the biased std (ddof=0, divide by G); `"sample"` the unbiased
  one (ddof=1, divide by G-1), as TRL and verl do via torch.std. A group of one has no spread:
  its std is defined as 0, and its advantage is 0.
  """
  if std_kind not in STD_KINDS:
    raise ValueError(f"unknown std_kind '{std_kind}'; known: {', '.join(STD_KINDS)}")
  g = rewards_bg.shape[-1]
  centred = rewards_bg - rewards_bg.mean(-1, keepdims=True)
  var = (centred**2).sum(-1, keepdims=True) / max(g - STD_KINDS[std_kind], 1)
  std = jnp.sqrt(var)
  # All-equal groups get exactly 0: their mean is not exact in floating point (0.1 * 8 / 8),
  # so r - mean is ~1e-9, and dividing that by (~1e-9 + eps) would give +-1e-3, not 0.
  equal = jnp.all(rewards_bg == rewards_bg[..., :1], axis=-1, keepdims=True)
  return jnp.where(equal | (std == 0), 0.0, centred / (std + eps))


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo(rewards_bg: jax.Array, *, eps: float = 1e-6, std_kind: str = "population"):
  """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 4): r - mean_g.

  Dropping the std removes GRPO's question-difficulty bias; `eps`/`std_kind` are unused.
  """
  del eps, std_kind
  return _centred(rewards_bg)


def _centred(rewards_bg):
  """r - mean_g, exactly 0 for all-equal groups (the float mean of equal values can be off)."""
  equal = jnp.all(rewards_bg == rewards_bg[..., :1], axis=-1, keepdims=True)
  return jnp.where(equal, 0.0, rewards_bg - rewards_bg.mean(-1, keepdims=True))


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards_bg: jax.Array, *, eps: float = 1e-6, std_kind: str = "population"):
  """RLOO (Ahmadian et al. 2024, "Back to Basics"): r_i - mean_{j != i} r_j.

  Equals G/(G-1) * (r_i - mean_g); a group of one has no other sample and gets 0.
  """
  del eps, std_kind
  g = rewards_bg.shape[-1]
  if g == 1:
    return jnp.zeros_like(rewards_bg)
  return _centred(rewards_bg) * (g / (g - 1))


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_kind: str = "population",
) -> jax.Array:
  """Advantages [B*G] (float32) for flat group-major rewards [B*G]; see the estimators above."""
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 1 or rewards.shape[0] % group_size:
    raise ValueError(
        f"rewards must be flat [B*G] with G={group_size} dividing its length; "
        f"got shape {rewards.shape}"
    )
  fn = ADVANTAGE_ESTIMATORS.get(estimator)
  adv_bg = fn(rewards.reshape(-1, group_size), eps=eps, std_kind=std_kind)
  return adv_bg.reshape(-1)


def advantage_metrics(rewards: jax.Array, advantages: jax.Array, group_size: int) -> dict:
  """Scalars for logging: advantage stats, within-group reward std, zero-std group fraction."""
  r_bg = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
  std_g = r_bg.std(-1)
  return {
      "advantages/mean": advantages.mean(),
      "advantages/std": advantages.std(),
      "advantages/min": advantages.min(),
      "advantages/max": advantages.max(),
      "reward/std_within_group": std_g.mean(),
      "reward/zero_std_group_fraction": (std_g == 0).mean(),
  }


def dynamic_sampling_mask(rewards: jax.Array, group_size: int) -> jax.Array:
  """DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): True for rows of groups whose rewards
  are not all equal (groups with zero variance carry no GRPO learning signal). [B*G] bool."""
  r_bg = jnp.asarray(rewards).reshape(-1, group_size)
  keep_b = jnp.any(r_bg != r_bg[:, :1], axis=-1)
  return jnp.repeat(keep_b, group_size)


def overlong_penalty(
    lengths: jax.Array, max_len: int, buffer_len: int, factor: float = 1.0
) -> jax.Array:
  """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward.

  min(-(len - (Lmax - Lbuf)) / Lbuf * factor, 0): 0 up to Lmax - Lbuf tokens, then linear down
  to -factor at len == Lmax. `buffer_len` = 0 disables it (returns zeros).
  """
  # Host lengths (numpy) give a host penalty: rewards are host values until they go to the
  # device with the batch, and the loop makes no transfer it does not mean to.
  xp = np if isinstance(lengths, np.ndarray) else jnp
  lengths = xp.asarray(lengths, xp.float32)
  if buffer_len <= 0:
    return xp.zeros_like(lengths)
  return xp.minimum(-(lengths - (max_len - buffer_len)) / buffer_len * factor, 0.0)
