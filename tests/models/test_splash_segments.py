"""Splash attention over packed rows skips the blocks that lie entirely in another sequence
(models/decoder/splash_segments.py, attention.splash_attention with segment ids): the tables
follow the rule, values and gradients equal the masked attention with several blocks per row,
and the skipped blocks are really not visited (NaN there stays out of the results). Pallas's
interpreter, f32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models.decoder import attention
from grpo_jax.models.decoder import splash_segments

BLK = 128
T = 500  # padded to 512: 4 blocks of 128


def _row(lengths, t=T):
  seg = np.zeros(t, np.int32)
  at = 0
  for sid, n in enumerate(lengths, 1):
    seg[at : at + n] = sid
    at += n
  return seg


def _segments():
  """4 rows, ragged sequences, padding at the ends of rows 0, 2 and 3 (row 1 full but for the
  kernel's padding to 512; row 3's last 3 blocks padding only), boundaries on and off the
  blocks' edges."""
  rows = [_row([60, 200, 90, 130]), _row([128, 128, 40, 4, 200]), _row([300, 20, 1, 99])]
  rows.append(_row([100, 20]))
  return jnp.asarray(np.stack(rows))


def _rule(seg, window):
  """The rule, slot by slot in numpy: fwd[i, j], dkv[i, j] (q block i, kv block j)."""
  seg = np.asarray(seg)
  tp = len(seg)
  start = [s if s == 0 or seg[s] != seg[s - 1] else 0 for s in range(tp)]
  start = np.maximum.accumulate(start)
  end = np.full(tp, tp)
  for s in range(tp - 2, -1, -1):
    end[s] = s + 1 if seg[s] != seg[s + 1] else end[s + 1]
  n = tp // BLK
  last_real = ((seg != 0).sum() - 1) // BLK  # q blocks past it: padding only
  fwd, dkv = np.zeros((n, n), bool), np.zeros((n, n), bool)
  for i in range(n):
    for j in range(n):
      lo = start[i * BLK] // BLK
      if window:
        lo = max(lo, max(0, i * BLK - (window - 1)) // BLK)
      if i > last_real:  # padding only: its diagonal block alone
        lo = i
      fwd[i, j] = lo <= j <= i
      hi = (end[(j + 1) * BLK - 1] - 1) // BLK
      if window:
        hi = min(hi, ((j + 1) * BLK + window - 2) // BLK)
      hi = max(j, min(hi, last_real))
      dkv[i, j] = j <= i <= hi
  return fwd, dkv


@pytest.mark.parametrize("window", [None, 100, 200])
def test_tables_follow_the_rule_and_cover_the_mask(window):
  """The per-row tables visit exactly the rule's blocks (each visited once), and every block
  holding an allowed (query, key) pair of `segment_mask` is visited by both passes."""
  seg = jnp.pad(_segments(), ((0, 0), (0, 12)))
  seg = jnp.concatenate([seg, jnp.zeros((1, 512), seg.dtype)])  # a bucket's row of padding
  for s in seg:
    fwd_next, fwd_mask, dkv_next, dkv_mask = (
        np.asarray(x)[0]
        for x in splash_segments.row_tables(s, tp=512, bq=BLK, bk=BLK, window=window)
    )
    fwd, dkv = _rule(s, window)
    got_fwd, got_dkv = np.zeros_like(fwd), np.zeros_like(dkv)
    for i, p in zip(*np.nonzero(fwd_mask)):
      assert not got_fwd[i, fwd_next[i, p]]
      got_fwd[i, fwd_next[i, p]] = True
    for p, j in zip(*np.nonzero(dkv_mask)):
      assert not got_dkv[dkv_next[p, j], j]
      got_dkv[dkv_next[p, j], j] = True
    np.testing.assert_array_equal(got_fwd, fwd)
    np.testing.assert_array_equal(got_dkv, dkv)
    vis_fwd, vis_dkv = splash_segments.visited_blocks(s, tp=512, bq=BLK, bk=BLK, window=window)
    np.testing.assert_array_equal(vis_fwd, fwd)
    np.testing.assert_array_equal(vis_dkv, dkv)
    allowed = np.asarray(attention.segment_mask(s[None], window)[0])
    needed = allowed.reshape(4, BLK, 4, BLK).any(axis=(1, 3))
    assert not (needed & ~fwd).any() and not (needed & ~dkv).any()
    assert (~fwd & np.tri(4, dtype=bool)).any()  # blocks skipped below the diagonal
  # padding only: each q block visits its diagonal block alone, in both passes
  np.testing.assert_array_equal(got_fwd, np.eye(4, dtype=bool))
  np.testing.assert_array_equal(got_dkv, np.eye(4, dtype=bool))
  # The rows end to end (one kernel call): each row's rule on its own blocks, nothing across.
  fwd_next, fwd_mask, dkv_next, dkv_mask = (
      np.asarray(x)[0] for x in splash_segments.packed_tables(seg, bq=BLK, bk=BLK, window=window)
  )
  got_fwd, got_dkv = np.zeros((4 * len(seg), 4 * len(seg)), bool), np.zeros(
      (4 * len(seg), 4 * len(seg)), bool
  )
  for i, p in zip(*np.nonzero(fwd_mask)):
    got_fwd[i, fwd_next[i, p]] = True
  for p, j in zip(*np.nonzero(dkv_mask)):
    got_dkv[dkv_next[p, j], j] = True
  rules = [_rule(s, window) for s in seg]
  for got, n in ((got_fwd, 0), (got_dkv, 1)):
    want = np.zeros((4 * len(seg), 4 * len(seg)), bool)
    for r, rule in enumerate(rules):
      want[4 * r : 4 * r + 4, 4 * r : 4 * r + 4] = rule[n]
    np.testing.assert_array_equal(got, want)


def _inputs(seed=0, h=4, g=2, kd=64):
  rng = np.random.default_rng(seed)
  seg = _segments()
  b = seg.shape[0]
  q = jnp.asarray(rng.normal(size=(b, T, h, kd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, T, g, kd)), jnp.float32) for _ in range(2))
  real = (seg > 0)[:, :, None, None]
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * real  # padding's outputs unread
  return q, k, v, seg, real, w


def _fused(seg, window, softcap):
  return lambda q, k, v: attention.splash_attention(
      q, k, v, window=window, softcap=softcap, segment_ids=seg, block=BLK, interpret=True
  )


def _masked(seg, window, softcap):
  return lambda q, k, v: attention.attention(
      q, k, v, attention.segment_mask(seg, window), softcap=softcap
  )


@pytest.mark.parametrize(
    "window,softcap", [(None, 0.0), (100, 0.0), pytest.param(200, 3.0, marks=pytest.mark.slow)]
)
def test_values_and_gradients_equal_the_masked_attention(window, softcap):
  """Several blocks per row (T = 500, blocks of 128), grouped-query heads (4 query, 2 kv),
  ragged sequences, padding: outputs of real tokens and the gradients of q, k, v equal the
  masked attention's (1e-5)."""
  q, k, v, seg, real, w = _inputs()
  fused, masked = _fused(seg, window, softcap), _masked(seg, window, softcap)
  np.testing.assert_allclose(fused(q, k, v) * real, masked(q, k, v) * real, rtol=1e-5, atol=1e-5)
  grads = [
      jax.jit(jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2))) for f in (fused, masked)
  ]
  for got, want in zip(grads[0](q, k, v), grads[1](q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _blocks(x, b, blocks):
  """x [B, T, ...] -> a bool mask of row b's slots in the given blocks ([B, T, 1, 1])."""
  slots = np.zeros(x.shape[:2], bool)
  for j in blocks:
    slots[b, j * BLK : (j + 1) * BLK] = True
  return jnp.asarray(slots[:, :T, None, None])


@pytest.mark.parametrize("window", [None, pytest.param(200, marks=pytest.mark.slow)])
def test_forward_and_dq_skip_the_other_sequences_blocks(window):
  """In each row, for the q block with the most skipped kv blocks, NaN in the keys and values of
  every kv block the rule does not visit for it (other sequences' blocks and those past the
  diagonal): that q block's outputs and dq stay finite and equal the masked attention's on clean
  inputs (a visited block's p = 0 times a NaN value would be NaN)."""
  q, k, v, seg, real, w = _inputs(seed=1)
  segp = np.pad(np.asarray(seg), ((0, 0), (0, 12)))
  poison, keep = jnp.zeros(k.shape[:2] + (1, 1), bool), jnp.zeros(q.shape[:2] + (1, 1), bool)
  for b in range(seg.shape[0]):
    fwd, _ = _rule(segp[b], window)
    i = int(np.argmax((~fwd & np.tri(4, dtype=bool)).sum(1)))
    assert (~fwd[i, : i + 1]).any()
    poison |= _blocks(k, b, np.nonzero(~fwd[i])[0])
    keep |= _blocks(q, b, [i])
  kn, vn = (jnp.where(poison, jnp.nan, x) for x in (k, v))
  fused, masked = _fused(seg, window, 0.0), _masked(seg, window, 0.0)
  keep &= real
  got = jnp.where(keep, fused(q, kn, vn), 0.0)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, jnp.where(keep, masked(q, k, v), 0.0), rtol=1e-5, atol=1e-5)
  wk = w * keep
  dq = jax.grad(lambda q, k, v, f: (f(q, k, v) * wk).sum(), argnums=0)
  got = jnp.where(keep, dq(q, kn, vn, fused), 0.0)
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, jnp.where(keep, dq(q, k, v, masked), 0.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, pytest.param(200, marks=pytest.mark.slow)])
def test_dkv_skips_the_other_sequences_blocks(window):
  """In each row, for the kv block with the most skipped q blocks, NaN in the queries and the
  output cotangents of every q block the rule does not visit for it (later sequences' blocks,
  those before the diagonal): that kv block's dk and dv stay finite and equal the masked
  attention's on clean inputs."""
  q, k, v, seg, real, w = _inputs(seed=2)
  segp = np.pad(np.asarray(seg), ((0, 0), (0, 12)))
  poison, keep = jnp.zeros(q.shape[:2] + (1, 1), bool), jnp.zeros(k.shape[:2] + (1, 1), bool)
  for b in range(seg.shape[0]):
    _, dkv = _rule(segp[b], window)
    j = int(np.argmax((~dkv & np.tri(4, dtype=bool)).sum(0)))
    assert (~dkv[j:, j]).any()
    poison |= _blocks(q, b, np.nonzero(~dkv[:, j])[0])
    keep |= _blocks(k, b, [j])
  qn, wn = jnp.where(poison, jnp.nan, q), jnp.where(poison, jnp.nan, w)
  _, vjp = jax.vjp(_fused(seg, window, 0.0), qn, k, v)
  _, dk, dv = vjp(wn)
  _, vjp = jax.vjp(_masked(seg, window, 0.0), q, k, v)
  _, dk_want, dv_want = vjp(w)
  for got, want in ((dk, dk_want), (dv, dv_want)):
    got = jnp.where(keep, got, 0.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, jnp.where(keep, want, 0.0), rtol=1e-5, atol=1e-5)
