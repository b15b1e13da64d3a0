"""Multi-turn rows in the slot engine (rollout/slots.py with `turns`): a row that stops on a
tool call keeps its slot, the response is appended at its own position (only those tokens
prefilled) with tool_mask 1, and the row goes on. A scripted `turns` object stands in for the
tools (rollout/turns.py drives real ones; tests/rollout/test_tool_turns.py)."""

from flax import nnx
import jax
import numpy as np
import pytest

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.rollout import GenerationConfig
from grpo_jax.rollout.slots import SlotEngine
from tests.rollout.test_sampler import prompts
from tests.rollout.test_sampler import trainer_logprobs

CFG = PRESETS["tiny-qwen3"]
P, C, G, R = 7, 40, 3, 6
EOS = 5
# The token that ends a turn with a "tool call" (a stop token) is one the random model draws
# often, greedy included (the `call` fixture).


class Scripted:
  """Every turn that ends at CALL gets a response of 1 + (row + turn) % R tokens, back after
  `delay` polls; at most `max_turns` turns per row."""

  def __init__(self, call, max_turns=3, delay=0):
    self.call, self.max_turns, self.delay = call, max_turns, delay
    self.reset()

  def reset(self):
    self.turns, self.waiting, self.log, self.finished = {}, {}, [], []

  def response(self, row, turn):
    return [20 + (row + turn + j) % 7 for j in range(1 + (row + turn) % R)]

  def stopped(self, row, turn_tokens):
    t = self.turns.get(row, 0)
    if turn_tokens[-1] != self.call or t + 1 >= self.max_turns:
      return False
    self.turns[row] = t + 1
    self.waiting[row] = [self.delay, self.response(row, t)]
    self.log.append((row, t, np.asarray(turn_tokens).copy()))
    return True

  def ready(self, block=False):
    out = {}
    for row, entry in list(self.waiting.items()):
      if entry[0] <= 0 or block:
        out[row] = entry[1]
        del self.waiting[row]
      else:
        entry[0] -= 1
    assert out or not block
    return out

  def finish(self, row):
    self.finished.append(row)
    self.turns.pop(row, None)


@pytest.fixture(scope="module")
def model():
  return build_model(CFG, seed=0)


@pytest.fixture(scope="module")
def call(model):
  """The most frequent greedy token past the first column of a plain run (not EOS)."""
  _, _, _, r = run(model, 12, 64, "greedy", None, call=-1)
  tokens = np.asarray(r.tokens)[:, 1:].ravel()
  counts = np.bincount(tokens[tokens != EOS], minlength=CFG.vocab_size)
  counts[0] = 0
  return int(np.argmax(counts))


def run(model, slots, chunk, gen, turns, seed=1, b=4, call=None, **kw):
  call = turns.call if call is None else call
  ids, mask = prompts(CFG.vocab_size, b=b, seed=seed)
  graphdef, state = nnx.split(model)
  e = SlotEngine(
      graphdef,
      slots=slots,
      chunk=chunk,
      max_prompt_length=P,
      max_new_tokens=C,
      num_generations=G,
      eos_ids=(EOS, call),
      turns=turns,
      max_append=R,
      **kw,
  )
  return e, ids, mask, e(state, ids, mask, jax.random.key(seed), gen)


def expected_tool_columns(turns, r):
  """The columns the scripted responses must occupy, from the log of calls per row."""
  want = np.zeros(np.asarray(r.mask).shape, np.int32)
  tokens = np.asarray(r.tokens)
  for row in range(want.shape[0]):
    col = 0
    for row_, t, turn in [e for e in turns.log if e[0] == row]:
      col += len(turn)
      resp = turns.response(row, t)
      k = min(len(resp), int(r.lengths[row]) - col)
      want[row, col : col + k] = 1
      np.testing.assert_array_equal(tokens[row, col : col + k], resp[:k])
      col += len(resp)
  return want


