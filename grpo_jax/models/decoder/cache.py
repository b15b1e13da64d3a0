"""The sampler's cache surgery and its copy of the decoder.

    rings = ring_sizes(model.cfg)                         # local layers: window-sized caches
    cache = share_prompt(prefilled, G, slots, BLOCK, rings)  # B prompts -> B*G decode rows
    cache = grow_cache(cache, more_slots, rings)          # between decode phases
    model = sampling_copy(model)                          # compute-dtype, per-layer weights
    model = stacked_sampling_copy(model)                  # the same, layers stacked (scanned)

A decode cache (`Transformer.decode`) is the prefill's cache (`Transformer.init_cache`) with
its prompts' keys/values kept once per group of G rows ("prefix_k", "prefix_v",
"prefix_valid": read by every sample of the prompt) and empty completion slots per row.
"""

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.transformer import Transformer
from grpo_jax.models.lora import adapters as lora


def ring_sizes(cfg: ModelConfig) -> tuple:
  """Per layer, the slots of its completion cache in the sampler's layout: a local layer's
  `sliding_window` (a ring: it never attends further back), else None (every slot)."""
  return tuple(cfg.sliding_window if local else None for local in cfg.local_layers)


def share_prompt(
    cache: dict, n: int, slots: int, prefix_multiple: int = 1, rings: tuple | None = None
) -> dict:
  """A cache of B prompts prefilled to exactly its P slots (`init_cache(B, P)`) -> a decode
  cache for n samples per prompt (B*n rows, group-major) that keeps the prompts' keys/values
  once per prompt ("prefix_k", "prefix_v", "prefix_valid": read by every sample of the prompt)
  and has `slots` empty slots per row for the new tokens (slot j = completion token j;
  `grow_cache` adds more). Decode attends to the prefix and the written slots: the same
  log-probs as a cache with each prompt repeated n times, and each prompt's keys are read once
  per group. `prefix_multiple`: the prefix padded at its end to a multiple of it (invalid
  slots: the blocks `decode_attention.ragged` reads). `rings` (per-layer caches; `ring_sizes`): a local
  layer's completion cache holds min(slots, its window) slots, used as a ring by the decode."""

  def empty(x, ring=None):
    shape = list(x.shape)
    shape[-4], shape[-2] = shape[-4] * n, slots if ring is None else min(slots, ring)
    return jnp.zeros(shape, x.dtype)

  def empties(kv):
    if rings is None or not isinstance(kv, tuple):
      return jax.tree.map(empty, kv)
    return tuple(empty(x, r) for x, r in zip(kv, rings))

  b, p = cache["valid"].shape
  extra = -p % prefix_multiple
  if extra:
    cache = grow_cache(cache, p + extra)
  return dict(
      prefix_k=cache["k"],
      prefix_v=cache["v"],
      prefix_valid=cache["valid"],
      k=empties(cache["k"]),
      v=empties(cache["v"]),
      valid=jnp.zeros((b * n, slots), jnp.int32),
      index=jnp.zeros((), jnp.int32),
      pos=jnp.repeat(cache["pos"], n, axis=0),
  )


def grow_cache(cache: dict, slots: int, rings: tuple | None = None) -> dict:
  """The cache with `slots` slots per row (more than it has; the new ones empty); a ring
  layer's (`rings`, as share_prompt) up to its window only."""

  def pad(x, ring=None):
    widths = [(0, 0)] * x.ndim
    widths[-2] = (0, (slots if ring is None else min(slots, ring)) - x.shape[-2])
    return jnp.pad(x, widths)

  def grown(kv):
    if rings is None or not isinstance(kv, tuple):
      return jax.tree.map(pad, kv)
    return tuple(pad(x, r) for x, r in zip(kv, rings))

  return dict(
      cache,
      k=grown(cache["k"]),
      v=grown(cache["v"]),
      valid=jnp.pad(cache["valid"], ((0, 0), (0, slots - cache["valid"].shape[1]))),
  )


