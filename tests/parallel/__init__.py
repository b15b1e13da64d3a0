"""Tests of grpo_jax/parallel/."""
