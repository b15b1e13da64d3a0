"""Tests of grpo_jax/rl/."""
