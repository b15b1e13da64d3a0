"""Rollout engines behind one interface (`make_engine`): the native jitted sampler, and vLLM
(grpo_jax.rollout.vllm_engine, optional)."""

from grpo_jax.rollout.engine import ENGINES
from grpo_jax.rollout.engine import NativeEngine
from grpo_jax.rollout.engine import make_engine
from grpo_jax.rollout.sampler import Sampler
from grpo_jax.rollout.sampler import sample
from grpo_jax.rollout.types import GENERATION_CONFIGS
from grpo_jax.rollout.types import GenerationConfig
from grpo_jax.rollout.types import Rollout
from grpo_jax.rollout.types import generation_config
