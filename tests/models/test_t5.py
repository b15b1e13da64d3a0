"""T5 (encoder-decoder): logit parity with transformers, HF round trip, the seq2seq sampler."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models.t5.model import t5_logprobs
from grpo_jax.models.t5.config import T5Config
from grpo_jax.models.t5.hf import load_t5_hf
from grpo_jax.models.t5.hf import save_t5_hf
from grpo_jax.rollout.seq2seq_sampler import Seq2SeqSampler
from grpo_jax.rollout.seq2seq_sampler import sample_seq2seq
from grpo_jax.rollout.types import GenerationConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# d_model / heads / d_kv, bucket counts and distances small enough that the tiny sequences
# below reach the log-spaced and the last (clamped) buckets, tied (scaled) and untied heads.
CONFIGS = {
    "gated-untied": dict(
        vocab_size=97,
        d_model=48,
        d_kv=12,
        d_ff=80,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=6,
        feed_forward_proj="gated-gelu",
        untie=True,
    ),
    "gated-tied": dict(
        vocab_size=131,
        d_model=64,
        d_kv=8,
        d_ff=96,
        num_heads=6,
        relative_attention_num_buckets=12,
        relative_attention_max_distance=9,
        feed_forward_proj="gated-gelu",
        num_decoder_layers=3,
        untie=False,
    ),
    "relu-tied": dict(
        vocab_size=64,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_heads=2,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="relu",
        untie=False,
    ),
}


def hf_model(kw, seed=0):
  kw = dict(kw)
  untie = kw.pop("untie")
  torch.manual_seed(seed)
  cfg = transformers.T5Config(
      num_layers=2,
      decoder_start_token_id=0,
      pad_token_id=0,
      eos_token_id=1,
      dropout_rate=0.0,
      tie_word_embeddings=not untie,
      attn_implementation="eager",
      **kw
  )
  model = transformers.T5ForConditionalGeneration(cfg)
  with torch.no_grad():  # non-trivial norm scales (so their mapping is tested), own head
    for name, p in model.named_parameters():
      if "layer_norm" in name:
        p.add_(0.1 * torch.randn_like(p))
    if untie:
      model.lm_head.weight = torch.nn.Parameter(0.2 * torch.randn_like(model.lm_head.weight))
  return model.eval()


def batch(vocab, seed=0, b=3, p=11, c=9):
  """Encoder inputs with left, right and no padding; decoder inputs right-padded."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(2, vocab, (b, p))
  enc_mask = np.ones((b, p), np.int64)
  enc_mask[1, :4] = 0  # left-padded
  enc_mask[2, p - 6 :] = 0  # right-padded
  dec = rng.integers(2, vocab, (b, c))
  dec[:, 0] = 0  # decoder start token
  dec_mask = (np.arange(c)[None] < np.array([c, 5, 2])[:, None]).astype(np.int64)
  return ids * enc_mask, enc_mask, dec * dec_mask, dec_mask


def hf_logits(model, ids, mask, dec, dec_mask):
  with torch.no_grad():
    return (
        model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            decoder_input_ids=torch.tensor(dec),
            decoder_attention_mask=torch.tensor(dec_mask),
        )
        .logits.float()
        .numpy()
    )


def max_diff(ours, theirs, mask):
  return np.abs(np.asarray(ours) - theirs)[mask > 0].max()


