"""A grouped matmul for the MoE experts on GPU: `jax.lax.ragged_dot`'s semantics as Pallas
Triton kernels, with its gradient as two more of them.

    y_mn = gmm(x_mk, w_ekn, sizes_e)        # rows [off_e, off_e + sizes_e) of x times w[e]
    dw_ekn = tgmm(x_mk, dy_mn, sizes_e)     # per group: x_g^T dy_g

x's rows are sorted by group (group e owns rows off_e .. off_e + sizes_e - 1, off = the
exclusive cumsum of sizes); rows past sum(sizes) (<= M) belong to no group: gmm writes 0 there
and tgmm ignores them, as ragged_dot does. `gmm` carries a custom VJP: dx = gmm(dy, w^T) (the
same kernel reading w transposed, no copy of the weights) and dw = tgmm(x, dy). Inputs in
bf16/f16 (f32 works too; the dots accumulate in f32, the outputs take x's dtype).

Why: XLA:GPU (jaxlib 0.12) has no grouped GEMM for ragged_dot on CUDA; its RaggedDotRewriter
computes every expert over every row ([E, M, N] dense products of a masked [E, M, K] copy),
E times the work (tests/plan/test_moe_programs.py). moe.py runs these kernels instead on GPU.

Kernels (grids of programs; Triton on GPU, Pallas's interpreter elsewhere, for the CPU tests):
  gmm   a program per (BM-row tile, BN-column tile) of y: for each group that overlaps its rows
        (a tile straddling a group boundary runs once per group, megablox-style, the rows
        outside the group masked to 0 on load) it accumulates x_tile @ w[g] over K in BK
        slices, then stores the tile once. Per-tile metadata, computed from sizes with jnp:
        the first and one-past-last group overlapping each tile (none past sum(sizes)).
  tgmm  a program per (group, BK-row tile of dw, BN-column tile): it walks its group's rows
        in BM chunks (unaligned starts; rows past the group masked), dw tile += x^T dy.
Ragged shapes: M, K and N need not be multiples of the blocks (loads and stores are masked);
blocks are powers of two >= 16 (Triton's dot), shrunk to the problem's size. Empty groups: a
gmm tile runs only the groups from its first row's to its last row's (an empty one between
them runs with every row masked), tgmm writes their dw as 0. The whole of each array stays in HBM and the kernels compute their
pointers, so no operand is padded or copied.

Speed on an H100 is unmeasured (no GPU where this was written); the default blocks are
common Triton GEMM tiles, not tuned. What is checked: values and gradients against ragged_dot
in the interpreter (tests/models/test_grouped_matmul.py) and the H100's deviceless compile
holding these kernels and no dense all-expert dot (tests/plan/test_moe_programs.py).

Deviceless compiles found in jax 0.12.0.1 (jax-cuda13-plugin), for the record: this module's
Triton kernels compile for an H100 when traced under a mesh of the target's devices (the
Triton lowering reads the GPU's kind from the abstract mesh: memory_plan's jax.set_mesh);
jax.experimental.pallas.ops.gpu.ragged_dot_mgpu (Mosaic GPU, Hopper wgmma) compiles too (a
mosaic_gpu_v2 custom call), but transposed_ragged_dot_mgpu (its weight gradient) does not:
it reads jax.devices()[0].core_count at trace time, which a CPU host lacks. Whether jax's
Mosaic GPU interpreter (jax/_src/pallas/mosaic_gpu/interpret) could check their numerics on
CPU was not tried; Triton-style kernels run in Pallas's interpreter, hence this module. JAX marks the Pallas Triton
backend deprecated (a warning at lowering); a Mosaic GPU port is the successor path.
"""

import functools

import jax
import jax.numpy as jnp

# Blocks (rows, contraction, columns) of each kernel: powers of two >= 16. GPU defaults:
# common Triton GEMM tiles, untuned (no H100 here to time them).
GMM_BLOCKS = (64, 64, 128)  # gmm: BM rows of x per program, BK per dot, BN columns of y
TGMM_BLOCKS = (64, 64, 128)  # tgmm: BM rows per step, BK rows of dw, BN columns of dw
_NUM_WARPS, _NUM_STAGES = 4, 3


def supported(platform: str, dtype) -> bool:
  """Whether moe.py runs `gmm` for its experts: on GPU, in bf16 or f16 compute (f32 would
  round through TF32 in Triton's dots, which ragged_dot does not)."""
  return platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def _block(size: int, dim: int) -> int:
  """A power-of-two block <= `size`, shrunk to cover `dim` and at least 16 (Triton's dot)."""
  return max(16, min(size, 1 << max(dim - 1, 0).bit_length()))


