"""The jitted group sampler for encoder-decoder (T5) policies: Sampler's contract, T5's loop.

    sampler = Seq2SeqSampler(graphdef, max_prompt_length=P, max_new_tokens=C,
                             num_generations=G, eos_ids=(eos,), pad_id=pad, decoder_start_id=0)
    rollout = sampler(params_state, prompt_ids, prompt_mask, rng, "standard")

1. Encode: the B prompts (encoder inputs [B, P], padded on either side) run through the
   encoder once, and each decoder layer's cross-attention keys/values are projected once; all
   of it stays at B rows: the G samples of a group attend to their prompt's keys together
   (t5.cross_attention), so neither the encoder nor its keys/values grow with G.
2. Start: the decoder start token runs on the B rows (slot 0 of a [B, H, C, K] self-attention
   cache); that cache is then repeated G times (group-major) and token 0 drawn from its logits.
3. Decode: a `lax.while_loop`, one token per row per step, stopping when every row has emitted
   a stop token (or after C tokens); rows that stopped emit `pad_id`. Sampling, log-prob
   conventions (`Rollout.logprobs` / `.raw_logprobs`), randomness and compile caching are the
   decoder-only Sampler's (rollout/sampler.py, rollout/sampling.py).
The trainer-side log-probs of the same tokens are `models.t5.t5_logprobs`.
"""

import functools

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax.parallel import sharding
from grpo_jax.models.t5.model import repeat_self_cache
from grpo_jax.rollout import sampling
from grpo_jax.rollout.sampler import Sampler
from grpo_jax.rollout.types import Rollout


class Seq2SeqSampler(Sampler):
  """Compile-once rollout generation for a T5 graph: prompts are the encoder's inputs and
  completions the decoder's tokens after `decoder_start_id` (see the module docstring)."""

  def __init__(
      self,
      graphdef,
      *,
      max_prompt_length: int,
      max_new_tokens: int,
      num_generations: int = 1,
      eos_ids=(),
      pad_id: int = 0,
      decoder_start_id: int = 0,
      mesh=None
  ):
    super().__init__(
        graphdef,
        max_prompt_length=max_prompt_length,
        max_new_tokens=max_new_tokens,
        num_generations=num_generations,
        eos_ids=eos_ids,
        pad_id=pad_id,
        mesh=mesh,
    )
    self.decoder_start_id = int(decoder_start_id)

  def _generate(
      self, state, prompt_ids, prompt_mask, rng, temperature, top_p, *, top_k, use_top_p, greedy
  ) -> Rollout:
    model = nnx.merge(self.graphdef, state)
    g, c_len = self.num_generations, self.max_new_tokens
    b = prompt_ids.shape[0]
    n = b * g
    prompt_ids = sharding.constrain(prompt_ids, "batch", "length")
    enc = model.encode(prompt_ids, prompt_mask)  # [B, P, D]: once per prompt
    cache = _constrain_cache(model.init_cache(enc, prompt_mask, c_len))
    start = jnp.full((b, 1), self.decoder_start_id, jnp.int32)
    logits, cache = model.decode(start, cache)  # [B, 1, V]
    logits = logits[:, 0]
    if g > 1:
      cache = _constrain_cache(repeat_self_cache(cache, g))
      logits = jnp.repeat(logits, g, axis=0)
    stop_ids = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
    draw = functools.partial(
        sampling.sample_token,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        use_top_p=use_top_p,
        greedy=greedy,
    )

    def col(arr, v, t):
      return jax.lax.dynamic_update_slice(arr, v[:, None].astype(arr.dtype), (0, t))

    def record(c, t, logits, done):
      """Draws token t for the rows still live and writes it (and its log-probs) out."""
      token, lp, raw = draw(logits, jax.random.fold_in(rng, t))
      live = ~done
      token = jnp.where(live, token, self.pad_id)
      return dict(
          c,
          t=t + 1,
          token=token,
          done=done | (live & jnp.isin(token, stop_ids)),
          tokens=col(c["tokens"], token, t),
          mask=col(c["mask"], live, t),
          logprobs=col(c["logprobs"], jnp.where(live, lp, 0.0), t),
          raw_logprobs=col(c["raw_logprobs"], jnp.where(live, raw, 0.0), t),
      )

    # As in Sampler: token t-1 is decoded (at cache slot t) and token t drawn in one iteration,
    # so no decode runs after the last token and the [N, V] logits stay out of the carry.
    def cond(c):
      return (c["t"] < c_len) & ~jnp.all(c["done"])

    def body(c):
      logits, cache = model.decode(c["token"][:, None], c["cache"])
      return record(dict(c, cache=_constrain_cache(cache)), c["t"], logits[:, 0], c["done"])

    init = dict(
        t=jnp.zeros((), jnp.int32),
        token=jnp.zeros((n,), jnp.int32),
        cache=cache,
        done=jnp.zeros((n,), bool),
        tokens=jnp.full((n, c_len), self.pad_id, jnp.int32),
        mask=jnp.zeros((n, c_len), jnp.int32),
        logprobs=jnp.zeros((n, c_len), jnp.float32),
        raw_logprobs=jnp.zeros((n, c_len), jnp.float32),
    )
    init = record(init, init["t"], logits, init["done"])
    final = jax.lax.while_loop(cond, body, init)
    return Rollout(
        tokens=final["tokens"],
        mask=final["mask"],
        logprobs=final["logprobs"],
        raw_logprobs=final["raw_logprobs"],
        lengths=final["mask"].sum(-1),
        truncated=~final["done"],
        tool_mask=jnp.zeros_like(final["mask"]),
    )


