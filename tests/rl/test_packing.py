"""Packed rows (rl/packing.py): the plan keeps sequences whole within the budget in few shapes;
the gather moves every field with its token; the update's loss and gradients on packed rows equal
the padded layout's for every aggregation mode and policy loss, micro-batched or not; GrpoStep's
inputs and update agree end to end (KL in the loss or in the reward, TIS, advantage clip, DAPO's
dynamic sampling, several passes, LoRA); the loop's metrics agree (slow)."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import configuration
from grpo_jax import train
from grpo_jax.models import PRESETS
from grpo_jax.models import build
from grpo_jax.models import build_model
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.logprobs import packed_logprobs
from grpo_jax.rl import losses
from grpo_jax.rl import packing
from grpo_jax.rl import step as step_lib
from grpo_jax.rl.reference import Reference
from grpo_jax.rollout import Rollout
from grpo_jax.rollout.source import Scored
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

# -------------------------------------------------------------------------------- the plan


def _long_tailed(rng, n, budget):
  return np.minimum(rng.geometric(3.0 / budget, n) + 1, budget)


@pytest.mark.parametrize("num_micro", [1, 2, 4])
def test_plan_keeps_sequences_whole_within_the_budget_in_few_shapes(num_micro):
  rng = np.random.default_rng(num_micro)
  budget, n, shards = 40, 64, 2
  sizes = set()
  for _ in range(30):
    lengths = _long_tailed(rng, n, budget)
    plan = packing.plan_rows(lengths, budget, num_micro=num_micro, row_multiple=shards)
    again = packing.plan_rows(lengths, budget, num_micro=num_micro, row_multiple=shards)
    np.testing.assert_array_equal(plan.row_of, again.row_of)  # deterministic
    np.testing.assert_array_equal(plan.offset_of, again.offset_of)
    assert plan.rows == plan.rows_per_micro * num_micro and plan.rows_per_micro % shards == 0
    assert plan.rows_per_micro <= n // num_micro
    used = np.zeros((plan.rows, budget), np.int32)
    for i, (r, o, l) in enumerate(zip(plan.row_of, plan.offset_of, lengths)):
      assert r % num_micro == i % num_micro  # micro-batch k's sequences in its rows
      assert o + l <= budget  # whole, inside its row
      used[r, o : o + l] += 1
    assert used.max() == 1  # no overlap
    assert plan.fill == pytest.approx(lengths.sum() / (plan.rows * budget))
    sizes.add(plan.rows_per_micro)
  assert len(sizes) <= packing.NUM_BUCKETS


def test_first_fit_decreasing_packs_tightly_and_refuses_what_does_not_fit():
  row, offset, used = packing.first_fit_decreasing(np.array([3, 7, 5, 5, 2, 8]), 10)
  assert used == 3  # 30 tokens in 3 rows of 10: [8, 2], [7, 3], [5, 5]
  assert (row[5], offset[5], row[4], offset[4]) == (0, 0, 0, 8)
  with pytest.raises(ValueError, match="does not fit"):
    packing.first_fit_decreasing(np.array([11]), 10)


# ------------------------------------------------------------------------------ the gather


def _padded_batch(rng, n, p, c, vocab, *, fields=("old_logp", "ref_logp", "sampler_logp")):
  """[left-padded prompt; right-padded completion] rows of ragged lengths (some completions
  empty), with the per-token fields the update takes."""
  plen = rng.integers(1, p + 1, n)
  clen = rng.integers(0, c + 1, n)
  clen[0], clen[1] = c, 0
  pm = (np.arange(p)[None] >= (p - plen)[:, None]).astype(np.int32)
  cm = (np.arange(c)[None] < clen[:, None]).astype(np.int32)
  am = np.concatenate([pm, cm], 1)
  batch = dict(
      input_ids=(rng.integers(1, vocab, (n, p + c)) * am).astype(np.int32),
      attention_mask=am,
      completion_mask=cm,
      advantages=np.clip(rng.normal(size=n), -1.5, 1.5).astype(np.float32),
  )
  for f in fields:
    batch[f] = (cm * rng.normal(-2.0, 0.3, (n, c))).astype(np.float32)
  return jax.tree.map(jnp.asarray, batch)


def _packed(batch, num_micro, row_multiple=1):
  s = batch["input_ids"].shape[1]
  plan = packing.plan_rows(
      np.asarray(batch["attention_mask"]).sum(1), s, num_micro=num_micro, row_multiple=row_multiple
  )
  return packing.pack(
      batch,
      jnp.asarray(plan.row_of),
      jnp.asarray(plan.offset_of),
      rows=plan.rows,
      num_micro=num_micro,
  )


@pytest.mark.parametrize("num_micro", [1, 2])
def test_pack_moves_every_field_with_its_token(num_micro):
  rng = np.random.default_rng(0)
  n, p, c = 12, 5, 6
  batch = _padded_batch(rng, n, p, c, 50)
  out = jax.tree.map(np.asarray, _packed(batch, num_micro))
  b = jax.tree.map(np.asarray, batch)
  seq_of = packing.sequence_index(jnp.asarray(out["segment_ids"]), num_micro)
  for i in range(n):
    real = np.flatnonzero(b["attention_mask"][i])
    here = (np.asarray(seq_of) == i) & (out["segment_ids"] > 0)
    r = np.flatnonzero(here.any(1))
    assert len(r) == 1 and r[0] % num_micro == i % num_micro  # one row, its micro-batch's
    slots = np.flatnonzero(here[r[0]])
    assert np.all(np.diff(slots) == 1)  # contiguous, in order
    np.testing.assert_array_equal(out["input_ids"][r[0], slots], b["input_ids"][i, real])
    np.testing.assert_array_equal(out["positions"][r[0], slots], np.arange(len(real)))
    comp = real[real >= p] - p
    tail = slots[len(slots) - len(comp) :]
    for f in ("completion_mask", "old_logp", "ref_logp", "sampler_logp"):
      np.testing.assert_array_equal(out[f][r[0], tail], b[f][i, comp])
      assert not out[f][r[0], slots[: len(slots) - len(comp)]].any()  # prompt tokens: 0
    assert np.all(out["advantages"][r[0], slots] == b["advantages"][i])
  assert not out["completion_mask"][out["segment_ids"] == 0].any()  # padding trains on nothing
  for f in ("old_logp", "completion_mask"):
    back = packing.unpack(jnp.asarray(out[f]), jnp.asarray(out["sequences"]["slot"]))
    np.testing.assert_array_equal(np.asarray(back), b[f] * b["completion_mask"])

  # The LM head's slots: exactly the real completion tokens', per micro-batch in its own rows.
  slot_nc = np.asarray(out["sequences"]["slot"])
  size = out["input_ids"].size
  heads = np.asarray(
      packing.global_slots(
          jnp.asarray(out["head_slots"]), rows=len(out["input_ids"]), num_micro=num_micro
      )
  )
  assert sorted(heads[heads < size]) == sorted(slot_nc[slot_nc < size])
  rows_of = heads // out["input_ids"].shape[1]
  k_h = np.arange(len(heads))[:, None] % num_micro
  assert np.all((rows_of % num_micro == k_h) | (heads == size))  # head row h * n + k: micro k's


def test_head_rows_cover_each_micro_batch_in_whole_buckets():
  completion_n = np.array([30, 0, 25, 7, 40, 3, 10, 10])
  assert packing.head_rows(completion_n, 48) == 3  # 125 tokens in rows of 48
  # micro-batch 0 holds 30 + 25 + 40 + 10 = 105 tokens (3 rows), 1 holds 20: 3 rows each
  assert packing.head_rows(completion_n, 48, num_micro=2) == 6
  assert packing.head_rows(completion_n, 48, num_micro=2, row_multiple=2) == 8  # whole shares


# ------------------------------------------------- the update: packed == padded, every mode
# (the decoder itself: tests/models/test_packed_attention.py)

N, P, C = 8, 6, 7
POLICY_LOSSES = {  # name -> LossSettings fields
    "ppo_clip": dict(policy_loss="ppo_clip", kl_kind="k1"),
    "clip_higher": dict(policy_loss="ppo_clip", clip_eps_high=0.28, kl_kind="k2"),
    "dual_clip": dict(policy_loss="ppo_clip", clip_ratio_c=3.0, kl_kind="k3"),
    "gspo": dict(policy_loss="gspo", clip_eps=0.003, clip_eps_high=0.004, kl_kind="k3"),
}


def _bigram(vocab, seed=0):
  """A differentiable stand-in for the model, the same in both layouts: token t's log-prob
  from the token before it in its sequence (padded: the column before; packed: the slot
  before, in its segment)."""
  rng = np.random.default_rng(seed)
  params = {
      "emb": jnp.asarray(rng.normal(size=(vocab, 8)), jnp.float32),
      "out": jnp.asarray(rng.normal(size=(8, vocab)), jnp.float32),
  }

  def next_logp(params, ids):
    logp = jax.nn.log_softmax(params["emb"][ids[:, :-1]] @ params["out"], -1)
    return jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]

  def padded_fn(params, ids, mask):
    return next_logp(params, ids)[:, -C:]

  def packed_fn(params, ids, seg, pos, head_slots):
    del head_slots  # every slot: the loss's mask picks the completion tokens
    return jnp.pad(next_logp(params, ids), ((0, 0), (1, 0)))

  return params, padded_fn, packed_fn


@pytest.fixture(scope="module")
def bigram_model():
  params, padded_fn, packed_fn = _bigram(50)
  batch = _padded_batch(np.random.default_rng(1), N, P, C, 50)
  logp = padded_fn(params, batch["input_ids"], batch["attention_mask"])
  return _near_policy(params, padded_fn, packed_fn, batch, logp)


@pytest.fixture(scope="module")
def decoder_model():
  return _decoder_model()


def _near_policy(params, padded_fn, packed_fn, batch, logp):
  # old/ref/sampler log-probs near the policy's own, so ratios straddle the clip ranges
  rng = np.random.default_rng(2)
  for f, scale in (("old_logp", 0.3), ("ref_logp", 0.2), ("sampler_logp", 0.3)):
    batch[f] = (logp + scale * jnp.asarray(rng.normal(size=logp.shape), jnp.float32)) * batch[
        "completion_mask"
    ]
  return params, padded_fn, packed_fn, batch


def _decoder_model():
  cfg = dataclasses.replace(PRESETS["tiny-qwen3"], dtype="float32", param_dtype="float32")
  graphdef, params = nnx.split(build_model(cfg, seed=0))

  def padded_fn(params, ids, mask):
    return completion_logprobs(nnx.merge(graphdef, params), ids, mask, C)

  def packed_fn(params, ids, seg, pos, head_slots):
    return packed_logprobs(nnx.merge(graphdef, params), ids, seg, pos, head_slots)

  batch = _padded_batch(np.random.default_rng(1), N, P, C, cfg.vocab_size)
  logp = padded_fn(params, batch["input_ids"], batch["attention_mask"])
  return _near_policy(params, padded_fn, packed_fn, batch, logp)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
def test_packed_loss_and_gradients_equal_padded(bigram_model, policy_loss):
  """Every aggregation mode x this policy loss (each with its KL kind), beta > 0, TIS, clipped
  advantages, ragged lengths (one completion empty); whole batch and 2 micro-batches. Loss
  within 1e-6 of its scale, gradients within 1e-6 relative (f32, CPU). On the bigram stand-in
  (the loss code; fast): the decoder's version is the slow test below."""
  _check_matrix(bigram_model, policy_loss)


