"""T5 v1.1 / flan-t5 encoder-decoder in Flax NNX: training forward, encoder, cached decoding.

    model = T5(T5Config(...), rngs=nnx.Rngs(0))        # or t5_hf.load_t5_hf(path)
    # T5Config: models/t5/config.py
    logits_btv = model(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)

Numerics follow transformers' modeling_t5.py (tests/models/test_t5.py checks 1e-5 in f32):
- no 1/sqrt(K) scaling of q.k (T5 folds it into the q initialization); instead a learned
  relative position bias [buckets, H], held by the first layer of each stack and added to the
  self-attention logits of every layer of that stack (none in cross-attention);
- pre-norm blocks with the T5 RMS norm (no bias, no mean subtraction, f32 math:
  layers.RMSNorm), and a final norm after each stack;
- gated-GELU MLP with the tanh GELU ("gelu_new") for T5 v1.1, or ReLU for the original T5;
- LM head: the shared embedding (tied) or its own matrix; HF multiplies the decoder output by
  d_model**-0.5 first when `scale_decoder_outputs` (set for the tied original T5, not for v1.1).
Position buckets come from NumPy float32 at trace time (the shapes are static): XLA's log
differs from torch's by an ulp at some bucket edges, which would move a distance to the
neighbouring bucket.

Generation (rollout/seq2seq_sampler.py): `encode` once per prompt; `init_cache` projects the
cross-attention keys/values once; `decode` runs T >= 1 new decoder tokens per row against the
self-attention KV cache (prefill: the start token; a step: T = 1). The decoder may have
N = B * G rows (group-major) over B encoder rows: each group of G rows attends to its prompt's
encoder keys/values, which are never copied G times (the same holds in the training forward).
"""

import math

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import layers
from grpo_jax.models import remat as remat_lib
from grpo_jax.models.decoder.layers import RMSNorm
from grpo_jax.models.logprobs import chunked_token_logprobs
from grpo_jax.models.t5.config import ACTIVATIONS
from grpo_jax.models.t5.config import T5Config

# ------------------------------------------------------------------ relative position buckets


