"""Ragged decode attention: one kernel that reads only the cache slots written so far
(`ragged`: Triton, the GPU's; `ragged_tpu`: Mosaic, the slot engine's on TPU, at the end).

The group sampler's decode step (rollout/sampler.py) attends each row's query to its prompt's
keys/values, kept once per group of G rows (`cache.share_prompt`: "prefix"), and to the
row's own completion cache [N, Hkv, S, K], of which only slots 0..length-1 are written (every
row writes slot t at step t). The XLA form (`attention.cache_attention`) reads all S slots
of every layer each step and runs ~8 small kernels per layer (two score products, masks, a
softmax, two value products, the prefix's sum and a transpose). `ragged` is one Pallas kernel
per layer (Triton on GPU; Pallas's interpreter elsewhere, for tests): a program per (row, kv
head) runs an online softmax over its prompt's valid slots and then over the first
ceil(length / block) blocks of its cache, and writes the normalized output: the slots past
`length` are never read, so the decode needs no phases (rollout.decode_phases) to avoid them.

Layout requirements (the sampler meets them: its cache slots and `share_prompt(...,
prefix_multiple=BLOCK)`): the cache's S and the prefix's P are multiples of BLOCK; the
completion slots < length are all valid (the sampler's cache, not a padded one); q heads per
kv head <= 16 (`supports`; else `layers.Block.decode` keeps the XLA attention).

Which attention a trace uses: `Kernels.ragged_decode` (kernels.py), read by
`layers.Block.decode`; `choose(impl, platform)` resolves the Sampler's `decode_attention` (None:
DEFAULT) into it.
Measured: benchmarks/README.md, "Ragged decode attention".
"""

import functools

import jax
import jax.numpy as jnp

from grpo_jax.models.decoder.attention import cache_attention
from grpo_jax.models.decoder.attention import slot_mask
from grpo_jax.parallel import sharding

IMPLS = ("auto", "xla", "pallas", "pallas_tpu")
# The sampler's choice when it is given none (rollout.Sampler(decode_attention=None)), a
# process-wide default (benchmarks/accelerator.py's loop_xla sets "xla" in its child process).
DEFAULT = "auto"
BLOCK = 64  # cache slots per kernel step (the cache and the prompt are padded to a multiple)
_ROWS = 16  # query rows per program: tensor-core dots need >= 16 (GQA groups are padded)


def choose(impl: str | None, platform: str) -> bool:
  """Whether the sampler's decode runs `ragged`: impl "pallas" always (off GPU in Pallas's
  interpreter: slow, for tests), "xla" never, "auto" on GPU (Triton); None: DEFAULT.
  ("pallas_tpu", the slot engine's TPU kernel: the lockstep sampler keeps XLA's attention.)"""
  impl = DEFAULT if impl is None else impl
  if impl not in IMPLS:
    raise ValueError(f"decode_attention={impl!r}: use one of {', '.join(IMPLS)}")
  return impl == "pallas" or (impl == "auto" and platform in ("gpu", "cuda", "rocm"))


def choose_slots(impl: str | None, platform: str) -> tuple[bool, bool]:
  """The slot engine's decode attention -> (ragged, tpu): a kernel over each row's written
  slots only, and whether it is the TPU's (`ragged_tpu`, Mosaic) rather than `ragged`
  (Triton). "auto": `ragged` on GPU, `ragged_tpu` on TPU, XLA's attention on CPU; "pallas":
  the platform's kernel (off GPU and TPU Triton's in Pallas's interpreter); "pallas_tpu":
  `ragged_tpu` (off TPU in the interpreter: the CPU tests); "xla": neither; None: DEFAULT."""
  impl = DEFAULT if impl is None else impl
  choose(impl, platform)  # (validates)
  tpu = platform == "tpu"
  if impl == "pallas_tpu" or (impl in ("auto", "pallas") and tpu):
    return True, True
  return choose(impl, platform), False


