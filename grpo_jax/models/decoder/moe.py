"""The mixture-of-experts MLP of Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): a top-k softmax
router over E SwiGLU experts, dropless, as grouped matmuls over the tokens sorted by expert.

    moe = MoE(cfg, rngs=rngs)          # Block's MLP where cfg.layer_is_moe(i) (layers.py)
    y_btd = moe(x_btd)                 # [B, T, D] -> [B, T, D]
    y_btd, own_btk = moe.routed(x_btd, routes_btk)   # routing replay (below)

Routing (HF's Qwen3MoeTopKRouter, in f32 whatever the compute dtype): p = softmax(x @ router)
over the E experts; each token takes its k most probable experts, gated by their p, renormalized
to sum to 1 when `norm_topk_prob`. The gates are differentiable in the router's weights.

Experts: the N*k (token, expert) pairs are sorted by expert so each expert's tokens are one
contiguous group; a grouped GEMM runs every expert's gate, up and down projection over those
groups (no capacity, no dropped token, no [N, E] dispatch tensor); each pair's output is scaled
by its gate and summed back onto its token. Padding tokens are routed like any other
(dropless: they cannot crowd out a real token). Which grouped GEMM (`grouped_matmul_for`,
decided once per trace from the devices the program is traced for):
  TPU  jax.lax.ragged_dot: the TPU compiler's grouped-GEMM kernel (tpu_custom_call
       "ragged-dot-*");
  GPU  (bf16/f16 compute) grouped_matmul.gmm: Pallas Triton kernels for the product, its input
       gradient and its weight gradient, since XLA:GPU (jaxlib 0.12) lowers ragged_dot to dense
       dots of every expert over every row; in f32, or where the mesh splits an expert's D
       or F (fsdp / tensor: the kernel would need whole experts gathered on every device),
       ragged_dot (dense, GSPMD-partitioned);
  CPU  jax.lax.ragged_dot (XLA:CPU's).
The H100's deviceless compile of the update holds the kernels and no dense all-expert dot
(tests/plan/test_moe_programs.py); their values and gradients equal ragged_dot's in Pallas's
interpreter (tests/models/test_grouped_matmul.py). Their speed on an H100 is unmeasured.

Expert parallelism (`expert_parallel`; a mesh whose `expert` axis, ep > 1, divides E, found
as the abstract mesh the program is traced under: sharding.traced_in, jax.set_mesh): the
routing runs as above on the rows (sharded over data * fsdp * expert, sharding.BATCH_AXES),
and the experts in a shard_map where each device holds E/ep experts and n of the rows (N
padded to a multiple of the row shards). Each device sorts its m = n*k pairs by expert and
copies each destination shard's run into a [ep, m, D] send buffer: m rows per destination,
since all of a device's pairs may go to one shard, so no routing can drop a pair; then
  all_to_all over `expert` (dense, tiled): row s of the result = shard s's pairs for my
    experts, expert-ordered, then empty rows; an all_to_all of the [ep, E/ep] pair counts
    tells which expert each received row is for;
  a permutation regroups the ep*m rows expert-major, the three grouped GEMMs run over them
    (rows past the received pairs come out 0), the permutation is undone;
  the reverse all_to_all returns each output to the slot its pair was sent from, and each
    device gathers its pairs' outputs, weights them by the gates and sums them per token.
jax.lax.ragged_all_to_all would send only the filled rows, but XLA:CPU cannot run it (the
tests' platform), so the dense all_to_all keeps one code path, exact on CPU as on chips.
Communication per MoE layer and device: forward two all_to_alls of ep*m*D activations (send,
return; (ep-1)/ep of it leaves the device, ep times the m*D a ragged one would move) and one
of ep*(E/ep) int32 counts; backward the two transposed all_to_alls. Memory: the send, received
and returned buffers, ep*m rows of D each, and the GEMMs' ep*m x F activations. The weights
keep their shardings: D over fsdp is all-gathered inside the shard_map (E/ep experts' worth;
its gradient reduce-scattered), F over tensor stays split (every tensor shard runs the same
dispatch on its F slice) and the per-token outputs are psum'd over tensor. With ep = 1 (or
E not divisible) the code is the single-device one above, partitioned by GSPMD.

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

import functools
import math

from flax import nnx
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax.models.decoder import grouped_matmul
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.kernels import platform_name
from grpo_jax.parallel import sharding

# The experts' logical axes (the parameters' metadata below; expert_parallel's in_specs).
GATE_UP_AXES = ("experts", "embed", "moe_mlp")  # [E, D, F]
DOWN_AXES = ("experts", "moe_mlp", "embed")  # [E, F, D]


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
    self.gate = _param(rngs, (e, d, f), GATE_UP_AXES, pd, fan_in=d)
    self.up = _param(rngs, (e, d, f), GATE_UP_AXES, pd, fan_in=d)
    self.down = _param(rngs, (e, f, d), DOWN_AXES, pd, fan_in=f)

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
    sorted by expert, three grouped GEMMs (`grouped_matmul_for`), the outputs gathered back per
    token.
    Under a mesh whose expert axis splits the experts: `expert_parallel` (the all-to-all
    dispatch). So too with the GPU kernel on a mesh of several devices (one expert shard): a
    custom call is not partitioned by GSPMD (its operands would be replicated: every device
    all rows), so each device runs its own rows in the shard_map. The kernel runs only where
    each device holds whole experts (D and F not split over fsdp / tensor). Else on the whole
    batch, as GSPMD partitions it."""
    dt = x_nd.dtype
    weights = tuple(w[...].astype(dt) for w in (self.gate, self.up, self.down))
    mesh = jax.sharding.get_abstract_mesh()
    matmul = grouped_matmul_for(mesh, dt)
    if _grpo_mesh(mesh) and _splits(mesh, self.gate.shape):
      # An expert's D or F split over fsdp / tensor: the kernel would need each layer's experts
      # gathered whole on every device (memory_plan, 8 x H100, Qwen3-30B-A3B at fsdp 8: the
      # sampler's temp 3 -> 39 GiB, the decode's gathers hoisted out of its loop); XLA's
      # ragged_dot is partitioned along the split dimension instead (dense on GPU).
      matmul = jax.lax.ragged_dot
    kernel_on_mesh = matmul is not jax.lax.ragged_dot and _grpo_mesh(mesh) and mesh.size > 1
    if uses_expert_parallel(mesh, self.num_experts) or kernel_on_mesh:
      return expert_parallel(mesh, x_nd, experts_nk, gates_nk, *weights, matmul=matmul)
    return grouped_experts(x_nd, experts_nk, gates_nk, *weights, matmul=matmul)

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


