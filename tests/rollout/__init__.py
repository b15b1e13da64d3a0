"""Tests of grpo_jax/rollout/."""
