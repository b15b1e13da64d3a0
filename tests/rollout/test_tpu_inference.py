"""Weight sync into vLLM-TPU's JAX model (grpo_jax/rollout/tpu_inference_mapping.py, tpu_inference_sync.py).

Without tpu-inference (the main venv): the name/layout mapping on tiny Qwen3 and Llama models
(scanned and not, tied and not, 1 and 4 tensor-parallel devices, both q layouts): every target
name once, shapes as tpu-inference 0.32.0 builds them, the round trip native -> target -> native
bit for bit, the mapping equal to tpu-inference's checkpoint-loader transforms applied to our HF
export, padded/repeated heads computing the same attention, and the on-device push into a
sharded target state (same chips and other chips) with host transfers disallowed.

With tpu-inference (scripts/test_tpu_pins.sh --full): its own Qwen3ForCausalLM /
LlamaForCausalLM built abstractly on CPU (nnx.eval_shape) have exactly the mapped names and
shapes; its own checkpoint loaders, fed our HF export, produce exactly our mapped arrays; the
push writes into the model its loader built, keeping its shardings.
"""

import importlib.util
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.transformer import build_model
from grpo_jax.rollout import tpu_inference_mapping as tim
from grpo_jax.rollout import tpu_inference_sync as tis


def qwen3(**kw):
  base = dict(
      arch="qwen3",
      vocab_size=97,
      hidden_size=64,
      intermediate_size=96,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=64,
      tie_embeddings=False,
      max_position_embeddings=256,
  )
  return ModelConfig(**{**base, **kw})


def llama3(**kw):
  base = dict(
      arch="llama3",
      vocab_size=104,
      hidden_size=64,
      intermediate_size=128,
      num_layers=2,
      num_heads=8,
      num_kv_heads=2,
      head_dim=8,
      qk_norm=False,
      rope_theta=5e5,
      rms_norm_eps=1e-5,
      tie_embeddings=True,
      max_position_embeddings=256,
  )
  return ModelConfig(**{**base, **kw})


CASES = {
    "qwen3-untied-scan-tp1": (qwen3(scan_layers=True), 1, "DNH"),
    "qwen3-tied-tp2": (qwen3(tie_embeddings=True), 2, "DNH"),
    "qwen3-ndh-scan-tp2": (qwen3(scan_layers=True), 2, "NDH"),
    "qwen3-hd128-tp1": (qwen3(head_dim=128, scan_layers=True), 1, "DNH"),
    "llama3-tied-tp1": (llama3(), 1, "DNH"),
    "llama3-untied-scan-tp4": (llama3(tie_embeddings=False, scan_layers=True), 4, "DNH"),
}


def native(cfg, seed=0):
  return nnx.state(build_model(cfg, seed=seed), nnx.Param)


def flat_np(state):
  return {p: np.asarray(v) for p, v in tim.native_flat(state, None).items()}


