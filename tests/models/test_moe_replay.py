"""Rollout routing replay (rl/replay.py): the sampler's recorded routes (layout, dtype), the
trainer's replayed forward == the sampler's log-probs (f32), replay closing the sampler-trainer
gap under bf16 compute, router gradients through the replayed gates, route_mismatch against a
NumPy count, and the loop with rollout.routing_replay=rollout: padded and packed rows, one step
off, the sampler on its own devices (packed == padded: tests/rl/test_packing.py; 2 processes ==
1: tests/parallel/test_multihost.py)."""

import dataclasses
import json
import os
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.logprobs import completion_logprobs_routed
from grpo_jax.rl.replay import route_mismatch
from grpo_jax.rollout import GenerationConfig
from grpo_jax.rollout import Sampler
from tests.rollout.test_sampler import prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
G, C = 4, 12


def moe_model(dtype="float32", seed=0):
  """tiny-qwen3-moe (8 experts, top-2): f32 params, compute in `dtype`."""
  cfg = dataclasses.replace(PRESETS["tiny-qwen3-moe"], dtype=dtype, param_dtype="float32")
  return build_model(cfg, seed=seed)


def rollout(model, b=8, seed=1):
  ids, mask = prompts(model.cfg.vocab_size, b=b, p=7)
  graphdef, state = nnx.split(model)
  sampler = Sampler(
      graphdef,
      max_prompt_length=7,
      max_new_tokens=C,
      num_generations=G,
      eos_ids=(5,),
      record_routes=True,
  )
  r = sampler(state, ids, mask, jax.random.key(seed), GenerationConfig(temperature=1.0))
  full_ids = jnp.concatenate([jnp.repeat(ids, G, 0), r.tokens], 1)
  full_mask = jnp.concatenate([jnp.repeat(mask, G, 0), r.mask], 1)
  return r, full_ids, full_mask


def test_recorded_routes_layout_and_f32_replay_equals_sampler():
  model = moe_model()
  r, ids, mask = rollout(model)
  n, s = ids.shape
  cfg = model.cfg
  assert r.routes.shape == (n, s, cfg.num_layers, cfg.num_experts_per_tok)
  assert r.routes.dtype == jnp.int8  # 8 experts
  routes = np.asarray(r.routes)
  # Every fed token has k distinct experts; the last column (drawn, never fed) has none.
  fed = routes[:, : s - 1]
  assert ((fed >= 0) & (fed < cfg.num_experts)).all()
  assert (np.sort(fed, -1)[..., 1:] != np.sort(fed, -1)[..., :-1]).all()
  assert (routes[:, -1] == -1).all()
  # The G rows of a prompt share its prefill's routes.
  assert (routes[0:G, :7] == routes[0:1, :7]).all()

  m = np.asarray(r.mask) > 0
  replayed, own = completion_logprobs_routed(model, ids, mask, r.routes, C)
  assert np.abs(np.asarray(replayed) - np.asarray(r.raw_logprobs))[m].max() <= 1e-5
  # In f32 the trainer's own routes are the sampler's: at every real position of the row.
  real = np.asarray(mask)[:, : s - 1] > 0
  assert (np.asarray(own)[:, : s - 1] == fed)[real].all()
  assert float(route_mismatch(own, r.routes, r.mask)) == 0.0
  # Replaying all -1 (no routes) is the plain forward, bit for bit.
  plain = completion_logprobs(model, ids, mask, C)
  none, _ = completion_logprobs_routed(model, ids, mask, jnp.full_like(r.routes, -1), C)
  np.testing.assert_array_equal(np.asarray(none), np.asarray(plain))
  # Replay is not a no-op: other experts give other log-probs.
  shifted = jnp.where(r.routes >= 0, (r.routes + 1) % cfg.num_experts, -1)
  moved, _ = completion_logprobs_routed(model, ids, mask, shifted, C)
  assert np.abs(np.asarray(moved) - np.asarray(replayed))[m].max() > 1e-2


