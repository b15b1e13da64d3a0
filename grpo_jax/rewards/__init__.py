"""Rewards: GSM8K / <think> format families, verl-style compute_score plug-ins, ROUGE.

Every reward function maps (prompts, completions, **row_fields) to one float per completion.
`build_reward_computer` combines named functions with weights (see computer.py); `from_config`
builds it from config.reward.
"""

from grpo_jax.rewards.computer import RewardComputer
from grpo_jax.rewards.computer import RewardError
from grpo_jax.rewards.computer import RewardResult
from grpo_jax.rewards.computer import build_reward_computer
from grpo_jax.rewards.computer import from_config
from grpo_jax.rewards.gsm8k import eval_flags
from grpo_jax.rewards.registry import names
