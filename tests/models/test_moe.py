"""Qwen3-MoE: logit parity with transformers' Qwen3MoeForCausalLM (the ground truth), HF folders
in and out, greedy generation, every decoder mode over MoE layers, the experts' grouped
GEMMs against a dense per-expert reference (values and gradients), and expert parallelism
(moe.expert_parallel's all-to-all dispatch) on 8 fake devices against one device."""

import functools
import json

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.models import completion_logprobs
from grpo_jax.models import load_hf
from grpo_jax.models import save_hf
from grpo_jax.models.decoder import hf as hf_lib
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.moe import MoE
from grpo_jax.rollout import Sampler
from grpo_jax.rollout import sample
from grpo_jax.rollout.slots import SlotEngine
from tests.models.test_hf_parity import assert_parity
from tests.models.test_hf_parity import hf_logits
from tests.models.test_hf_parity import left_padded_batch
from tests.models.test_model import decode_logprobs
from tests.models.test_model import prompts_and_completions
from tests.rollout.test_sampler import prompts
from tests.rollout.test_sampler import trainer_logprobs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
CASES = [  # 8 experts throughout
    dict(num_experts_per_tok=2, norm_topk_prob=True),
    dict(num_experts_per_tok=8, norm_topk_prob=False),  # every expert, gates = softmax
    dict(num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1]),
    dict(num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2),  # layer 1 routed
]
IDS = ["top2-norm", "top8", "top2-mlp_only", "top3-sparse_step2"]


def hf_moe(kw, seed=0, layers=3):
  torch.manual_seed(seed)
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=VOCAB,
      hidden_size=64,
      intermediate_size=96,
      moe_intermediate_size=32,
      num_hidden_layers=layers,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      num_experts=8,
      max_position_embeddings=256,
      rope_theta=10000.0,
      attn_implementation="eager",
      **kw,
  )
  model = transformers.Qwen3MoeForCausalLM(cfg)
  with torch.no_grad():  # decisive routing and experts large enough to move the logits
    for name, p in model.named_parameters():
      if name.endswith("mlp.gate.weight"):
        p.copy_(0.3 * torch.randn_like(p))
      elif "experts" in name:
        p.copy_(0.1 * torch.randn_like(p))
      elif "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_logit_parity_left_padded(kw, tmp_path):
  model = hf_moe(kw)
  model.save_pretrained(tmp_path, safe_serialization=True)
  ours = load_hf(str(tmp_path))
  routed = [i for i in range(3) if ours.cfg.layer_is_moe(i)]
  assert ours.cfg.num_experts == 8 and routed == [
      i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")
  ]
  ids, mask = left_padded_batch(VOCAB)
  want = hf_logits(model, ids, mask)
  assert_parity(ours(jnp.asarray(ids), jnp.asarray(mask)), want, mask)
  # The routing is live: one expert fewer per token moves the logits.
  fewer = load_hf(str(tmp_path), num_experts_per_tok=kw["num_experts_per_tok"] - 1)
  assert np.abs(np.asarray(fewer(jnp.asarray(ids), jnp.asarray(mask))) - want).max() > 1e-3


def test_scanned_and_fused_paths(tmp_path):
  """Every layer routed: the layer scan stacks the experts [L, E, D, F]; the fused attention
  path runs them on the compacted rows."""
  model = hf_moe(CASES[0])
  model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
  ids, mask = left_padded_batch(VOCAB, seed=1)
  want = hf_logits(model, ids, mask)
  for variant in (dict(scan_layers=True), dict(attention_impl="fused", scan_layers=True)):
    ours = load_hf(str(tmp_path), **variant)
    assert_parity(ours(jnp.asarray(ids), jnp.asarray(mask)), want, mask)
  assert ours.layers.mlp.gate[...].shape == (3, 8, 64, 32)


def test_mixed_layers_cannot_be_scanned(tmp_path):
  model = hf_moe(CASES[2])
  model.save_pretrained(tmp_path, safe_serialization=True)
  with pytest.raises(ValueError, match="scan_layers.*dense and MoE layers mix"):
    load_hf(str(tmp_path), scan_layers=True)


