"""Block skipping for splash attention over packed rows (`attention.splash_attention` with
segment ids): per row, the scalar-prefetch tables (splash's MaskInfo: data_next, block_mask)
that make the kernel visit only the (q block, kv block) pairs that may hold a query and a key of
the same sequence, built in jnp from the row's segment ids (O(T) work, no [T, T] mask).

The kernel's static mask (CausalMask, or LocalMask for a window) stays as its mask function
(computed in the kernel, elementwise), and so do the SegmentIds: a visited block is masked
exactly as before; only the blocks that lie entirely in another sequence are no longer visited.

The rule (what a benchmark counts as issued FLOPs), with start(s) the first slot of the sequence
that slot s belongs to and end(s) one past its last (padding, segment 0 at the row's end, is one
more such run):
  forward and dq pass: q block i visits the kv blocks j in
      [max(start(i * bq) // bk, window's first), diagonal(i) = ((i + 1) * bq - 1) // bk],
    window's first = max(0, i * bq - (window - 1)) // bk (0 without a window);
  dkv pass: kv block j visits the q blocks i in
      [diagonal(j) = j * bk // bq, min((end((j + 1) * bk - 1) - 1) // bq, window's last)],
    window's last = min(nq - 1, ((j + 1) * bk + window - 2) // bq) (nq - 1 without a window).
A q at slot s only attends keys at slots >= start(s) >= start(i * bq) (start is monotone), and a
key at slot s only gets queries at slots < end(s) <= end((j + 1) * bk - 1): no needed block is
left out. Padding (bq = bk, as splash_attention runs it): a q block of padding only visits its
diagonal block alone (its queries attend to the padding keys up to themselves there: finite
outputs, never read; a row's bucketed rows of padding only cost a block per q block, not every
causal one), and the dkv pass's q blocks stop at the last q block holding a real slot (the
diagonal at least), the forward's pairs exactly.

Layout: splash's "shrunk grid": the kernel's grid has a static width W (the most blocks any q
block (kv block) may visit: the window's span, else all), position p of q block i's row holds kv
block lo(i) + p while that is <= the diagonal (block_mask 1: the mask function and segment ids
are applied); the positions past it repeat the last visited block with block_mask 0: no compute
and, the block index unchanged, no copy. One table for all heads. The rows run as one kernel
call over the rows laid end to end (`packed_tables`; the kernel's causal or window mask function
is the same within a row, and no row's block visits another's), so the tables are
[1, B * nq, W] (forward, dq) and [1, Wq, B * nk] (dkv), int16 and int8: B * nq * W * 3 bytes
each in SMEM (8 rows of 1280 slots, blocks of 256: 600 bytes). A vmap over the rows instead
would make pallas_call batch the per-row prefetch operands as a loop of kernel calls, each on
a dynamic slice of q, k, v.
"""

import jax
import jax.numpy as jnp
import numpy as np


def segment_bounds(segments_t):
  """start, end [T]: the first slot of each slot's run of equal segment ids, one past its last
  (segments [T]: contiguous runs; padding 0 at the end is a run too)."""
  t = segments_t.shape[-1]
  slots = jnp.arange(t)
  first = jnp.concatenate([jnp.ones((1,), bool), segments_t[1:] != segments_t[:-1]])
  last = jnp.concatenate([segments_t[1:] != segments_t[:-1], jnp.ones((1,), bool)])
  start = jax.lax.cummax(jnp.where(first, slots, 0))
  end = jax.lax.cummin(jnp.where(last, slots + 1, t), reverse=True)
  return start, end


