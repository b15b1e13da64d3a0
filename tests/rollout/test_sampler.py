"""The rollout sampler: exact log-probs, greedy parity with transformers, sampling statistics."""

from flax import nnx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from grpo_jax.parallel import sharding
from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.models import completion_logprobs
from grpo_jax.rollout import GenerationConfig
from grpo_jax.rollout import Sampler
from grpo_jax.rollout import sample
from grpo_jax.rollout import sampling
from grpo_jax.rollout.sampler import phase_ends

CFG = PRESETS["tiny-qwen3"]


@pytest.fixture(scope="module")
def model():
  return build_model(CFG, seed=0)


def prompts(vocab, seed=0, b=4, p=7):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, vocab, (b, p))
  lens = np.array([7, 3, 1, 5, 6, 2, 4, 7])[:b]
  mask = (np.arange(p)[None] >= (p - lens)[:, None]).astype(np.int32)
  return jnp.asarray(np.where(mask > 0, ids, 0), jnp.int32), jnp.asarray(mask)


def trainer_logprobs(model, prompt_ids, prompt_mask, r, g, temperature=1.0):
  ids = jnp.concatenate([jnp.repeat(prompt_ids, g, 0), r.tokens], 1)
  mask = jnp.concatenate([jnp.repeat(prompt_mask, g, 0), r.mask], 1)
  return completion_logprobs(model, ids, mask, r.tokens.shape[1], temperature)


@pytest.mark.parametrize(
    "gen", ["greedy", "standard", "liberal", GenerationConfig(temperature=1.0)]
)
def test_sampled_logprobs_equal_training_forward(model, gen):
  ids, mask = prompts(CFG.vocab_size)
  r = sample(
      model,
      ids,
      mask,
      num_generations=3,
      max_new_tokens=9,
      rng=jax.random.key(1),
      generation=gen,
      eos_ids=(5, 9),
  )
  m = np.asarray(r.mask) > 0
  train = np.asarray(trainer_logprobs(model, ids, mask, r, 3))
  assert np.abs(train - np.asarray(r.raw_logprobs))[m].max() <= 1e-5
  if isinstance(gen, GenerationConfig):  # no truncation, T=1: sampled == raw
    assert np.abs(train - np.asarray(r.logprobs))[m].max() <= 1e-5
  assert np.all(np.asarray(r.logprobs)[~m] == 0) and np.all(np.asarray(r.raw_logprobs)[~m] == 0)


@pytest.mark.parametrize("scan", [False, True])
def test_decode_phases_keep_tokens_and_logprobs(scan):
  """Decoding in 3 loops over a growing cache (and the prompt's keys shared by the group)
  draws the same tokens as one loop, with the trainer's log-probs."""
  model = build_model(CFG.replace(scan_layers=scan), seed=3)
  ids, mask = prompts(CFG.vocab_size, seed=6)
  graphdef, state = nnx.split(model)
  out = {}
  for phases in (1, 3):
    s = Sampler(
        graphdef,
        max_prompt_length=7,
        max_new_tokens=24,
        num_generations=3,
        eos_ids=(5,),
        decode_phases=phases,
    )
    assert len(s.phase_ends) == phases and s.phase_ends[-1] == 24
    out[phases] = s(state, ids, mask, jax.random.key(4), GenerationConfig(temperature=1.0))
  np.testing.assert_array_equal(out[1].tokens, out[3].tokens)
  np.testing.assert_allclose(out[1].logprobs, out[3].logprobs, atol=1e-6)
  m = np.asarray(out[3].mask) > 0
  assert m.sum() > 3 * 24  # the rows ran into the later phases
  train = np.asarray(trainer_logprobs(model, ids, mask, out[3], 3))
  assert np.abs(train - np.asarray(out[3].raw_logprobs))[m].max() <= 1e-5


def test_phase_ends():
  assert phase_ends(128) == (32, 64, 96, 128)
  assert phase_ends(1024) == (256, 512, 768, 1024)
  assert phase_ends(40) == (20, 40)
  assert phase_ends(10) == (10,)
  assert phase_ends(100, 3) == (34, 67, 100)
  assert phase_ends(12, 4) == (12,)  # phases of at least 8 tokens
  assert phase_ends(128, 0) == phase_ends(128)  # 0 = auto
  assert phase_ends(128, 0, "tpu") == (128,)  # auto: growing the cache costs memory there
  assert phase_ends(128, 2, "gpu") == (64, 128)
  assert phase_ends(512, 0, "gpu") == (128, 256, 384, 512)  # auto: one per 128 on GPU
  assert phase_ends(100, 0, "gpu") == (100,)
  with pytest.raises(ValueError, match="decode_phases=-1"):
    phase_ends(12, -1)


