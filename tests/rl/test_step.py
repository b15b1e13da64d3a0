"""The jitted update: gradient accumulation is exact, and non-finite updates are skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import losses
from grpo_jax.rl import step

B, S, L, V = 16, 10, 6, 11


def _logprob_fn(params, input_ids, attention_mask):
  """A tiny differentiable 'model': log-softmax of a per-token embedding times a matrix."""
  h = params["emb"][input_ids] * attention_mask[..., None]
  logits = h @ params["out"]
  logp = jax.nn.log_softmax(logits[:, -L - 1 : -1], -1)
  return jnp.take_along_axis(logp, input_ids[:, -L:, None], -1)[..., 0]


def _batch(seed, beta):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, V, (B, S)).astype(np.int32)
  lengths = rng.integers(1, L + 1, B)  # ragged completions
  cmask = (np.arange(L)[None] < lengths[:, None]).astype(np.int32)
  amask = np.concatenate([np.ones((B, S - L), np.int32), cmask], 1)
  batch = dict(
      input_ids=ids,
      attention_mask=amask,
      completion_mask=cmask,
      advantages=rng.normal(size=B).astype(np.float32),
      old_logp=np.log(rng.uniform(0.05, 0.5, (B, L))).astype(np.float32),
  )
  if beta:
    batch["ref_logp"] = np.log(rng.uniform(0.05, 0.5, (B, L))).astype(np.float32)
  return jax.tree.map(jnp.asarray, batch)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "emb": jnp.asarray(rng.normal(size=(V, 8)), jnp.float32),
      "out": jnp.asarray(rng.normal(size=(8, V)), jnp.float32),
  }


@pytest.mark.parametrize("mode", sorted(losses.LOSS_AGG_MODES.names()))
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_micro_batches_give_the_whole_batch_gradient(mode, beta):
  settings = step.LossSettings(beta=beta, clip_eps=0.2, loss_agg_mode=mode, max_completion_length=L)
  params, batch = _params(), _batch(1, beta)

  def loss_fn(p, mb):
    return step.grpo_micro_loss(p, mb, logprob_fn=_logprob_fn, settings=settings)

  ref_loss, ref_grads, ref_metrics = step.accumulate_gradients(loss_fn, params, batch, 1, mode)
  for n in (2, 4, 16):
    loss, grads, metrics = jax.jit(step.accumulate_gradients, static_argnums=(0, 3, 4))(
        loss_fn, params, batch, n, mode
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for k in ref_grads:
      np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6, err_msg=k)
    for k in ("pg_loss", "kl", "clip_frac", "ppo_kl", "ratio_mean", "ratio_max"):  # joined exactly
      np.testing.assert_allclose(metrics[k], ref_metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # The whole-batch loss is the definition in docs/design.md (policy_loss on all rows at once).
  direct, _ = losses.policy_loss(
      _logprob_fn(params, batch["input_ids"], batch["attention_mask"]),
      batch["old_logp"],
      batch.get("ref_logp"),
      batch["advantages"],
      batch["completion_mask"],
      clip_eps=0.2,
      beta=beta,
      loss_agg_mode=mode,
      max_completion_length=L,
  )
  np.testing.assert_allclose(ref_loss, direct, rtol=1e-6)


def test_nonfinite_update_is_skipped():
  import optax

  opt = optax.adamw(1e-2)
  params = _params()
  state = step.init_state(params, opt)
  grads = jax.tree.map(jnp.ones_like, params)
  new, m = step.apply_update(opt, state, jnp.float32(1.0), grads, {})
  assert float(m["skipped"]) == 0 and int(new["nonfinite_streak"]) == 0
  bad = jax.tree.map(lambda g: g.at[0, 0].set(jnp.nan), grads)
  new2, m2 = step.apply_update(opt, new, jnp.float32(1.0), bad, {})
  assert float(m2["skipped"]) == 1
  assert int(new2["nonfinite_streak"]) == 1 and int(new2["nonfinite_total"]) == 1
  jax.tree.map(np.testing.assert_array_equal, new["params"], new2["params"])
  jax.tree.map(np.testing.assert_array_equal, new["opt_state"], new2["opt_state"])
  new3, _ = step.apply_update(opt, new2, jnp.float32(jnp.inf), grads, {})
  assert int(new3["nonfinite_streak"]) == 2
  new4, _ = step.apply_update(opt, new3, jnp.float32(0.5), grads, {})
  assert int(new4["nonfinite_streak"]) == 0 and int(new4["nonfinite_total"]) == 2


@pytest.mark.parametrize("warmup_ratio,end_lr_ratio", [(0.0, 0.0), (0.0, 0.1), (0.1, 0.0)])
def test_the_schedule_is_warmup_cosine_and_a_zero_warmup_logs_nothing(
    warmup_ratio, end_lr_ratio, caplog
):
  """AdamW's learning rate follows optax's warmup + cosine schedule exactly; with no warmup
  (the CPU demo) optax's note on a non-positive `transition_steps` is not logged on every run."""
  import logging

  import optax

  caplog.set_level(logging.INFO)
  lr, total = 5e-4, 40
  kw = dict(b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=0.0)
  opt = step.make_optimizer(
      learning_rate=lr,
      total_steps=total,
      warmup_ratio=warmup_ratio,
      end_lr_ratio=end_lr_ratio,
      **kw,
  )
  assert not [r for r in caplog.records if "transition_steps" in r.getMessage()]
  warmup = int(round(warmup_ratio * total))
  want = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if warmup else lr,
      peak_value=lr,
      warmup_steps=warmup,
      decay_steps=total,
      end_value=lr * end_lr_ratio,
  )
  # The same updates, bit for bit, as AdamW on optax's own schedule, through the decay's end.
  ref = optax.adamw(want, b1=0.9, b2=0.99, weight_decay=0.0)
  params = {"w": jnp.zeros(3)}
  state, ref_state = opt.init(params), ref.init(params)
  for t in range(total + 2):
    grads = {"w": jnp.asarray([1.0, -2.0, 0.5]) * (t + 1)}
    updates, state = opt.update(grads, state, params)
    want_updates, ref_state = ref.update(grads, ref_state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(want_updates["w"]))
