"""Tests of grpo_jax/rewards/."""
