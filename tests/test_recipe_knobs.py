"""The recipes' knobs (issue 18): epochs, KL in the reward, reference refresh, advantage
clipping, DAPO dynamic sampling. Each test asserts the knob's effect on the math or the loop;
the last runs the loop with all of them on together."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import configuration
from grpo_jax.rollout import dynamic_sampling as dyn
from grpo_jax import train
from grpo_jax.data import pipeline
from grpo_jax.models import build
from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rl import step as step_lib
from grpo_jax.rollout import Rollout
from tests.test_train import checkpoint_state
from tests.test_train import flat
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARITY_REWARD = os.path.join(ROOT, "tests", "data", "parity_reward.py")


# ------------------------------------------------------------------------------ 1. epochs


def test_epochs_are_exact_permutations_and_resume_at_the_boundary():
  """10 rows, batches of 4: each epoch is 2 batches of 8 distinct rows from its own
  permutation; an iterator restored exactly at an epoch boundary continues with the next
  epoch's first batch (not an empty epoch)."""
  it = pipeline.make_prompt_iterator(10, batch_size=4, seed=3, num_epochs=3)
  batches = [next(it) for _ in range(6)]
  with pytest.raises(StopIteration):
    next(it)
  epochs = [np.concatenate(batches[2 * e : 2 * e + 2]) for e in range(3)]
  for e in epochs:
    assert len(set(e.tolist())) == 8 and set(e.tolist()) <= set(range(10))
  assert not all(np.array_equal(epochs[0], e) for e in epochs[1:])  # reshuffled per epoch

  straight = pipeline.make_prompt_iterator(10, batch_size=4, seed=3, num_epochs=3)
  for _ in range(2):
    next(straight)
  state = straight.get_state()
  resumed = pipeline.make_prompt_iterator(10, batch_size=4, seed=3, num_epochs=3)
  resumed.set_state(state)
  rest = list(resumed)
  assert len(rest) == 4
  for a, b in zip(rest, batches[2:]):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # suite time (-m slow runs it)
def test_num_epochs_sets_the_run_length_and_a_resume_at_the_epoch_boundary_trains_on(tmp_path):
  """24 train prompts / batch 8 = 3 steps per epoch; num_epochs=2 -> 6 steps. A run stopped
  exactly at the epoch boundary (step 3) and resumed trains steps 4-6 and ends bit-identical to
  a straight run."""
  kw = dict(
      num_steps=0, num_epochs=2, **{"data.arithmetic.num_train": 24, "eval.generation_configs": ()}
  )
  straight = train.run(tiny_config(**kw), str(tmp_path / "straight"))
  assert straight["final_step"] == 6
  rows = grpo_rows(tmp_path / "straight")
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert [r["data/epoch"] for r in rows] == pytest.approx([1 / 3, 2 / 3, 1, 4 / 3, 5 / 3, 2])

  with pytest.raises(SystemExit) as stop:  # max_steps_per_run: checkpoint, exit status 0
    train.run(tiny_config(max_steps_per_run=3, **kw), str(tmp_path / "resumed"))
  assert stop.value.code == 0 and checkpoint_state(tmp_path / "resumed")[0] == 3
  second = train.run(tiny_config(**kw), str(tmp_path / "resumed"))
  assert second["final_step"] == 6
  assert [r["step"] for r in grpo_rows(tmp_path / "resumed")] == [1, 2, 3, 4, 5, 6]
  _, a = checkpoint_state(tmp_path / "straight")
  _, b = checkpoint_state(tmp_path / "resumed")
  fa, fb = flat(a["train"]["params"]), flat(b["train"]["params"])
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_num_epochs_and_num_steps_together_are_refused():
  errors = configuration.validate(tiny_config(num_epochs=2), num_devices=8)
  assert any(e.startswith("num_epochs=2") and "num_steps=0" in e for e in errors), errors


# ------------------------------------------------------------ 2. KL in the reward; 4. clip


@pytest.fixture(scope="module")
def tiny_fns():
  config = tiny_config(
      beta=0.1, kl_in_reward=True, **{"loss.advantage_clip": 1.0, "reference.refresh_mix": 0.25}
  )
  mesh = build.make_mesh(config)
  policy = build.make_policy(config, mesh)
  return config, step_lib.build(config, policy, mesh), policy


def _batch(config, rng, n):
  c = config.max_completion_length
  mask = (np.arange(c)[None] < rng.integers(1, c + 1, n)[:, None]).astype(np.int32)
  return dict(
      input_ids=np.zeros((n, 4 + c), np.int32),
      attention_mask=np.concatenate([np.ones((n, 4), np.int32), mask], 1),
      completion_mask=mask,
      advantages=np.zeros(n, np.float32),
      old_logp=rng.normal(-2, 0.5, (n, c)).astype(np.float32),
      ref_logp=rng.normal(-2, 0.5, (n, c)).astype(np.float32),
  )


