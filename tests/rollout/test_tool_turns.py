"""ToolTurns (rollout/turns.py): which stopped turns call tools, and the response tokens."""

import numpy as np
import pytest

from grpo_jax.data.tokenizers import CHAR_ALPHABET
from grpo_jax.data.tokenizers import CHAR_SPECIALS
from grpo_jax.data.tokenizers import CharTokenizer
from grpo_jax.rollout.tools import formats
from grpo_jax.rollout.tools import load_tools
from grpo_jax.rollout.turns import ToolTurns

MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


@pytest.fixture
def tok():
  return CharTokenizer(specials=CHAR_SPECIALS + MARKERS, alphabet=CHAR_ALPHABET + "{}")


def make(tok, **kw):
  kw = dict(max_turns=3, max_response_tokens=40, timeout_sec=5.0) | kw
  return ToolTurns(load_tools("", "calculator"), formats.get("plain"), tok, **kw)


def call(expr):
  return formats.get("plain").call_text("calculator", {"expression": expr})


def test_a_call_pauses_the_row_and_its_response_comes_back_as_tokens(tok):
  turns = make(tok)
  text = "12*3=" + call("123*45")
  assert text.endswith("</tool_call>")
  assert turns.stopped(0, tok.encode(text))
  got = turns.ready(block=True)
  assert tok.decode(got[0], skip_special=False) == "<tool_response>5535</tool_response>"
  assert turns.ready() == {}
  turns.finish(0)
  s = turns.stats()
  assert s["tool_call/calculator/calls"] == 1 and s["tool_call/turns_per_row"] == 2
  assert s["tool_call/row_fraction"] == 1.0


def test_turns_without_calls_and_past_the_limit_end_the_row(tok):
  turns = make(tok, max_turns=2)
  assert not turns.stopped(1, tok.encode("<answer>7</answer><eos>"))
  assert turns.stopped(2, tok.encode(call("1+1")))
  turns.ready(block=True)
  assert not turns.stopped(2, tok.encode(call("2+2")))  # its second turn is its last
  turns.finish(1), turns.finish(2)
  s = turns.stats()
  assert s["tool_call/turn_limit"] == 1 and s["tool_call/turns_per_row"] == 1.5


def test_errors_are_responses_and_long_ones_are_cut_to_the_budget(tok):
  turns = make(tok, max_response_tokens=24)
  assert turns.stopped(0, tok.encode(call("__import__('os')")))
  assert turns.stopped(1, tok.encode("<tool_call>{not json</tool_call>"))
  got = turns.ready(block=True)
  while len(got) < 2:
    got |= turns.ready(block=True)
  for row in (0, 1):
    text = tok.decode(got[row], skip_special=False)
    assert len(got[row]) <= 24
    assert text.startswith("<tool_response>") and text.endswith("</tool_response>"), text
  s = turns.stats()
  assert s["tool_call/errors"] + s["tool_call/malformed"] >= 2


def test_characters_the_vocabulary_lacks_become_question_marks(tok):
  turns = make(tok)
  ids = turns._tokens("é→x")
  assert tok.decode(ids) == "??x"


def test_a_process_that_does_not_run_tools_decides_alike_and_runs_nothing(tok):
  turns = make(tok, runs_tools=False)
  assert turns.stopped(0, tok.encode(call("1+2")))
  assert turns.ready(block=True) == {}  # its responses come from the first process
  assert not np.any([k.endswith("/calls") for k in turns.stats()])


def test_stats_summed_over_processes_keep_their_ratios(tok):
  """stats(reduce=...): the counters are summed (as over processes that each ran their own
  rows' tools, the vLLM engine); turns per row and the calling share stay ratios of sums."""
  turns = make(tok)
  assert turns.stopped(0, tok.encode(call("2*3")))
  turns.ready(block=True)
  turns.finish(0), turns.finish(1)
  s = turns.stats(reduce=lambda v: v * 2)  # two processes alike
  assert s["tool_call/calculator/calls"] == 2 and s["tool_call/calls"] == 2
  assert s["tool_call/turns_per_row"] == 1.5 and s["tool_call/row_fraction"] == 0.5