@pytest.mark.parametrize("kw", [CASES[0], CASES[2]], ids=[IDS[0], IDS[2]])
def test_save_hf_round_trip(kw, tmp_path):
  model = hf_moe(kw, seed=3)
  model.save_pretrained(tmp_path / "src", safe_serialization=True)
  ours = load_hf(str(tmp_path / "src"))
  save_hf(ours, str(tmp_path / "out"), max_shard_bytes=100_000)
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert written["architectures"] == ["Qwen3MoeForCausalLM"]
  back = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "out"), attn_implementation="eager"
  )
  assert type(back).__name__ == "Qwen3MoeForCausalLM"
  assert back.config.norm_topk_prob == kw["norm_topk_prob"]
  assert list(back.config.mlp_only_layers) == kw.get("mlp_only_layers", [])
  ids, mask = left_padded_batch(VOCAB, seed=2)
  np.testing.assert_array_equal(hf_logits(back, ids, mask), hf_logits(model, ids, mask))
  again = load_hf(str(tmp_path / "out"))
  np.testing.assert_array_equal(
      np.asarray(again(jnp.asarray(ids), jnp.asarray(mask))),
      np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask))),
  )


def test_mapping_covers_every_tensor_once(tmp_path):
  from safetensors import safe_open

  model = hf_moe(CASES[2])
  model.save_pretrained(tmp_path, safe_serialization=True)
  cfg = ModelConfig.from_hf_config(model.config.to_dict())
  names = []
  for e in hf_lib.param_mapping(cfg):
    names += [n for _, _, n in hf_lib._native_paths(cfg, e)]
  with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
    assert sorted(names) == sorted(f.keys())


def test_greedy_equals_transformers_generate(tmp_path):
  model = hf_moe(CASES[2], seed=2)
  model.save_pretrained(tmp_path, safe_serialization=True)
  ours = load_hf(str(tmp_path))
  ids = np.random.default_rng(3).integers(1, VOCAB, (2, 5))
  with torch.no_grad():
    want = model.generate(
        torch.tensor(ids), max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0
    ).numpy()[:, 5:]
  r = sample(
      ours,
      jnp.asarray(ids, jnp.int32),
      jnp.ones((2, 5), jnp.int32),
      num_generations=1,
      max_new_tokens=12,
      rng=jax.random.key(0),
      generation="greedy",
      eos_ids=(),
  )
  np.testing.assert_array_equal(np.asarray(r.tokens), want)


# ------------------------------------------------------------------------- the native modes

MIXED = PRESETS["tiny-qwen3-moe"].replace(num_layers=3, mlp_only_layers=(1,))


@pytest.mark.parametrize("cfg", [MIXED, PRESETS["tiny-qwen3-moe"].replace(scan_layers=True)])
def test_prefill_decode_equals_training_forward(cfg):
  model = build_model(cfg, seed=1)
  prompt, pmask, comp, cmask = prompts_and_completions(cfg.vocab_size)
  ids = jnp.concatenate([prompt, comp], 1)
  mask = jnp.concatenate([pmask, cmask], 1)
  train = nnx.jit(completion_logprobs, static_argnums=3)(model, ids, mask, comp.shape[1])
  m = np.asarray(cmask) > 0
  for kw in (dict(), dict(repeat=3, shared=True)):
    dec = decode_logprobs(model, prompt, pmask, comp, **kw)[:: kw.get("repeat", 1)]
    assert np.abs(np.asarray(train - dec))[m].max() <= 1e-5


