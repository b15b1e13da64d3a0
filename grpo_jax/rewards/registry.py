"""Named reward functions: what `config.reward.functions` may list.

Every entry has the interface `fn(prompts, completions, **row_fields) -> list[float]` with row
fields `ground_truth`, `data_source`, `extra_info` (lists aligned with completions). Add one
with `@register("name")`; the config validator lists `names()` in its messages.
"""

from typing import Callable

from grpo_jax.rewards import code as code_lib
from grpo_jax.rewards import gsm8k
from grpo_jax.rewards import rouge as rouge_lib
from grpo_jax.rewards import scoring
from grpo_jax.rewards import think

_REWARDS: dict[str, Callable] = {}

# The rewards that compare a completion's answer with the row's ground truth, and those of them
# that compare one number only: the start-up check of the ground truths (data/checks.py) asks
# whether a row's ground truth is something they can ever match.
NUMBER_REWARDS = ("answer_match", "check_numbers")
ANSWER_REWARDS = (*NUMBER_REWARDS, "check_answer", "correctness_reward", "verl_default")


def register(name: str):
  def deco(fn):
    if name in _REWARDS:
      raise ValueError(f"reward function '{name}' is already registered")
    _REWARDS[name] = fn
    return fn

  return deco


def get(name: str) -> Callable:
  if name not in _REWARDS:
    raise ValueError(f"unknown reward function '{name}'; known: {', '.join(names())}")
  return _REWARDS[name]


def names() -> tuple[str, ...]:
  return tuple(_REWARDS)


for _fn in (
    gsm8k.match_format_exactly,
    gsm8k.match_format_approximately,
    gsm8k.check_answer,
    gsm8k.check_numbers,
    gsm8k.answer_match,
    gsm8k.answer_format,
    think.correctness_reward,
    think.digit_reward,
    think.hard_format_reward,
    think.mark_reward,
    rouge_lib.rouge,
    rouge_lib.length_similarity,
):
  register(_fn.__name__)(_fn)
register("code_tests")(code_lib.code_tests)  # sandboxed execution of the row's tests (code.py)


@register("verl_default")
def verl_default(prompts, completions, ground_truth, data_source, extra_info=None, **_):
  """verl's default_compute_score per row, dispatched on its data_source (scoring.py)."""
  return scoring.as_reward_fn(scoring.default_compute_score)(
      prompts,
      completions,
      ground_truth=ground_truth,
      data_source=data_source,
      extra_info=extra_info,
  )
