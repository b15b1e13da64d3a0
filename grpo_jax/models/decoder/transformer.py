"""The decoder: Qwen3 dense, Llama 3, Gemma 2 and Gemma 3 in one Flax NNX module, in three modes.

1. Training forward: `model(input_ids, attention_mask) -> logits [B, T, V]` (or
   `model.hidden(...)` -> final-norm hidden states [B, T, D] for memory-frugal log-probs).
   Left padding is allowed: positions are `cumsum(mask) - 1`, padding is never attended.
2. Prefill: `model.prefill(tokens, mask, cache)` runs the prompt and fills the KV cache.
3. Decode: `model.decode(token_b, cache)` runs one new token per row against the cache.
All three give the same log-probs for the same tokens (tests/models/test_model.py checks 1e-5 in f32).

The KV cache is a plain pytree (a dict of arrays, see `init_cache`), passed in and out, so it
can be a `lax.while_loop` carry. Cache slot j holds the token at sequence index j of
[prompt (left-padded to P); completion], exactly the layout the training forward sees, so the
sampler's and the trainer's attention patterns and positions agree by construction.

Layers are a Python list or, with `scan_layers`, one stacked Block run by `lax.scan` (compile
time flat in depth). The layer function is wrapped in `jax.checkpoint` with the named remat
policy (`remat.py`).
"""
from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import layers
from grpo_jax.models.lora import adapters as lora
from grpo_jax.models import remat as remat_lib
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.layers import Block
from grpo_jax.models.decoder.layers import _param


