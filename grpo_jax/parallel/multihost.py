"""Host <-> global-array plumbing that works the same on one process and on many.

Each JAX process owns the rows of a batch that live on its devices (`process_rows`). It builds the global batch
from its own rows (`to_global`), reads back just its rows of a global result (`local_rows`,
e.g. rollout tokens to decode and score on its host), and sums host-side statistics over all
processes (`sum_over_processes`).
"""

import jax
from jax.experimental import multihost_utils
import numpy as np

from grpo_jax.parallel import sharding


def owns(mesh) -> bool:
  """Whether this process holds devices of `mesh` (with rollout.placement=disaggregated a
  process may hold only sampler or only trainer devices)."""
  return any(d.process_index == jax.process_index() for d in mesh.devices.flat)


def to_global(local: np.ndarray, mesh, global_rows: int | None = None) -> jax.Array:
  """This process's rows -> one global array with rows sharded over (data, fsdp).
  global_rows: the global row count, needed only on a process without devices in `mesh`
  (it contributes no rows; its array has no addressable shards)."""
  local = np.asarray(local)
  spec = sharding.batch_sharding(mesh, local.ndim)
  if not owns(mesh):
    if global_rows is None:
      raise ValueError("to_global on a process without devices in the mesh needs global_rows")
    return jax.make_array_from_single_device_arrays(
        (global_rows, *local.shape[1:]), spec, [], dtype=local.dtype
    )
  return jax.make_array_from_process_local_data(spec, local)


def process_rows(mesh, global_rows: int) -> np.ndarray:
  """Positions (sorted) of the rows of a [global_rows, ...] batch sharded over (data, fsdp)
  that this process's devices hold: the rows `to_global` expects from it, in that order."""
  index_map = sharding.batch_sharding(mesh, 1).addressable_devices_indices_map((global_rows,))
  starts = sorted({(idx[0].start or 0, idx[0].stop) for idx in index_map.values()})
  if not starts:  # no devices of the mesh here: no rows
    return np.zeros(0, np.int64)
  return np.concatenate([np.arange(a, global_rows if b is None else b) for a, b in starts])


def replicated(value, mesh) -> jax.Array:
  """A host value that every process holds alike -> one array replicated over the mesh (an
  explicit transfer; `jax.device_put` refuses a sharding that spans other processes)."""
  value = np.asarray(value)
  with jax.transfer_guard_host_to_device("allow"):  # on purpose (the loop's transfer guard)
    return jax.make_array_from_callback(
        value.shape, sharding.replicated(mesh), lambda index: value[index], dtype=value.dtype
    )


def local_rows(tree):
  """The rows of row-sharded global arrays (one, or a pytree of them) held by this process, in
  global row order (the order `to_global` took them in). One device-to-host transfer for all."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, jax.device_get(tree))

  def own_shards(x):
    by_start = {}
    for s in x.addressable_shards:  # replicas over the tensor axis hold the same rows
      by_start.setdefault(s.index[0].start or 0, s.data)
    return [by_start[k] for k in sorted(by_start)]

  shards = jax.device_get(jax.tree.map(own_shards, tree))  # leaves: lists of row blocks
  empty = jax.tree.map(lambda x: np.zeros((0, *x.shape[1:]), x.dtype), tree)
  return jax.tree.map(
      lambda blocks, e: np.concatenate([np.asarray(b) for b in blocks], axis=0) if blocks else e,
      shards,
      empty,
      is_leaf=lambda x: isinstance(x, list),
  )


def read(tree, mesh):
  """Host copies of replicated arrays on `mesh`, on every process: a process without devices
  in `mesh` gets them from process 0 (which holds trainer devices: build.make_meshes)."""
  if {d.process_index for d in mesh.devices.flat} == set(range(jax.process_count())):
    return jax.device_get(tree)
  values = (
      jax.device_get(tree)
      if owns(mesh)
      else jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)
  )
  return multihost_utils.broadcast_one_to_all(values)


def spans_processes(mesh) -> bool:
  """Whether `mesh` holds devices of more than one process."""
  return len({d.process_index for d in mesh.devices.flat}) > 1


def from_first_process(value: np.ndarray, mesh) -> np.ndarray:
  """The host value of the first process among `mesh`'s, on every process of `mesh` (a
  collective over its devices only: processes outside it, disaggregated, are not waited for).
  Every process of the mesh passes an array of the same shape and dtype."""
  value = np.asarray(value)
  devices = list(mesh.devices.flat)
  first = min(d.process_index for d in devices)
  flat = jax.sharding.Mesh(np.array(devices), ("all",))
  mine = value if jax.process_index() == first else np.zeros_like(value)
  with jax.transfer_guard_host_to_device("allow"):
    stacked = jax.make_array_from_callback(
        (len(devices), *value.shape),
        jax.sharding.NamedSharding(flat, jax.sharding.PartitionSpec("all")),
        lambda index: mine[None],
        dtype=value.dtype,
    )
  i = next(k for k, d in enumerate(devices) if d.process_index == first)
  out = jax.jit(
      lambda a: a[i], out_shardings=jax.sharding.NamedSharding(flat, jax.sharding.PartitionSpec())
  )(stacked)
  return np.asarray(out.addressable_data(0))


def from_mesh_to_all(value: np.ndarray, mesh) -> np.ndarray:
  """The host value of the first process among `mesh`'s, on every JAX process (a collective
  over all of them; `from_first_process` waits for the mesh's processes only). Identity where
  every process holds devices of `mesh`, whose processes then already agree on the value."""
  value = np.asarray(value)
  if mesh is None or {d.process_index for d in mesh.devices.flat} == set(
      range(jax.process_count())
  ):
    return value
  first = min(d.process_index for d in mesh.devices.flat)
  return np.asarray(
      multihost_utils.broadcast_one_to_all(value, is_source=jax.process_index() == first)
  )


def per_process(x) -> np.ndarray:
  """[processes, *x.shape]: every process's host value, by process index (reduce it as needed:
  one gather where a sum and a max would take two)."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x[None]
  return np.asarray(multihost_utils.process_allgather(x)).reshape(-1, *x.shape)


