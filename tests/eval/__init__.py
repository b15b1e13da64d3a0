"""Tests of grpo_jax/eval/."""
