"""Mesh axis names, the mesh from config, and the one table from logical axes to mesh axes.

Every parameter carries logical axis names (`logical_axes=("embed", "mlp")` metadata on its
nnx.Param); `LOGICAL_RULES` maps each name to mesh axes. Batch dimensions shard over
`BATCH_AXES` = (data, fsdp, expert): plain data parallelism over `data`, ZeRO-3-style parameter
sharding over `fsdp`, Megatron-style tensor parallelism over `tensor`, expert parallelism over
`expert` (an MoE layer's experts split over it, models/decoder/moe.py; outside the experts the
axis carries rows like `data`). The mesh is (data, fsdp, tensor, expert); `expert` (config
.mesh.expert, default 1) is a factor of its own, the three others are sized as before over the
devices it leaves.

Multi-slice (config.mesh.dcn_data > 1): the DCN (data-center network) factor is part of `data`,
its slowest-varying part, so the axes stay (data, fsdp, tensor): each slice is an ICI mesh of
the configured (data, fsdp, tensor) sizes and the global data axis is dcn_data * data.
"""

import functools
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
EXPERT = "expert"
MESH_AXES = (DATA, FSDP, TENSOR, EXPERT)
BATCH_AXES = (DATA, FSDP, EXPERT)

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
    "experts": EXPERT,  # an MoE layer's expert axis (models/decoder/moe.py)
    "moe_mlp": TENSOR,  # an expert's MLP width
    "norm": None,
    "layers": None,
    "act_embed": None,  # the embed dim of activations: replicated (fsdp shards params only)
}


def resolve_ici_shape(sizes: Sequence[int], num_devices: int, dcn_data: int = 1) -> tuple[int, ...]:
  """The (data, fsdp, tensor) mesh of one DCN slice: fills the one -1 entry so the product
  equals the devices of a slice, num_devices / dcn_data (all of them when dcn_data = 1).

  Raises a one-line ValueError that names the sizes and the device count otherwise."""
  sizes = list(sizes)
  if dcn_data < 1 or num_devices % dcn_data:
    raise ValueError(
        f"mesh.dcn_data={dcn_data} does not split {num_devices} devices into " "equal slices"
    )
  per = num_devices // dcn_data
  if dcn_data == 1:
    where, avail = f"{num_devices} devices", f"{num_devices} are available"
  else:
    where = f"the {per} devices of one slice ({num_devices} devices / " f"mesh.dcn_data={dcn_data})"
    avail = f"a slice has {per} (mesh.dcn_data={dcn_data} slices of {num_devices} devices)"
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh {sizes}: at most one axis may be -1 (fill)")
  fixed = math.prod(s for s in sizes if s != -1)
  if any(s == 0 or s < -1 for s in sizes) or per % fixed:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} does not fit {where}")
  if -1 in sizes:
    sizes[sizes.index(-1)] = per // fixed
  if math.prod(sizes) != per:
    raise ValueError(
        f"mesh {dict(zip(MESH_AXES, sizes))} uses {math.prod(sizes)} devices but "
        f"{avail}: make data * fsdp * tensor = {per}"
    )
  return tuple(sizes)


def resolve_mesh_shape(
    sizes: Sequence[int], num_devices: int, dcn_data: int = 1
) -> tuple[int, ...]:
  """The global (data, fsdp, tensor) shape: `resolve_ici_shape` per slice, with `data`
  multiplied by dcn_data (the DCN factor is part of the data axis, its slowest-varying part).
  With dcn_data = 1: fills the one -1 so the product equals num_devices."""
  data, fsdp, tensor = resolve_ici_shape(sizes, num_devices, dcn_data)
  return (dcn_data * data, fsdp, tensor)


def data_parallel_size(mesh_or_shape) -> int:
  """Devices a batch's rows split over: data * fsdp (the one place this is computed). The DCN
  factor (mesh.dcn_data) is part of `data`, so it is included.

  Takes a Mesh, or a global (data, fsdp, tensor) shape from `resolve_mesh_shape`."""
  if isinstance(mesh_or_shape, Mesh):
    return math.prod(mesh_or_shape.shape.get(a, 1) for a in BATCH_AXES)
  data, fsdp, _, *expert = mesh_or_shape  # (data, fsdp, tensor[, expert])
  return data * fsdp * math.prod(expert)


# ------------------------------------------------------------------- multi-slice (DCN) meshes