def reads_every_layer(cfg, tpu: bool, interpret: bool = False) -> bool:
  """Whether the slot engine's decode kernel (`ragged_tpu` with `tpu`, else `ragged`) reads
  every layer of a model (ModelConfig): no soft-capped scores, no sliding-window layer (under a
  layer scan one such layer makes every layer's window a traced choice), and the heads its
  tiles take (`supports` / `supports_tpu`); a layer it does not read runs XLA's attention."""
  h, hkv, kd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  windows = cfg.sliding_window > 0 and any(cfg.local_layers)
  if cfg.attn_logit_softcap or windows or h % hkv:
    return False
  if tpu:
    return interpret or kd % 128 == 0
  return h // hkv <= _ROWS and (interpret or (kd >= 16 and kd & (kd - 1) == 0))


def over_slots(q_bthk, cache_k, cache_v, at_b, kernels, *, window=None, softcap=0.0, layer=None):
  """The slot engine's decode attention (`layers.Block.decode_rows`): T new queries per row at
  slots at_b .. at_b + T - 1 of the row's own cache, each over the row's slots up to its own
  (the cache written first; a row's sequence lies contiguously from slot 0). -> [B, T, H, K].

  q [B, T, H, K]; cache_k, cache_v head-major [B, Hkv, S, K] (with `kernels.ragged_tpu`
  slot-major [B, S, Hkv, K]), or with `layer` (an int32 scalar, under the layer scan) every
  layer's stacked [L, ...], of which layer `layer` is read. `kernels` (kernels.Kernels):
  with T = 1, no window and no soft-cap, `ragged_tpu` (TPU) or `ragged` (GPU) reads each row's
  written slots only, a stack's layer in place; else XLA's attention over all S slots,
  masked, on the layer's cache (sliced out of a stack: a copy per step; transposed when
  slot-major)."""
  b, t = q_bthk.shape[:2]
  shape = cache_k.shape[-4:]  # [B, Hkv, S, K]
  slot_major = kernels.ragged_tpu
  if slot_major:
    shape = (shape[0], shape[2], shape[1], shape[3])
  kernel = kernels.ragged_decode and t == 1 and window is None and not softcap
  if kernel and slot_major:
    interpret = kernels.platform != "tpu"
    if supports_tpu(q_bthk, shape, interpret=interpret):
      return ragged_tpu(q_bthk, cache_k, cache_v, at_b + 1, layer=layer, interpret=interpret)
  elif kernel:
    # (the prompt block: an unread placeholder; no shared prompt, the slot's cache holds it)
    none = jnp.zeros((b, shape[1], BLOCK, shape[3]), cache_k.dtype)
    prefix = (none, none, jnp.zeros((b, BLOCK), jnp.int32))
    per_layer = jax.ShapeDtypeStruct(shape, cache_k.dtype)
    if supports(q_bthk, per_layer, none, interpret=kernels.interpret):
      return ragged(
          q_bthk, cache_k, cache_v, at_b + 1, prefix, layer=layer, interpret=kernels.interpret
      )
  s = shape[2]
  k, v = cache_k, cache_v
  if layer is not None:
    k, v = (jax.lax.dynamic_index_in_dim(c, layer, 0, keepdims=False) for c in (k, v))
  if slot_major:
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  positions = at_b[:, None] + jnp.arange(t, dtype=at_b.dtype)
  valid = jnp.ones((b, s), jnp.int32)  # slot_mask's causality does the rest
  empty = jnp.zeros((b, k.shape[1], 0, k.shape[3]), k.dtype)
  return cache_attention(
      q_bthk,
      k,
      v,
      slot_mask(positions, jnp.arange(s), valid, window),
      (empty, empty, jnp.zeros((b, 0), jnp.int32)),
      jnp.zeros((b, 1, 1, 0), bool),
      softcap=softcap,
  )


