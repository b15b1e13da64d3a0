"""Off-policy corrections (rl/corrections.py) against a NumPy reference, and in the update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.rl import corrections
from grpo_jax.rl import losses
from grpo_jax.rl import step
from tests.rl.test_step import B
from tests.rl.test_step import L
from tests.rl.test_step import _batch
from tests.rl.test_step import _logprob_fn
from tests.rl.test_step import _params

KINDS = ("tis", "sequence_is", "icepop", "geometric_mask")
# (kind, cap, low, high): each variant, the masks with and without token TIS on kept tokens.
CASES = [
    ("tis", 2.0, 0.0, 0.0),
    ("sequence_is", 3.0, 0.0, 0.0),
    ("icepop", 0.0, 0.5, 2.0),
    ("icepop", 1.5, 0.5, 2.0),
    ("geometric_mask", 0.0, 0.8, 1.25),
    ("geometric_mask", 1.5, 0.8, 1.25),
]


def _inputs(seed, b=12, t=9):
  """Trainer and sampler log-probs [b, t] with ratios on both sides of the bands, ragged masks
  (one row empty, one full) and NaN where the mask is 0."""
  rng = np.random.default_rng(seed)
  old = np.log(rng.uniform(0.05, 0.9, (b, t)))
  logp = old + rng.normal(0.0, 0.6, (b, t))
  lengths = rng.integers(1, t + 1, b)
  lengths[0], lengths[1] = 0, t
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
  logp = np.where(mask > 0, logp, np.nan).astype(np.float32)
  return logp, old.astype(np.float32), mask


def reference(kind, logp, old, mask, cap, low, high):
  """Weights and metrics, one sequence at a time in float64 (the module docstring's table)."""
  w = np.zeros(logp.shape)
  rejected_seqs, nonempty = 0, 0
  for i in range(logp.shape[0]):
    idx = np.flatnonzero(mask[i])
    if not len(idx):
      continue
    nonempty += 1
    log_r = logp[i, idx].astype(np.float64) - old[i, idx]
    r = np.exp(np.clip(log_r, -20, 20))
    tis = np.minimum(r, cap) if cap > 0 else None
    if kind == "tis":
      w[i, idx] = tis
    elif kind == "sequence_is":
      w[i, idx] = min(np.exp(np.clip(log_r.sum(), -20, 20)), cap)
    elif kind == "icepop":
      w[i, idx] = np.where((low <= r) & (r <= high), r if tis is None else tis, 0.0)
    else:
      geo = np.exp(np.clip(log_r.mean(), -20, 20))
      w[i, idx] = (1.0 if tis is None else tis) * float(low <= geo <= high)
    rejected_seqs += bool((w[i, idx] == 0).any())
  m = mask > 0
  metrics = {
      "correction_weight_mean": w[m].mean(),
      "correction_masked_frac": (w[m] == 0).mean(),
      "correction_masked_seq_frac": rejected_seqs / nonempty,
  }
  if cap > 0:
    metrics["correction_capped_frac"] = (w[m] >= cap).mean()
  return w, metrics


def _weights(kind, logp, old, mask, cap, low, high, seqs=losses.ROWS):
  return corrections.correction_weights(
      kind,
      jnp.asarray(logp),
      jnp.asarray(old),
      jnp.asarray(mask),
      cap=cap,
      low=low,
      high=high,
      seqs=seqs,
  )


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("kind,cap,low,high", CASES)
def test_weights_and_metrics_match_numpy(kind, cap, low, high, seed):
  logp, old, mask = _inputs(seed)
  w, metrics = _weights(kind, logp, old, mask, cap, low, high)
  w_ref, metrics_ref = reference(kind, logp, old, mask, cap, low, high)
  np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5, atol=1e-6)
  assert sorted(metrics) == sorted(metrics_ref)
  for k, v in metrics_ref.items():
    np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)
  assert np.all(np.asarray(w)[mask == 0] == 0)