def granule_attr(devices) -> str:
  """The device attribute that names a device's DCN unit ("granule"): `slice_index` on TPU (and
  on any platform whose devices span several slices), else `process_index` (CPU/GPU: each JAX
  process is a granule, create_hybrid_device_mesh's process_is_granule=True)."""
  d = devices[0]
  if hasattr(d, "slice_index") and (
      d.platform == "tpu" or len({x.slice_index for x in devices}) > 1
  ):
    return "slice_index"
  return "process_index"


def granule_unit(attr: str, count: int = 2) -> str:
  """ "slices" or "JAX processes" (singular for count == 1)."""
  unit = "slice" if attr == "slice_index" else "JAX process"
  return unit if count == 1 else unit + ("es" if unit.endswith("s") else "s")


def granules(devices=None) -> list[list]:
  """`devices` (default: all global devices) grouped by granule, in granule order."""
  devices = jax.devices() if devices is None else list(devices)
  attr = granule_attr(devices)
  groups: dict[int, list] = {}
  for d in devices:
    groups.setdefault(getattr(d, attr), []).append(d)
  return [groups[k] for k in sorted(groups)]


def num_granules(num_processes: int | None = None, devices=None) -> tuple[int, str]:
  """(how many DCN granules, their unit name) for validation: the number of slices when devices
  carry slice_index (TPU), else `num_processes` (default jax.process_count())."""
  devices = jax.devices() if devices is None else list(devices)
  attr = granule_attr(devices)
  if attr == "slice_index":
    count = len({d.slice_index for d in devices})
  else:
    count = jax.process_count() if num_processes is None else num_processes
  return count, granule_unit(attr, count)


def dcn_problem(
    dcn_data: int, data_ici: int | None, count: int, unit: str
) -> tuple[str, str] | None:
  """(why, fix) when dcn_data DCN slices cannot be laid over `count` granules (slices or JAX
  processes, named by `unit`); None when fine. data_ici=None skips the per-slice data check.

  dcn_data must divide the granules: each of the dcn_data DCN slices is then k = count/dcn_data
  whole granules. With k > 1 on slices (TPU) the per-slice data axis must split over those k
  slices (data % k == 0) since TPU slices share no ICI; processes (CPU/GPU) have no such limit."""
  if not isinstance(dcn_data, int) or dcn_data < 1:
    return "must be an integer >= 1 (1 = one slice: no DCN axis)", "use 1, or the number of slices"
  if count % dcn_data:
    fix = (
        f"use a divisor of {count}, e.g. {count}"
        if count > 1
        else f"use 1: there is a single {unit} (multi-slice needs one JAX process per host, or a "
        "multi-slice TPU job)"
    )
    return (
        f"must divide the {count} {unit} (each DCN slice of the data axis is a whole number "
        f"of them)",
        fix,
    )
  k = count // dcn_data
  if data_ici is not None and k > 1 and unit == "slices" and data_ici % k:
    return (
        f"puts {k} slices in each DCN slice, so the per-slice mesh.data={data_ici} must split "
        f"over them",
        f"set mesh.dcn_data to the {count} slices, or make mesh.data a " f"multiple of {k}",
    )
  return None


