"""Rewards: table-driven values on hand-written completions and real GSM8K rows, plug-ins,
bad reward functions, ROUGE, and the process pool's timeout."""

import os

import numpy as np
import pytest

from tests.conftest import SHARED_DATA
from grpo_jax import rewards
from grpo_jax.data import read_gsm8k
from grpo_jax.rewards import gsm8k
from grpo_jax.rewards import parsing
from grpo_jax.rewards import rouge
from grpo_jax.rewards import scoring
from grpo_jax.rewards import think

GSM8K_TEST = os.path.join(SHARED_DATA, "gsm8k", "test.jsonl")
HUGE = "<reasoning>" + "blah " * 20000 + "</reasoning><answer>72</answer>"

# (completion, ground truth, match_format_exactly, match_format_approximately, check_answer,
#  check_numbers)
GSM8K_TABLE = [
    ("<reasoning>48/2=24, 48+24=72</reasoning><answer>72</answer>", "72", 3.0, 2.0, 3.0, 1.5),
    ("  <reasoning>r</reasoning>\n<answer>72</answer>\n", "72", 3.0, 2.0, 3.0, 1.5),
    ("<reasoning>r</reasoning><answer> 72 </answer>", "72", 3.0, 2.0, 1.5, 1.5),
    ("<reasoning>r</reasoning><answer>72.0</answer>", "72", 3.0, 2.0, 1.5, 1.5),
    ("<reasoning>r</reasoning><answer>$1,234</answer>", "1234", 3.0, 2.0, 1.5, 1.5),
    ("<reasoning>r</reasoning><answer>-3</answer>", "-3", 3.0, 2.0, 3.0, 1.5),
    ("<reasoning>r</reasoning><answer>75</answer>", "72", 3.0, 2.0, 0.5, 0.0),  # within 10%
    ("<reasoning>r</reasoning><answer>84</answer>", "72", 3.0, 2.0, 0.25, 0.0),  # within 20%
    ("<reasoning>r</reasoning><answer>100</answer>", "72", 3.0, 2.0, -1.0, 0.0),
    ("<reasoning>r</reasoning><answer>seventy-two</answer>", "72", 3.0, 2.0, -0.5, 0.0),
    ("<reasoning>r</reasoning><answer>72 apples, not 5</answer>", "72", 3.0, 2.0, -0.5, 1.5),
    ("The answer is 72.", "72", 0.0, -2.0, 0.0, 0.0),  # no tags at all
    ("<answer>72</answer>", "72", 0.0, 0.0, 0.0, 1.5),  # answer only: not the full format
    ("<reasoning>r</reasoning><answer>72</answer> trailing text", "72", 0.0, 2.0, 0.0, 1.5),
    (
        "<reasoning>a</reasoning><reasoning>b</reasoning><answer>72</answer>",
        "72",
        3.0,
        0.0,
        3.0,
        1.5,
    ),  # two tags once (+1), two repeated (-1)
    # Tunix's regex (lazy groups, fullmatch) spans both answers: "72</answer><answer>5" does
    # not parse as one number (-0.5); check_numbers reads the last answer tag ("5").
    ("<reasoning>r</reasoning><answer>72</answer><answer>5</answer>", "72", 3.0, 0.0, -0.5, 0.0),
    ("", "72", 0.0, -2.0, 0.0, 0.0),
    ("<reasoning>你好 ünïcode ½</reasoning><answer>７２</answer>", "72", 3.0, 2.0, 1.5, 1.5),
    ("<reasoning>r</reasoning><answer>0</answer>", "0", 3.0, 2.0, 3.0, 1.5),
    ("<reasoning>r</reasoning><answer>1</answer>", "0", 3.0, 2.0, -1.0, 0.0),
    (HUGE, "72", 3.0, 2.0, 3.0, 1.5),
]


@pytest.mark.parametrize("row", GSM8K_TABLE, ids=[repr(r[0][:40]) for r in GSM8K_TABLE])
def test_gsm8k_rewards_table(row):
  completion, truth, exact, approx, answer, numbers = row
  kw = dict(prompts=["q"], completions=[completion], ground_truth=[truth])
  got = (
      gsm8k.match_format_exactly(**kw)[0],
      gsm8k.match_format_approximately(**kw)[0],
      gsm8k.check_answer(**kw)[0],
      gsm8k.check_numbers(**kw)[0],
  )
  assert got == (exact, approx, answer, numbers)


