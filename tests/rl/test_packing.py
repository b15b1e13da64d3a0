"""Packed rows (rl/packing.py): the plan keeps sequences whole within the budget in few shapes;
the gather moves every field with its token; the update's loss and gradients on packed rows equal
the padded layout's for every aggregation mode and policy loss, micro-batched or not; GrpoStep's
inputs and update agree end to end (KL in the loss or in the reward, TIS, advantage clip, DAPO's
dynamic sampling, several passes, LoRA); the loop's metrics agree (slow). MoE routing replay:
the routes move with their tokens, packed == padded in loss, gradients, route_mismatch and the
GrpoStep."""

import dataclasses
import functools
import itertools

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
from grpo_jax.rl import row_plan
from grpo_jax.rl import step as step_lib
from grpo_jax.rl.reference import Reference
from grpo_jax.rollout import Rollout
from grpo_jax.rollout.source import Scored
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

# -------------------------------------------------------------------------------- the plan


def _long_tailed(rng, n, budget):
  return np.minimum(rng.geometric(3.0 / budget, n) + 1, budget)


MICRO = {  # name -> row_plan.MicroBatching (2 shards): by rows, or by tokens (rows of 40 slots)
    "whole": row_plan.MicroBatching(2),
    "rows2": row_plan.MicroBatching(2, count=2),
    "rows4": row_plan.MicroBatching(2, count=4),
    "tokens": row_plan.MicroBatching(2, tokens=2 * 3 * 40 + 39),  # 3 rows per shard
}