def test_slot_engine_equals_the_lockstep_sampler():
  """Block.decode_rows (per-row positions) over MoE layers: the lockstep sampler's greedy
  tokens, and raw log-probs = the trainer's (1e-5, f32)."""
  model = build_model(MIXED, seed=0)
  graphdef, state = nnx.split(model)
  ids, mask = prompts(MIXED.vocab_size, b=4)
  kw = dict(max_prompt_length=7, max_new_tokens=10, num_generations=3, eos_ids=(5, 9))
  want = Sampler(graphdef, **kw)(state, ids, mask, jax.random.key(1), "greedy")
  got = SlotEngine(graphdef, slots=5, chunk=3, **kw)(state, ids, mask, jax.random.key(1), "greedy")
  np.testing.assert_array_equal(got.tokens, want.tokens)
  m = np.asarray(got.mask) > 0
  train = np.asarray(trainer_logprobs(model, ids, mask, got, 3))
  assert np.abs(train - np.asarray(got.raw_logprobs))[m].max() <= 1e-5


def test_packed_rows_equal_separate_sequences():
  model = build_model(MIXED, seed=4)
  rng = np.random.default_rng(0)
  a, b = rng.integers(1, MIXED.vocab_size, 5), rng.integers(1, MIXED.vocab_size, 4)
  row = jnp.asarray(np.concatenate([a, b, [0, 0]])[None], jnp.int32)
  segments = jnp.asarray([[1] * 5 + [2] * 4 + [0, 0]], jnp.int32)
  positions = jnp.asarray([list(range(5)) + list(range(4)) + [0, 0]], jnp.int32)
  packed = np.asarray(model.packed_hidden(row, segments, positions))[0]
  alone_a = np.asarray(model.hidden(jnp.asarray(a[None], jnp.int32)))[0]
  alone_b = np.asarray(model.hidden(jnp.asarray(b[None], jnp.int32)))[0]
  np.testing.assert_allclose(packed[:5], alone_a, atol=1e-5)
  np.testing.assert_allclose(packed[5:9], alone_b, atol=1e-5)


# ------------------------------------------------------------------------------- the experts


def dense_reference(params, x_nd, k, norm_topk_prob):
  """Every expert on every token, weighted by a dense [N, E] gate matrix (zero off the top k):
  what the sorted grouped GEMMs must equal."""
  probs = jax.nn.softmax(x_nd @ params["router"], axis=-1)  # [N, E]
  top = jnp.argsort(-probs, axis=-1)[:, :k]
  chosen = jnp.zeros_like(probs).at[jnp.arange(x_nd.shape[0])[:, None], top].set(1.0)
  gates = probs * chosen
  if norm_topk_prob:
    gates = gates / gates.sum(-1, keepdims=True)
  g = jnp.einsum("nd,edf->enf", x_nd, params["gate"])
  u = jnp.einsum("nd,edf->enf", x_nd, params["up"])
  y = jnp.einsum("enf,efd->end", jax.nn.silu(g) * u, params["down"])
  return jnp.einsum("end,ne->nd", y, gates)


@pytest.mark.parametrize("k,norm", [(2, True), (3, False)])
def test_experts_equal_a_dense_reference_with_gradients(k, norm):
  cfg = PRESETS["tiny-qwen3-moe"].replace(num_experts_per_tok=k, norm_topk_prob=norm)
  moe = MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 11, cfg.hidden_size))
  graphdef, params = nnx.split(moe)
  pure = nnx.to_pure_dict(params)
  cot = jax.random.normal(jax.random.key(2), x.shape)

  def ours(p, x):
    state = nnx.State(params)
    nnx.replace_by_pure_dict(state, p)
    return (nnx.merge(graphdef, state)(x) * cot).sum()

  def ref(p, x):
    return (dense_reference(p, x.reshape(-1, x.shape[-1]), k, norm).reshape(x.shape) * cot).sum()

  (v1, g1), (v2, g2) = (jax.value_and_grad(f, argnums=(0, 1))(pure, x) for f in (ours, ref))
  np.testing.assert_allclose(v1, v2, rtol=1e-5)
  for name in ("router", "gate", "up", "down"):
    np.testing.assert_allclose(g1[0][name], g2[0][name], atol=1e-5, err_msg=name)
    assert np.abs(np.asarray(g1[0][name])).max() > 1e-3, name  # the gates carry the router's
  np.testing.assert_allclose(g1[1], g2[1], atol=1e-5)


# ------------------------------------------------------------------------------- the config