def _window_spans(tp: int, bq: int, bk: int, window: int | None):
  """Static (numpy) spans of the mask without segments: forward lo, diag [nq] (kv blocks),
  dkv diag, hi [nk] (q blocks)."""
  nq, nk = tp // bq, tp // bk
  qi, kj = np.arange(nq), np.arange(nk)
  diag_q = ((qi + 1) * bq - 1) // bk
  diag_k = kj * bk // bq
  if window is None:
    lo_q, hi_k = np.zeros(nq, np.int32), np.full(nk, nq - 1)
  else:
    lo_q = np.maximum(0, qi * bq - (window - 1)) // bk
    hi_k = np.minimum(nq - 1, ((kj + 1) * bk + window - 2) // bq)
  return lo_q, diag_q, diag_k, hi_k


def visited_blocks(segments_t, *, tp: int, bq: int, bk: int, window: int | None):
  """The rule as two bool tables (for tests and FLOP counts): fwd [nq, nk] (q block i visits kv
  block j in the forward and dq passes), dkv [nq, nk] (kv block j visits q block i in the dkv
  pass). segments [tp]."""
  lo, hi, dlo, dhi = _row_spans(segments_t, tp=tp, bq=bq, bk=bk, window=window)
  kj, qi = jnp.arange(tp // bk), jnp.arange(tp // bq)
  fwd = (kj[None, :] >= lo[:, None]) & (kj[None, :] <= hi[:, None])
  dkv = (qi[:, None] >= dlo[None, :]) & (qi[:, None] <= dhi[None, :])
  return fwd, dkv


def _row_spans(segments_t, *, tp, bq, bk, window):
  """One row's spans: forward lo, hi [nq] (kv blocks), dkv lo, hi [nk] (q blocks)."""
  lo_w, diag_q, diag_k, hi_w = _window_spans(tp, bq, bk, window)
  start, end = segment_bounds(segments_t)
  nq, nk = tp // bq, tp // bk
  lo = jnp.maximum(start[jnp.arange(nq) * bq] // bk, lo_w)
  hi = jnp.minimum((end[(jnp.arange(nk) + 1) * bk - 1] - 1) // bq, hi_w)
  if bq == bk:  # a q block of padding only visits its diagonal block alone (module docstring)
    last_real = ((segments_t != 0).sum() - 1) // bq  # the last q block holding a real slot
    lo = jnp.where(jnp.arange(nq) > last_real, jnp.asarray(diag_q), lo)
    hi = jnp.maximum(jnp.asarray(diag_k), jnp.minimum(hi, last_real))
  return lo, jnp.asarray(diag_q), jnp.asarray(diag_k), hi


def row_tables(segments_t, *, tp: int, bq: int, bk: int, window: int | None):
  """One row's scalar-prefetch tables (see the module's docstring): (fwd data_next, fwd
  block_mask) [1, nq, W] for the forward and dq passes (bq, bk their blocks) and (dkv data_next,
  dkv block_mask) [1, Wq, nk] for the dkv pass, int32. segments [tp]."""
  lo_w, diag_q, diag_k, hi_w = _window_spans(tp, bq, bk, window)
  width = int((diag_q - lo_w).max()) + 1
  width_q = int((hi_w - diag_k).max()) + 1
  lo, diag_q, diag_k, hi = _row_spans(segments_t, tp=tp, bq=bq, bk=bk, window=window)
  kv = lo[:, None] + jnp.arange(width)[None, :]  # [nq, W]
  fwd_next = jnp.minimum(kv, diag_q[:, None]).astype(jnp.int32)
  fwd_mask = (kv <= diag_q[:, None]).astype(jnp.int32)
  q = diag_k[None, :] + jnp.arange(width_q)[:, None]  # [Wq, nk]
  dkv_next = jnp.minimum(q, hi[None, :]).astype(jnp.int32)
  dkv_mask = (q <= hi[None, :]).astype(jnp.int32)
  return fwd_next[None], fwd_mask[None], dkv_next[None], dkv_mask[None]


def packed_tables(segments_bt, *, bq: int, bk: int, window: int | None):
  """The tables of B rows laid end to end as one sequence of B * T slots (how
  `attention.splash_attention` runs them: one kernel call over the rows, each row's blocks
  offset by its place): `row_tables` of each row, its block indices offset by the row's first
  block, rows concatenated along the q blocks (forward, dq) or the kv blocks (dkv); a row's
  blocks never visit another row's. Downcast as splash's own tables are (SMEM is small):
  block_mask int8, data_next int16 where it fits. segments [B, T] -> (fwd data_next, fwd
  block_mask) [1, B * nq, W], (dkv data_next, dkv block_mask) [1, Wq, B * nk]."""
  b, tp = segments_bt.shape
  nq, nk = tp // bq, tp // bk
  fwd_next, fwd_mask, dkv_next, dkv_mask = jax.vmap(
      lambda s: row_tables(s, tp=tp, bq=bq, bk=bk, window=window)
  )(
      segments_bt
  )  # [B, 1, nq, W], [B, 1, Wq, nk]
  rows = jnp.arange(b)[:, None, None, None]
  fwd_next = (fwd_next + rows * nk).reshape(1, b * nq, -1)
  fwd_mask = fwd_mask.reshape(1, b * nq, -1)
  dkv_next = (dkv_next + rows * nq)[:, 0].transpose(1, 0, 2).reshape(1, -1, b * nk)
  dkv_mask = dkv_mask[:, 0].transpose(1, 0, 2).reshape(1, -1, b * nk)
  index = jnp.int16 if b * max(nq, nk) <= np.iinfo(np.int16).max else jnp.int32
  return (
      fwd_next.astype(index),
      fwd_mask.astype(jnp.int8),
      dkv_next.astype(index),
      dkv_mask.astype(jnp.int8),
  )
