"""Rewards for the `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>\\n` format family.

The reward set of the torchrun GRPO seed (reward_func.py): a correctness reward, a digit
reward, a strict format reward and a per-tag partial-credit reward. Same interface as every
reward: `fn(prompts, completions, **row_fields) -> list[float]`.
"""

import re

from grpo_jax.rewards import parsing

_HARD_FORMAT = re.compile(r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>\n?", re.DOTALL)


def _answer(completion: str) -> str:
  a = parsing.answer_tag(completion)
  return "" if a is None else a.strip()


def correctness_reward(prompts, completions, ground_truth, **_) -> list[float]:
  """+2.0 when the stripped <answer> text equals the ground truth (as a string, or as a number
  up to formatting such as "1,000" vs "1000"), else 0.0."""
  del prompts
  out = []
  for c, t in zip(completions, ground_truth):
    a, t = _answer(c), str(t).strip()
    same = a == t or parsing.numbers_equal(
        parsing.parse_number(a) if a else None, parsing.parse_number(t)
    )
    out.append(2.0 if a and same else 0.0)
  return out


def digit_reward(prompts, completions, **_) -> list[float]:
  """+0.5 when the stripped <answer> text is a non-negative integer written in ASCII digits
  only (e.g. "42"), else 0.0: it rewards giving a bare number."""
  del prompts
  return [0.5 if re.fullmatch(r"[0-9]+", _answer(c)) else 0.0 for c in completions]


def hard_format_reward(prompts, completions, **_) -> list[float]:
  """+0.5 when the whole completion is exactly
  `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>` (a final newline optional), else 0.0."""
  del prompts
  return [0.5 if _HARD_FORMAT.fullmatch(c) else 0.0 for c in completions]


def mark_reward(prompts, completions, **_) -> list[float]:
  """Partial format credit: +0.125 for each of "<think>\\n", "\\n</think>\\n", "\\n<answer>\\n",
  "\\n</answer>" that occurs exactly once (range [0, 0.5])."""
  del prompts
  marks = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
  return [sum(0.125 for m in marks if c.count(m) == 1) for c in completions]
