"""Decoder building blocks: RMSNorm, RoPE (with Llama-3 scaling), GQA attention, SwiGLU MLP;
for Gemma 2 / 3 ((1 + w) norms, post-norms, GeGLU, soft-capped scores, sliding windows) the
same blocks with the ModelConfig fields that switch each feature on.

Parameter layouts (logical axes in parentheses) keep heads as their own dimension:
  q  [D, H, K]    (embed, q_heads, head_dim)       k, v [D, Hkv, K] (embed, kv_heads, head_dim)
  o  [H, K, D]    (q_heads, head_dim, embed)
  gate, up [D, F] (embed, mlp)                     down [F, D] (mlp, embed)
Activations are tagged with `checkpoint_name` so named remat policies can pick them:
  "qkv_proj" (q, k, v after RoPE), "attn_out" (o-projection output), "mlp_hidden" (gated
  activation before the down projection), "mlp_out".

A Block has one method per mode: `forward` (the training forward and the prefill: the tokens
attend among themselves) and `decode` (the sampler's step: one token per row written into the
layer's cache, then attending to the shared prompt and the cache). Which kernels they run is one
value, `Kernels` (kernels.py), resolved when the model is built and passed down. The masked
attentions (`attention`, and `cache_attention` for the decode) take an explicit mask
(`slot_mask`, `prefix_mask`): queries at absolute slots attend to keys at slots <= theirs
(causal) that hold real tokens (padding is never attended).

Sliding windows count positions (real tokens), not slots: a local layer's query at position p
attends to the keys at positions p - window + 1 .. p (Hugging Face's Gemma mask on an unpadded
row), whatever padding the row holds, and per sequence in a packed row (positions restart at
0 in each). In the training forward the key positions are the queries' (self-attention); in the caches the real tokens of a row are contiguous from the
first completion slot on (the sampler's layout), so slot distance is position distance there.
"""

import functools
import math

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from grpo_jax.models.decoder import decode_attention
from grpo_jax.models.decoder.attention import attention
from grpo_jax.models.decoder.attention import cache_attention
from grpo_jax.models.decoder.attention import causal_attention
from grpo_jax.models.decoder.attention import prefix_mask
from grpo_jax.models.decoder.attention import segment_attention
from grpo_jax.models.decoder.attention import slot_mask
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.decoder.moe import MoE


def _dtype(name: str):
  return jnp.dtype(name)


def _param(rngs, shape, axes, dtype, *, fan_in: int | None = None, init: str = "normal"):
  """Normal(0, 1/sqrt(fan_in)) weights (so a random model's loss starts near log V), ones
  for norm scales, zeros for biases."""
  if init == "ones":
    value = jnp.ones(shape, dtype)
  elif init == "zeros":
    value = jnp.zeros(shape, dtype)
  else:
    std = 1.0 / math.sqrt(fan_in) if fan_in else 0.02
    value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
  return nnx.Param(value, logical_axes=axes)


class RMSNorm(nnx.Module):
  """RMSNorm computed in f32, scaled in the input dtype (as Hugging Face's Qwen3/Llama do);
  `plus_one` (Gemma): the scale is stored as w and applied as (1 + w) in f32 (init w = 0)."""

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs, plus_one: bool = False):
    self.eps = eps
    self.plus_one = plus_one
    self.scale = _param(rngs, (dim,), ("norm",), param_dtype, init="zeros" if plus_one else "ones")

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    if self.plus_one:
      return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
    return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def norm(cfg: ModelConfig, dim: int, rngs: nnx.Rngs) -> RMSNorm:
  return RMSNorm(
      dim, cfg.rms_norm_eps, param_dtype=_dtype(cfg.param_dtype), rngs=rngs, plus_one=cfg.gemma
  )


def rope_inv_freq(cfg: ModelConfig, local=False) -> jax.Array:
  """Inverse frequencies [K/2], with Llama-3 scaling of the long wavelengths when configured;
  `local` (a bool or a traced one: the scanned layers): a sliding-window layer's, with
  rope_local_theta (0: rope_theta) and never scaled, as HF's Gemma 3; else divided by
  rope_linear_factor (Gemma 3's global layers; 1.0 elsewhere: exact)."""
  if not isinstance(local, bool):
    return jnp.where(local, rope_inv_freq(cfg, True), rope_inv_freq(cfg, False))
  exponent = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
  if local:  # Gemma's sliding-window layers: their own base (0: rope_theta's), never scaled
    return 1.0 / ((cfg.rope_local_theta or cfg.rope_theta) ** exponent)
  inv = 1.0 / (cfg.rope_theta**exponent) / cfg.rope_linear_factor
  if cfg.rope_scaling_factor > 0:
    factor, lo, hi = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_position
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    inv = jnp.where(medium, smoothed, scaled)
  return inv


