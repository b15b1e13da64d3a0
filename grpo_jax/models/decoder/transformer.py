"""The decoder: Qwen3 dense, Llama 3, Gemma 2 and Gemma 3 in one Flax NNX module, in three modes.

1. Training forward: `model(input_ids, attention_mask) -> logits [B, T, V]` (or
   `model.hidden(...)` -> final-norm hidden states [B, T, D] for memory-frugal log-probs).
   Left padding is allowed: positions are `cumsum(mask) - 1`, padding is never attended.
   Packed rows (several sequences per row, rl/packing.py): `model.packed_hidden(input_ids,
   segment_ids, positions)`; attention never crosses a sequence.
2. Prefill: `model.prefill(tokens, mask, cache)` runs the prompt and fills the KV cache.
3. Decode: `model.decode(token_b, cache)` runs one new token per row against the cache.
All three give the same log-probs for the same tokens (tests/models/test_model.py checks 1e-5 in f32).

The KV cache is a plain pytree (a dict of arrays, see `init_cache`), passed in and out, so it
can be a `lax.while_loop` carry. Cache slot j holds the token at sequence index j of
[prompt (left-padded to P); completion], exactly the layout the training forward sees, so the
sampler's and the trainer's attention patterns and positions agree by construction.

Layers are a Python list or, with `scan_layers`, one stacked Block run by `lax.scan` (compile
time flat in depth); modes 1 and 2 run `Block.forward`, mode 3 `Block.decode`. The layer
function is wrapped in `jax.checkpoint` with the named remat policy (`remat.py`). Which kernels
every mode runs is one value, `self.kernels` (kernels.py), given or resolved at construction.
The sampler's cache surgery (shared prompts, growing caches, rings) and its copy of the model
are in cache.py.
"""

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import layers
from grpo_jax.models.lora import adapters as lora
from grpo_jax.models import remat as remat_lib
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.kernels import Kernels
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
  each query (what the masked `attention.attention` computes), whatever the padding pattern (left
  padding, right padding, holes), so a fused causal kernel (`attention.causal_attention`) serves
  every batch the loop makes. Padding slots' outputs are unspecified (they are never read)."""
  m = mask_bt != 0
  rank = jnp.cumsum(m, axis=-1) - 1
  dst = jnp.where(m, rank, rank[:, -1:] + jnp.cumsum(~m, axis=-1)).astype(jnp.int32)
  t = mask_bt.shape[1]
  src = jax.vmap(
      lambda d: jnp.zeros((t,), jnp.int32)
      .at[d]
      .set(jnp.arange(t, dtype=jnp.int32), unique_indices=True)
  )(dst)
  return src, dst


def _take(x, idx_bt, axis: int = 1):
  """x gathered along its token `axis` by [B, T'] indices (rows on the axis before it)."""
  idx = idx_bt.reshape((1,) * (axis - 1) + idx_bt.shape + (1,) * (x.ndim - axis - 1))
  return jnp.take_along_axis(x, idx, axis=axis)