def test_gsm8k_rewards_on_real_rows():
  if not os.path.exists(GSM8K_TEST):
    pytest.skip(f"{GSM8K_TEST} not present")
  rows = read_gsm8k(GSM8K_TEST)
  assert len(rows) == 1319
  for row in rows[:300]:
    truth = row["ground_truth"]
    assert parsing.parse_number(truth) is not None, truth
    good = row["demonstration"]  # the worked solution in the reasoning/answer format
    value = parsing.parse_number(truth)
    wrong = good.replace(f"<answer>{truth}</answer>", f"<answer>{value * 3 + 7:g}</answer>")
    kw = lambda c: dict(prompts=[row["prompt"]], completions=[c], ground_truth=[truth])
    assert gsm8k.match_format_exactly(**kw(good)) == [3.0]
    assert gsm8k.check_answer(**kw(good)) == [3.0]
    assert gsm8k.check_numbers(**kw(good)) == [1.5]
    assert gsm8k.answer_match(**kw(good)) == [1.0]
    assert gsm8k.check_answer(**kw(wrong))[0] in (-1.0, 0.25, 0.5)  # 3x+7 is never equal
    assert gsm8k.answer_match(**kw(wrong)) == [0.0]
    assert gsm8k.eval_flags(good, truth) == (True, True, True)
    # verl-style dispatch agrees with the structured reward.
    assert scoring.default_compute_score("gsm8k", good, truth) == 1.0
  # Ground truths with thousands separators are normalized ("1,000" -> "1000").
  raw = [r["extra_info"]["answer"].split("####")[-1].strip() for r in rows]
  with_commas = [(r, t["ground_truth"]) for r, t in zip(raw, rows) if "," in r]
  assert with_commas and all("," not in t for _, t in with_commas)


THINK_GOOD = "<think>\n12+30=42\n</think>\n<answer>\n42\n</answer>\n"
THINK_TABLE = [
    # completion, truth, correctness, digit, hard_format, mark
    (THINK_GOOD, "42", 2.0, 0.5, 0.5, 0.5),
    ("<think>\nx\n</think>\n<answer>\n42\n</answer>", "42", 2.0, 0.5, 0.5, 0.5),
    ("<think>x</think><answer>42</answer>", "42", 2.0, 0.5, 0.0, 0.0),
    ("<think>\nx\n</think>\n<answer>\n41\n</answer>\n", "42", 0.0, 0.5, 0.5, 0.5),
    ("<think>\nx\n</think>\n<answer>\n1,000\n</answer>\n", "1000", 2.0, 0.0, 0.5, 0.5),
    ("<think>\nx\n</think>\n<answer>\n-4\n</answer>\n", "-4", 2.0, 0.0, 0.5, 0.5),
    ("<think>\nx\n</think>\n", "42", 0.0, 0.0, 0.0, 0.25),
    ("42", "42", 0.0, 0.0, 0.0, 0.0),
    ("", "42", 0.0, 0.0, 0.0, 0.0),
    ("say <think>\nx\n</think>\n<answer>\n42\n</answer>\n", "42", 2.0, 0.5, 0.0, 0.5),
]


@pytest.mark.parametrize("row", THINK_TABLE, ids=[repr(r[0][:30]) for r in THINK_TABLE])
def test_think_rewards_table(row):
  completion, truth, correct, digit, hard, mark = row
  kw = dict(prompts=["q"], completions=[completion], ground_truth=[truth])
  got = (
      think.correctness_reward(**kw)[0],
      think.digit_reward(**kw)[0],
      think.hard_format_reward(**kw)[0],
      think.mark_reward(**kw)[0],
  )
  assert got == (correct, digit, hard, mark)


@pytest.mark.parametrize(
    "text,value",
    [
        ("1,234", 1234.0),
        ("$5", 5.0),
        ("72.0", 72.0),
        ("-3", -3.0),
        (" 42 dollars", 42.0),
        ("−7", -7.0),
        (".5", 0.5),
        ("3 and 4", None),
        ("abc", None),
        ("", None),
        (None, None),
        ("1,234,567.25", 1234567.25),
    ],
)
def test_parse_number(text, value):
  assert parsing.parse_number(text) == value