@pytest.mark.slow  # ~45 s each: 12 gradients of the decoder compiled in one program
@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
def test_packed_decoder_loss_and_gradients_equal_padded(decoder_model, policy_loss):
  """The same matrix on a random tiny decoder (tiny-qwen3, f32): packed attention included."""
  _check_matrix(decoder_model, policy_loss)


def _check_matrix(model, policy_loss):
  params, padded_fn, packed_fn, batch = model
  modes = sorted(losses.LOSS_AGG_MODES.names())

  @jax.jit
  def both(params, batch, packed1, packed2):
    out = {}
    for mode in modes:
      settings = step_lib.LossSettings(
          beta=0.1,
          clip_eps=POLICY_LOSSES[policy_loss].get("clip_eps", 0.2),
          loss_agg_mode=mode,
          max_completion_length=C,
          tis_cap=2.0,
          **{k: v for k, v in POLICY_LOSSES[policy_loss].items() if k != "clip_eps"},
      )
      for name, fn, data, n_micro, layout in (
          ("padded", padded_fn, batch, 1, packing.PADDED),
          ("packed", packed_fn, packed1, 1, packing.PackedLayout(N, 1)),
          ("packed2", packed_fn, packed2, 2, packing.PackedLayout(N // 2, 2)),
      ):
        loss_fn = lambda p, mb, fn=fn, layout=layout, settings=settings: step_lib.grpo_micro_loss(
            p, mb, logprob_fn=fn, settings=settings, layout=layout
        )
        data = {k: v for k, v in data.items() if k != "sequences"}
        out[mode, name] = step_lib.accumulate_gradients(
            loss_fn, params, data, n_micro, mode, layout
        )
    return out

  out = both(params, batch, _packed(batch, 1), _packed(batch, 2))
  for mode in modes:
    loss, grads, metrics = out[mode, "padded"]
    scale = float(jnp.abs(metrics["pg_loss"])) + 1e-3  # the loss can sit near 0
    for name in ("packed", "packed2"):
      l2, g2, m2 = out[mode, name]
      assert abs(float(l2) - float(loss)) <= 1e-6 * scale, (mode, name, l2, loss)
      flat, flat2 = jax.tree.leaves(grads), jax.tree.leaves(g2)
      err = _rel(
          np.concatenate([x.ravel() for x in flat2]), np.concatenate([x.ravel() for x in flat])
      )
      assert err <= 1e-6, (mode, name, err)
      if name == "packed":  # the same sequences in one pass: the same token metrics
        for k in ("kl", "clip_frac", "ppo_kl", "ratio_mean"):
          assert float(m2[k]) == pytest.approx(float(metrics[k]), rel=1e-5, abs=1e-7), k
    assert float(metrics["clip_frac"]) > 0 or policy_loss == "gspo"  # the clip is exercised


# -------------------------------------------------- GrpoStep: inputs and update end to end


def _scored(config, policy, seed):
  """A made-up scored batch of the config's shape: ragged completions (one empty), rewards that
  vary in most groups and not in one (dynamic sampling drops it)."""
  rng = np.random.default_rng(seed)
  b, g, p, c = config.batch_size, config.num_generations, 6, config.max_completion_length
  n = b * g
  plen = rng.integers(2, p + 1, b)
  pmask = (np.arange(p)[None] >= (p - plen)[:, None]).astype(np.int32)
  clen = rng.integers(1, c + 1, n)
  clen[1] = 0
  cmask = (np.arange(c)[None] < clen[:, None]).astype(np.int32)
  vocab = policy.model_config.vocab_size
  rewards = rng.uniform(0, 1, n).astype(np.float32)
  rewards[:g] = 0.5
  logprobs = jnp.asarray(cmask * rng.normal(-2.5, 0.5, (n, c)), jnp.float32)
  rollout = Rollout(
      tokens=jnp.asarray(rng.integers(1, vocab, (n, c)) * cmask, jnp.int32),
      mask=jnp.asarray(cmask),
      logprobs=logprobs,
      raw_logprobs=logprobs,
      lengths=jnp.asarray(clen, jnp.int32),
      truncated=jnp.asarray(clen == c),
      tool_mask=jnp.zeros_like(jnp.asarray(cmask)),
  )
  prompt = dict(
      ids=jnp.asarray(rng.integers(1, vocab, (b, p)) * pmask, jnp.int32), mask=jnp.asarray(pmask)
  )
  return Scored(prompt=prompt, rollout=rollout, rewards=jnp.asarray(rewards), host={}, figures={})


def _step_both(overrides, seed=0):
  """GrpoStep.inputs + update + figures, padded and packed, from the same state and batch."""
  out = []
  for pack in (False, True):
    config = tiny_config(pack_sequences=pack, **overrides)
    assert not configuration.validate(config, num_devices=8)
    mesh = build.make_mesh(config)
    policy = build.make_policy(config, mesh)
    fns = step_lib.build(config, policy, mesh)
    reference = Reference(config, policy, fns, mesh)
    reference.start(policy.params)
    grpo = step_lib.GrpoStep(config, fns, reference, mesh, matches_trainer=True)
    batch = _scored(config, policy, seed)
    state = fns.init(policy.params)
    upd, kl_rewards = grpo.inputs(state, batch)
    figures = grpo.figures(batch, upd, kl_rewards)
    state, metrics = grpo.update(state, upd)
    out.append((jax.device_get(state["params"]), jax.device_get({**metrics, **figures})))
  return out


@pytest.mark.parametrize(
    "overrides",
    [
        {  # KL in the loss, TIS (old log-probs from a trainer pass), clip, 2 micro-batches
            "beta": 0.1,
            "loss.tis_cap": 2.0,
            "loss.advantage_clip": 1.0,
            "loss.loss_agg_mode": "seq-mean-token-mean",
            "micro_batch_size": 16,
        },
        {  # KL in the reward (packed fold_kl), DAPO dynamic sampling, GSPO, two passes
            "beta": 0.1,
            "kl_in_reward": True,
            "loss.dynamic_sampling": True,
            "loss.policy_loss": "gspo",
            "loss.loss_agg_mode": "seq-mean-token-sum-norm",
        },
        {  # a sequence mask over segments (rl/corrections.py; ~97% of these rows masked, the
            # rest with token TIS), 2 micro-batches
            "loss.offpolicy_correction": "geometric_mask",
            "loss.correction_low": 0.2,
            "loss.correction_high": 5.0,
            "loss.tis_cap": 2.0,
            "loss.loss_agg_mode": "token-mean",
            "micro_batch_size": 16,
        },
    ],
    ids=["kl_loss_tis_clip_micro", "kl_reward_dynamic_gspo", "geometric_mask_micro"],
)
@pytest.mark.slow  # ~40 s each: a tiny_config policy's update compiled in both layouts
def test_grpo_step_packed_equals_padded(overrides):
  """Every metric (loss, grad norm, KL, clip fractions, advantages' statistics) within 1e-5;
  the params after the AdamW step within 1e-5 relative: AdamW divides each coordinate by its
  own gradient's size, which lifts the f32 noise of near-zero gradient coordinates (the
  gradients themselves: 1e-6, test_packed_*_loss_and_gradients_equal_padded)."""
  (params_a, metrics_a), (params_b, metrics_b) = _step_both(overrides)
  for k, v in metrics_a.items():
    assert float(metrics_b[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
  la, lb = jax.tree.leaves(params_a), jax.tree.leaves(params_b)
  assert (
      _rel(np.concatenate([x.ravel() for x in lb]), np.concatenate([x.ravel() for x in la])) < 1e-5
  )


@pytest.mark.slow  # ~40 s
def test_lora_step_packed_equals_padded():
  """LoRA: the adapters train on packed rows, the reference is the base run packed."""
  overrides = {"lora.rank": 4, "beta": 0.1, "micro_batch_size": 16}
  (params_a, metrics_a), (params_b, metrics_b) = _step_both(overrides, seed=3)
  assert float(metrics_b["grad_norm"]) == pytest.approx(float(metrics_a["grad_norm"]), rel=1e-5)
  assert float(metrics_a["grad_norm"]) > 0
  la, lb = jax.tree.leaves(params_a), jax.tree.leaves(params_b)
  assert (
      _rel(np.concatenate([x.ravel() for x in lb]), np.concatenate([x.ravel() for x in la])) < 1e-6
  )


def test_packing_is_refused_where_it_is_not_built():
  for overrides, field in (
      ({"model.impl": "maxtext"}, "pack_sequences"),
      ({"model.attention_impl": "fused"}, "model.attention_impl"),
  ):
    errors = configuration.validate(tiny_config(pack_sequences=True, **overrides), num_devices=8)
    assert any(e.startswith(field + "=") for e in errors), errors
  errors = configuration.validate(tiny_config(pack_sequences=True), num_devices=8, num_processes=2)
  assert any(e.startswith("pack_sequences=") and "2 processes" in e for e in errors), errors


# -------------------------------------------------------------------------------- the loop


@pytest.mark.slow  # two 3-step runs of the demo loop (~60 s on 2 cores)
def test_loop_metrics_equal_padded_vs_packed(tmp_path):
  """configs/tiny.py shrunk (tests/test_train.py: tiny_config; micro-batches of 32 rows), 3 GRPO
  steps padded and packed: every logged metric but timings equal; losses and gradient norms
  within 1e-6 relative (of the loss's scale: an on-policy loss sits near 0)."""
  rows = {}
  for pack in (False, True):
    train.run(
        tiny_config(pack_sequences=pack, **{"eval.generation_configs": ()}),
        str(tmp_path / str(pack)),
    )
    rows[pack] = grpo_rows(tmp_path / str(pack))
  assert len(rows[True]) == len(rows[False]) == 3
  for a, b in zip(rows[False], rows[True]):
    for k, v in a.items():
      if k.startswith("perf/") or "time" in k or "per_sec" in k or not isinstance(v, float):
        continue
      if k.startswith("loss/") and k != "loss/grad_norm":
        assert abs(b[k] - v) <= 1e-6 * max(abs(v), 1e-1), (a["step"], k, v, b[k])
      else:
        assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (a["step"], k, v, b[k])
