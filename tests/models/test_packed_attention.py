"""Packed rows through the decoder (models/logprobs.py: packed_logprobs): a sequence's log-probs
are the padded forward's, attention never crosses a segment, Gemma's sliding windows count
positions within the sequence, and the fused kernels refuse segments rather than mix them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.decoder.transformer import Transformer
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.logprobs import packed_logprobs
from grpo_jax.rl import packing
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
  plan = packing.plan_rows(am.sum(1), p + c)
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


def test_fused_attention_refuses_packed_rows():
  cfg = dataclasses.replace(PRESETS["tiny-qwen3"], dtype="float32", param_dtype="float32")
  model = Transformer(cfg, rngs=nnx.Rngs(0), kernels=Kernels("cpu", True, False))
  ids = jnp.ones((2, 8), jnp.int32)
  with pytest.raises(ValueError, match="segment ids"):
    model.packed_hidden(ids, ids, jnp.zeros_like(ids))