def test_the_cases_reject_and_cap_something():
  """The references above are not vacuous: on these inputs each mask rejects some tokens and
  keeps others, and each cap binds somewhere."""
  logp, old, mask = _inputs(0)
  for kind, cap, low, high in CASES:
    _, m = reference(kind, logp, old, mask, cap, low, high)
    if kind in ("icepop", "geometric_mask"):
      assert 0 < m["correction_masked_frac"] < 1, (kind, m)
    if cap > 0:
      assert 0 < m["correction_capped_frac"] < 1, (kind, cap, m)


def test_tis_is_the_existing_token_tis_and_off_without_a_cap():
  logp, old, mask = _inputs(5)
  w, _ = _weights("tis", logp, old, mask, 2.0, 0.0, 0.0)
  expected = np.where(mask > 0, losses.tis_weights(jnp.asarray(logp), jnp.asarray(old), 2.0), 0)
  np.testing.assert_array_equal(np.asarray(w), expected)
  assert _weights("tis", logp, old, mask, 0.0, 0.5, 2.0) == (None, {})
  assert not corrections.active("tis", 0.0)
  assert all(corrections.active(k, 0.0) for k in KINDS if k != "tis")


@pytest.mark.parametrize("kind,cap,low,high", CASES)
def test_no_gradient_flows_through_the_weights(kind, cap, low, high):
  logp, old, mask = _inputs(1)

  def total(lp, o):
    w, _ = corrections.correction_weights(
        kind, lp, o, jnp.asarray(mask), cap=cap, low=low, high=high
    )
    return (w * lp).sum()  # d/d logp of sum(sg(w) * logp) is w itself

  g_logp, g_old = jax.grad(total, argnums=(0, 1))(jnp.asarray(logp), jnp.asarray(old))
  w, _ = _weights(kind, logp, old, mask, cap, low, high)
  np.testing.assert_array_equal(np.asarray(g_logp), np.asarray(w))
  np.testing.assert_array_equal(np.asarray(g_old), 0.0)


def test_thresholds_at_their_edges():
  """A ratio at a band's end is kept (verl's `>=` and `<=`), one just past it is not; a weight
  at the cap is the cap; a geometric mean of 1 keeps a sequence whose tokens are far off."""
  d = 1e-3
  log_r = np.array([[0.0, 0.0, 0.0], [d, -d, 0.0], [d, 0.0, 0.0], [3.0, -3.0, 0.0]], np.float32)
  old = np.full(log_r.shape, -1.0, np.float32)
  logp, mask = old + log_r, np.ones(log_r.shape, np.int32)

  w, m = _weights("icepop", logp, old, mask, 0.0, 1.0, 1.0)
  np.testing.assert_array_equal(np.asarray(w) > 0, log_r == 0)
  np.testing.assert_array_equal(np.asarray(w)[log_r == 0], 1.0)
  assert float(m["correction_masked_seq_frac"]) == 0.75
  w, _ = _weights("icepop", logp, old, mask, 0.0, 0.0, 1.0)  # low = 0: only the high end
  np.testing.assert_array_equal(np.asarray(w) > 0, log_r <= 0)

  w, m = _weights("geometric_mask", logp, old, mask, 0.0, 1.0, 1.0)
  np.testing.assert_array_equal(np.asarray(w), [[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 1, 1]])
  assert float(m["correction_masked_seq_frac"]) == 0.25

  for kind in ("tis", "sequence_is"):
    w, m = _weights(kind, logp[:1], old[:1], mask[:1], 1.0, 0.0, 0.0)
    np.testing.assert_array_equal(np.asarray(w), 1.0)
    assert float(m["correction_capped_frac"]) == 1.0


def test_extreme_log_ratios_stay_finite():
  old = np.zeros((2, 4), np.float32)
  logp = np.array([[1e3, 0, 0, 0], [-1e3, 0, 0, 0]], np.float32)
  mask = np.ones((2, 4), np.int32)
  for kind, cap, low, high in CASES:
    w, metrics = _weights(kind, logp, old, mask, cap, low, high)
    assert np.isfinite(np.asarray(w)).all(), kind
    assert all(np.isfinite(float(v)) for v in metrics.values()), kind
  w, _ = _weights("sequence_is", logp, old, mask, 3.0, 0.0, 0.0)
  np.testing.assert_allclose(np.asarray(w), [[3.0] * 4, [np.exp(-20.0)] * 4], rtol=1e-6)