@pytest.mark.parametrize("name", sorted(MICRO))
def test_plan_packs_each_shard_whole_within_the_budget_in_few_shapes(name):
  micro = MICRO[name]
  rng = np.random.default_rng(len(name))
  budget, n, shards = 40, 64, micro.shards
  local = n // shards
  sizes = set()
  for _ in range(30):
    lengths = _long_tailed(rng, n, budget)
    completion = np.minimum(lengths, rng.integers(0, budget, n))
    plan = row_plan.plan_rows(lengths, budget, micro, completion)
    again = row_plan.plan_rows(lengths, budget, micro, completion)
    np.testing.assert_array_equal(plan.row_of, again.row_of)  # deterministic
    np.testing.assert_array_equal(plan.offset_of, again.offset_of)
    per_shard, n_micro = plan.rows_per_shard, plan.num_micro
    assert plan.rows == per_shard * shards and per_shard % n_micro == 0
    if micro.tokens:  # a micro-batch within the budget; no more of them than the padded rows
      assert per_shard // n_micro <= micro.tokens // budget // shards
      assert n_micro <= -(-local // (micro.tokens // budget // shards))
    else:
      assert n_micro == micro.count and per_shard <= local
    used = np.zeros((plan.rows, budget), np.int32)
    heads = np.zeros((shards, n_micro), np.int64)
    for i, (r, o, l) in enumerate(zip(plan.row_of, plan.offset_of, lengths)):
      assert 0 <= r < per_shard and o + l <= budget  # whole, inside its shard's rows
      used[i // local * per_shard + r, o : o + l] += 1
      heads[i // local, r % n_micro] += completion[i]
    assert used.max() == 1  # no overlap
    head_per_micro = plan.head_rows // shards // n_micro
    w = row_plan.head_width(budget)  # the head's rows: W positions, at most every slot's
    assert plan.head_rows % (shards * n_micro) == 0
    assert head_per_micro <= -(-per_shard // n_micro * budget // w)
    assert heads.max() <= head_per_micro * w  # room for each micro-batch's completions
    assert plan.fill == pytest.approx(lengths.sum() / (plan.rows * budget))
    sizes.add((plan.rows, n_micro))
  assert len(sizes) <= row_plan.NUM_BUCKETS


def test_micro_batches_by_tokens_count_rows_of_the_width():
  micro = row_plan.MicroBatching(4, tokens=1000)  # 1000 // 40 = 25 rows: 6 per shard (24)
  assert micro.shard_rows(40) == 6 and micro.shard_rows(2000) == 1  # at least one per shard
  # padded: the fewest micro-batches of <= 6 rows per shard that split a shard's rows evenly
  assert micro.padded_count(64, 40) == 4  # 16 rows per shard: 4 x 4
  assert micro.padded_count(96, 40) == 4  # 24: 4 x 6
  assert micro.padded_count(28, 40) == 7  # 7 (a prime): 7 x 1
  assert row_plan.MicroBatching(4, count=2).padded_count(64, 40) == 2  # by rows: as configured
  # packed: micro-batches of <= 6 rows per shard, as many as the fullest shard's rows need,
  # then the rows each needs (bucketed: 13 rows in 3 micro-batches of 5)
  assert micro.packed(used=13, local=24, width=40) == (3, 5)
  assert micro.packed(used=4, local=24, width=40) == (1, 4)


def test_first_fit_decreasing_packs_tightly_and_refuses_what_does_not_fit():
  row, offset, used = row_plan.first_fit_decreasing(np.array([3, 7, 5, 5, 2, 8]), 10)
  assert used == 3  # 30 tokens in 3 rows of 10: [8, 2], [7, 3], [5, 5]
  assert (row[5], offset[5], row[4], offset[4]) == (0, 0, 0, 8)
  with pytest.raises(ValueError, match="does not fit"):
    row_plan.first_fit_decreasing(np.array([11]), 10)


def _fewest_by_subsets(lengths, budget) -> int:
  """The fewest rows of `budget` slots that hold `lengths` (n <= 12): over every subset of the
  sequences placed, (rows closed, tokens in the open row), least first."""
  n = len(lengths)
  best = [(n + 1, 0)] * (1 << n)
  best[0] = (0, budget)  # as if a full row were open: the first sequence opens one
  for mask in range(1 << n):
    rows, open_ = best[mask]
    for i in range(n):
      if not mask >> i & 1:
        step = (
            (rows, open_ + lengths[i]) if open_ + lengths[i] <= budget else (rows + 1, lengths[i])
        )
        best[mask | 1 << i] = min(best[mask | 1 << i], step)
  return best[-1][0]


def _check_plan(lengths, budget, row, offset, used):
  """Every sequence in a row < used, inside its row, overlapping none."""
  cover = np.zeros((used, budget), np.int32)
  for l, r, o in zip(lengths, row, offset):
    assert 0 <= r < used and 0 <= o and o + l <= budget
    cover[r, o : o + l] += 1
  assert cover.max() <= 1


def test_fewest_rows_finds_what_first_fit_decreasing_misses():
  lengths = np.array([4, 4, 3, 3, 3, 3])  # first-fit decreasing: [4, 4], [3, 3, 3], [3]
  assert row_plan.first_fit_decreasing(lengths, 10)[2] == 3
  row, offset, used = row_plan.fewest_rows(lengths, 10)
  assert used == 2  # [4, 3, 3] twice
  _check_plan(lengths, 10, row, offset, used)
  with pytest.raises(ValueError, match="does not fit"):
    row_plan.fewest_rows(np.array([3, 11]), 10)


def test_fewest_rows_is_the_fewest_on_random_batches_and_never_worse_than_ffd():
  rng = np.random.default_rng(0)
  better = 0
  for trial in range(200):
    n, budget = int(rng.integers(1, 13)), int(rng.integers(20, 60))
    lengths = rng.integers(budget // 5, budget // 2 + 2, n)  # where first-fit decreasing slips
    row, offset, used = row_plan.fewest_rows(lengths, budget)
    _check_plan(lengths, budget, row, offset, used)
    assert used == _fewest_by_subsets(lengths.tolist(), budget), (lengths, budget)
    ffd = row_plan.first_fit_decreasing(lengths, budget)[2]
    assert used <= ffd
    better += used < ffd
    again = row_plan.fewest_rows(lengths, budget)  # deterministic: every process plans alike
    assert (again[0] == row).all() and (again[1] == offset).all()
  assert better > 0  # the search did find fewer rows somewhere


def test_fewest_rows_keeps_first_fit_decreasing_when_its_search_runs_out():
  lengths = np.random.default_rng(1).integers(30, 70, 120)
  ffd = row_plan.first_fit_decreasing(lengths, 100)
  row, offset, used = row_plan.fewest_rows(lengths, 100, max_work=0)
  assert used == ffd[2] and (row == ffd[0]).all() and (offset == ffd[1]).all()
  row, offset, used = row_plan.fewest_rows(lengths, 100)  # bounded host time on any batch
  _check_plan(lengths, 100, row, offset, used)
  assert used <= ffd[2]


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


def _packed(batch, micro=row_plan.MicroBatching()):
  """`batch` packed per shard as the Packer does (MicroBatches in it: the update's count)."""
  s = batch["input_ids"].shape[1]
  plan = row_plan.plan_rows(
      np.asarray(batch["attention_mask"]).sum(1),
      s,
      micro,
      np.asarray(batch["attention_mask"])[:, -batch["completion_mask"].shape[1] :].sum(1),
  )
  out = packing.pack(
      batch,
      jnp.asarray(plan.row_of),
      jnp.asarray(plan.offset_of),
      shards=plan.shards,
      rows=plan.rows,
      num_micro=plan.num_micro,
      head_rows=plan.head_rows,
  )
  return dict(out, micro_batches=packing.MicroBatches(plan.num_micro))


@pytest.mark.parametrize("name", ["whole", "rows2", "tokens"])
def test_pack_moves_every_field_with_its_token(name):
  micro = MICRO[name]
  rng = np.random.default_rng(0)
  n, p, c = 16, 5, 6
  batch = _padded_batch(rng, n, p, c, 50)
  out = _packed(batch, dataclasses.replace(micro, tokens=micro.tokens and 2 * 2 * (p + c)))
  n_micro = out.pop("micro_batches").count
  out = jax.tree.map(np.asarray, out)
  b = jax.tree.map(np.asarray, batch)
  rows, shards = len(out["input_ids"]), micro.shards
  per_shard = rows // shards
  for i in range(n):
    real = np.flatnonzero(b["attention_mask"][i])
    here = out["segment_ids"] == i + 1  # the sequence's index in the batch + 1
    r = np.flatnonzero(here.any(1))
    assert len(r) == 1 and r[0] // per_shard == i // (n // shards)  # one row, its shard's
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
    back = packing.unpack(jnp.asarray(out[f]), jnp.asarray(out["sequences"]["slot"]), shards)
    np.testing.assert_array_equal(np.asarray(back), b[f] * b["completion_mask"])
  adv = packing.spread(jnp.asarray(b["advantages"]), jnp.asarray(out["segment_ids"]), shards)
  np.testing.assert_array_equal(np.asarray(adv), out["advantages"])

  # The LM head's slots: exactly the real completion tokens', per micro-batch and shard in its
  # own rows (shard d's head rows hold slots of its rows; head row h * n + k: micro-batch k's).
  slot_nc = np.asarray(out["sequences"]["slot"])
  size = per_shard * out["input_ids"].shape[1]
  heads = np.asarray(
      packing.global_slots(
          jnp.asarray(out["head_slots"]),
          rows=rows,
          num_micro=n_micro,
          shards=shards,
          width=out["input_ids"].shape[1],
      )
  )
  per_head = len(heads) // shards
  for d in range(shards):
    mine = heads[d * per_head : (d + 1) * per_head]
    want = slot_nc[d * (n // shards) : (d + 1) * (n // shards)]
    assert sorted(mine[mine < size]) == sorted(want[want < size])
    k_h = np.arange(per_head)[:, None] % n_micro
    assert np.all((mine // out["input_ids"].shape[1] % n_micro == k_h) | (mine == size))


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

  def packed_fn(params, ids, seg, pos, head_slots, shards=1):
    del head_slots, shards  # every slot: the loss's mask picks the completion tokens
    return jnp.pad(next_logp(params, ids), ((0, 0), (1, 0)))

  return params, padded_fn, packed_fn


@pytest.mark.parametrize(
    "name",
    [  # suite time: -m slow runs the other two
        pytest.param("whole", marks=pytest.mark.slow),
        "rows2",
        pytest.param("tokens", marks=pytest.mark.slow),
    ],
)
def test_head_rows_narrower_than_the_packed_rows(monkeypatch, name):
  """The LM head's rows of W = head_width(S) < S positions (HEAD_WIDTH 4 here, 128 in a run:
  S = P + C > W): the head slots are exactly the completion tokens' per micro-batch and shard,
  in rows of W, fewer positions than rows of S would issue; the log-probs of the decoder's
  packed pass there == the padded pass's (f32, 1e-5), over 2 shards and micro-batches."""
  monkeypatch.setattr(row_plan, "HEAD_WIDTH", 4)
  micro = MICRO[name]
  rng = np.random.default_rng(3)
  n, p, c = 16, 5, 6
  cfg = dataclasses.replace(PRESETS["tiny-qwen3"], dtype="float32", param_dtype="float32")
  model = build_model(cfg, seed=0)
  batch = _padded_batch(rng, n, p, c, cfg.vocab_size)
  out = _packed(batch, dataclasses.replace(micro, tokens=micro.tokens and 2 * 2 * (p + c)))
  n_micro = out.pop("micro_batches").count
  rows, s = out["input_ids"].shape
  assert out["head_slots"].shape[1] == 4 < s
  assert out["head_slots"].size < rows * s  # fewer positions than whole rows of S
  slots = packing.global_slots(
      out["head_slots"], rows=rows, num_micro=n_micro, shards=micro.shards, width=s
  )
  got = packed_logprobs(
      model, out["input_ids"], out["segment_ids"], out["positions"], slots, shards=micro.shards
  )
  want = completion_logprobs(model, batch["input_ids"], batch["attention_mask"], c)
  back = packing.unpack(got, out["sequences"]["slot"], micro.shards)
  np.testing.assert_allclose(back, want * batch["completion_mask"], rtol=1e-5, atol=1e-5)
  real = np.asarray(out["completion_mask"]) > 0
  assert np.all(np.asarray(got)[~real] == 0)


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

  def packed_fn(params, ids, seg, pos, head_slots, shards=1):
    return packed_logprobs(nnx.merge(graphdef, params), ids, seg, pos, head_slots, shards=shards)

  batch = _padded_batch(np.random.default_rng(1), N, P, C, cfg.vocab_size)
  logp = padded_fn(params, batch["input_ids"], batch["attention_mask"])
  return _near_policy(params, padded_fn, packed_fn, batch, logp)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# name -> the micro-batches of the packed side: whole, by rows, per shard by tokens (one row
# of S = P + C slots per shard in a micro-batch) and by rows
VARIANTS = {
    "packed": row_plan.MicroBatching(),
    "packed_rows2": row_plan.MicroBatching(count=2),
    "shards4_tokens": row_plan.MicroBatching(4, tokens=4 * (P + C)),
    "shards2_rows2": row_plan.MicroBatching(2, count=2),
}


@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
def test_packed_loss_and_gradients_equal_padded(bigram_model, policy_loss):
  """Every aggregation mode x this policy loss (each with its KL kind), beta > 0, TIS, clipped
  advantages, ragged lengths (one completion empty); packed per shard (2 and 4) by rows and by
  tokens, several micro-batches. Loss within 1e-6 of its scale, gradients within 1e-6 relative
  (f32, CPU), the token metrics (joined exactly over micro-batches) within 1e-5. On the bigram
  stand-in (the loss code; fast): every variant and the decoder are the slow tests below."""
  _check_matrix(bigram_model, policy_loss, ("shards4_tokens", "shards2_rows2"))


@pytest.mark.slow  # ~30 s each: 7 layouts' gradients compiled in one program
@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
def test_every_packed_variant_equals_padded(bigram_model, policy_loss):
  """The matrix above with padded rows in 2 micro-batches and packed rows whole and in 2
  micro-batches on one shard too."""
  _check_matrix(bigram_model, policy_loss, ("padded2", *VARIANTS))


@pytest.mark.slow  # ~45 s each: the decoder's gradients compiled in one program
@pytest.mark.parametrize("policy_loss", sorted(POLICY_LOSSES))
def test_packed_decoder_loss_and_gradients_equal_padded(decoder_model, policy_loss):
  """The same matrix on a random tiny decoder (tiny-qwen3, f32): packed attention included."""
  _check_matrix(decoder_model, policy_loss, ("padded2", "packed", "shards4_tokens"))


def _check_matrix(model, policy_loss, names):
  params, padded_fn, packed_fn, batch = model
  modes = sorted(losses.LOSS_AGG_MODES.names())
  packed = {name: _packed(batch, VARIANTS[name]) for name in names if name in VARIANTS}
  if "shards4_tokens" in packed:
    assert packed["shards4_tokens"]["micro_batches"].count >= 2  # several micro-batches

  @jax.jit
  def both(params, batch, packed):
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
      sides = [("padded", padded_fn, batch, 1, packing.PADDED)]
      if "padded2" in names:
        sides.append(("padded2", padded_fn, batch, 2, packing.PADDED))
      for name in packed:
        fn = functools.partial(packed_fn, shards=VARIANTS[name].shards)
        data = packed[name]
        sides.append((name, fn, data, data["micro_batches"].count, packing.PackedLayout(N)))
      for name, fn, data, n_micro, layout in sides:
        loss_fn = lambda p, mb, fn=fn, layout=layout, settings=settings: step_lib.grpo_micro_loss(
            p, mb, logprob_fn=fn, settings=settings, layout=layout
        )
        data = {k: v for k, v in data.items() if k not in ("sequences", "micro_batches")}
        out[mode, name] = step_lib.accumulate_gradients(
            loss_fn, params, data, n_micro, mode, layout
        )
    return out

  out = both(params, batch, packed)
  for mode in modes:
    loss, grads, metrics = out[mode, "padded"]
    scale = float(jnp.abs(metrics["pg_loss"])) + 1e-3  # the loss can sit near 0
    for name in names:
      l2, g2, m2 = out[mode, name]
      assert abs(float(l2) - float(loss)) <= 1e-6 * scale, (mode, name, l2, loss)
      flat, flat2 = jax.tree.leaves(grads), jax.tree.leaves(g2)
      err = _rel(
          np.concatenate([x.ravel() for x in flat2]), np.concatenate([x.ravel() for x in flat])
      )
      assert err <= 1e-6, (mode, name, err)
      for k in ("kl", "clip_frac", "ppo_kl", "ratio_mean", "ratio_max"):
        assert float(m2[k]) == pytest.approx(float(metrics[k]), rel=1e-5, abs=1e-7), (name, k)
      assert abs(float(m2["pg_loss"]) - float(metrics["pg_loss"])) <= 1e-6 * scale, name
    assert float(metrics["clip_frac"]) > 0 or policy_loss == "gspo"  # the clip is exercised


@pytest.mark.slow  # ~40 s: the decoder's gradients in 3 layouts, compiled for 8 devices
def test_packed_equals_padded_sharded_over_8_devices():
  """The decoder matrix (every aggregation mode, PPO-clip) with the rows sharded over 8 fake
  CPU devices (mesh data=8): packed per shard (the gather and the LM head's slots partitioned
  along the shards), by tokens in several micro-batches and by rows in 2 == padded (sharded
  alike), loss within 1e-6 of its scale, gradients within 2e-6 relative: sharding alone moves
  the padded rows' gradients by 1.05e-6 here (the 8 devices' partial sums; measured against
  the same program on one device), and packed vs padded on one device differ by 1.6e-7."""
  from grpo_jax.parallel import multihost
  from grpo_jax.parallel import sharding

  cfg = dataclasses.replace(PRESETS["tiny-qwen3"], dtype="float32", param_dtype="float32")
  graphdef, params = nnx.split(build_model(cfg, seed=0))
  n = 32
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8, 1, 1, 1), sharding.MESH_AXES)
  batch = _padded_batch(np.random.default_rng(5), n, P, C, cfg.vocab_size)

  def padded_fn(params, ids, mask):
    return completion_logprobs(nnx.merge(graphdef, params), ids, mask, C)

  def packed_fn(params, ids, seg, pos, head_slots):
    return packed_logprobs(nnx.merge(graphdef, params), ids, seg, pos, head_slots, shards=8)

  variants = {
      "tokens": row_plan.MicroBatching(8, tokens=8 * (P + C)),
      "rows2": row_plan.MicroBatching(8, count=2),
  }
  data = {k: jax.device_put(v, sharding.batch_sharding(mesh, v.ndim)) for k, v in batch.items()}
  sides = {"padded": (data, 1, packing.PADDED, padded_fn)}
  for name, micro in variants.items():
    lengths = np.asarray(batch["attention_mask"])
    plan = row_plan.plan_rows(lengths.sum(1), P + C, micro, lengths[:, P:].sum(1))
    where = [multihost.sharded_rows(x, mesh) for x in (plan.row_of, plan.offset_of)]
    pack = functools.partial(
        packing.pack, shards=8, rows=plan.rows, num_micro=plan.num_micro, head_rows=plan.head_rows
    )
    packed = jax.jit(sharding.traced_in(pack, mesh))(data, *where)
    packed = {k: v for k, v in packed.items() if k != "sequences"}
    layout = packing.PackedLayout(n)
    sides[name] = (packed, plan.num_micro, layout, packed_fn)
  assert sides["tokens"][1] >= 2 and sides["rows2"][1] == 2

  def run(params, data, n_micro, layout, fn, mode):
    settings = step_lib.LossSettings(
        beta=0.1, clip_eps=0.2, loss_agg_mode=mode, max_completion_length=C, tis_cap=2.0
    )
    loss_fn = lambda p, mb: step_lib.grpo_micro_loss(  # noqa: E731
        p, mb, logprob_fn=fn, settings=settings, layout=layout
    )
    return step_lib.accumulate_gradients(loss_fn, params, data, n_micro, mode, layout)[:2]

  modes = sorted(losses.LOSS_AGG_MODES.names())

  @jax.jit
  @functools.partial(sharding.traced_in, mesh=mesh)
  def all_sides(params, datas):
    return {
        (mode, name): run(params, datas[name], *sides[name][1:], mode)
        for mode in modes
        for name in sides
    }

  out = all_sides(params, {name: side[0] for name, side in sides.items()})
  for mode in modes:
    loss, grads = out[mode, "padded"]
    flat = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(grads)])
    for name in variants:
      l2, g2 = out[mode, name]
      assert abs(float(l2) - float(loss)) <= 1e-6 * (abs(float(loss)) + 1e-3), (mode, name)
      flat2 = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(g2)])
      assert _rel(flat2, flat) <= 2e-6, (mode, name, _rel(flat2, flat))


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


def grpo_step(config):
  """-> (mesh, policy, fns, grpo): the loop's GrpoStep for `config` (a started reference)."""
  mesh = build.make_mesh(config)
  policy = build.make_policy(config, mesh)
  fns = step_lib.build(config, policy, mesh)
  reference = Reference(config, policy, fns, mesh)
  reference.start(policy.params)
  return mesh, policy, fns, step_lib.GrpoStep(config, fns, reference, mesh, matches_trainer=True)


def _step_both(overrides, seed=0):
  """GrpoStep.inputs + update + figures, padded and packed, from the same state and batch."""
  out = []
  for pack in (False, True):
    config = tiny_config(pack_sequences=pack, **overrides)
    assert not configuration.validate(config, num_devices=8)
    mesh, policy, fns, grpo = grpo_step(config)
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
        {  # micro-batches by tokens (one row of 13 slots per device: the padded rows in 4,
            # the packed in what they need), KL in the reward, token-mean
            "beta": 0.1,
            "kl_in_reward": True,
            "loss.loss_agg_mode": "token-mean",
            "micro_batch_size": 0,
            "micro_batch_tokens": 8 * 13,
        },
    ],
    ids=[
        "kl_loss_tis_clip_micro",
        "kl_reward_dynamic_gspo",
        "geometric_mask_micro",
        "micro_batch_tokens",
    ],
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


def test_where_packing_runs_and_where_it_is_refused(monkeypatch):
  t5 = tiny_config(pack_sequences=True, **{"model.family": "t5"})  # padded rows: decoder-only
  assert not any(e.startswith("pack_sequences=") for e in configuration.validate(t5, num_devices=8))
  assert not packing.packs(t5) and packing.packs(tiny_config(pack_sequences=True))
  maxtext = tiny_config(pack_sequences=True, **{"model.impl": "maxtext"})  # its segment ids
  assert not any(
      e.startswith("pack_sequences=") for e in configuration.validate(maxtext, num_devices=8)
  )
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
  # 2+ processes: each packs its own shards (every process makes the same plan)
  assert not configuration.validate(
      tiny_config(pack_sequences=True), num_devices=8, num_processes=2
  )


# ---------------------------------------------------------- per shard: no traffic between them


@pytest.mark.slow  # ~60 s each: the update and the log-prob passes compiled padded and packed
@pytest.mark.parametrize("axis", ["data", "fsdp"])
def test_packing_moves_nothing_between_shards(axis):
  """8 fake CPU devices, the rows sharded 8 ways over mesh.<axis> (fsdp: the params too): the
  optimized HLO of the packed programs (the gather, unpack, fold_kl, the old / reference
  log-prob pass with the LM head's gather of completion slots, the update in 2 micro-batches)
  holds no collective that the padded programs lack, but for the per-sequence sums of the loss
  (all-reduces of N values): no all-gather, all-to-all or collective-permute of the packed rows
  or of the hidden states."""
  from grpo_jax.parallel import multihost
  from grpo_jax.plan import hlo_inspect

  overrides = {"micro_batch_size": 16, "beta": 0.1, "kl_in_reward": True, "mesh.data": 1}
  overrides[f"mesh.{axis}"] = 8
  found = {}
  for pack in (False, True):
    config = tiny_config(pack_sequences=pack, **overrides)
    mesh = build.make_mesh(config)
    assert packing.batch_shards(mesh) == 8
    policy = build.make_policy(config, mesh)
    fns = step_lib.build(config, policy, mesh)
    grpo = step_lib.GrpoStep(
        config, fns, Reference(config, policy, fns, mesh), mesh, matches_trainer=True
    )
    batch = _scored(config, policy, 0)
    state = fns.init(policy.params)
    upd = fns.assemble(batch.prompt["ids"], batch.prompt["mask"], batch.rollout, batch.rewards)
    upd = dict(upd, old_logp=batch.rollout.logprobs, ref_logp=batch.rollout.logprobs)
    n = upd["advantages"].shape[0]
    programs = {}
    if pack:
      mask = upd["attention_mask"]
      lengths_n, completion_n = np.asarray(jax.device_get(grpo.rows._lengths(mask)))
      plan = grpo.rows.plan(lengths_n, completion_n, mask.shape[1])
      where = [multihost.sharded_rows(x, mesh) for x in (plan.row_of, plan.offset_of)]
      programs["pack"] = fns.pack.lower(upd, *where, plan.rows, plan.head_rows, plan.num_micro)
      upd = grpo.rows.rows(upd)
      assert upd["micro_batches"].count == 2
      programs["unpack"] = fns.unpack.lower(upd["old_logp"], upd["sequences"]["slot"])
      programs["fold_kl"] = fns.packed_fold_kl.lower(upd, batch.rewards)
      args = ("input_ids", "segment_ids", "positions", "head_slots", "micro_batches")
      programs["logprobs"] = fns.packed_logprobs.lower(state["params"], *(upd[k] for k in args))
    else:
      args = (upd["input_ids"], upd["attention_mask"])
      programs["logprobs"] = fns.logprobs.lower(state["params"], *args)
    programs["update"] = fns.update.lower(state, upd)
    for name, lowered in programs.items():
      ops = hlo_inspect.collectives(lowered.compile().as_text())
      found[pack, name] = {(o.opcode, hlo_inspect.dims(o.type)): o for o in ops}
  for (pack, name), ops in found.items():
    if not pack:
      continue
    padded = found.get((False, name), {})
    added = [
        o.line for key, o in ops.items() if key not in padded and hlo_inspect.largest_array(o) > n
    ]
    assert not added, (name, added)
  assert any(o.opcode.startswith("all-reduce") for o in found[True, "update"].values())


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
    data = {k: v for k, v in data.items() if k not in ("sequences", "micro_batches")}
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
    data = {k: v for k, v in data.items() if k not in ("sequences", "micro_batches")}
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
    packed = _packed(batch, row_plan.MicroBatching(count=n_micro))
    assert packed["routes"].shape == (*packed["input_ids"].shape, *batch["routes"].shape[2:])
    assert (np.asarray(packed["routes"])[np.asarray(packed["segment_ids"]) == 0] == -1).all()
    layout = replay.RoutedPackedLayout(n)
    loss2, grads2 = run(packed_fn, packed, n_micro, layout)
    assert abs(loss2 - loss) <= 1e-5 * max(1.0, abs(loss)), (n_micro, loss2, loss)
    assert _rel(grads2, grads) <= 1e-5, (n_micro, _rel(grads2, grads))
    assert np.abs(grads).max() > 1e-3
  for axis in (1, 0):  # one position later, one row later
    shifted = _packed({**batch, "routes": jnp.roll(batch["routes"], 1, axis)})
    wrong = loss_only(packed_fn, shifted, replay.RoutedPackedLayout(n))
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
    packed = _packed(batch)
    rows = len(packed["input_ids"])
    slots = packing.global_slots(
        packed["head_slots"], rows=rows, num_micro=1, width=packed["input_ids"].shape[1]
    )
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
