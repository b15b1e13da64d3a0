"""verl-style scoring: `compute_score(data_source, solution_str, ground_truth, extra_info)`.

`default_compute_score` dispatches on the row's data_source:
  math, gsm8k, arithmetic, math_* : 1.0 when the final answer equals the ground truth as a
                                    number (the <answer> tag if present, else the last number)
  qa, trivia, triviaqa, nq, ...   : 1.0 on normalized exact match (lowercase, no punctuation or
                                    articles, collapsed spaces) with the ground truth or any of
                                    a list of acceptable answers
  classification, label           : 1.0 when the predicted label (the <answer> tag, else the
                                    whole completion) equals the ground-truth label, normalized
  summarization, xsum, cnn_dm     : ROUGE-L F1 of the completion vs the reference summary
  code, code_generation           : fraction of the test statements (ground_truth, or
                                    extra_info["tests"]) the program passes, sandboxed (code.py)
A user file defining the same function (verl's interface) plugs in with
`--config.reward.custom_file=path.py` (see `load_custom_file`); a TRL-style batch function in
it, `fn(prompts, completions, **columns)`, with `--config.reward.custom_function=fn`.
data_source names with an organization ("openai/gsm8k", as verl's preprocessing writes them)
are matched by their last part too.
"""

import importlib.util
import re
import string

from grpo_jax.run import paths
from grpo_jax.rewards import code as code_lib
from grpo_jax.rewards import parsing
from grpo_jax.rewards import rouge


def normalize_text(s: str) -> str:
  """SQuAD-style normalization: lowercase, drop punctuation and articles, collapse spaces."""
  s = s.lower()
  s = "".join(ch for ch in s if ch not in set(string.punctuation))
  s = re.sub(r"\b(a|an|the)\b", " ", s)
  return " ".join(s.split())


def _final_answer(solution: str) -> str:
  tagged = parsing.answer_tag(solution)
  return tagged if tagged is not None else solution


def math_score(solution: str, ground_truth) -> float:
  tagged = parsing.answer_tag(solution)
  if tagged is not None:
    guess = parsing.parse_number(tagged)
  else:
    nums = parsing.NUMBER_RE.findall(solution)
    guess = parsing.parse_number(nums[-1]) if nums else None
  return 1.0 if parsing.numbers_equal(guess, parsing.parse_number(str(ground_truth))) else 0.0


def qa_score(solution: str, ground_truth) -> float:
  answers = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
  guess = normalize_text(_final_answer(solution))
  return 1.0 if any(guess == normalize_text(str(a)) for a in answers) else 0.0


def classification_score(solution: str, ground_truth) -> float:
  return (
      1.0 if normalize_text(_final_answer(solution)) == normalize_text(str(ground_truth)) else 0.0
  )


def summarization_score(solution: str, ground_truth) -> float:
  return rouge.rouge_scores(_final_answer(solution), str(ground_truth))["rougeL"]


_HANDLERS = [
    (("math", "gsm8k", "arithmetic", "math_", "numina", "aime", "amc"), math_score),
    (("qa", "trivia", "triviaqa", "nq", "hotpotqa", "squad"), qa_score),
    (("classification", "label", "sentiment"), classification_score),
    (("summarization", "xsum", "cnn_dm", "cnn_dailymail"), summarization_score),
]


def default_compute_score(
    data_source: str, solution_str: str, ground_truth, extra_info=None
) -> float:
  if (data_source or "").lower() in code_lib.DATA_SOURCES:  # tests may be in extra_info
    return code_lib.compute_score(data_source, solution_str, ground_truth, extra_info)
  del extra_info
  full = (data_source or "").lower()
  for ds in dict.fromkeys((full, full.rsplit("/", 1)[-1])):  # "openai/gsm8k" is gsm8k
    for names, fn in _HANDLERS:
      if any(ds == n or (n.endswith("_") and ds.startswith(n)) for n in names):
        return fn(solution_str, ground_truth)
  raise ValueError(
      f"no built-in scorer for data_source '{data_source}'; built-in: "
      f"{', '.join(n for names, _ in _HANDLERS for n in names)}. Fix: give rows a "
      "known data_source or set reward.custom_file to your compute_score"
  )


def load_custom_file(path: str, name: str = ""):
  """compute_score from a user .py file (verl's interface), or the function `name` (a
  TRL-style batch function), with clear errors."""
  if not paths.exists(path):
    raise FileNotFoundError(f"reward.custom_file={path!r} does not exist")
  spec = importlib.util.spec_from_file_location(
      f"grpo_user_reward_{abs(hash(path))}", paths.local_copy(path, ".py")
  )
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:
    raise RuntimeError(f"{path}: importing the reward file failed: {type(e).__name__}: {e}") from e
  if name:
    fn = getattr(module, name, None)
    if not callable(fn):
      found = sorted(
          k
          for k, v in vars(module).items()
          if callable(v)
          and not k.startswith("_")
          and getattr(v, "__module__", None) == module.__name__
      )
      raise AttributeError(
          f"{path} defines no function {name!r} (reward.custom_function); it " f"defines {found}"
      )
    return fn
  fn = getattr(module, "compute_score", None)
  if not callable(fn):
    raise AttributeError(
        f"{path} must define compute_score(data_source, solution_str, "
        "ground_truth, extra_info=None) -> float"
    )
  return fn


def as_trl_reward_fn(fn):
  """A TRL-style reward function `fn(prompts, completions, **kwargs) -> list[float]` as TRL's
  GRPOTrainer calls it: keywords prompts= and completions= (the rendered prompt texts and the
  completion texts), plus ground_truth, data_source, extra_info and every column of a parquet /
  hf_dataset row (rewards/computer.py row_fields), one list entry per completion."""

  def reward(prompts, completions, **fields):
    return fn(prompts=prompts, completions=completions, **fields)

  return reward


def as_reward_fn(compute_score):
  """Adapts a verl compute_score to the batch reward interface."""

  def reward(prompts, completions, ground_truth, data_source, extra_info=None, **_):
    del prompts
    extra_info = extra_info or [None] * len(completions)
    # Keywords, as verl's reward managers call it: a user's function may order them its way.
    return [
        compute_score(data_source=ds, solution_str=c, ground_truth=gt, extra_info=ei)
        for c, gt, ds, ei in zip(completions, ground_truth, data_source, extra_info)
    ]

  return reward
