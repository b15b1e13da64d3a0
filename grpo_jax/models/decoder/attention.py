"""Attention for the decoder, by mode and kernel: `attention` (grouped-query, an explicit mask:
the training forward's masked form), `cache_attention` (the decode step: the group's shared
prompt and the row's cache), `causal_attention` (one fused kernel over real tokens: cuDNN on
GPU, `splash_attention` on TPU, its XLA form on CPU), `segment_attention` (one fused kernel
over packed rows, several sequences per row: `triton_attention` on GPU, `splash_attention`
with segment ids on TPU, the masked form on CPU), and the masks (`slot_mask`, `prefix_mask`,
`segment_mask`): queries at absolute slots attend to keys at slots <= theirs (causal) that hold
real tokens (padding is never attended), within a sliding window where the layer has one.

Which one runs is decided by `Block` (layers.py) from the model's `Kernels` (kernels.py); the
GPU ragged decode kernel is decode_attention.py. Softmax in f32 everywhere.
"""

import jax
import jax.numpy as jnp

from grpo_jax.models.decoder import splash_segments
from grpo_jax.parallel import sharding


def _capped(logits, softcap: float):
  """softcap > 0: scores -> softcap * tanh(scores / softcap) (Gemma 2); else as they are."""
  return jnp.tanh(logits / softcap) * softcap if softcap else logits


def slot_mask(q_slot_bt, kv_slot_s, kv_valid_bs, window=None) -> jax.Array:
  """[B, T, S]: which keys each query attends to, by slot: a real key (`kv_valid` nonzero) at
  a slot <= the query's (causal) and, with a `window` (an int or a traced one), fewer than
  `window` slots before it. q_slot [B, T] absolute slots; kv_slot [S] the slot each key holds
  (0..S-1, or a ring's: `Block.decode`)."""
  allowed = (kv_valid_bs[:, None, :] != 0) & (kv_slot_s[None, None, :] <= q_slot_bt[:, :, None])
  if window is not None:
    allowed &= q_slot_bt[:, :, None] - kv_slot_s[None, None, :] < window
  return allowed


