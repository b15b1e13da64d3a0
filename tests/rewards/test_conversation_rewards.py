"""Rewards of multi-turn completions (grpo_jax/rewards/conversation.py): runs split at the tool
tokens, TRL's message lists for conversational rows, the final answer for compute_score."""

import json
import os
import textwrap

import numpy as np
import pytest

from grpo_jax import rewards
from grpo_jax.data import tokenizers
from grpo_jax.rewards import conversation
from tests.conftest import SHARED_DATA

QWEN_TOK = os.path.join(SHARED_DATA, "qwen_tokenizer")
CALL = json.dumps({"name": "calculator", "arguments": {"expression": "123*45"}})
MODEL_1 = f"<think>use the tool</think><tool_call>{CALL}</tool_call>"
RESPONSE = "<tool_response>5535</tool_response>"
MODEL_2 = "<answer>5535</answer>"

# TRL's think_format_reward in spirit (trl.rewards.format_rewards): reads completion[0]["content"].
THINK_FORMAT = textwrap.dedent("""
    import re

    def think_format_reward(completions, **kwargs):
      pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
      contents = [completion[0]["content"] for completion in completions]
      return [1.0 if re.match(pattern, c, re.DOTALL | re.MULTILINE) else 0.0 for c in contents]
    """)
# verl's interface: 1.0 only when solution_str is exactly the final answer's text.
FINAL_ANSWER = textwrap.dedent("""
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
      return 1.0 if solution_str == f"<answer>{ground_truth}</answer>" else 0.0
    """)


def _rows_and_tokens(tok, prompts, pieces_n, width=96):
  """Rows of [model, tool, model, ...] pieces -> tokens, mask (model tokens + eos), tool."""
  n = len(pieces_n)
  tokens = np.full((n, width), tok.pad_id, np.int32)
  mask, tool = np.zeros((n, width), np.int32), np.zeros((n, width), np.int32)
  for i, pieces in enumerate(pieces_n):
    at = 0
    for j, piece in enumerate(pieces):
      ids = tok.encode(piece)
      tokens[i, at : at + len(ids)] = ids
      (tool if j % 2 else mask)[i, at : at + len(ids)] = 1
      at += len(ids)
    tokens[i, at], mask[i, at] = tok.eos_id, 1
  rows = [
      {"prompt": p, "ground_truth": "5535", "data_source": "arithmetic", "extra_info": {}}
      for p in prompts
  ]
  return rows, tokens, mask, tool


def test_runs_split_where_the_tool_flag_changes():
  tool = np.array([0, 0, 1, 1, 1, 0, 0, 0])
  keep = np.array([1, 1, 1, 1, 1, 1, 1, 0])
  got = [(t, p.tolist()) for t, p in conversation.runs(tool, keep)]
  assert got == [(False, [0, 1]), (True, [2, 3, 4]), (False, [5, 6])]
  assert conversation.runs(tool, np.zeros(8)) == []


def test_plain_and_hermes_tool_contents():
  assert conversation.tool_contents(RESPONSE) == ["5535"]
  hermes = (
      "<|im_end|>\n<|im_start|>user\n<tool_response>\n156\n</tool_response>\n"
      "<tool_response>\nline 1\nline 2\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
  )
  assert conversation.tool_contents(hermes) == ["156", "line 1\nline 2"]
  assert conversation.tool_contents("\n<|im_start|>user\n<tool_response>\ncut sho") == ["cut sho"]


def test_string_and_conversational_rows_get_their_shapes():
  tok = tokenizers.build_tokenizer("char_tools")
  chat = [{"role": "user", "content": "123*45="}]
  rows, tokens, mask, tool = _rows_and_tokens(
      tok, ["123*45=", chat], [[MODEL_1, RESPONSE, MODEL_2]] * 2
  )
  turns = conversation.build(tok, ["123*45=", "rendered"], rows, tokens, mask, tool)
  whole = MODEL_1 + RESPONSE + MODEL_2
  assert turns.texts == [whole, whole]
  assert turns.answers == [MODEL_2, MODEL_2]
  assert turns.prompts == ["123*45=", "rendered"]
  assert turns.trl_prompts == ["123*45=", chat]
  assert turns.trl_completions[0] == whole
  assert turns.trl_completions[1] == [
      {"role": "assistant", "content": MODEL_1},
      {"role": "tool", "content": "5535"},
      {"role": "assistant", "content": MODEL_2},
  ]
  # The mask may also count the tool tokens: the same turns.
  again = conversation.build(tok, ["123*45=", "rendered"], rows, tokens, mask | tool, tool)
  assert again == turns


