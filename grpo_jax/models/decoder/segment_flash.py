"""Flash attention over packed rows for the GPU, as Pallas Triton kernels with a custom VJP:
causal self-attention where a token attends only to the earlier tokens of its own sequence, and
a program skips the kv blocks that hold none of its queries' sequences.

    out_bthk = segment_flash(q_bthk, k_btgk, v_btgk, segments_bt)

segments [B, T] int: 0 = padding (at the row's end), else the sequence's id, each sequence a
contiguous run of slots (rl/packing.py's rows). q [B, T, H, K]; k, v [B, T, Hkv, K], H a
multiple of Hkv: query head h reads kv head h // (H / Hkv) in place (no repeated copy). Values
are `attention.attention` under `attention.segment_mask` for real tokens; f32 accumulation and
softmax, the output in q's dtype.

Why: jax's Pallas Triton flash attention (jax.experimental.pallas.ops.gpu.attention.mha, what
attention.triton_attention ran before) masks other sequences' scores elementwise but visits
every kv block up to the causal diagonal: a packed row of 1280 slots holding ~4 sequences of
~300 tokens spends most of its attention FLOPs on blocks that are wholly another sequence's.

The rule (per row and head; `visited_blocks` counts it, the benchmarks' issued FLOPs): q block i
(slots [i*bq, (i+1)*bq)) visits kv blocks j in [start(i*bq) // bk, ((i+1)*bq - 1) // bk], where
start(s) is the first slot of the sequence holding slot s, and none if it holds no real slot
(padding only: its output is 0). The bounds are computed with jnp outside the kernels (`_spans`:
start and end = one past the last slot, by cummax/cummin over the segment boundaries) and each
program loads its own from an int32 array (a fori_loop with dynamic bounds).

Kernels (grids of programs; Triton on GPU, Pallas's interpreter elsewhere, for the CPU tests):
  fwd  a program per (q block, row, head): online softmax over its kv range (causal and segment
       masks inside the blocks, masked probabilities exactly 0); writes the output and the
       log-sum-exp (base 2, +inf for a skipped block) for the backward.
  dq   a program per (q block, row, head): the same kv range (the dq blocks' own), the
       probabilities recomputed from the saved lse, delta = rowsum(dO * O) precomputed in jnp.
  dkv  a program per (kv block j, row, kv head): for each of the kv head's H / Hkv query heads,
       the q blocks from the diagonal j*bk // bq to (end(last slot of j) - 1) // bq (the last
       query of the last sequence it holds), none past the last q block holding a real slot.
Padding slots (segment 0) form one more "sequence": they attend each other, are never attended
by a real token, and their outputs (never read) stay finite; so do the gradients they get.
T is padded at the end to a multiple of the largest block with segment 0, head_dim to a power
of two with zeros (Triton's blocks are powers of two); both are cut off again.

Speed on an H100 is unmeasured (no GPU where this was written); the default blocks follow
jax's kernel (128 x 128 forward) and common Triton backward tiles (64 x 64), untuned. What is
checked: values and gradients against the masked attention in the interpreter, and that the
skipped blocks are never read (NaN there leaves the results finite), in
tests/models/test_segment_flash.py; the H100's deviceless compile of the packed update holding
these kernels, in tests/plan/test_compiled_programs.py. XLA:GPU's deviceless compile checks
Triton's shared memory against the H100's 227 KiB per block: the defaults compile at T 1280, 32
query / 8 kv heads, head_dim 128, bf16 (so do 128 x 128 backward blocks); 256 x 256
forward blocks (128 backward) do not (321 KiB requested). By the rule, a row of 1280 slots
holding 4 sequences of 300 visits 25 of the causal 55 128 x 128 blocks per head (jax's kernel:
all 55): real causal attention FLOPs / issued 0.44 (0.20 for all 55); 64 x 64 blocks: 69 of
210, 0.64. JAX marks the Pallas Triton backend deprecated (a warning at lowering); a Mosaic
GPU port is the successor path.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class BlockSizes(NamedTuple):
  """Blocks of each kernel (powers of two >= 16, Triton's dot): forward q/kv, dq's q/kv, dkv's
  q/kv. GPU defaults untuned (no H100 here to time them)."""

  fwd_q: int = 128
  fwd_k: int = 128
  dq_q: int = 64
  dq_k: int = 64
  dkv_q: int = 64
  dkv_k: int = 64


_MASK = -0.7 * float(np.finfo(np.float32).max)  # a masked score: finite, below any real one
_LOG2E = math.log2(math.e)


def segment_flash(
    q_bthk,
    k_btgk,
    v_btgk,
    segments_bt,
    *,
    blocks: BlockSizes = BlockSizes(),
    interpret: bool = False,
):
  """Causal self-attention within each packed sequence (see the module docstring).
  q [B, T, H, K]; k, v [B, T, Hkv, K]; segments [B, T] -> [B, T, H, K] in q's dtype.
  `interpret`: Pallas's interpreter (off GPU), else Triton."""
  b, t, h, kd = q_bthk.shape
  if h % k_btgk.shape[2]:
    raise ValueError(f"{h} query heads are not a multiple of {k_btgk.shape[2]} kv heads")
  for x in blocks:
    if x < 16 or x & (x - 1):
      raise ValueError(f"blocks must be powers of two >= 16: {blocks}")
  tp = -(-t // max(blocks)) * max(blocks)
  kp = max(16, 1 << (kd - 1).bit_length())
  pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, kp - kd)))  # noqa: E731
  seg = jnp.pad(segments_bt.astype(jnp.int32), ((0, 0), (0, tp - t)))
  out = _flash(pad(q_bthk), pad(k_btgk), pad(v_btgk), seg, blocks, kd**-0.5, interpret)
  return out[:, :t, :, :kd]


