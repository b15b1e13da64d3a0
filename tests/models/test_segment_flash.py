"""segment_flash.py's packed-row flash attention in Pallas's interpreter (f32): its values and
gradients are the masked attention's (`attention.segment_mask`), the kv blocks (q blocks, for
dk/dv) its rule skips are never read (NaN there changes nothing), and `visited_blocks` counts
that rule."""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.models.decoder import attention
from grpo_jax.models.decoder import segment_flash as sf

# Small mixed blocks: several blocks per row at small T, q and kv blocks of different sizes.
BLOCKS = sf.BlockSizes(fwd_q=16, fwd_k=32, dq_q=32, dq_k=16, dkv_q=16, dkv_k=32)
SMALL = sf.BlockSizes(*(16,) * 6)


def _rows(t):
  """[3, t] segment ids: many short sequences (1-6 slots) then padding; one long sequence then
  padding; ragged sequences (a 1-slot one among them) filling the row."""
  rng = np.random.default_rng(3)
  seg = np.zeros((3, t), np.int32)
  at, sid = 0, 7
  while at < t - 8:
    n = int(rng.integers(1, 7))
    seg[0, at : at + n], at, sid = sid, at + n, sid + 2
  seg[1, : t - 5] = 4
  for a, z in zip([0, 9, 10, 31, 50], [9, 10, 31, 50, t]):
    seg[2, a:z] = a + 1
  return jnp.asarray(seg)


def _inputs(b, t, h, g, kd, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, g, kd)), jnp.float32) for _ in range(2))
  return q, k, v, jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32)


def _masked(seg):
  return lambda q, k, v: attention.attention(q, k, v, attention.segment_mask(seg))


def test_equals_the_masked_attention():
  """Outputs of real tokens and the gradients of q, k, v (every slot: padding's are 0 both
  ways when its outputs are unread) equal the masked attention's to 1e-5: grouped-query heads
  (4 query, 2 kv), head_dim 24 (padded to 32), T = 75 (padded to 96), a row of many short
  sequences, one of a long one, a ragged one; nothing NaN, padding's outputs included."""
  seg = _rows(75)
  q, k, v, w = _inputs(3, 75, 4, 2, 24)
  real = (seg > 0)[:, :, None, None]
  w = w * real
  fused = lambda q, k, v: sf.segment_flash(q, k, v, seg, blocks=BLOCKS, interpret=True)  # noqa
  got = fused(q, k, v)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got * real, _masked(seg)(q, k, v) * real, rtol=1e-5, atol=1e-5)
  grads = [jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2)) for f in (fused, _masked(seg))]
  for name, a, b in zip("qkv", grads[0](q, k, v), grads[1](q, k, v)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def _two_sequences():
  """One row of 80 slots: sequence A [0, 40), B [40, 70), padding [70, 80); 16-slot blocks.
  q block 3 (slots 48-63) visits kv blocks 2-3 only (from B's start, 40, to the diagonal);
  kv block 1 (slots 16-31) is attended by q blocks 1-2 only (its diagonal to A's end, 39)."""
  seg = np.zeros((1, 80), np.int32)
  seg[0, :40], seg[0, 40:70] = 1, 2
  lo, hi = sf._kv_ranges(jnp.asarray(seg), 16, 16)
  assert (int(lo[0, 3]), int(hi[0, 3])) == (2, 4)
  lo, hi = sf._q_ranges(jnp.asarray(seg), 16, 16)
  assert (int(lo[0, 1]), int(hi[0, 1])) == (1, 3)
  return jnp.asarray(seg)


def test_skipped_kv_blocks_are_never_read():
  """NaN in the keys and values of every kv block q block 3 does not visit (0-1 before B's
  start, 4 past the diagonal): its outputs and dq stay finite and equal the masked attention's
  on clean inputs (a kernel visiting those blocks multiplies p = 0 by NaN)."""
  seg = _two_sequences()
  q, k, v, w = _inputs(1, 80, 4, 2, 16, seed=1)
  rows = slice(48, 64)
  w = w.at[:, : rows.start].set(0).at[:, rows.stop :].set(0)  # dO only on q block 3
  nan = jnp.zeros(k.shape).at[:, :32].set(jnp.nan).at[:, 64:].set(jnp.nan)
  fused = lambda q, k, v: sf.segment_flash(q, k, v, seg, blocks=SMALL, interpret=True)  # noqa
  got, vjp = jax.vjp(fused, q, k + nan, v + nan)
  want, vjp_want = jax.vjp(_masked(seg), q, k, v)
  assert np.isfinite(got[:, rows]).all()
  np.testing.assert_allclose(got[:, rows], want[:, rows], rtol=1e-5, atol=1e-5)
  dq = vjp(w)[0][:, rows]
  assert np.isfinite(dq).all()
  np.testing.assert_allclose(dq, vjp_want(w)[0][:, rows], rtol=1e-5, atol=1e-5)


def test_skipped_q_blocks_are_never_read_for_dkv():
  """NaN in the queries and output gradients of every q block that kv block 1 is not attended
  by (0 before its diagonal, 3-4 past A's end): its dk and dv stay finite and equal the masked
  attention's on clean inputs."""
  seg = _two_sequences()
  q, k, v, w = _inputs(1, 80, 4, 2, 16, seed=2)
  w = w * (seg > 0)[:, :, None, None]  # padding's outputs unread (the masked form's attend all)
  nan = jnp.zeros(q.shape).at[:, :16].set(jnp.nan).at[:, 48:].set(jnp.nan)
  fused = lambda q, k, v: sf.segment_flash(q, k, v, seg, blocks=SMALL, interpret=True)  # noqa
  _, vjp = jax.vjp(fused, q + nan, k, v)
  _, vjp_want = jax.vjp(_masked(seg), q, k, v)
  rows = slice(16, 32)
  for name, a, b in zip("kv", vjp(w + nan)[1:], vjp_want(w)[1:]):
    assert np.isfinite(a[:, rows]).all(), f"d{name}"
    np.testing.assert_allclose(a[:, rows], b[:, rows], rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_visited_blocks_counts_the_rule():
  """A hand count, q blocks of 8 slots, kv blocks of 4, T = 32: row 0 holds sequences [0, 10),
  [10, 13), [13, 30) and padding: q block 0 visits kv blocks 0-1 (2), block 1 (its first slot's
  sequence starts at 0) 0-3 (4), block 2 (sequence from 13) 3-5 (3), block 3 3-7 (5): 14. Row 1
  is padding only: 0. Row 2 is one sequence of 30 slots: 2 + 4 + 6 + 8 = 20 (T padded to the
  block: the same count)."""
  seg = np.zeros((3, 30), np.int32)
  seg[0, :10], seg[0, 10:13], seg[0, 13:] = 5, 6, 7
  seg[2] = 1
  seg = np.pad(seg, ((0, 0), (0, 2)))
  np.testing.assert_array_equal(sf.visited_blocks(seg, 8, 4, per_row=True), [14, 0, 20])
  assert sf.visited_blocks(seg[:, :30], 8, 4) == 34
  # 8-slot kv blocks: row 0's q blocks visit 1, 2, 2 (from block 13 // 8 = 1), 3; row 2's 1-4.
  assert sf.visited_blocks(seg, 8, 8) == 8 + 0 + 10