def test_kl_in_reward_folds_beta_times_the_sequence_kl_into_the_rewards(tiny_fns):
  """rewards - beta * sum_t k3(old, ref) over each completion's tokens, then GRPO advantages
  (clipped to 1) of those; the loss itself carries no KL term."""
  config, fns, _ = tiny_fns
  rng = np.random.default_rng(0)
  n = config.batch_size * config.num_generations
  batch = _batch(config, rng, n)
  rewards = rng.uniform(0, 1, n).astype(np.float32)
  out, penalized = fns.fold_kl(batch, rewards)

  d = batch["ref_logp"] - batch["old_logp"]
  kl = np.where(batch["completion_mask"] > 0, np.exp(d) - d - 1, 0).sum(-1)
  want = rewards - 0.1 * kl
  np.testing.assert_allclose(np.asarray(penalized), want, rtol=1e-5, atol=1e-6)
  r = want.reshape(-1, config.num_generations)
  adv = np.clip((r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + 1e-6), -1, 1)
  np.testing.assert_allclose(np.asarray(out["advantages"]), adv.reshape(-1), atol=1e-5)
  assert step_lib.LossSettings.from_config(config).beta == 0.0
  assert step_lib.LossSettings.from_config(tiny_config(beta=0.1)).beta == 0.1


