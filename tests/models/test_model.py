"""The native decoder's modes agree, remat/scan change nothing numerically, sharded init works."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.parallel import sharding
from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.models import chunked_token_logprobs
from grpo_jax.models import completion_logprobs
from grpo_jax.models.decoder import attention
from grpo_jax.models.decoder import layers
from grpo_jax.models.decoder.cache import grow_cache
from grpo_jax.models.decoder.cache import sampling_copy
from grpo_jax.models.decoder.cache import share_prompt
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.decoder.transformer import _write_kv as write_kv
from grpo_jax.models import token_logprobs
from grpo_jax.models.decoder.config import REMAT_POLICIES

CFGS = {
    "qwen3": PRESETS["tiny-qwen3"],
    "llama3": PRESETS["tiny-llama3"],
    "gemma2": PRESETS["tiny-gemma2"],
    "gemma3": PRESETS["tiny-gemma3"],
}


def prompts_and_completions(vocab, seed=0):
  """Left-padded prompts of different lengths and right-padded completions (EOS then pads)."""
  rng = np.random.default_rng(seed)
  b, p, l = 4, 9, 6
  prompt = rng.integers(1, vocab, (b, p))
  plen = np.array([9, 4, 1, 6])
  pmask = (np.arange(p)[None] >= (p - plen)[:, None]).astype(np.int32)
  prompt = np.where(pmask > 0, prompt, 0)
  comp = rng.integers(1, vocab, (b, l))
  clen = np.array([6, 3, 1, 5])  # rows stop early: the rest is padding
  cmask = (np.arange(l)[None] < clen[:, None]).astype(np.int32)
  comp = np.where(cmask > 0, comp, 0)
  return [jnp.asarray(x) for x in (prompt, pmask, comp, cmask)]


def repeat_cache(cache: dict, n: int) -> dict:
  """Each row's cache repeated n times, group-major (row i -> rows i*n .. i*n+n-1): the plain
  layout of a group's caches, the reference for share_prompt's."""
  rep = lambda x: jnp.repeat(x, n, axis=x.ndim - 4)  # noqa: E731  (the batch axis)
  return dict(
      k=jax.tree.map(rep, cache["k"]),
      v=jax.tree.map(rep, cache["v"]),
      valid=jnp.repeat(cache["valid"], n, axis=0),
      index=cache["index"],
      pos=jnp.repeat(cache["pos"], n, axis=0),
  )


def reference_attention(q_bthk, cache_k, cache_v, k1, v1, q_slot_bt, valid_bs, window, softcap):
  """The decode step's attention read-then-append: the cache [B, Hkv, S, K] as it was before
  the step (its valid slots at or before the query's), then the token's own key/value
  appended ([B, 1, Hkv, K]) instead of written first; f32 softmax (the reference for
  Block.decode, which writes first and reads the written cache)."""
  b, t, h, kd = q_bthk.shape
  g, s = cache_k.shape[1:3]
  q = q_bthk.reshape(b, t, g, h // g, kd)

  def cap(x):
    return jnp.tanh(x / softcap) * softcap if softcap else x

  logits = cap(
      jnp.einsum("btgrk,bgsk->bgrts", q, cache_k, preferred_element_type=jnp.float32) * kd**-0.5
  )
  allowed = attention.slot_mask(q_slot_bt, jnp.arange(s), valid_bs, window)
  logits = jnp.where(allowed[:, None, None], logits, jnp.finfo(jnp.float32).min)
  own = cap(
      jnp.einsum("btgrk,btgk->bgrt", q, k1, preferred_element_type=jnp.float32)[..., None]
      * kd**-0.5
  )
  probs = jax.nn.softmax(jnp.concatenate([logits, own], axis=-1), axis=-1).astype(cache_v.dtype)
  out = jnp.einsum("bgrts,bgsk->bgrtk", probs[..., :-1], cache_v)
  out = out + jnp.einsum("bgrt,btgk->bgrtk", probs[..., -1], v1)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, kd)


def reference_decode(model, token_b, cache):
  """`model.decode` on a plain cache (no shared prompt), each layer reading its cache and
  appending the token's key/value (`reference_attention`); the cache written after all layers."""
  index = cache["index"]
  positions = cache["pos"][:, None]
  q_slot = jnp.full(positions.shape, index)

  def step(block, x, cache_kv, local):
    q, k, v = block.attn.project_qkv(block.attn_norm(x), positions, local)
    a = reference_attention(
        q,
        *cache_kv,
        k,
        v,
        q_slot,
        cache["valid"],
        block._window(local),
        block.cfg.attn_logit_softcap
    )
    return block._residual(x, a, model.kernels)[0], (k, v)  # (x, the MoE routes)

  x, (ks, vs) = model._run_layers(step, model._embed(token_b[:, None]), (cache["k"], cache["v"]))
  logits = model.logits_from_hidden(model.final_norm(x))[:, 0]
  valid = jax.lax.dynamic_update_slice(
      cache["valid"], jnp.ones_like(cache["valid"][:, :1]), (0, index)
  )
  cache = dict(
      cache,
      k=write_kv(cache["k"], ks, index),
      v=write_kv(cache["v"], vs, index),
      valid=valid,
      index=index + 1,
      pos=cache["pos"] + 1,
  )
  return logits, cache


def decode_logprobs(model, prompt, pmask, comp, repeat=1, shared=False, reference=False):
  """Prefill + teacher-forced decode (each step jitted); log-prob of each completion token.
  `shared`: the sampler's layout (share_prompt: one copy of the prompt's keys per group, the
  new tokens' cache starting at 2 slots and grown to the completion length after 2 steps).
  `reference`: `reference_decode` instead of model.decode (a plain cache)."""
  b, p = prompt.shape
  l = comp.shape[1]
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda s, *a: nnx.merge(graphdef, s).prefill(*a))
  if reference:
    decode = jax.jit(lambda s, *a: reference_decode(nnx.merge(graphdef, s), *a))
  else:
    decode = jax.jit(lambda s, *a: nnx.merge(graphdef, s).decode(*a))
  cache = model.init_cache(b, p if shared else p + l)
  logits, cache = prefill(state, prompt, pmask, cache)
  if shared:
    cache = share_prompt(cache, repeat, 2)
  elif repeat > 1:
    cache = repeat_cache(cache, repeat)
  logits = jnp.repeat(logits, repeat, axis=0)
  comp = jnp.repeat(comp, repeat, axis=0)
  out = []
  for t in range(l):
    out.append(jax.nn.log_softmax(logits, -1)[jnp.arange(comp.shape[0]), comp[:, t]])
    if shared and t == 2:
      cache = grow_cache(cache, l)
    logits, cache = decode(state, comp[:, t], cache)
  return jnp.stack(out, 1)


