"""GRPO math (pure jnp): advantages, KL estimators, policy losses, aggregation, off-policy
corrections, and the step."""

from grpo_jax.rl.advantages import advantage_metrics
from grpo_jax.rl.advantages import dynamic_sampling_mask
from grpo_jax.rl.advantages import group_advantages
from grpo_jax.rl.advantages import overlong_penalty
from grpo_jax.rl.corrections import correction_weights
from grpo_jax.rl.losses import aggregate
from grpo_jax.rl.losses import masked_mean
from grpo_jax.rl.losses import policy_loss
from grpo_jax.rl.losses import tis_weights
from grpo_jax.rl.losses import token_kl
from grpo_jax.rl.registry import ADVANTAGE_ESTIMATORS
from grpo_jax.rl.registry import KL_ESTIMATORS
from grpo_jax.rl.registry import LOSS_AGG_MODES
from grpo_jax.rl.registry import OFFPOLICY_CORRECTIONS
from grpo_jax.rl.registry import POLICY_LOSSES
