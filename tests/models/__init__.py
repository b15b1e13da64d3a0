"""Tests of grpo_jax/models/."""
