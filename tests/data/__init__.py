"""Tests of grpo_jax/data/, and the small data files other tests read (gsm8k_sample/, reward
plug-ins such as digit_count_reward.py)."""
