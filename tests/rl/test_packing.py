"""Packed rows (rl/packing.py): the plan keeps sequences whole within the budget in few shapes;
the gather moves every field with its token; the update's loss and gradients on packed rows equal
the padded layout's for every aggregation mode and policy loss, micro-batched or not; GrpoStep's
inputs and update agree end to end (KL in the loss or in the reward, TIS, advantage clip, DAPO's
dynamic sampling, several passes, LoRA); the loop's metrics agree (slow). MoE routing replay:
the routes move with their tokens, packed == padded in loss, gradients, route_mismatch and the
GrpoStep."""

import dataclasses
import functools

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


def _with_routes(batch, policy, seed):
  """The batch's rollout with recorded routes [N, P+C, L_moe, k] (routing replay): k distinct
  random experts for every real token (not the model's own top-k), -1 on padding."""
  cfg = policy.model_config
  g = batch.rollout.mask.shape[0] // batch.prompt["mask"].shape[0]
  prompt_mask = np.repeat(np.asarray(batch.prompt["mask"]), g, 0)
  mask = np.concatenate([prompt_mask, np.asarray(batch.rollout.mask)], 1)
  rng = np.random.default_rng(seed)
  shape = (*mask.shape, sum(cfg.moe_layers))
  perm = np.argsort(rng.random((*shape, cfg.num_experts)), -1)[..., : cfg.num_experts_per_tok]
  routes = np.where(mask[:, :, None, None] > 0, perm, -1).astype(np.int8)
  rollout = dataclasses.replace(batch.rollout, routes=jnp.asarray(routes))
  return dataclasses.replace(batch, rollout=rollout)


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
    if config.rollout.routing_replay == "rollout":
      batch = _with_routes(batch, policy, seed)
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


MOE = {  # configs/tiny_moe.py's model on tiny_config
    "model.preset": "tiny-moe",
    "model.num_experts": 8,
    "model.num_experts_per_tok": 2,
    "model.moe_intermediate_size": 96,
    "model.norm_topk_prob": True,
}


