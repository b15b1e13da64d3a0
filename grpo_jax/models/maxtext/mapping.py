"""Native decoder <-> MaxText parameter mapping: pure dicts, exact both ways, no MaxText import.

Kept apart from models/maxtext/adapter.py so the mapping (the part that silently corrupts a
model when wrong) is unit-tested without MaxText installed (tests/models/test_maxtext_mapping.py).

  native (models/decoder/transformer.py)  MaxText (decoder_block qwen3 / llama2)     HF
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

Per family (check_supported says what each needs, and refuses the rest in one line):
  qwen3   decoder_block qwen3, as above.
  llama3  decoder_block llama2 with MaxText's Llama 3.1 RoPE (`rope_type: llama3.1`), which
          rotates interleaved pairs (2j, 2j+1) where HF and the native decoder rotate halves
          (j, j + K/2): q and k kernels are permuted on their last axis (exact; the scores,
          hence the model, are unchanged). The block applies no 1/sqrt(K) to the scores: the
          query kernel holds it (so does gemma2's, with query_pre_attn_scalar ** -0.5); a round
          trip is exact where that scale is a power of 2 (K = 16, 64, 256), else to f32
          rounding. This is the layout of MaxText's Llama and Gemma 2 checkpoints.
  gemma2  decoder_block gemma2: one MaxText layer holds a (local, global) pair of ours, its
          modules suffixed `_local` / `_global` (pre_self_attention_norm, self_attention,
          post_self_attention_norm, pre_ffw_norm, mlp, post_ffw_norm); L/2 MaxText layers.
  gemma3  decoder_block gemma3, the same module names unsuffixed, one per layer; scanned, the
          layers go in blocks of 6 (5 local, 1 global): `decoder.layers.layers_j` stacks layer
          6b + j over the blocks b, `decoder.layers_remainder.layers_j` holds the L mod 6 last.
  Gemma's RMSNorms compute x * (1 + w) with HF's w; MaxText's hold the scale 1 + w, and its
  token table holds the embeddings times sqrt(D) (embed_scale), as its checkpoints do: a
  round trip is exact up to f32 rounding of 1 + w (<= 6e-8 absolute) and of the scaling.
"""

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from grpo_jax.models.decoder import hf
from grpo_jax.models.decoder.config import ModelConfig

ARCHS = ("qwen3", "llama3", "gemma2", "gemma3")
GEMMA3_BLOCK = 6  # MaxText's GEMMA3_ATTENTION_PATTERN: 5 local layers, then a global one
# MaxText's Llama 3.1 RoPE scaling (layers/embeddings.py LLaMARotaryEmbedding, hard-coded):
# (rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position).
LLAMA31_SCALING = (8.0, 1.0, 4.0, 8192)

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
# Gemma's four norms (gemma2 and gemma3 blocks; gemma2 suffixes the module names).
GEMMA_NORMS = (
    (("attn_norm", "scale"), ("pre_self_attention_norm", "scale")),
    (("post_attn_norm", "scale"), ("post_self_attention_norm", "scale")),
    (("mlp_norm", "scale"), ("pre_ffw_norm", "scale")),
    (("post_mlp_norm", "scale"), ("post_ffw_norm", "scale")),
)
# (native path, MaxText path) outside the layers; lm_head only for untied embeddings.
GLOBAL_MAP = (
    (("embed",), ("token_embedder", "embedding")),
    (("final_norm", "scale"), ("decoder", "decoder_norm", "scale")),
    (("lm_head",), ("decoder", "logits_dense", "kernel")),
)


@dataclasses.dataclass(frozen=True)
class Entry:
  native: tuple
  maxtext: tuple
  to_maxtext: Callable = lambda x: x
  to_native: Callable = lambda x: x


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _is_norm(native_path) -> bool:
  return native_path[-1] == "scale"


def _entries(cfg: ModelConfig, table) -> list[Entry]:
  out = []
  perm = _rope_permutation(cfg)
  inv = None if perm is None else np.argsort(perm)
  scale = _query_scale(cfg)
  for n, m in table:
    if "q_norm" in n or "k_norm" in n:
      if not cfg.qk_norm:
        continue
    if n == ("lm_head",) and cfg.tie_embeddings:
      continue
    if cfg.gemma and _is_norm(n):  # MaxText holds 1 + w
      out.append(Entry(n, m, lambda x: x + 1, lambda x: x - 1))
    elif cfg.gemma and n == ("embed",):  # MaxText holds the table times Gemma's sqrt(D)
      c = embed_scale(cfg)
      out.append(Entry(n, m, lambda x: x * c, lambda x: x / c))
    elif n == ("attn", "q") and (perm is not None or scale != 1.0):
      p, q = (slice(None), slice(None)) if perm is None else (perm, inv)
      out.append(Entry(n, m, lambda x: x[..., p] * scale, lambda x: x[..., q] / scale))
    elif n == ("attn", "k") and perm is not None:
      out.append(Entry(n, m, lambda x: x[..., perm], lambda x: x[..., inv]))
    else:
      out.append(Entry(n, m))
  return out


