"""The MoE experts' GPU grouped matmul (models/decoder/grouped_matmul.py) in Pallas's
interpreter against jax.lax.ragged_dot, the semantics it replaces: values and both gradients
(f32, tight), random group sizes with empty groups, rows past the groups, M, K and N off the
blocks; moe.py's expert paths (one device and expert parallelism's shard_map) with the kernel
against ragged_dot; and which grouped GEMM moe.py picks where."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models.decoder import grouped_matmul as gm
from grpo_jax.models.decoder import moe
from grpo_jax.parallel import sharding

gmm = functools.partial(gm.gmm, interpret=True)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  """16-row/column blocks: several tiles, tiles straddling group boundaries, ragged edges."""
  monkeypatch.setattr(gm, "GMM_BLOCKS", (16, 16, 16))
  monkeypatch.setattr(gm, "TGMM_BLOCKS", (16, 16, 16))


def problem(m, k, n, sizes, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)), dtype)
  w = jnp.asarray(rng.normal(size=(len(sizes), k, n)), dtype)
  dy = jnp.asarray(rng.normal(size=(m, n)), dtype)
  return x, w, jnp.asarray(sizes, jnp.int32), dy


def random_sizes(rng, e, total):
  """e group sizes summing to `total`, about a third of them empty."""
  cuts = np.sort(rng.integers(0, total + 1, size=e - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [total]]))
  sizes[rng.random(e) < 0.3] = 0
  return sizes


CASES = {  # name: (M, K, N, sizes): sum(sizes) <= M
    "ragged": (45, 20, 36, [7, 0, 19, 0, 11]),  # 8 rows past the groups; K, N off 16
    "one-group": (40, 32, 16, [0, 0, 40, 0]),
    "tiny-m": (5, 8, 24, [2, 3, 0]),  # M below a block
    "all-empty": (24, 16, 16, [0, 0, 0]),
    "boundaries-on-blocks": (64, 16, 48, [16, 32, 0, 16]),
}


FAST = ("ragged", "all-empty")  # the rest slow: ~5 s each in the interpreter (the CI budget)


@pytest.mark.parametrize(
    "case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_gmm_and_its_gradients_equal_ragged_dot(case):
  m, k, n, sizes = CASES[case]
  x, w, sizes, dy = problem(m, k, n, sizes)
  got, want = (value_and_grads(f, x, w, sizes, dy) for f in (gmm, jax.lax.ragged_dot))
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, **TOL)


@functools.partial(jax.jit, static_argnums=0)
def value_and_grads(matmul, x, w, sizes, dy):
  """-> (matmul(x, w, sizes), (dx, dw) of <that, dy>)."""
  y, vjp = jax.vjp(lambda x, w: matmul(x, w, sizes), x, w)
  return y, vjp(dy)


def test_random_group_sizes():
  rng = np.random.default_rng(1)
  for seed in range(3):
    m, e = int(rng.integers(20, 70)), int(rng.integers(2, 9))
    sizes = random_sizes(rng, e, int(rng.integers(0, m + 1)))
    x, w, sizes, dy = problem(m, 24, 40, sizes, seed=seed)
    got, want = (value_and_grads(f, x, w, sizes, dy) for f in (gmm, jax.lax.ragged_dot))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, r, **TOL)


@pytest.mark.slow
def test_bf16_accumulates_in_f32():
  """bf16 inputs (the GPU path's): the f32 product rounded once to bf16 (within an ulp), not
  partial sums rounded per block of K."""
  x, w, sizes, _ = problem(45, 128, 32, [7, 0, 19, 0, 11], jnp.bfloat16)
  y = jax.jit(gmm)(x, w, sizes)
  assert y.dtype == jnp.bfloat16
  want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
  np.testing.assert_allclose(y.astype(jnp.float32), want, rtol=2**-8, atol=1e-6)


def experts_problem(n=24, d=32, f=24, e=8, k=2, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
  experts = jnp.asarray(np.argsort(rng.random((n, e)), axis=1)[:, :k], jnp.int32)
  experts = experts.at[:, 0].set(jnp.where(experts[:, 0] == 5, 1, experts[:, 0]))  # some idle
  gates = jnp.asarray(rng.random((n, k)), jnp.float32)
  ws = [jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d))]
  return x, experts, gates, ws


def assert_same_values_and_grads(run, mesh=None):
  """run(matmul, x, experts, gates, gate, up, down) -> [N, D]: with gmm as with ragged_dot,
  values and d/d(x, weights); traced under `mesh` (None: none)."""
  x, experts, gates, ws = experts_problem()
  dy = jnp.asarray(np.random.default_rng(9).normal(size=x.shape), jnp.float32)

  def grads(matmul):
    loss = lambda x, *ws: jnp.vdot(run(matmul, x, experts, gates, *ws), dy)  # noqa: E731
    f = jax.value_and_grad(loss, range(4))
    return jax.jit(f if mesh is None else sharding.traced_in(f, mesh))(x, *ws)

  got, want = grads(gmm), grads(jax.lax.ragged_dot)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, **TOL)


def test_moe_experts_with_the_kernel_equal_ragged_dot():
  assert_same_values_and_grads(lambda matmul, *a: moe.grouped_experts(*a, matmul=matmul))


def test_expert_parallel_traces_with_the_kernel():
  """Expert parallelism's shard_map (4 expert shards x 2 data) checks how values vary over its
  axes: the Triton kernel (GPU's, not interpreted) traces there, forward and backward, with the
  weights' gradients summed over the data shards as ragged_dot's are (grouped_matmul's
  `_varying_together`). Only traced: Pallas's interpreter cannot run inside such a shard_map
  (jax 0.12: a dynamic_slice of mixed varying axes); the per-shard math is the test above's,
  and the H100 compile of this path is tests/plan/test_moe_programs.py's h100x4-ep4."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  mesh = sharding.make_mesh(2, 1, 1, expert=4)
  x, experts, gates, ws = experts_problem()

  def grads(matmul):
    def loss(x, *ws):
      y = moe.expert_parallel(mesh.abstract_mesh, x, experts, gates, *ws, matmul=matmul)
      return y.sum()

    f = sharding.traced_in(jax.value_and_grad(loss, range(4)), mesh)
    return jax.make_jaxpr(f)(x, *ws)

  got = grads(gm.gmm)
  assert str(got).count("grouped_matmul") >= 9  # 3 GEMMs: forward, input and weight gradients
  assert got.out_avals == grads(jax.lax.ragged_dot).out_avals


def test_the_kernel_runs_on_gpu_in_bf16_only():
  def mesh(platform):
    return types.SimpleNamespace(abstract_device=types.SimpleNamespace(platform=platform))

  assert moe.grouped_matmul_for(mesh("gpu"), jnp.bfloat16) is gm.gmm
  assert moe.grouped_matmul_for(mesh("gpu"), jnp.float16) is gm.gmm
  assert moe.grouped_matmul_for(mesh("gpu"), jnp.float32) is jax.lax.ragged_dot
  assert moe.grouped_matmul_for(mesh("tpu"), jnp.bfloat16) is jax.lax.ragged_dot
  assert moe.grouped_matmul_for(mesh("cpu"), jnp.bfloat16) is jax.lax.ragged_dot
  no_mesh = jax.sharding.get_abstract_mesh()  # this CPU process's default backend
  assert moe.grouped_matmul_for(no_mesh, jnp.bfloat16) is jax.lax.ragged_dot
