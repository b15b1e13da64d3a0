"""Streaming rollouts in the loop (rollout.slots > 0 with rollout.max_staleness = k >= 1):
the slot engine holds up to k steps ahead, new weights land between decode chunks, each token
keeps the version that drew it; resume; the disaggregated placement; the refused settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import configuration
from grpo_jax import train
from grpo_jax.rollout import source as source_lib
from grpo_jax.rollout import streaming
from tests.rollout.test_sampler import trainer_logprobs
from tests.test_train import checkpoint_state
from tests.test_train import flat
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

# 48 slots for 32 rows a step (8 prompts x 4): the next step's groups are admitted while this
# step's rows run, so rows of one step are drawn under two weight versions.
STREAM = {"rollout.slots": 48, "rollout.max_staleness": 1, "rollout.slot_chunk": 2}
KEYS = (
    "reward/total",
    "loss/policy_loss",
    "completions/mean_length",
    "loss/grad_norm",
    "rollout/staleness",
    "rollout/staleness_token_mean",
    "data/epoch",
)


def test_streaming_trains_and_each_token_keeps_its_versions_log_prob(tmp_path, monkeypatch):
  """4 steps, k = 1: finite losses, the staleness figures (per token <= k, some tokens of a
  step 1 update old, the first step on-policy); every recorded behaviour log-prob (the loss's
  old log-probs) == the trainer's under the weights of the version recorded with the token
  (1e-5, f32)."""
  weights, prompts, drawn = {}, {}, {}
  set_weights, enqueue, wait = (
      streaming.Stream.set_weights,
      streaming.Stream.enqueue,
      streaming.Stream.wait,
  )

  def record_weights(self, params, version):
    weights[version] = jax.device_get(params)
    set_weights(self, params, version)

  def record_prompt(self, step, prompt, key):
    prompts[step] = jax.device_get(prompt)
    enqueue(self, step, prompt, key)

  def record_rollout(self, step):
    out = wait(self, step)
    drawn[step] = (jax.device_get(out), self.slots.graphdef)
    return out

  monkeypatch.setattr(streaming.Stream, "set_weights", record_weights)
  monkeypatch.setattr(streaming.Stream, "enqueue", record_prompt)
  monkeypatch.setattr(streaming.Stream, "wait", record_rollout)
  run = str(tmp_path / "run")
  train.run(tiny_config(num_steps=4, **STREAM), run)
  rows = grpo_rows(run)
  assert len(rows) == 4
  for r in rows:
    assert np.isfinite(r["loss/policy_loss"]) and np.isfinite(r["loss/grad_norm"])
    assert 0 <= r["rollout/staleness_token_mean"] <= r["rollout/staleness_token_max"] <= 1
    assert r["rollout/staleness"] == r["rollout/staleness_token_max"]
    assert 0 < r["rollout/slots_busy"] <= 1
  assert rows[0]["rollout/staleness_token_max"] == 0  # queued and drawn from the first weights
  assert any(r["rollout/staleness_token_mean"] > 0 for r in rows)

  assert sorted(drawn) == [0, 1, 2, 3]
  seen = set()
  for step, ((rollout, versions), graphdef) in drawn.items():
    m = np.asarray(rollout.mask) > 0
    v = np.asarray(versions)
    for version in np.unique(v[m]):
      model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, weights[int(version)]))
      want = np.asarray(
          trainer_logprobs(model, prompts[step]["ids"], prompts[step]["mask"], rollout, 4)
      )
      on = m & (v == version)
      assert np.abs(want - np.asarray(rollout.logprobs))[on].max() <= 1e-5, (step, version)
      assert step - 1 <= version <= step
      seen.add((step, int(version)))
  assert any(version < step for step, version in seen)  # some tokens drawn by older weights


def test_resume_at_a_checkpoint_equals_a_run_never_stopped(tmp_path):
  """The source queues no step past a checkpoint it foresees (here save_interval_steps=2, where
  max_steps_per_run=2 stops the run): nothing is in flight there, nothing is saved for the
  rollouts, and the resumed run == the run never stopped, figures and weights."""
  kw = dict(num_steps=4, save_interval_steps=2, **STREAM)
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
  for ra, rb in zip(a, b, strict=True):
    for k in KEYS:
      assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
  fa, fb = (flat(checkpoint_state(w, 4)[1]["train"]) for w in (straight, split))
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@pytest.mark.slow  # ~70 s on 2 cores: three runs
def test_steps_in_flight_at_an_unforeseen_checkpoint_are_drawn_again(tmp_path, monkeypatch):
  """A checkpoint the source did not foresee (as a preemption's; here: its horizon removed)
  with step 4's rows in flight: they are dropped, the checkpoint records the iterator before
  their prompts, and the resumed run draws them again from there: 6 steps, the same prompts
  per step (data/epoch) as a run never stopped, the first 3 steps' figures equal."""
  monkeypatch.setattr(
      source_lib.RolloutSource, "_horizon", lambda self, step: self.config.num_steps
  )
  kw = dict(num_steps=6, **STREAM)
  straight = str(tmp_path / "straight")
  train.run(tiny_config(**kw), straight)
  split = str(tmp_path / "split")
  with pytest.raises(SystemExit):
    train.run(tiny_config(max_steps_per_run=3, **kw), split)
  _, saved = checkpoint_state(split, 3)
  assert "pending" not in saved
  train.run(tiny_config(max_steps_per_run=3, **kw), split)
  a, b = grpo_rows(straight), grpo_rows(split)
  assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
  assert [r["data/epoch"] for r in a] == [r["data/epoch"] for r in b]
  for ra, rb in zip(a[:3], b[:3], strict=True):
    for k in KEYS:
      assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
  for r in b:
    assert np.isfinite(r["loss/policy_loss"]) and r["rollout/staleness_token_max"] <= 1


def test_disaggregated_streaming_trains(tmp_path):
  """placement=disaggregated (sampler on 4 of the 8 devices): the next step's rows decode
  beside the update, the weights land after their move; finite losses, staleness <= 1."""
  if jax.device_count() < 2:
    pytest.skip("needs >= 2 (fake) devices")
  run = str(tmp_path / "dis")
  train.run(tiny_config(num_steps=4, **STREAM, **{"rollout.placement": "disaggregated"}), run)
  rows = grpo_rows(run)
  assert len(rows) == 4
  for r in rows:
    assert np.isfinite(r["loss/policy_loss"]) and r["perf/weight_sync_gb"] > 0
    assert 0 <= r["rollout/staleness_token_mean"] <= r["rollout/staleness_token_max"] <= 1
  assert any(r["rollout/staleness_token_mean"] > 0 for r in rows)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (
            {"loss.dynamic_sampling": True, "loss.max_resample_rounds": 1},
            "loss.dynamic_sampling=",
        ),
        ({"debug.transfer_guard": "disallow"}, "debug.transfer_guard="),
    ],
)
def test_settings_not_built_for_streaming_are_refused(overrides, field):
  errors = configuration.validate(tiny_config(**STREAM, **overrides), num_devices=8)
  assert len(errors) == 1 and errors[0].startswith(field), errors
  assert configuration.validate(tiny_config(**STREAM), num_devices=8) == []