def relative_position_bucket(
    rel: np.ndarray, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
  """HF's _relative_position_bucket in NumPy float32 (rel = key - query position): exact
  buckets for small distances, log-spaced ones up to max_distance, then the last bucket."""
  rel = np.asarray(rel, np.int64)
  out = np.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    out = out + (rel > 0) * num_buckets
    rel = np.abs(rel)
  else:
    rel = -np.minimum(rel, 0)
  max_exact = num_buckets // 2
  with np.errstate(divide="ignore", invalid="ignore"):
    large = max_exact + (
        np.log(rel.astype(np.float32) / np.float32(max_exact))
        / np.float32(math.log(max_distance / max_exact))
        * np.float32(num_buckets - max_exact)
    ).astype(np.int64)
  large = np.minimum(large, num_buckets - 1)
  return out + np.where(rel < max_exact, rel, large)


def encoder_buckets(cfg: T5Config, length: int) -> np.ndarray:
  """Bidirectional buckets [P, P] of the encoder's self-attention (array index = position)."""
  pos = np.arange(length)
  return relative_position_bucket(
      pos[None, :] - pos[:, None],
      True,
      cfg.relative_attention_num_buckets,
      cfg.relative_attention_max_distance,
  )


def decoder_buckets(cfg: T5Config, q_slot_t: jax.Array, length: int) -> jax.Array:
  """Causal buckets [T, S] for queries at (possibly traced) slots q_slot_t over key slots
  0..S-1: a lookup into a static NumPy table by distance (future keys are masked anyway)."""
  table = relative_position_bucket(
      -np.arange(length),
      False,
      cfg.relative_attention_num_buckets,
      cfg.relative_attention_max_distance,
  )
  dist = jnp.clip(q_slot_t[:, None] - jnp.arange(length)[None, :], 0, length - 1)
  return jnp.asarray(table, jnp.int32)[dist]


# ---------------------------------------------------------------------------------- layers


def _param(rngs, shape, axes, dtype, *, fan_in: int):
  """layers._param (normal, std fan_in**-0.5) drawn as one flat vector and reshaped: the same
  i.i.d. init, but XLA:CPU compiles a 1-D threefry draw several times faster than a 3-D one
  (a tiny T5's sharded init: ~9 s -> ~3 s of compile on 2 cores)."""
  flat = layers._param(rngs, (math.prod(shape),), (None,), dtype, fan_in=fan_in)
  return nnx.Param(flat[...].reshape(shape), logical_axes=axes)


def t5_attention(q_bthk, k_bhsk, v_bhsk, allowed_bts, bias_hts=None):
  """softmax(q.k + bias) v over the keys where `allowed`, softmax in f32, no 1/sqrt(K).

  q [B, T, H, K]; k, v head-major [B, H, S, K]; allowed [B or 1, T, S] bool; bias [H, T, S].
  Fully masked rows (padding) get a uniform softmax, never NaN. -> [B, T, H, K]"""
  logits = jnp.einsum("bthk,bhsk->bhts", q_bthk, k_bhsk, preferred_element_type=jnp.float32)
  if bias_hts is not None:
    logits = logits + bias_hts.astype(jnp.float32)
  logits = jnp.where(allowed_bts[:, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_bhsk.dtype)
  return jnp.einsum("bhts,bhsk->bthk", probs, v_bhsk)


def cross_attention(q_nthk, k_bhpk, v_bhpk, enc_valid_bp):
  """Decoder rows N = B * G (group-major) over B encoder rows: each group's G * T queries
  attend together to their prompt's keys, so the encoder side is never repeated."""
  n, t, h, kd = q_nthk.shape
  b, p = enc_valid_bp.shape
  q = q_nthk.reshape(b, (n // b) * t, h, kd)
  allowed = (enc_valid_bp != 0)[:, None, :]  # [B, 1, P]
  return t5_attention(q, k_bhpk, v_bhpk, allowed).reshape(n, t, h, kd)


class T5Attention(nnx.Module):
  """q, k, v [D, H, K] (embed, heads, head_dim); o [H, K, D]. Init as HF: q std (D*K)**-0.5."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    d, h, k = cfg.d_model, cfg.num_heads, cfg.d_kv
    self.q = _param(rngs, (d, h, k), ("embed", "q_heads", "head_dim"), pd, fan_in=d * k)
    self.k = _param(rngs, (d, h, k), ("embed", "kv_heads", "head_dim"), pd, fan_in=d)
    self.v = _param(rngs, (d, h, k), ("embed", "kv_heads", "head_dim"), pd, fan_in=d)
    self.o = _param(rngs, (h, k, d), ("q_heads", "head_dim", "embed"), pd, fan_in=h * k)

  @staticmethod
  def project(x_btd, w_dhk):
    """x [B, T, D] @ w [D, H, K] -> [B, T, H, K], as one 2-D GEMM."""
    b, t, d = x_btd.shape
    _, h, k = w_dhk.shape
    w = w_dhk[...].astype(x_btd.dtype).reshape(d, h * k)
    return checkpoint_name((x_btd.reshape(b * t, d) @ w).reshape(b, t, h, k), "qkv_proj")

  def kv(self, x_bsd):
    """Head-major keys and values [B, H, S, K]."""
    return (self.project(x_bsd, self.k).swapaxes(1, 2), self.project(x_bsd, self.v).swapaxes(1, 2))

  def out(self, a_bthk):
    b, t, h, k = a_bthk.shape
    w = self.o[...].astype(a_bthk.dtype).reshape(h * k, -1)
    return checkpoint_name((a_bthk.reshape(b * t, h * k) @ w).reshape(b, t, -1), "attn_out")


class T5MLP(nnx.Module):
  """Gated: wo(act(wi_0 x) * wi_1 x); plain: wo(act(wi x)). wi* [D, F], wo [F, D]."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    d, f = cfg.d_model, cfg.d_ff
    self.act = cfg.activation
    if cfg.gated:
      self.wi_0 = _param(rngs, (d, f), ("embed", "mlp"), pd, fan_in=d)
      self.wi_1 = _param(rngs, (d, f), ("embed", "mlp"), pd, fan_in=d)
    else:
      self.wi = _param(rngs, (d, f), ("embed", "mlp"), pd, fan_in=d)
    self.wo = _param(rngs, (f, d), ("mlp", "embed"), pd, fan_in=f)

  def __call__(self, x_btd):
    dt = x_btd.dtype
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)
    act = ACTIVATIONS[self.act]
    if hasattr(self, "wi_0"):
      h = act(x @ self.wi_0[...].astype(dt)) * (x @ self.wi_1[...].astype(dt))
    else:
      h = act(x @ self.wi[...].astype(dt))
    h = checkpoint_name(h, "mlp_hidden")
    return checkpoint_name((h @ self.wo[...].astype(dt)).reshape(b, t, d), "mlp_out")


def _norm(cfg: T5Config, rngs):
  return RMSNorm(
      cfg.d_model, cfg.layer_norm_epsilon, param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs
  )


class EncoderBlock(nnx.Module):

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
    self.attn_norm, self.attn = _norm(cfg, rngs), T5Attention(cfg, rngs=rngs)
    self.mlp_norm, self.mlp = _norm(cfg, rngs), T5MLP(cfg, rngs=rngs)

  def __call__(self, x_bpd, bias_hpp, allowed_bpp):
    h = self.attn_norm(x_bpd)
    k, v = self.attn.kv(h)
    x_bpd = x_bpd + self.attn.out(
        t5_attention(self.attn.project(h, self.attn.q), k, v, allowed_bpp, bias_hpp)
    )
    return x_bpd + self.mlp(self.mlp_norm(x_bpd))


class DecoderBlock(nnx.Module):

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
    self.self_norm, self.self_attn = _norm(cfg, rngs), T5Attention(cfg, rngs=rngs)
    self.cross_norm, self.cross_attn = _norm(cfg, rngs), T5Attention(cfg, rngs=rngs)
    self.mlp_norm, self.mlp = _norm(cfg, rngs), T5MLP(cfg, rngs=rngs)

  def __call__(self, x_ntd, bias_hts, allowed_nts, enc_valid_bp, cross, self_kv=None, slot=0):
    """`cross`: the encoder output [B, P, D] (projected here) or its (k, v) [B, H, P, K].
    Without `self_kv`, attends within x (training forward). With the cache's (k, v)
    [N, H, S, K], writes this call's keys/values at `slot` first and attends over the cache.
    -> (x, self k, self v), the latter the updated cache (or this call's [N, H, T, K])."""
    h = self.self_norm(x_ntd)
    k, v = self.self_attn.kv(h)
    if self_kv is not None:
      k = jax.lax.dynamic_update_slice(self_kv[0], k.astype(self_kv[0].dtype), (0, 0, slot, 0))
      v = jax.lax.dynamic_update_slice(self_kv[1], v.astype(self_kv[1].dtype), (0, 0, slot, 0))
    q = self.self_attn.project(h, self.self_attn.q)
    x_ntd = x_ntd + self.self_attn.out(t5_attention(q, k, v, allowed_nts, bias_hts))
    ck, cv = cross if isinstance(cross, tuple) else self.cross_attn.kv(cross)
    q = self.cross_attn.project(self.cross_norm(x_ntd), self.cross_attn.q)
    x_ntd = x_ntd + self.cross_attn.out(cross_attention(q, ck, cv, enc_valid_bp))
    return x_ntd + self.mlp(self.mlp_norm(x_ntd)), k, v


class Stack(nnx.Module):
  """One side of the model: its relative-position bias table [buckets, H], layers, final norm."""

  def __init__(self, cfg: T5Config, num_layers: int, block, *, rngs: nnx.Rngs):
    self.rel_bias = _param(
        rngs,
        (cfg.relative_attention_num_buckets, cfg.num_heads),
        (None, "q_heads"),
        jnp.dtype(cfg.param_dtype),
        fan_in=cfg.d_model,
    )
    self.layers = nnx.List([block(cfg, rngs=rngs) for _ in range(num_layers)])
    self.final_norm = _norm(cfg, rngs)

  def bias(self, buckets_ts) -> jax.Array:
    """Position bias [H, T, S] for bucket ids [T, S]."""
    return jnp.take(self.rel_bias[...], buckets_ts, axis=0).transpose(2, 0, 1)


# ----------------------------------------------------------------------------------- model


class T5(nnx.Module):
  """T5ForConditionalGeneration. `T5(cfg, rngs=nnx.Rngs(0))`; `build_t5` for sharded init."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    pd = jnp.dtype(cfg.param_dtype)
    d, v = cfg.d_model, cfg.vocab_size
    self.shared = _param(rngs, (v, d), ("vocab", "embed"), pd, fan_in=1)  # std 1, as HF
    self.encoder = Stack(cfg, cfg.num_layers, EncoderBlock, rngs=rngs)
    self.decoder = Stack(cfg, cfg.num_decoder_layers, DecoderBlock, rngs=rngs)
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), pd, fan_in=d)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.cfg.dtype)

  def _embed(self, tokens_bt):
    x = jnp.take(self.shared[...], tokens_bt, axis=0).astype(self.compute_dtype)
    return sharding.constrain(x, "batch", "length", "act_embed")

  def _layer(self, blk, *args):
    """blk(*args) under jax.checkpoint with the configured remat policy."""
    graphdef, state = nnx.split(blk)

    def layer(state, *args):
      return nnx.merge(graphdef, state)(*args)

    policy = remat_lib.policy(self.cfg.remat_policy)
    if policy is not None:
      layer = jax.checkpoint(layer, policy=policy, prevent_cse=True)
    return layer(state, *args)

  def head_input(self, h_btd):
    """The decoder output as the LM head sees it (HF's d_model**-0.5 scaling when set)."""
    return h_btd * self.cfg.d_model**-0.5 if self.cfg.scale_decoder_outputs else h_btd

  def unembedding(self) -> jax.Array:
    """The output projection [D, V] in the compute dtype."""
    w = self.shared[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
    return w.astype(self.compute_dtype)

  def logits_from_hidden(self, h_btd) -> jax.Array:
    return jnp.einsum(
        "btd,dv->btv",
        self.head_input(h_btd),
        self.unembedding(),
        preferred_element_type=jnp.float32,
    )

  # ------------------------------------------------------------------------ training mode

  def encode(self, input_ids, attention_mask=None) -> jax.Array:
    """Final-norm encoder states [B, P, D] of a padded batch (pads are never attended to)."""
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    with jax.named_scope("t5_encoder"):
      bias = self.encoder.bias(jnp.asarray(encoder_buckets(self.cfg, input_ids.shape[1])))
      allowed = (attention_mask != 0)[:, None, :]  # [B, 1, P]
      x = self._embed(input_ids)
      for blk in self.encoder.layers:
        x = sharding.constrain(self._layer(blk, x, bias, allowed), "batch", "length", "act_embed")
      return self.encoder.final_norm(x)

  def decoder_hidden(
      self, decoder_input_ids, decoder_attention_mask, enc_bpd, enc_mask_bp
  ) -> jax.Array:
    """Final-norm decoder states [N, T, D] by teacher forcing (causal; padded decoder keys are
    never attended to). N may be G times the encoder's B rows (group-major)."""
    t = decoder_input_ids.shape[1]
    if decoder_attention_mask is None:
      decoder_attention_mask = jnp.ones_like(decoder_input_ids)
    slots = jnp.arange(t)
    allowed = (slots[None, :] <= slots[:, None])[None] & (decoder_attention_mask != 0)[:, None]
    bias = self.decoder.bias(decoder_buckets(self.cfg, slots, t))
    x = self._embed(decoder_input_ids)
    for blk in self.decoder.layers:
      x, _, _ = self._layer(blk, x, bias, allowed, enc_mask_bp, enc_bpd)
      x = sharding.constrain(x, "batch", "length", "act_embed")
    return self.decoder.final_norm(x)

  def __call__(
      self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask=None
  ) -> jax.Array:
    """Logits [N, T, V] (float32) of the next decoder token at every decoder position."""
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids)
    enc = self.encode(input_ids, attention_mask)
    return self.logits_from_hidden(
        self.decoder_hidden(decoder_input_ids, decoder_attention_mask, enc, attention_mask)
    )

  # --------------------------------------------------------------------- generation modes

  def init_cache(self, enc_bpd, enc_mask_bp, max_len: int, dtype=None) -> dict:
    """A decoding cache for the B encoder rows, cross-attention keys/values projected here,
    once (tuples of L arrays, head-major):

    self_k, self_v    [B, H, S, K]  decoder self-attention keys/values by slot (zeros)
    cross_k, cross_v  [B, H, P, K]  from the encoder output (never grow with G)
    enc_valid         [B, P]        the encoder mask
    index             int32 scalar  the next slot to write (the same for every row)
    `repeat_self_cache` widens the self part to B * G rows after the start token."""
    dtype = dtype or self.compute_dtype
    b = enc_bpd.shape[0]
    shape = (b, self.cfg.num_heads, max_len, self.cfg.d_kv)
    with jax.named_scope("t5_cross_kv"):
      cross = [blk.cross_attn.kv(enc_bpd.astype(self.compute_dtype)) for blk in self.decoder.layers]
    zeros = tuple(jnp.zeros(shape, dtype) for _ in self.decoder.layers)
    return dict(
        self_k=zeros,
        self_v=zeros,
        cross_k=tuple(k.astype(dtype) for k, _ in cross),
        cross_v=tuple(v.astype(dtype) for _, v in cross),
        enc_valid=enc_mask_bp.astype(jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )

  def decode(self, tokens_nt, cache: dict):
    """T new decoder tokens per row at slots index .. index+T-1 (prefill: the start token or
    a decoder prefix; a step: T = 1). -> (logits [N, T, V] float32, cache)."""
    t = tokens_nt.shape[1]
    index = cache["index"]
    s = cache["self_k"][0].shape[2]
    q_slot = index + jnp.arange(t)
    allowed = (jnp.arange(s)[None, :] <= q_slot[:, None])[None]  # [1, T, S]
    bias = self.decoder.bias(decoder_buckets(self.cfg, q_slot, s))
    x = self._embed(tokens_nt)
    ks, vs = [], []
    for i, blk in enumerate(self.decoder.layers):
      x, k, v = self._layer(
          blk,
          x,
          bias,
          allowed,
          cache["enc_valid"],
          (cache["cross_k"][i], cache["cross_v"][i]),
          (cache["self_k"][i], cache["self_v"][i]),
          index,
      )
      x = sharding.constrain(x, "batch", "length", "act_embed")
      ks.append(k)
      vs.append(v)
    logits = self.logits_from_hidden(self.decoder.final_norm(x))
    return logits, dict(cache, self_k=tuple(ks), self_v=tuple(vs), index=index + t)


def repeat_self_cache(cache: dict, g: int) -> dict:
  """The decoder self-attention cache repeated G times along rows, group-major (row i ->
  rows i*G .. i*G+G-1); the cross-attention part stays at B rows, shared by each group."""
  rep = lambda x: jnp.repeat(x, g, axis=0)  # noqa: E731
  return dict(
      cache, self_k=tuple(map(rep, cache["self_k"])), self_v=tuple(map(rep, cache["self_v"]))
  )


def shift_right(targets_nc, start_id: int):
  """Decoder inputs for teacher forcing: [start, targets[:, :-1]]."""
  start = jnp.full((targets_nc.shape[0], 1), start_id, targets_nc.dtype)
  return jnp.concatenate([start, targets_nc[:, :-1]], axis=1)


def t5_logprobs(
    model: T5,
    input_ids_bp,
    attention_mask_bp,
    targets_nc,
    targets_mask_nc,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> jax.Array:
  """Per-token log-probs [N, C] (f32, 0 where the mask is 0) of decoder targets given the
  encoder input: log softmax(logits / temperature)[target], teacher-forced after the decoder
  start token. The trainer-side twin of the seq2seq sampler (same attention, same buckets).

  input_ids / attention_mask [B, P]; targets / mask [N, C] with N = B or N = B * G (rows
  grouped by prompt): then the encoder runs once per prompt, not once per sample."""
  cfg = model.cfg
  enc = model.encode(input_ids_bp, attention_mask_bp)
  dec_in = shift_right(targets_nc, cfg.decoder_start_token_id)
  dec_mask = shift_right(targets_mask_nc, 1)
  h = model.decoder_hidden(dec_in, dec_mask, enc, attention_mask_bp)
  logp = chunked_token_logprobs(
      model.head_input(h),
      model.unembedding(),
      targets_nc,
      temperature,
      chunk_size,
      remat=cfg.remat_policy != "none",
  )
  return jnp.where(targets_mask_nc != 0, logp, 0.0)


def build_t5(cfg: T5Config, *, seed: int = 0, mesh=None) -> T5:
  """A randomly initialized T5, created directly sharded over `mesh` when given."""
  if mesh is None:
    return T5(cfg, rngs=nnx.Rngs(params=seed))
  abstract = nnx.eval_shape(lambda: T5(cfg, rngs=nnx.Rngs(params=seed)))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = sharding.state_shardings(abstract_state, mesh)
  state = jax.jit(lambda: nnx.state(T5(cfg, rngs=nnx.Rngs(params=seed))), out_shardings=shardings)()
  return nnx.merge(graphdef, state)
