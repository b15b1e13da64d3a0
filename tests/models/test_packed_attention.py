"""Packed rows through the decoder (models/logprobs.py: packed_logprobs): a sequence's log-probs
are the padded forward's, attention never crosses a segment, Gemma's sliding windows count
positions within the sequence; the fused kernels with segment ids (attention.segment_attention:
TPU splash attention, GPU Pallas Triton, both in Pallas's interpreter here) equal the masked
attention, forward and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.models.decoder import attention
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.decoder.transformer import Transformer
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.logprobs import packed_logprobs
from grpo_jax.rl import packing
from grpo_jax.rl import row_plan
from flax import nnx


def _batch(vocab, seed=0):
  """8 sequences: left-padded prompts (1-12 tokens), right-padded completions (0-10 tokens)."""
  rng = np.random.default_rng(seed)
  n, p, c = 8, 12, 10
  plen, clen = rng.integers(1, p + 1, n), rng.integers(0, c + 1, n)
  clen[0] = c
  pm = (np.arange(p)[None] >= (p - plen)[:, None]).astype(np.int32)
  cm = (np.arange(c)[None] < clen[:, None]).astype(np.int32)
  am = np.concatenate([pm, cm], 1)
  ids = (rng.integers(1, vocab, (n, p + c)) * am).astype(np.int32)
  upd = dict(
      input_ids=ids, attention_mask=am, completion_mask=cm, advantages=np.zeros(n, np.float32)
  )
  plan = row_plan.plan_rows(am.sum(1), p + c)
  assert plan.rows < n  # several sequences share rows
  packed = packing.pack(
      jax.tree.map(jnp.asarray, upd),
      jnp.asarray(plan.row_of),
      jnp.asarray(plan.offset_of),
      rows=plan.rows,
      num_micro=1,
  )
  return upd, packed, c


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma2", "tiny-gemma3"])
def test_packed_logprobs_equal_the_padded_forward(preset):
  """Every completion token's log-prob from packed rows equals the padded forward's (1e-6,
  f32); Gemma's windows (5 and 4 tokens here) are shorter than the sequences, so a window
  counted in slots of the packed row rather than positions of the sequence would differ."""
  cfg = dataclasses.replace(PRESETS[preset], dtype="float32", param_dtype="float32")
  model = build_model(cfg, seed=0)
  assert not model.kernels.fused_attention
  upd, packed, c = _batch(cfg.vocab_size)
  padded = jax.jit(completion_logprobs, static_argnums=3)(
      model, upd["input_ids"], upd["attention_mask"], c
  )
  got = jax.jit(packed_logprobs)(
      model, packed["input_ids"], packed["segment_ids"], packed["positions"], packed["head_slots"]
  )
  got = packing.unpack(got, packed["sequences"]["slot"])
  m = upd["completion_mask"] > 0
  np.testing.assert_allclose(np.where(m, got, 0), np.where(m, padded, 0), rtol=1e-6, atol=1e-6)


def test_a_segment_never_sees_another():
  """Changing every token of the other sequences in the packed rows leaves a sequence's
  log-probs bit-identical."""
  cfg = dataclasses.replace(PRESETS["tiny-gemma2"], dtype="float32", param_dtype="float32")
  model = build_model(cfg, seed=1)
  _, packed, _ = _batch(cfg.vocab_size, seed=1)
  seg = np.asarray(packed["segment_ids"])
  row = int(np.argmax((seg > 0).sum(1) - (seg.max(1) == seg.min(1))))  # a row of several
  mine = seg == seg[row, seg[row] > 0][-1]  # the row's last sequence
  every = jnp.arange(seg.size).reshape(seg.shape)  # the LM head on every slot
  fn = jax.jit(packed_logprobs)
  base = fn(model, packed["input_ids"], packed["segment_ids"], packed["positions"], every)
  other_ids = jnp.where(mine, packed["input_ids"], (packed["input_ids"] + 7) % cfg.vocab_size)
  moved = fn(model, other_ids, packed["segment_ids"], packed["positions"], every)
  first = np.argmax(mine, axis=1)  # a sequence's first slot reads the slot before it: not its
  mine[np.arange(len(first)), first] = False
  assert mine.sum() > 3
  np.testing.assert_array_equal(np.asarray(moved)[mine], np.asarray(base)[mine])
  assert not np.array_equal(
      np.asarray(moved)[~mine & (seg > 0)], np.asarray(base)[~mine & (seg > 0)]
  )


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gemma3"])
def test_fused_path_passes_segments(preset):
  """The fused attention's path (Kernels.fused_attention; on CPU `segment_attention`'s masked
  form) reads the packed rows' segment ids: its log-probs are the padded forward's (1e-6, f32).
  Gemma 3 scanned: local and global layers in one scan (the window under lax.cond)."""
  cfg = dataclasses.replace(
      PRESETS[preset], dtype="float32", param_dtype="float32", scan_layers=preset != "tiny-qwen3"
  )
  padded_model = build_model(cfg, seed=0)
  model = Transformer(cfg, rngs=nnx.Rngs(0), kernels=Kernels("cpu", True, False))
  nnx.update(model, nnx.state(padded_model))
  upd, packed, c = _batch(cfg.vocab_size)
  padded = jax.jit(completion_logprobs, static_argnums=3)(
      padded_model, upd["input_ids"], upd["attention_mask"], c
  )
  got = jax.jit(packed_logprobs)(
      model, packed["input_ids"], packed["segment_ids"], packed["positions"], packed["head_slots"]
  )
  got = packing.unpack(got, packed["sequences"]["slot"])
  m = upd["completion_mask"] > 0
  np.testing.assert_allclose(np.where(m, got, 0), np.where(m, padded, 0), rtol=1e-6, atol=1e-6)


def _segments(b, t, seed):
  """[b, t] packed rows' segment ids: ragged sequences (1 to t/2 slots, a 1-slot one among
  them), ids unique per row but not 1..n (rl/packing.py's are), padding (0) at the row's end
  (none in the last row)."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((b, t), np.int32)
  for r in range(b):
    at, sid = 0, 3 * r + 1
    while at < t - 4 or (r == b - 1 and at < t):
      n = min(1 if at == 0 and r == 0 else int(rng.integers(1, t // 2)), t - at)
      seg[r, at : at + n] = sid
      at, sid = at + n, sid + 1
  return jnp.asarray(seg)


KERNEL_CASES = [  # (kernel, window, softcap)
    ("splash", None, 0.0),
    ("splash", 5, 0.0),
    ("splash", 7, 3.0),
    ("triton", None, 0.0),
]


@pytest.mark.parametrize("kernel,window,softcap", KERNEL_CASES)
def test_segment_kernels_equal_the_masked_attention(kernel, window, softcap):
  """TPU's splash attention and GPU's Triton flash attention with segment ids, in Pallas's
  interpreter, against the masked attention on packed rows (`segment_mask`): outputs of real
  tokens and the gradients of q, k, v (1e-5, f32), grouped-query heads (4 query, 2 kv), ragged
  segments, padding at the rows' ends, T = 40 (the kernels pad it to 128), head_dim 64."""
  b, t, h, g, kd = 3, 40, 4, 2, 64
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(b, t, h, kd)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(b, t, g, kd)), jnp.float32) for _ in range(2))
  seg = _segments(b, t, seed=1)
  assert (seg == 0).any() and len(np.unique(seg[0])) > 3
  real = (seg > 0)[:, :, None, None]
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * real  # padding's outputs unread

  def fused(q, k, v):
    if kernel == "triton":
      return attention.triton_attention(q, k, v, seg, interpret=True)
    return attention.segment_attention(
        q, k, v, seg, platform="tpu", window=window, softcap=softcap, interpret=True
    )

  def masked(q, k, v):
    return attention.attention(q, k, v, attention.segment_mask(seg, window), softcap=softcap)

  np.testing.assert_allclose(fused(q, k, v) * real, masked(q, k, v) * real, rtol=1e-5, atol=1e-5)
  grads = [jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2)) for f in (fused, masked)]
  for got, want in zip(grads[0](q, k, v), grads[1](q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_segment_mask_is_the_packed_rows_mask():
  """`segment_mask` by slots == Block.forward's masked form by positions (restarting at 0 in
  each sequence) on contiguous segments: causal within a sequence, no padding, windows."""
  seg = _segments(3, 24, seed=2)
  starts = jnp.concatenate([jnp.ones((3, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  slots = jnp.arange(24)
  first = jax.lax.cummax(jnp.where(starts, slots, 0), axis=1)
  pos = slots - first
  for window in (None, 3):
    want = (
        (seg[:, None, :] > 0)
        & (seg[:, :, None] == seg[:, None, :])
        & (slots[None, :] <= slots[:, None])
    )
    if window is not None:
      want &= pos[:, :, None] - pos[:, None, :] < window
    np.testing.assert_array_equal(attention.segment_mask(seg, window), want)