def test_reward_computer_gives_each_kind_its_view(tmp_path):
  tok = tokenizers.build_tokenizer("char_tools")
  (tmp_path / "trl_style.py").write_text(THINK_FORMAT)
  (tmp_path / "verl_style.py").write_text(FINAL_ANSWER)
  chat = [{"role": "user", "content": "123*45="}]
  pieces = [
      [MODEL_1, RESPONSE, MODEL_2],  # think first, final answer after the tool
      ["<tool_call>x</tool_call>", RESPONSE, "<think>late</think>" + MODEL_2],  # no think first
      [MODEL_2],  # no tool call at all
  ]
  rows, tokens, mask, tool = _rows_and_tokens(tok, [chat] * 3, pieces)
  turns = conversation.build(tok, ["p"] * 3, rows, tokens, mask, tool)
  trl = rewards.build_reward_computer(
      ("answer_match",),
      (1.0,),
      custom_file=str(tmp_path / "trl_style.py"),
      custom_function="think_format_reward",
  )
  got = trl.score_turns(turns, rows)
  same = trl.score_tool_rows(tok, ["p"] * 3, rows, tokens, mask, tool)
  np.testing.assert_array_equal(same.total, got.total)
  # completion[0]["content"] is the first assistant turn: only row 0 starts with <think>.
  np.testing.assert_array_equal(got.per_function["custom"], [1.0, 0.0, 0.0])
  np.testing.assert_array_equal(got.per_function["answer_match"], [1.0, 1.0, 1.0])
  # Today's strings are not TRL's conversational shape: the function cannot read them.
  with pytest.raises(rewards.RewardError, match="string indices must be integers"):
    trl(turns.prompts, turns.texts, rows)
  verl = rewards.build_reward_computer(
      ("verl_default",), (1.0,), custom_file=str(tmp_path / "verl_style.py")
  )
  got = verl.score_turns(turns, rows)
  np.testing.assert_array_equal(got.per_function["custom"], [1.0, 0.0, 1.0])
  np.testing.assert_array_equal(got.per_function["verl_default"], [1.0, 1.0, 1.0])
  # Row 1's final answer is "<think>late</think><answer>5535</answer>", not only the answer.
  assert turns.answers[1].startswith("<think>late")
  # One call per row under a timer: the message lists reach the function row by row.
  timed = rewards.build_reward_computer(
      (),
      (),
      custom_file=str(tmp_path / "trl_style.py"),
      custom_function="think_format_reward",
      timeout_sec=30.0,
  )
  np.testing.assert_array_equal(timed.score_turns(turns, rows).total, [1.0, 0.0, 0.0])


def test_trl_think_format_reward_unmodified(tmp_path):
  pytest.importorskip("trl")
  (tmp_path / "r.py").write_text("from trl.rewards import think_format_reward\n")
  tok = tokenizers.build_tokenizer("char_tools")
  chat = [{"role": "user", "content": "123*45="}]
  rows, tokens, mask, tool = _rows_and_tokens(
      tok, [chat] * 2, [[MODEL_1, RESPONSE, MODEL_2], ["<tool_call>x</tool_call>", RESPONSE]]
  )
  turns = conversation.build(tok, ["p"] * 2, rows, tokens, mask, tool)
  rc = rewards.build_reward_computer(
      (), (), custom_file=str(tmp_path / "r.py"), custom_function="think_format_reward"
  )
  np.testing.assert_array_equal(rc.score_turns(turns, rows).total, [1.0, 0.0])


def test_hermes_rows_with_qwen_tokens():
  if not os.path.exists(QWEN_TOK):
    pytest.skip(f"{QWEN_TOK} not present (../shared/data)")
  tok = tokenizers.HFTokenizer(QWEN_TOK)
  call = json.dumps({"name": "python", "arguments": {"code": "print(12*13)"}})
  model_1 = f"Let me run it.\n<tool_call>\n{call}\n</tool_call><|im_end|>"
  response = (
      "\n<|im_start|>user\n<tool_response>\n156\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n"
  )
  model_2 = "The answer is 156."
  chat = [{"role": "user", "content": "12*13?"}]
  rows, tokens, mask, tool = _rows_and_tokens(tok, [chat], [[model_1, response, model_2]], 128)
  turns = conversation.build(tok, ["p"], rows, tokens, mask, tool)
  (msgs,) = turns.trl_completions
  assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"]
  assert msgs[1]["content"] == "156"
  assert msgs[2]["content"] == model_2 == turns.answers[0]
  assert (
      msgs[0]["content"].startswith("Let me run it.\n") and "<|im_end|>" not in msgs[0]["content"]
  )