@pytest.mark.parametrize(
    "source,solution,truth,score",
    [
        ("gsm8k", "so it is <answer>18</answer>", "18", 1.0),
        ("math", "the total is 3 + 4 = 7", "7", 1.0),
        ("math_algebra", "x = 7.0", "7", 1.0),
        ("math", "<answer>8</answer>", "7", 0.0),
        ("qa", "<answer>The Eiffel Tower!</answer>", "eiffel tower", 1.0),
        ("triviaqa", "Paris", ["paris", "Paris, France"], 1.0),
        ("qa", "London", ["paris"], 0.0),
        ("classification", "<answer>Positive</answer>", "positive", 1.0),
        ("classification", "negative", "positive", 0.0),
    ],
)
def test_verl_dispatch(source, solution, truth, score):
  assert scoring.default_compute_score(source, solution, truth) == score


def test_verl_dispatch_unknown_source_names_the_fix():
  with pytest.raises(ValueError, match="no built-in scorer for data_source 'poetry'.*custom_file"):
    scoring.default_compute_score("poetry", "x", "y")


# ---------------------------------------------------------------------------------- ROUGE

# Values from the rouge-score reference implementation's definition, computed by hand:
# pred "the cat sat on the mat", ref "the cat is on the mat": unigram overlap 5 of 6 each
# (P = R = F = 5/6); bigrams: the-cat, on-the, the-mat shared = 3 of 5 (F = 0.6); LCS = 5
# ("the cat on the mat") -> F = 5/6.
ROUGE_CASES = [
    ("the cat sat on the mat", "the cat is on the mat", 5 / 6, 0.6, 5 / 6),
    ("a b c d", "a b c d", 1.0, 1.0, 1.0),
    ("x y z", "a b c", 0.0, 0.0, 0.0),
    ("", "a b c", 0.0, 0.0, 0.0),
    # 3-token pred vs 6-token ref, all pred unigrams present: P=1, R=0.5 -> F=2/3; bigrams
    # "police arrest" only: P=1/2, R=1/5 -> F=2/7; LCS 3 -> F=2/3.
    ("police arrest man", "police arrest a man in london", 2 / 3, 2 / 7, 2 / 3),
]


@pytest.mark.parametrize("pred,ref,r1,r2,rl", ROUGE_CASES)
def test_rouge_known_values(pred, ref, r1, r2, rl):
  s = rouge.rouge_scores(pred, ref)
  np.testing.assert_allclose([s["rouge1"], s["rouge2"], s["rougeL"]], [r1, r2, rl], atol=1e-9)
  assert rouge.rouge(["p"], [pred], [ref])[0] == pytest.approx((r1 + r2 + rl) / 3)


def test_rouge_stems():
  # Porter stemming: "running"/"runs" -> "run".
  assert rouge.rouge_scores("dogs running", "dog runs")["rouge1"] == 1.0


# --------------------------------------------------------------------- the reward computer


def _rows(n, truth="7", source="math"):
  return [dict(ground_truth=truth, data_source=source, extra_info={"i": i}) for i in range(n)]


def test_weighted_sum_and_per_function_values():
  rc = rewards.build_reward_computer(("check_answer", "match_format_exactly"), (1.0, 0.5))
  comps = ["<reasoning>r</reasoning><answer>7</answer>", "<answer>7</answer>", "nothing"]
  res = rc(["p"] * 3, comps, _rows(3))
  np.testing.assert_array_equal(res.per_function["check_answer"], [3.0, 0.0, 0.0])
  np.testing.assert_array_equal(res.per_function["match_format_exactly"], [3.0, 0.0, 0.0])
  np.testing.assert_array_equal(res.total, [4.5, 0.0, 0.0])
  assert res.errors == 0


def test_plugin_file_by_path(tmp_path):
  f = tmp_path / "my_reward.py"
  f.write_text(
      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
      "  return float(solution_str.strip() == ground_truth) + extra_info['i'] / 100\n"
  )
  rc = rewards.build_reward_computer((), (), custom_file=str(f), custom_weight=2.0)
  res = rc(["p"] * 3, ["7", "8", " 7 "], _rows(3))
  np.testing.assert_allclose(res.total, [2.0, 0.02, 2.04], rtol=1e-6)
  assert list(res.per_function) == ["custom"]