def sum_over_processes(x) -> np.ndarray:
  """Elementwise sum of a host value over all JAX processes (identity on one process)."""
  x = np.asarray(x)
  return x if jax.process_count() == 1 else per_process(x).sum(axis=0)


def any_process(flag: bool) -> bool:
  """True on every process when any process says True (e.g. 'I got SIGTERM')."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.asarray(multihost_utils.process_allgather(np.array(flag))).any())


def barrier(name: str):
  """Every process waits here until all have arrived (no-op on one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def sharded_rows(value, mesh) -> jax.Array:
  """A host value that every process holds whole -> one global array with rows sharded over
  (data, fsdp, expert), each process providing its own shards (an explicit transfer)."""
  value = np.asarray(value)
  with jax.transfer_guard_host_to_device("allow"):  # on purpose (the loop's transfer guard)
    return jax.make_array_from_callback(
        value.shape,
        sharding.batch_sharding(mesh, value.ndim),
        lambda index: value[index],
        dtype=value.dtype,
    )


# ------------------------------------------------ checkpoint leaves on some processes only


def _local_to_a_process(x) -> bool:
  """An array (or abstract one) on devices of some processes only, in a multi-process job:
  e.g. the trainer's or the sampler's mesh with rollout.placement=disaggregated when each
  process holds one role. Orbax writes only arrays that span every process."""
  s = getattr(x, "sharding", None)
  return (
      jax.process_count() > 1
      and s is not None
      and ({d.process_index for d in s.device_set} != set(range(jax.process_count())))
  )


def savable(x):
  """A leaf to hand Orbax's save (jax.tree.map over the tree; every process): an array that
  spans every process as it is; one on some processes only as a host array, which process 0
  writes: its value on process 0 (the loop keeps such arrays on the trainer's mesh, which holds
  process 0's devices), a zero placeholder elsewhere."""
  if not _local_to_a_process(x):
    return x
  if not any(d.process_index == 0 for d in x.sharding.device_set):
    raise ValueError(f"a checkpoint leaf {x.shape} lives on devices process 0 does not hold")
  return np.asarray(jax.device_get(x)) if jax.process_index() == 0 else np.zeros(x.shape, x.dtype)


def readable(x):
  """The restore target of a leaf `savable` wrote (x abstract, with its sharding)."""
  return np.empty(x.shape, x.dtype) if _local_to_a_process(x) else x


def placed(value, target):
  """A leaf Orbax restored for `readable(target)` -> an array in the target's sharding."""
  if not _local_to_a_process(target):
    return value
  value = np.asarray(value)
  return jax.make_array_from_callback(
      target.shape, target.sharding, lambda i: value[i], dtype=target.dtype
  )