def _offsets(sizes_e):
  """-> (starts [E], ends [E]) int32: each group's first and one-past-last row."""
  ends = jnp.cumsum(sizes_e.astype(jnp.int32))
  return ends - sizes_e.astype(jnp.int32), ends


# ---------------------------------------------------------------------------------- gmm


def gmm(x_mk, w_ekn, sizes_e, interpret: bool = False):
  """ragged_dot(x, w, sizes): [M, K] x [E, K, N] -> [M, N] in x's dtype (f32 accumulation).
  `interpret`: Pallas's interpreter (off GPU), else Triton."""
  return _gmm_vjp(*_varying_together(x_mk, w_ekn, sizes_e), interpret)


def _varying_together(*arrays):
  """Inside a shard_map that checks how values vary over its manual axes (expert_parallel's),
  a kernel's result must say how it varies: every operand is made varying over the axes any of
  them varies over (an operand that does not, e.g. the weights over the data axes, is cast;
  autodiff sums its gradient over them), so the result varies as its operands. Outside a
  shard_map: a no-op."""
  axes = frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))
  return tuple(
      jax.lax.pcast(a, tuple(sorted(axes - jax.typeof(a).mat.varying)), to="varying")
      for a in arrays
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_vjp(x_mk, w_ekn, sizes_e, interpret):
  return _gmm(x_mk, w_ekn, sizes_e, transpose_w=False, interpret=interpret)


def _gmm_fwd(x_mk, w_ekn, sizes_e, interpret):
  return _gmm_vjp(x_mk, w_ekn, sizes_e, interpret), (x_mk, w_ekn, sizes_e)


def _gmm_bwd(interpret, res, dy_mn):
  x_mk, w_ekn, sizes_e = res
  dx = _gmm(dy_mn, w_ekn, sizes_e, transpose_w=True, interpret=interpret)  # dy @ w[g]^T
  dw = tgmm(x_mk, dy_mn, sizes_e, interpret=interpret).astype(w_ekn.dtype)
  return dx.astype(x_mk.dtype), dw, None


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def _gmm(x_mk, w, sizes_e, *, transpose_w: bool, interpret: bool):
  """x @ w[g] per group g of rows; w [E, K, N], or [E, N, K] read transposed (`transpose_w`:
  the input gradient's dy @ w^T, K and N the forward's swapped). -> [M, N] in x's dtype."""
  from jax.experimental import pallas as pl

  m, k = x_mk.shape
  n = w.shape[1] if transpose_w else w.shape[2]
  bm, bk, bn = (_block(b, d) for b, d in zip(GMM_BLOCKS, (m, k, n)))
  tiles = pl.cdiv(m, bm)
  starts, ends = _offsets(sizes_e)
  # Groups overlapping tile t's rows [t*bm, min((t+1)*bm, total)): from the one holding its
  # first row to the one holding its last, none where the tile starts past every group.
  first_row = jnp.arange(tiles, dtype=jnp.int32) * bm
  last_row = jnp.minimum(first_row + bm, ends[-1]) - 1
  lo = jnp.searchsorted(ends, first_row, side="right").astype(jnp.int32)
  hi = jnp.searchsorted(ends, last_row, side="right").astype(jnp.int32) + 1
  hi = jnp.where(first_row < ends[-1], hi, lo)
  kernel = functools.partial(
      _gmm_kernel, bm=bm, bk=bk, bn=bn, m=m, k=k, n=n, transpose_w=transpose_w
  )
  return pl.pallas_call(
      kernel,
      grid=(tiles, pl.cdiv(n, bn)),
      out_shape=_result((m, n), x_mk),
      interpret=interpret,
      name="grouped_matmul",
      **_compiler_params(interpret),
  )(lo, hi, starts, ends, x_mk, w)


def _gmm_kernel(
    lo_ref, hi_ref, starts_ref, ends_ref, x_ref, w_ref, y_ref, *, bm, bk, bn, m, k, n, transpose_w
):
  """One (row tile t, column tile j) of y: sum over the groups g overlapping the tile of
  (x rows of g) @ w[g], over K in bk slices."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  t, j = pl.program_id(0), pl.program_id(1)
  rows = t * bm + jnp.arange(bm)
  cols = j * bn + jnp.arange(bn)
  row_slice, col_slice = pl.ds(t * bm, bm), pl.ds(j * bn, bn)

  def group(g, acc):
    in_group = (rows >= starts_ref[g]) & (rows < ends_ref[g])

    def k_step(i, acc):
      ks = i * bk + jnp.arange(bk)
      k_ok = ks < k
      x = plgpu.load(
          x_ref.at[row_slice, pl.ds(i * bk, bk)],
          mask=in_group[:, None] & k_ok[None, :],
          other=0,
      )  # [bm, bk]
      if transpose_w:  # w [E, N, K]
        w = plgpu.load(
            w_ref.at[g, col_slice, pl.ds(i * bk, bk)],
            mask=(cols < n)[:, None] & k_ok[None, :],
            other=0,
        )  # [bn, bk]
        return acc + plgpu.dot(x, w, trans_b=True)  # f32 (plgpu.dot's result)
      w = plgpu.load(
          w_ref.at[g, pl.ds(i * bk, bk), col_slice],
          mask=k_ok[:, None] & (cols < n)[None, :],
          other=0,
      )  # [bk, bn]
      return acc + plgpu.dot(x, w)

    return jax.lax.fori_loop(0, pl.cdiv(k, bk), k_step, acc)

  acc = jax.lax.fori_loop(lo_ref[t], hi_ref[t], group, jnp.zeros((bm, bn), jnp.float32))
  ok = (rows < m)[:, None] & (cols < n)[None, :]
  plgpu.store(y_ref.at[row_slice, col_slice], acc.astype(y_ref.dtype), mask=ok)


# --------------------------------------------------------------------------------- tgmm


def tgmm(x_mk, dy_mn, sizes_e, *, interpret: bool = False):
  """The weight gradient of gmm: [E, K, N], dw[e] = x_e^T dy_e over group e's rows (0 for an
  empty group), f32 accumulation, in x's dtype."""
  from jax.experimental import pallas as pl

  x_mk, dy_mn, sizes_e = _varying_together(x_mk, dy_mn, sizes_e)
  m, k = x_mk.shape
  n = dy_mn.shape[1]
  e = sizes_e.shape[0]
  bm, bk, bn = (_block(b, d) for b, d in zip(TGMM_BLOCKS, (m, k, n)))
  starts, ends = _offsets(sizes_e)
  kernel = functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn, k=k, n=n)
  return pl.pallas_call(
      kernel,
      grid=(e, pl.cdiv(k, bk), pl.cdiv(n, bn)),
      out_shape=_result((e, k, n), x_mk),
      interpret=interpret,
      name="grouped_matmul_weight_grad",
      **_compiler_params(interpret),
  )(starts, ends, x_mk, dy_mn)