def test_presets_match_the_published_shapes():
  c = PRESETS["qwen3-30b-a3b"]
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
      48,
      2048,
      32,
      4,
      128,
  )
  assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 768)
  assert c.norm_topk_prob and c.vocab_size == 151936 and all(c.moe_layers)
  assert 30.4e9 < c.num_params < 30.6e9  # "30.5B" (Qwen3-30B-A3B's model card)
  assert 235.0e9 < PRESETS["qwen3-235b-a22b"].num_params < 235.2e9
  # num_params counts what the module holds, dense and routed layers mixed.
  model = nnx.eval_shape(lambda: build_model(MIXED))
  held = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert held == MIXED.num_params


def test_bad_moe_fields_are_named():
  base = PRESETS["tiny-qwen3-moe"]
  for kw, field in [
      (dict(num_experts_per_tok=9), "num_experts_per_tok"),
      (dict(moe_intermediate_size=0), "moe_intermediate_size"),
      (dict(mlp_only_layers=(5,)), "mlp_only_layers"),
      (dict(decoder_sparse_step=0), "decoder_sparse_step"),
      (dict(arch="llama3", qk_norm=False), "num_experts"),
  ]:
    assert field in [f for f, *_ in base.replace(**kw).problems()], kw
  assert not base.problems() and not MIXED.problems()


# ------------------------------------------------------------------------ expert parallelism

# 8 fake devices as (data, fsdp, tensor, expert): the experts split 4, 8 and 2 ways, with
# their D over fsdp (gathered in the shard_map) or their F over tensor (summed after it).
EP_MESHES = [(1, 2, 1, 4), (1, 1, 1, 8), (2, 1, 2, 2)]
EP_IDS = ["fsdp2-ep4", "ep8", "data2-tensor2-ep2"]
# The default suite runs the first mesh (fsdp and expert together); the others are slow (suite
# time: each mesh compiles its own programs).
EP_PARAMS = [
    pytest.param(shape, id=name, marks=() if i == 0 else pytest.mark.slow)
    for i, (shape, name) in enumerate(zip(EP_MESHES, EP_IDS))
]


def ep_mesh(shape):
  from grpo_jax.parallel import sharding

  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  mesh = sharding.make_mesh(*shape[:3], expert=shape[3])
  assert tuple(mesh.shape.values()) == shape
  return mesh


def all_to_alls(compiled_text: str) -> int:
  return sum(" all-to-all(" in line for line in compiled_text.splitlines())


@pytest.mark.parametrize("shape", EP_PARAMS)
def test_expert_parallel_mesh_equals_one_device(shape):
  """8 devices with the experts split over `expert` (moe.expert_parallel: the all-to-all
  dispatch, in the compiled program) and rows over data * fsdp * expert: logits, loss,
  gradients and one update equal the single-device model's (1e-5, f32). The update is SGD's:
  AdamW's first step g / (|g| + eps) turns the f32 summation-order noise of a gradient near eps
  (~5e-8 here) into 1e-5 of lr, on any two layouts; the gradients it would read are held to
  1e-5 directly."""
  import optax

  from grpo_jax.parallel import sharding

  cfg = MIXED
  mesh = ep_mesh(shape)
  data, fsdp, tensor, ep = shape
  single = build_model(cfg, seed=5)
  split = build_model(cfg, seed=5, mesh=mesh)
  gate = split.layers[0].mlp.gate[...]
  assert gate.sharding.spec == jax.sharding.PartitionSpec("expert", "fsdp", "tensor")
  assert gate.addressable_shards[0].data.shape == (8 // ep, 64 // fsdp, 32 // tensor)
  ids, mask = prompts(cfg.vocab_size, b=8, p=9)

  def loss(model, ids, mask):
    lp = jax.nn.log_softmax(model(ids, mask)[:, :-1], -1)
    tok = jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0]
    return -(tok * mask[:, 1:]).sum() / mask[:, 1:].sum()

  opt = optax.sgd(0.1)

  def run(model, mesh=None):
    graphdef, params = nnx.split(model)

    def step(params, ids, mask):
      value, grads = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), ids, mask))(params)
      updates, _ = opt.update(grads, opt.init(params), params)
      logits = nnx.merge(graphdef, params)(ids, mask)
      return logits, value, grads, optax.apply_updates(params, updates)

    if mesh is None:
      return jax.jit(step)(params, ids, mask)
    rows = sharding.batch_sharding(mesh)
    args = (jax.device_put(ids, rows), jax.device_put(mask, rows))
    compiled = jax.jit(sharding.traced_in(step, mesh)).lower(params, *args).compile()
    # Two MoE layers, each: dispatch, counts and return forward, their transposes backward.
    assert all_to_alls(compiled.as_text()) >= 2 * 3
    return compiled(params, *args)

  want, got = run(single), run(split, mesh)
  m = np.asarray(mask) > 0
  assert np.abs(np.asarray(got[0]) - np.asarray(want[0]))[m].max() <= 1e-5
  np.testing.assert_allclose(got[1], want[1], atol=1e-6)
  for g, w in zip(jax.tree.leaves(got[2:]), jax.tree.leaves(want[2:])):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
  moved = np.abs(np.asarray(got[3]["layers"][0]["mlp"]["gate"][...]) - np.asarray(gate)).max()
  assert moved > 1e-3  # the update reached the experts