class Transformer(nnx.Module):
  """Decoder-only LM. `Transformer(cfg, rngs=nnx.Rngs(0))`; see `build_model` for sharded init."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, kernels: Kernels | None = None):
    """`kernels`: the kernels every mode runs (kernels.py; static, part of the graph); default
    `Kernels.resolve(cfg)`, for the default backend."""
    cfg.validate()
    self.cfg = cfg
    self.kernels = Kernels.resolve(cfg) if kernels is None else kernels
    pd = jnp.dtype(cfg.param_dtype)
    d, v = cfg.hidden_size, cfg.vocab_size
    self.embed = _param(rngs, (v, d), ("vocab", "embed"), pd, fan_in=d)
    if cfg.scan_layers:

      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=0, out_axes=0)
      def make(rngs):  # one structure: MoE layers all or none (ModelConfig.problems)
        return Block(cfg, rngs=rngs, moe=all(cfg.moe_layers))

      self.layers = make(rngs)
      _prepend_layers_axis(self.layers)
    else:
      self.layers = nnx.List(
          [Block(cfg, rngs=rngs, moe=cfg.layer_is_moe(i)) for i in range(cfg.num_layers)]
      )
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
    logits = jnp.einsum(
        "btd,dv->btv", h_btd, self.unembedding(), preferred_element_type=jnp.float32
    )
    return softcap(logits, self.cfg.final_logit_softcap)

  def _embed(self, tokens_bt):
    x = jnp.take(self.embed[...], tokens_bt, axis=0).astype(self.compute_dtype)
    if self.cfg.gemma:  # sqrt(D), rounded to the compute dtype first (as Hugging Face's Gemma)
      x = x * jnp.asarray(self.cfg.hidden_size**0.5, self.compute_dtype)
    return sharding.constrain(x, "batch", "length", "act_embed")

  def _run_layers(self, step, x, xs=()):
    """All layers: `step(block, x, xs_l, local) -> (x, ys_l)` per layer, where xs_l is the
    layer's slice of every array in the tuple `xs` (stacked on a leading layer axis with
    scan_layers, else one per layer) and `local` whether it is a sliding-window layer (a bool,
    or a traced one under the scan when local and global layers mix). Each layer runs inside
    the named remat policy (`remat.py`) with its LoRA / quantized weights made effective
    (`lora.adapt`). -> (x, ys): ys stacked on a layer axis with scan_layers, else a tuple per
    layer (as the cache: ys = (k, v) gives (ks, vs))."""
    policy = remat_lib.policy(self.cfg.remat_policy)
    kinds = self.cfg.local_layers
    # local and global layers in one scan: the layer kind is a traced per-layer flag
    traced_kind = self.cfg.scan_layers and any(kinds) and not all(kinds)

    def make_layer(graphdef, local):
      def layer(block_state, x, xs_l, flag):
        # lora.adapt: LoRA adapters / a quantized base become this layer's effective weights
        # here, one layer at a time (a no-op on a plain layer).
        block = lora.adapt(nnx.merge(graphdef, block_state))
        return step(block, x, xs_l, flag if traced_kind else local)

      if policy is None:
        return layer
      return jax.checkpoint(layer, policy=policy, prevent_cse=not self.cfg.scan_layers)

    if self.cfg.scan_layers:
      graphdef, stacked = nnx.split(self.layers)
      layer = make_layer(graphdef, all(kinds) and any(kinds))

      def body(x, per_layer):
        state, xs_l, flag = per_layer
        x, ys_l = layer(state, x, xs_l, flag)
        return sharding.constrain(x, "batch", "length", "act_embed"), ys_l

      return jax.lax.scan(body, x, (stacked, xs, jnp.asarray(kinds)))

    ys = []
    for i, blk in enumerate(self.layers):
      graphdef, state = nnx.split(blk)
      x, ys_l = make_layer(graphdef, kinds[i])(state, x, tuple(a[i] for a in xs), kinds[i])
      x = sharding.constrain(x, "batch", "length", "act_embed")
      ys.append(ys_l)
    return x, jax.tree.map(lambda *per_layer: per_layer, *ys)

  def _forward_layers(self, x, positions, segments, routes=None, *, packed: bool = False):
    """All layers' `Block.forward` (segments: 0 = padding, else the token's sequence in its
    row; `packed`: several sequences per row, the fused attention reads the segments). routes [B, T, L_moe, k] (int, -1 = own top-k): the MoE layers' replayed experts
    (routing replay, moe.py), L_moe the MoE layers in order; None: each layer its own. ->
    (x, ks, vs, own): each layer's keys/values [B, T, Hkv, K]; own [B, T, L_moe, k] int32, the
    MoE layers' own top-k experts (None for a dense model)."""
    kernels = self.kernels

    def step(block, x, xs_l, local):
      r = xs_l[0] if xs_l else None
      x, k, v, own = block.forward(
          x, positions, segments, kernels, local, routes_btk=r, packed=packed
      )
      return x, (k, v, _no_routes(x) if own is None else own)

    moe = self.cfg.moe_layers
    if routes is None:
      xs = ()
    elif self.cfg.scan_layers:  # every layer MoE (ModelConfig.problems): [L, B, T, k]
      xs = (jnp.moveaxis(routes, 2, 0),)
    else:
      index = [sum(moe[:i]) for i in range(len(moe))]
      xs = (tuple(routes[:, :, index[i]] if moe[i] else None for i in range(len(moe))),)
    x, (ks, vs, own) = self._run_layers(step, x, xs)
    return x, ks, vs, self._stack_routes(own)

  def _stack_routes(self, own):
    """The layers' own top-k (stacked [L, B, T, k] under the scan, else a tuple per layer,
    a dense layer's `_no_routes`) as [B, T, L_moe, k]; None for a dense model."""
    moe = self.cfg.moe_layers
    if not any(moe):
      return None
    if self.cfg.scan_layers:
      return jnp.moveaxis(own, 0, 2)
    return jnp.stack([o for o, m in zip(own, moe) if m], axis=2)

  # ------------------------------------------------------------------------- training mode

  def hidden(self, input_ids, attention_mask=None):
    """Final-norm hidden states [B, T, D] (compute dtype) for a left- or right-padded batch."""
    return self.hidden_routed(input_ids, attention_mask)[0]

  def hidden_routed(self, input_ids, attention_mask=None, routes=None):
    """`hidden` with routing replay (an MoE model; moe.py): routes [B, T, L_moe, k] (int; -1 =
    the token's own top-k) are the experts each MoE layer uses for each token instead of its
    own top-k; None: its own. -> (hidden [B, T, D], own [B, T, L_moe, k] int32: each MoE
    layer's own top-k, as it would route the token without replay; None for a dense model)."""
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    positions = positions_from_mask(attention_mask)
    segments = (attention_mask != 0).astype(jnp.int32)  # one sequence per row
    if self.kernels.fused_attention:  # real tokens first, one fused causal kernel
      src, dst = compaction(attention_mask)
      x, _, _, own = self._forward_layers(
          self._embed(_take(input_ids, src)),
          _take(positions, src),
          _take(segments, src),
          None if routes is None else _take(routes, src),
      )
      return _take(self.final_norm(x), dst), None if own is None else _take(own, dst)
    x, _, _, own = self._forward_layers(self._embed(input_ids), positions, segments, routes)
    return self.final_norm(x), own

  def packed_hidden(self, input_ids, segment_ids, positions):
    """Final-norm hidden states [R, L, D] of packed rows (rl/packing.py): several sequences per
    row, segment_ids [R, L] (0 = padding, else the sequence's id, unique in its row), positions
    [R, L] restarting at 0 in each sequence. A token attends only to its own sequence: with
    the fused attention one kernel that reads the segment ids (`attention.segment_attention`:
    splash attention on TPU, Pallas's Triton kernel on GPU), else the masked attention."""
    return self.packed_hidden_routed(input_ids, segment_ids, positions)[0]

  def packed_hidden_routed(self, input_ids, segment_ids, positions, routes=None):
    """`packed_hidden` with routing replay (as `hidden_routed`): routes [R, L, L_moe, k] (int;
    -1 = the token's own top-k), slot for slot with input_ids (rl/packing.py gathers them with
    their tokens). -> (hidden [R, L, D], own [R, L, L_moe, k] int32; None for a dense model)."""
    x, _, _, own = self._forward_layers(
        self._embed(input_ids), positions, segment_ids, routes, packed=True
    )
    return self.final_norm(x), own

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
    return dict(
        k=k,
        v=v,
        valid=jnp.zeros((batch, max_len), jnp.int32),
        index=jnp.zeros((), jnp.int32),
        pos=jnp.zeros((batch,), jnp.int32),
    )

  def prefill(self, tokens_bp, mask_bp, cache: dict, *, all_logits: bool = False):
    """Runs a left-padded prompt batch, writes slots 0..P-1. -> (logits, cache).

    logits: [B, V] for the last prompt position (the next-token distribution), or
    [B, P, V] with `all_logits`. Every row needs at least one real token.
    """
    logits, cache, _ = self.prefill_routed(tokens_bp, mask_bp, cache, all_logits=all_logits)
    return logits, cache

  def prefill_routed(self, tokens_bp, mask_bp, cache: dict, *, all_logits: bool = False):
    """`prefill` -> (logits, cache, routes): routes [B, P, L_moe, k] int32, the experts each
    MoE layer chose for each prompt token (the sampler records them for routing replay);
    None for a dense model."""
    p = tokens_bp.shape[1]
    positions = positions_from_mask(mask_bp)
    if self.kernels.fused_attention:  # real tokens first, one fused causal kernel
      src, dst = compaction(mask_bp)
      x, ks, vs, routes = self._forward_layers(
          self._embed(_take(tokens_bp, src)), _take(positions, src), _take(mask_bp, src)
      )
      lead = 1 if self.cfg.scan_layers else 0  # stacked keys: [L, B, P, Hkv, K]
      ks, vs = (jax.tree.map(lambda a: _take(a, dst, axis=1 + lead), kv) for kv in (ks, vs))
      routes = None if routes is None else _take(routes, dst)
      x = _take(x, dst if all_logits else dst[:, -1:])
    else:
      x, ks, vs, routes = self._forward_layers(
          self._embed(tokens_bp), positions, (mask_bp != 0).astype(jnp.int32)
      )
    h = self.final_norm(x if all_logits else x[:, -1:])
    logits = self.logits_from_hidden(h)
    cache = dict(
        k=_write_kv(cache["k"], ks, 0),
        v=_write_kv(cache["v"], vs, 0),
        valid=jax.lax.dynamic_update_slice(cache["valid"], mask_bp.astype(jnp.int32), (0, 0)),
        index=jnp.asarray(p, jnp.int32),
        pos=(mask_bp != 0).sum(-1).astype(jnp.int32),
    )
    return (logits if all_logits else logits[:, 0]), cache, routes

  def prefill_rows(self, tokens_bp, mask_bp, *, stacked: bool = False, head_major: bool = True):
    """The slot engine's prefill (rollout/slots.py): a prompt batch (any padding) with each
    row's real tokens moved to its front, so slot j of a row holds its token at position j.
    -> (logits [B, V] f32 of the next token after each prompt's last real token, keys and
    values: per layer (a tuple) head-major [B, Hkv, P, K], or with `stacked` one array
    [L, B, Hkv, P, K], slots >= length unspecified, and length [B] int32, the real tokens of
    each row). head_major False: the keys and values slot-major, [B, P, Hkv, K] ([L, B, P,
    Hkv, K]), as the layers make them (the TPU kernel's caches: no transpose)."""
    src, _ = compaction(mask_bp)
    tokens, mask = _take(tokens_bp, src), _take(mask_bp, src)
    length = (mask_bp != 0).sum(-1).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, ks, vs, _ = self._forward_layers(
        self._embed(tokens), positions, (mask != 0).astype(jnp.int32)
    )
    last = jnp.take_along_axis(x, jnp.maximum(length - 1, 0)[:, None, None], axis=1)
    logits = self.logits_from_hidden(self.final_norm(last))[:, 0]

    def layout(kv):
      swap = (lambda a: a.swapaxes(-3, -2)) if head_major else (lambda a: a)  # noqa: E731
      if stacked:
        return swap(jnp.stack(kv) if isinstance(kv, tuple) else kv)
      if isinstance(kv, tuple):
        return tuple(swap(a) for a in kv)
      return tuple(swap(kv[i]) for i in range(kv.shape[0]))

    return logits, layout(ks), layout(vs), length

  def decode_rows(self, token_b, ks, vs, at_b):
    """One new token per row, each at its own position `at` [B] (the slot engine's cache: a
    row's sequence contiguous from slot 0; see `Block.decode_rows`). -> (logits [B, V] float32,
    ks, vs). Per-layer model (layers as a list, cache.sampling_copy): ks, vs per-layer tuples of
    [B, Hkv, S, K], one program per layer. scan_layers (cache.stacked_sampling_copy): ks, vs
    stacked [L, B, Hkv, S, K], carried by one `lax.scan` over the layers (compile time flat in
    depth) that writes each layer's token into them in place."""
    x, ks, vs = self._rows(self._embed(token_b[:, None]), ks, vs, at_b)
    return self.logits_from_hidden(self.final_norm(x))[:, 0], ks, vs

  def extend_rows(self, tokens_bt, ks, vs, at_b, n_b):
    """Appends up to T tokens to each live row of the slot engine's cache (a tool's response
    after the row's last token: rollout/slots.py): row b's first n_b of `tokens` [B, T] are
    written at slots at_b .. at_b + n_b - 1 and attend to the row's cache before them and to
    each other causally, with the same keys/values a decode of them one by one would write
    (columns past n_b write slots the row's next tokens overwrite before reading). -> (logits
    [B, V] float32 of the token after each row's n_b-th, ks, vs)."""
    x, ks, vs = self._rows(self._embed(tokens_bt), ks, vs, at_b)
    last = jnp.take_along_axis(x, jnp.maximum(n_b - 1, 0)[:, None, None], axis=1)
    return self.logits_from_hidden(self.final_norm(last))[:, 0], ks, vs

  def _rows(self, x, ks, vs, at_b):
    """The layers of decode_rows / extend_rows: x [B, T, D] at slots at_b + (0..T-1)."""
    kernels = self.kernels
    if self.cfg.scan_layers:
      return self._rows_scanned(x, ks, vs, at_b)

    def step(block, x, xs_l, local):
      x, k, v = block.decode_rows(x, xs_l[0], xs_l[1], at_b, kernels, local)
      return x, (k, v)

    x, (ks, vs) = self._run_layers(step, x, (ks, vs))
    return x, ks, vs

  def _rows_scanned(self, x, ks, vs, at_b):
    """decode_rows over stacked layers: the caches ride in the scan's carry (not its outputs,
    which would be a new stacked cache per step), each layer scattering its token into its own
    slots of them. No remat and no LoRA here: the engine decodes the effective compute-dtype
    copy."""
    kinds = self.cfg.local_layers
    kernels = self.kernels
    graphdef, stacked = nnx.split(self.layers)
    mixed = any(kinds) and not all(kinds)  # local and global layers: a traced per-layer flag
    same = all(kinds) and any(kinds)

    def body(carry, per_layer):
      x, ks, vs = carry
      state, index, flag = per_layer
      block = nnx.merge(graphdef, state)
      x, ks, vs = block.decode_rows(x, ks, vs, at_b, kernels, flag if mixed else same, layer=index)
      return (sharding.constrain(x, "batch", "length", "act_embed"), ks, vs), None

    layers_xs = (stacked, jnp.arange(len(kinds), dtype=jnp.int32), jnp.asarray(kinds))
    (x, ks, vs), _ = jax.lax.scan(body, (x, ks, vs), layers_xs)
    return x, ks, vs

  def decode(self, token_b, cache: dict):
    """One new token per row at slot `cache["index"]`. -> (logits [B, V] float32, cache)."""
    logits, cache, _ = self.decode_routed(token_b, cache)
    return logits, cache

  def decode_routed(self, token_b, cache: dict):
    """`decode` -> (logits [B, V] float32, cache, routes): routes [B, L_moe, k] int32, the
    experts each MoE layer chose for the token (None for a dense model).

    Each layer writes the token's key/value into its cache, then attends to the written cache
    and to the prompt's shared keys/values where the cache has them (cache.share_prompt; a
    plain cache attends to an empty prefix). Per-layer caches update in place; a stacked one
    (scan_layers) comes back from the layer scan as a new array, a copy per step: the sampler
    decodes its per-layer copy of the model (cache.sampling_copy)."""
    b = token_b.shape[0]
    index = cache["index"]
    positions = cache["pos"][:, None]
    valid = jax.lax.dynamic_update_slice(cache["valid"], jnp.ones((b, 1), jnp.int32), (0, index))
    prefix_k, prefix_v, prefix_valid = _prefix(cache)
    kernels = self.kernels

    def step(block, x, xs_l, local):
      cache_k, cache_v, pk, pv = xs_l
      x, k, v, own = block.decode(
          x, positions, cache_k, cache_v, valid, index, (pk, pv, prefix_valid), kernels, local
      )
      return x, (k, v, _no_routes(x) if own is None else own)

    x, (ks, vs, own) = self._run_layers(
        step, self._embed(token_b[:, None]), (cache["k"], cache["v"], prefix_k, prefix_v)
    )
    logits = self.logits_from_hidden(self.final_norm(x))[:, 0]
    cache = dict(cache, k=ks, v=vs, valid=valid, index=index + 1, pos=cache["pos"] + 1)
    routes = self._stack_routes(own)
    return logits, cache, None if routes is None else routes[:, 0]