def _tgmm_kernel(starts_ref, ends_ref, x_ref, dy_ref, dw_ref, *, bm, bk, bn, k, n):
  """One (group g, dw row tile a, column tile b): x[rows of g, a]^T dy[rows of g, b], the
  group's rows in bm chunks."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  g, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[g], ends_ref[g]
  ks = a * bk + jnp.arange(bk)
  cols = b * bn + jnp.arange(bn)
  k_slice, col_slice = pl.ds(a * bk, bk), pl.ds(b * bn, bn)

  def step(i, acc):
    r0 = start + i * bm
    row_ok = (r0 + jnp.arange(bm) < end)[:, None]
    x = plgpu.load(x_ref.at[pl.ds(r0, bm), k_slice], mask=row_ok & (ks < k)[None, :], other=0)
    dy = plgpu.load(dy_ref.at[pl.ds(r0, bm), col_slice], mask=row_ok & (cols < n)[None, :], other=0)
    return acc + plgpu.dot(x, dy, trans_a=True)  # [bk, bn] f32

  acc = jax.lax.fori_loop(0, pl.cdiv(end - start, bm), step, jnp.zeros((bk, bn), jnp.float32))
  ok = (ks < k)[:, None] & (cols < n)[None, :]
  plgpu.store(dw_ref.at[g, k_slice, col_slice], acc.astype(dw_ref.dtype), mask=ok)


def _result(shape, like):
  """The kernel's result: `like`'s dtype, varying over the manual axes it does (operands made
  alike by `_varying_together`)."""
  return jax.ShapeDtypeStruct(shape, like.dtype, manual_axis_type=jax.typeof(like).mat)


def _compiler_params(interpret: bool) -> dict:
  if interpret:
    return {}
  from jax.experimental.pallas import triton as plgpu

  return {"compiler_params": plgpu.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)}