@pytest.mark.parametrize("kind,cap,low,high", CASES)
def test_packed_rows_give_the_padded_weights(kind, cap, low, high):
  """Three padded rows per packed row, each a segment: the same weights and metrics."""
  logp, old, mask = _inputs(2)
  b, t = mask.shape
  seqs = losses.Segments(jnp.asarray(np.repeat(np.arange(b), t).reshape(b // 3, 3 * t)), b)
  packed = [x.reshape(b // 3, 3 * t) for x in (logp, old, mask)]
  w, metrics = _weights(kind, logp, old, mask, cap, low, high)
  w2, metrics2 = _weights(kind, *packed, cap, low, high, seqs=seqs)
  np.testing.assert_allclose(np.asarray(w2).reshape(b, t), np.asarray(w), rtol=1e-6)
  for k in metrics:
    np.testing.assert_allclose(float(metrics2[k]), float(metrics[k]), rtol=1e-6, err_msg=k)


# ------------------------------------------------------------------------------- the update


def _step_batch(seed):
  """test_step's batch with the sampler's log-probs: the old ones plus noise."""
  batch = _batch(seed, 0.0)
  rng = np.random.default_rng(seed + 100)
  noise = rng.normal(0.0, 0.5, batch["old_logp"].shape).astype(np.float32)
  return dict(batch, sampler_logp=batch["old_logp"] + noise)


def _settings(**kw):
  return step.LossSettings(beta=0.0, clip_eps=0.2, max_completion_length=L, **kw)


def _loss_and_grads(settings, batch, num_micro=1):
  def loss_fn(p, mb):
    return step.grpo_micro_loss(p, mb, logprob_fn=_logprob_fn, settings=settings)

  fn = jax.jit(step.accumulate_gradients, static_argnums=(0, 3, 4))
  return fn(loss_fn, _params(), batch, num_micro, settings.loss_agg_mode)


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_the_default_update_is_todays(cap):
  """offpolicy_correction="tis" (the default) gives bit for bit the loss and gradients of the
  step before corrections.py: policy_loss with losses.tis_weights when tis_cap > 0, else none."""
  batch = _step_batch(0)
  if not cap:
    batch = {k: v for k, v in batch.items() if k != "sampler_logp"}

  def before(params, mb):
    return losses.policy_loss(
        _logprob_fn(params, mb["input_ids"], mb["attention_mask"]),
        mb["old_logp"],
        None,
        mb["advantages"],
        mb["completion_mask"],
        clip_eps=0.2,
        beta=0.0,
        max_completion_length=L,
        tis_weights=losses.tis_weights(mb["old_logp"], mb["sampler_logp"], cap) if cap else None,
    )

  mode = "seq-mean-token-mean"
  fn = jax.jit(step.accumulate_gradients, static_argnums=(0, 3, 4))
  loss0, grads0, metrics0 = fn(before, _params(), batch, 1, mode)
  loss, grads, metrics = _loss_and_grads(_settings(tis_cap=cap), batch)
  np.testing.assert_array_equal(loss, loss0)
  jax.tree.map(np.testing.assert_array_equal, grads, grads0)
  for k in metrics0:
    np.testing.assert_array_equal(metrics[k], metrics0[k], err_msg=k)
  assert ("correction_weight_mean" in metrics) == (cap > 0)


def _update(settings, batch, num_micro=2):
  opt = optax.sgd(0.1)  # not Adam: its first step is about lr * sign(g), whatever the weights
  update = jax.jit(step.make_grpo_update(_logprob_fn, opt, settings, num_micro))
  return update(step.init_state(_params(), opt), batch)


def test_each_variant_updates_and_differs_or_matches_as_expected():
  batch = _step_batch(1)
  plain_state, _ = _update(_settings(), batch)
  states = {}
  for kind, cap, low, high in CASES:
    settings = _settings(
        offpolicy_correction=kind, tis_cap=cap, correction_low=low, correction_high=high
    )
    state, metrics = _update(settings, batch)
    assert float(metrics["skipped"]) == 0 and np.isfinite(float(metrics["loss"])), kind
    assert 0 < float(metrics["correction_weight_mean"]), kind
    states[kind, cap] = state["params"]
    # Weights other than 1 move the parameters elsewhere than the uncorrected update.
    diff = max(
        float(jnp.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(plain_state["params"]))
    )
    assert diff > 1e-6, kind
  # ... and each variant is its own: no two cases give the same update.
  leaves = [np.concatenate([x.ravel() for x in jax.tree.leaves(p)]) for p in states.values()]
  for i in range(len(leaves)):
    for j in range(i):
      assert np.abs(leaves[i] - leaves[j]).max() > 1e-7, (list(states)[i], list(states)[j])


@pytest.mark.parametrize(
    "kind,cap,low,high,same_as",
    [
        # A band wide enough to keep everything: weights 1, the uncorrected update.
        ("geometric_mask", 0.0, 0.0, 1e30, None),
        # ... or the untruncated ratio: token TIS with a cap no ratio reaches.
        ("icepop", 0.0, 0.0, 1e30, ("tis", 1e30)),
        # With a band, icepop's truncated kept tokens equal TIS where nothing is rejected.
        ("icepop", 2.0, 0.0, 1e30, ("tis", 2.0)),
    ],
)
def test_variants_that_reduce_to_another_give_its_update(kind, cap, low, high, same_as):
  batch = _step_batch(2)
  settings = _settings(
      offpolicy_correction=kind, tis_cap=cap, correction_low=low, correction_high=high
  )
  other = (
      _settings()
      if same_as is None
      else _settings(offpolicy_correction=same_as[0], tis_cap=same_as[1])
  )
  state, _ = _update(settings, batch)
  state2, _ = _update(other, batch)
  for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(state2["params"])):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_on_policy_samples_get_weight_one():
  """sampler == trainer: every variant weighs each token 1 and rejects none."""
  batch = _step_batch(3)
  batch["sampler_logp"] = batch["old_logp"]
  for kind, cap, low, high in CASES:
    w, metrics = corrections.correction_weights(
        kind,
        batch["old_logp"],
        batch["sampler_logp"],
        batch["completion_mask"],
        cap=cap,
        low=low,
        high=high,
    )
    m = np.asarray(batch["completion_mask"]) > 0
    np.testing.assert_array_equal(np.asarray(w)[m], 1.0)
    assert float(metrics["correction_masked_frac"]) == 0


@pytest.mark.parametrize("kind,cap,low,high", CASES)
def test_micro_batches_give_the_whole_batch_gradient(kind, cap, low, high):
  """Sequence-level weights see whole sequences in every micro-batch: accumulation stays exact."""
  batch = _step_batch(4)
  settings = _settings(
      offpolicy_correction=kind, tis_cap=cap, correction_low=low, correction_high=high
  )
  loss1, grads1, _ = _loss_and_grads(settings, batch, 1)
  for n in (2, B):
    loss, grads, _ = _loss_and_grads(settings, batch, n)
    np.testing.assert_allclose(loss, loss1, rtol=1e-5, atol=1e-6)
    for k in grads1:
      np.testing.assert_allclose(grads[k], grads1[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_off_policy_with_a_correction_takes_the_trainers_old_log_probs():
  """max_staleness > 0: the sampler's log-probs are the old ones unless a correction is on;
  with one, the trainer's (the proximal policy), so the correction weighs trainer vs sampler."""
  from configs import tiny
  from grpo_jax.rl import step as step_lib

  config = tiny.get_config()
  assert step_lib.old_logprobs_source(config, True) == ""
  config.rollout.max_staleness = 1
  assert step_lib.old_logprobs_source(config, True) == "sampler"
  config.loss.tis_cap = 2.0
  assert step_lib.old_logprobs_source(config, True) == "trainer"
  config.loss.tis_cap = 0.0
  config.loss.offpolicy_correction = "icepop"
  assert step_lib.old_logprobs_source(config, True) == "trainer"
