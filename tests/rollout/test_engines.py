"""Both rollout engines satisfy one interface (grpo_jax/rollout/engine.py): the native engine
always, vLLM when installed. Same call, same Rollout contract, same optional figures."""

import copy
import importlib.util
import os

from flax import nnx
import jax
import numpy as np
import pytest

from grpo_jax import data as data_lib
from grpo_jax.parallel import multihost
from grpo_jax import rollout
from grpo_jax.parallel import sharding
from grpo_jax.models import build
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.rollout.types import GenerationConfig
from tests.conftest import vllm_unusable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_VLLM = vllm_unusable()  # "" when the vLLM engine runs here, else why not
KINDS = ["native", pytest.param("vllm", marks=pytest.mark.skipif(bool(NO_VLLM), reason=NO_VLLM))]
B, G = 8, 4
_GREEDY = {}  # kind -> (tokens, mask) of a greedy rollout, compared across engines


@pytest.fixture(scope="module")
def setup():
  os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
  spec = importlib.util.spec_from_file_location(
      "cfg_tiny", os.path.join(ROOT, "configs", "tiny.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.num_generations = G
  config.max_completion_length = 7
  config.lock()
  mesh = build.make_mesh(config)
  policy = build.make_policy(config, mesh)
  tok = data_lib.build_tokenizer("char")
  rows = data_lib.arithmetic_rows(B, split="test", seed=0)
  data = data_lib.PromptData(
      rows, tok, template="plain", system_prompt="", max_prompt_length=config.max_prompt_length
  )
  return dict(config=config, mesh=mesh, policy=policy, tok=tok, batch=data.batch(np.arange(B)))


@pytest.mark.parametrize("kind", KINDS)
def test_engine_contract(setup, kind):
  s = setup
  config, mesh, policy, tok = s["config"], s["mesh"], s["policy"], s["tok"]
  engine = rollout.make_engine(config, policy, tok, mesh, kind=kind)
  try:
    assert isinstance(engine.matches_trainer, bool)
    gen = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0)
    r = engine.generate(policy.params, s["batch"], jax.random.key(1), gen)
    assert isinstance(r, rollout.Rollout)
    n, c = B * G, config.max_completion_length
    rows_spec = sharding.batch_sharding(mesh, 2).spec
    for name in ("tokens", "mask", "logprobs", "raw_logprobs"):
      x = getattr(r, name)
      assert x.shape == (n, c), name
      assert x.sharding.spec[0] == rows_spec[0], name  # rows over (data, fsdp), like the update
    assert r.lengths.shape == r.truncated.shape == (n,)
    tokens, mask = multihost.local_rows(r.tokens), multihost.local_rows(r.mask)
    logp = multihost.local_rows(r.logprobs)
    lengths, truncated = multihost.local_rows(r.lengths), multihost.local_rows(r.truncated)
    assert ((mask == 0) | (mask == 1)).all()
    assert (np.diff(mask, axis=1) <= 0).all()  # 1 up to the stop token, then 0
    np.testing.assert_array_equal(lengths, mask.sum(-1))
    assert (tokens[mask == 0] == tok.pad_id).all()
    eos_at_end = np.array(
        [m.sum() > 0 and t[m.sum() - 1] in tok.stop_ids for t, m in zip(tokens, mask)]
    )
    np.testing.assert_array_equal(truncated, ~eos_at_end)
    assert (lengths[truncated] == c).all()
    assert (logp[mask == 0] == 0).all() and (logp[mask == 1] <= 0).all()
    # The sampled tokens' log-probs are the trainer's: exactly when the engine runs the
    # trainer's program, within the cross-engine tolerance of tests/rollout/test_vllm.py otherwise.
    ids = np.concatenate([np.repeat(s["batch"]["prompt_ids"], G, 0), tokens], 1)
    am = np.concatenate([np.repeat(s["batch"]["prompt_mask"], G, 0), mask], 1)
    trainer = np.asarray(
        completion_logprobs(nnx.merge(policy.graphdef, policy.params), ids, am, c, 1.0)
    )
    tol = 1e-5 if engine.matches_trainer else 1e-4
    assert np.abs((trainer - logp) * mask).max() <= tol
    stats = engine.stats()
    assert isinstance(stats, dict) and all(isinstance(v, float) for v in stats.values())
    g = engine.generate(policy.params, s["batch"], jax.random.key(0), "greedy")
    _GREEDY[kind] = (multihost.local_rows(g.tokens), multihost.local_rows(g.mask))
  finally:
    engine.close()


@pytest.mark.skipif(bool(NO_VLLM), reason=NO_VLLM)
def test_engines_agree_on_greedy(setup):
  if set(_GREEDY) != {"native", "vllm"}:
    pytest.skip("needs both engine contract tests to have run")
  (t1, m1), (t2, m2) = _GREEDY["native"], _GREEDY["vllm"]
  np.testing.assert_array_equal(m1, m2)
  np.testing.assert_array_equal(t1 * m1, t2 * m2)


def test_slot_scan_layers_reaches_the_engine_and_draws_the_per_layer_tokens(setup):
  """config.rollout.slot_scan_layers picks the slot engine's scanned programs (one layer scan
  over stacked caches), on the run's 8-device mesh; greedy rows equal the per-layer engine's."""
  s = setup
  gen = GenerationConfig(temperature=0.0, top_k=0, top_p=1.0)
  out = {}
  for scan in (False, True):
    config = copy.deepcopy(s["config"])
    config.rollout.slots = B * G
    config.rollout.slot_scan_layers = scan
    engine = rollout.make_engine(config, s["policy"], s["tok"], s["mesh"], kind="native")
    assert engine.sampler.scan_layers is scan
    r = engine.generate(s["policy"].params, s["batch"], jax.random.key(1), gen)
    out[scan] = (multihost.local_rows(r.tokens), multihost.local_rows(r.logprobs))
    if scan:
      assert engine.sampler._state["k"].ndim == 5  # [L, slots, Hkv, S, K]
    engine.close()
  np.testing.assert_array_equal(out[True][0], out[False][0])
  np.testing.assert_allclose(out[True][1], out[False][1], atol=1e-5)


def test_step_graphs_reach_both_engines_and_their_gpu_options(setup):
  """config.rollout.step_graphs reaches the lockstep Sampler and the SlotEngine (a no-op off
  GPU); on GPU each slot program gets its option sets merged, disabled passes joined."""
  from types import SimpleNamespace

  from grpo_jax.rollout import gpu_options
  from grpo_jax.rollout.slot_programs import SlotPrograms

  s = setup
  for slots in (0, B * G):
    config = copy.deepcopy(s["config"])
    config.rollout.slots = slots
    config.rollout.step_graphs = True
    engine = rollout.make_engine(config, s["policy"], s["tok"], s["mesh"], kind="native")
    assert engine.sampler.step_graphs is True, type(engine.sampler)
    engine.close()

  both = gpu_options.merged(gpu_options.SCANNED_GPU_OPTIONS, gpu_options.STEP_GRAPH_OPTIONS)
  assert both["xla_disable_hlo_passes"] == "dot-merger,dynamic-slice-copy-fusion-async-wrapper"
  assert both["xla_gpu_enable_dynamic_slice_fusion"] is True
  assert "WHILE" in both["xla_gpu_enable_command_buffer"].split(",")
  assert gpu_options.merged() == {}
  # (either order: a dict update would keep the later set's list alone)
  assert gpu_options.merged(gpu_options.STEP_GRAPH_OPTIONS, gpu_options.SCANNED_GPU_OPTIONS) == both
  options = lambda **kw: SlotPrograms._gpu_options(SimpleNamespace(**kw), "decode")  # noqa: E731
  assert options(platform="gpu", scan_layers=True, step_graphs=True) == both
  assert options(platform="gpu", scan_layers=False, step_graphs=True) == (
      gpu_options.STEP_GRAPH_OPTIONS
  )
  assert options(platform="gpu", scan_layers=True, step_graphs=False) == (
      gpu_options.SCANNED_GPU_OPTIONS
  )
  assert options(platform="cpu", scan_layers=True, step_graphs=True) is None
  assert (
      SlotPrograms._gpu_options(
          SimpleNamespace(platform="gpu", scan_layers=False, step_graphs=True), "take"
      )
      is None
  )