def supports(q_bthk, cache_k, prefix_k, *, interpret: bool = False) -> bool:
  """Shapes `ragged` takes: one query per row, GQA groups <= 16 rows, slots in whole blocks;
  compiled for GPU (not `interpret`: Triton tiles) a power-of-two head_dim >= 16."""
  b, t, h, kd = q_bthk.shape
  hkv, s = cache_k.shape[1], cache_k.shape[2]
  tiles = interpret or (kd >= 16 and kd & (kd - 1) == 0)
  return (
      t == 1
      and h % hkv == 0
      and h // hkv <= _ROWS
      and s % BLOCK == 0
      and tiles
      and prefix_k.shape[2] % BLOCK == 0
      and b % prefix_k.shape[0] == 0
  )


def ragged(q_bthk, k_nhsk, v_nhsk, length, prefix, *, layer=None, interpret: bool = False):
  """Decode attention of one query per row over its prompt (shared per group) and the first
  `length` slots of its cache; the same values as `attention.cache_attention` with the query at slot
  length - 1 and slots < length valid (f32 softmax; on GPU the
  probabilities meet V in the compute dtype, as there).

  q [N, 1, H, K]; k, v [N, Hkv, S, K] (head-major cache, slots < length written); length: int32
  scalar (1..S), the lockstep sampler's, or [N], one per row (the slot engine's: each row at
  its own position); prefix = (pk, pv, p_valid): [N/G, Hkv, P, K], [N/G, P]. -> [N, 1, H, K].
  `layer` (an int32 scalar; the slot engine's layer scan): k, v are every layer's caches
  stacked [L, N, Hkv, S, K] and the kernel reads layer `layer`'s written slots of them in
  place (a `k[layer]` before the call is a copy of the layer's whole cache per step: on an
  H100 2 x 168 MB per layer at Qwen3-0.6B's recipe shapes, benchmarks/README.md "Slot
  engine"). `interpret`: Pallas's interpreter (off GPU: Kernels.interpret), else Triton."""
  pk, pv, p_valid = prefix
  n, _, h, kd = q_bthk.shape
  stacked = layer is not None
  hkv = k_nhsk.shape[2 if stacked else 1]
  q = q_bthk.reshape(n, hkv, h // hkv, kd)
  length = jnp.asarray(length, jnp.int32).reshape(-1)
  per_row = length.shape[0] > 1 or n == 1
  layers = () if not stacked else (jnp.asarray(layer, jnp.int32).reshape(1),)
  call = functools.partial(
      _call, groups=n // pk.shape[0], interpret=interpret, per_row=per_row, stacked=stacked
  )
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and set(sharding.MESH_AXES) <= set(mesh.axis_names):
    qs = sharding.logical_to_spec(("batch", "kv_heads", "q_heads", "head_dim"), q.shape, mesh)
    per_layer = k_nhsk.shape[1:] if stacked else k_nhsk.shape  # (a stack's layers: whole)
    ks = sharding.logical_to_spec(("batch", "kv_heads", "length", "head_dim"), per_layer, mesh)
    ps = sharding.logical_to_spec(("batch", "kv_heads", "length", "head_dim"), pk.shape, mesh)
    vs = sharding.logical_to_spec(("batch", "length"), p_valid.shape, mesh)
    if qs[0] != ks[0] or qs[0] != ps[0] or qs[1] != ks[1] or ps[1] != ks[1]:
      spec = jax.sharding.PartitionSpec  # rows or heads split unevenly: one shard does it all
      qs, ks, ps, vs = spec(), spec(), spec(), spec()
    qs = jax.sharding.PartitionSpec(qs[0], qs[1], None, None)
    cache = jax.sharding.PartitionSpec(None, *ks) if stacked else ks
    call = jax.shard_map(
        call,
        mesh=mesh,
        check_vma=False,
        in_specs=(
            qs,
            cache,
            cache,
            ps,
            ps,
            vs,
            jax.sharding.PartitionSpec(qs[0]) if per_row else jax.sharding.PartitionSpec(),
            *(jax.sharding.PartitionSpec() for _ in layers),
        ),
        out_specs=qs,
    )
  out = call(q, k_nhsk, v_nhsk, pk, pv, p_valid.astype(jnp.int32), length, *layers)
  return out.reshape(n, 1, h, kd)


def _call(
    q, k, v, pk, pv, p_valid, length, *layer, groups: int, interpret: bool, per_row: bool, stacked
):
  from jax.experimental import pallas as pl

  n, hkv, r, kd = q.shape
  s, p = k.shape[-2], pk.shape[2]
  kernel = functools.partial(
      _kernel, rows=r, scale=kd**-0.5, prefix_blocks=p // BLOCK, stacked=stacked
  )
  row = lambda i, j: (i, j, 0, 0)  # noqa: E731
  prompt = lambda i, j: (i // groups, j, 0, 0)  # noqa: E731
  if stacked:  # the whole stack; the kernel reads its (layer, row, head)'s blocks
    cache = pl.BlockSpec(k.shape, lambda i, j: (0,) * 5)
  else:
    cache = pl.BlockSpec((None, None, s, kd), row)
  kw = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu

    kw["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=2)
  return pl.pallas_call(
      kernel,
      grid=(n, hkv),
      in_specs=[
          pl.BlockSpec((None, None, _ROWS, kd), row),
          cache,
          cache,
          pl.BlockSpec((None, None, p, kd), prompt),
          pl.BlockSpec((None, None, p, kd), prompt),
          pl.BlockSpec((None, p), lambda i, j: (i // groups, 0)),
          pl.BlockSpec((1,), (lambda i, j: (i,)) if per_row else (lambda i, j: (0,))),
          *(pl.BlockSpec((1,), lambda i, j: (0,)) for _ in layer),
      ],
      out_specs=pl.BlockSpec((None, None, _ROWS, kd), row),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=interpret,
      name="ragged_decode_attention",
      **kw,
  )(q, k, v, pk, pv, p_valid, length, *layer)


def _kernel(
    q_ref,
    k_ref,
    v_ref,
    pk_ref,
    pv_ref,
    pvalid_ref,
    len_ref,
    *refs,
    rows: int,
    scale: float,
    prefix_blocks: int,
    stacked: bool,
):
  """One (row, kv head): the online softmax (flash attention's) over the prompt's blocks, then
  over the cache's written blocks; q rows past the GQA group (padding to _ROWS) are masked.
  `stacked`: k_ref, v_ref are the whole [L, N, Hkv, S, K] stacks and refs[0] the layer."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu

  kd = q_ref.shape[-1]
  row_ok = (jnp.arange(_ROWS) < rows)[:, None]
  q = plgpu.load(q_ref, mask=row_ok, other=0)  # [R', K]
  neg = jnp.finfo(jnp.float32).min

  def update(carry, k_blk, v_blk, ok):  # [BLOCK, K] x2, ok [BLOCK]
    acc, m, l = carry
    sc = plgpu.dot(q, k_blk, trans_b=True).astype(jnp.float32) * scale  # [R', BLOCK]
    sc = jnp.where(ok[None, :], sc, neg)
    m_new = jnp.maximum(m, sc.max(axis=1))
    corr = jnp.exp(m - m_new)
    prob = jnp.where(ok[None, :], jnp.exp(sc - m_new[:, None]), 0.0)
    l = l * corr + prob.sum(axis=1)
    acc = acc * corr[:, None] + plgpu.dot(prob.astype(v_blk.dtype), v_blk).astype(jnp.float32)
    return acc, m_new, l

  def prompt_step(i, carry):
    sl = pl.ds(pl.multiple_of(i * BLOCK, BLOCK), BLOCK)
    return update(carry, pk_ref[sl, :], pv_ref[sl, :], pvalid_ref[sl] != 0)

  length = len_ref[0]
  if stacked:
    layer_ref, o_ref = refs
    at = (layer_ref[0], pl.program_id(0), pl.program_id(1))
  else:
    (o_ref,) = refs
    at = ()

  def cache_step(i, carry):
    sl = pl.ds(pl.multiple_of(i * BLOCK, BLOCK), BLOCK)
    ok = i * BLOCK + jnp.arange(BLOCK) < length
    return update(carry, k_ref[(*at, sl, slice(None))], v_ref[(*at, sl, slice(None))], ok)

  carry = (
      jnp.zeros((_ROWS, kd), jnp.float32),
      jnp.full((_ROWS,), neg, jnp.float32),
      jnp.zeros((_ROWS,), jnp.float32),
  )
  carry = jax.lax.fori_loop(0, prefix_blocks, prompt_step, carry)
  carry = jax.lax.fori_loop(0, pl.cdiv(length, BLOCK), cache_step, carry)
  acc, _, l = carry
  plgpu.store(o_ref, (acc / l[:, None]).astype(o_ref.dtype), mask=row_ok)


# ------------------------------------------------------------------------------------------ TPU

TPU_BLOCK = 128  # cache slots per grid step of `ragged_tpu` (a lane-wide tile)


def supports_tpu(q_bthk, cache_shape, *, interpret: bool = False) -> bool:
  """Shapes `ragged_tpu` takes (cache_shape head-major [.., Hkv, S, K]): one query per row,
  slots in whole TPU_BLOCKs; compiled for TPU (not `interpret`) a head_dim that is a multiple
  of 128 (the TPU's lanes)."""
  b, t, h, kd = q_bthk.shape
  hkv, s = cache_shape[-3], cache_shape[-2]
  lanes = interpret or kd % 128 == 0
  return t == 1 and h % hkv == 0 and s % TPU_BLOCK == 0 and lanes


def ragged_tpu(q_bthk, k_nshk, v_nshk, length, *, layer=None, interpret: bool = False):
  """The slot engine's decode attention on TPU (a Mosaic kernel): each row's query over the
  first length[b] slots of its own cache, no shared prompt; the same values as `ragged` with
  an empty prompt (f32 scores and softmax; the probabilities meet V in the compute dtype).

  q [N, 1, H, K]; k, v slot-major [N, S, Hkv, K] (slots before heads: how XLA:TPU lays out a
  cache written one slot per row, so the slot engine keeps its caches so on TPU and nothing is
  relaid out per step) or, with `layer` (an int32 scalar), every layer's caches stacked
  [L, N, S, Hkv, K], of which layer `layer` is read in place; length [N] int32 (1..S).
  -> [N, 1, H, K]. A block of TPU_BLOCK slots of every kv head per grid step (row, block),
  the lengths and the layer
  prefetched as scalars: a block past a row's length maps to the row's last written block, so
  the pipeline fetches nothing new for it and the kernel skips it (an online softmax over the
  written blocks). A block's [TPU_BLOCK x Hkv, K] keys meet all H queries in one product,
  pairs of different heads masked (Hkv times the FLOPs of a per-head product, no relayout in
  the kernel; the decode reads HBM, not the MXU, at its limit). `interpret`: Pallas's
  interpreter (the CPU tests)."""
  n, _, h, kd = q_bthk.shape
  stacked = layer is not None
  s, hkv = k_nshk.shape[-3], k_nshk.shape[-2]
  rows = -(-h // 8) * 8  # (sublanes: the heads padded to whole tiles)
  q = jnp.pad(q_bthk.reshape(n, h, kd), ((0, 0), (0, rows - h), (0, 0)))
  k, v = k_nshk, v_nshk
  length = jnp.asarray(length, jnp.int32).reshape(n)
  at = jnp.asarray(layer if stacked else 0, jnp.int32).reshape(1)
  call = functools.partial(
      _call_tpu, blocks=s // TPU_BLOCK, group=h // hkv, stacked=stacked, interpret=interpret
  )
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and set(sharding.MESH_AXES) <= set(mesh.axis_names):
    spec = jax.sharding.PartitionSpec
    qs = sharding.logical_to_spec(("batch", "q_heads", "head_dim"), q.shape, mesh)
    per_layer = k.shape[1:] if stacked else k.shape
    ks = sharding.logical_to_spec(("batch", "length", "kv_heads", "head_dim"), per_layer, mesh)
    rows_spec = qs[0] if qs[0] == ks[0] else None  # (rows split unevenly: one shard does all)
    qs, ks = spec(rows_spec, None, None), spec(rows_spec, None, None, None)
    cache = spec(None, *ks) if stacked else ks
    call = jax.shard_map(
        call,
        mesh=mesh,
        check_vma=False,
        in_specs=(spec(rows_spec), spec(), qs, cache, cache),
        out_specs=qs,
    )
  out = call(length, at, q, k, v)
  return out[:, :h].reshape(n, 1, h, kd)


def _call_tpu(length, layer, q, k, v, *, blocks: int, group: int, stacked: bool, interpret):
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  n, rows, kd = q.shape
  hkv = k.shape[-2]

  def block(i, b, length_ref, layer_ref):  # past the row's last written block: that block
    last = jnp.maximum(length_ref[i] - 1, 0) // TPU_BLOCK
    c = (i, jnp.minimum(b, last), 0, 0)
    return (layer_ref[0], *c) if stacked else c

  lead = (None,) if stacked else ()
  cache = pl.BlockSpec((*lead, None, TPU_BLOCK, hkv, kd), block)
  one = pl.BlockSpec((None, rows, kd), lambda i, b, *_: (i, 0, 0))
  kw = {}
  if not interpret:
    kw["compiler_params"] = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
  return pl.pallas_call(
      functools.partial(_kernel_tpu, blocks=blocks, group=group, scale=kd**-0.5),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(n, blocks),
          in_specs=[one, cache, cache],
          out_specs=one,
          scratch_shapes=[
              pltpu.VMEM((rows, 128), jnp.float32),  # running max (lanes alike)
              pltpu.VMEM((rows, 128), jnp.float32),  # running sum
              pltpu.VMEM((rows, kd), jnp.float32),  # running output
          ],
      ),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=interpret,
      name="ragged_decode_attention_tpu",
      **kw,
  )(length, layer, q, k, v)


def _kernel_tpu(
    length_ref,
    layer_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    acc_ref,
    *,
    blocks,
    group,
    scale,
):
  """One (row, block of slots): the online softmax's update for a written block. Column c of
  the block's flattened [TPU_BLOCK x Hkv] keys is slot c // Hkv of kv head c % Hkv, which
  query head j reads iff j // group == c % Hkv."""
  from jax.experimental import pallas as pl

  del layer_ref  # (read by the index maps)
  b = pl.program_id(1)
  length = length_ref[pl.program_id(0)]
  neg = jnp.finfo(jnp.float32).min

  @pl.when(b == 0)
  def _():
    m_ref[...] = jnp.full(m_ref.shape, neg, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(b * TPU_BLOCK < length)
  def _():
    q = q_ref[...]  # [rows, K]
    hkv, kd = k_ref.shape[-2], k_ref.shape[-1]
    k = k_ref[...].reshape(TPU_BLOCK * hkv, kd)
    v = v_ref[...].reshape(TPU_BLOCK * hkv, kd)
    sc = (
        jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        * scale
    )  # [rows, TPU_BLOCK x Hkv]
    col = jax.lax.broadcasted_iota(jnp.int32, sc.shape, 1)
    head = jax.lax.broadcasted_iota(jnp.int32, sc.shape, 0) // group
    ok = (b * TPU_BLOCK + col // hkv < length) & (col % hkv == head)
    sc = jnp.where(ok, sc, neg)
    m_prev = m_ref[...][:, :1]
    m_new = jnp.maximum(m_prev, sc.max(axis=1, keepdims=True))
    corr = jnp.exp(m_prev - m_new)
    prob = jnp.where(ok, jnp.exp(sc - m_new), 0.0)
    slot = b * TPU_BLOCK + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0) // hkv
    v = jnp.where(slot < length, v, jnp.zeros_like(v))  # (unwritten slots: never NaN * 0)
    l_ref[...] = jnp.broadcast_to(
        l_ref[...][:, :1] * corr + prob.sum(axis=1, keepdims=True), l_ref.shape
    )
    m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
    pv = jax.lax.dot_general(
        prob.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    acc_ref[...] = acc_ref[...] * corr + pv

  @pl.when(b == blocks - 1)
  def _():
    o_ref[...] = (acc_ref[...] / l_ref[...][:, :1]).astype(o_ref.dtype)
