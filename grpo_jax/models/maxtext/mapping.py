"""Native decoder <-> MaxText parameter mapping: pure dicts, exact both ways, no MaxText import.

Kept apart from models/maxtext/adapter.py so the mapping (the part that silently corrupts a
model when wrong) is unit-tested without MaxText installed (tests/test_maxtext_mapping.py).

  native (models/decoder/transformer.py)      MaxText (decoder_block qwen3)            HF
  embed [V, D]                        token_embedder.embedding [V, D]          model.embed_tokens
  final_norm.scale                    decoder.decoder_norm.scale               model.norm
  lm_head [D, V] (untied only)        decoder.logits_dense.kernel [D, V]       lm_head (transposed)
  layers[i].attn_norm.scale           decoder.layers_i.pre_self_attention_layer_norm.scale
  layers[i].mlp_norm.scale            decoder.layers_i.post_self_attention_layer_norm.scale
  layers[i].attn.{q,k,v} [D, n, K]    decoder.layers_i.self_attention.{query,key,value}.kernel
  layers[i].attn.o [H, K, D]          decoder.layers_i.self_attention.out.kernel
  layers[i].attn.{q,k}_norm.scale     decoder.layers_i.self_attention.{query,key}_norm.scale
  layers[i].mlp.{gate,up,down}        decoder.layers_i.mlp.{wi_0,wi_1,wo}.kernel

Per-layer tensors have the same shapes on both sides (no transposes). Scanned layers stack
them: native on axis 0 (`layers.attn.q` [L, D, H, K]), MaxText on `param_scan_axis` (1 by
default in MaxText's base.yml: `decoder.layers.self_attention.query.kernel` [D, L, H, K]); the
callers pass the pyconfig's `param_scan_axis`.

Supported: Qwen3 dense (decoder_block qwen3). Llama 3 is refused with a clear error (its
MaxText RoPE layout is not yet parity-tested here), as are attention biases (the qwen3 block
has none).
"""
import jax.numpy as jnp

from grpo_jax.models.decoder import hf
from grpo_jax.models.decoder.config import ModelConfig

# (native per-layer path, MaxText per-layer path); qk-norm entries only when cfg.qk_norm.
LAYER_MAP = (
    (("attn_norm", "scale"), ("pre_self_attention_layer_norm", "scale")),
    (("mlp_norm", "scale"), ("post_self_attention_layer_norm", "scale")),
    (("attn", "q"), ("self_attention", "query", "kernel")),
    (("attn", "k"), ("self_attention", "key", "kernel")),
    (("attn", "v"), ("self_attention", "value", "kernel")),
    (("attn", "o"), ("self_attention", "out", "kernel")),
    (("attn", "q_norm", "scale"), ("self_attention", "query_norm", "scale")),
    (("attn", "k_norm", "scale"), ("self_attention", "key_norm", "scale")),
    (("mlp", "gate"), ("mlp", "wi_0", "kernel")),
    (("mlp", "up"), ("mlp", "wi_1", "kernel")),
    (("mlp", "down"), ("mlp", "wo", "kernel")),
)
# (native path, MaxText path) outside the layers; lm_head only for untied embeddings.
GLOBAL_MAP = (
    (("embed",), ("token_embedder", "embedding")),
    (("final_norm", "scale"), ("decoder", "decoder_norm", "scale")),
    (("lm_head",), ("decoder", "logits_dense", "kernel")),
)


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _layer_entries(cfg: ModelConfig):
  return [(n, m) for n, m in LAYER_MAP if cfg.qk_norm or "norm" not in n[1]]


def _global_entries(cfg: ModelConfig):
  return [(n, m) for n, m in GLOBAL_MAP if n != ("lm_head",) or not cfg.tie_embeddings]


def check_supported(cfg: ModelConfig):
  """Raises ValueError, naming the fix, for a model the qwen3 MaxText block cannot hold."""
  if cfg.arch != "qwen3":
    raise ValueError(
        f"model.impl=maxtext supports arch qwen3 only (got {cfg.arch!r}): use "
        "--config.model.impl=native for Llama 3")
  if cfg.attention_bias:
    raise ValueError("model.impl=maxtext: attention_bias=True has no MaxText qwen3 "
                     "counterpart; use --config.model.impl=native")


def native_to_maxtext(native: dict, cfg: ModelConfig, *, scan_layers: bool,
                      scan_axis: int = 1) -> dict:
  """Native decoder params (pure dict, scanned or not per cfg.scan_layers) -> MaxText params
  (scanned on `scan_axis` when `scan_layers`, else one `layers_i` subtree per layer)."""
  check_supported(cfg)
  out: dict = {}
  for n, m in _global_entries(cfg):
    _set(out, m, _get(native, n))
  for n, m in _layer_entries(cfg):
    if cfg.scan_layers:
      stacked = _get(native, ("layers", *n))  # [L, ...]
      per_layer = [stacked[i] for i in range(cfg.num_layers)]
    else:
      per_layer = [_get(native, ("layers", i, *n)) for i in range(cfg.num_layers)]
    if scan_layers:
      _set(out, ("decoder", "layers", *m), jnp.stack(per_layer, axis=scan_axis))
    else:
      for i, x in enumerate(per_layer):
        _set(out, ("decoder", f"layers_{i}", *m), x)
  return out


def maxtext_to_native(mt: dict, cfg: ModelConfig, *, scan_layers: bool,
                      scan_axis: int = 1) -> dict:
  """MaxText params (pure dict; `scan_layers` says how they are stored) -> native decoder
  params (scanned or not per cfg.scan_layers)."""
  check_supported(cfg)
  out: dict = {}
  for n, m in _global_entries(cfg):
    _set(out, n, _get(mt, m))
  for n, m in _layer_entries(cfg):
    if scan_layers:
      stacked = _get(mt, ("decoder", "layers", *m))
      per_layer = [jnp.take(stacked, i, axis=scan_axis) for i in range(cfg.num_layers)]
    else:
      per_layer = [_get(mt, ("decoder", f"layers_{i}", *m)) for i in range(cfg.num_layers)]
    if cfg.scan_layers:
      _set(out, ("layers", *n), jnp.stack(per_layer, axis=0))
    else:
      for i, x in enumerate(per_layer):
        _set(out, ("layers", i, *n), x)
  return out


def maxtext_hf_names(cfg: ModelConfig, *, scan_layers: bool) -> dict[str, str]:
  """MaxText parameter path ("decoder/layers_3/mlp/wo/kernel") -> HF tensor name (per layer;
  with scan_layers the stacked path maps to the name with "{i}"). Shapes: see hf.param_mapping
  (native <-> HF); MaxText <-> native needs no reshapes."""
  by_native = {e.path: e.hf_name for e in hf.param_mapping(cfg)}
  out = {}
  for n, m in _global_entries(cfg):
    out["/".join(m)] = by_native[n]
  for n, m in _layer_entries(cfg):
    if scan_layers:
      out["/".join(("decoder", "layers", *m))] = by_native[n]
    else:
      for i in range(cfg.num_layers):
        out["/".join(("decoder", f"layers_{i}", *m))] = by_native[n].format(i=i)
  return out