def positions_from_mask(mask_bt: jax.Array) -> jax.Array:
  """Position of each token = number of real tokens before it (pads get 0)."""
  m = (mask_bt != 0).astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def compaction(mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(src, dst) [B, T] int32: `_take(x, src)` moves each row's real tokens to its front, in
  order, and the padding behind them; `_take(y, dst)` puts every slot back. With the real
  tokens first, attention under a plain causal mask is attention over the real tokens before
  each query (what the masked `layers.attention` computes), whatever the padding pattern (left
  padding, right padding, holes), so a fused causal kernel (`layers.causal_attention`) serves
  every batch the loop makes. Padding slots' outputs are unspecified (they are never read)."""
  m = mask_bt != 0
  rank = jnp.cumsum(m, axis=-1) - 1
  dst = jnp.where(m, rank, rank[:, -1:] + jnp.cumsum(~m, axis=-1)).astype(jnp.int32)
  t = mask_bt.shape[1]
  src = jax.vmap(lambda d: jnp.zeros((t,), jnp.int32).at[d].set(jnp.arange(t, dtype=jnp.int32),
                                                               unique_indices=True))(dst)
  return src, dst


def _take(x, idx_bt, axis: int = 1):
  """x gathered along its token `axis` by [B, T'] indices (rows on the axis before it)."""
  idx = idx_bt.reshape((1,) * (axis - 1) + idx_bt.shape + (1,) * (x.ndim - axis - 1))
  return jnp.take_along_axis(x, idx, axis=axis)


class Transformer(nnx.Module):
  """Decoder-only LM. `Transformer(cfg, rngs=nnx.Rngs(0))`; see `build_model` for sharded init."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    pd = jnp.dtype(cfg.param_dtype)
    d, v = cfg.hidden_size, cfg.vocab_size
    self.embed = _param(rngs, (v, d), ("vocab", "embed"), pd, fan_in=d)
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=0, out_axes=0)
      def make(rngs):
        return Block(cfg, rngs=rngs)
      self.layers = make(rngs)
      _prepend_layers_axis(self.layers)
    else:
      self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = layers.norm(cfg, d, rngs)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), pd, fan_in=d)

  # ------------------------------------------------------------------------------ pieces

  @property
  def compute_dtype(self):
    return jnp.dtype(self.cfg.dtype)

  def unembedding(self) -> jax.Array:
    """The output projection [D, V] in the compute dtype (the tied embedding transposed)."""
    w = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
    return w.astype(self.compute_dtype)

  def logits_from_hidden(self, h_btd: jax.Array) -> jax.Array:
    logits = jnp.einsum("btd,dv->btv", h_btd, self.unembedding(),
                        preferred_element_type=jnp.float32)
    return softcap(logits, self.cfg.final_logit_softcap)

  def _embed(self, tokens_bt):
    x = jnp.take(self.embed[...], tokens_bt, axis=0).astype(self.compute_dtype)
    if self.cfg.gemma:  # sqrt(D), rounded to the compute dtype first (as Hugging Face's Gemma)
      x = x * jnp.asarray(self.cfg.hidden_size**0.5, self.compute_dtype)
    return sharding.constrain(x, "batch", "length", "act_embed")

  def _run_layers(self, x, positions, q_slot, kv_valid, cache_k=None, cache_v=None,
                  write_slot=None, prefix=None):
    """All layers. Returns (x, ks, vs): each layer's new keys/values [B, T, Hkv, K], stacked
    on a leading layer axis with scan_layers, else a tuple per layer (like the cache). With
    `write_slot` (per-layer caches only): each layer writes its keys/values into its cache
    first and (x, caches k, caches v) come back (layers.Block). `prefix=(k, v, valid)`: a
    shared prompt's keys/values (laid out like the cache) that the queries also attend to."""
    prefix_k, prefix_v, prefix_valid = prefix if prefix is not None else (None, None, None)
    policy = remat_lib.policy(self.cfg.remat_policy)

    kinds = self.cfg.local_layers
    mixed = any(kinds) and not all(kinds)  # local and global layers: a per-layer flag

    def make_layer(graphdef, local=False):
      def layer(block_state, x, cache_kv, prefix_kv, local_flag=None):
        # lora.adapt: LoRA adapters / a quantized base become this layer's effective weights
        # here, one layer at a time (a no-op on a plain layer).
        block = lora.adapt(nnx.merge(graphdef, block_state))
        pre = None if prefix_kv is None else (*prefix_kv, prefix_valid)
        return block(x, positions, q_slot, kv_valid, cache_kv, write_slot, pre,
                     local if local_flag is None else local_flag)
      if policy is None:
        return layer
      return jax.checkpoint(layer, policy=policy, prevent_cse=not self.cfg.scan_layers)

    if self.cfg.scan_layers:
      graphdef, stacked = nnx.split(self.layers)
      layer = make_layer(graphdef, all(kinds) and any(kinds))
      flags = jnp.asarray(kinds) if mixed else None

      def body(x, xs):
        state, ck, cv, pk, pv, flag = xs
        x, k, v = layer(state, x, None if ck is None else (ck, cv),
                        None if pk is None else (pk, pv), flag)
        return sharding.constrain(x, "batch", "length", "act_embed"), (k, v)

      x, (ks, vs) = jax.lax.scan(body, x, (stacked, cache_k, cache_v, prefix_k, prefix_v,
                                           flags))
      return x, ks, vs

    ks, vs = [], []
    for i, blk in enumerate(self.layers):
      graphdef, state = nnx.split(blk)
      kv = None if cache_k is None else (cache_k[i], cache_v[i])
      pkv = None if prefix_k is None else (prefix_k[i], prefix_v[i])
      x, k, v = make_layer(graphdef, kinds[i])(state, x, kv, pkv)
      x = sharding.constrain(x, "batch", "length", "act_embed")
      ks.append(k)
      vs.append(v)
    return x, tuple(ks), tuple(vs)

  # ------------------------------------------------------------------------- training mode

  def hidden(self, input_ids, attention_mask=None):
    """Final-norm hidden states [B, T, D] (compute dtype) for a left- or right-padded batch."""
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    b, t = input_ids.shape
    positions = positions_from_mask(attention_mask)
    if layers.fused_attention_for(self.cfg):  # real tokens first, one fused causal kernel
      src, dst = compaction(attention_mask)
      x, _, _ = self._run_layers(self._embed(_take(input_ids, src)), _take(positions, src),
                                 None, None)
      return _take(self.final_norm(x), dst)
    q_slot = jnp.broadcast_to(jnp.arange(t), (b, t))
    x, _, _ = self._run_layers(self._embed(input_ids), positions, q_slot, attention_mask)
    return self.final_norm(x)

  def __call__(self, input_ids, attention_mask=None):
    """Logits [B, T, V] (float32) of the next token at every position."""
    return self.logits_from_hidden(self.hidden(input_ids, attention_mask))

  # --------------------------------------------------------------------- generation modes

  def init_cache(self, batch: int, max_len: int, dtype=None) -> dict:
    """An empty KV cache of `max_len` slots (>= prompt length + new tokens).

    k, v   keys/values by slot (slot j = sequence index j), head-major: a tuple of L arrays
           [B, Hkv, S, K] (one buffer per layer: the decode step reads and updates each in
           place, no per-step slice copies of a stacked cache), or with scan_layers one
           stacked [L, B, Hkv, S, K] array for the scan
    valid  [B, S] int32       1 where a slot holds a real token
    index  int32 scalar       the next slot to write (the same for every row)
    pos    [B] int32          the RoPE position of the next token of each row
    """
    c = self.cfg
    dtype = dtype or self.compute_dtype
    shape = (batch, c.num_kv_heads, max_len, c.head_dim)
    if c.scan_layers:
      k = jnp.zeros((c.num_layers, *shape), dtype)
      v = jnp.zeros((c.num_layers, *shape), dtype)
    else:
      k = tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers))
      v = tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers))
    return dict(k=k, v=v,
                valid=jnp.zeros((batch, max_len), jnp.int32), index=jnp.zeros((), jnp.int32),
                pos=jnp.zeros((batch,), jnp.int32))

  def prefill(self, tokens_bp, mask_bp, cache: dict, *, all_logits: bool = False):
    """Runs a left-padded prompt batch, writes slots 0..P-1. -> (logits, cache).

    logits: [B, V] for the last prompt position (the next-token distribution), or
    [B, P, V] with `all_logits`. Every row needs at least one real token.
    """
    b, p = tokens_bp.shape
    positions = positions_from_mask(mask_bp)
    if layers.fused_attention_for(self.cfg):  # real tokens first, one fused causal kernel
      src, dst = compaction(mask_bp)
      x, ks, vs = self._run_layers(self._embed(_take(tokens_bp, src)), _take(positions, src),
                                   None, None)
      lead = 1 if self.cfg.scan_layers else 0  # stacked keys: [L, B, P, Hkv, K]
      ks, vs = (jax.tree.map(lambda a: _take(a, dst, axis=1 + lead), kv) for kv in (ks, vs))
      x = _take(x, dst if all_logits else dst[:, -1:])
    else:
      q_slot = jnp.broadcast_to(jnp.arange(p), (b, p))
      x, ks, vs = self._run_layers(self._embed(tokens_bp), positions, q_slot, mask_bp)
    h = self.final_norm(x if all_logits else x[:, -1:])
    logits = self.logits_from_hidden(h)
    cache = dict(
        k=_write_kv(cache["k"], ks, 0), v=_write_kv(cache["v"], vs, 0),
        valid=jax.lax.dynamic_update_slice(cache["valid"], mask_bp.astype(jnp.int32), (0, 0)),
        index=jnp.asarray(p, jnp.int32),
        pos=(mask_bp != 0).sum(-1).astype(jnp.int32))
    return (logits if all_logits else logits[:, 0]), cache

  def decode(self, token_b, cache: dict):
    """One new token per row at slot `cache["index"]`. -> (logits [B, V] float32, cache)."""
    b = token_b.shape[0]
    index = cache["index"]
    positions = cache["pos"][:, None]
    q_slot = jnp.full((b, 1), index)
    valid = jax.lax.dynamic_update_slice(cache["valid"], jnp.ones((b, 1), jnp.int32),
                                         (0, index))
    prefix = None
    if "prefix_k" in cache:
      prefix = (cache["prefix_k"], cache["prefix_v"], cache["prefix_valid"])
    if isinstance(cache["k"], tuple):  # per-layer buffers: each layer writes, then reads
      x, ks, vs = self._run_layers(self._embed(token_b[:, None]), positions, q_slot, valid,
                                   cache["k"], cache["v"], write_slot=index, prefix=prefix)
    else:  # one stacked buffer, sliced per layer by the scan: written after all layers
      x, ks, vs = self._run_layers(self._embed(token_b[:, None]), positions, q_slot,
                                   cache["valid"], cache["k"], cache["v"], prefix=prefix)
      ks, vs = _write_kv(cache["k"], ks, index), _write_kv(cache["v"], vs, index)
    logits = self.logits_from_hidden(self.final_norm(x))[:, 0]
    cache = dict(cache, k=ks, v=vs, valid=valid, index=index + 1, pos=cache["pos"] + 1)
    return logits, cache


