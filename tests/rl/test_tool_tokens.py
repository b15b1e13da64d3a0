"""Tool-response tokens are context, not actions (issue 44): the update attends to them but
takes no loss and no KL on them, padded or packed; the KL in the reward sums the policy's
tokens only. Each test also moves an action token's value, so it fails if tool tokens were
counted and if nothing were counted at all."""

import jax
import numpy as np
import pytest

from grpo_jax.models import build
from grpo_jax.rl import packing
from grpo_jax.rl import step as step_lib
from grpo_jax.rollout import Rollout
from tests.test_train import tiny_config


@pytest.fixture(scope="module", params=[False, True], ids=["padded", "packed"])
def setup(request):
  config = tiny_config(beta=0.1, pack_sequences=request.param, **{"model.attention_impl": "xla"})
  mesh = build.make_mesh(config)
  policy = build.make_policy(config, mesh)
  fns = step_lib.build(config, policy, mesh)
  rows = packing.Packer(config, fns, mesh) if config.pack_sequences else packing.Padded(fns)
  return config, fns, policy, rows


def _rollout(config, rng):
  n, c = config.batch_size * config.num_generations, config.max_completion_length
  lengths = rng.integers(4, c + 1, n)
  mask = (np.arange(c)[None] < lengths[:, None]).astype(np.int32)
  tool = np.zeros((n, c), np.int32)
  tool[:, 1:3] = 1  # a 2-token response after each row's first token
  tokens = rng.integers(1, config.model.vocab_size, (n, c)) * mask
  return Rollout(
      tokens=tokens.astype(np.int32),
      mask=mask,
      logprobs=np.zeros((n, c), np.float32),
      raw_logprobs=np.zeros((n, c), np.float32),
      lengths=lengths.astype(np.int32),
      truncated=np.zeros(n, bool),
      tool_mask=tool * mask,
  )


def _update_batch(config, fns, rows, rng, shift=None):
  """The update's batch; `shift` (where, amount): old/ref log-probs moved at those tokens."""
  r = _rollout(config, np.random.default_rng(0))
  n, c = r.mask.shape
  prompts = np.ones((config.batch_size, 3), np.int32)
  rewards = np.random.default_rng(1).uniform(0, 1, n).astype(np.float32)
  upd = dict(fns.assemble(prompts, prompts, r, rewards))
  old = rng.normal(-2.0, 0.3, (n, c)).astype(np.float32)
  ref = old + rng.normal(0, 0.3, (n, c)).astype(np.float32)
  if shift is not None:
    where, amount = shift
    old, ref = old + amount * where, ref - amount * where
  upd["old_logp"], upd["ref_logp"] = old * r.mask, ref * r.mask
  return r, rows.rows(upd)


def _step(fns, policy, upd):
  state = fns.init(policy.params)
  state, metrics = fns.update(state, upd)
  return float(metrics["loss"]), jax.tree.map(np.asarray, state["params"])


def test_the_update_takes_no_loss_and_no_kl_on_tool_tokens(setup):
  config, fns, policy, rows = setup
  r, base = _update_batch(config, fns, rows, np.random.default_rng(2))
  tool = np.asarray(r.tool_mask, np.float32)
  action = np.asarray(r.action_mask, np.float32)
  assert tool.sum() > 0 and action.sum() > 0
  upd = {k: v for k, v in base.items()}
  np.testing.assert_array_equal(np.asarray(upd["kl_mask"] if "kl_mask" in upd else action), action)
  loss0, params0 = _step(fns, policy, upd)
  _, moved_tool = _update_batch(config, fns, rows, np.random.default_rng(2), (tool, 1.5))
  loss1, params1 = _step(fns, policy, moved_tool)
  assert loss1 == loss0
  jax.tree.map(np.testing.assert_array_equal, params1, params0)
  # The same move on the policy's own tokens changes the loss: the test can fail.
  _, moved_action = _update_batch(config, fns, rows, np.random.default_rng(2), (action, 1.5))
  loss2, _ = _step(fns, policy, moved_action)
  assert abs(loss2 - loss0) > 1e-4


def test_the_kl_in_the_reward_sums_the_policys_tokens_only(setup):
  config, fns, policy, rows = setup
  rng = np.random.default_rng(3)
  r, upd = _update_batch(config, fns, rows, rng)
  _, raw = _update_batch(config, fns, packing.Padded(fns), np.random.default_rng(3))
  n = r.mask.shape[0]
  rewards = np.random.default_rng(4).uniform(0, 1, n).astype(np.float32)
  _, penalized = rows.fold_kl(upd, rewards)
  d = np.asarray(raw["ref_logp"]) - np.asarray(raw["old_logp"])
  k3 = np.exp(d) - d - 1
  action, tool = np.asarray(r.action_mask) > 0, np.asarray(r.tool_mask) > 0
  want = rewards - 0.1 * np.where(action, k3, 0).sum(-1)
  np.testing.assert_allclose(np.asarray(penalized), want, rtol=1e-5, atol=1e-6)
  with_tool = rewards - 0.1 * np.where(action | tool, k3, 0).sum(-1)
  assert np.abs(with_tool - want).max() > 1e-3  # counting the tool tokens would show