def grouped_matmul_for(mesh, dtype):
  """The grouped GEMM the experts run, decided once per trace from the devices the program is
  traced for (the abstract mesh's, as `uses_expert_parallel` reads it: the trainer's
  sharding.traced_in, memory_plan's target chips; else jax.default_backend()): on GPU in
  bf16/f16, grouped_matmul.gmm (Pallas Triton kernels); elsewhere jax.lax.ragged_dot (TPU:
  its grouped-GEMM kernel; CPU: XLA's). Both: (x [M, K], w [E, K, N], sizes [E]) -> [M, N].
  (Read here, not from kernels.Kernels: Block hands its MLP no Kernels.)"""
  device = mesh.abstract_device
  platform = platform_name(device.platform if device is not None else jax.default_backend())
  if grouped_matmul.supported(platform, dtype):
    return grouped_matmul.gmm
  return jax.lax.ragged_dot


def grouped_experts(
    x_nd, experts_nk, gates_nk, gate_edf, up_edf, down_efd, *, matmul=jax.lax.ragged_dot
):
  """The experts of one device (all E of them, or one shard's under `expert_parallel`): the
  N*k (token, expert) pairs sorted by expert, three grouped GEMMs (`matmul`:
  `grouped_matmul_for`'s), each pair's output gathered back to its token and weighted by its
  gate. -> [N, D] in x's dtype."""
  dt = x_nd.dtype
  n, d = x_nd.shape
  k = experts_nk.shape[1]
  flat = experts_nk.reshape(-1)  # [N*k], pair i = (token i // k, its (i % k)-th expert)
  order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
  sizes = jnp.bincount(flat, length=gate_edf.shape[0]).astype(jnp.int32)  # [E]
  xs = jnp.take(x_nd, order // k, axis=0)  # [N*k, D]
  ys = _swiglu_experts(xs, gate_edf, up_edf, down_efd, sizes, matmul)  # [N*k, D]
  back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]), unique_indices=True)
  y_nkd = jnp.take(ys, back, axis=0).reshape(n, k, d)
  return jnp.einsum("nkd,nk->nd", y_nkd, gates_nk.astype(dt))