def hybrid_device_array(ici_shape: Sequence[int], dcn_data: int, devices=None) -> np.ndarray:
  """The (data, fsdp, tensor) device array of a multi-slice mesh: dcn_data DCN slices along
  `data`, outermost (slowest varying), each an ICI mesh of `ici_shape`.

  Built with jax.experimental.mesh_utils.create_hybrid_device_mesh over the granules (slices or,
  without slice_index, processes). When dcn_data divides but is smaller than the number of
  granules, each DCN slice holds k consecutive granules, laid along its data axis when
  data % k == 0 (a hybrid mesh with a (k*dcn_data, 1, 1) DCN shape), else the k processes
  (CPU/GPU only) form one ICI mesh of `ici_shape` in device order."""
  from jax.experimental import mesh_utils

  devices = jax.devices() if devices is None else list(devices)
  attr = granule_attr(devices)
  groups = granules(devices)
  data, fsdp, tensor = ici_shape
  if math.prod(ici_shape) * dcn_data != len(devices):
    raise ValueError(
        f"mesh {dict(zip(MESH_AXES, ici_shape))} per slice times mesh.dcn_data="
        f"{dcn_data} slices does not cover the {len(devices)} devices"
    )
  bad = dcn_problem(dcn_data, data, len(groups), granule_unit(attr, len(groups)))
  if bad:
    raise ValueError(f"mesh.dcn_data={dcn_data}: {bad[0]}. Fix: {bad[1]}.")
  k = len(groups) // dcn_data
  if data % k == 0:
    return mesh_utils.create_hybrid_device_mesh(
        (data // k, fsdp, tensor),
        (len(groups), 1, 1),
        devices,
        process_is_granule=attr == "process_index",
    )
  blocks = [
      mesh_utils.create_device_mesh(ici_shape, [d for g in groups[i * k : (i + 1) * k] for d in g])
      for i in range(dcn_data)
  ]
  return np.concatenate(blocks, axis=0)


def split_off_local(num_devices: int, devices=None) -> tuple[list, list]:
  """(kept, split off): every process's last `num_devices` local devices (by id) split off the
  global list, e.g. chips of their own for an inference engine (vLLM on TPU) beside a trainer
  mesh over the rest. 0: nothing split off. Same rule in every process, so all agree."""
  devices = jax.devices() if devices is None else list(devices)
  if num_devices <= 0:
    return devices, []
  by_process = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  off = set()
  for p, ds in by_process.items():
    if num_devices >= len(ds):
      raise ValueError(
          f"cannot split {num_devices} devices off process {p}'s {len(ds)}: the "
          "trainer needs at least one"
      )
    off.update(sorted(ds, key=lambda d: d.id)[-num_devices:])
  return (
      [d for d in devices if d not in off],
      sorted(
          (d for d in devices if d in off and d.process_index == jax.process_index()),
          key=lambda d: d.id,
      ),
  )


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    tensor: int = 1,
    devices=None,
    dcn_data: int = 1,
    expert: int = 1,
) -> Mesh:
  """A (data, fsdp, tensor, expert) mesh over all global devices (every process, multi-host
  ready).

  `expert` (>= 1) divides the devices first; data, fsdp and tensor (one of them -1: fills) are
  sized over the rest, as without it. dcn_data > 1: a multi-slice mesh (expert = 1 only). The
  sizes are per slice (data = -1 fills a slice) and the global data axis is dcn_data * data, the
  DCN factor outermost: slice i holds the i-th block of `data` (see hybrid_device_array).
  dcn_data = 1 is the single-slice mesh (jax.make_mesh)."""
  devices = jax.devices() if devices is None else list(devices)
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  if expert < 1 or len(devices) % expert:
    raise ValueError(f"mesh.expert={expert} does not divide the {len(devices)} devices")
  if dcn_data != 1:
    if expert != 1:
      raise ValueError(f"mesh.expert={expert} with mesh.dcn_data={dcn_data}: not supported yet")
    ici = resolve_ici_shape((data, fsdp, tensor), len(devices), dcn_data)
    grid = hybrid_device_array(ici, dcn_data, devices)[..., None]
    return Mesh(grid, MESH_AXES, axis_types=axis_types)
  shape = (*resolve_mesh_shape((data, fsdp, tensor), len(devices) // expert), expert)
  if len(devices) == len(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def logical_to_spec(
    logical_axes: Sequence[str | None] | None, shape=None, mesh: Mesh | None = None
) -> PartitionSpec:
  """PartitionSpec for logical axis names. With `shape` and `mesh`, a mesh axis that does not
  divide its dimension is dropped (that dimension stays replicated) instead of failing."""
  if logical_axes is None:
    return PartitionSpec()
  out, used = [], set()
  for i, name in enumerate(logical_axes):
    axes = LOGICAL_RULES.get(name) if name is not None else None
    if name is not None and name not in LOGICAL_RULES:
      raise ValueError(
          f"logical axis '{name}' has no rule in grpo_jax.parallel.sharding.LOGICAL_RULES"
      )
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
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def opt_state_shardings(optimizer, opt_state, param_shardings, mesh: Mesh):
  """Optimizer-state shardings: moments like their params, scalars (counts) replicated."""
  import optax

  return optax.tree_map_params(
      optimizer,
      lambda _, s: s,
      opt_state,
      param_shardings,
      transform_non_params=lambda _: replicated(mesh),
  )


def traced_in(fn, mesh: Mesh):
  """`fn` traced with `mesh` as the abstract mesh (jit it: `jax.jit(traced_in(f, mesh))`):
  its `constrain` calls take effect and kernels that split their work over the mesh (TPU
  splash attention's shard_map: attention.splash_attention) find it. Unlike `jax.set_mesh`
  around the call, this holds wherever the jitted function is traced (eval_shape, lower,
  compile-ahead threads)."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return wrapped