def _no_routes(x_btd):
  """A dense layer's routes, [B, T, 0]: the layers' outputs keep one structure."""
  return jnp.zeros((*x_btd.shape[:2], 0), jnp.int32)


def _prefix(cache: dict):
  """(prefix k, prefix v, prefix valid): the shared prompt of a decode cache
  (cache.share_prompt), or an empty one (0 slots, one per row) for a plain cache."""
  if "prefix_k" in cache:
    return cache["prefix_k"], cache["prefix_v"], cache["prefix_valid"]
  empty = lambda x: jnp.zeros((*x.shape[:-2], 0, x.shape[-1]), x.dtype)  # noqa: E731
  return (
      jax.tree.map(empty, cache["k"]),
      jax.tree.map(empty, cache["v"]),
      jnp.zeros((cache["valid"].shape[0], 0), jnp.int32),
  )


def softcap(logits, cap: float):
  """cap * tanh(logits / cap) (Gemma 2's final-logit soft-capping); logits as they are at 0."""
  return logits if not cap else jnp.tanh(logits / cap) * cap


def _write_kv(cache_kv, new_kv, slot):
  """Writes new keys/values ([B, T, Hkv, K] per layer, as _forward_layers returns them) into the
  head-major cache at `slot`, per layer buffer (tuple) or into the stacked array."""
  if isinstance(cache_kv, tuple):
    return tuple(
        jax.lax.dynamic_update_slice(c, n.swapaxes(1, 2).astype(c.dtype), (0, 0, slot, 0))
        for c, n in zip(cache_kv, new_kv)
    )
  return jax.lax.dynamic_update_slice(
      cache_kv, new_kv.swapaxes(2, 3).astype(cache_kv.dtype), (0, 0, 0, slot, 0)
  )


def _prepend_layers_axis(module):
  """Marks every stacked parameter's leading axis as the "layers" logical axis."""
  for _, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Variable):
      axes = var.get_metadata().get("logical_axes")
      if axes is not None and len(axes) == var[...].ndim - 1:
        var.set_metadata("logical_axes", ("layers", *axes))


def build_model(cfg: ModelConfig, *, seed: int = 0, mesh=None) -> Transformer:
  """A randomly initialized model, created directly sharded over `mesh` when given, with the
  kernels of the mesh's platform (Kernels.for_mesh).

  Initialization runs under jit with out_shardings from the logical-axis rules, so each device
  materializes only its shards; no full host or single-device copy is ever made.
  """
  kernels = Kernels.for_mesh(cfg, mesh)
  if mesh is None:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed), kernels=kernels)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=seed), kernels=kernels))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = sharding.state_shardings(abstract_state, mesh)

  def init():
    return nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=seed), kernels=kernels))

  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(graphdef, state)