def apply_rope(x, positions, inv_freq):
  """Rotary embedding, half-split ("rotate_half") layout. x [B, T, N, K], positions [B, T]."""
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, K/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, K]
  cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = _dtype(cfg.param_dtype)
    d, h, g, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.q = _param(rngs, (d, h, k), ("embed", "q_heads", "head_dim"), pd, fan_in=d)
    self.k = _param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), pd, fan_in=d)
    self.v = _param(rngs, (d, g, k), ("embed", "kv_heads", "head_dim"), pd, fan_in=d)
    self.o = _param(rngs, (h, k, d), ("q_heads", "head_dim", "embed"), pd, fan_in=h * k)
    if cfg.attention_bias:
      self.q_bias = _param(rngs, (h, k), ("q_heads", "head_dim"), pd, init="zeros")
      self.k_bias = _param(rngs, (g, k), ("kv_heads", "head_dim"), pd, init="zeros")
      self.v_bias = _param(rngs, (g, k), ("kv_heads", "head_dim"), pd, init="zeros")
      self.o_bias = _param(rngs, (d,), ("embed",), pd, init="zeros")
    if cfg.qk_norm:
      self.q_norm = norm(cfg, k, rngs)
      self.k_norm = norm(cfg, k, rngs)

  def project_qkv(self, x_btd, positions_bt, local=False):
    """q [B, T, H, K], k and v [B, T, Hkv, K], RoPE applied (a local layer's with `local`);
    q scaled by sqrt(head_dim / query_pre_attn_scalar) when that is set, so every attention
    path's head_dim ** -0.5 makes the scale query_pre_attn_scalar ** -0.5."""
    dt = x_btd.dtype
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)

    def proj(w_dnk):  # as one 2-D GEMM (faster on XLA:CPU than the 3-D einsum, same values)
      n, kd = w_dnk.shape[1:]
      return (x @ w_dnk[...].astype(dt).reshape(d, n * kd)).reshape(b, t, n, kd)

    q, k, v = proj(self.q), proj(self.k), proj(self.v)
    if self.cfg.attention_bias:
      q, k, v = (
          q + self.q_bias[...].astype(dt),
          k + self.k_bias[...].astype(dt),
          v + self.v_bias[...].astype(dt),
      )
    if self.cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(self.cfg, local)
    q = apply_rope(q, positions_bt, inv_freq)
    qs = self.cfg.query_pre_attn_scalar
    if qs and qs != self.cfg.head_dim:
      q = q * jnp.asarray((self.cfg.head_dim / qs) ** 0.5, q.dtype)
    k = apply_rope(k, positions_bt, inv_freq)
    return (
        checkpoint_name(q, "qkv_proj"),
        checkpoint_name(k, "qkv_proj"),
        checkpoint_name(v, "qkv_proj"),
    )

  def out(self, attn_bthk):
    b, t, h, kd = attn_bthk.shape
    w = self.o[...].astype(attn_bthk.dtype)
    y = (attn_bthk.reshape(b * t, h * kd) @ w.reshape(h * kd, -1)).reshape(b, t, -1)
    if self.cfg.attention_bias:
      y = y + self.o_bias[...].astype(y.dtype)
    return checkpoint_name(y, "attn_out")