def test_bf16_replay_narrows_the_sampler_trainer_gap():
  """bf16 compute (f32 params): the sampler's decode and the trainer's full forward round
  differently, some tokens change experts; replaying the sampler's routes removes that part of
  the log-prob gap. Prints the measured figures."""
  model = moe_model("bfloat16")
  r, ids, mask = rollout(model, b=8)
  m = np.asarray(r.mask) > 0
  sampler = np.asarray(r.raw_logprobs)
  free, own = completion_logprobs_routed(model, ids, mask, jnp.full_like(r.routes, -1), C)
  replayed, _ = completion_logprobs_routed(model, ids, mask, r.routes, C)
  mismatch = float(route_mismatch(own, r.routes, r.mask))
  gap_free = np.abs(np.asarray(free) - sampler)[m]
  gap_replay = np.abs(np.asarray(replayed) - sampler)[m]
  print(
      f"bf16 tiny-qwen3-moe: {m.sum()} tokens, route mismatch without replay {mismatch:.4f}; "
      f"|trainer - sampler| log-prob mean/max without replay {gap_free.mean():.5f}/"
      f"{gap_free.max():.5f}, with replay {gap_replay.mean():.5f}/{gap_replay.max():.5f}"
  )
  assert mismatch > 0  # else the comparison below says nothing
  assert gap_replay.mean() < gap_free.mean()
  assert gap_replay.max() <= gap_free.max()


def test_router_gets_gradients_through_replayed_gates():
  model = moe_model()
  r, ids, mask = rollout(model, b=2)
  graphdef, params = nnx.split(model)

  def loss(params, routes):
    logp, _ = completion_logprobs_routed(nnx.merge(graphdef, params), ids, mask, routes, C)
    return (logp * r.mask).sum()

  grads = jax.grad(loss)(params, r.routes)
  for blk in grads["layers"].values():
    g = np.asarray(blk["mlp"]["router"][...])
    assert np.isfinite(g).all() and np.abs(g).max() > 1e-6
  # The gates are the current router's probabilities at the replayed experts: replaying
  # other experts gives the router another gradient.
  shifted = jnp.where(r.routes >= 0, (r.routes + 1) % model.cfg.num_experts, -1)
  other = jax.grad(loss)(params, shifted)
  a = np.asarray(grads["layers"][0]["mlp"]["router"][...])
  b = np.asarray(other["layers"][0]["mlp"]["router"][...])
  assert np.abs(a - b).max() > 1e-6


def test_route_mismatch_counts_recorded_routes_missing_from_own_top_k():
  rng = np.random.default_rng(0)
  b, s, c, l, k, e = 3, 9, 4, 2, 2, 6
  routes = np.stack([rng.permutation(e)[:k] for _ in range(b * s * l)]).reshape(b, s, l, k)
  own = routes.copy()
  own[..., [0, 1]] = own[..., [1, 0]]  # order differs: no mismatch
  flip = rng.random((b, s, l)) < 0.3
  own[flip, 1] = -7  # misses
  routes[1, s - 2, 1] = -1  # not recorded: not counted
  mask = (rng.random((b, c)) < 0.7).astype(np.int32)
  # NumPy reference: positions s-c-1 .. s-2 predict completion tokens 0 .. c-1.
  missed = counted = 0
  for i in range(b):
    for j in range(c):
      if not mask[i, j]:
        continue
      pos = s - c - 1 + j
      for layer in range(l):
        for slot in range(k):
          e_rec = routes[i, pos, layer, slot]
          if e_rec < 0:
            continue
          counted += 1
          missed += e_rec not in own[i, pos, layer]
  got = float(route_mismatch(jnp.asarray(own), jnp.asarray(routes, jnp.int8), jnp.asarray(mask)))
  assert missed > 0 and abs(got - missed / counted) < 1e-6