@pytest.mark.parametrize(
    "slots,chunk,gen,delay",
    [(12, 64, "greedy", 0), (5, 3, GenerationConfig(temperature=1.0), 2), (3, 1, "liberal", 1)],
)
def test_tool_responses_are_appended_in_place_and_log_probs_stay_the_trainers(
    model, call, slots, chunk, gen, delay
):
  turns = Scripted(call, delay=delay)
  e, ids, mask, r = run(model, slots, chunk, gen, turns)
  assert len(turns.log) >= 3, "the scripted tool was never called: the test would prove nothing"
  tool = np.asarray(r.tool_mask)
  np.testing.assert_array_equal(tool, expected_tool_columns(turns, r))
  m, act = np.asarray(r.mask) > 0, np.asarray(r.action_mask) > 0
  assert np.all(m[tool > 0]) and not np.any(act[tool > 0])
  # The model's tokens of every turn: the trainer's log-probs over the whole row (tool tokens
  # as context), within 1e-5 in f32.
  train = np.asarray(trainer_logprobs(model, ids, mask, r, G))
  assert np.abs(train - np.asarray(r.raw_logprobs))[act].max() <= 1e-5
  assert np.all(np.asarray(r.logprobs)[tool > 0] == 0)
  # Live cache: each append prefilled the row's last token and the response only.
  appended = sum(len(turns.response(row, t)) + 1 for row, t, _ in turns.log)
  assert int(e._state["extended"]) <= appended  # rows out of budget are not extended
  assert int(e._state["extended"]) >= appended - len(turns.log) * (R + 1)
  assert sorted(turns.finished) == list(range(r.tokens.shape[0]))  # every row released once


def test_a_response_that_does_not_fit_ends_the_row_truncated(model, call):
  """Budgets one token past each row's first call (greedy): no room for a response and a
  next token, so those rows end there, truncated, the call unanswered."""
  _, ids, mask, plain = run(model, 12, 64, "greedy", None, call=call)
  tokens, lengths = np.asarray(plain.tokens), np.asarray(plain.lengths)
  calls = (tokens == call) & (np.arange(C)[None] < lengths[:, None])
  first = np.where(calls.any(1), calls.argmax(1), C)
  caps = np.minimum(first + 2, C)
  assert (first < C - 2).sum() >= 2, "too few calls: the test would prove nothing"
  graphdef, state = nnx.split(model)
  turns = Scripted(call)
  e = SlotEngine(
      graphdef,
      slots=5,
      chunk=3,
      max_prompt_length=P,
      max_new_tokens=C,
      num_generations=G,
      eos_ids=(EOS, call),
      turns=turns,
      max_append=R,
  )
  r = e(state, ids, mask, jax.random.key(1), "greedy", caps=caps)
  for row in np.flatnonzero(first < C - 2):
    assert int(r.lengths[row]) == first[row] + 1 and bool(r.truncated[row])
    assert int(r.tokens[row, first[row]]) == call
  assert not np.asarray(r.tool_mask).any()


def test_the_live_cache_equals_prefilling_the_whole_history_again(model, call):
  """The baseline engine (reprefill_turns: every row's history prefilled again after each
  append) draws the same tokens with the same log-probs; the live cache prefills only the
  appended tokens."""
  live_turns, again_turns = Scripted(call, delay=1), Scripted(call, delay=1)
  e1, _, _, a = run(model, 5, 3, GenerationConfig(temperature=1.0), live_turns)
  e2, _, _, b = run(
      model, 5, 3, GenerationConfig(temperature=1.0), again_turns, reprefill_turns=True
  )
  assert len(live_turns.log) >= 3
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.tool_mask, b.tool_mask)
  np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)
  assert int(e2._state["extended"]) > 2 * int(e1._state["extended"])


@pytest.mark.parametrize(
    "again", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["live", "reprefill"]
)
def test_turns_with_the_tpu_kernels_slot_major_caches(model, call, again):
  """decode_attention="pallas_tpu" (the TPU's kernel, interpreted here) keeps the caches
  slot-major [slots, S, Hkv, K]: its decode steps, the appends (XLA's attention over the
  transposed cache) and the re-prefill baseline draw the same tokens with the same log-probs
  as the head-major caches of XLA's attention."""
  gen = GenerationConfig(temperature=1.0)
  kw = dict(reprefill_turns=again)
  a_turns, b_turns = Scripted(call, delay=1), Scripted(call, delay=1)
  _, _, _, a = run(model, 5, 3, gen, a_turns, decode_attention="xla", **kw)
  e, _, _, b = run(model, 5, 3, gen, b_turns, decode_attention="pallas_tpu", **kw)
  assert e.slot_major and len(a_turns.log) >= 3
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.tool_mask, b.tool_mask)
  np.testing.assert_allclose(a.raw_logprobs, b.raw_logprobs, atol=1e-5)


def test_without_turns_nothing_changes(model):
  """turns=None: tool_mask all zero and the rows as before (the existing slot tests pin the
  lockstep equality)."""
  _, _, _, r = run(model, 5, 3, "greedy", None, call=-1)
  assert not np.asarray(r.tool_mask).any()
