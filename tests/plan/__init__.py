"""Tests of grpo_jax/plan/."""