def test_temperature_logprobs_match_scaled_forward(model):
  ids, mask = prompts(CFG.vocab_size, seed=2)
  gen = GenerationConfig(temperature=0.6)
  r = sample(
      model, ids, mask, num_generations=2, max_new_tokens=6, rng=jax.random.key(2), generation=gen
  )
  train = np.asarray(trainer_logprobs(model, ids, mask, r, 2, temperature=0.6))
  np.testing.assert_allclose(np.asarray(r.logprobs), train * np.asarray(r.mask), atol=1e-5)


def test_eos_stops_rows_and_masks_the_rest(model):
  ids, mask = prompts(CFG.vocab_size, seed=3, b=8)
  free = sample(
      model,
      ids,
      mask,
      num_generations=2,
      max_new_tokens=12,
      rng=jax.random.key(3),
      generation=GenerationConfig(temperature=1.5),
  )
  toks = np.asarray(free.tokens)
  stop = int(toks[0, 4])  # a token row 0 emits mid-way: make it a stop token
  r = sample(
      model,
      ids,
      mask,
      num_generations=2,
      max_new_tokens=12,
      rng=jax.random.key(3),
      generation=GenerationConfig(temperature=1.5),
      eos_ids=(stop,),
      pad_id=-7,
  )
  t, m = np.asarray(r.tokens), np.asarray(r.mask)
  saw_stop = False
  for row in range(t.shape[0]):
    hits = np.nonzero(toks[row] == stop)[0]
    if len(hits):  # same rng -> same tokens up to and including the first stop
      k = hits[0]
      saw_stop = True
      np.testing.assert_array_equal(t[row, : k + 1], toks[row, : k + 1])
      assert m[row, : k + 1].all() and not m[row, k + 1 :].any()
      assert (t[row, k + 1 :] == -7).all()
      assert r.lengths[row] == k + 1 and not r.truncated[row]
    else:
      assert m[row].all() and r.truncated[row]
  assert saw_stop


def test_reproducible_for_a_seed_and_different_across_seeds(model):
  ids, mask = prompts(CFG.vocab_size)
  kw = dict(num_generations=4, max_new_tokens=8, generation="liberal")
  a = sample(model, ids, mask, rng=jax.random.key(7), **kw)
  b = sample(model, ids, mask, rng=jax.random.key(7), **kw)
  c = sample(model, ids, mask, rng=jax.random.key(8), **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  # The G samples of a prompt differ from each other.
  assert len({tuple(row) for row in np.asarray(a.tokens)[:4]}) > 1


def test_top_k_1_equals_greedy(model):
  ids, mask = prompts(CFG.vocab_size, seed=4)
  greedy = sample(model, ids, mask, num_generations=1, max_new_tokens=8, rng=jax.random.key(0))
  g = nnx.split(model)
  s = Sampler(g[0], max_prompt_length=7, max_new_tokens=8)
  k1 = s(g[1], ids, mask, jax.random.key(5), GenerationConfig(temperature=1.3, top_k=1))
  np.testing.assert_array_equal(greedy.tokens, k1.tokens)


def test_compiles_once_for_new_params_prompts_and_temperature(model):
  graphdef, state = nnx.split(model)
  s = Sampler(graphdef, max_prompt_length=7, max_new_tokens=4, num_generations=2)
  ids, mask = prompts(CFG.vocab_size)
  s(state, ids, mask, jax.random.key(0), GenerationConfig(temperature=0.9, top_k=5))
  fn = s._compiled[(5, False, False)]
  before = fn._cache_size()
  state2 = jax.tree.map(lambda x: x * 1.01, state)
  ids2, _ = prompts(CFG.vocab_size, seed=9)
  s(state2, ids2, mask, jax.random.key(1), GenerationConfig(temperature=0.5, top_k=5))
  assert fn._cache_size() == before


# ------------------------------------------------------------------- sampling statistics

N_DRAWS = 20000


def draws(logits_v, **kw):
  logits = jnp.broadcast_to(jnp.asarray(logits_v, jnp.float32), (N_DRAWS, len(logits_v)))
  kw = dict(dict(temperature=1.0, top_p=1.0, top_k=0, use_top_p=False, greedy=False), **kw)
  # logits as an argument, not a closure constant (XLA would constant-fold the sort slowly)
  tok, lp, raw = jax.jit(lambda x, k: sampling.sample_token(x, k, **kw))(logits, jax.random.key(11))
  return np.asarray(tok), np.asarray(lp), np.asarray(raw)


LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])


