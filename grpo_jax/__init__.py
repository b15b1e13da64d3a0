"""grpo_jax: GRPO for language models in pure JAX / Flax NNX."""

__version__ = "0.1.0"
