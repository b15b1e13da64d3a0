"""The mixture-of-experts MLP of Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): a top-k softmax
router over E SwiGLU experts, dropless, as grouped matmuls over the tokens sorted by expert.

    moe = MoE(cfg, rngs=rngs)          # Block's MLP where cfg.layer_is_moe(i) (layers.py)
    y_btd = moe(x_btd)                 # [B, T, D] -> [B, T, D]
    y_btd, own_btk = moe.routed(x_btd, routes_btk)   # routing replay (below)

Routing (HF's Qwen3MoeTopKRouter, in f32 whatever the compute dtype): p = softmax(x @ router)
over the E experts; each token takes its k most probable experts, gated by their p, renormalized
to sum to 1 when `norm_topk_prob`. The gates are differentiable in the router's weights.

Experts: the N*k (token, expert) pairs are sorted by expert so each expert's tokens are one
contiguous group; `jax.lax.ragged_dot` runs every expert's gate, up and down projection as one
grouped GEMM over those groups (no capacity, no dropped token, no [N, E] dispatch tensor); each
pair's output is scaled by its gate and summed back onto its token. Padding tokens are routed
like any other (dropless: they cannot crowd out a real token).

Routing replay (R3, arXiv 2510.11370; rollout.routing_replay="rollout"): `routed(x, routes)`
takes each token's k experts from `routes` (the ones the sampler chose for it; rollout/sampler.py
records them) instead of the router's own top-k; a token whose routes are -1 takes its own. The
gates are R3's: the router's softmax probabilities of the current weights gathered at the
replayed experts (renormalized over the k with `norm_topk_prob`), so the router still gets
gradients through them; only the choice of experts is replayed. Without replayed routes the
gathered probabilities are exactly the top-k's values (one code path).

Parameter layouts (logical axes in parentheses):
  router [D, E]          (embed, None)            replicated over experts: every token needs all E
  gate, up [E, D, F]     (experts, embed, moe_mlp) F = moe_intermediate_size
  down [E, F, D]         (experts, moe_mlp, embed)
The checkpoint names "mlp_hidden" / "mlp_out" are the dense MLP's (remat policies see both).
"""

import math

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from grpo_jax.models.decoder.config import ModelConfig


def _param(rngs: nnx.Rngs, shape, axes, dtype, fan_in: int) -> nnx.Param:
  """Normal(0, 1/sqrt(fan_in)), as layers._param's projections (not imported: layers imports
  this module)."""
  value = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
  return nnx.Param(value.astype(dtype), logical_axes=axes)


def routes_dtype(num_experts: int):
  """The compact integer type of recorded routes (rollout/types.py `Rollout.routes`): int8 up
  to 127 experts, else int16 (-1 = none recorded)."""
  return jnp.int8 if num_experts <= 127 else jnp.int16


class MoE(nnx.Module):
  """Top-k routed SwiGLU experts (Qwen3MoeSparseMoeBlock)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    self.num_experts, self.top_k, self.norm_topk_prob = (
        e,
        cfg.num_experts_per_tok,
        cfg.norm_topk_prob,
    )
    self.router = _param(rngs, (d, e), ("embed", None), pd, fan_in=d)
    self.gate = _param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, fan_in=d)
    self.up = _param(rngs, (e, d, f), ("experts", "embed", "moe_mlp"), pd, fan_in=d)
    self.down = _param(rngs, (e, f, d), ("experts", "moe_mlp", "embed"), pd, fan_in=f)

  def route(self, x_nd):
    """-> (experts [N, k] int32, gates [N, k] f32): each token's k experts, most probable
    first, and their gates (softmax probabilities, renormalized with norm_topk_prob)."""
    logits = x_nd.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [N, E]
    gates, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.top_k)
    if self.norm_topk_prob:
      gates = gates / gates.sum(-1, keepdims=True)
    return experts.astype(jnp.int32), gates

  def replay_route(self, x_nd, routes_nk):
    """Routing replay: -> (experts [N, k] int32 used, gates [N, k] f32, own [N, k] int32 the
    router's own top-k). experts = routes where a token's k routes are all >= 0, else its own;
    gates = the softmax probabilities at those experts (renormalized with norm_topk_prob),
    differentiable in the router's weights (R3's gates)."""
    logits = x_nd.astype(jnp.float32) @ self.router[...].astype(jnp.float32)  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1)
    _, own = jax.lax.top_k(probs, self.top_k)
    own = own.astype(jnp.int32)
    routes = routes_nk.astype(jnp.int32)
    replayed = jnp.all(routes >= 0, axis=-1, keepdims=True)  # [N, 1]
    experts = jnp.where(replayed, routes, own)
    gates = jnp.take_along_axis(probs, experts, axis=-1)
    if self.norm_topk_prob:
      gates = gates / gates.sum(-1, keepdims=True)
    return experts, gates, own

  def experts(self, x_nd, experts_nk, gates_nk):
    """sum_j gates[n, j] * expert_{experts[n, j]}(x[n]), [N, D]: the (token, expert) pairs
    sorted by expert, three grouped GEMMs (ragged_dot), the outputs gathered back per token."""
    dt = x_nd.dtype
    n, d = x_nd.shape
    k = experts_nk.shape[1]
    flat = experts_nk.reshape(-1)  # [N*k], pair i = (token i // k, its (i % k)-th expert)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)  # [E]
    xs = jnp.take(x_nd, order // k, axis=0)  # [N*k, D]
    g = jax.lax.ragged_dot(xs, self.gate[...].astype(dt), sizes)
    u = jax.lax.ragged_dot(xs, self.up[...].astype(dt), sizes)
    h = checkpoint_name(jax.nn.silu(g) * u, "mlp_hidden")  # [N*k, F]
    ys = jax.lax.ragged_dot(h, self.down[...].astype(dt), sizes)  # [N*k, D]
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]), unique_indices=True)
    y_nkd = jnp.take(ys, back, axis=0).reshape(n, k, d)
    return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(dt))

  def __call__(self, x_btd):
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)
    experts, gates = self.route(x)
    return checkpoint_name(self.experts(x, experts, gates).reshape(b, t, d), "mlp_out")

  def routed(self, x_btd, routes_btk=None):
    """-> (y [B, T, D], own [B, T, k] int32: the router's own top-k experts of each token).
    routes [B, T, k] (any int dtype; -1 = the token's own top-k): the experts to use instead
    (`replay_route`); None: every token its own (then y == self(x))."""
    b, t, d = x_btd.shape
    x = x_btd.reshape(b * t, d)
    if routes_btk is None:
      routes_btk = jnp.full((b, t, self.top_k), -1, jnp.int32)
    experts, gates, own = self.replay_route(x, routes_btk.reshape(b * t, -1))
    y = checkpoint_name(self.experts(x, experts, gates).reshape(b, t, d), "mlp_out")
    return y, own.reshape(b, t, -1)
