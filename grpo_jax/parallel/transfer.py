"""Device-to-device moves of array trees between two disjoint meshes (trainer <-> sampler).

No host round trip and no gather: the src devices and the dst devices (laid out in the src
mesh's shape, `same_layout_mesh`) are stacked into one "union" mesh with a leading `role` axis
(0 = dst, 1 = src). Each leaf becomes one union array whose rows are [dst buffer; src data],
sharded P(("role", *dim0_axes), ...), so every device's block is exactly its own shard (built
with make_array_from_single_device_arrays: no copy), and one shard_map'd `ppermute` over `role`
sends every src device's block to the dst device in the same position. The dst blocks then
form the result; only a leaf whose wanted dst sharding places shards differently is resharded,
by a jit over the dst devices alone.

Per tree structure four programs, each over all leaves at once (cached): the cast (src mesh;
bf16 before moving halves the bytes), the dst buffers (dst devices; skipped for leaves whose
`donate` buffer is reused), the ppermute (union mesh, donated: the dst buffers become the
result, the src temporaries the src side's dead output) and the reshard (dst mesh, when
needed). Multi-controller: every process calls `move` the same way; a process that owns
devices of one mesh only just has no local work in the other mesh's programs.
"""

import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

ROLE = "role"


def same_layout_mesh(src: Mesh, dst: Mesh) -> Mesh:
  """`dst`'s devices (in flat order) laid out in `src`'s shape and axis names."""
  return Mesh(
      np.asarray(dst.devices).reshape(src.devices.shape), src.axis_names, axis_types=src.axis_types
  )


def _ids(mesh: Mesh) -> np.ndarray:
  return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)


def _signature(x):
  return np.shape(x), getattr(x, "dtype", None), getattr(x, "sharding", None)


def _union_spec(spec: P, ndim: int) -> P:
  """The union array's spec: `role` outermost on dim 0 (a scalar moves as shape [1])."""
  entries = tuple(spec) + (None,) * (ndim - len(spec)) if ndim else (None,)
  first = entries[0]
  first = () if first is None else (first,) if isinstance(first, str) else tuple(first)
  return P((ROLE, *first), *entries[1:])


