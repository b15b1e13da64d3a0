"""The native <-> MaxText weight mapping (models/maxtext/mapping.py), run without MaxText.

The expected MaxText paths, shapes and HF names below are written out from MaxText's qwen3
decoder block, not read from the module's tables, and values are matched through the HF name
of each tensor (hf.param_mapping, checked against transformers in test_hf_parity.py): a swapped
entry (q/k, gate/up, the two norms), a wrong scan axis or a dropped tensor fails here.
"""

import collections
import os
import subprocess
import sys

from flax import nnx
import jax
import numpy as np
import pytest

from grpo_jax.models.decoder import hf
from grpo_jax.models.maxtext import mapping as mm
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.transformer import build_model

D, F, V, L, H, G, K = 32, 64, 61, 3, 4, 2, 8

# MaxText per-layer path -> (HF name without "model.layers.{i}.", per-layer shape).
MT_LAYER = {
    "pre_self_attention_layer_norm/scale": ("input_layernorm.weight", (D,)),
    "post_self_attention_layer_norm/scale": ("post_attention_layernorm.weight", (D,)),
    "self_attention/query/kernel": ("self_attn.q_proj.weight", (D, H, K)),
    "self_attention/key/kernel": ("self_attn.k_proj.weight", (D, G, K)),
    "self_attention/value/kernel": ("self_attn.v_proj.weight", (D, G, K)),
    "self_attention/out/kernel": ("self_attn.o_proj.weight", (H, K, D)),
    "self_attention/query_norm/scale": ("self_attn.q_norm.weight", (K,)),
    "self_attention/key_norm/scale": ("self_attn.k_norm.weight", (K,)),
    "mlp/wi_0/kernel": ("mlp.gate_proj.weight", (D, F)),
    "mlp/wi_1/kernel": ("mlp.up_proj.weight", (D, F)),
    "mlp/wo/kernel": ("mlp.down_proj.weight", (F, D)),
}
MT_GLOBAL = {
    "token_embedder/embedding": ("model.embed_tokens.weight", (V, D)),
    "decoder/decoder_norm/scale": ("model.norm.weight", (D,)),
    "decoder/logits_dense/kernel": ("lm_head.weight", (D, V)),  # untied only
}


def model_cfg(*, tied=False, scan=False, qk_norm=True, arch="qwen3", **kw) -> ModelConfig:
  return ModelConfig(
      arch=arch,
      vocab_size=V,
      hidden_size=D,
      intermediate_size=F,
      num_layers=L,
      num_heads=H,
      num_kv_heads=G,
      head_dim=K,
      tie_embeddings=tied,
      scan_layers=scan,
      qk_norm=qk_norm,
      **kw,
  )


def native_params(cfg: ModelConfig) -> dict:
  """Unscanned native params with distinct values everywhere: build_model's norms are all
  ones, which would hide a swapped q_norm/k_norm or pre/post norm."""
  cfg = cfg.replace(scan_layers=False)
  pure = nnx.to_pure_dict(nnx.state(build_model(cfg, seed=0)))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda x: np.asarray(x) + rng.standard_normal(x.shape, np.float32), pure)


def stacked(native: dict) -> dict:
  """The scanned native layout of an unscanned tree: layers stacked on axis 0."""
  layers = [native["layers"][i] for i in range(L)]
  return {**native, "layers": jax.tree.map(lambda *xs: np.stack(xs), *layers)}


def flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(flat(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def expected_maxtext(cfg: ModelConfig, *, scan_layers: bool, scan_axis: int = 1) -> dict:
  """MaxText path -> (HF name, with "{i}" when stacked; shape)."""
  out = {p: v for p, v in MT_GLOBAL.items() if "logits_dense" not in p or not cfg.tie_embeddings}
  for p, (name, shape) in MT_LAYER.items():
    if p.startswith("self_attention/") and "_norm" in p and not cfg.qk_norm:
      continue
    name = "model.layers.{i}." + name
    if scan_layers:
      out[f"decoder/layers/{p}"] = (name, shape[:scan_axis] + (L,) + shape[scan_axis:])
    else:
      out.update({f"decoder/layers_{i}/{p}": (name.format(i=i), shape) for i in range(L)})
  return out


def native_by_hf_name(native: dict, cfg: ModelConfig) -> dict:
  """HF tensor name -> the unscanned native tensor hf.param_mapping pairs with it."""
  out = {}
  for e in hf.param_mapping(cfg):
    if e.per_layer:
      for i in range(L):
        out[e.hf_name.format(i=i)] = mm._get(native, ("layers", i, *e.path))
    else:
      out[e.hf_name] = mm._get(native, e.path)
  return out


def assert_trees_equal(got: dict, want: dict):
  got, want = flat(got), flat(want)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mt_scan", [False, True])
@pytest.mark.parametrize("native_scan", [False, True])
def test_round_trips_exactly_between_every_layout(native_scan, mt_scan, tied):
  cfg = model_cfg(tied=tied, scan=native_scan)
  unscanned = native_params(cfg)
  layouts = {False: unscanned, True: stacked(unscanned)}
  native = layouts[native_scan]
  mt = mm.native_to_maxtext(native, cfg, scan_layers=mt_scan)
  # The MaxText tree does not depend on the native layout it came from.
  assert_trees_equal(
      mt, mm.native_to_maxtext(unscanned, cfg.replace(scan_layers=False), scan_layers=mt_scan)
  )
  assert_trees_equal(mm.maxtext_to_native(mt, cfg, scan_layers=mt_scan), native)
  # Into the other native layout too (what a scanned <-> unscanned checkpoint load does).
  other = cfg.replace(scan_layers=not native_scan)
  assert_trees_equal(mm.maxtext_to_native(mt, other, scan_layers=mt_scan), layouts[not native_scan])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mt_scan,scan_axis", [(False, 1), (True, 1), (True, 0)])
def test_maxtext_tensors_have_maxtext_paths_shapes_and_the_right_values(mt_scan, scan_axis, tied):
  cfg = model_cfg(tied=tied)
  native = native_params(cfg)
  by_hf = native_by_hf_name(native, cfg)
  mt_tree = mm.native_to_maxtext(native, cfg, scan_layers=mt_scan, scan_axis=scan_axis)
  assert_trees_equal(
      mm.maxtext_to_native(mt_tree, cfg, scan_layers=mt_scan, scan_axis=scan_axis), native
  )
  mt = flat(mt_tree)
  want = expected_maxtext(cfg, scan_layers=mt_scan, scan_axis=scan_axis)
  assert sorted(mt) == sorted(want)
  for path, (name, shape) in want.items():
    x = np.asarray(mt[path])
    assert x.shape == shape, path
    if "{i}" in name:  # each layer's slice on the scan axis is that layer's tensor
      for i in range(L):
        np.testing.assert_array_equal(
            np.take(x, i, axis=scan_axis), by_hf[name.format(i=i)], err_msg=f"{path} layer {i}"
        )
    else:
      np.testing.assert_array_equal(x, by_hf[name], err_msg=path)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mt_scan", [False, True])
def test_hf_names_cover_every_hf_tensor_once(mt_scan, tied, qk_norm):
  cfg = model_cfg(tied=tied, qk_norm=qk_norm)
  names = mm.maxtext_hf_names(cfg, scan_layers=mt_scan)
  want = expected_maxtext(cfg, scan_layers=mt_scan)
  stacked_names = lambda n: tuple(n.format(i=i) for i in range(L)) if "{i}" in n else n  # noqa
  assert names == {p: stacked_names(name) for p, (name, _) in want.items()}
  # Keys are the real MaxText tensors of the mapped tree.
  assert sorted(names) == sorted(
      flat(mm.native_to_maxtext(native_params(cfg), cfg, scan_layers=mt_scan))
  )
  assert_each_hf_tensor_once(names, cfg)


def assert_each_hf_tensor_once(names: dict, cfg: ModelConfig):
  expand = lambda n: [n.format(i=i) for i in range(cfg.num_layers)] if "{i}" in n else [n]  # noqa
  got = collections.Counter(
      x for n in names.values() for x in (n if isinstance(n, tuple) else (n,))
  )
  hf_names = [x for e in hf.param_mapping(cfg) for x in expand(e.hf_name)]
  assert max(got.values()) == 1
  assert sorted(got) == sorted(hf_names)


# ------------------------------------------------------- Llama 3 / 3.1, Gemma 2, Gemma 3


def family_cfg(arch: str, num_layers: int, **kw) -> ModelConfig:
  """Tiny shapes MaxText's block for `arch` holds (check_supported passes)."""
  base = dict(
      arch=arch,
      vocab_size=V,
      hidden_size=D,
      intermediate_size=F,
      num_layers=num_layers,
      num_heads=H,
      num_kv_heads=G,
      head_dim=K,
      tie_embeddings=False,
      qk_norm=False,
  )
  if arch == "llama3":
    base.update(rope_scaling_factor=8.0, rope_theta=5e5)
  if arch == "gemma2":
    base.update(
        sliding_window=3,
        sliding_window_pattern=2,
        query_pre_attn_scalar=12.0,
        attn_logit_softcap=5.0,
    )
  if arch == "gemma3":
    base.update(
        sliding_window=3,
        sliding_window_pattern=6,
        qk_norm=True,
        rope_local_theta=1e4,
        rope_linear_factor=2.0,
    )
  return ModelConfig(**{**base, **kw})


def unscanned_native(cfg: ModelConfig) -> dict:
  pure = nnx.to_pure_dict(nnx.state(build_model(cfg.replace(scan_layers=False), seed=0)))
  rng = np.random.default_rng(1)
  return jax.tree.map(lambda x: np.asarray(x) + rng.standard_normal(x.shape, np.float32), pure)


FAMILIES = [("llama3", 3), ("gemma2", 4), ("gemma3", 8), ("gemma3", 4)]


@pytest.mark.parametrize("arch,num_layers", FAMILIES)
@pytest.mark.parametrize("mt_scan", [False, True])
@pytest.mark.parametrize("native_scan", [False, True])
def test_families_round_trip_and_name_every_hf_tensor_once(arch, num_layers, mt_scan, native_scan):
  cfg = family_cfg(arch, num_layers, scan_layers=native_scan)
  unscanned = unscanned_native(cfg)
  native = (
      unscanned
      if not native_scan
      else {
          **unscanned,
          "layers": jax.tree.map(
              lambda *xs: np.stack(xs), *[unscanned["layers"][i] for i in range(num_layers)]
          ),
      }
  )
  mt = mm.native_to_maxtext(native, cfg, scan_layers=mt_scan)
  back = mm.maxtext_to_native(mt, cfg, scan_layers=mt_scan)
  # Exact but for f32 rounding of Gemma's 1 + w, its sqrt(D) table and the query scale.
  got, want = flat(back), flat(native)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-6, atol=2e-7, err_msg=k)
  names = mm.maxtext_hf_names(cfg, scan_layers=mt_scan)
  assert sorted(names) == sorted(flat(mt))
  assert_each_hf_tensor_once(names, cfg)
  for path, n in names.items():  # a stacked tensor has one slice per name, on the scan axis
    if isinstance(n, tuple):
      assert flat(mt)[path].shape[1] == len(n), path


def test_gemma_layouts_put_each_layer_where_maxtext_holds_it():
  """Gemma 2: MaxText layer p holds our layers 2p (local) and 2p+1 (global); Gemma 3 scanned:
  blocks of 6 (decoder/layers/layers_j stacks layer 6b+j), the rest in layers_remainder."""
  cfg2 = family_cfg("gemma2", 4)
  names = mm.maxtext_hf_names(cfg2, scan_layers=False)
  assert names["decoder/layers_1/self_attention_local/key/kernel"] == (
      "model.layers.2.self_attn.k_proj.weight"
  )
  assert names["decoder/layers_1/post_ffw_norm_global/scale"] == (
      "model.layers.3.post_feedforward_layernorm.weight"
  )
  assert mm.maxtext_hf_names(cfg2, scan_layers=True)["decoder/layers/mlp_global/wo/kernel"] == (
      "model.layers.1.mlp.down_proj.weight",
      "model.layers.3.mlp.down_proj.weight",
  )
  cfg3 = family_cfg("gemma3", 14)
  names = mm.maxtext_hf_names(cfg3, scan_layers=True)
  assert names["decoder/layers/layers_5/self_attention/query_norm/scale"] == (
      "model.layers.5.self_attn.q_norm.weight",
      "model.layers.11.self_attn.q_norm.weight",
  )
  assert names["decoder/layers_remainder/layers_1/pre_ffw_norm/scale"] == (
      "model.layers.13.pre_feedforward_layernorm.weight"
  )
  assert not any(p.startswith("decoder/layers_remainder/layers_2") for p in names)
  mt = mm.native_to_maxtext(unscanned_native(cfg3), cfg3, scan_layers=True)
  assert mt["decoder"]["layers"]["layers_0"]["mlp"]["wi_0"]["kernel"].shape == (D, 2, F)


def test_family_values_hold_what_maxtext_blocks_compute_with():
  """Llama: q/k last axis interleaved (MaxText's dim 2j = ours j, 2j+1 = ours j + K/2) and q
  times K ** -0.5; Gemma: norms hold 1 + w, the table sqrt(D) * embeddings, gemma2's q
  query_pre_attn_scalar ** -0.5; values, k and the rest unchanged."""
  perm = [0, K // 2, 1, K // 2 + 1, 2, K // 2 + 2, 3, K // 2 + 3]
  cfg = family_cfg("llama3", 3)
  native = unscanned_native(cfg)
  mt = mm.native_to_maxtext(native, cfg, scan_layers=False)["decoder"]["layers_2"]
  q, k, v = (native["layers"][2]["attn"][n] for n in "qkv")
  np.testing.assert_allclose(
      mt["self_attention"]["query"]["kernel"], q[..., perm] * K**-0.5, rtol=1e-7
  )
  np.testing.assert_array_equal(mt["self_attention"]["key"]["kernel"], k[..., perm])
  np.testing.assert_array_equal(mt["self_attention"]["value"]["kernel"], v)
  for arch, layers in (("gemma2", 2), ("gemma3", 1)):
    cfg = family_cfg(arch, layers)
    native = unscanned_native(cfg)
    mt = mm.native_to_maxtext(native, cfg, scan_layers=False)
    layer = mt["decoder"]["layers_0"]
    suffix = "_local" if arch == "gemma2" else ""
    np.testing.assert_allclose(
        layer[f"pre_ffw_norm{suffix}"]["scale"],
        native["layers"][0]["mlp_norm"]["scale"] + 1,
        rtol=1e-7,
    )
    np.testing.assert_allclose(
        mt["decoder"]["decoder_norm"]["scale"], native["final_norm"]["scale"] + 1, rtol=1e-7
    )
    np.testing.assert_allclose(
        mt["token_embedder"]["embedding"], native["embed"] * np.sqrt(D), rtol=1e-6
    )
    scale = 12.0**-0.5 if arch == "gemma2" else 1.0  # gemma3 scales in the forward
    np.testing.assert_allclose(
        layer[f"self_attention{suffix}"]["query"]["kernel"],
        native["layers"][0]["attn"]["q"] * scale,
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        layer[f"mlp{suffix}"]["wo"]["kernel"], native["layers"][0]["mlp"]["down"]
    )


@pytest.mark.parametrize(
    "arch,fields,match",
    [
        ("qwen3", dict(attention_bias=True), "attention_bias"),
        ("qwen3", dict(rope_scaling_factor=8.0), "Llama 3 RoPE scaling on arch qwen3"),
        (
            "llama3",
            dict(rope_scaling_factor=8.0, rope_original_max_position=4096),
            "Llama RoPE scaling is Llama 3.1's",
        ),
        ("llama3", dict(qk_norm=True), "no q/k norms"),
        ("gemma2", dict(num_layers=3), "even num_layers"),
        ("gemma2", dict(sliding_window_pattern=3), "sliding_window_pattern=2"),
        ("gemma3", dict(sliding_window_pattern=3), "sliding_window_pattern=6"),
        ("gemma3", dict(query_pre_attn_scalar=12.0), "query_pre_attn_scalar in"),
        ("gemma3", dict(final_logit_softcap=30.0), "tie_embeddings=True with final_logit_softcap"),
        ("gemma3", dict(rms_norm_eps=1e-5), "rms_norm_eps=1e-6"),
        ("gemma3", dict(qk_norm=False), "qk_norm=True"),
        ("gemma2", dict(qk_norm=True), "qk_norm=False"),
    ],
)
def test_unsupported_models_are_refused_with_the_fix(arch, fields, match):
  layers = {"llama3": 3, "gemma2": 4, "gemma3": 6, "qwen3": L}[arch]
  cfg = family_cfg(arch, layers) if arch != "qwen3" else model_cfg()
  mm.check_supported(cfg)  # the family's own shape passes
  bad = cfg.replace(**fields)
  with pytest.raises(ValueError, match=r"--config\.model\.impl=native"):
    mm.check_supported(bad)
  with pytest.raises(ValueError, match=match):
    mm.native_to_maxtext(native_params(model_cfg()), bad, scan_layers=False)


def test_modules_import_without_maxtext():
  """The mapping, and the adapter's module level (ATTENTION_KERNELS for the config validator),
  must import on an install without the optional maxtext package."""
  code = (
      "import sys; sys.modules['maxtext'] = None; "
      "import grpo_jax.models.maxtext.mapping; "
      "from grpo_jax.models.maxtext import adapter as m; print(m.ATTENTION_KERNELS)"
  )
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run(
      [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "dot_product" in out.stdout