def _swiglu_experts(xs_md, gate_edf, up_edf, down_efd, sizes_e, matmul):
  """down(silu(gate x) * up x) of rows grouped by expert (sizes_e rows each, in expert order;
  rows past sum(sizes_e) come out 0): three grouped GEMMs (`matmul`). [M, D] -> [M, D]."""
  g = matmul(xs_md, gate_edf, sizes_e)
  u = matmul(xs_md, up_edf, sizes_e)
  h = checkpoint_name(jax.nn.silu(g) * u, "mlp_hidden")  # [M, F]
  return matmul(h, down_efd, sizes_e)


# ---------------------------------------------------------------------- expert parallelism


def uses_expert_parallel(mesh, num_experts: int) -> bool:
  """Whether a trace under `mesh` (the abstract mesh, jax.sharding.get_abstract_mesh()) runs
  `expert_parallel`: the mesh has grpo_jax's axes and an expert axis > 1 that divides the
  experts (otherwise sharding.logical_to_spec leaves the experts unsplit)."""
  if not _grpo_mesh(mesh):
    return False
  ep = mesh.shape[sharding.EXPERT]
  return ep > 1 and num_experts % ep == 0


def _grpo_mesh(mesh) -> bool:
  """A mesh with grpo_jax's axes (sharding.MESH_AXES), as the trainer and sampler trace under."""
  return not mesh.empty and set(sharding.MESH_AXES) <= set(mesh.axis_names)


def _splits(mesh, gate_shape) -> bool:
  """Whether `mesh` splits an expert's D or F (fsdp / tensor over more than one device)."""
  spec = sharding.logical_to_spec(GATE_UP_AXES, gate_shape, mesh)
  return any(mesh.shape[a] > 1 for entry in spec[1:] for a in _axes(entry))


def _axes(entry) -> tuple:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallel(
    mesh, x_nd, experts_nk, gates_nk, gate_edf, up_edf, down_efd, *, matmul=jax.lax.ragged_dot
):
  """`grouped_experts` with the experts split over the mesh's expert axis: a shard_map in which
  each device dispatches its own rows' (token, expert) pairs to the experts' shards with an
  all-to-all, runs its E / ep experts, and takes the outputs back with a second all-to-all
  (`_dispatch`). Rows shard over sharding.BATCH_AXES (N padded to a multiple of them with
  zero rows); the weights keep their parameter shardings (experts over expert, D over fsdp, F
  over tensor); `matmul`: the grouped GEMM (`grouped_matmul_for`). -> [N, D]."""
  n = x_nd.shape[0]
  pad = -n % math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
  if pad:  # rows that do not split (a few decode rows): replicated, padded with expert-0,
    # gate-0 rows (cut off below), then split; the constraint keeps GSPMD from splitting the
    # unpadded rows unevenly
    x_nd, experts_nk, gates_nk = (
        jnp.pad(jax.lax.with_sharding_constraint(a, PartitionSpec()), ((0, pad), (0, 0)))
        for a in (x_nd, experts_nk, gates_nk)
    )
  rows = PartitionSpec(sharding.BATCH_AXES, None)
  gate_spec = sharding.logical_to_spec(GATE_UP_AXES, gate_edf.shape, mesh)
  down_spec = sharding.logical_to_spec(DOWN_AXES, down_efd.shape, mesh)
  local = functools.partial(
      _dispatch, embed_axes=_axes(gate_spec[1]), mlp_axes=_axes(gate_spec[2]), matmul=matmul
  )
  y_nd = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(rows, rows, rows, gate_spec, gate_spec, down_spec),
      out_specs=rows,
  )(x_nd, experts_nk, gates_nk, gate_edf, up_edf, down_efd)
  return y_nd[:n]