LOOP_ARGS = [
    "--config=configs/tiny_moe.py",
    "--config.rollout.routing_replay=rollout",
    "--config.num_steps=3",
    "--config.sft_steps=2",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=64",
    "--config.data.arithmetic.num_test=16",
    "--config.sft.num_validation=16",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.report_at_end=False",
]


def _loop(workdir, *args) -> list[dict]:
  """configs/tiny_moe.py with routing replay, SFT 2 steps, then 3 GRPO steps -> their rows of
  metrics.jsonl."""
  r = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", f"--workdir={workdir}", *LOOP_ARGS, *args],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [row for row in rows if "loss/policy_loss" in row]


@pytest.mark.slow  # ~40 s on 2 CPU cores
def test_loop_with_routing_replay_logs_route_mismatch(tmp_path):
  """configs/tiny_moe.py with replay and bf16 compute: SFT, then 3 GRPO steps whose every
  log-prob pass replays the sampler's routes; rollout/route_mismatch logged each step."""
  rows = _loop(tmp_path / "run", "--config.model.dtype=bfloat16")
  values = [row["rollout/route_mismatch"] for row in rows]
  print("rollout/route_mismatch per step:", values)
  assert len(values) == 3 and all(0.0 <= v <= 1.0 for v in values), values


@pytest.mark.slow  # ~40-90 s each on 2 CPU cores
@pytest.mark.parametrize(
    "args",
    [
        ["--config.pack_sequences=True"],
        ["--config.rollout.max_staleness=1"],
        ["--config.rollout.placement=disaggregated"],
        ["--config.rollout.placement=disaggregated", "--config.rollout.max_staleness=1"],
        ["--config.lora.rank=4", "--config.pack_sequences=True"],
    ],
    ids=["packed", "one_step_off", "disaggregated", "disaggregated_one_step_off", "lora_packed"],
)
def test_loop_placements_with_routing_replay(tmp_path, args):
  """The loop's other placements replay the sampler's routes (f32): packed rows, one step off
  (routes drawn under the weights one update behind: the behaviour policy's choice, which R3
  replays), the sampler on its own devices (routes moved with the rows). Every step: a finite
  loss and gradient, rollout/route_mismatch logged; on-policy steps miss at most 2% of the
  recorded routes (f32: the trainer's own top-k is the sampler's; routes replayed at the wrong
  tokens would miss ~3/4 of them), one step off at most 30% (a weight update apart)."""
  reward = os.path.join(ROOT, "tests", "data", "digit_count_reward.py")
  rows = _loop(tmp_path / "run", f"--config.reward.custom_file={reward}", *args)
  assert len(rows) == 3
  assert all(np.isfinite(row["loss/policy_loss"]) for row in rows)
  assert all(np.isfinite(row["loss/grad_norm"]) for row in rows)
  assert any(row["loss/grad_norm"] > 0 for row in rows)  # the rewards vary: real updates
  mismatch = [(row["rollout/staleness"], row["rollout/route_mismatch"]) for row in rows]
  print(args, "(staleness, rollout/route_mismatch) per step:", mismatch)
  for staleness, value in mismatch:
    assert 0.0 <= value <= (0.02 if staleness == 0 else 0.3), mismatch
  if "--config.rollout.max_staleness=1" in args:
    assert any(staleness > 0 for staleness, _ in mismatch)


def _replaying(c, fields):
  """config `c` with routing_replay="rollout" and `fields` ({"a.b": value}) set."""
  c.rollout.routing_replay = "rollout"
  for k, v in fields.items():
    node, *path = [c, *k.split(".")]
    for p in path[:-1]:
      node = node[p]
    node[path[-1]] = v
  return c


