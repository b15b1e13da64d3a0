"""Partial rollouts (rollout.partial_rollout with streaming): a step's batch is the first B whole
groups to finish among all groups in flight; a group still running trains in a later step, at
the latest k steps after the step it was queued for. The rule on its own, on the slot engine
with imposed row lengths, in the loop, and through a resume."""

from flax import nnx
import jax
import numpy as np
import pytest

from grpo_jax import configuration
from grpo_jax import train
from grpo_jax.rollout import source as source_lib
from grpo_jax.rollout import streaming
from grpo_jax.rollout.types import GenerationConfig
from tests.rollout.test_sampler import prompts
from tests.rollout.test_slots import CFG
from tests.rollout.test_slots import G
from tests.rollout.test_slots import engine
from tests.rollout.test_slots import model  # noqa: F401  (the fixture)
from tests.rollout.test_streaming import KEYS
from tests.rollout.test_streaming import STREAM
from tests.test_train import checkpoint_state
from tests.test_train import flat
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

PARTIAL = {**STREAM, "rollout.partial_rollout": True}


def test_the_rule_takes_the_first_finished_and_waits_for_the_due():
  untaken = {0: {0, 1, 2}, 1: {0, 1, 2}}
  first = streaming.first_finished
  # Finish order (1, 0) before (0, 2): the batch is the first 3 to finish, oldest first.
  finished = [(0, 0), (1, 0), (0, 2), (1, 1)]
  assert first(finished, untaken, batch_groups=3, due=-1) == [(0, 0), (0, 2), (1, 0)]
  assert first(finished[:2], untaken, batch_groups=3, due=-1) is None  # too few finished
  # Step 0's groups are due: (0, 1) still runs, so the batch waits for it ...
  assert first(finished, untaken, batch_groups=3, due=0) is None
  # ... then takes all of step 0's and no other.
  done = [*finished, (0, 1)]
  assert first(done, untaken, batch_groups=3, due=0) == [(0, 0), (0, 1), (0, 2)]
  with pytest.raises(RuntimeError):
    first(done, untaken, batch_groups=2, due=0)


def test_engine_batches_hold_the_first_finished_groups_whole_and_carry_the_rest(model):  # noqa: F811
  """Imposed row lengths (budgets, no stop token), 4 groups of 3 rows a step, k = 1: step 0's
  group 1 is long; step 0 trains the first 4 groups to finish (some of step 1's), step 1 takes
  the carried long group (due: queued for step 0) and the first others; every row is the
  row its own step, prompt and key give alone (its group's, never split), with the budget
  imposed on it."""
  graphdef, state = nnx.split(model)
  k, b = 1, 4
  e = engine(graphdef, 6, eos_ids=(), chunk=1, steps_in_flight=2 * k + 1)
  gen = GenerationConfig(temperature=1.0)
  short, long = [1, 2, 2], [12, 12, 11]  # a short group takes 2 decode steps, the long 12
  caps = {
      0: np.array([*short, *long, *short, *short]),
      1: np.array([*short, *short, *short, *short]),
      2: np.array([*short, *short, *long, *short]),
  }
  batches = {t: prompts(CFG.vocab_size, b=b, seed=t) for t in caps}
  key = lambda t: jax.random.key(100 + t)  # noqa: E731
  alone = {  # each step's rows on their own (the same engine: its programs compiled once)
      t: np.asarray(e(state, *batches[t], key(t), gen, caps=caps[t]).tokens) for t in caps
  }
  stream = streaming.Stream(e, lambda p: p)
  stream.reset(gen, rows_per_step=b * G)
  stream.set_weights(state, version=0)
  taken, enqueued = {}, set()
  for step in (0, 1, 2):  # as the source queues: step 0 and 1 at step 0, then one more a step
    for t in sorted({*range(step, step + k + 1)} & set(caps) - enqueued):
      enqueued.add(t)
      stream.enqueue(t, {"ids": batches[t][0], "mask": batches[t][1]}, key(t), caps=caps[t])
    rollout, _, groups = stream.wait_first(step, due=step - k)
    taken[step] = [tuple(map(int, g)) for g in groups]
    assert len(set(taken[step])) == b and taken[step] == sorted(taken[step])
    assert all(step - k <= t <= step + k for t, _ in taken[step])  # the staleness bound
    lengths = np.asarray(rollout.lengths).reshape(b, G)
    for (t, i), got in zip(taken[step], lengths):
      np.testing.assert_array_equal(got, caps[t][i * G : (i + 1) * G])
    for (t, i), tokens in zip(taken[step], np.asarray(rollout.tokens).reshape(b, G, -1)):
      np.testing.assert_array_equal(tokens, alone[t][i * G : (i + 1) * G])
  assert (0, 1) not in taken[0] and any(t == 1 for t, _ in taken[0])  # long one carried
  assert (0, 1) in taken[1]  # due in step 1 (queued for step 0, k = 1)
  assert (2, 2) in taken[2]  # the last step before nothing is queued waits for all
  every = sorted(g for groups in taken.values() for g in groups)
  assert every == [(t, i) for t in caps for i in range(b)]  # each group once
  assert not stream.in_flight() and not e.running()