def softcap(logits, cap: float):
  """cap * tanh(logits / cap) (Gemma 2's final-logit soft-capping); logits as they are at 0."""
  return logits if not cap else jnp.tanh(logits / cap) * cap


def _write_kv(cache_kv, new_kv, slot):
  """Writes new keys/values ([B, T, Hkv, K] per layer, as _run_layers returns them) into the
  head-major cache at `slot`, per layer buffer (tuple) or into the stacked array."""
  if isinstance(cache_kv, tuple):
    return tuple(jax.lax.dynamic_update_slice(c, n.swapaxes(1, 2).astype(c.dtype), (0, 0, slot, 0))
                 for c, n in zip(cache_kv, new_kv))
  return jax.lax.dynamic_update_slice(cache_kv, new_kv.swapaxes(2, 3).astype(cache_kv.dtype),
                                      (0, 0, 0, slot, 0))


def ring_sizes(cfg: ModelConfig) -> tuple:
  """Per layer, the slots of its completion cache in the sampler's layout: a local layer's
  `sliding_window` (a ring: it never attends further back), else None (every slot)."""
  return tuple(cfg.sliding_window if local else None for local in cfg.local_layers)


def share_prompt(cache: dict, n: int, slots: int, prefix_multiple: int = 1,
                 rings: tuple | None = None) -> dict:
  """A cache of B prompts prefilled to exactly its P slots (`init_cache(B, P)`) -> a decode
  cache for n samples per prompt (B*n rows, group-major) that keeps the prompts' keys/values
  once per prompt ("prefix_k", "prefix_v", "prefix_valid": read by every sample of the prompt)
  and has `slots` empty slots per row for the new tokens (slot j = completion token j;
  `grow_cache` adds more). Decode attends to the prefix and the written slots: the same
  log-probs as `repeat_cache` + decode, and each prompt's keys are read once per group.
  `prefix_multiple`: the prefix padded at its end to a multiple of it (invalid slots: the
  blocks `decode_attention.ragged` reads). `rings` (per-layer caches; `ring_sizes`): a local
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
  return dict(prefix_k=cache["k"], prefix_v=cache["v"], prefix_valid=cache["valid"],
              k=empties(cache["k"]), v=empties(cache["v"]),
              valid=jnp.zeros((b * n, slots), jnp.int32), index=jnp.zeros((), jnp.int32),
              pos=jnp.repeat(cache["pos"], n, axis=0))


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
  return dict(cache, k=grown(cache["k"]), v=grown(cache["v"]),
              valid=jnp.pad(cache["valid"], ((0, 0), (0, slots - cache["valid"].shape[1]))))


def repeat_cache(cache: dict, n: int) -> dict:
  """Each row's cache repeated n times, group-major (row i -> rows i*n .. i*n+n-1)."""
  rep = lambda x: jnp.repeat(x, n, axis=x.ndim - 4)  # noqa: E731  (the batch axis)
  return dict(k=jax.tree.map(rep, cache["k"]), v=jax.tree.map(rep, cache["v"]),
              valid=jnp.repeat(cache["valid"], n, axis=0), index=cache["index"],
              pos=jnp.repeat(cache["pos"], n, axis=0))


