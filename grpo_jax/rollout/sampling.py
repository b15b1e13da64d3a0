"""Drawing one token per row from logits: greedy, temperature, top-k, top-p (pure jnp).

Log-prob conventions (what `Rollout.logprobs` / `.raw_logprobs` hold):
- raw: log softmax(logits)[token], the policy at temperature 1 with no truncation: what the
  trainer's forward computes for the same token (`token_logprobs(..., temperature=1)`).
- sampled: the log-prob under the distribution the token was actually drawn from:
  softmax(logits / temperature) restricted to the top-k tokens and then to the smallest prefix
  (by probability) whose mass reaches top_p, renormalized over what is kept. When nothing is
  truncated it equals log softmax(logits / temperature)[token]. For greedy decoding the
  distribution is a point mass, so it is 0 (log 1). A trainer that scores tokens with
  temperature-scaled, untruncated log-probs differs from this where truncation removed mass;
  the TIS weights in grpo_jax.rl correct for exactly that mismatch.
"""
import jax
import jax.numpy as jnp


def _top_p_keep(sorted_logits_nk: jax.Array, top_p) -> jax.Array:
  """Keep mask over descending-sorted logits: the smallest prefix with mass >= top_p."""
  probs = jax.nn.softmax(sorted_logits_nk, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  return mass_before < top_p  # the first token always survives (mass_before = 0)


def sample_token(logits_nv: jax.Array, key: jax.Array, *, temperature, top_p, top_k: int,
                 use_top_p: bool, greedy: bool):
  """-> (token [N] int32, sampled-distribution log-prob [N], raw log-prob [N]).

  `top_k`, `use_top_p` and `greedy` are static (they pick the compiled path); `temperature`
  and `top_p` may be traced. top_k = 0 means no top-k; with top-p alone the whole vocabulary
  is sorted each step, so pair top-p with a top-k where speed matters.
  """
  logits = logits_nv.astype(jnp.float32)
  raw_lse = jax.nn.logsumexp(logits, axis=-1)
  rows = jnp.arange(logits.shape[0])
  if greedy:
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return token, jnp.zeros(token.shape, jnp.float32), logits[rows, token] - raw_lse

  scaled = logits / temperature
  if top_k == 0 and not use_top_p:
    token = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    logp = scaled[rows, token] - jax.nn.logsumexp(scaled, axis=-1)
    return token, logp, logits[rows, token] - raw_lse

  k = top_k if top_k > 0 else logits.shape[-1]
  k = min(k, logits.shape[-1])
  vals_nk, idx_nk = jax.lax.top_k(scaled, k)  # descending
  neg = jnp.finfo(jnp.float32).min
  if use_top_p:
    vals_nk = jnp.where(_top_p_keep(vals_nk, top_p), vals_nk, neg)
  choice = jax.random.categorical(key, vals_nk, axis=-1)
  token = idx_nk[rows, choice].astype(jnp.int32)
  logp = vals_nk[rows, choice] - jax.nn.logsumexp(vals_nk, axis=-1)
  return token, logp, logits[rows, token] - raw_lse