@pytest.mark.parametrize(
    "arch,scan",
    [  # suite time: -m slow runs the other two
        ("qwen3", True),
        ("llama3", False),
        pytest.param("qwen3", False, marks=pytest.mark.slow),
        pytest.param("llama3", True, marks=pytest.mark.slow),
        ("gemma3", True),
        pytest.param("gemma2", False, marks=pytest.mark.slow),
    ],
)  # windows < rows
def test_prefill_decode_equals_training_forward(arch, scan):
  model = build_model(CFGS[arch].replace(scan_layers=scan), seed=1)
  prompt, pmask, comp, cmask = prompts_and_completions(model.cfg.vocab_size)
  ids = jnp.concatenate([prompt, comp], 1)
  mask = jnp.concatenate([pmask, cmask], 1)
  train = nnx.jit(completion_logprobs, static_argnums=3)(model, ids, mask, comp.shape[1])
  dec = decode_logprobs(model, prompt, pmask, comp)  # the model's own decode, scanned or not
  diff = np.abs(np.asarray(train - dec))[np.asarray(cmask) > 0]
  assert diff.max() <= 1e-5, diff.max()
  if scan:  # the reference decode of a stacked cache, read-then-append (reference_decode)
    ref = decode_logprobs(model, prompt, pmask, comp, reference=True)
    ref_diff = np.abs(np.asarray(train - ref))[np.asarray(cmask) > 0]
    assert ref_diff.max() <= 1e-5, ref_diff.max()
  # Repeating the cache G times (group sampling), and the sampler's layout (the prompt's keys
  # once per group, a cache that grows mid-way, on the model the sampler runs: sampling_copy).
  # Unscanned: every layout gives the plain decode's log-probs (1e-6). Scanned: the stacked
  # cache is written inside the layer scan and the sampler's copy has one cache per layer, so
  # the layouts sum in other orders, a few f32 ulps apart (up to 1.9e-6 seen on jax 0.11.2):
  # each is held to the training forward as the decode is (1e-5).
  dec3 = decode_logprobs(model, prompt, pmask, comp, repeat=3)
  sampler_model = sampling_copy(model)
  shared = decode_logprobs(sampler_model, prompt, pmask, comp, repeat=3, shared=True)
  shared1 = decode_logprobs(sampler_model, prompt, pmask, comp, shared=True)
  layouts = [dec3[::3], dec3[2::3], shared[::3], shared[1::3], shared[2::3], shared1]
  for got in layouts:
    if scan:
      got_diff = np.abs(np.asarray(train - got))[np.asarray(cmask) > 0]
      assert got_diff.max() <= 1e-5, got_diff.max()
    else:
      np.testing.assert_allclose(got, dec, atol=1e-6)