@pytest.mark.slow  # ~45 s (suite time); the default suite runs the layer-level replay
def test_expert_parallel_routing_replay_equals_one_device():
  """The scanned model's routing-replay forward (Transformer.hidden_routed: every layer's
  experts from recorded routes, some tokens none) on the expert-parallel mesh (fsdp 2, expert
  4): the single device's hidden states, own routes and gradients (1e-5, f32)."""
  from grpo_jax.parallel import sharding

  cfg = PRESETS["tiny-qwen3-moe"].replace(scan_layers=True)
  mesh = ep_mesh((1, 2, 1, 4))
  ids, mask = prompts(cfg.vocab_size, b=8, p=9)
  rng = np.random.default_rng(6)
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  routes = np.stack([rng.permutation(e)[:k] for _ in range(8 * 9 * cfg.num_layers)])
  routes = routes.reshape(8, 9, cfg.num_layers, k)
  routes[rng.random((8, 9)) < 0.25] = -1
  routes = jnp.asarray(routes, jnp.int8)
  cot = jax.random.normal(jax.random.key(8), (8, 9, cfg.hidden_size)) / np.sqrt(8 * 9)

  def f(graphdef, params, ids, mask, routes):
    def value(p):
      hidden, own = nnx.merge(graphdef, p).hidden_routed(ids, mask, routes)
      return (hidden * cot * mask[..., None]).sum(), (hidden, own)

    return jax.value_and_grad(value, has_aux=True)(params)

  def run(model, mesh=None):
    graphdef, params = nnx.split(model)
    fn = functools.partial(f, graphdef)
    if mesh is None:
      return jax.jit(fn)(params, ids, mask, routes)
    rows = sharding.batch_sharding(mesh)
    args = (jax.device_put(ids, rows), jax.device_put(mask, rows))
    args += (jax.device_put(routes, sharding.batch_sharding(mesh, 4)),)
    compiled = jax.jit(sharding.traced_in(fn, mesh)).lower(params, *args).compile()
    # The scanned layer's dispatch, counts and return forward, two transposes backward.
    assert all_to_alls(compiled.as_text()) >= 5
    return compiled(params, *args)

  (_, (h1, own1)), g1 = run(build_model(cfg, seed=6))
  (_, (h2, own2)), g2 = run(build_model(cfg, seed=6, mesh=mesh), mesh)
  m = np.asarray(mask) > 0
  assert np.abs(np.asarray(h2) - np.asarray(h1))[m].max() <= 1e-5
  np.testing.assert_array_equal(np.asarray(own2)[m], np.asarray(own1)[m])
  for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def moe_value_and_grads(moe, x, routes, mesh=None):
  """(y, own, d<y, cot>/d(params, x)) of `moe.routed(x, routes)`, jitted on one device or
  traced under `mesh` with the parameters sharded by their logical axes and rows over the
  batch axes."""
  from grpo_jax.parallel import sharding

  graphdef, params = nnx.split(moe)
  # A cotangent of norm ~ sqrt(D): gradients O(1), as a per-token mean loss gives them.
  cot = jax.random.normal(jax.random.key(7), x.shape) / np.sqrt(x.shape[0] * x.shape[1])

  def f(params, x, routes):
    def value(p, x):
      y, own = nnx.merge(graphdef, p).routed(x, routes)
      return (y * cot).sum(), (y, own)

    (_, (y, own)), grads = jax.value_and_grad(value, argnums=(0, 1), has_aux=True)(params, x)
    return y, own, grads

  if mesh is None:
    return jax.jit(f)(params, x, routes)
  params = jax.device_put(params, sharding.state_shardings(params, mesh))
  rows = sharding.batch_sharding(mesh, 3)
  return jax.jit(sharding.traced_in(f, mesh))(
      params, jax.device_put(x, rows), jax.device_put(routes, rows)
  )