def visited_blocks(segments_bt, block_q: int = 128, block_k: int = 128, per_row: bool = False):
  """How many (q block, kv block) pairs the forward kernel visits, per row and head: the rule
  of the module docstring (kv blocks start(i*bq) // bk .. ((i+1)*bq - 1) // bk for each q
  block i holding a real slot), computed by the function that gives the kernel its bounds.
  Each pair issues 4 * bq * bk * head_dim FLOPs per head (QK^T and PV). -> an int, or with
  `per_row` an int array [B]."""
  seg = np.asarray(segments_bt)
  size = max(block_q, block_k)
  t = -(-seg.shape[1] // size) * size
  seg = np.pad(seg.astype(np.int32), ((0, 0), (0, t - seg.shape[1])))
  lo, hi = _kv_ranges(jnp.asarray(seg), block_q, block_k)
  rows = np.asarray(hi - lo).sum(axis=1)
  return rows if per_row else int(rows.sum())


# --------------------------------------------------------------------------------- bounds


def _spans(seg_bt):
  """-> (start, end) [B, T] int32: the first slot and one past the last slot of the sequence
  holding each slot (padding, segment 0, is one more sequence)."""
  b, t = seg_bt.shape
  slots = jnp.arange(t, dtype=jnp.int32)
  change = seg_bt[:, 1:] != seg_bt[:, :-1]
  edge = jnp.ones((b, 1), bool)
  first = jnp.concatenate([edge, change], axis=1)
  last = jnp.concatenate([change, edge], axis=1)
  start = jax.lax.cummax(jnp.where(first, slots, 0), axis=1)
  end = jax.lax.cummin(jnp.where(last, slots + 1, t), axis=1, reverse=True)
  return start, end


def _kv_ranges(seg_bt, bq: int, bk: int):
  """-> (lo, hi) [B, T/bq] int32: the kv blocks [lo, hi) that q block i visits: from the block
  of its first slot's sequence's start to the causal diagonal; none (lo == hi) for a q block
  of padding only."""
  b, t = seg_bt.shape
  start, _ = _spans(seg_bt)
  i = jnp.arange(t // bq, dtype=jnp.int32)
  lo = start[:, ::bq] // bk
  hi = ((i + 1) * bq - 1) // bk + 1
  real = (seg_bt.reshape(b, t // bq, bq) != 0).any(axis=-1)
  return lo, jnp.where(real, hi[None, :], lo)


def _q_ranges(seg_bt, bq: int, bk: int):
  """-> (lo, hi) [B, T/bk] int32: the q blocks [lo, hi) whose queries may attend kv block j:
  from the diagonal to the block of the last query of the sequence holding j's last slot, none
  past the last q block holding a real slot (the forward skipped those)."""
  b, t = seg_bt.shape
  _, end = _spans(seg_bt)
  j = jnp.arange(t // bk, dtype=jnp.int32)
  lo = jnp.broadcast_to((j * bk) // bq, (b, t // bk))
  hi = (end[:, bk - 1 :: bk] - 1) // bq + 1
  real = (seg_bt.reshape(b, t // bq, bq) != 0).any(axis=-1)
  last = jnp.max(jnp.where(real, jnp.arange(1, t // bq + 1), 0), axis=1, keepdims=True)
  return lo, jnp.maximum(jnp.minimum(hi, last), lo)


# ------------------------------------------------------------------------------- the VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, blocks, scale, interpret):
  return _forward(q, k, v, seg, blocks, scale, interpret)[0]


def _flash_fwd(q, k, v, seg, blocks, scale, interpret):
  out, lse = _forward(q, k, v, seg, blocks, scale, interpret)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(blocks, scale, interpret, res, do):
  q, k, v, seg, out, lse = res
  delta = jnp.einsum("bthk,bthk->bht", out, do, preferred_element_type=jnp.float32)
  dq = _dq(q, k, v, seg, do, lse, delta, blocks, scale, interpret)
  dk, dv = _dkv(q, k, v, seg, do, lse, delta, blocks, scale, interpret)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _compiler_params(interpret: bool, kp: int) -> dict:
  if interpret:
    return {}
  from jax.experimental.pallas import triton as plgpu

  return {"compiler_params": plgpu.CompilerParams(num_warps=4 if kp <= 64 else 8, num_stages=2)}


def _mask(q_slots, k_slots, q_seg, k_seg):
  """[bq, bk]: causal within the same sequence (padding attends padding)."""
  return (q_seg[:, None] == k_seg[None, :]) & (q_slots[:, None] >= k_slots[None, :])


# ------------------------------------------------------------------------------- forward


def _forward(q, k, v, seg, blocks, scale, interpret):
  """-> (out [B, Tp, H, Kp] q's dtype, lse [B, H, Tp] f32, base 2)."""
  from jax.experimental import pallas as pl

  b, tp, h, kp = q.shape
  rep = h // k.shape[2]
  bq, bk = blocks.fwd_q, blocks.fwd_k
  nq = tp // bq
  lo, hi = _kv_ranges(seg, bq, bk)
  whole_kv = pl.BlockSpec((None, tp, None, kp), lambda i, r, n: (r, 0, n // rep, 0))
  by_row = lambda size: pl.BlockSpec((None, size), lambda i, r, n: (r, 0))  # noqa: E731
  q_block = pl.BlockSpec((None, bq, None, kp), lambda i, r, n: (r, i, n, 0))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, bq=bq, bk=bk, scale=scale),
      grid=(nq, b, h),
      in_specs=[by_row(nq), by_row(nq), by_row(tp), q_block, whole_kv, whole_kv],
      out_specs=[q_block, pl.BlockSpec((None, None, bq), lambda i, r, n: (r, n, i))],
      out_shape=[
          jax.ShapeDtypeStruct(q.shape, q.dtype),
          jax.ShapeDtypeStruct((b, h, tp), jnp.float32),
      ],
      interpret=interpret,
      name="segment_flash_fwd",
      **_compiler_params(interpret, kp),
  )(lo, hi, seg, q, k, v)


def _fwd_kernel(lo_ref, hi_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, bq, bk, scale):
  """q block i of one (row, head): online softmax (base 2) over kv blocks [lo[i], hi[i])."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  i = pl.program_id(0)
  q = q_ref[...]  # [bq, Kp]
  q_slots = i * bq + jnp.arange(bq)
  q_seg = seg_ref[pl.ds(i * bq, bq)]

  def step(j, carry):
    o, m, l = carry
    ks = pl.ds(j * bk, bk)
    s = plgpu.dot(q, k_ref[ks, :], trans_b=True) * (scale * _LOG2E)  # [bq, bk] f32
    allowed = _mask(q_slots, j * bk + jnp.arange(bk), q_seg, seg_ref[ks])
    s = jnp.where(allowed, s, _MASK)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_next)
    p = jnp.where(allowed, jnp.exp2(s - m_next[:, None]), 0.0)
    v = v_ref[ks, :]
    o = o * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return o, m_next, l * alpha + jnp.sum(p, axis=1)

  init = (
      jnp.zeros(q.shape, jnp.float32),
      jnp.full((bq,), -jnp.inf, jnp.float32),
      jnp.zeros((bq,), jnp.float32),
  )
  o, m, l = jax.lax.fori_loop(lo_ref[i], hi_ref[i], step, init)
  seen = l > 0  # false only in a skipped (padding-only) block: output 0, lse +inf (p = 0)
  o_ref[...] = (o / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), jnp.inf)


# ------------------------------------------------------------------------------ backward


def _dq(q, k, v, seg, do, lse, delta, blocks, scale, interpret):
  from jax.experimental import pallas as pl

  b, tp, h, kp = q.shape
  rep = h // k.shape[2]
  bq, bk = blocks.dq_q, blocks.dq_k
  nq = tp // bq
  lo, hi = _kv_ranges(seg, bq, bk)
  whole_kv = pl.BlockSpec((None, tp, None, kp), lambda i, r, n: (r, 0, n // rep, 0))
  by_row = lambda size: pl.BlockSpec((None, size), lambda i, r, n: (r, 0))  # noqa: E731
  q_block = pl.BlockSpec((None, bq, None, kp), lambda i, r, n: (r, i, n, 0))
  stat = pl.BlockSpec((None, None, bq), lambda i, r, n: (r, n, i))
  return pl.pallas_call(
      functools.partial(_dq_kernel, bq=bq, bk=bk, scale=scale),
      grid=(nq, b, h),
      in_specs=[by_row(nq), by_row(nq), by_row(tp), q_block, whole_kv, whole_kv, q_block]
      + [stat, stat],
      out_specs=q_block,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=interpret,
      name="segment_flash_dq",
      **_compiler_params(interpret, kp),
  )(lo, hi, seg, q, k, v, do, lse, delta)


def _dq_kernel(
    lo_ref,
    hi_ref,
    seg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    bq,
    bk,
    scale,
):
  """dq of q block i of one (row, head) over the forward's kv range (the dq blocks')."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  i = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_slots = i * bq + jnp.arange(bq)
  q_seg = seg_ref[pl.ds(i * bq, bq)]

  def step(j, dq):
    ks = pl.ds(j * bk, bk)
    k, v = k_ref[ks, :], v_ref[ks, :]
    s = plgpu.dot(q, k, trans_b=True) * (scale * _LOG2E)
    allowed = _mask(q_slots, j * bk + jnp.arange(bk), q_seg, seg_ref[ks])
    p = jnp.where(allowed, jnp.exp2(s - lse[:, None]), 0.0)
    ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  dq = jax.lax.fori_loop(lo_ref[i], hi_ref[i], step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv(q, k, v, seg, do, lse, delta, blocks, scale, interpret):
  from jax.experimental import pallas as pl

  b, tp, h, kp = q.shape
  g = k.shape[2]
  rep = h // g
  bq, bk = blocks.dkv_q, blocks.dkv_k
  nk = tp // bk
  lo, hi = _q_ranges(seg, bq, bk)
  by_row = lambda size: pl.BlockSpec((None, size), lambda j, r, n: (r, 0))  # noqa: E731
  kv_block = pl.BlockSpec((None, bk, None, kp), lambda j, r, n: (r, j, n, 0))
  group_q = pl.BlockSpec((None, tp, rep, kp), lambda j, r, n: (r, 0, n, 0))  # its query heads
  group_stat = pl.BlockSpec((None, rep, tp), lambda j, r, n: (r, n, 0))
  return pl.pallas_call(
      functools.partial(_dkv_kernel, bq=bq, bk=bk, rep=rep, scale=scale),
      grid=(nk, b, g),
      in_specs=[by_row(nk), by_row(nk), by_row(tp), group_q, kv_block, kv_block, group_q]
      + [group_stat, group_stat],
      out_specs=[kv_block, kv_block],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=interpret,
      name="segment_flash_dkv",
      **_compiler_params(interpret, kp),
  )(lo, hi, seg, q, k, v, do, lse, delta)


def _dkv_kernel(
    lo_ref,
    hi_ref,
    seg_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    bq,
    bk,
    rep,
    scale,
):
  """dk, dv of kv block j of one (row, kv head): over its `rep` query heads and the q blocks
  [lo[j], hi[j])."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]  # [bk, Kp]
  k_slots = j * bk + jnp.arange(bk)
  k_seg = seg_ref[pl.ds(j * bk, bk)]
  lo, hi = lo_ref[j], hi_ref[j]

  def head(n, carry):
    def step(i, carry):
      dk, dv = carry
      qs = pl.ds(i * bq, bq)
      q, do = q_ref[qs, n, :], do_ref[qs, n, :]  # [bq, Kp]
      lse, delta = lse_ref[n, qs], delta_ref[n, qs]
      s = plgpu.dot(q, k, trans_b=True) * (scale * _LOG2E)  # [bq, bk]
      allowed = _mask(i * bq + jnp.arange(bq), k_slots, seg_ref[qs], k_seg)
      p = jnp.where(allowed, jnp.exp2(s - lse[:, None]), 0.0)
      dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
      ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
      return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    return jax.lax.fori_loop(lo, hi, step, carry)

  zero = jnp.zeros(k.shape, jnp.float32)
  dk, dv = jax.lax.fori_loop(0, rep, head, (zero, zero))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