def read_then_append(q, cache_k, cache_v, k1, v1, q_slot, valid, prefix, softcap):
  """NumPy reference of a decode step's attention, the cache read before the new token's key
  is written: each query attends to its group's valid prompt keys, the cache's valid slots at
  or before its own, and its own key/value appended. q, k1, v1 [B, 1, H or Hkv, K]; cache
  [B, Hkv, S, K]; q_slot [B]; valid [B, S]; prefix (pk, pv, p_valid) [B/G, Hkv, P, K], [B/G, P]."""
  q, cache_k, cache_v, k1, v1 = (np.asarray(a, np.float64) for a in (q, cache_k, cache_v, k1, v1))
  pk, pv, p_valid = (np.asarray(a) for a in prefix)
  b, _, h, kd = q.shape
  hkv, s = cache_k.shape[1:3]
  group = b // pk.shape[0]
  out = np.zeros_like(q)
  for i in range(b):
    for j in range(h):
      g = j // (h // hkv)
      seen = (valid[i] != 0) & (np.arange(s) <= q_slot[i])
      p_ok = p_valid[i // group] != 0
      keys = np.concatenate([pk[i // group, g][p_ok], cache_k[i, g][seen], k1[i, :, g]])
      values = np.concatenate([pv[i // group, g][p_ok], cache_v[i, g][seen], v1[i, :, g]])
      scores = keys @ q[i, 0, j] / np.sqrt(kd)
      if softcap:
        scores = np.tanh(scores / softcap) * softcap
      probs = np.exp(scores - scores.max())
      out[i, 0, j] = probs @ values / probs.sum()
  return out


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_decode_writes_then_reads_like_read_then_append(softcap):
  """Block.decode's attention (the token's key/value written into the cache first, then the
  written cache read: the cache updates in place) equals reading the cache and appending the
  token's own key/value (f32: 1e-6), over a shared prompt per group of 2 rows, GQA groups of 2,
  rows with different slots written."""
  b, g, hkv, r, kd, s, p = 4, 2, 2, 2, 16, 8, 5
  ks = jax.random.split(jax.random.key(0), 7)
  q = jax.random.normal(ks[0], (b, 1, hkv * r, kd))
  cache_k = jax.random.normal(ks[1], (b, hkv, s, kd))
  cache_v = jax.random.normal(ks[2], (b, hkv, s, kd))
  k1, v1 = (jax.random.normal(kk, (b, 1, hkv, kd)) for kk in ks[3:5])
  prefix = (
      jax.random.normal(ks[5], (b // g, hkv, p, kd)),
      jax.random.normal(ks[6], (b // g, hkv, p, kd)),
      jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32),
  )
  slot = 5
  valid = np.ones((b, s), np.int32)
  valid[1, :3] = 0  # slots a row has not written
  valid[:, slot:] = 0
  want = read_then_append(q, cache_k, cache_v, k1, v1, np.full(b, slot), valid, prefix, softcap)
  written_k, written_v = (c.at[:, :, slot].set(n[:, 0]) for c, n in ((cache_k, k1), (cache_v, v1)))
  valid[:, slot] = 1
  q_slot = jnp.full((b, 1), slot)
  got = attention.cache_attention(
      q,
      written_k,
      written_v,
      attention.slot_mask(q_slot, jnp.arange(s), jnp.asarray(valid)),
      prefix,
      attention.prefix_mask(prefix[2], q_slot),
      softcap=softcap,
  )
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_jitted_decode_as_while_loop_carry():
  model = build_model(CFGS["qwen3"], seed=2)
  prompt, pmask, comp, cmask = prompts_and_completions(97, seed=3)
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, prompt, pmask, comp):
    m = nnx.merge(graphdef, state)
    cache = m.init_cache(prompt.shape[0], prompt.shape[1] + comp.shape[1])
    logits, cache = m.prefill(prompt, pmask, cache)

    def body(carry):
      t, logits, cache, out = carry
      lp = jax.nn.log_softmax(logits, -1)[jnp.arange(comp.shape[0]), comp[:, t]]
      logits, cache = m.decode(comp[:, t], cache)
      return t + 1, logits, cache, out.at[:, t].set(lp)

    init = (0, logits, cache, jnp.zeros(comp.shape, jnp.float32))
    return jax.lax.while_loop(lambda c: c[0] < comp.shape[1], body, init)[3]

  got = run(state, prompt, pmask, comp)
  want = decode_logprobs(model, prompt, pmask, comp)
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_scanned_equals_unscanned_on_same_weights():
  cfg = CFGS["qwen3"]
  plain = build_model(cfg, seed=4)
  scanned = build_model(cfg.replace(scan_layers=True), seed=0)
  # Stack the unscanned layers' weights into the scanned model.
  layer_states = [nnx.state(blk) for blk in plain.layers]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layer_states)
  nnx.update(scanned.layers, stacked)
  for name in ("embed", "lm_head"):
    getattr(scanned, name)[...] = getattr(plain, name)[...]
  prompt, pmask, comp, cmask = prompts_and_completions(97, seed=5)
  ids = jnp.concatenate([prompt, comp], 1)
  mask = jnp.concatenate([pmask, cmask], 1)
  np.testing.assert_allclose(scanned(ids, mask), plain(ids, mask), atol=1e-5)


REMAT_CASES = [(p, False) for p in REMAT_POLICIES if p != "none"] + [
    ("full", True),
    ("offload_dots", True),
]


@pytest.mark.parametrize("policy,scan", REMAT_CASES)
def test_remat_policies_keep_loss_and_gradients(policy, scan):
  cfg = CFGS["llama3"].replace(scan_layers=scan)
  base = build_model(cfg, seed=6)
  remat = build_model(cfg.replace(remat_policy=policy), seed=6)
  prompt, pmask, comp, cmask = prompts_and_completions(cfg.vocab_size, seed=7)
  ids = jnp.concatenate([prompt, comp], 1)
  mask = jnp.concatenate([pmask, cmask], 1)

  def loss(model):
    lp = completion_logprobs(model, ids, mask, comp.shape[1])
    return -(lp * cmask).sum() / cmask.sum()

  grad_fn = nnx.jit(nnx.value_and_grad(loss))
  l0, g0 = grad_fn(base)
  l1, g1 = grad_fn(remat)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  # Recomputation changes f32 summation order only: compare at f32 precision of the largest
  # gradient entry (gradients here are ~1e-2; 1e-6 absolute is ~1e-4 of that scale).
  for a, b in zip(jax.tree.leaves(nnx.state(g0)), jax.tree.leaves(nnx.state(g1))):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_random_init_loss_is_near_log_vocab():
  cfg = PRESETS["tiny-qwen3"].replace(vocab_size=1000, num_layers=4)
  model = build_model(cfg, seed=0)
  ids = jax.random.randint(jax.random.key(0), (4, 32), 0, cfg.vocab_size)
  logits = model(ids)
  nll = -token_logprobs(logits[:, :-1], ids[:, 1:]).mean()
  assert abs(float(nll) - np.log(cfg.vocab_size)) < 0.5, float(nll)


def test_sharded_init_on_8_device_mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  mesh = sharding.make_mesh(2, 2, 2)
  cfg = CFGS["qwen3"].replace(vocab_size=96)
  model = build_model(cfg, seed=8, mesh=mesh)
  P = jax.sharding.PartitionSpec
  assert model.embed[...].sharding.spec == P("tensor", "fsdp")
  assert model.layers[0].mlp.down[...].sharding.spec == P("tensor", "fsdp")
  assert model.layers[0].attn.o[...].sharding.spec == P("tensor", None, "fsdp")
  # kv_heads=2 over tensor=2 shards; each device holds a quarter of q.
  q = model.layers[0].attn.q[...]
  assert q.addressable_shards[0].data.shape == (32, 2, 24)
  # Same numbers as the unsharded model with the same seed.
  ref = build_model(cfg, seed=8)
  ids = jax.random.randint(jax.random.key(1), (4, 8), 0, 96)
  np.testing.assert_allclose(model(ids), ref(ids), atol=1e-5)
  # Scanned layers get the "layers" axis prepended and replicated.
  scanned = build_model(cfg.replace(scan_layers=True), seed=8, mesh=mesh)
  assert scanned.layers.attn.q[...].sharding.spec == P(None, "fsdp", "tensor", None)


def test_logprob_helpers_match_log_softmax_with_gradients():
  rng = jax.random.key(9)
  h = jax.random.normal(rng, (3, 37, 16))
  w = jax.random.normal(jax.random.key(10), (16, 50)) * 0.3
  tok = jax.random.randint(jax.random.key(11), (3, 37), 0, 50)

  def ref(h, w, temp):
    lp = jax.nn.log_softmax((h @ w) / temp, -1)
    return jnp.take_along_axis(lp, tok[..., None], -1)[..., 0]

  for temp in (1.0, 0.7):
    want = ref(h, w, temp)
    np.testing.assert_allclose(token_logprobs(h @ w, tok, temp), want, atol=1e-5)
    np.testing.assert_allclose(
        chunked_token_logprobs(h, w, tok, temp, chunk_size=8), want, atol=1e-5
    )
    g_ref = jax.grad(lambda h, w: ref(h, w, temp).sum(), (0, 1))(h, w)
    for remat in (True, False):  # logits recomputed in the backward pass, or kept
      g = jax.grad(lambda h, w: chunked_token_logprobs(h, w, tok, temp, 8, remat).sum(), (0, 1))(
          h, w
      )
      for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-5)


def test_lm_head_logits_are_recomputed_unless_remat_policy_is_none():
  """remat_policy="none" keeps the head's logits for the backward (no checkpoint around the
  chunk: one [c, D] x [D, V] product fewer); every other policy recomputes them. Same grads."""
  cfg = CFGS["qwen3"]
  ids = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
  mask = jnp.ones_like(ids)
  grads = {}
  for policy in ("none", "full", "save_dots"):
    graphdef, params = nnx.split(build_model(cfg.replace(remat_policy=policy), seed=3))
    loss = lambda p: completion_logprobs(nnx.merge(graphdef, p), ids, mask, 5).sum()
    remats = str(jax.make_jaxpr(loss)(params)).count("remat")  # jax.checkpoint's primitive
    # one per layer under a remat policy, plus the head's chunk: none of either with "none"
    assert remats == (0 if policy == "none" else cfg.num_layers + 1), (policy, remats)
    grads[policy] = jax.grad(loss)(params)
  for policy in ("full", "save_dots"):
    for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[policy])):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_padding_tokens_do_not_change_real_logits():
  model = build_model(CFGS["qwen3"], seed=12)
  prompt, pmask, comp, cmask = prompts_and_completions(97, seed=13)
  ids = jnp.concatenate([prompt, comp], 1)
  mask = jnp.concatenate([pmask, cmask], 1)
  garbage = jnp.where(mask > 0, ids, jax.random.randint(jax.random.key(0), ids.shape, 0, 97))
  a, b = model(ids, mask), model(garbage, mask)
  np.testing.assert_allclose(
      np.asarray(a)[np.asarray(mask) > 0], np.asarray(b)[np.asarray(mask) > 0], atol=1e-6
  )


@pytest.mark.parametrize("fused", [True, False])
def test_swiglu_custom_vjp_matches_autodiff(fused):
  """The hand-written SwiGLU backward (gate/up as one GEMM or two) equals autodiff of
  silu(x @ w_gate) * (x @ w_up), f32 to ~1e-6 relative; bf16 inputs give bf16 gradients."""

  def swiglu(*a):
    return layers.swiglu(*a, fused)

  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (48, 32))
  wg, wu = (jax.random.normal(kk, (32, 80)) * 0.2 for kk in k[1:3])
  dh = jax.random.normal(k[3], (48, 80))
  ours = jax.grad(lambda *a: jnp.sum(swiglu(*a) * dh), argnums=(0, 1, 2))(x, wg, wu)
  ref = jax.grad(lambda x, wg, wu: jnp.sum(jax.nn.silu(x @ wg) * (x @ wu) * dh), argnums=(0, 1, 2))(
      x, wg, wu
  )
  np.testing.assert_allclose(
      swiglu(x, wg, wu), jax.nn.silu(x @ wg) * (x @ wu), rtol=1e-6, atol=1e-6
  )
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
  bf = [a.astype(jnp.bfloat16) for a in (x, wg, wu)]
  grads = jax.grad(lambda *a: jnp.sum(swiglu(*a).astype(jnp.float32)), argnums=(0, 1, 2))(*bf)
  assert all(g.dtype == jnp.bfloat16 for g in grads)


@pytest.mark.parametrize("scan", [False, True])
def test_fused_attention_path_equals_masked_attention(scan):
  """attention_impl="fused" (real tokens moved first, one causal kernel: cuDNN flash on GPU,
  its XLA form here) gives the masked einsum's hidden states, prefill logits and caches, and
  gradients, for left padding, right padding and holes in the mask."""
  cfg = CFGS["qwen3"].replace(scan_layers=scan)
  masked = build_model(cfg, seed=2)
  graphdef, state = nnx.split(build_model(cfg.replace(attention_impl="fused"), seed=2))
  fused = nnx.merge(graphdef, nnx.state(masked))
  assert fused.kernels.fused_attention and not masked.kernels.fused_attention
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (4, 12)), jnp.int32)
  mask = np.ones((4, 12), np.int32)
  mask[0, :5] = 0  # left padding
  mask[1, 7:] = 0  # right padding
  mask[2, [0, 3, 4, 9]] = 0  # holes
  mask = jnp.asarray(mask)
  m = mask[..., None] > 0
  h_masked, h_fused = masked.hidden(ids, mask), fused.hidden(ids, mask)
  assert float(jnp.abs(jnp.where(m, h_masked - h_fused, 0)).max()) <= 1e-5
  lo, co = masked.prefill(ids, mask, masked.init_cache(4, 12), all_logits=True)
  lf, cf = fused.prefill(ids, mask, fused.init_cache(4, 12), all_logits=True)
  assert float(jnp.abs(jnp.where(m, lo - lf, 0)).max()) <= 1e-4
  last_o, _ = masked.prefill(ids, mask, masked.init_cache(4, 12))
  last_f, _ = fused.prefill(ids, mask, fused.init_cache(4, 12))
  real_last = np.asarray([0, 2, 3])  # rows whose last slot is a real token
  np.testing.assert_allclose(last_o[real_last], last_f[real_last], atol=1e-4)
  for a, b in zip(jax.tree.leaves((co["k"], co["v"])), jax.tree.leaves((cf["k"], cf["v"]))):
    slot = mask[:, None, :, None] > 0 if a.ndim == 4 else mask[None, :, None, :, None] > 0
    assert float(jnp.abs(jnp.where(slot, a - b, 0)).max()) <= 1e-5

  probe = jnp.asarray(rng.standard_normal((4, 12, cfg.hidden_size)), jnp.float32)

  def loss(model):  # linear in the hidden states (a sum of squares of an RMSNorm output is
    return jnp.sum(jnp.where(m, model.hidden(ids, mask), 0) * probe)  # ~constant: no gradient)

  g_masked, g_fused = nnx.grad(loss)(masked), nnx.grad(loss)(fused)
  for a, b in zip(jax.tree.leaves(nnx.state(g_masked)), jax.tree.leaves(nnx.state(g_fused))):
    np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-4)  # gradients of size ~10-70


def test_attention_impl_auto_picks_the_fused_kernel_on_gpu_only():
  cfg = CFGS["qwen3"].replace(dtype="bfloat16", head_dim=64)
  assert Kernels.resolve(cfg, "cuda").fused_attention
  assert not Kernels.resolve(cfg.replace(dtype="float32"), "cuda").fused_attention  # cuDNN: bf16
  assert not Kernels.resolve(cfg.replace(attention_impl="xla"), "cuda").fused_attention
  for platform in ("cpu", "tpu"):
    assert not Kernels.resolve(cfg, platform).fused_attention
    assert Kernels.resolve(cfg.replace(attention_impl="fused"), platform).fused_attention
  # The gate/up GEMM fusion is an XLA:CPU tuning only.
  assert [Kernels.resolve(cfg, p).fuse_gate_up for p in ("cpu", "gpu", "tpu")] == [
      True,
      False,
      False,
  ]


def test_splash_attention_equals_causal_attention_under_a_mesh():
  """The TPU kernel (Pallas splash attention, run by Pallas's interpreter here): the causal
  attention's values and gradients, T padded to 128s, grouped-query heads, rows and heads
  split over an 8-device (data, fsdp, tensor) mesh by its shard_map."""
  rng = np.random.default_rng(0)
  b, t, h, g, kd = 4, 200, 4, 2, 128
  q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, kd)), jnp.float32) for n in (h, g, g))
  want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  dwant = jax.grad(
      lambda q, k: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2),
      argnums=(0, 1),
  )(q, k)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  splash = jax.jit(lambda q, k, v: attention.splash_attention(q, k, v, interpret=True))
  dsplash = jax.jit(
      jax.grad(
          lambda q, k: jnp.sum(attention.splash_attention(q, k, v, interpret=True) ** 2),
          argnums=(0, 1),
      )
  )
  with jax.set_mesh(mesh):
    got = splash(q, k, v)
    dgot = dsplash(q, k)
  np.testing.assert_allclose(got, want, atol=2e-5)
  for a, w in zip(dgot, dwant):
    np.testing.assert_allclose(a, w, atol=2e-4, rtol=1e-4)