def one_shard_router(moe, x_btd):
  """(x, router weights) that send every token to the last two experts (the last shard's when
  ep <= 4): feature 0 set to 1 in every token, the router's row 0 giving those two experts
  positive logits and the others negative, its other rows 0."""
  e = moe.num_experts
  w = np.zeros(moe.router[...].shape, np.float32)
  w[0] = -1.0
  w[0, e - 1], w[0, e - 2] = 1.0, 0.5
  moe.router[...] = jnp.asarray(w)
  return x_btd.at[..., 0].set(1.0)


@pytest.mark.parametrize("shape", EP_PARAMS)
@pytest.mark.parametrize("routing", ["own", "replayed", "all-to-one-shard", "router-to-one-shard"])
def test_expert_parallel_experts_are_dropless_and_exact(shape, routing):
  """moe.routed under the mesh == on one device (outputs, own top-k, gradients of the
  parameters and inputs; 1e-5, f32): the router's own choice, replayed routes (some tokens
  with none: -1), and every token on the last shard's experts (replayed, or by the router's
  weights), where all 8 devices send all their pairs to one shard's experts: a dispatch buffer
  short of that worst case drops pairs and the outputs differ."""
  mesh = ep_mesh(shape)
  cfg = PRESETS["tiny-qwen3-moe"]
  moe = MoE(cfg, rngs=nnx.Rngs(3))
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  x = jax.random.normal(jax.random.key(4), (8, 6, cfg.hidden_size))
  rng = np.random.default_rng(5)
  routes = np.stack([rng.permutation(e)[:k] for _ in range(8 * 6)]).reshape(8, 6, k)
  routes[rng.random((8, 6)) < 0.3] = -1
  if routing == "own":
    routes[:] = -1
  elif routing == "all-to-one-shard":
    routes[:] = [e - 1, e - 2]
  elif routing == "router-to-one-shard":
    routes[:] = -1
    x = one_shard_router(moe, x)
  routes = jnp.asarray(routes, jnp.int8)
  want = moe_value_and_grads(moe, x, routes)
  got = moe_value_and_grads(moe, x, routes, mesh)
  if routing == "router-to-one-shard":
    assert set(np.unique(np.asarray(want[1]))) == {e - 2, e - 1}
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5)
  assert np.abs(np.asarray(want[0])).min(-1).max() > 0  # every token's output is live
  for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)


