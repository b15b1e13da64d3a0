"""Tests of grpo_jax/run/."""