@pytest.mark.parametrize(
    "body,err",
    [
        ("", "must define compute_score"),
        ("import not_a_module_xyz\n", "importing the reward file failed: ModuleNotFoundError"),
    ],
)
def test_bad_plugin_file_fails_at_start_up(tmp_path, body, err):
  f = tmp_path / "bad.py"
  f.write_text(body)
  with pytest.raises(Exception, match=err):
    rewards.build_reward_computer((), (), custom_file=str(f))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    rewards.build_reward_computer((), (), custom_file=str(tmp_path / "missing.py"))


def _plugin(tmp_path, body):
  f = tmp_path / "r.py"
  f.write_text(
      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" + body
  )
  return str(f)


RAISING = "  if 'boom' in solution_str:\n    raise KeyError('missing key')\n  return 1.0\n"
NAN = "  return float('nan') if 'boom' in solution_str else 1.0\n"
STRING = "  return 'high' if 'boom' in solution_str else 1.0\n"
BOOL = "  return True if 'boom' in solution_str else 1.0\n"
HUGE = "  return 10 ** 400 if 'boom' in solution_str else 1\n"


@pytest.mark.parametrize(
    "body,words",
    [
        (RAISING, ["'custom' raised KeyError", "row 1", "'xx boom yy'"]),
        (NAN, ["'custom' returned nan", "row 1", "'xx boom yy'"]),
        (STRING, ["'custom' returned 'high'", "row 1"]),
        (BOOL, ["'custom' returned True", "row 1"]),
        (HUGE, ["'custom' raised OverflowError", "row 1"]),
    ],
)
def test_bad_reward_fails_fast_by_default_naming_function_row_and_snippet(tmp_path, body, words):
  rc = rewards.build_reward_computer((), (), custom_file=_plugin(tmp_path, body))
  with pytest.raises(rewards.RewardError) as e:
    rc(["p"] * 3, ["fine", "xx boom yy", "fine"], _rows(3))
  for w in words:
    assert w in str(e.value), str(e.value)
  assert "on_error=zero" in str(e.value)


@pytest.mark.parametrize("body", [RAISING, NAN, STRING, BOOL, HUGE])
def test_bad_reward_scores_zero_and_is_counted_when_asked(tmp_path, body):
  rc = rewards.build_reward_computer((), (), custom_file=_plugin(tmp_path, body), on_error="zero")
  res = rc(["p"] * 4, ["fine", "boom", "fine", "boom"], _rows(4))
  np.testing.assert_array_equal(res.total, [1.0, 0.0, 1.0, 0.0])
  assert res.errors == 2


def test_unknown_reward_name_lists_known_ones():
  with pytest.raises(ValueError, match="unknown reward function 'nope'; known: .*check_answer"):
    rewards.build_reward_computer(("nope",), (1.0,))


SLOW = "  import time\n  if 'slow' in solution_str:\n    time.sleep(30)\n  return 1.0\n"


def test_process_pool_scores_and_times_out(tmp_path):
  rc = rewards.build_reward_computer(
      ("check_answer",),
      (1.0,),
      custom_file=_plugin(tmp_path, SLOW),
      num_workers=2,
      timeout_sec=3.0,
      on_error="zero",
  )
  try:
    comps = ["<reasoning>r</reasoning><answer>7</answer>", "slow", "fast"]
    res = rc(["p"] * 3, comps, _rows(3))
    np.testing.assert_array_equal(res.per_function["check_answer"], [3.0, 0.0, 0.0])
    np.testing.assert_array_equal(res.per_function["custom"], [1.0, 0.0, 1.0])
    assert res.errors == 1
    # The pool was restarted after the hung call and still works.
    res = rc(["p"], ["fast"], _rows(1))
    assert res.total.tolist() == [1.0] and res.errors == 0
  finally:
    rc.close()


def test_process_pool_timeout_fails_fast_by_default(tmp_path):
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path, SLOW), num_workers=1, timeout_sec=2.0
  )
  try:
    with pytest.raises(rewards.RewardError, match="'custom' timed out after 2.0s on row 0"):
      rc(["p"], ["slow"], _rows(1))
  finally:
    rc.close()
