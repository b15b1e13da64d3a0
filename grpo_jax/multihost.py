"""Host <-> global-array plumbing that works the same on one process and on many.

Each JAX process owns the rows of a batch that live on its devices. It builds the global batch
from its own rows (`to_global`), reads back just its rows of a global result (`local_rows`,
e.g. rollout tokens to decode and score on its host), and sums host-side statistics over all
processes (`sum_over_processes`).
"""
import jax
from jax.experimental import multihost_utils
import numpy as np

from grpo_jax import sharding


def to_global(local: np.ndarray, mesh) -> jax.Array:
  """This process's rows -> one global array with rows sharded over (data, fsdp)."""
  local = np.asarray(local)
  spec = sharding.batch_sharding(mesh, local.ndim)
  return jax.make_array_from_process_local_data(spec, local)


def replicated(value, mesh) -> jax.Array:
  """A host value that every process holds alike -> one array replicated over the mesh (an
  explicit transfer; `jax.device_put` refuses a sharding that spans other processes)."""
  value = np.asarray(value)
  with jax.transfer_guard_host_to_device("allow"):  # on purpose (the loop's transfer guard)
    return jax.make_array_from_callback(value.shape, sharding.replicated(mesh),
                                        lambda index: value[index])


def local_rows(x: jax.Array) -> np.ndarray:
  """The rows of a row-sharded global array held by this process, in global row order (the
  order `to_global` took them in). One device-to-host copy."""
  if jax.process_count() == 1:
    return np.asarray(jax.device_get(x))
  by_start = {}
  for s in x.addressable_shards:  # replicas over the tensor axis hold the same rows
    start = s.index[0].start or 0
    if start not in by_start:
      by_start[start] = s.data
  parts = jax.device_get([by_start[k] for k in sorted(by_start)])
  return np.concatenate([np.asarray(p) for p in parts], axis=0)


def sum_over_processes(x) -> np.ndarray:
  """Elementwise sum of a host value over all JAX processes (identity on one process)."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.process_allgather(x)).sum(axis=0)


def any_process(flag: bool) -> bool:
  """True on every process when any process says True (e.g. 'I got SIGTERM')."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.asarray(multihost_utils.process_allgather(np.array(flag))).any())