def test_config_from_hf_dicts():
  base = dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_heads=6)
  flan = T5Config.from_hf_dict(
      dict(
          base,
          tie_word_embeddings=False,
          feed_forward_proj="gated-gelu",
          num_decoder_layers=None,
          eos_token_id=[1, 2],
      )
  )
  assert (flan.tie_word_embeddings, flan.scale_decoder_outputs) == (False, False)
  assert (flan.num_decoder_layers, flan.eos_token_id, flan.activation) == (8, 1, "gelu_new")
  t5 = T5Config.from_hf_dict(base)  # original T5: tied, scaled, ReLU
  assert (t5.tie_word_embeddings, t5.scale_decoder_outputs, t5.gated) == (True, True, False)
  hf5 = T5Config.from_hf_dict(dict(base, tie_word_embeddings=True, scale_decoder_outputs=False))
  assert not hf5.scale_decoder_outputs  # transformers 5 writes the scaling on its own
  assert T5Config.from_hf_dict(flan.to_hf_dict()) == flan
  with pytest.raises(ValueError, match="feed_forward_proj='gated-swish'"):
    T5Config.from_hf_dict(dict(base, feed_forward_proj="gated-swish"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  """The gated untied config: (HF model, ours loaded from HF's save_pretrained folder)."""
  path = tmp_path_factory.mktemp("t5")
  hf = hf_model(CONFIGS["gated-untied"])
  hf.save_pretrained(path, safe_serialization=True)
  return hf, load_t5_hf(str(path))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_equal_transformers(name, tmp_path):
  hf = hf_model(CONFIGS[name])
  hf.save_pretrained(tmp_path, safe_serialization=True)
  ours = load_t5_hf(str(tmp_path))
  assert ours.cfg.tie_word_embeddings == (not CONFIGS[name]["untie"])
  assert ours.cfg.scale_decoder_outputs == (not CONFIGS[name]["untie"])
  ids, mask, dec, dec_mask = batch(CONFIGS[name]["vocab_size"], p=17 if name == "relu-tied" else 11)
  logits = jax.jit(lambda *a: ours(*a))(*map(jnp.asarray, (ids, mask, dec, dec_mask)))
  assert max_diff(logits, hf_logits(hf, ids, mask, dec, dec_mask), dec_mask) <= 1e-5


def test_saved_folder_loads_in_transformers_with_equal_logits(pair, tmp_path):
  hf, ours = pair
  save_t5_hf(ours, None, str(tmp_path))
  back = transformers.T5ForConditionalGeneration.from_pretrained(
      str(tmp_path), attn_implementation="eager"
  ).eval()
  ids, mask, dec, dec_mask = batch(97, seed=3)
  assert (
      max_diff(
          hf_logits(back, ids, mask, dec, dec_mask),
          hf_logits(hf, ids, mask, dec, dec_mask),
          dec_mask,
      )
      <= 1e-6
  )
  again = load_t5_hf(str(tmp_path))  # and the params survive ours -> HF -> ours exactly
  for a, b in zip(jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(again))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def prompts(vocab, seed=0, b=3, p=10):
  rng = np.random.default_rng(seed)
  mask = np.ones((b, p), np.int32)
  mask[1, :3] = 0
  mask[2, 6:] = 0
  return jnp.asarray(rng.integers(2, vocab, (b, p)) * mask, jnp.int32), jnp.asarray(mask)


_logprobs = nnx.jit(t5_logprobs, static_argnums=5)


@pytest.mark.parametrize(
    "gen,temperature",
    [
        (GenerationConfig(temperature=1.0), 1.0),
        (GenerationConfig(temperature=0.6), 0.6),
        ("standard", 1.0),
    ],
)
def test_sampled_logprobs_equal_teacher_forced(pair, gen, temperature):
  _, ours = pair
  ids, mask = prompts(97)
  g = 3
  r = sample_seq2seq(
      ours,
      ids,
      mask,
      num_generations=g,
      max_new_tokens=8,
      rng=jax.random.key(1),
      generation=gen,
      eos_ids=(5, 9, 11),
  )
  m = np.asarray(r.mask) > 0
  assert 0 < (~np.asarray(r.truncated)).sum() < len(m)  # stops and full rows both exercised
  train = _logprobs(ours, ids, mask, r.tokens, r.mask, temperature)
  if gen == "standard":  # the encoder input once per sample instead of once per prompt
    rep = _logprobs(ours, jnp.repeat(ids, g, 0), jnp.repeat(mask, g, 0), r.tokens, r.mask, 1.0)
    assert np.abs(np.asarray(train) - np.asarray(rep)).max() <= 1e-5
  if isinstance(gen, GenerationConfig):  # untruncated: the sampled distribution's log-probs
    assert np.abs(np.asarray(train) - np.asarray(r.logprobs)).max() <= 1e-5
  else:  # truncated: the raw policy's (temperature 1) log-probs
    assert np.abs(np.asarray(train) - np.asarray(r.raw_logprobs)).max() <= 1e-5
  assert np.all(np.asarray(r.tokens)[~m] == 0)


def test_greedy_equals_transformers_generate(pair):
  """Token for token, and rows stop where transformers stops them (a stop token taken from
  row 0's free-running output)."""
  hf, ours = pair
  ids, mask = prompts(97, seed=4)
  new = 10
  kw = dict(attention_mask=torch.tensor(np.asarray(mask)), max_new_tokens=new, do_sample=False)
  with torch.no_grad():
    free = hf.generate(torch.tensor(np.asarray(ids)), min_new_tokens=new, eos_token_id=None, **kw)
    eos = int(free[0, 5])
    out = hf.generate(torch.tensor(np.asarray(ids)), eos_token_id=eos, pad_token_id=0, **kw)
  want = np.zeros((3, new), np.int64)
  want[:, : out.shape[1] - 1] = out[:, 1:].numpy()  # after the decoder start token
  r = sample_seq2seq(
      ours, ids, mask, num_generations=2, max_new_tokens=new, rng=jax.random.key(0), eos_ids=(eos,)
  )
  np.testing.assert_array_equal(np.asarray(r.tokens), np.repeat(want, 2, 0))
  stops = [1 + int(np.argmax(w == eos)) if (w == eos).any() else new for w in want]
  np.testing.assert_array_equal(np.asarray(r.lengths), np.repeat(stops, 2))
  assert stops[0] == 5


def _dots(jaxpr, scope: str, in_loop=False, inside=False, out=None):
  """(in a while loop, output shape) of every dot_general under the named scope, recursively."""
  out = [] if out is None else out
  for eqn in jaxpr.eqns:
    here = inside or scope in str(eqn.source_info.name_stack)
    if eqn.primitive.name == "dot_general" and here:
      out.append((in_loop, tuple(eqn.outvars[0].aval.shape)))
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else [v]):
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          _dots(sub, scope, in_loop or eqn.primitive.name == "while", here, out)
  return out


def test_encoder_runs_once_per_prompt_whatever_g(pair):
  """The encoder and the cross-attention K/V projections: same work for G = 1 and G = 4, none
  of it inside the decode loop; the decoder's work does grow with G."""
  _, ours = pair
  graphdef, state = nnx.split(ours)
  ids, mask = prompts(97)

  def jaxpr(g):
    s = Seq2SeqSampler(graphdef, max_prompt_length=10, max_new_tokens=6, num_generations=g)
    fn = s._fn(0, False, False)
    return jax.make_jaxpr(fn)(state, ids, mask, jax.random.key(0), 1.0, 1.0).jaxpr

  j1, j4 = jaxpr(1), jaxpr(4)
  for scope in ("t5_encoder", "t5_cross_kv"):
    d1, d4 = _dots(j1, scope), _dots(j4, scope)
    assert d1 and d1 == d4, scope
    assert not any(in_loop for in_loop, _ in d4), scope
  loop1, loop4 = ([np.prod(s) for in_loop, s in _dots(j, "") if in_loop] for j in (j1, j4))
  assert loop1 and sum(loop4) == 4 * sum(loop1)  # per decoded row


@pytest.mark.slow
def test_mesh_load_and_sampler_equal_single_device(pair, tmp_path):
  """Sharded load (data=2, fsdp=2, tensor=2) and the sampler on that mesh: same logits and
  tokens as on one device."""
  from grpo_jax.parallel import sharding

  _, ours = pair
  save_t5_hf(ours, None, str(tmp_path))
  mesh = sharding.make_mesh(2, 2, 2)
  sharded = load_t5_hf(str(tmp_path), mesh=mesh)
  spec = nnx.state(sharded)["decoder"]["layers"][0]["mlp"]["wi_0"][...].sharding.spec
  assert spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  ids, mask = prompts(97, b=4)
  dec = jnp.asarray(np.arange(24).reshape(4, 6) % 97, jnp.int32)
  with jax.set_mesh(mesh):
    got = nnx.jit(lambda m, *a: m(*a))(sharded, ids, mask, dec, jnp.ones_like(dec))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ours(ids, mask, dec)), atol=1e-5)
  kw = dict(
      num_generations=2,
      max_new_tokens=8,
      rng=jax.random.key(3),
      generation="standard",
      eos_ids=(5, 9),
  )
  r0 = sample_seq2seq(ours, ids, mask, **kw)
  r1 = sample_seq2seq(sharded, ids, mask, mesh=mesh, **kw)
  np.testing.assert_array_equal(np.asarray(r1.tokens), np.asarray(r0.tokens))
  np.testing.assert_allclose(np.asarray(r1.logprobs), np.asarray(r0.logprobs), atol=1e-5)