def _gate_up(x_nd, w_gate_df, w_up_df, fused: bool):
  """(x @ w_gate, x @ w_up), as one GEMM when `fused` (Kernels.fuse_gate_up: XLA:CPU)."""
  if not fused:
    return x_nd @ w_gate_df, x_nd @ w_up_df
  f = w_gate_df.shape[1]
  gu = x_nd @ jnp.concatenate([w_gate_df, w_up_df], axis=1)
  return gu[:, :f], gu[:, f:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def swiglu(x_nd, w_gate_df, w_up_df, fused: bool = False):
  """silu(x @ w_gate) * (x @ w_up), [N, F], with a hand-written backward; `fused`
  (Kernels.fuse_gate_up, static): gate and up as one GEMM.

  Autodiff of this expression saves silu's intermediates and runs several unfused elementwise
  passes over [N, F] (jvp of silu's division); the custom rule saves only the two
  pre-activations and forms both input gradients in one elementwise expression (in f32), and
  dx as one GEMM against the stacked weights where gate/up are fused. Same values as autodiff
  (f32: ~1e-7 relative)."""
  g, u = _gate_up(x_nd, w_gate_df, w_up_df, fused)
  return jax.nn.silu(g) * u


def _swiglu_fwd(x_nd, w_gate_df, w_up_df, fused):
  g, u = _gate_up(x_nd, w_gate_df, w_up_df, fused)
  return jax.nn.silu(g) * u, (x_nd, w_gate_df, w_up_df, g, u)


def _swiglu_bwd(fused, res, dh_nf):
  x, wg, wu, g, u = res
  dt = dh_nf.dtype
  g32, u32, dh32 = g.astype(jnp.float32), u.astype(jnp.float32), dh_nf.astype(jnp.float32)
  sig = jax.nn.sigmoid(g32)
  du = (dh32 * g32 * sig).astype(dt)
  dg = (dh32 * u32 * sig * (1.0 + g32 * (1.0 - sig))).astype(dt)
  if fused:
    dgu = jnp.concatenate([dg, du], axis=1)  # [N, 2F]
    dx = dgu @ jnp.concatenate([wg, wu], axis=1).T
    dw = x.T @ dgu
    f = wg.shape[1]
    dwg, dwu = dw[:, :f], dw[:, f:]
  else:
    dx = dg @ wg.T + du @ wu.T
    dwg, dwu = x.T @ dg, x.T @ du
  return dx.astype(x.dtype), dwg.astype(wg.dtype), dwu.astype(wu.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)) (`swiglu`: a custom VJP); Gemma's GeGLU:
  down(gelu_tanh(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = _dtype(cfg.param_dtype)
    self.geglu = cfg.gemma
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate = _param(rngs, (d, f), ("embed", "mlp"), pd, fan_in=d)
    self.up = _param(rngs, (d, f), ("embed", "mlp"), pd, fan_in=d)
    self.down = _param(rngs, (f, d), ("mlp", "embed"), pd, fan_in=f)

  def __call__(self, x_btd, fuse_gate_up: bool = False):
    """`fuse_gate_up` (Kernels.fuse_gate_up): gate and up as one GEMM."""
    dt = x_btd.dtype
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)  # 2-D GEMMs: XLA:CPU's backward is ~30% faster than for 3-D
    if self.geglu:
      g, u = _gate_up(x, self.gate[...].astype(dt), self.up[...].astype(dt), fuse_gate_up)
      h = jax.nn.gelu(g, approximate=True) * u
    else:
      h = swiglu(x, self.gate[...].astype(dt), self.up[...].astype(dt), fuse_gate_up)
    h = checkpoint_name(h.reshape(b, t, -1), "mlp_hidden")
    y = h.reshape(b * t, -1) @ self.down[...].astype(dt)
    return checkpoint_name(y.reshape(b, t, d), "mlp_out")


class Block(nnx.Module):
  """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)); Gemma's adds a norm
  after each: x + post_attn_norm(attn(attn_norm(x))), then + post_mlp_norm(mlp(mlp_norm(.))).
  `moe` (cfg.layer_is_moe(i)): the MLP is the routed experts (moe.py), in every mode."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, moe: bool = False):
    self.cfg = cfg
    self.attn_norm = norm(cfg, cfg.hidden_size, rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = norm(cfg, cfg.hidden_size, rngs)
    self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)
    if cfg.gemma:
      self.post_attn_norm = norm(cfg, cfg.hidden_size, rngs)
      self.post_mlp_norm = norm(cfg, cfg.hidden_size, rngs)

  def forward(
      self,
      x_btd,
      positions_bt,
      segments_bt,
      kernels: Kernels,
      local=False,
      routes_btk=None,
      *,
      packed: bool = False,
  ):
    """The training forward and the prefill: the T tokens of each row attend among themselves.

    x [B, T, D]; positions [B, T] (RoPE; the real tokens of its sequence before each);
    segments [B, T] int: 0 = padding, else the token's sequence within the row (a padded row:
    its attention mask, one sequence; a packed row, rl/packing.py: its segment ids); a token
    attends only to the earlier tokens of its own sequence. With `kernels.fused_attention` one
    fused kernel runs: for padded rows (not `packed`) the caller has moved each row's real
    tokens first (transformer.compaction) and the kernel is causal (`causal_attention`;
    `segments` not read); for `packed` rows (static: Transformer.packed_hidden) the kernel
    reads the segment ids (`segment_attention`). Else the masked attention, where slot j is
    the row's index j. `local`: a sliding-window layer (a bool, or a traced one under the
    layer scan). `routes_btk` [B, T, k]: an MoE layer's replayed experts (routing replay,
    moe.py; -1 = the token's own top-k). -> (x, k, v, own): k, v [B, T, Hkv, K] are the tokens'
    keys/values (the prefill's cache entries); own [B, T, k] an MoE layer's own top-k experts
    (None for a dense layer)."""
    cfg = self.cfg
    q, k, v = self.attn.project_qkv(self.attn_norm(x_btd), positions_bt, local)
    window = self._window(local)
    if kernels.fused_attention:

      def fused(w):
        if packed:
          return segment_attention(
              q,
              k,
              v,
              segments_bt,
              platform=kernels.platform,
              window=w,
              softcap=cfg.attn_logit_softcap,
          )
        return causal_attention(
            q, k, v, platform=kernels.platform, window=w, softcap=cfg.attn_logit_softcap
        )

      if window is None:
        a = fused(None)
      elif local is True:
        a = fused(cfg.sliding_window)
      else:  # the kernel's mask is static: one branch per layer kind
        a = jax.lax.cond(local, lambda: fused(cfg.sliding_window), lambda: fused(None))
    else:
      b, t = segments_bt.shape
      slots = jnp.arange(t)
      allowed = slot_mask(jnp.broadcast_to(slots, (b, t)), slots, segments_bt)
      allowed &= segments_bt[:, :, None] == segments_bt[:, None, :]
      if window is not None:  # windows count positions (within the sequence), not slots
        allowed &= positions_bt[:, :, None] - positions_bt[:, None, :] < window
      a = attention(q, k, v, allowed, softcap=cfg.attn_logit_softcap)
    x_btd, own = self._residual(x_btd, a, kernels, routes_btk)
    return x_btd, k, v, own

  def decode(
      self,
      x_btd,
      positions_bt,
      cache_k,
      cache_v,
      valid_bs,
      slot,
      prefix,
      kernels: Kernels,
      local=False,
  ):
    """The decode step: one new token per row (T = 1) is written into the layer's cache at
    `slot`, then attends to its group's shared prompt and the written cache.

    x [B, 1, D]; positions [B, 1] (RoPE); cache_k, cache_v head-major [B, Hkv, S, K]; valid
    [B, S] marks the real slots, `slot` (an int32 scalar, the same for every row) included;
    prefix = (pk, pv, p_valid) the shared prompts' keys/values [B/G, Hkv, P, K] and validity
    [B/G, P] (`cache_attention`; P = 0 for a cache without one). Written first, the cache is
    updated in place; read first and written after, XLA would copy the whole cache every step
    (the old buffer still read when the update lands). With `kernels.ragged_decode` (the
    sampler's, on GPU) one kernel reads the written slots only, where the layer allows it (no
    window, no soft-cap, `decode_attention.supports`). `local`: as `forward`.
    -> (x, cache k, cache v, own): the written cache; own [B, 1, k] an MoE layer's top-k
    experts (None for a dense layer)."""
    cfg = self.cfg
    q, k, v = self.attn.project_qkv(self.attn_norm(x_btd), positions_bt, local)
    window = self._window(local)
    # A local layer's cache of exactly `sliding_window` slots is a ring (cache.ring_sizes): slot
    # r holds completion slot j = slot - (slot - r) mod W, the last W written (j < 0: not yet);
    # while slot < W it is the plain layout.
    s_len = cache_k.shape[2]
    ring = local is True and cfg.sliding_window == s_len
    at = slot % s_len if ring else slot
    k, v = (
        jax.lax.dynamic_update_slice(c, n.swapaxes(1, 2).astype(c.dtype), (0, 0, at, 0))
        for c, n in ((cache_k, k), (cache_v, v))
    )
    kv_slot = jnp.arange(s_len)
    if ring:
      kv_slot = slot - (slot - kv_slot) % s_len
      valid_bs = jnp.broadcast_to((kv_slot >= 0).astype(jnp.int32), (q.shape[0], s_len))
    ragged = (
        kernels.ragged_decode
        and window is None
        and not cfg.attn_logit_softcap
        and decode_attention.supports(q, k, prefix[0], interpret=kernels.interpret)
    )
    if ragged:  # the sampler's: written slots only
      a = decode_attention.ragged(q, k, v, slot + 1, prefix, interpret=kernels.interpret)
    else:
      q_slot = jnp.full(positions_bt.shape, slot)
      a = cache_attention(
          q,
          k,
          v,
          slot_mask(q_slot, kv_slot, valid_bs, window),
          prefix,
          prefix_mask(prefix[2], positions_bt, window),
          softcap=cfg.attn_logit_softcap,
      )
    x_btd, own = self._residual(x_btd, a, kernels)
    return x_btd, k, v, own

  def decode_rows(self, x_btd, cache_k, cache_v, at_b, kernels: Kernels, local=False, layer=None):
    """The slot engine's decode step (rollout/slots.py): one new token per row (or T, appended
    after each other: a tool response fed into a live row), each row at its own position. A
    row's cache holds its sequence contiguously from slot 0 (prompt, then completion: no
    padding), so a token's slot is its position: the token is written at slot `at` of its row
    and attends to slots 0..at of it (the last `sliding_window` of them in a local layer).

    x [B, T, D] (token i of a row at slot at + i; slots past S are dropped); cache_k, cache_v
    head-major [B, Hkv, S, K] (with `kernels.ragged_tpu` slot-major [B, S, Hkv, K], the TPU
    kernel's); at [B] int32 (< S). -> (x, cache k, cache v), the caches updated in place
    (written first, as `decode`). `layer` (an int32 scalar, under the layer scan): the caches
    are every layer's, stacked [L, B, ...]; the token is written into layer `layer`'s slots of
    them (in place in the scan's carry). The attention, `decode_attention.over_slots`: a kernel
    over each row's written slots (GPU, TPU; a stack's layer in place) where the layer allows
    it, else XLA's over all S slots (a product and sum form that XLA could fuse was slower on
    CPU and copied more on TPU: benchmarks/README.md "Slot engine")."""
    t = x_btd.shape[1]
    positions = at_b[:, None] + jnp.arange(t, dtype=at_b.dtype)
    q, k, v = self.attn.project_qkv(self.attn_norm(x_btd), positions, local)
    rows = jnp.arange(x_btd.shape[0])[:, None]
    slot_major = kernels.ragged_tpu  # (the TPU kernel's caches: [.., B, S, Hkv, K])
    at = (rows, positions) if slot_major else (rows, slice(None), positions)
    at = at if layer is None else (layer, *at)
    # [B, T] slots, then heads: the [B, T, Hkv, K] keys as they are
    cache_k, cache_v = (
        c.at[at].set(n.astype(c.dtype), unique_indices=True, mode="drop")
        for c, n in ((cache_k, k), (cache_v, v))
    )
    a = decode_attention.over_slots(
        q,
        cache_k,
        cache_v,
        at_b,
        kernels,
        window=self._window(local),
        softcap=self.cfg.attn_logit_softcap,
        layer=layer,
    )
    return self._residual(x_btd, a, kernels)[0], cache_k, cache_v

  def _window(self, local):
    """The layer's sliding window: None (a global layer, or a model without windows),
    cfg.sliding_window (a local one), or under the layer scan a traced choice between it and a
    window no sequence reaches."""
    cfg = self.cfg
    if cfg.sliding_window <= 0 or local is False:
      return None
    if local is True:
      return cfg.sliding_window
    return jnp.where(local, cfg.sliding_window, 2**30)

  def _residual(self, x_btd, attn_bthk, kernels: Kernels, routes_btk=None):
    """x + attn, then + mlp (Gemma: each output normed first). -> (x, own): own [B, T, k]
    int32, an MoE layer's own top-k experts per token (None for a dense MLP); `routes_btk`:
    an MoE layer's replayed experts (MoE.routed; -1 = own)."""
    a = self.attn.out(attn_bthk)
    if self.cfg.gemma:
      a = self.post_attn_norm(a)
    x_btd = x_btd + a
    h = self.mlp_norm(x_btd)
    own = None
    if isinstance(self.mlp, MoE):
      m, own = self.mlp.routed(h, routes_btk)
    else:
      m = self.mlp(h, kernels.fuse_gate_up)
    if self.cfg.gemma:
      m = self.post_mlp_norm(m)
    return x_btd + m, own