def _long_tailed(monkeypatch):
  """Imposed long-tailed row lengths in the loop (the tiny model's rows all run to the 7-token
  budget): per row a budget of 1-3 tokens, 7 for about one row in 6 (a seeded draw per step).
  Records each step's groups and batch, and each queued step's prompts."""
  queued, batches = {}, {}
  enqueue, take_first = streaming.Stream.enqueue, source_lib.RolloutSource._take_first

  def record_enqueue(self, step, prompt, key, caps=None):
    queued[step] = np.asarray(jax.device_get(prompt["ids"]))
    rng = np.random.default_rng(step)
    n = queued[step].shape[0] * self.slots.g
    caps = np.where(rng.random(n) < 1 / 6, 7, rng.integers(1, 4, n))
    enqueue(self, step, prompt, key, caps)

  def record_take(self, drawn):
    take_first(self, drawn)
    batches[drawn.step] = (drawn.groups.copy(), np.asarray(jax.device_get(drawn.prompt["ids"])))

  monkeypatch.setattr(streaming.Stream, "enqueue", record_enqueue)
  monkeypatch.setattr(source_lib.RolloutSource, "_take_first", record_take)
  return queued, batches


def _unpadded(ids):
  return ids[ids != 0]


@pytest.mark.slow  # ~50 s on 2 shared cores
def test_partial_rollouts_train_and_carry_groups_with_their_own_prompts(tmp_path, monkeypatch):
  """4 steps, k = 1, long-tailed row lengths: finite losses; some step trains groups carried
  from the step before; each batch's prompt i is its group's own prompt (the one its step
  queued: the rewards read that row); each group trains once; token staleness <= 2k."""
  queued, batches = _long_tailed(monkeypatch)
  run = str(tmp_path / "run")
  train.run(tiny_config(num_steps=4, **PARTIAL), run)
  rows = grpo_rows(run)
  assert len(rows) == 4
  for r in rows:
    assert np.isfinite(r["loss/policy_loss"]) and np.isfinite(r["loss/grad_norm"])
    assert 0 <= r["rollout/staleness_token_mean"] <= r["rollout/staleness_token_max"] <= 2
    assert 0 <= r["rollout/carried_groups"] <= 8 and 0 <= r["rollout/early_groups"] <= 8
  assert rows[0]["rollout/carried_groups"] == 0
  assert any(r["rollout/carried_groups"] > 0 for r in rows)
  assert sorted(batches) == [0, 1, 2, 3]
  every = []
  for step, (groups, ids) in batches.items():
    for (t, i), row in zip(groups, ids):
      assert step - 1 <= t <= step + 1
      np.testing.assert_array_equal(_unpadded(row), _unpadded(queued[t][i]))
      every.append((int(t), int(i)))
  assert sorted(every) == [(t, i) for t in range(4) for i in range(8)]  # each group once


@pytest.mark.slow  # ~70 s on 2 shared cores: three runs
def test_partial_resume_at_a_checkpoint_equals_a_run_never_stopped(tmp_path, monkeypatch):
  """Long-tailed rows, groups carried: the step before a checkpoint the source foresees takes
  every group left (none queued past it), so nothing is in flight at the save, and the resumed
  run == the run never stopped, figures and weights."""
  _long_tailed(monkeypatch)
  kw = dict(num_steps=4, save_interval_steps=2, **PARTIAL)
  straight = str(tmp_path / "straight")
  train.run(tiny_config(**kw), straight)
  split = str(tmp_path / "split")
  with pytest.raises(SystemExit):
    train.run(tiny_config(max_steps_per_run=2, **kw), split)
  _, saved = checkpoint_state(split, 2)
  assert "pending" not in saved
  train.run(tiny_config(max_steps_per_run=2, **kw), split)
  a, b = grpo_rows(straight), grpo_rows(split)
  assert [r["step"] for r in b] == [1, 2, 3, 4]
  assert any(r["rollout/carried_groups"] > 0 for r in a)
  for ra, rb in zip(a, b, strict=True):
    for k in (*KEYS, "rollout/carried_groups"):
      assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
  fa, fb = (flat(checkpoint_state(w, 4)[1]["train"]) for w in (straight, split))
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_partial_rollout_without_streaming_is_refused():
  errors = configuration.validate(tiny_config(**{"rollout.partial_rollout": True}), num_devices=8)
  assert len(errors) == 1 and errors[0].startswith("rollout.partial_rollout="), errors
  assert configuration.validate(tiny_config(**PARTIAL), num_devices=8) == []