def embed_scale(cfg: ModelConfig) -> float:
  """Gemma's embedding multiplier, sqrt(D) rounded to the compute dtype (the native decoder's
  and Hugging Face's); MaxText's Gemma blocks apply none and hold the scaled table, dividing
  tied logits by sqrt(D) instead (normalize_embedding_logits)."""
  return float(np.asarray(cfg.hidden_size**0.5, jnp.dtype(cfg.dtype)).astype(np.float32))


def _query_scale(cfg: ModelConfig) -> float:
  """MaxText's llama2 and gemma2 blocks apply no attention scale: the query kernel holds it
  (as MaxText's checkpoints of those families do); qwen3 and gemma3 scale in the forward."""
  if cfg.arch in ("llama3", "gemma2"):
    return float(np.float32((cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5))
  return 1.0


def _layer_entries(cfg: ModelConfig) -> list[Entry]:
  if cfg.gemma:
    attn_mlp = tuple(e for e in LAYER_MAP if e[0][0] in ("attn", "mlp"))
    return _entries(cfg, GEMMA_NORMS + attn_mlp)
  return _entries(cfg, LAYER_MAP)


def _global_entries(cfg: ModelConfig) -> list[Entry]:
  return _entries(cfg, GLOBAL_MAP)


def _rope_permutation(cfg: ModelConfig):
  """Llama: MaxText's RoPE rotates pairs (2j, 2j+1), ours (j, j + K/2): MaxText's dim 2j is
  our j, 2j+1 our j + K/2. None for the families whose RoPE layouts agree."""
  if cfg.arch != "llama3":
    return None
  half = cfg.head_dim // 2
  return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def _where(cfg: ModelConfig, i: int, scan_layers: bool):
  """Native layer i in MaxText: (module path prefix, index on the scan axis or None, suffix of
  the first module name)."""
  if cfg.arch == "gemma2":
    pair, suffix = i // 2, ("_local", "_global")[i % 2]
    if scan_layers:
      return ("decoder", "layers"), pair, suffix
    return ("decoder", f"layers_{pair}"), None, suffix
  if cfg.arch == "gemma3" and scan_layers:
    full = cfg.num_layers // GEMMA3_BLOCK * GEMMA3_BLOCK
    if i < full:
      return ("decoder", "layers", f"layers_{i % GEMMA3_BLOCK}"), i // GEMMA3_BLOCK, ""
    return ("decoder", "layers_remainder", f"layers_{i - full}"), None, ""
  if scan_layers:
    return ("decoder", "layers"), i, ""
  return ("decoder", f"layers_{i}"), None, ""


def _mt_path(prefix, m, suffix):
  return (*prefix, m[0] + suffix, *m[1:])


def check_supported(cfg: ModelConfig):
  """Raises ValueError, naming the fix, for a model no MaxText decoder block holds as is."""
  native = "; use --config.model.impl=native"
  if cfg.arch not in ARCHS:
    raise ValueError(
        f"model.impl=maxtext supports arch {', '.join(ARCHS)} (got " f"{cfg.arch!r}){native}"
    )
  if cfg.attention_bias:
    raise ValueError(
        f"model.impl=maxtext: attention_bias=True has no counterpart in MaxText's "
        f"{cfg.arch} block{native}"
    )
  if cfg.arch == "llama3":
    scaling = (
        cfg.rope_scaling_factor,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_max_position,
    )
    if cfg.rope_scaling_factor and scaling != LLAMA31_SCALING:
      raise ValueError(
          f"model.impl=maxtext: MaxText's Llama RoPE scaling is Llama 3.1's "
          f"(factor, low, high, original) = {LLAMA31_SCALING}, got {scaling}"
          f"{native}"
      )
    if cfg.qk_norm:
      raise ValueError(f"model.impl=maxtext: MaxText's llama2 block has no q/k norms{native}")
  elif cfg.rope_scaling_factor:
    raise ValueError(f"model.impl=maxtext: Llama 3 RoPE scaling on arch {cfg.arch}{native}")
  if cfg.rope_linear_factor != 1.0 and cfg.arch != "gemma3":
    raise ValueError(
        f"model.impl=maxtext: rope_linear_factor on arch {cfg.arch} (Gemma 3 " f"only){native}"
    )
  if cfg.gemma:
    pattern = {"gemma2": 2, "gemma3": GEMMA3_BLOCK}[cfg.arch]
    scalars = {
        "gemma2": (cfg.query_pre_attn_scalar or cfg.head_dim,),  # any: in the kernel
        "gemma3": (cfg.head_dim, cfg.hidden_size // cfg.num_heads),
    }[cfg.arch]
    problems = []
    if not cfg.sliding_window or cfg.sliding_window_pattern != pattern:
      problems.append(
          f"sliding_window > 0 with sliding_window_pattern={pattern} (got "
          f"{cfg.sliding_window}, {cfg.sliding_window_pattern})"
      )
    if (cfg.query_pre_attn_scalar or cfg.head_dim) not in scalars:
      problems.append(f"query_pre_attn_scalar in {scalars} (got {cfg.query_pre_attn_scalar})")
    if cfg.rms_norm_eps != 1e-6:
      problems.append(f"rms_norm_eps=1e-6 (got {cfg.rms_norm_eps})")
    if cfg.qk_norm != (cfg.arch == "gemma3"):
      problems.append(f"qk_norm={cfg.arch == 'gemma3'} (got {cfg.qk_norm})")
    if cfg.final_logit_softcap and not cfg.tie_embeddings:
      problems.append(
          "tie_embeddings=True with final_logit_softcap (MaxText caps the tied "
          "head's logits only)"
      )
    if cfg.arch == "gemma2" and cfg.num_layers % 2:
      problems.append(f"an even num_layers (got {cfg.num_layers})")
    if cfg.arch == "gemma2" and cfg.rope_local_theta not in (0.0, cfg.rope_theta):
      problems.append("one RoPE base (rope_local_theta=0)")
    if problems:
      raise ValueError(
          f"model.impl=maxtext: MaxText's {cfg.arch} block needs " f"{'; '.join(problems)}{native}"
      )


def native_to_maxtext(
    native: dict, cfg: ModelConfig, *, scan_layers: bool, scan_axis: int = 1
) -> dict:
  """Native decoder params (pure dict, scanned or not per cfg.scan_layers) -> MaxText params
  (scanned on `scan_axis` when `scan_layers`, else one module per MaxText layer)."""
  check_supported(cfg)
  out: dict = {}
  for e in _global_entries(cfg):
    _set(out, e.maxtext, e.to_maxtext(_get(native, e.native)))
  for e in _layer_entries(cfg):
    if cfg.scan_layers:
      stacked = _get(native, ("layers", *e.native))  # [L, ...]
      per_layer = [stacked[i] for i in range(cfg.num_layers)]
    else:
      per_layer = [_get(native, ("layers", i, *e.native)) for i in range(cfg.num_layers)]
    stacks: dict = {}
    for i, x in enumerate(per_layer):
      prefix, index, suffix = _where(cfg, i, scan_layers)
      path = _mt_path(prefix, e.maxtext, suffix)
      if index is None:
        _set(out, path, e.to_maxtext(x))
      else:
        stacks.setdefault(path, []).append(e.to_maxtext(x))  # in index order
    for path, xs in stacks.items():
      _set(out, path, jnp.stack(xs, axis=scan_axis))
  return out


def maxtext_to_native(mt: dict, cfg: ModelConfig, *, scan_layers: bool, scan_axis: int = 1) -> dict:
  """MaxText params (pure dict; `scan_layers` says how they are stored) -> native decoder
  params (scanned or not per cfg.scan_layers)."""
  check_supported(cfg)
  out: dict = {}
  for e in _global_entries(cfg):
    _set(out, e.native, e.to_native(_get(mt, e.maxtext)))
  for e in _layer_entries(cfg):
    per_layer = []
    for i in range(cfg.num_layers):
      prefix, index, suffix = _where(cfg, i, scan_layers)
      x = _get(mt, _mt_path(prefix, e.maxtext, suffix))
      per_layer.append(e.to_native(x if index is None else jnp.take(x, index, axis=scan_axis)))
    if cfg.scan_layers:
      _set(out, ("layers", *e.native), jnp.stack(per_layer, axis=0))
    else:
      for i, x in enumerate(per_layer):
        _set(out, ("layers", i, *e.native), x)
  return out


def maxtext_hf_names(cfg: ModelConfig, *, scan_layers: bool) -> dict[str, str | tuple[str, ...]]:
  """MaxText parameter path ("decoder/layers_3/mlp/wo/kernel") -> HF tensor name; a stacked
  path (scan_layers) -> the HF names of its slices on the scan axis, in order. Values differ
  from HF's by hf.param_mapping's reshapes and by the Entry transforms above."""
  check_supported(cfg)
  by_native = {e.path: e.hf_name for e in hf.param_mapping(cfg)}
  out: dict = {}
  for e in _global_entries(cfg):
    out["/".join(e.maxtext)] = by_native[e.native]
  for e in _layer_entries(cfg):
    for i in range(cfg.num_layers):
      prefix, index, suffix = _where(cfg, i, scan_layers)
      path = "/".join(_mt_path(prefix, e.maxtext, suffix))
      name = by_native[e.native].format(i=i)
      out[path] = name if index is None else (*out.get(path, ()), name)
  return out