def test_advantage_clip_binds_and_is_counted(tiny_fns):
  """A group [0, 0, 0, 1]: GRPO gives the outlier (1 - 0.25) / 0.433 = 1.73, clipped to 1; the
  stats count the clipped rows."""
  config, fns, _ = tiny_fns
  g, n = config.num_generations, config.batch_size * config.num_generations
  c = config.max_completion_length
  rewards = np.tile(np.array([0, 0, 0, 1], np.float32), n // g)
  rollout = Rollout(
      tokens=np.zeros((n, c), np.int32),
      mask=np.ones((n, c), np.int32),
      logprobs=np.zeros((n, c), np.float32),
      raw_logprobs=np.zeros((n, c), np.float32),
      lengths=np.full(n, c, np.int32),
      truncated=np.zeros(n, bool),
      tool_mask=np.zeros((n, c), np.int32),
  )
  prompts = np.ones((config.batch_size, 4), np.int32)
  adv = np.asarray(fns.assemble(prompts, prompts, rollout, rewards)["advantages"])
  unclipped = np.asarray(adv_lib.group_advantages(rewards, g))
  assert unclipped.max() > 1.7
  np.testing.assert_allclose(adv, np.clip(unclipped, -1, 1), atol=1e-6)
  from grpo_jax.run import metrics

  stats = metrics.rollout_stats(
      jnp.asarray(rewards), jnp.asarray(adv), rollout.mask, group_size=g, advantage_clip=1.0
  )
  assert float(stats["advantages/clip_fraction"]) == pytest.approx(0.25)


# ------------------------------------------------------------------ 3. reference refresh


def test_refresh_is_an_ema_of_the_policy(tiny_fns):
  config, fns, policy = tiny_fns
  params = policy.params
  ref = jax.tree.map(lambda x: x + 1.0, params)
  want = jax.tree.map(lambda r, p: 0.25 * np.asarray(p) + 0.75 * np.asarray(r), ref, params)
  got = fns.refresh(jax.tree.map(jnp.copy, ref), params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-6)


def test_reference_refresh_in_the_loop(tmp_path):
  """refresh_every_steps=2 over 2 steps: the checkpointed reference IS the trained policy (a
  frozen one stays the initial policy: test_train's resume tests; an EMA one is neither: the
  all-knobs test below)."""
  train.run(
      tiny_config(
          num_steps=2,
          beta=0.05,
          **{"reference.refresh_every_steps": 2, "eval.generation_configs": ()},
      ),
      str(tmp_path),
  )
  _, saved = checkpoint_state(tmp_path)
  ref, params = flat(saved["ref"]), flat(saved["train"]["params"])
  for k in ref:
    np.testing.assert_array_equal(ref[k], params[k], err_msg=k)


# ------------------------------------------------------------------- 5. dynamic sampling


def test_dynamic_sampling_keeps_signal_groups_first_then_fills():
  g = 2
  r0 = np.array([1, 1, 0, 1, 0, 0], np.float32)  # groups: flat, signal, flat
  r1 = np.array([0, 1, 1, 1, 1, 0], np.float32)  # signal, flat, signal
  flags = [dyn.has_signal(r0, g), dyn.has_signal(r1, g)]
  np.testing.assert_array_equal(flags[0], [False, True, False])
  np.testing.assert_array_equal(dyn.picks(flags, 3), [1, 3, 5])
  np.testing.assert_array_equal(dyn.picks(flags[:1], 3), [1, 0, 2])  # rounds ran out: fill
  rounds = [{"prompt": np.arange(3) + 10 * k, "rows": np.arange(6) + 100 * k} for k in (1, 2)]
  out = dyn.take(rounds, jnp.asarray(dyn.picks(flags, 3)), g)
  np.testing.assert_array_equal(out["prompt"], [11, 20, 22])
  np.testing.assert_array_equal(out["rows"], [102, 103, 200, 201, 204, 205])


def test_dynamic_sampling_left_pads_narrower_rounds():
  """Rounds trimmed to different prompt widths (data.prompt_width=bucket) meet at the widest,
  the extra columns masked on the left."""
  ids = [np.array([[7, 8], [9, 9]]), np.array([[1, 2, 3], [4, 5, 6]])]
  rounds = [{"prompt": {"ids": i, "mask": np.ones_like(i)}, "rows": np.arange(4)} for i in ids]
  out = dyn.take(rounds, jnp.asarray([0, 3]), 2)
  np.testing.assert_array_equal(out["prompt"]["ids"], [[0, 7, 8], [4, 5, 6]])
  np.testing.assert_array_equal(out["prompt"]["mask"], [[0, 1, 1], [1, 1, 1]])


def test_dynamic_sampling_in_the_loop_fills_the_batch_with_signal(tmp_path):
  """Half the prompts (even answers) give every completion reward 0, so a batch of 8 prompts
  holds zero-variance groups; extra rounds run until none is left in any batch (the counts of
  groups sampled and of those with signal are logged)."""
  train.run(
      tiny_config(
          num_steps=2,
          **{
              "reward.custom_file": PARITY_REWARD,
              "loss.dynamic_sampling": True,
              "loss.max_resample_rounds": 6,
              "eval.generation_configs": (),
          },
      ),
      str(tmp_path),
  )
  for r in grpo_rows(tmp_path):
    assert r["reward/zero_std_group_fraction"] == 0, r
    assert r["dynamic_sampling/rounds"] >= 2
    assert r["dynamic_sampling/groups_sampled"] == 8 * r["dynamic_sampling/rounds"]
    assert 8 <= r["dynamic_sampling/signal_groups_sampled"] < r["dynamic_sampling/groups_sampled"]


# ----------------------------------------------------------------------- all together


def test_three_steps_with_every_knob_on(tmp_path):
  """num_epochs, KL in reward, an EMA reference refresh, advantage clipping, dynamic sampling
  and a learned judge in one run: it trains 3 steps, the KL penalty shows up once the policy
  moved, the clip binds, every batch is full of signal groups although half the prompts (even
  answers: tests/data/parity_reward.py) give every completion the same reward from the plug-in,
  and the judge's score enters the total with its weight."""
  test_judge = pytest.importorskip("tests.rewards.test_judge")
  if not os.path.isdir(test_judge.QWEN_TOK):  # the judge folder takes the Qwen tokenizer
    pytest.skip(f"the Qwen tokenizer files are not at {test_judge.QWEN_TOK}")
  torch = test_judge.torch
  torch.manual_seed(0)
  judge_dir = test_judge._save(
      test_judge.transformers.Qwen3ForSequenceClassification(
          test_judge._qwen3_config(num_labels=1, tie_word_embeddings=True)
      ),
      tmp_path / "judge",
  )
  config = tiny_config(
      num_steps=0,
      num_epochs=1,
      beta=0.05,
      kl_in_reward=True,
      **{
          "data.arithmetic.num_train": 24,
          "reference.refresh_every_steps": 1,
          "reference.refresh_mix": 0.5,
          "loss.advantage_clip": 1.0,
          "loss.dynamic_sampling": True,
          "loss.max_resample_rounds": 6,
          "reward.custom_file": PARITY_REWARD,
          "eval.generation_configs": (),
          "reward.judge.path": judge_dir,
          "reward.judge.mode": "classifier",
          "reward.judge.weight": 0.5,
          "reward.judge.batch_size": 32,
          "reward.judge.max_length": 64,
          "reward.judge.dtype": "float32",
          "reward.judge.template": "{prompt} -> {completion}",
      },
  )
  assert not configuration.validate(config, num_devices=8)
  summary = train.run(config, str(tmp_path / "run"))
  assert summary["final_step"] == 3
  rows = grpo_rows(tmp_path / "run")
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert rows[0]["reward/kl_penalty"] == pytest.approx(0, abs=1e-6)  # ref == policy at first
  assert rows[-1]["reward/kl_penalty"] > 0
  assert rows[-1]["reward/total_with_kl"] == pytest.approx(
      rows[-1]["reward/total"] - rows[-1]["reward/kl_penalty"], abs=1e-5
  )
  assert max(r["advantages/clip_fraction"] for r in rows) > 0
  for r in rows:  # the judge's scores vary within every group: no resampling needed
    assert r["reward/zero_std_group_fraction"] == 0, r
    assert r["dynamic_sampling/rounds"] >= 1
  for r in rows:  # weights: answer_match 1, answer_format 0.1, the plug-in 1, the judge 0.5
    assert 0 < r["reward/judge"] < 1
    assert r["reward/total"] == pytest.approx(
        r["reward/answer_match"]
        + 0.1 * r["reward/answer_format"]
        + r["reward/custom"]
        + 0.5 * r["reward/judge"],
        abs=1e-5,
    ), r
  _, saved = checkpoint_state(tmp_path / "run")
  ref, params = flat(saved["ref"]), flat(saved["train"]["params"])
  assert not any(np.array_equal(ref[k], params[k]) for k in ref)  # an EMA, not a copy
