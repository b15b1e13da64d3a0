"""Evaluation by task: each row scored by its data_source, pass@k, and the loop's eval output."""

import itertools
import json

import numpy as np
import pytest

from grpo_jax.eval import tasks as eval_tasks
from grpo_jax import train
from grpo_jax.rewards import eval_flags
from tests.test_train import tiny_config


def test_pass_at_k_matches_brute_force_enumeration():
  for n in range(1, 8):
    for c in range(n + 1):
      samples = [1] * c + [0] * (n - c)
      for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert eval_tasks.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)
  with pytest.raises(ValueError, match="pass@5 needs at least 5 samples"):
    eval_tasks.pass_at_k(4, 1, 5)
  assert eval_tasks.default_ks(8) == (1, 2, 4, 8) and eval_tasks.default_ks(6) == (1, 2, 4, 6)


def test_rouge_on_known_strings():
  rows = [{"ground_truth": "the cat is on the mat", "data_source": "summarization"}] * 2
  scores = eval_tasks.TASKS["summarization"].score(
      ["the cat sat on the mat", "the cat is on the mat"], rows
  )
  # Unigrams: 5 of 6 shared; bigrams: the-cat, on-the, the-mat of 5; LCS "the cat on the mat".
  np.testing.assert_allclose(scores["rouge1"], [5 / 6, 1.0], atol=1e-6)
  np.testing.assert_allclose(scores["rouge2"], [3 / 5, 1.0], atol=1e-6)
  np.testing.assert_allclose(scores["rougeL"], [5 / 6, 1.0], atol=1e-6)


def test_think_format_is_recognized_like_reasoning():
  for text in (
      "<think>\n6*7\n</think>\n<answer>\n42\n</answer>\n",
      "<reasoning>6*7</reasoning><answer>42</answer>",
      "<answer>42</answer>",
  ):
    assert eval_flags(text, "42") == (True, True, True), text
  assert eval_flags("<think>6*7</think> so 42 <answer>41</answer> ok", "42") == (False, True, False)


def test_rows_are_scored_by_their_data_source():
  assert eval_tasks.task_of("gsm8k").name == "math"
  assert eval_tasks.task_of("openai/gsm8k").name == "math"
  assert eval_tasks.task_of("arithmetic").name == "math"
  assert eval_tasks.task_of("xsum").name == "summarization"
  assert eval_tasks.task_of("code_generation").name == "code"
  assert eval_tasks.task_of("sst2_classification").name == "exact_match"
  rows = [
      {"ground_truth": "42", "data_source": "gsm8k"},
      {"ground_truth": ["Paris", "paris, france"], "data_source": "qa"},
      {"ground_truth": "the cat is on the mat", "data_source": "summarization"},
  ]
  tally = eval_tasks.Tally(())
  tally.add(
      ["<answer>42</answer>", "<answer> Paris,  France </answer>", "the cat is on the mat"], rows, 1
  )
  r = tally.results()
  assert r["math/accuracy"] == 1.0 and r["exact_match/accuracy"] == 1.0
  assert r["summarization/rouge1"] == pytest.approx(1.0) and r["num_examples"] == 3
  # One task only: plain metric names; the per-process sums add up to the whole.
  a, b = eval_tasks.Tally((1, 2)), eval_tasks.Tally((1, 2))
  qa = {"ground_truth": "yes", "data_source": "qa"}
  a.add(["yes", "no"], [qa, qa], 2)
  b.add(["no", "no", "yes", "yes"], [qa] * 4, 2)
  whole = eval_tasks.Tally((1, 2))
  whole.add(["yes", "no", "no", "no", "yes", "yes"], [qa] * 6, 2)
  assert a.results(a.sums + b.sums) == whole.results()
  assert whole.results() == {
      "accuracy": 0.5,
      "pass@1": 0.5,
      "pass@2": pytest.approx(2 / 3),
      "num_examples": 3,
  }


def test_code_rows_report_pass_rate():
  rows = [{"ground_truth": ["assert f(2) == 4", "assert f(3) == 9"], "data_source": "code"}] * 2
  s = eval_tasks.TASKS["code"].score(
      ["```python\ndef f(x):\n  return x * x\n```", "def f(x):\n  return 2 * x"], rows
  )
  np.testing.assert_allclose(s["pass_rate"], [1.0, 0.5])
  np.testing.assert_allclose(s["accuracy"], [1.0, 0.0])


def test_loop_writes_pass_at_k_and_the_plain_greedy_names(tmp_path):
  workdir = tmp_path / "passk"
  summary = train.run(
      tiny_config(
          num_steps=1, **{"eval.num_samples": 4, "eval.generation_configs": ("greedy", "standard")}
      ),
      str(workdir),
  )
  after = summary["eval_after"]
  assert set(after["greedy"]) == {"accuracy", "partial_accuracy", "format_accuracy", "num_examples"}
  std = after["standard"]
  assert {"pass@1", "pass@2", "pass@4"} <= set(std) and std["num_examples"] == 16
  assert std["pass@1"] == pytest.approx(std["accuracy"])  # pass@1 is the per-sample mean
  assert std["pass@1"] <= std["pass@2"] <= std["pass@4"]
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in rows if "eval/accuracy/greedy" in r]
  assert evals and all(
      r["eval/accuracy"] == r["eval/accuracy/greedy"]
      and "eval/partial_accuracy" in r
      and "eval/format_accuracy" in r
      and "eval/pass@4/standard" in r
      for r in evals
  )