def _send(x):
  """x's src block to the dst device in the same position. Floats cross as unsigned ints of
  their width: XLA:CPU widens a bf16 collective-permute to f32 (the cost: benchmarks/README.md,
  "Figures behind design choices")."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return jax.lax.ppermute(x, ROLE, [(1, 0)])
  bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
  y = jax.lax.ppermute(jax.lax.bitcast_convert_type(x, bits), ROLE, [(1, 0)])
  return jax.lax.bitcast_convert_type(y, x.dtype)


class CrossMesh:
  """Moves arrays from `src` mesh to `dst` mesh (same device count, disjoint devices).

  last_bytes: bytes of the last move's tree after the cast (global sizes: a replicated leaf
  counts once though each of its copies moves). last_sec: wall seconds of the last move, until
  this process's shards of the result (and its src side's part) are ready."""

  def __init__(self, src: Mesh, dst: Mesh):
    if src.devices.size != dst.devices.size:
      raise ValueError(
          f"CrossMesh needs meshes of equal size, got src {src.devices.size} and dst "
          f"{dst.devices.size} devices: give both meshes the same device count"
      )
    shared = {int(i) for i in _ids(src).flat} & {int(i) for i in _ids(dst).flat}
    if shared:
      raise ValueError(
          f"CrossMesh needs disjoint meshes, devices {sorted(shared)} are in both: "
          "build the src and dst meshes over separate devices"
      )
    self.src, self.dst = src, dst
    self.same = same_layout_mesh(src, dst)  # [*src.shape]: where each src shard lands
    self.union = Mesh(
        np.stack([self.same.devices, src.devices]),
        (ROLE, *src.axis_names),
        axis_types=(jax.sharding.AxisType.Auto,) * (src.devices.ndim + 1),
    )
    self._dst_ids = {int(i) for i in _ids(dst).flat}
    self._programs = {}
    self.last_bytes = 0
    self.last_sec = 0.0

  # ----------------------------------------------------------------------------- planning

  def _src_spec(self, x) -> P:
    s = getattr(x, "sharding", None)
    if not (
        isinstance(s, NamedSharding)
        and s.mesh.axis_names == self.src.axis_names
        and np.array_equal(_ids(s.mesh), _ids(self.src))
    ):
      raise ValueError(
          f"CrossMesh.move: a leaf of shape {np.shape(x)} has sharding {s}, not a "
          "NamedSharding on the src mesh: put the tree on the src mesh first"
      )
    return s.spec

  def _wanted(self, s, shape) -> NamedSharding:
    if isinstance(s, P):
      s = NamedSharding(self.dst, s)
    if not (isinstance(s, NamedSharding) and set(_ids(s.mesh).flat) == self._dst_ids):
      raise ValueError(
          f"CrossMesh.move: dst sharding {s} for a leaf of shape {shape} is not a "
          "NamedSharding on the dst mesh: pass NamedSharding(dst, spec) or a spec"
      )
    return s

  def _plan(self, leaves, wanted, old, dtype):
    """Per leaf (shape, moved dtype, src spec, wanted, direct), where `direct`: the landed
    shards already sit where `wanted` puts them (no reshard); and per leaf `reuse`: the donated
    dst array's buffers are laid out as the landed shards, so they become the result's."""
    plan, reuse = [], []
    for x, w, o in zip(leaves, wanted, old):
      spec = self._src_spec(x)
      w = self._wanted(w, x.shape)
      dt = jnp.dtype(
          dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
      )
      landed = NamedSharding(self.same, spec)
      plan.append((x.shape, dt, spec, w, x.ndim > 0 and landed.is_equivalent_to(w, x.ndim)))
      if o is not None and (o.shape != x.shape or o.dtype != dt):
        raise ValueError(
            f"CrossMesh.move: donated array {o.shape} {o.dtype} does not match the "
            f"moved leaf {x.shape} {dt}: donate the result of the previous move"
        )
      reuse.append(o is not None and x.ndim > 0 and o.sharding.is_equivalent_to(landed, x.ndim))
    return tuple(plan), tuple(reuse)

  def _compile(self, plan, fresh):
    """The four programs for a plan; `fresh`: per leaf, whether its dst buffer is allocated."""
    cast_out = [NamedSharding(self.src, spec if shape else P()) for shape, _, spec, _, _ in plan]

    def cast(xs):  # a copy even when the dtype stays: the union program donates it
      return [
          jnp.copy(x.astype(dt)).reshape(shape or (1,)) for x, (shape, dt, _, _, _) in zip(xs, plan)
      ]

    alloc_plan = [p for p, f in zip(plan, fresh) if f]
    alloc_out = [
        NamedSharding(self.same, spec if shape else P()) for shape, _, spec, _, _ in alloc_plan
    ]

    def alloc():
      return [jnp.zeros(shape or (1,), dt) for shape, dt, _, _, _ in alloc_plan]

    uspecs = [_union_spec(spec, len(shape)) for shape, _, spec, _, _ in plan]
    send = jax.shard_map(
        lambda xs: [_send(x) for x in xs], mesh=self.union, in_specs=(uspecs,), out_specs=uspecs
    )
    moved = [p for p in plan if not p[4]]

    def reshard(xs):
      return [x.reshape(shape) for x, (shape, _, _, _, _) in zip(xs, moved)]

    return (
        jax.jit(cast, out_shardings=cast_out),
        jax.jit(alloc, out_shardings=alloc_out) if alloc_plan else None,
        jax.jit(send, donate_argnums=0),
        jax.jit(reshard, out_shardings=[p[3] for p in moved]) if moved else None,
    )

  # ----------------------------------------------------------------------------------- move

  def move(self, tree, dst_shardings, *, dtype=None, donate=None):
    """tree: pytree of jax.Arrays on `src` (NamedSharding on src). dst_shardings: a pytree
    (same structure) of NamedSharding on `dst`, or one NamedSharding/PartitionSpec for all
    leaves (a PartitionSpec means NamedSharding(dst, spec)). dtype: cast floating leaves to it
    first (on src, so fewer bytes move). donate: optional pytree of existing dst arrays (same
    structure; shapes and dtypes after the cast) whose buffers are reused (donated) for the
    result, so the dst side never holds two copies. -> the tree on dst."""
    t0 = time.perf_counter()
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      self.last_bytes, self.last_sec = 0, 0.0
      return tree
    if isinstance(dst_shardings, (NamedSharding, P)):
      wanted = [dst_shardings] * len(leaves)
    else:
      wanted = jax.tree.leaves(dst_shardings)
    old = [None] * len(leaves) if donate is None else jax.tree.leaves(donate)
    for name, other in (("dst_shardings", wanted), ("donate", old)):
      if len(other) != len(leaves):
        raise ValueError(
            f"CrossMesh.move: {name} has {len(other)} leaves, the tree "
            f"{len(leaves)}: give it the tree's structure"
        )
    dtype = None if dtype is None else jnp.dtype(dtype)
    key = (
        treedef,
        tuple(_signature(x) for x in leaves),
        tuple(wanted),
        dtype,
        tuple(o if o is None else _signature(o) for o in old),
    )
    if key not in self._programs:  # validation, layouts and programs once per signature
      plan, reuse = self._plan(leaves, wanted, old, dtype)
      self._programs[key] = plan, reuse, self._compile(plan, tuple(not r for r in reuse))
    plan, reuse, (cast, alloc, send, reshard) = self._programs[key]
    for o, r in zip(old, reuse):
      if o is not None and not r:
        o.delete()  # laid out otherwise: freed first, so dst never holds two copies

    srcs = cast(leaves)
    allocs = iter(alloc() if alloc is not None else [])
    unions = []
    for s, o, r, (shape, dt, spec, _, _) in zip(srcs, old, reuse, plan):
      d = o if r else next(allocs)
      ushape = (2 * (shape[0] if shape else 1), *shape[1:])
      shards = [a.data for a in d.addressable_shards] + [a.data for a in s.addressable_shards]
      unions.append(
          jax.make_array_from_single_device_arrays(
              ushape, NamedSharding(self.union, _union_spec(spec, len(shape))), shards, dtype=dt
          )
      )
    outs = send(unions)

    result, pending, back = [], [], []
    for u, (shape, dt, spec, w, direct) in zip(outs, plan):
      landed = [a.data for a in u.addressable_shards if a.device.id in self._dst_ids]
      back += [a.data for a in u.addressable_shards if a.device.id not in self._dst_ids]
      if direct:
        result.append(jax.make_array_from_single_device_arrays(shape, w, landed, dtype=dt))
      else:
        result.append(None)
        sharding = NamedSharding(self.same, spec if shape else P())
        pending.append(
            jax.make_array_from_single_device_arrays(shape or (1,), sharding, landed, dtype=dt)
        )
    if pending:
      it = iter(reshard(pending))
      result = [next(it) if r is None else r for r in result]

    for a in back:  # the src side's part of the program (this process's work only)
      a.block_until_ready()
    for r in result:
      for a in r.addressable_shards:
        a.data.block_until_ready()
    self.last_bytes = sum(int(np.prod(shape)) * dt.itemsize for shape, dt, _, _, _ in plan)
    self.last_sec = time.perf_counter() - t0
    return jax.tree.unflatten(treedef, result)