def _constrain_kv(x):
  return sharding.constrain(x, "batch", "kv_heads", "length", "head_dim")


def _constrain_cache(cache: dict) -> dict:
  kv = {k: tuple(map(_constrain_kv, cache[k])) for k in ("self_k", "self_v", "cross_k", "cross_v")}
  return dict(cache, **kv, enc_valid=sharding.constrain(cache["enc_valid"], "batch", "length"))


_SAMPLERS: dict = {}


def sample_seq2seq(
    model,
    prompt_ids,
    prompt_mask,
    *,
    num_generations: int,
    max_new_tokens: int,
    rng,
    generation="greedy",
    eos_ids=None,
    pad_id=None,
    decoder_start_id=None,
    mesh=None
) -> Rollout:
  """Samples `num_generations` decoder completions per encoder prompt ([B, P] ids and mask).

  eos_ids / pad_id / decoder_start_id default to the model config's eos, pad and decoder start
  tokens. Rows are grouped by prompt (prompt i -> rows i*G .. i*G+G-1); compiled samplers are
  cached per model graph and shapes, as `rollout.sample` does."""
  cfg = model.cfg
  eos_ids = (cfg.eos_token_id,) if eos_ids is None else tuple(eos_ids)
  pad_id = cfg.pad_token_id if pad_id is None else pad_id
  start = cfg.decoder_start_token_id if decoder_start_id is None else decoder_start_id
  graphdef, state = nnx.split(model)
  key = (
      graphdef,
      prompt_ids.shape[1],
      max_new_tokens,
      num_generations,
      eos_ids,
      pad_id,
      start,
      mesh,
  )
  if key not in _SAMPLERS:
    _SAMPLERS[key] = Seq2SeqSampler(
        graphdef,
        max_prompt_length=prompt_ids.shape[1],
        max_new_tokens=max_new_tokens,
        num_generations=num_generations,
        eos_ids=eos_ids,
        pad_id=pad_id,
        decoder_start_id=start,
        mesh=mesh,
    )
  return _SAMPLERS[key](
      state,
      jnp.asarray(prompt_ids, jnp.int32),
      jnp.asarray(prompt_mask, jnp.int32),
      rng,
      generation,
  )