def test_routing_replay_is_validated_in_one_line_each():
  from tests.test_config import errors_of
  from tests.test_config import load

  c = load("tiny_moe")
  c.rollout.routing_replay = "rollout"
  assert errors_of(c) == []
  for fields in (  # packed rows carry routes (rl/packing.py); the loop's other placements; LoRA
      {"pack_sequences": True},
      {"rollout.max_staleness": 1},
      {"rollout.placement": "disaggregated"},
      {"rollout.placement": "disaggregated", "rollout.max_staleness": 1},
      {"lora.rank": 4},
      {"lora.rank": 4, "pack_sequences": True},
  ):
    c = _replaying(load("tiny_moe"), fields)
    assert errors_of(c) == [], (fields, errors_of(c))
  cases = [
      ({"rollout.routing_replay": "always"}, "unknown routing replay mode"),
      ({"rollout.slots": 32}, "records routes in the lockstep sampler. Fix: set rollout.slots=0"),
      ({"rollout.engine": "vllm"}, "replayed by the native decoder"),
  ]
  for fields, why in cases:
    c = _replaying(load("tiny_moe"), fields)
    errs = [e for e in errors_of(c) if e.startswith("rollout.routing_replay")]
    assert len(errs) == 1 and why in errs[0], (fields, errs)
  dense = load("tiny")
  dense.rollout.routing_replay = "rollout"
  errs = errors_of(dense)
  assert errs == [
      "rollout.routing_replay='rollout': the model is dense: no routes to replay. "
      "Fix: routing_replay=none."
  ], errs


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("rollout.engine", "vllm", "weight sync has no mapping for an MoE model"),
        ("model.impl", "maxtext", "MaxText policy's mapping for an MoE model"),
    ],
)
def test_moe_paths_not_built_are_refused_in_one_line(field, value, why):
  from tests.test_config import errors_of
  from tests.test_config import load

  c = load("tiny_moe")
  node, *path = [c, *field.split(".")]
  for p in path[:-1]:
    node = node[p]
  node[path[-1]] = value
  errs = [e for e in errors_of(c) if e.startswith(f"{field}=")]
  assert any(why in e for e in errs), errors_of(c)


@pytest.mark.slow  # ~60-120 s on 2 CPU cores
def test_one_step_off_resume_keeps_the_in_flight_rollouts_routes(tmp_path):
  """An MoE policy one step off with routing replay, stopped after 3 of 5 steps: the in-flight
  rollout of step 4 travels with checkpoint 3 together with its routes (meta names their
  shape), and the resumed run == one never stopped: the same figures (route_mismatch too:
  the restored routes are replayed, not re-chosen) and bit-equal params."""
  from grpo_jax import train
  from tests.test_train import checkpoint_state
  from tests.test_train import flat
  from tests.test_train import grpo_rows
  from tests.test_train import tiny_config

  kw = {
      "model.num_experts": 4,
      "model.num_experts_per_tok": 2,
      "model.moe_intermediate_size": 32,
      "rollout.routing_replay": "rollout",
      "rollout.max_staleness": 1,
  }
  straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
  train.run(tiny_config(num_steps=5, **kw), straight)
  with pytest.raises(SystemExit):
    train.run(tiny_config(num_steps=5, max_steps_per_run=3, **kw), split)
  _, saved = checkpoint_state(split, 3)
  with open(os.path.join(split, "checkpoints", "3", "meta", "metadata")) as f:
    (entry,) = json.load(f)["rollout_pending"]
  routes = saved["pending"][0]["routes"]
  assert list(routes.shape) == entry["routes"]["shape"] and (np.asarray(routes) >= 0).any()
  train.run(tiny_config(num_steps=5, max_steps_per_run=3, **kw), split)
  a, b = grpo_rows(straight), grpo_rows(split)
  for ra, rb in zip(a, b, strict=True):
    for k in ("reward/total", "loss/policy_loss", "loss/grad_norm", "rollout/route_mismatch"):
      assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
  fa, fb = (flat(checkpoint_state(w, 5)[1]["train"]) for w in (straight, split))
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)
