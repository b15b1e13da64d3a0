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


def categorical(key: jax.Array, logits_nv: jax.Array, block: int = 256) -> jax.Array:
  """One draw per row from softmax(logits) by inverse-CDF sampling: token i with probability
  p_i / sum(p) (up to float32 rounding of the cumulative sums, ~1e-7 relative).

  `jax.random.categorical` draws V Gumbel variates per row, whose random bits cost more than the
  whole decode step on CPU. Here one uniform per row is compared against cumulative
  probabilities, two-level (block sums, then within the chosen block) so the scan is over
  V / block + block values (measured: benchmarks/README.md, "Figures behind design choices"). A
  token of probability 0 (masked to -inf or to the float32 minimum) is never drawn.
  """
  return categorical_lse(key, logits_nv, block=block)[0]


def categorical_lse(
    key: jax.Array, logits_nv: jax.Array, inv_temperature=1.0, block: int = 256
) -> tuple[jax.Array, jax.Array]:
  """`categorical` from softmax(logits * inv_temperature) (inv_temperature > 0, may be traced),
  and that distribution's log-normalizer logsumexp(logits * inv_temperature) [N] from the same
  pass: the scaled logits are never formed (max(x * t) = max(x) * t for t > 0), and the mass
  the draw sums anyway gives the normalizer. Over [N, V] that is one max, one exp and the block
  sums, instead of a division, two more max passes and two more exp passes (the decode step's
  elementwise work next to the LM head)."""
  n, v = logits_nv.shape
  logits = logits_nv.astype(jnp.float32)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp((logits - m) * inv_temperature)
  top = m[:, 0] * inv_temperature
  if v <= 2 * block:  # small vocabularies / top-k sets: one level
    c = jnp.cumsum(p, axis=-1)
    u = _uniform_in(key, n, c[:, -1])
    return jnp.sum(c < u[:, None], axis=-1).astype(jnp.int32), top + jnp.log(c[:, -1])
  pad = -v % block
  p_nbk = jnp.pad(p, ((0, 0), (0, pad))).reshape(n, (v + pad) // block, block)
  cb = jnp.cumsum(p_nbk.sum(-1), axis=-1)  # [N, nb]
  u = _uniform_in(key, n, cb[:, -1])
  blk = jnp.sum(cb < u[:, None], axis=-1)  # first block whose cumulative mass reaches u
  before = jnp.where(
      blk > 0, jnp.take_along_axis(cb, jnp.maximum(blk - 1, 0)[:, None], 1)[:, 0], 0.0
  )
  inner = jnp.take_along_axis(p_nbk, blk[:, None, None], 1)[:, 0]  # [N, block]
  ci = jnp.cumsum(inner, axis=-1)
  u_in = jnp.clip(u - before, jnp.finfo(jnp.float32).tiny, ci[:, -1])
  j = jnp.sum(ci < u_in[:, None], axis=-1)
  return (blk * block + j).astype(jnp.int32), top + jnp.log(cb[:, -1])


def top_k(x_nv: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k(x, k)` (values descending, ties to the lower index), found in two levels so
  no step sorts the vocabulary: the k blocks of `block` entries with the largest maxima hold
  every top-k entry (a block holding one has its max >= the k-th value, and at most k blocks
  do), so top-k runs over the [N, V / block] block maxima, then over those k blocks' k * block
  entries. At V = 152k, k = 50: sorts of 1.2k and 6.4k entries per row instead of 152k (a
  radix sort of the whole vocabulary per token on GPU). Small vocabularies: lax.top_k."""
  n, v = x_nv.shape
  nb = -(-v // block)
  if nb < 4 * k:
    return jax.lax.top_k(x_nv, k)
  x = jnp.pad(x_nv, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf)
  x_nbk = x.reshape(n, nb, block)
  _, blocks = jax.lax.top_k(x_nbk.max(-1), k)
  blocks = jnp.sort(blocks, axis=-1)  # candidates in index order: ties go to the lower index
  cand = jnp.take_along_axis(x_nbk, blocks[:, :, None], axis=1).reshape(n, k * block)
  vals, j = jax.lax.top_k(cand, k)
  idx = jnp.take_along_axis(blocks, j // block, axis=1) * block + j % block
  return vals, idx.astype(jnp.int32)


def _uniform_in(key, n, total_n):
  """u in (0, total]: never 0, so a leading zero-probability token is never chosen. `key`: one
  key for the batch (row i's draw depends on i), or one key per row ([N]: the slot engine's,
  a row's draw depends on its own key only)."""
  if _per_row(key):
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key) * total_n
  else:
    u = jax.random.uniform(key, (n,), jnp.float32) * total_n
  return jnp.clip(u, jnp.finfo(jnp.float32).tiny, total_n)


def _per_row(key) -> bool:
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  return key.ndim == (1 if typed else 2)


_top_k = top_k  # sample_token's argument `top_k` shadows the function


def sample_token(
    logits_nv: jax.Array,
    key: jax.Array,
    *,
    temperature,
    top_p,
    top_k: int,
    use_top_p: bool,
    greedy: bool
):
  """-> (token [N] int32, sampled-distribution log-prob [N], raw log-prob [N]).

  `key`: one key for the batch, or one per row ([N] keys: row i's draw reads key i only).

  `top_k`, `use_top_p` and `greedy` are static (they pick the compiled path); `temperature`
  and `top_p` may be traced. top_k = 0 means no top-k; with top-p alone the whole vocabulary
  is sorted each step, so pair top-p with a top-k where speed matters.
  """
  logits = logits_nv.astype(jnp.float32)
  rows = jnp.arange(logits.shape[0])
  if greedy:
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    raw_lse = jax.nn.logsumexp(logits, axis=-1)
    return token, jnp.zeros(token.shape, jnp.float32), logits[rows, token] - raw_lse

  if top_k == 0 and not use_top_p:  # the whole vocabulary: no [N, V] pass beyond the draw's
    inv_t = 1.0 / jnp.asarray(temperature, jnp.float32)
    token, lse = categorical_lse(key, logits, inv_t)
    picked = logits[rows, token]
    # raw_lse only where the temperature is not 1 (else the draw's normalizer is it).
    raw_lse = jax.lax.cond(inv_t == 1.0, lambda: lse, lambda: jax.nn.logsumexp(logits, axis=-1))
    return token, picked * inv_t - lse, picked - raw_lse

  k = top_k if top_k > 0 else logits.shape[-1]
  k = min(k, logits.shape[-1])
  # Top-k of the raw logits, scaled after (1 / temperature > 0 keeps the order): the scaled
  # [N, V] logits are never formed. Without top-k (top-p alone) the vocabulary is sorted.
  vals_nk, idx_nk = _top_k(logits, k) if k < logits.shape[-1] else jax.lax.top_k(logits, k)
  vals_nk = vals_nk / temperature
  neg = jnp.finfo(jnp.float32).min
  if use_top_p:
    vals_nk = jnp.where(_top_p_keep(vals_nk, top_p), vals_nk, neg)
  choice, lse = categorical_lse(key, vals_nk)
  token = idx_nk[rows, choice].astype(jnp.int32)
  logp = vals_nk[rows, choice] - lse
  return token, logp, logits[rows, token] - jax.nn.logsumexp(logits, axis=-1)