def _dispatch(
    x_nd, experts_nk, gates_nk, gate_edf, up_edf, down_efd, *, embed_axes, mlp_axes, matmul
):
  """One device's part of `expert_parallel` (inside the shard_map): its n rows, its E_loc = E /
  ep experts (D gathered over `embed_axes` here; F split over `mlp_axes`, summed at the end).

  Send: the m = n*k pairs sorted by expert; shard s's are a contiguous run, copied into slot
  row s of a [ep, m, D] buffer (m rows per destination: every pair may go to one shard, so the
  buffer is dropless whatever the routing), zeros after the run. The all-to-all over `expert`
  swaps buffer rows: row s of the result holds shard s's pairs for this device's experts, in
  expert order. A second all-to-all of the [ep, E_loc] pair counts tells each row's expert;
  `_grouped_positions` regroups the ep*m received rows expert-major (a permutation), the
  grouped GEMMs run over them, the outputs go back to their rows, and the reverse all-to-all
  returns each pair's output to the slot it was sent from."""
  embed_gather = functools.partial(jax.lax.all_gather, axis_name=embed_axes, tiled=True)
  if embed_axes:
    gate_edf, up_edf = embed_gather(gate_edf, axis=1), embed_gather(up_edf, axis=1)
    down_efd = embed_gather(down_efd, axis=2)
  ep = jax.lax.axis_size(sharding.EXPERT)
  e_loc = gate_edf.shape[0]
  n, d = x_nd.shape
  k = experts_nk.shape[1]
  m = n * k
  flat = experts_nk.reshape(-1)  # [m], pair i = (token i // k, its (i % k)-th expert)
  order = jnp.argsort(flat, stable=True)  # pairs grouped by expert (so by shard)
  counts = jnp.bincount(flat, length=ep * e_loc).astype(jnp.int32).reshape(ep, e_loc)
  per_shard = counts.sum(1)  # [ep]
  start = jnp.cumsum(per_shard) - per_shard  # [ep] shard s's first pair in `order`
  slot = jnp.arange(m)
  ranks = jnp.minimum(start[:, None] + slot, m - 1)  # [ep, m] sorted pair in slot (s, c)
  filled = (slot < per_shard[:, None])[..., None]  # [ep, m, 1]
  send = jnp.where(filled, jnp.take(x_nd, jnp.take(order, ranks) // k, axis=0), 0)
  recv = jax.lax.all_to_all(send, sharding.EXPERT, 0, 0, tiled=True)  # [ep, m, D]
  got = jax.lax.all_to_all(counts, sharding.EXPERT, 0, 0, tiled=True)  # [ep, E_loc]
  pos = _grouped_positions(got, m)  # [ep*m]
  inv = jnp.zeros_like(pos).at[pos].set(jnp.arange(ep * m, dtype=pos.dtype), unique_indices=True)
  xs = jnp.take(recv.reshape(ep * m, d), inv, axis=0)  # grouped by local expert, then zeros
  ys = _swiglu_experts(xs, gate_edf, up_edf, down_efd, got.sum(0), matmul)  # [ep*m, D]
  ret = jnp.take(ys, pos, axis=0).reshape(ep, m, d)
  back = jax.lax.all_to_all(ret, sharding.EXPERT, 0, 0, tiled=True)  # [ep, m, D]
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(m, dtype=order.dtype), unique_indices=True)
  dest = flat // e_loc  # pair i went to shard dest[i], slot rank[i] - start[dest[i]]
  y_md = jnp.take(back.reshape(ep * m, d), dest * m + rank - start[dest], axis=0)
  y_nd = jnp.einsum("nkd,nk->nd", y_md.reshape(n, k, d), gates_nk.astype(x_nd.dtype))
  return jax.lax.psum(y_nd, mlp_axes) if mlp_axes else y_nd


def _grouped_positions(got, m: int):
  """got [ep, E_loc]: the pairs shard s sent for each local expert (row s of the received
  [ep, m] buffer holds them in expert order, then m - got[s].sum() empty slots). -> pos [ep*m]
  int32, a permutation: received row (s, c) goes to row pos of the expert-major layout (local
  expert e's rows from shard 0, then shard 1, ...; experts in order), empty slots after every
  filled one."""
  ep, e_loc = got.shape
  c = jnp.arange(m, dtype=jnp.int32)
  upto = jnp.cumsum(got, axis=1)  # [ep, E_loc]: shard s's rows up to expert e's
  e = jax.vmap(lambda u: jnp.searchsorted(u, c, side="right"))(upto)  # [ep, m]: E_loc = empty
  e = jnp.minimum(e, e_loc - 1).astype(jnp.int32)
  in_run = c - jnp.take_along_axis(upto - got, e, axis=1)  # index among (s, e)'s rows
  sizes = got.sum(0)  # [E_loc]
  group_start = jnp.cumsum(sizes) - sizes  # [E_loc]
  earlier = jnp.cumsum(got, axis=0) - got  # [ep, E_loc]: expert e's rows from shards < s
  filled_pos = group_start[e] + jnp.take_along_axis(earlier, e, axis=1) + in_run
  per_shard = got.sum(1)  # [ep]
  flat_idx = jnp.arange(ep, dtype=jnp.int32)[:, None] * m + c  # [ep, m]
  empty_pos = sizes.sum() + flat_idx - jnp.cumsum(per_shard)[:, None]
  return jnp.where(c < per_shard[:, None], filled_pos, empty_pos).reshape(-1)