def sampling_copy(model: Transformer) -> Transformer:
  """The decoder the sampler runs, made once per rollout inside its program: every floating
  weight in the compute dtype and already effective (LoRA adapters added, a quantized base
  dequantized: lora.effective_weight), and the layers as a list (scan_layers unstacked), so the
  decode loop reads compute-dtype per-layer weights and per-layer caches that update in place:
  no f32 -> bf16 convert per token, no slice of a stacked weight or cache per layer (which the
  layer scan would otherwise put inside the loop, whatever the compiler hoists). Same values as
  the trainer's forward, which casts each weight to the compute dtype where it reads it. The
  model itself when there is nothing to do (unscanned, plain, weights already in the compute
  dtype)."""
  cfg = model.cfg
  dt = model.compute_dtype
  plain = not lora.has_adapters(nnx.state(model)) and not _has_quantized(model)
  if (
      not cfg.scan_layers
      and plain
      and all(
          x.dtype == dt
          for x in jax.tree.leaves(nnx.state(model, nnx.Param))
          if jnp.issubdtype(x.dtype, jnp.floating)
      )
  ):
    return model
  out_cfg = cfg.replace(scan_layers=False, param_dtype=cfg.dtype, remat_policy="none")
  target = nnx.eval_shape(lambda: Transformer(out_cfg, rngs=nnx.Rngs(0), kernels=model.kernels))
  graphdef, state = nnx.split(target)
  if cfg.scan_layers:
    layer_graph, stacked = nnx.split(model.layers)
    blocks = [
        nnx.merge(layer_graph, jax.tree.map(lambda x, i=i: x[i], stacked))
        for i in range(cfg.num_layers)
    ]
  else:
    blocks = list(model.layers)

  def value(path):
    obj = blocks[path[1]] if path[0] == "layers" else model
    for name in path[2:] if path[0] == "layers" else path:
      obj = getattr(obj, name)
    return obj[...]

  def effective(path, x):
    if path[0] == "layers" and len(path) == 4 and path[2] in ("attn", "mlp"):
      w = lora.effective_weight(getattr(blocks[path[1]], path[2]), path[3])
      if w is not None:
        return w
    return value(path)

  pure = nnx.to_pure_dict(state)
  flat = {path: effective(path, x) for path, x in _flatten(pure)}
  filled = _unflatten(
      {p: (v.astype(dt) if jnp.issubdtype(v.dtype, jnp.floating) else v) for p, v in flat.items()}
  )
  nnx.replace_by_pure_dict(state, filled)
  return nnx.merge(graphdef, state)


def stacked_sampling_copy(model: Transformer) -> Transformer:
  """sampling_copy's weights (compute dtype, effective) with the layers kept stacked
  (scan_layers): what the slot engine's scanned decode runs (one compiled layer body whatever
  the depth; rollout/slots.py). A scanned plain model is cast as it is; any other goes through
  sampling_copy and its per-layer weights are stacked again."""
  cfg = model.cfg
  dt = model.compute_dtype
  out_cfg = cfg.replace(scan_layers=True, param_dtype=cfg.dtype, remat_policy="none")
  target = nnx.eval_shape(lambda: Transformer(out_cfg, rngs=nnx.Rngs(0), kernels=model.kernels))
  graphdef, state = nnx.split(target)
  cast = lambda v: v.astype(dt) if jnp.issubdtype(v.dtype, jnp.floating) else v  # noqa: E731
  plain = not lora.has_adapters(nnx.state(model)) and not _has_quantized(model)
  if cfg.scan_layers and plain:
    pure = jax.tree.map(cast, nnx.to_pure_dict(nnx.state(model)))
  else:
    pure = nnx.to_pure_dict(nnx.state(sampling_copy(model)))
    per_layer = [pure["layers"][i] for i in range(cfg.num_layers)]
    pure = dict(pure, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _has_quantized(model) -> bool:
  return any("_qscale" in "/".join(map(str, path)) for path, _ in nnx.iter_graph(model))


def _flatten(tree, prefix=()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flatten(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def _unflatten(flat: dict) -> dict:
  out = {}
  for path, v in flat.items():
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = v
  return out