def test_temperature_one_matches_softmax_chi_square():
  tok, lp, raw = draws(LOGITS)
  p = np.exp(LOGITS - LOGITS.max())
  p /= p.sum()
  counts = np.bincount(tok, minlength=len(p))
  chi2, pval = stats.chisquare(counts, p * N_DRAWS)
  assert pval > 1e-4, (chi2, pval)  # fixed seed: deterministic, with a wide margin
  np.testing.assert_allclose(lp, np.log(p)[tok], atol=1e-6)
  np.testing.assert_allclose(raw, np.log(p)[tok], atol=1e-6)


def test_large_vocab_blocked_inverse_cdf_matches_softmax():
  """The two-level inverse-CDF draw (vocabularies > 512, not a multiple of its block) keeps
  softmax's distribution and never draws a masked (-inf) token."""
  rng = np.random.default_rng(5)
  logits = (rng.normal(size=1531) * 2).astype(np.float32)
  logits[::5] = -np.inf
  logits[-1] = -np.inf  # the last real column, next to the block padding
  x = jnp.broadcast_to(jnp.asarray(logits), (N_DRAWS, logits.size))
  tok = np.asarray(jax.jit(sampling.categorical)(jax.random.key(3), x))
  assert tok.min() >= 0 and tok.max() < logits.size
  assert np.isfinite(logits[tok]).all()
  p = np.exp((logits - logits[np.isfinite(logits)].max()).astype(np.float64))
  p /= p.sum()
  counts = np.bincount(tok, minlength=logits.size)
  big = p * N_DRAWS >= 5  # chi-square over well-populated cells, the rest pooled
  obs = np.append(counts[big], counts[~big].sum())
  exp = np.append(p[big], p[~big].sum()) * N_DRAWS
  exp *= obs.sum() / exp.sum()  # float rounding only
  assert stats.chisquare(obs, exp).pvalue > 1e-4


def test_top_k_support_and_renormalized_logprobs():
  tok, lp, raw = draws(LOGITS, top_k=3, temperature=0.8)
  allowed = np.argsort(-LOGITS)[:3]
  assert set(np.unique(tok)) == set(allowed)
  z = LOGITS[allowed] / 0.8
  q = np.exp(z - z.max())
  q /= q.sum()
  want = dict(zip(allowed, np.log(q)))
  np.testing.assert_allclose(lp, [want[t] for t in tok], atol=1e-5)
  counts = np.array([np.sum(tok == a) for a in allowed])
  assert stats.chisquare(counts, q * N_DRAWS).pvalue > 1e-4


@pytest.mark.parametrize("top_p,top_k", [(0.5, 0), (0.8, 0), (0.9, 4), (0.3, 0)])
def test_top_p_support_is_the_smallest_nucleus(top_p, top_k):
  tok, lp, _ = draws(LOGITS, top_p=top_p, use_top_p=True, top_k=top_k)
  order = np.argsort(-LOGITS)
  if top_k:
    order = order[:top_k]
  p = np.exp(LOGITS[order] - LOGITS[order].max())
  p /= p.sum()
  keep = order[: np.searchsorted(np.cumsum(p), top_p) + 1]
  assert set(np.unique(tok)) == set(keep)
  q = p[: len(keep)] / p[: len(keep)].sum()
  q_of = dict(zip(keep, q))
  np.testing.assert_allclose(lp, np.log([q_of[t] for t in tok]), atol=1e-5)


def test_greedy_path():
  tok, lp, raw = draws(LOGITS, greedy=True)
  assert (tok == np.argmax(LOGITS)).all() and (lp == 0).all()
  np.testing.assert_allclose(raw, LOGITS.max() - np.log(np.exp(LOGITS).sum()), atol=1e-6)


# ---------------------------------------------------------------------------- parity / mesh