def expected_shapes(cfg, tp, q_layout):
  """tpu-inference 0.32.0's parameter shapes, written out from its model code (qwen3.py,
  llama3.py, utils.get_padded_head_dim / get_padded_num_heads / align_to)."""
  d, f, h, g, k, v = (
      cfg.hidden_size,
      cfg.intermediate_size,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.head_dim,
      cfg.vocab_size,
  )
  kp = 64 if k == 64 else -(-k // 128) * 128
  gp = max(g, tp)
  if cfg.arch == "qwen3":
    vp = -(-v // tp) * tp
    out = {"model.embed_tokens.weight": (vp, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
      out["lm_head.weight"] = (d, vp)
    per = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (d, h, kp) if q_layout == "DNH" else (h, d, kp),
        "self_attn.k_proj.weight": (d, gp, kp),
        "self_attn.v_proj.weight": (d, gp, kp),
        "self_attn.o_proj.weight": (h, kp, d),
        "self_attn.q_norm.weight": (kp,),
        "self_attn.k_norm.weight": (kp,),
        "mlp.gate_proj.weight": (d, f),
        "mlp.up_proj.weight": (d, f),
        "mlp.down_proj.weight": (f, d),
    }
  else:
    out = {"model.embed.embedding": (v, d), "model.norm.scale": (d,)}
    if not cfg.tie_embeddings:
      out["model.lm_head"] = (d, v)
    per = {
        "input_layernorm.scale": (d,),
        "post_attention_layernorm.scale": (d,),
        "self_attn.q_proj.kernel": (d, h, kp),
        "self_attn.k_proj.kernel": (d, gp, kp),
        "self_attn.v_proj.kernel": (d, gp, kp),
        "self_attn.o_proj.kernel": (h, kp, d),
        "mlp.gate_proj.kernel": (d, f),
        "mlp.up_proj.kernel": (d, f),
        "mlp.down_proj.kernel": (f, d),
    }
  for i in range(cfg.num_layers):
    out.update({f"model.layers.{i}.{n}": s for n, s in per.items()})
  return out


# ------------------------------------------------------------ the mapping (no tpu_inference)


@pytest.mark.parametrize("case", list(CASES))
def test_names_shapes_and_round_trip(case):
  cfg, tp, q_layout = CASES[case]
  lay = tim.Layout.expected(cfg, tp, q_layout)
  names = tim.target_names(cfg)
  assert len(names) == len(set(names))  # each target written once
  want = expected_shapes(cfg, tp, q_layout)
  assert set(names) == set(want)
  state = native(cfg)
  # Every native parameter is read by exactly one rule.
  used = [
      (("layers", *r.path) if cfg.scan_layers else ("layers", i, *r.path))
      if r.per_layer
      else r.path
      for r in tim.rules(cfg)
      for i in (range(cfg.num_layers) if r.per_layer and not cfg.scan_layers else [0])
  ]
  assert sorted(map(str, used)) == sorted(map(str, tim.native_flat(state, cfg)))
  target = tim.to_target_tree(state, cfg, lay, jnp.bfloat16)
  assert {n: tuple(a.shape) for n, a in target.items()} == want
  assert all(a.dtype == jnp.bfloat16 for a in target.values())
  # The layout read back from the shapes is the predicted one.
  assert tim.Layout.from_target(cfg, want) == lay
  # Round trip, bit for bit (f32 here).
  back = tim.from_target_tree(tim.to_target_tree(state, cfg, lay), cfg, lay)
  orig = flat_np(state)
  assert set(back) == set(orig)
  for p, x in orig.items():
    np.testing.assert_array_equal(np.asarray(back[p]), x, err_msg=str(p))


def _loader_view(cfg, tp, q_layout, model=None):
  """{target name: array} built the way tpu-inference's checkpoint loaders build it from a
  Hugging Face export (weight_utils.get_default_maps / _load_and_shard_weight for Llama,
  JaxAutoWeightsLoader's reshape_dims/permute_dims for Qwen3): an independent route to the
  same arrays, from the HF tensors (models/decoder/hf.py, tested against transformers) of `model`
  (default: a native model of `cfg`)."""
  model = build_model(cfg, seed=3) if model is None else model
  tensors = {n: p() for n, p in hf.hf_tensors(model)}
  h, g, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
  kp = tim.padded_head_dim(k)
  rep = max(g, tp) // g

  def heads(w, n):  # HF [n*K, D] -> reshape (n, K, D), pad K, transpose (2, 0, 1) -> [D, n, Kp]
    w = np.pad(w.reshape(n, k, d), ((0, 0), (0, kp - k), (0, 0)))
    return w.transpose(2, 0, 1)

  out = {}
  qwen = cfg.arch == "qwen3"
  for name, w in tensors.items():
    short = name.removesuffix(".weight")
    if "q_proj" in name:
      y = heads(w, h)
      y = y.transpose(1, 0, 2) if q_layout == "NDH" else y
    elif "k_proj" in name or "v_proj" in name:
      y = np.repeat(heads(w, g), rep, axis=1)
    elif "o_proj" in name:  # [D, H*K] -> (D, H, K), pad K, transpose (1, 2, 0) -> [H, Kp, D]
      y = np.pad(w.reshape(d, h, k), ((0, 0), (0, 0), (0, kp - k))).transpose(1, 2, 0)
    elif any(s in name for s in ("gate_proj", "up_proj", "down_proj")) or name == "lm_head.weight":
      y = w.T
    else:
      y = w
    if "embed_tokens" in name or name == "lm_head.weight":
      rows = tim.Layout.expected(cfg, tp).vocab_rows
      y = np.pad(
          y,
          ((0, rows - y.shape[0]), (0, 0)) if "embed" in name else ((0, 0), (0, rows - y.shape[1])),
      )
    if qwen:
      out[name] = y
    else:  # Llama: the names of LlamaForCausalLM.load_weights' mapping table
      if short == "model.embed_tokens":
        out["model.embed.embedding"] = y
      elif short == "lm_head":
        out["model.lm_head"] = y
      elif short.endswith("layernorm") or short == "model.norm":
        out[short + ".scale"] = y
      else:
        out[short + ".kernel"] = y
  return model, out


@pytest.mark.parametrize(
    "case",
    ["qwen3-untied-scan-tp1", "qwen3-ndh-scan-tp2", "llama3-untied-scan-tp4", "llama3-tied-tp1"],
)
def test_mapping_equals_the_checkpoint_loaders_transform(case):
  cfg, tp, q_layout = CASES[case]
  model, theirs = _loader_view(cfg, tp, q_layout)
  ours = tim.to_target_tree(
      nnx.state(model, nnx.Param), cfg, tim.Layout.expected(cfg, tp, q_layout)
  )
  assert set(ours) == set(theirs)
  for n in ours:
    np.testing.assert_array_equal(np.asarray(ours[n]), theirs[n], err_msg=n)


def test_padded_heads_compute_the_same_attention():
  """Zero-padded head_dim and KV heads repeated r times (head j <- j // r) leave grouped-query
  attention unchanged (q head i reads kv head i // (H / Hkv), tpu-inference's grouping and
  ours), with the scale of the original head_dim (as tpu-inference passes it)."""
  cfg = llama3()
  lay = tim.Layout.expected(cfg, 4)
  assert (lay.head_dim, lay.num_kv_heads) == (128, 4)
  state = native(cfg, seed=5)
  flat = flat_np(state)
  w = {n: flat[("layers", 0, "attn", n)] for n in "qkvo"}
  t = {
      n: np.asarray(tim.to_target(kind, w[n], cfg, lay))
      for n, kind in zip("qkvo", ("q", "kv", "kv", "o"))
  }
  x = np.random.default_rng(0).normal(size=(2, 5, cfg.hidden_size)).astype(np.float32)

  def attn(q_w, k_w, v_w, o_w):
    q, k, v = (np.einsum("btd,dnk->btnk", x, a) for a in (q_w, k_w, v_w))
    group = q.shape[2] // k.shape[2]
    kv = np.arange(q.shape[2]) // group
    s = np.einsum("bthk,bshk->bhts", q, k[:, :, kv]) / np.sqrt(cfg.head_dim)
    s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshk,hkd->btd", p, v[:, :, kv], o_w)

  np.testing.assert_allclose(
      attn(t["q"], t["k"], t["v"], t["o"]),
      attn(w["q"], w["k"], w["v"], w["o"]),
      rtol=1e-5,
      atol=1e-5,
  )


def test_problems_name_the_field():
  assert tim.problems(qwen3(), 2) == []
  assert tim.problems(llama3(), 4) == []
  checks = [
      (qwen3(head_dim=96), 1, "model.head_dim=96"),
      (qwen3(attention_bias=True), 1, "model.attention_bias"),
      (qwen3(qk_norm=False), 1, "model.qk_norm"),
      (qwen3(), 4, "model.num_kv_heads=2"),  # tpu-inference's Qwen3 cannot replicate KV heads
      (llama3(), 16, "model.num_heads=8"),
      (llama3(vocab_size=101), 2, "model.vocab_size=101"),
      (ModelConfig(arch="gpt", vocab_size=8), 1, "model.arch"),
  ]
  for cfg, tp, needle in checks:
    got = tim.problems(cfg, tp)
    assert any(needle in p for p in got), (needle, got)
  with pytest.raises(ValueError, match="model.head_dim=96"):
    tis.Syncer(qwen3(head_dim=96))


def test_split_off_local_devices():
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  kept, off = sharding.split_off_local(2)
  assert [d.id for d in off] == [6, 7] and [d.id for d in kept] == list(range(6))
  assert sharding.split_off_local(0) == (jax.devices(), [])
  assert tis.vllm_local_devices(2) == off and tis.vllm_local_devices(0) == jax.local_devices()
  with pytest.raises(ValueError, match="at least one"):
    sharding.split_off_local(8)
  assert not tim.available()  # CPU: the vllm engine stays vllm_engine.VLLMEngine


def test_trainer_mesh_leaves_vllm_its_chips():
  """rollout.vllm.num_devices=N: the trainer's mesh is built over all but each host's last N
  devices (the ones the TPU engine gives vLLM), and the mesh check counts only those."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  import importlib.util as iu
  import os
  from grpo_jax import configuration
  from grpo_jax.models import build

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  spec = iu.spec_from_file_location("cfg_tiny", os.path.join(root, "configs", "tiny.py"))
  module = iu.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  if "num_devices" not in config.rollout.vllm:
    pytest.skip("configs/common.py has no rollout.vllm.num_devices yet")
  config.rollout.engine = "vllm"
  config.rollout.vllm.num_devices = 4
  mesh = build.make_mesh(config)
  assert sorted(d.id for d in mesh.devices.flat) == list(range(4))
  assert not [e for e in configuration.validate(config) if "mesh" in e or "num_devices" in e]
  config.rollout.vllm.num_devices = 2  # 6 trainer devices: the batch of 32 does not divide
  assert any("data * fsdp = 6" in e for e in configuration.validate(config))
  config.rollout.vllm.num_devices = 8
  assert any("rollout.vllm.num_devices" in e for e in configuration.validate(config))


# ------------------------------------------------------------------------- the on-device push


def fake_target_state(cfg, tp, devices, dtype=jnp.bfloat16, q_layout="DNH"):
  """A concrete target state shaped and sharded as tpu-inference's (tensor parallelism over a
  "model" axis: heads, the MLP width and the vocabulary split), zeros, as an nnx.State whose
  dotted paths are the target names."""
  mesh = Mesh(np.asarray(devices), ("model",))
  lay = tim.Layout.expected(cfg, tp, q_layout)
  shapes = expected_shapes(cfg, tp, q_layout)
  specs = {
      "q_proj": (None, "model", None) if q_layout == "DNH" else ("model", None, None),
      "k_proj": (None, "model", None),
      "v_proj": (None, "model", None),
      "o_proj": ("model", None, None),
      "gate_proj": (None, "model"),
      "up_proj": (None, "model"),
      "down_proj": ("model", None),
      "embed": ("model", None),
      "lm_head": (None, "model"),
  }
  tree = {}
  for name, shape in shapes.items():
    spec = next((s for k, s in specs.items() if k in name), (None,) * len(shape))
    arr = jax.device_put(jnp.zeros(shape, dtype), NamedSharding(mesh, PartitionSpec(*spec)))
    node = tree
    *parents, leaf = name.split(".")
    for p in parents:
      node = node.setdefault(int(p) if p.isdigit() else p, {})
    node[leaf] = nnx.Param(arr)
  return nnx.State(tree), lay


PLACEMENTS = {  # trainer devices, vLLM devices (by index), tensor-parallel size
    "same_chips": (range(8), range(8), 8),  # the jitted mapper writes the target sharding
    "other_chips": (range(4), range(4, 8), 4),  # rollout.vllm.num_devices=4
    "local_subset": (range(8), range(4), 4),  # e.g. a host's chips of a multi-host mesh
}


@pytest.mark.parametrize(
    "where,scan", [("same_chips", True), ("other_chips", False), ("local_subset", True)]
)
def test_push_on_device_keeps_target_shardings(where, scan):
  """The trainer's sharded params (data x fsdp x tensor mesh) land in the target's own
  shardings, device to device: no host transfer happens (guards on), the old buffers are freed,
  and the values are the mapping's."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  cfg = llama3(tie_embeddings=False, scan_layers=scan, num_kv_heads=4)
  devs = jax.devices()
  train, vllm, tp = PLACEMENTS[where]
  mesh = sharding.make_mesh(-1, 2, 2, devices=[devs[i] for i in train])
  model = build_model(cfg, seed=7, mesh=mesh)
  params = nnx.state(model, nnx.Param)
  target, lay = fake_target_state(cfg, tp, [devs[i] for i in vllm])
  before = {
      n: (v.get_value(), v.get_value().sharding) for n, v in tim.target_params(target).items()
  }
  syncer = tis.Syncer(cfg)
  with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
    stats = syncer.push(params, target)
    stats2 = syncer.push(params, target)  # a second sync reuses the compiled mappers
  assert stats == stats2 and stats["tensors"] == len(before)
  assert stats["bytes"] == sum(a.size * 2 for a, _ in before.values())
  after = tim.target_params(target)
  for n, (old, sh) in before.items():
    new = after[n].get_value()
    assert new.sharding == sh and new.dtype == jnp.bfloat16, n
    assert old.is_deleted(), n
  got = tim.from_target_tree({n: v.get_value() for n, v in after.items()}, cfg, lay)
  for p, x in flat_np(params).items():
    np.testing.assert_array_equal(
        np.asarray(got[p]), np.asarray(jnp.asarray(x, jnp.bfloat16)), err_msg=str(p)
    )


def test_maxtext_policy_weights_push_into_the_tpu_inference_layout():
  """The seed's path (model.impl=maxtext, rollout.engine=vllm on a TPU): the MaxText policy's
  params, mapped to the native layout by its jitted rollout_params (what the vLLM engine syncs),
  pushed into a tpu-inference-shaped Qwen3 state on other chips, device to device. Each target
  tensor is checked against MaxText's own tensor (read by its MaxText path, not through the
  mapping modules) and the whole state against the checkpoint loaders' transform of the HF
  folder the engine boots vLLM from."""
  from tests.conftest import maxtext_unusable

  if maxtext_unusable():
    pytest.skip(maxtext_unusable())
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  from configs import tiny
  from grpo_jax.models import build

  config = tiny.get_config()
  config.model.impl = "maxtext"
  # A vocabulary that MaxText's tensor axis divides; Qwen3's head_dim 64 (tpu-inference keeps it).
  config.model.update(
      dict(
          vocab_size=98,
          hidden_size=64,
          intermediate_size=96,
          num_heads=4,
          num_kv_heads=2,
          head_dim=64,
          tie_embeddings=False,
          scan_layers=True,
      )
  )
  config.model.maxtext.attention = "dot_product"
  config.mesh.update(dict(data=1, fsdp=2, tensor=2))
  devs = jax.devices()
  policy = build.make_policy(config, build.make_mesh(config, devs[:4]))  # MaxText's mesh
  cfg, tp = policy.model_config, 2
  rollout = jax.jit(policy.rollout_params)(policy.params)
  target, lay = fake_target_state(cfg, tp, devs[6:8])
  with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
    tis.Syncer(cfg).push(rollout, target)
  got = {n: np.asarray(v.get_value(), np.float32) for n, v in tim.target_params(target).items()}

  mt = jax.tree.map(lambda x: np.asarray(x, np.float32), nnx.to_pure_dict(policy.params))
  dec, k = mt["decoder"]["layers"], cfg.head_dim  # scanned: the layer axis is 1
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)  # noqa: E731
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    np.testing.assert_array_equal(
        got[pre + "self_attn.q_proj.weight"][..., :k],
        bf16(dec["self_attention"]["query"]["kernel"][:, i]),
    )
    np.testing.assert_array_equal(
        got[pre + "self_attn.k_norm.weight"][:k],
        bf16(dec["self_attention"]["key_norm"]["scale"][:, i]),
    )
    np.testing.assert_array_equal(
        got[pre + "mlp.gate_proj.weight"], bf16(dec["mlp"]["wi_0"]["kernel"][:, i])
    )
    np.testing.assert_array_equal(
        got[pre + "mlp.down_proj.weight"], bf16(dec["mlp"]["wo"]["kernel"][:, i])
    )
  np.testing.assert_array_equal(
      got["model.embed_tokens.weight"][: cfg.vocab_size], bf16(mt["token_embedder"]["embedding"])
  )
  np.testing.assert_array_equal(
      got["lm_head.weight"][:, : cfg.vocab_size], bf16(mt["decoder"]["logits_dense"]["kernel"])
  )

  boot = nnx.merge(policy.sampler_graphdef, rollout)  # the HF folder vLLM boots from
  _, theirs = _loader_view(cfg, tp, "DNH", model=boot)
  assert set(theirs) == set(got)
  for n, a in theirs.items():
    np.testing.assert_array_equal(got[n], bf16(a), err_msg=n)


def test_push_refuses_a_foreign_state():
  if jax.device_count() < 4:
    pytest.skip("needs 4 (fake) devices")
  cfg = llama3()
  target, _ = fake_target_state(cfg, 1, jax.devices()[:1])
  del target["model"]["layers"][1]["mlp"]["up_proj"]
  with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.kernel'\]"):
    tis.Syncer(cfg).push(native(cfg), target)
  target, _ = fake_target_state(cfg, 1, jax.devices()[:1])
  with pytest.raises(ValueError, match="do not match the qwen3 mapping"):
    tis.Syncer(qwen3()).push(native(qwen3()), target)


# ------------------------------------------------- against tpu-inference's own definitions

HAVE_TPU_INFERENCE = importlib.util.find_spec("tpu_inference") is not None
needs_ti = pytest.mark.skipif(
    not HAVE_TPU_INFERENCE,
    reason="tpu-inference not installed " "(scripts/test_tpu_pins.sh --full installs vllm-tpu)",
)


@pytest.fixture(scope="module")
def ti():
  """tpu-inference's model classes, importable on CPU once its pipeline group is set (one
  stage: what its TPU worker sets up at start-up)."""
  pytest.importorskip("tpu_inference")
  from tpu_inference.distributed import jax_parallel_state
  from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES
  from tpu_inference.models.jax.llama3 import LlamaForCausalLM
  from tpu_inference.models.jax.qwen3 import Qwen3ForCausalLM

  if getattr(jax_parallel_state, "_PP", None) is None:
    jax_parallel_state._PP = jax_parallel_state.GroupCoordinator(0, 1)
  return types.SimpleNamespace(
      axes=MESH_AXIS_NAMES, classes={"qwen3": Qwen3ForCausalLM, "llama3": LlamaForCausalLM}
  )


def ti_mesh(ti, tp):
  shape = tuple(tp if a == "model" else 1 for a in ti.axes)
  return Mesh(np.asarray(jax.devices()[:tp]).reshape(shape), ti.axes)


def ti_config(cfg, tp, weights=None):
  """The slice of vllm.config.VllmConfig these model classes and loaders read."""
  from transformers import LlamaConfig
  from transformers import Qwen3Config

  fields = {k: v for k, v in cfg.to_hf_config().items() if k != "torch_dtype"}
  hfc = (Qwen3Config if cfg.arch == "qwen3" else LlamaConfig)(**fields)
  mc = types.SimpleNamespace(
      hf_config=hfc,
      dtype=jnp.float32,
      runner_type="generate",
      model="/nonexistent",
      get_vocab_size=lambda: hfc.vocab_size,
      get_head_size=lambda: hfc.head_dim,
      get_hidden_size=lambda: hfc.hidden_size,
      is_multimodal_model=False,
      get_total_num_kv_heads=lambda: hfc.num_key_value_heads,
  )
  if weights is not None:  # StandardWeightLoader's iterator hook (the RunAI streamer's)
    mc.runai_model_weights_iterator = weights
  return types.SimpleNamespace(
      model_config=mc,
      quant_config=None,
      speculative_config=None,
      additional_config={},
      parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
      cache_config=types.SimpleNamespace(cache_dtype="auto"),
      load_config=types.SimpleNamespace(download_dir=None, load_format="auto"),
  )


TI_CASES = [
    "qwen3-untied-scan-tp1",
    "qwen3-tied-tp2",
    "qwen3-hd128-tp1",
    "llama3-tied-tp1",
    "llama3-untied-scan-tp4",
]


@needs_ti
@pytest.mark.parametrize("case", TI_CASES)
def test_abstract_tpu_inference_model_has_the_mapped_names_and_shapes(ti, case):
  cfg, tp, _ = CASES[case]
  mesh = ti_mesh(ti, tp)
  with jax.set_mesh(mesh):
    m = nnx.eval_shape(lambda: ti.classes[cfg.arch](ti_config(cfg, tp), jax.random.key(0), mesh))
  shapes = tim.target_shapes(nnx.state(m))
  assert shapes == expected_shapes(cfg, tp, "DNH")
  lay = tis.Syncer(cfg).check(nnx.state(m))  # the engine's own start-up check
  assert lay == tim.Layout.expected(cfg, tp)


@needs_ti
@pytest.mark.parametrize(
    "case", ["qwen3-tied-tp2", "qwen3-untied-scan-tp1", "llama3-untied-scan-tp4", "llama3-tied-tp1"]
)
def test_tpu_inference_loader_equals_mapping_and_push_overwrites_it(ti, case):
  """tpu-inference's own checkpoint loader (Qwen3: JaxAutoWeightsLoader via load_weights;
  Llama: StandardWeightLoader) fed our HF export builds exactly our mapped arrays; then the
  push of other weights into that very model keeps its shardings and writes the mapping."""
  torch = pytest.importorskip("torch")
  cfg, tp, _ = CASES[case]
  mesh = ti_mesh(ti, tp)
  model = build_model(cfg, seed=1)

  def tensors():
    for name, produce in hf.hf_tensors(model):
      yield name, torch.from_numpy(np.array(produce(), copy=True))

  vc = ti_config(cfg, tp, weights=tensors())
  with jax.set_mesh(mesh):
    m = nnx.eval_shape(lambda: ti.classes[cfg.arch](vc, jax.random.key(0), mesh))
    if cfg.arch == "qwen3":
      m.load_weights(tensors())
    else:
      m.load_weights(jax.random.key(0))
  state = nnx.state(m)
  lay = tim.Layout.expected(cfg, tp)
  theirs = {n: v.get_value() for n, v in tim.target_params(state).items()}
  ours = tim.to_target_tree(nnx.state(model, nnx.Param), cfg, lay)
  assert set(theirs) == set(ours)
  for n, a in ours.items():
    np.testing.assert_array_equal(np.asarray(a), np.asarray(theirs[n]), err_msg=n)

  other = native(cfg, seed=2)
  shardings = {n: a.sharding for n, a in theirs.items()}
  with jax.transfer_guard_host_to_device("disallow"), jax.transfer_guard_device_to_host("disallow"):
    tis.Syncer(cfg).push(other, state)
  after = {n: v.get_value() for n, v in tim.target_params(state).items()}
  assert {n: a.sharding for n, a in after.items()} == shardings
  back = tim.from_target_tree(after, cfg, lay)
  for p, x in flat_np(other).items():
    np.testing.assert_array_equal(np.asarray(back[p]), x, err_msg=str(p))