def _prepend_layers_axis(module):
  """Marks every stacked parameter's leading axis as the "layers" logical axis."""
  for _, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Variable):
      axes = var.get_metadata().get("logical_axes")
      if axes is not None and len(axes) == var[...].ndim - 1:
        var.set_metadata("logical_axes", ("layers", *axes))


def build_model(cfg: ModelConfig, *, seed: int = 0, mesh=None) -> Transformer:
  """A randomly initialized model, created directly sharded over `mesh` when given.

  Initialization runs under jit with out_shardings from the logical-axis rules, so each device
  materializes only its shards; no full host or single-device copy is ever made.
  """
  if mesh is None:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=seed)))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = sharding.state_shardings(abstract_state, mesh)

  def init():
    return nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=seed)))

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)


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
  if (not cfg.scan_layers and plain and
      all(x.dtype == dt for x in jax.tree.leaves(nnx.state(model, nnx.Param))
          if jnp.issubdtype(x.dtype, jnp.floating))):
    return model
  out_cfg = cfg.replace(scan_layers=False, param_dtype=cfg.dtype, remat_policy="none")
  target = nnx.eval_shape(lambda: Transformer(out_cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(target)
  if cfg.scan_layers:
    layer_graph, stacked = nnx.split(model.layers)
    blocks = [nnx.merge(layer_graph, jax.tree.map(lambda x, i=i: x[i], stacked))
              for i in range(cfg.num_layers)]
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
  filled = _unflatten({p: (v.astype(dt) if jnp.issubdtype(v.dtype, jnp.floating) else v)
                       for p, v in flat.items()})
  nnx.replace_by_pure_dict(state, filled)
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