def test_mesh_results_equal_single_device(model):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  mesh = sharding.make_mesh(2, 2, 2)
  ids, mask = prompts(CFG.vocab_size, b=8)
  graphdef, state = nnx.split(model)
  sharded_state = jax.device_put(state, sharding.state_shardings(state, mesh))
  kw = dict(max_prompt_length=7, max_new_tokens=6, num_generations=2, eos_ids=(3,))
  single = Sampler(graphdef, **kw)(state, ids, mask, jax.random.key(4), "standard")
  on_mesh = Sampler(graphdef, mesh=mesh, **kw)(
      sharded_state,
      jax.device_put(ids, sharding.batch_sharding(mesh)),
      jax.device_put(mask, sharding.batch_sharding(mesh)),
      jax.random.key(4),
      "standard",
  )
  assert on_mesh.tokens.sharding.spec[0] == sharding.BATCH_AXES
  np.testing.assert_array_equal(single.tokens, on_mesh.tokens)
  np.testing.assert_array_equal(single.mask, on_mesh.mask)
  np.testing.assert_allclose(single.logprobs, on_mesh.logprobs, atol=1e-5)
  np.testing.assert_allclose(single.raw_logprobs, on_mesh.raw_logprobs, atol=1e-5)


def test_greedy_equals_transformers_generate(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from grpo_jax.models import load_hf

  torch.manual_seed(0)
  cfg = transformers.Qwen3Config(
      vocab_size=97,
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=24,
      rope_theta=10000.0,
      max_position_embeddings=128,
      attn_implementation="eager",
      tie_word_embeddings=False,
  )
  hf = transformers.Qwen3ForCausalLM(cfg).eval()
  hf.save_pretrained(tmp_path, safe_serialization=True)
  ours = load_hf(str(tmp_path))
  ids, mask = prompts(97, seed=6)
  new = 10
  with torch.no_grad():
    out = hf.generate(
        torch.tensor(np.asarray(ids)),
        attention_mask=torch.tensor(np.asarray(mask)),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
  want = out[:, ids.shape[1] :].numpy()
  r = sample(ours, ids, mask, num_generations=1, max_new_tokens=new, rng=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(r.tokens), want)


@pytest.mark.parametrize(
    "v,k,ties",
    [(151936, 50, False), (151936, 50, True), (32000, 20, True), (5000, 7, False), (96, 50, False)],
)
def test_two_level_top_k_equals_lax_top_k(v, k, ties):
  """sampling.top_k (block maxima, then the k best blocks) == lax.top_k: values and indices,
  ties to the lower index, -inf entries included."""
  rng = np.random.default_rng(v + k)
  x = (rng.integers(-20, 5, (6, v)) if ties else rng.standard_normal((6, v))).astype(np.float32)
  x[1] = 0.0  # one all-tied row
  x[2, k // 2 :] = -np.inf  # fewer than k finite entries
  want = jax.lax.top_k(jnp.asarray(x), k)
  got = jax.jit(sampling.top_k, static_argnums=1)(jnp.asarray(x), k)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def _while_bodies(jaxpr):
  """Every while loop body in a (closed) jaxpr, nested ones too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while":
      yield eqn.params["body_jaxpr"].jaxpr
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _while_bodies(sub)


@pytest.mark.parametrize("scan", [False, True])
def test_decode_loop_reads_compute_dtype_weights_made_once(scan):
  """f32 master weights, bf16 compute: the sampler's program casts the weights (and unstacks
  scanned layers) once, before its loops; no weight-sized convert and no slice of a stacked
  weight inside a decode loop (no reliance on the compiler's loop-invariant motion)."""
  cfg = CFG.replace(
      param_dtype="float32", dtype="bfloat16", scan_layers=scan, remat_policy="save_dots"
  )
  model = build_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  sampler = Sampler(
      graphdef, max_prompt_length=7, max_new_tokens=16, num_generations=2, decode_phases=2
  )
  ids, mask = prompts(cfg.vocab_size)
  fn, args = sampler._call(state, ids, mask, jax.random.key(0), "standard")
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  weights = {s for x in jax.tree.leaves(state) if x.ndim >= 2 for s in (x.shape, x.shape[1:])}
  bodies = list(_while_bodies(jaxpr))
  assert len(bodies) >= 2  # the decode phases

  def walk(j):
    for eqn in j.eqns:
      yield eqn
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from walk(sub)

  for body in bodies:
    for eqn in walk(body):
      if eqn.primitive.name == "convert_element_type":
        x = eqn.invars[0].aval
        assert not (x.dtype == jnp.float32 and x.shape in weights), eqn
      if eqn.primitive.name in ("slice", "dynamic_slice", "squeeze") and scan:
        assert eqn.invars[0].aval.ndim < 5 or eqn.invars[0].aval.shape[0] != cfg.num_layers
  r = sampler(state, ids, mask, jax.random.key(0), "standard")
  train = trainer_logprobs(model, ids, mask, r, 2)
  m = np.asarray(r.mask) > 0
  assert np.abs(np.asarray(train) - np.asarray(r.raw_logprobs))[m].max() <= 0.1  # bf16


def test_decode_blocks_keep_tokens_logprobs_and_stops(model):
  """Decoding in blocks of steps between stop checks (GPU's default: 8), with or without
  phases, draws the tokens of the step-by-step loop, stops rows at the same tokens and marks
  the same rows truncated; the columns past max_new_tokens that whole blocks need stay out."""
  graphdef, state = nnx.split(model)
  ids, mask = prompts(CFG.vocab_size, seed=4)
  for eos in [(), (5, 9, 11, 13)]:
    runs = []
    for block, phases in [(1, 1), (8, 1), (3, 3), (5, 2)]:
      s = Sampler(
          graphdef,
          max_prompt_length=7,
          max_new_tokens=21,
          num_generations=3,
          eos_ids=eos,
          decode_phases=phases,
          decode_block=block,
      )
      runs.append(s(state, ids, mask, jax.random.key(2), "standard"))
      assert runs[-1].tokens.shape == (12, 21)
    for r in runs[1:]:
      for name in ("tokens", "mask", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(r, name), getattr(runs[0], name))
      np.testing.assert_allclose(r.raw_logprobs, runs[0].raw_logprobs, atol=1e-5)
    truncated = np.asarray(runs[0].truncated)
    assert truncated.all() if not eos else not truncated.all()


@pytest.mark.parametrize("length", [1, 63, 64, 65, 128])
def test_ragged_decode_attention_equals_xla_attention(length):
  """The Pallas decode kernel (Pallas's interpreter on CPU) == the XLA decode attention over a
  shared, left-padded prompt and the first `length` cache slots (f32: 1e-5), reading no slot
  past them (garbage there changes nothing); GQA groups of 2, 2 prompts x 4 rows."""
  from grpo_jax.models.decoder import decode_attention
  from grpo_jax.models.decoder import attention

  b, g, hkv, r, kd, s, p = 2, 4, 2, 2, 32, 128, 64
  ks = jax.random.split(jax.random.key(0), 6)
  q = jax.random.normal(ks[0], (b * g, 1, hkv * r, kd))
  k = jax.random.normal(ks[1], (b * g, hkv, s, kd))
  v = jax.random.normal(ks[2], (b * g, hkv, s, kd))
  pk = jax.random.normal(ks[3], (b, hkv, p, kd))
  pv = jax.random.normal(ks[4], (b, hkv, p, kd))
  p_valid = (jnp.arange(p)[None] >= jnp.array([[5], [40]])).astype(jnp.int32)
  valid = jnp.broadcast_to(jnp.arange(s) < length, (b * g, s)).astype(jnp.int32)
  allowed = attention.slot_mask(jnp.full((b * g, 1), length - 1), jnp.arange(s), valid)
  want = attention.cache_attention(
      q,
      k,
      v,
      allowed,
      (pk, pv, p_valid),
      attention.prefix_mask(p_valid, jnp.zeros((b * g, 1), jnp.int32)),
  )
  assert decode_attention.supports(q, k, pk, interpret=True)
  got = decode_attention.ragged(q, k, v, length, (pk, pv, p_valid), interpret=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  # Whole blocks past `length` are never read (the sampler's unwritten slots inside the last
  # block read are zeros: masked out of the softmax).
  unread = jnp.arange(s)[None, None, :, None] >= -(-length // 64) * 64
  nan_k, nan_v = jnp.where(unread, jnp.nan, k), jnp.where(unread, jnp.nan, v)
  again = decode_attention.ragged(q, nan_k, nan_v, length, (pk, pv, p_valid), interpret=True)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


@pytest.mark.parametrize("kernel", ["triton", "tpu"])
def test_ragged_decode_attention_reads_a_stacks_layer_in_place(kernel):
  """layer=l over caches stacked [L, N, Hkv, S, K] (the slot engine's layer scan) == the kernel
  over stack[l] == the XLA attention (f32: 1e-5), per-row lengths (one slot, whole and partial
  blocks); the other layers and the slots past a row's last block read are never read (NaN
  there changes nothing). `ragged` (Triton's, 64-slot blocks) and `ragged_tpu` (Mosaic's,
  128-slot blocks of every kv head, slot-major caches), in Pallas's interpreter."""
  from grpo_jax.models.decoder import decode_attention
  from grpo_jax.models.decoder import attention

  n, layers, hkv, r, kd, s = 4, 3, 2, 2, 32, 256
  ks = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(ks[0], (n, 1, hkv * r, kd))
  k = jax.random.normal(ks[1], (layers, n, hkv, s, kd))
  v = jax.random.normal(ks[2], (layers, n, hkv, s, kd))
  length = jnp.array([1, 128, 129, 200], jnp.int32)
  block = decode_attention.TPU_BLOCK if kernel == "tpu" else decode_attention.BLOCK
  if kernel == "tpu":
    # (its caches slot-major: [.., S, Hkv, K])
    run = lambda k, v, **kw: decode_attention.ragged_tpu(  # noqa: E731
        q, jnp.swapaxes(k, -3, -2), jnp.swapaxes(v, -3, -2), length, interpret=True, **kw
    )
  else:
    none = jnp.zeros((n, hkv, 64, kd))
    prefix = (none, none, jnp.zeros((n, 64), jnp.int32))
    run = lambda k, v, **kw: decode_attention.ragged(  # noqa: E731
        q, k, v, length, prefix, interpret=True, **kw
    )
  empty = jnp.zeros((n, hkv, 0, kd))
  allowed = attention.slot_mask((length - 1)[:, None], jnp.arange(s), jnp.ones((n, s), jnp.int32))
  unread = jnp.arange(s)[None, None, :, None] >= (-(-length // block) * block)[:, None, None, None]
  for layer in range(layers):
    want = attention.cache_attention(
        q,
        k[layer],
        v[layer],
        allowed,
        (empty, empty, jnp.zeros((n, 0), jnp.int32)),
        jnp.zeros((n, 1, 1, 0), bool),
    )
    one = run(k[layer], v[layer])
    np.testing.assert_allclose(np.asarray(one), np.asarray(want), atol=1e-5, rtol=1e-5)
    other = (jnp.arange(layers) != layer)[:, None, None, None, None] | unread[None]
    nan_k, nan_v = jnp.where(other, jnp.nan, k), jnp.where(other, jnp.nan, v)
    got = run(nan_k, nan_v, layer=jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(one))


@pytest.mark.parametrize("block", [pytest.param(1, marks=pytest.mark.slow), 8])  # 8: GPU's default
def test_ragged_decode_sampler_equals_xla_sampler(block):
  """The sampler with the ragged decode kernel (decode_attention="pallas": one phase, the
  cache and the prompt padded to whole blocks) draws the XLA sampler's tokens and stops, with
  the trainer's log-probs (f32: 1e-5), step by step and in GPU's blocks of 8 steps; "auto" on
  CPU is the XLA attention, with its phases."""
  model = build_model(CFG, seed=3)
  ids, mask = prompts(CFG.vocab_size, seed=6)
  graphdef, state = nnx.split(model)
  out = {}
  with pytest.raises(ValueError, match="decode_attention='flash'"):
    Sampler(graphdef, max_prompt_length=7, max_new_tokens=8, decode_attention="flash")
  for impl in ("xla", "pallas"):
    s = Sampler(
        graphdef,
        max_prompt_length=7,
        max_new_tokens=24,
        num_generations=3,
        eos_ids=(5,),
        decode_attention=impl,
        decode_block=block,
    )
    assert s.ragged == (impl == "pallas") and len(s.phase_ends) == 1
    out[impl] = s(state, ids, mask, jax.random.key(4), GenerationConfig(temperature=1.0))
  assert len(Sampler(graphdef, max_prompt_length=7, max_new_tokens=128).phase_ends) == 4
  for name in ("tokens", "mask", "lengths", "truncated"):
    np.testing.assert_array_equal(getattr(out["pallas"], name), getattr(out["xla"], name))
  np.testing.assert_allclose(out["pallas"].raw_logprobs, out["xla"].raw_logprobs, atol=1e-5)
  m = np.asarray(out["pallas"].mask) > 0
  assert m.sum() > 3 * 24  # rows ran past the first block of 8 steps
  train = np.asarray(trainer_logprobs(model, ids, mask, out["pallas"], 3))
  assert np.abs(train - np.asarray(out["pallas"].raw_logprobs))[m].max() <= 1e-5
