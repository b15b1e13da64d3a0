"""How an eval row is scored: by its `data_source`, the task's own metrics, and pass@k.

  math            gsm8k, arithmetic, math (and sources naming them, e.g. "openai/gsm8k"):
                  accuracy (the <answer> holds the number), partial_accuracy (within 10%),
                  format_accuracy (<reasoning>/<answer> or <think>/<answer>, or a lone answer tag)
  summarization   summarization, xsum, cnn_dailymail: rouge1, rouge2, rougeL (F1)
  code            code, code_generation: pass_rate (fraction of the row's tests passed),
                  accuracy (all of them)
  exact_match     anything else (classification, qa, ...): accuracy, the answer (the <answer>
                  tag's text if there is one, else the completion) equal to the ground truth
                  (or one of a list) after lower-casing and collapsing whitespace

`TASKS[name].score(completions, rows) -> {metric: [per-row floats]}`; `correct` names the
metric that makes a sample count as solved for pass@k (None: no pass@k, e.g. ROUGE).
"""

import dataclasses
import math
import re
from typing import Callable

import numpy as np

from grpo_jax.rewards import eval_flags
from grpo_jax.rewards import parsing


@dataclasses.dataclass(frozen=True)
class Task:
  name: str
  metrics: tuple[str, ...]
  primary: str  # the headline figure (logs, SFT early stopping)
  correct: str | None  # per-sample 0/1 metric pass@k counts; None: no pass@k
  score: Callable  # (completions, rows) -> {metric: list[float]}


def _math(completions, rows):
  flags = np.array(
      [eval_flags(c, r["ground_truth"]) for c, r in zip(completions, rows)], np.float64
  ).reshape(-1, 3)
  return dict(zip(("accuracy", "partial_accuracy", "format_accuracy"), flags.T))


def _summarization(completions, rows):
  from grpo_jax.rewards.rouge import rouge_scores

  scores = [rouge_scores(c, str(r["ground_truth"])) for c, r in zip(completions, rows)]
  return {k: [s[k] for s in scores] for k in ("rouge1", "rouge2", "rougeL")}


def _code(completions, rows):
  from grpo_jax.rewards import code

  rates = np.asarray(
      code.code_tests(
          None, completions, [r["ground_truth"] for r in rows], [r.get("extra_info") for r in rows]
      ),
      np.float64,
  )
  return {"pass_rate": rates, "accuracy": (rates >= 1.0).astype(np.float64)}


def _normalize(text: str) -> str:
  return re.sub(r"\s+", " ", str(text)).strip().lower()


def _exact_match(completions, rows):
  out = []
  for c, r in zip(completions, rows):
    tagged = parsing.answer_tag(c)
    guess = _normalize(tagged if tagged is not None else c)
    truths = r["ground_truth"] if isinstance(r["ground_truth"], list) else [r["ground_truth"]]
    out.append(float(any(guess == _normalize(t) for t in truths)))
  return {"accuracy": out}


TASKS = {
    t.name: t
    for t in (
        Task(
            "math",
            ("accuracy", "partial_accuracy", "format_accuracy"),
            "accuracy",
            "accuracy",
            _math,
        ),
        Task("summarization", ("rouge1", "rouge2", "rougeL"), "rougeL", None, _summarization),
        Task("code", ("pass_rate", "accuracy"), "accuracy", "accuracy", _code),
        Task("exact_match", ("accuracy",), "accuracy", "accuracy", _exact_match),
    )
}
_SOURCES = {
    "gsm8k": "math",
    "arithmetic": "math",
    "math": "math",
    "summarization": "summarization",
    "xsum": "summarization",
    "cnn_dailymail": "summarization",
    "code": "code",
    "code_generation": "code",
}


def task_of(data_source: str) -> Task:
  """The task a data_source is scored as: its name or last path part ("openai/gsm8k")."""
  s = str(data_source or "").lower()
  name = _SOURCES.get(s) or _SOURCES.get(s.rsplit("/", 1)[-1])
  if name is None:
    name = next((t for key, t in _SOURCES.items() if key in s and t == "math"), "exact_match")
  return TASKS[name]


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1):
  1 - C(n - c, k) / C(n, k), as a product so large n stays exact in floats."""
  if k > n:
    raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
  if n - c < k:
    return 1.0
  return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def default_ks(n: int) -> tuple[int, ...]:
  """1, 2, 4, ... up to n, and n itself."""
  return tuple(sorted({1, n} | {2**i for i in range(n.bit_length()) if 2**i <= n}))


class Tally:
  """Sums of per-row metrics (and pass@k per prompt) per task, in a fixed-length vector so
  processes can add theirs up (`vector`, `from_vector`) before `results` divides."""

  def __init__(self, ks: tuple[int, ...]):
    self.ks = tuple(ks)
    self._layout = []  # (task, key) in a fixed order: metrics, pass@k, then the two counts
    for t in TASKS.values():
      keys = [*t.metrics, *(f"pass@{k}" for k in self.ks if t.correct), "_rows", "_prompts"]
      self._layout += [(t.name, key) for key in keys]
    self.sums = np.zeros(len(self._layout), np.float64)
    self._index = {key: i for i, key in enumerate(self._layout)}

  def add(self, completions, rows, samples_per_prompt: int):
    """Scores a batch: rows[i] is the row of completions[i]; each prompt's samples adjacent."""
    by_task = {}
    for i, r in enumerate(rows):
      by_task.setdefault(task_of(r.get("data_source")).name, []).append(i)
    n = samples_per_prompt
    for name, idx in by_task.items():
      t = TASKS[name]
      scores = t.score([completions[i] for i in idx], [rows[i] for i in idx])
      for metric, values in scores.items():
        self.sums[self._index[name, metric]] += float(np.sum(values))
      self.sums[self._index[name, "_rows"]] += len(idx)
      self.sums[self._index[name, "_prompts"]] += len(idx) / n
      if t.correct:
        solved = np.asarray(scores[t.correct]).reshape(-1, n).sum(-1)  # per prompt
        for k in self.ks:
          self.sums[self._index[name, f"pass@{k}"]] += sum(pass_at_k(n, int(c), k) for c in solved)

  def results(self, sums=None) -> dict[str, float]:
    """{metric: mean}; with rows of several tasks the names are "<task>/<metric>"."""
    sums = self.sums if sums is None else sums
    present = [t for t in TASKS.values() if sums[self._index[t.name, "_rows"]] > 0]
    out = {}
    for t in present:
      rows, prompts = (sums[self._index[t.name, key]] for key in ("_rows", "_prompts"))
      prefix = f"{t.name}/" if len(present) > 1 else ""
      for metric in t.metrics:
        out[prefix + metric] = float(sums[self._index[t.name, metric]] / rows)
      for k in (self.ks if t.correct else ()):
        out[f"{prefix}pass@{k}"] = float(sums[self._index[t.name, f"pass@{k}"]] / prompts)
    out["num_examples"] = int(round(sum(sums[self._index[t.name, "_prompts"]] for t in present)))
    return out


def primary_metric(results: dict) -> tuple[str, float]:
  """The headline (name, value) of one generation config's results."""
  for t in TASKS.values():
    if t.primary in results:
      return t.primary, results[t.primary]
  name = next(k for k in results if k != "num_examples")
  return name, results[name]
