"""Mesh axis names, the mesh from config, and the one table from logical axes to mesh axes.

Every parameter carries logical axis names (`logical_axes=("embed", "mlp")` metadata on its
nnx.Param); `LOGICAL_RULES` maps each name to mesh axes. Batch dimensions shard over
`BATCH_AXES` = (data, fsdp): plain data parallelism over `data`, ZeRO-3-style parameter
sharding over `fsdp`, Megatron-style tensor parallelism over `tensor`.
"""
import math
from typing import Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)
BATCH_AXES = (DATA, FSDP)

# logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated)
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "length": None,
    "vocab": TENSOR,
    "embed": FSDP,
    "q_heads": TENSOR,
    "kv_heads": TENSOR,
    "head_dim": None,
    "mlp": TENSOR,
    "norm": None,
    "layers": None,
    "act_embed": None,  # the embed dim of activations: replicated (fsdp shards params only)
}


def resolve_mesh_shape(sizes: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Fills the one -1 entry so the product equals num_devices; clear error otherwise."""
  sizes = list(sizes)
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh {sizes}: at most one axis may be -1 (fill)")
  fixed = math.prod(s for s in sizes if s != -1)
  if any(s == 0 or s < -1 for s in sizes) or num_devices % fixed:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} does not fit {num_devices} devices")
  if -1 in sizes:
    sizes[sizes.index(-1)] = num_devices // fixed
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} uses {math.prod(sizes)} devices but "
                     f"{num_devices} are available: make data * fsdp * tensor = {num_devices}")
  return tuple(sizes)


def data_parallel_size(mesh_or_shape) -> int:
  """Devices a batch's rows split over: data * fsdp (the one place this is computed).

  Takes a Mesh, or a (data, fsdp, tensor) shape from `resolve_mesh_shape`."""
  if isinstance(mesh_or_shape, Mesh):
    return mesh_or_shape.shape[DATA] * mesh_or_shape.shape[FSDP]
  data, fsdp, _ = mesh_or_shape
  return data * fsdp


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over all global devices (every process, multi-host ready)."""
  devices = jax.devices() if devices is None else list(devices)
  shape = resolve_mesh_shape((data, fsdp, tensor), len(devices))
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
              axis_types=(jax.sharding.AxisType.Auto,) * 3)


def logical_to_spec(logical_axes: Sequence[str | None] | None, shape=None,
                    mesh: Mesh | None = None) -> PartitionSpec:
  """PartitionSpec for logical axis names. With `shape` and `mesh`, a mesh axis that does not
  divide its dimension is dropped (that dimension stays replicated) instead of failing."""
  if logical_axes is None:
    return PartitionSpec()
  out, used = [], set()
  for i, name in enumerate(logical_axes):
    axes = LOGICAL_RULES.get(name) if name is not None else None
    if name is not None and name not in LOGICAL_RULES:
      raise ValueError(f"logical axis '{name}' has no rule in grpo_jax.sharding.LOGICAL_RULES")
    axes_t = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    if used & set(axes_t):  # a mesh axis shards at most one dimension: first one wins
      axes_t = ()
    if axes_t and shape is not None and mesh is not None:
      if shape[i] % math.prod(mesh.shape[a] for a in axes_t):
        axes_t = ()
    used |= set(axes_t)
    out.append(None if not axes_t else axes_t if isinstance(axes, tuple) else axes_t[0])
  return PartitionSpec(*out)


def _is_variable(x) -> bool:
  from flax import nnx
  return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh):
  """NamedShardings for an nnx.State (abstract or concrete) from its `logical_axes` metadata.

  Leaves without metadata are replicated. The result has exactly the State's structure (each
  Variable holding a NamedSharding instead of its value), usable as jit in/out_shardings and
  zippable leaf-by-leaf with the state.
  """
  def one(v):
    if _is_variable(v):
      axes = v.get_metadata().get("logical_axes")
      return v.replace(NamedSharding(mesh, logical_to_spec(axes, np.shape(v.get_value()), mesh)))
    return NamedSharding(mesh, logical_to_spec(None, np.shape(v), mesh))
  return jax.tree.map(one, state, is_leaf=_is_variable)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Rows over (data, fsdp), everything else replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def constrain(x: jax.Array, *logical_axes: str | None) -> jax.Array:
  """with_sharding_constraint by logical names when tracing under a mesh; a no-op otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def abstract_with(tree, shardings):
  """ShapeDtypeStructs of `tree` carrying `shardings` (a restore target)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def opt_state_shardings(optimizer, opt_state, param_shardings, mesh: Mesh):
  """Optimizer-state shardings: moments like their params, scalars (counts) replicated."""
  import optax
  return optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_shardings,
                               transform_non_params=lambda _: replicated(mesh))