def test_expert_parallel_is_the_compiled_dispatch():
  """The compiled CPU program of the MoE forward: all-to-alls (dispatch, counts, return) with
  the experts split over `expert`; none on a mesh without an expert axis (expert = 1: the
  unsplit grouped GEMMs, as GSPMD partitions them), nor on one device."""
  from grpo_jax.parallel import sharding

  cfg = PRESETS["tiny-qwen3-moe"]
  moe = MoE(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(moe)
  x = jnp.ones((8, 4, cfg.hidden_size))

  def forward(params, x):
    return nnx.merge(graphdef, params)(x)

  def compiled(mesh):
    if mesh is None:
      return jax.jit(forward).lower(params, x).compile().as_text()
    placed = jax.device_put(params, sharding.state_shardings(params, mesh))
    rows = jax.device_put(x, sharding.batch_sharding(mesh, 3))
    return jax.jit(sharding.traced_in(forward, mesh)).lower(placed, rows).compile().as_text()

  assert all_to_alls(compiled(ep_mesh((1, 2, 1, 4)))) == 3
  assert all_to_alls(compiled(ep_mesh((1, 8, 1, 1)))) == 0
  assert all_to_alls(compiled(None)) == 0


@pytest.mark.slow  # ~45 s (suite time); the default suite runs the layer-level replay
def test_expert_parallel_sampling_equals_one_device():
  """The sampler's prefill and decode and the slot engine's programs over the expert-parallel
  mesh (data 1, fsdp 2, tensor 1, expert 4; a decode step's rows padded to the 8 devices where
  fewer): the single device's greedy tokens, log-probs (1e-5) and recorded routes."""
  from grpo_jax.parallel import sharding

  mesh = ep_mesh((1, 2, 1, 4))
  model = build_model(MIXED, seed=2)
  graphdef, state = nnx.split(model)
  placed = jax.device_put(state, sharding.state_shardings(state, mesh))
  ids, mask = prompts(MIXED.vocab_size, b=8)
  rows = sharding.batch_sharding(mesh)
  on_mesh = (jax.device_put(ids, rows), jax.device_put(mask, rows))
  kw = dict(max_prompt_length=7, max_new_tokens=6, num_generations=2, eos_ids=(3,))
  key = jax.random.key(4)
  want = Sampler(graphdef, record_routes=True, **kw)(state, ids, mask, key, "greedy")
  got = Sampler(graphdef, record_routes=True, mesh=mesh, **kw)(placed, *on_mesh, key, "greedy")
  slots = SlotEngine(graphdef, slots=8, chunk=3, mesh=mesh, **kw)(placed, *on_mesh, key, "greedy")
  for r in (got, slots):
    np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(r.mask), np.asarray(want.mask))
    np.testing.assert_allclose(np.asarray(r.raw_logprobs), np.asarray(want.raw_logprobs), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got.routes), np.asarray(want.routes))


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((8, 1, 1, 1), id="data8"),
        pytest.param((4, 2, 1, 1), id="data4-fsdp2", marks=pytest.mark.slow),
    ],
)
def test_kernel_on_a_mesh_without_expert_axis_runs_each_devices_rows(shape, monkeypatch):
  """A grouped-GEMM custom call (the GPU kernel) is not partitioned by GSPMD: on a mesh of
  several devices with one expert shard, moe runs it in expert_parallel's shard_map (each
  device its own rows) == one device, values and gradients; with the experts split over fsdp
  it runs XLA's partitioned ragged_dot instead (no kernel: it would gather whole experts).
  (Here a stand-in for the kernel that XLA:CPU runs: ragged_dot behind another function.)"""
  from grpo_jax.models.decoder import moe as moe_lib

  calls = []

  def kernel(x, w, sizes):
    calls.append(x.shape)
    return jax.lax.ragged_dot(x, w, sizes)

  monkeypatch.setattr(moe_lib, "grouped_matmul_for", lambda mesh, dtype: kernel)
  mesh = ep_mesh(shape)
  cfg = PRESETS["tiny-qwen3-moe"]
  moe = MoE(cfg, rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(4), (8, 6, cfg.hidden_size))
  routes = jnp.full((8, 6, cfg.num_experts_per_tok), -1, jnp.int8)
  want = moe_value_and_grads(moe, x, routes)
  calls.clear()
  got = moe_value_and_grads(moe, x, routes, mesh)
  if shape[1] > 1:  # experts split over fsdp: XLA's partitioned ragged_dot, not the kernel
    assert not calls, calls
  else:
    rows_per_device = 8 * 6 * cfg.num_experts_per_tok // shape[0]
    assert calls and all(c[0] == rows_per_device for c in calls), calls  # each device its rows
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5)
  for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
