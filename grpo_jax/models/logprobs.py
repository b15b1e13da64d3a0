"""Per-token log-probs of given tokens, without materializing [B, T, V] log-softmaxes.

With V = 151936 (Qwen3), a [B, T, V] float32 array is where training memory goes:
- `token_logprobs(logits, tokens)` computes logit[token] - logsumexp(logits) (one fused
  reduction over V, no second [B, T, V] array for log_softmax);
- `chunked_token_logprobs(hidden, unembedding, tokens)` never holds more than one chunk of
  logits: it scans over sequence chunks, projecting [B, c, D] hidden states to [B, c, V]
  logits, and recomputes each chunk in the backward pass (jax.checkpoint), so activation memory
  is O(B * c * V) instead of O(B * T * V). With `remat=False` (the model's
  `remat_policy="none"`: keep every activation) the chunks' logits are kept for the backward
  instead: one [B, c, D] x [D, V] product fewer per chunk (a quarter of the LM head's
  training FLOPs), at O(B * T * V) activation memory.
Temperature divides the logits first (the distribution the sampler draws from, before top-k /
top-p truncation).
"""

import jax
import jax.numpy as jnp

from grpo_jax.parallel import sharding


def token_logprobs(
    logits_btv: jax.Array, tokens_bt: jax.Array, temperature: float = 1.0
) -> jax.Array:
  """log softmax(logits / temperature)[token] in float32. [B, T, V], [B, T] -> [B, T]."""
  logits = logits_btv.astype(jnp.float32)
  if temperature != 1.0:
    logits = logits / temperature
  picked = jnp.take_along_axis(logits, tokens_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def token_entropy(logits_btv: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Entropy of softmax(logits / temperature) per position, float32 [B, T]."""
  logits = logits_btv.astype(jnp.float32) / temperature
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -(jnp.exp(logp) * logp).sum(-1)


@jax.custom_vjp
def head_logits(h_bcd: jax.Array, w_dv: jax.Array) -> jax.Array:
  """float32 logits h @ w [B, c, V] of compute-dtype hidden states and head, whose backward
  products run in the compute dtype too: the [B, c, V] float32 cotangent is rounded to h's
  dtype once, so dh and dw are bf16 GEMMs accumulating in f32 (autodiff would promote h and w
  to float32 and run both as float32 GEMMs, TF32 on GPU: about half the bf16 rate). Same as
  autodiff when h is float32."""
  return jnp.einsum("bcd,dv->bcv", h_bcd, w_dv, preferred_element_type=jnp.float32)


def _head_fwd(h, w):
  return head_logits(h, w), (h, w)


def _head_bwd(res, g_bcv):
  h, w = res
  g = g_bcv.astype(h.dtype)
  dh = jnp.einsum("bcv,dv->bcd", g, w, preferred_element_type=jnp.float32)
  dw = jnp.einsum("bcd,bcv->dv", h, g, preferred_element_type=jnp.float32)
  return dh.astype(h.dtype), dw.astype(w.dtype)


head_logits.defvjp(_head_fwd, _head_bwd)


def chunked_token_logprobs(
    hidden_btd: jax.Array,
    unembedding_dv: jax.Array,
    tokens_bt: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 256,
    remat: bool = True,
    softcap: float = 0.0,
) -> jax.Array:
  """token_logprobs(hidden @ unembedding, tokens) one sequence chunk at a time. -> [B, T].

  remat: recompute each chunk's logits in the backward pass (memory O(B * c * V)); False
  keeps them (no second forward product; memory O(B * T * V)). softcap > 0: the logits are
  soft-capped first, cap * tanh(logits / cap) (Gemma 2)."""
  b, t, d = hidden_btd.shape
  c = min(chunk_size, t)
  pad = -t % c
  if pad:
    hidden_btd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0)))
    tokens_bt = jnp.pad(tokens_bt, ((0, 0), (0, pad)))
  n = (t + pad) // c

  def chunk(h_bcd, tok_bc):
    logits = head_logits(h_bcd, unembedding_dv)
    if softcap:
      logits = jnp.tanh(logits / softcap) * softcap
    return token_logprobs(logits, tok_bc, temperature)

  if remat:
    chunk = jax.checkpoint(chunk)
  if n == 1:  # one chunk (t <= chunk_size, no padding): no scan, a smaller program
    return chunk(hidden_btd, tokens_bt)
  h_nbcd = hidden_btd.reshape(b, n, c, d).swapaxes(0, 1)
  tok_nbc = tokens_bt.reshape(b, n, c).swapaxes(0, 1)
  _, out_nbc = jax.lax.scan(lambda carry, xs: (carry, chunk(*xs)), None, (h_nbcd, tok_nbc))
  return out_nbc.swapaxes(0, 1).reshape(b, n * c)[:, :t]


def completion_logprobs(
    model,
    input_ids_bs: jax.Array,
    attention_mask_bs: jax.Array,
    completion_len: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
    remat: bool | None = None,
) -> jax.Array:
  """Log-probs [B, C] of the last C (completion) tokens of each [prompt; completion] row.

  remat: recompute the LM head's logits in the backward pass; None follows the model's
  `remat_policy` ("none" keeps them, any other policy recomputes).

  This is the trainer-side forward of GRPO: the same positions (from the mask) and attention
  pattern as the sampler's prefill + decode. Logits at index j predict token j + 1.
  """
  h = model.hidden(input_ids_bs, attention_mask_bs)
  return _completion_head(model, h, input_ids_bs, completion_len, temperature, chunk_size, remat)


def completion_logprobs_routed(
    model,
    input_ids_bs: jax.Array,
    attention_mask_bs: jax.Array,
    routes_bslk: jax.Array,
    completion_len: int,
    temperature: float = 1.0,
    chunk_size: int = 256,
    remat: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
  """`completion_logprobs` of an MoE decoder with routing replay: routes [B, S, L_moe, k] (-1 =
  the token's own top-k) are the experts each MoE layer uses per token (Transformer.
  hidden_routed). -> (log-probs [B, C], own [B, S, L_moe, k] int32: the MoE layers' own top-k
  experts in this forward)."""
  h, own = model.hidden_routed(input_ids_bs, attention_mask_bs, routes_bslk)
  logp = _completion_head(model, h, input_ids_bs, completion_len, temperature, chunk_size, remat)
  return logp, own


def _completion_head(model, h_bsd, input_ids_bs, completion_len, temperature, chunk_size, remat):
  """The LM head's log-probs of the last C tokens from the hidden states before them."""
  s = input_ids_bs.shape[1]
  if remat is None:
    remat = model.cfg.remat_policy != "none"
  return chunked_token_logprobs(
      h_bsd[:, s - completion_len - 1 : s - 1],
      model.unembedding(),
      input_ids_bs[:, s - completion_len :],
      temperature,
      chunk_size,
      remat,
      getattr(model.cfg, "final_logit_softcap", 0.0),
  )


def packed_logprobs(
    model,
    input_ids_rl: jax.Array,
    segment_ids_rl: jax.Array,
    positions_rl: jax.Array,
    head_slots_hs: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 256,
    remat: bool | None = None,
    shards: int = 1,
) -> jax.Array:
  """Log-probs [R, L] of the tokens at `head_slots_hs` [H, W] of packed rows (rl/packing.py),
  each given the tokens before it in its sequence, 0 elsewhere. The rows and the head's rows
  split into `shards` blocks (the data-parallel shards: rl/packing.py packs each shard's
  sequences in its own rows): head row block d holds flat slots of row block d (R / shards * L
  pads), so the head's gather never crosses a shard. The LM head runs only there: the
  completion tokens (rl/packing.py: pack), not every slot of the rows (their prompt tokens and
  padding). A slot's token is predicted from the slot before it, so a slot must not be a
  sequence's first. remat: as `completion_logprobs`."""
  h = model.packed_hidden(input_ids_rl, segment_ids_rl, positions_rl)
  return _packed_head(model, h, input_ids_rl, head_slots_hs, temperature, chunk_size, remat, shards)


def packed_logprobs_routed(
    model,
    input_ids_rl: jax.Array,
    segment_ids_rl: jax.Array,
    positions_rl: jax.Array,
    head_slots_hs: jax.Array,
    routes_rllk: jax.Array,
    temperature: float = 1.0,
    chunk_size: int = 256,
    remat: bool | None = None,
    shards: int = 1,
) -> tuple[jax.Array, jax.Array]:
  """`packed_logprobs` of an MoE decoder with routing replay: routes [R, L, L_moe, k] (-1 = the
  token's own top-k), slot for slot with the packed tokens (Transformer.packed_hidden_routed).
  -> (log-probs [R, L], own [R, L, L_moe, k] int32: the MoE layers' own top-k)."""
  h, own = model.packed_hidden_routed(input_ids_rl, segment_ids_rl, positions_rl, routes_rllk)
  logp = _packed_head(model, h, input_ids_rl, head_slots_hs, temperature, chunk_size, remat, shards)
  return logp, own


def _packed_head(model, h_rld, input_ids_rl, head_slots_hs, temperature, chunk_size, remat, shards):
  """The LM head's log-probs [R, L] of the tokens at head_slots from the slots before them,
  gathered and scattered per shard (a vmap over a leading [shards] axis, which XLA partitions
  along it: no hidden state moves between devices)."""
  if remat is None:
    remat = model.cfg.remat_policy != "none"
  r, l = input_ids_rl.shape
  size = r // shards * l  # slots per shard
  slot_kx = head_slots_hs.reshape(shards, -1)  # [shards, H / shards * W]: a shard's positions
  slot = jnp.minimum(slot_kx, size - 1)
  take = jax.vmap(lambda x, i: x[i])
  hidden = take(_blocks(h_rld, shards, size), jnp.maximum(slot - 1, 0))  # the slot before's
  # Chunks of the positions per shard as many as the rows of L slots they fill hold at
  # `chunk_size` per row: the logits' memory of a head over whole rows of L, fewer rows.
  per_shard = slot_kx.shape[1]
  logp = chunked_token_logprobs(
      hidden,  # [shards, positions, D]
      model.unembedding(),
      take(_blocks(input_ids_rl, shards, size), slot),
      temperature,
      chunk_size * max(1, per_shard // l),
      remat,
      getattr(model.cfg, "final_logit_softcap", 0.0),
  )
  flat = jax.vmap(lambda i, v: jnp.zeros((size,), jnp.float32).at[i].set(v, mode="drop"))(
      slot_kx, logp
  )
  return _rows(flat, r, l)


def head_slot_mask(head_slots_hs: jax.Array, r: int, l: int, shards: int = 1) -> jax.Array:
  """[R, L] f32: 1 at the slots `head_slots` names (as `_packed_head` reads them: flat slots
  within each shard's rows; a shard's slot count pads), else 0. For a policy that computes
  every slot's log-prob (the MaxText policy) and keeps the head's."""
  size = r // shards * l
  slot_kx = head_slots_hs.reshape(shards, -1)
  flat = jax.vmap(lambda i: jnp.zeros((size,), jnp.float32).at[i].set(1.0, mode="drop"))(slot_kx)
  return _rows(flat, r, l)


def _blocks(x, shards: int, size: int):
  """[R, L, ...] rows -> [shards, R / shards * L, ...]: each shard's slots, flat."""
  x = x.reshape(shards, size, *x.shape[2:])
  return sharding.constrain(x, "batch", *[None] * (x.ndim - 1))


def _rows(x, r: int, l: int):
  """[shards, ..., ...] -> [R, L, ...] rows (the inverse of `_blocks`)."""
  x = x.reshape(r, l, *x.shape[2:])
  return sharding.constrain(x, "batch", *[None] * (x.ndim - 1))