def prefix_mask(p_valid_bp, q_pos_bt, window=None) -> jax.Array:
  """[B/G, G, T, P] (or broadcastable to it): which keys of its group's shared prompt each of
  the B = (B/G) * G queries' rows attends to: the prompt's real tokens, and with a `window`
  those fewer than `window` positions before the query's (q_pos [B, T]; the prompt's keys are
  at their positions within the left-padded prompt)."""
  bp = p_valid_bp.shape[0]
  allowed = (p_valid_bp != 0)[:, None, None, :]
  if window is not None:
    p_pos = jnp.cumsum(p_valid_bp != 0, axis=-1) - 1  # [B/G, P]
    b, t = q_pos_bt.shape
    dist = q_pos_bt.reshape(bp, b // bp, t)[..., None] - p_pos[:, None, None, :]
    allowed = allowed & (dist < window)
  return allowed


def segment_mask(segments_bt, window=None) -> jax.Array:
  """[B, T, T]: a packed row's self-attention mask by slot: a query attends to the earlier
  slots (causal) of its own sequence, never to padding (segment 0), and with a `window` to
  fewer than `window` slots before it. segments [B, T] (0 = padding, else the sequence's id,
  unique in its row; each sequence a contiguous run of slots, so slot distance within a
  sequence is position distance and the window counts positions of the sequence)."""
  b, t = segments_bt.shape
  slots = jnp.arange(t)
  allowed = slot_mask(jnp.broadcast_to(slots, (b, t)), slots, segments_bt, window)
  return allowed & (segments_bt[:, :, None] == segments_bt[:, None, :])


def attention(q_bthk, k_bsgk, v_bsgk, allowed_bts, *, softcap: float = 0.0):
  """Grouped-query attention under an explicit mask; softmax in f32.

  q [B, T, H, K]; k, v [B, S, Hkv, K] (H a multiple of Hkv); allowed [B, T, S] (`slot_mask`).
  Fully masked query rows (padding) get a uniform softmax, never NaN. -> [B, T, H, K]."""
  b, t, h, kd = q_bthk.shape
  g = k_bsgk.shape[2]
  q = q_bthk.reshape(b, t, g, h // g, kd)
  logits = _capped(
      jnp.einsum("btgrk,bsgk->bgrts", q, k_bsgk, preferred_element_type=jnp.float32) * kd**-0.5,
      softcap,
  )
  logits = jnp.where(allowed_bts[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_bsgk.dtype)  # [B, G, R, T, S]
  out = jnp.einsum("bgrts,bsgk->bgrtk", probs, v_bsgk)
  # Batch dims first in the product's output, then a transpose of the (small) result: XLA:CPU
  # runs "bgrts,bgsk->btgrk" ~17x slower than "->bgrtk" at decode shapes.
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, kd)


def cache_attention(
    q_bthk, k_bgsk, v_bgsk, allowed_bts, prefix, prefix_allowed, *, softcap: float = 0.0
):
  """The decode step's attention: each query attends to its group's shared prompt and to its
  row's cache; softmax in f32 over both.

  q [B, T, H, K]; k, v the head-major cache [B, Hkv, S, K] (batch and head lead, so the batched
  products read the cache as it lies, with no per-step transpose of the whole cache); allowed
  [B, T, S] (`slot_mask`). prefix = (pk, pv, p_valid): the shared prompts' keys and values,
  head-major [B/G, Hkv, P, K], and their validity [B/G, P], one prompt per group of G = B / (B/G)
  consecutive rows, read once per group (P may be 0: no prompt); prefix_allowed [B/G, G, T, P]
  or broadcastable (`prefix_mask`). -> [B, T, H, K]."""
  b, t, h, kd = q_bthk.shape
  g = k_bgsk.shape[1]
  pk, pv, _ = prefix
  bp, n_prefix = pk.shape[0], pk.shape[2]
  neg = jnp.finfo(jnp.float32).min
  scale = kd**-0.5
  q = q_bthk.reshape(b, t, g, h // g, kd)
  logits = _capped(
      jnp.einsum("btgrk,bgsk->bgrts", q, k_bgsk, preferred_element_type=jnp.float32) * scale,
      softcap,
  )
  logits = jnp.where(allowed_bts[:, None, None], logits, neg)  # [B, G, R, T, S]
  # The G samples of a prompt are one product against its keys: [G*R*T, K] x [K, P].
  qp = q.reshape(bp, b // bp, t, g, h // g, kd)
  lp = _capped(
      jnp.einsum("bntgrk,bgpk->bgnrtp", qp, pk, preferred_element_type=jnp.float32) * scale, softcap
  )
  lp = jnp.where(prefix_allowed[:, None, :, None], lp, neg)
  lp = lp.transpose(0, 2, 1, 3, 4, 5).reshape(b, g, h // g, t, n_prefix)
  logits = jnp.concatenate([lp, logits], axis=-1)  # [B, G, R, T, P+S]
  probs = jax.nn.softmax(logits, axis=-1).astype(v_bgsk.dtype)
  out = jnp.einsum("bgrts,bgsk->bgrtk", probs[..., n_prefix:], v_bgsk)
  pp = probs[..., :n_prefix].reshape(bp, b // bp, g, h // g, t, n_prefix)
  op = jnp.einsum("bngrtp,bgpk->bgnrtk", pp, pv)
  out = out + op.transpose(0, 2, 1, 3, 4, 5).reshape(b, g, h // g, t, kd)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, kd)


def causal_attention(
    q_bthk, k_btgk, v_btgk, *, platform: str, window: int | None = None, softcap: float = 0.0
):
  """Causal self-attention over T slots that all hold real tokens (the callers move padding
  behind the real tokens first: transformer.compaction), as one fused kernel: no [.., T, T]
  score matrix in HBM. `platform` (Kernels.platform) picks it: GPU: cuDNN's flash attention
  (jax.nn.dot_product_attention); TPU: `splash_attention`; CPU: its XLA form (same values;
  what the CPU tests check the layout against).
  q [B, T, H, K], k, v [B, T, Hkv, K] (grouped-query: H a multiple of Hkv) -> [B, T, H, K].
  `window` (a static int): each query attends to its last `window` keys only (a local layer);
  `softcap`: soft-capped scores (splash attention on TPU; elsewhere the masked form)."""
  if platform == "tpu":
    return splash_attention(q_bthk, k_btgk, v_btgk, window=window, softcap=softcap)
  if softcap:  # no fused kernel caps scores here: the masked form over the real tokens
    b, t = q_bthk.shape[:2]
    slots = jnp.arange(t)
    allowed = slot_mask(jnp.broadcast_to(slots, (b, t)), slots, jnp.ones((b, t), jnp.int32), window)
    return attention(q_bthk, k_btgk, v_btgk, allowed, softcap=softcap)
  gpu = platform == "gpu" and q_bthk.dtype in (jnp.bfloat16, jnp.float16)
  return jax.nn.dot_product_attention(
      q_bthk,
      k_btgk,
      v_btgk,
      is_causal=True,
      local_window_size=None if window is None else (window - 1, 0),
      implementation="cudnn" if gpu else "xla",
  )


def segment_attention(
    q_bthk,
    k_btgk,
    v_btgk,
    segments_bt,
    *,
    platform: str,
    window: int | None = None,
    softcap: float = 0.0,
    interpret: bool = False
):
  """Self-attention over packed rows (rl/packing.py: several sequences per row) as one fused
  kernel: a token attends to the earlier tokens of its own sequence only (`segment_mask`'s
  values, with no [.., T, T] score matrix in HBM). segments [B, T] int: 0 = padding (at the
  row's end), else the sequence's id, unique in its row, each sequence a contiguous run of
  slots (so causal in slots is causal in positions, and a `window` of slots is one of positions
  within the sequence). `platform` (Kernels.platform) picks the kernel:
    TPU: `splash_attention` with segment ids (windows and soft-caps in the kernel).
    GPU: `triton_attention` (segment_flash.py's Pallas Triton flash attention, skipping the kv
      blocks of other sequences) for bf16/f16
      and a layer without window or soft-cap; such a layer (and f32) takes the masked form, as
      the padded rows' f32 and soft-capped layers do (`causal_attention`).
    CPU: the masked form (`segment_mask` + `attention`), what the tests check the kernels
      against.
  q [B, T, H, K], k, v [B, T, Hkv, K] -> [B, T, H, K]. `interpret`: the Pallas kernels in
  Pallas's interpreter (the CPU tests)."""
  if platform == "tpu":
    return splash_attention(
        q_bthk,
        k_btgk,
        v_btgk,
        window=window,
        softcap=softcap,
        segment_ids=segments_bt,
        interpret=interpret,
    )
  kernel = (
      platform == "gpu"
      and window is None
      and not softcap
      and q_bthk.dtype in (jnp.bfloat16, jnp.float16)
  )
  if kernel:
    return triton_attention(q_bthk, k_btgk, v_btgk, segments_bt, interpret=interpret)
  allowed = segment_mask(segments_bt, window)
  return attention(q_bthk, k_btgk, v_btgk, allowed, softcap=softcap)


def triton_attention(q_bthk, k_btgk, v_btgk, segments_bt, *, interpret: bool = False):
  """`segment_attention` on GPU: this repo's Pallas Triton flash attention for packed rows
  (segment_flash.py: causal and segment masks in the kernel, forward and backward kernels of
  its own, each q block visiting only the kv blocks from its first sequence's start to the
  diagonal, so blocks wholly of other sequences cost nothing), one call over all rows, under a
  shard_map that keeps rows on (data, fsdp) and heads on tensor when a mesh is set. Grouped kv
  heads are read in place (query head h reads kv head h // (H / Hkv)); where the tensor axis
  does not divide the kv heads they are repeated to the query heads first (the gradients summed
  back by autodiff). The kernel pads T to its block with segment id 0 (the rows' own padding's:
  a real query never attends it) and head_dim to a power of two.

  Why this kernel and not cuDNN's packed layout (jax._src.cudnn.fused_attention_stablehlo's
  q_seqlen / q_offsets): cuDNN checks for Hopper on the *runtime* backend, so it cannot be traced
  for a GPU from a CPU host (memory_plan's and the AOT tests' deviceless H100 compile); the Triton
  kernel traces and compiles there (tests/plan/test_compiled_programs.py), and runs in Pallas's
  interpreter on CPU, so its values and gradients are tested against the masked form
  (tests/models/test_segment_flash.py). Not jax's Pallas Triton attention (pallas.ops.gpu.
  attention.mha, what ran here before): it masks other sequences elementwise but visits every kv
  block up to the diagonal. Limits: no sliding window and no soft-cap (`segment_attention` keeps
  the masked form for such layers; configuration refuses packed rows for such a GPU model under
  the fused attention). Its speed against cuDNN's or mha's is unmeasured (no GPU here).
  `interpret`: Pallas's interpreter (the CPU tests)."""
  from grpo_jax.models.decoder import segment_flash

  h, g = q_bthk.shape[2], k_btgk.shape[2]

  def local(q, k, v, seg):  # [b, T, h, K], [b, T, g, K], seg [b, T]: this shard's rows, heads
    return segment_flash.segment_flash(q, k, v, seg, interpret=interpret)

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and set(sharding.MESH_AXES) <= set(mesh.axis_names):
    qs = sharding.logical_to_spec(("batch", "length", "q_heads", "head_dim"), q_bthk.shape, mesh)
    ks = sharding.logical_to_spec(("batch", "length", "kv_heads", "head_dim"), k_btgk.shape, mesh)
    if qs[2] != ks[2] and g != h:  # kv heads split otherwise than the query heads: repeat them
      k_btgk, v_btgk = (jnp.repeat(x, h // g, axis=2) for x in (k_btgk, v_btgk))
      ks = qs
    qs, ks = (jax.sharding.PartitionSpec(qs[0], None, p[2], None) for p in (qs, ks))
    ss = jax.sharding.PartitionSpec(qs[0], None)
    local = jax.shard_map(
        local, mesh=mesh, in_specs=(qs, ks, ks, ss), out_specs=qs, check_vma=False
    )
  return local(q_bthk, k_btgk, v_btgk, segments_bt)


def splash_attention(
    q_bthk,
    k_btgk,
    v_btgk,
    *,
    interpret: bool = False,
    window: int | None = None,
    softcap: float = 0.0,
    segment_ids=None,
    block: int | None = None
):
  """`causal_attention` on TPU: the Pallas splash-attention kernel (flash attention tiled for
  the TPU's VMEM, grouped-query heads read in place), one kernel call per row, under a
  shard_map that keeps rows on (data, fsdp) and heads on tensor when a mesh is set. T is padded
  at the end to a multiple of 128 (causal: the padding is never attended by a real query).
  `segment_ids` [B, T] (packed rows: `segment_attention`): the kernel's segment mask too (a
  query attends to keys of its own segment only); the padding to 128 gets segment 0, the rows'
  own padding's id. With segment ids the kernel also skips, per row, the blocks that lie
  entirely in another sequence (splash_segments.py: each row's own scalar-prefetch tables, built
  from its segment ids), and the rows run as one kernel call, laid end to end as one sequence
  (a vmap of per-row prefetch operands would be pallas_call's loop of calls over the rows).
  `block`: the kernel's block (default: the largest of 512, 256, 128 dividing the padded T).
  `interpret`: Pallas's interpreter (the CPU tests)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

  b, t, h, kd = q_bthk.shape
  tp = -(-t // 128) * 128
  blk = block or next(x for x in (512, 256, 128) if tp % x == 0)
  assert tp % blk == 0 and blk % 128 == 0, (tp, blk)
  pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))).swapaxes(1, 2)  # noqa
  q, k, v = pad(q_bthk * jnp.asarray(kd**-0.5, q_bthk.dtype)), pad(k_btgk), pad(v_btgk)

  def local(q, k, v, *seg):  # [b, h, T, K] this shard's rows and heads; seg: [b, T] or none
    one = (
        sm.CausalMask((tp, tp))
        if window is None
        else sm.LocalMask((tp, tp), window_size=(window - 1, 0), offset=0)
    )
    mask = sm.MultiHeadMask([one for _ in range(q.shape[1])])
    sizes = sk.BlockSizes(
        block_q=blk,
        block_kv=blk,
        block_kv_compute=blk,
        block_q_dkv=blk,
        block_kv_dkv=blk,
        block_kv_dkv_compute=blk,
        block_q_dq=blk,
        block_kv_dq=blk,
    )
    kernel = sk.make_splash_mha(
        mask,
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sizes,
        interpret=interpret,
        attn_logits_soft_cap=softcap or None,
    )
    if not seg:
      return jax.vmap(kernel)(q, k, v)

    # Packed rows: the b rows laid end to end as one sequence of b * tp slots, one kernel call
    # with the rows' own tables (splash_segments.packed_tables: no block of one row visits
    # another's) and the static mask's function (causal or window: the same within a row).
    info = kernel.fwd_mask_info  # the static mask's: a mask function, no mask blocks
    assert info.mask_next is None and info.partial_mask_blocks is None, info
    b, heads = q.shape[:2]
    fwd_next, fwd_mask, dkv_next, dkv_mask = splash_segments.packed_tables(
        seg[0], bq=blk, bk=blk, window=window
    )
    q_sequence = jnp.arange(b * tp, dtype=jnp.int32)
    fwd = info._replace(data_next=fwd_next, block_mask=fwd_mask, q_sequence=q_sequence)
    dkv = kernel.dkv_mask_info._replace(
        data_next=dkv_next, block_mask=dkv_mask, q_sequence=q_sequence
    )
    rows_kernel = sk.SplashAttentionKernel(fwd, fwd, dkv, **kernel.kwargs)
    flat = lambda x: x.swapaxes(0, 1).reshape(x.shape[1], b * tp, x.shape[3])  # noqa
    s = seg[0].reshape(b * tp)
    out = rows_kernel(flat(q), flat(k), flat(v), segment_ids=sk.SegmentIds(q=s, kv=s))
    return out.reshape(heads, b, tp, -1).swapaxes(0, 1)

  args = (q, k, v)
  if segment_ids is not None:
    args += (jnp.pad(segment_ids, ((0, 0), (0, tp - t))),)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and set(sharding.MESH_AXES) <= set(mesh.axis_names):
    names = ("batch", "q_heads", "length", "head_dim")
    qs = sharding.logical_to_spec(names, q.shape, mesh)
    ks = sharding.logical_to_spec(("batch", "kv_heads", "length", "head_dim"), k.shape, mesh)
    if qs[1] != ks[1]:  # heads split differently (Hkv not divisible): replicate heads
      qs, ks = (jax.sharding.PartitionSpec(p[0], None, None, None) for p in (qs, ks))
    specs = (qs, ks, ks) + ((jax.sharding.PartitionSpec(qs[0], qs[2]),) if len(args) > 3 else ())
    local = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=qs, check_vma=False)
  return local(*args).swapaxes(1, 2)[:, :t]