@pytest.mark.slow  # ~60 s: an MoE policy's update compiled in both layouts
def test_routing_replay_step_packed_equals_padded():
  """tiny-moe with routing replay: GrpoStep on packed rows (the routes gathered with their
  tokens) == on padded rows: rollout/route_mismatch (routes not the model's own: well above 0),
  loss, grad norm, KL and the rest within 1e-5, params after AdamW within 1e-5 relative."""
  overrides = {
      **MOE,
      "rollout.routing_replay": "rollout",
      "beta": 0.1,
      "loss.tis_cap": 2.0,
      "micro_batch_size": 16,
  }
  (params_a, metrics_a), (params_b, metrics_b) = _step_both(overrides, seed=4)
  assert 0.3 < float(metrics_a["rollout/route_mismatch"]) < 1.0
  for k, v in metrics_a.items():
    assert float(metrics_b[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), k
  la, lb = jax.tree.leaves(params_a), jax.tree.leaves(params_b)
  assert (
      _rel(np.concatenate([x.ravel() for x in lb]), np.concatenate([x.ravel() for x in la])) < 1e-5
  )


def test_packing_is_refused_where_it_is_not_built(monkeypatch):
  errors = configuration.validate(
      tiny_config(pack_sequences=True, **{"model.impl": "maxtext"}), num_devices=8
  )
  assert any(e.startswith("pack_sequences=") for e in errors), errors
  # The fused attention takes segment ids (attention.segment_attention); on GPU its kernel has
  # no sliding window, so a windowed model is refused there, and only there.
  windowed = {"model.attention_impl": "fused", "model.sliding_window": 4}
  assert not configuration.validate(tiny_config(pack_sequences=True, **windowed), num_devices=8)
  monkeypatch.setattr(configuration.jax, "default_backend", lambda: "gpu")
  errors = configuration.validate(tiny_config(pack_sequences=True, **windowed), num_devices=8)
  assert any(e.startswith("model.attention_impl=") and "sliding" in e for e in errors), errors
  fused = {"model.attention_impl": "fused"}
  errors = configuration.validate(tiny_config(pack_sequences=True, **fused), num_devices=8)
  assert not any(e.startswith("model.attention_impl=") for e in errors), errors
  auto = {"model.attention_impl": "auto", "model.sliding_window": 4}  # windows: masked there
  errors = configuration.validate(tiny_config(pack_sequences=True, **auto), num_devices=8)
  assert not any(e.startswith("model.attention_impl=") for e in errors), errors
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


# ------------------------------------------------- routing replay through packed rows (MoE)


@functools.lru_cache(maxsize=1)
def _sampled_moe():
  """A random tiny-qwen3-moe (f32) and its sampler's rollout of 4 prompts x 4 (one per module:
  the sampler's compile is most of the tests' time)."""
  from tests.models.test_moe_replay import moe_model
  from tests.models.test_moe_replay import rollout

  model = moe_model()
  return (model, *rollout(model, b=4))


def _replay_batch(seed=0, sampled=False):
  """A sampled tiny-qwen3-moe batch (f32; ragged prompts and completions) with routes that are
  not the trainer's own top-k (k distinct random experts per fed token, -1 where the sampler
  recorded none), so only routes replayed at the right tokens reproduce the padded forward;
  `sampled`: the sampler's own recorded routes instead (f32: the trainer's own top-k)."""
  model, r, ids, mask = _sampled_moe()
  n, s = ids.shape
  cfg = model.cfg
  rng = np.random.default_rng(seed)
  recorded = np.asarray(r.routes) >= 0
  shape = (n, s, cfg.num_layers)
  perm = np.argsort(rng.random((*shape, cfg.num_experts)), -1)[..., : cfg.num_experts_per_tok]
  routes = np.asarray(r.routes) if sampled else np.where(recorded, perm, -1).astype(np.int8)
  c = r.tokens.shape[1]
  cm = np.asarray(r.mask)
  assert 0 < cm.sum(1).min() < c and np.asarray(mask)[:, :7].sum(1).min() < 7  # ragged
  logp = np.asarray(r.raw_logprobs)
  batch = dict(
      input_ids=ids,
      attention_mask=mask,
      completion_mask=r.mask,
      advantages=jnp.asarray(np.clip(rng.normal(size=n), -1.5, 1.5), jnp.float32),
      old_logp=jnp.asarray((logp + 0.2 * rng.normal(size=logp.shape)) * cm, jnp.float32),
      ref_logp=jnp.asarray((logp + 0.2 * rng.normal(size=logp.shape)) * cm, jnp.float32),
      routes=jnp.asarray(routes),
  )
  return model, batch, c


def _replay_fns(model, c):
  from grpo_jax.models.logprobs import completion_logprobs_routed
  from grpo_jax.models.logprobs import packed_logprobs_routed

  graphdef, params = nnx.split(model)

  def padded_fn(params, ids, mask, routes):
    return completion_logprobs_routed(nnx.merge(graphdef, params), ids, mask, routes, c)[0]

  def packed_fn(params, ids, seg, pos, head_slots, routes):
    m = nnx.merge(graphdef, params)
    return packed_logprobs_routed(m, ids, seg, pos, head_slots, routes)[0]

  return params, padded_fn, packed_fn


def test_packed_routing_replay_loss_and_gradients_equal_padded():
  """Packed rows carry each token's recorded routes (packing.pack): the replayed packed forward's
  loss and gradients == the replayed padded forward's within 1e-5 (f32), whole batch and 2
  micro-batches; routes shifted by one position or one row in the packed batch give another
  loss (the routes matter and only aligned ones agree)."""
  from grpo_jax.rl import replay

  model, batch, c = _replay_batch()
  params, padded_fn, packed_fn = _replay_fns(model, c)
  n = batch["input_ids"].shape[0]
  settings = step_lib.LossSettings(
      beta=0.1, clip_eps=0.2, loss_agg_mode="seq-mean-token-mean", max_completion_length=c
  )

  def run(fn, data, n_micro, layout):
    data = {k: v for k, v in data.items() if k != "sequences"}
    loss_fn = lambda p, mb: step_lib.grpo_micro_loss(  # noqa: E731
        p, mb, logprob_fn=fn, settings=settings, layout=layout
    )
    loss, grads, _ = jax.jit(
        lambda params, data: step_lib.accumulate_gradients(
            loss_fn, params, data, n_micro, settings.loss_agg_mode, layout
        )
    )(params, data)
    return float(loss), np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(grads)])

  def loss_only(fn, data, layout):
    data = {k: v for k, v in data.items() if k != "sequences"}
    return float(
        jax.jit(
            lambda params, data: step_lib.grpo_micro_loss(
                params, data, logprob_fn=fn, settings=settings, layout=layout
            )[0]
        )(params, data)
    )

  loss, grads = run(padded_fn, batch, 1, replay.ROUTED)
  own = {**batch, "routes": jnp.full_like(batch["routes"], -1)}
  assert abs(loss_only(padded_fn, own, replay.ROUTED) - loss) > 1e-3  # replay changes the loss
  for n_micro in (1, 2):
    packed = _packed(batch, n_micro)
    assert packed["routes"].shape == (*packed["input_ids"].shape, *batch["routes"].shape[2:])
    assert (np.asarray(packed["routes"])[np.asarray(packed["segment_ids"]) == 0] == -1).all()
    layout = replay.RoutedPackedLayout(n // n_micro, n_micro)
    loss2, grads2 = run(packed_fn, packed, n_micro, layout)
    assert abs(loss2 - loss) <= 1e-5 * max(1.0, abs(loss)), (n_micro, loss2, loss)
    assert _rel(grads2, grads) <= 1e-5, (n_micro, _rel(grads2, grads))
    assert np.abs(grads).max() > 1e-3
  for axis in (1, 0):  # one position later, one row later
    shifted = _packed({**batch, "routes": jnp.roll(batch["routes"], 1, axis)}, 1)
    wrong = loss_only(packed_fn, shifted, replay.RoutedPackedLayout(n, 1))
    assert abs(wrong - loss) > 1e-3, (axis, wrong, loss)


def test_packed_route_mismatch_equals_padded():
  """rollout/route_mismatch over packed rows (the positions before each trained completion
  token) == the padded layout's: 0 for the sampler's own routes (f32), which any misalignment
  of the packed routes would raise; the same fraction, well above 0, for random routes."""
  from grpo_jax.models.logprobs import completion_logprobs_routed
  from grpo_jax.models.logprobs import packed_logprobs_routed
  from grpo_jax.rl import replay

  for sampled in (True, False):
    model, batch, c = _replay_batch(seed=1, sampled=sampled)
    _, own = completion_logprobs_routed(
        model, batch["input_ids"], batch["attention_mask"], batch["routes"], c
    )
    padded = float(replay.route_mismatch(own, batch["routes"], batch["completion_mask"]))
    packed = _packed(batch, 1)
    rows = len(packed["input_ids"])
    slots = packing.global_slots(packed["head_slots"], rows=rows, num_micro=1)
    _, own_p = packed_logprobs_routed(
        model,
        packed["input_ids"],
        packed["segment_ids"],
        packed["positions"],
        slots,
        packed["routes"],
    )
    got = float(replay.packed_route_mismatch(own_p, packed["routes"], packed["completion_mask"]))
    assert got == pytest.approx(padded, abs=1e-6), (sampled, got, padded)
    if sampled:
      assert padded == 0.0, padded
    else:
      assert 0.3 < padded < 1.0, padded
