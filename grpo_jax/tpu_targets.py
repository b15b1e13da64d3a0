"""The chips the HBM planner (memory_plan.py) compiles for: TPU slice names -> compile-only
devices through libtpu (`jax.experimental.topologies`), or this machine's / fake CPU devices.

    make_target("v5p-8")   # 4 v5p chips (v5p-N counts TensorCores), topology v5:2x2x1
    make_target(None)      # this machine's devices
"""
import dataclasses
import glob
import math
import os
import re

import jax
import numpy as np

GIB = 1024 ** 3

# generation -> (topology-name prefix, TensorCores per chip (the "-N" of v5p-8 counts cores),
# topology dimensions, chip config, HBM GiB per chip, jax device_kind)
GENERATIONS = {
    "v4": ("v4", 2, 3, "megacore", 32, "TPU v4"),
    "v5p": ("v5", 2, 3, "megacore", 95, "TPU v5"),
    "v5e": ("v5e", 1, 2, "default", 16, "TPU v5 lite"),
    "v5litepod": ("v5e", 1, 2, "default", 16, "TPU v5 lite"),
    "v6e": ("v6e", 1, 2, "default", 32, "TPU v6 lite"),
}
HBM_BY_KIND = {kind: gib * GIB for _, _, _, _, gib, kind in GENERATIONS.values()}

# ================================================================================= targets


@dataclasses.dataclass(frozen=True)
class Target:
  """What to compile for: devices, their kind and HBM, and how the figures were made."""
  name: str
  devices: tuple
  device_kind: str
  hbm_bytes: int | None
  compiler: str  # e.g. "TPU compiler (libtpu 0.0.50.1)"; "XLA:CPU on fake devices" ...
  num_processes: int


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice by name: what get_topology_desc needs, and the chip's kind and HBM."""
  topology_name: str  # e.g. "v5:2x2x1"
  chips: int
  chip_config_name: str
  device_kind: str
  hbm_bytes: int


def parse_topology(name: str) -> Slice:
  """'v5p-8' -> Slice('v5:2x2x1', 4 chips, ...); 'v6e-8' -> Slice('v6e:2x4', 8 chips, ...).

  The "-N" suffix counts TensorCores as Cloud TPU names slices: v4/v5p chips have two (v5p-8 is
  4 chips), v5e/v6e one (v6e-8 is 8 chips). A raw 'v5p:2x2x1' / 'v6e:2x4' is taken as is."""
  raw = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)+)", name)
  named = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
  gen = (raw or named).group(1) if (raw or named) else None
  gen = {"v5": "v5p"}.get(gen, gen)
  if gen not in GENERATIONS:
    raise ValueError(f"--topology={name}: use a slice name like v5p-8, v6e-8, v5e-16, v4-8 "
                     f"(generations {', '.join(GENERATIONS)}) or a raw one like v5p:2x2x1")
  prefix, cores, ndim, chip_config, gib, kind = GENERATIONS[gen]
  if raw:
    dims = [int(d) for d in raw.group(2).split("x")]
  else:
    chips, rem = divmod(int(named.group(2)), cores)
    if rem or chips < 1 or chips & (chips - 1) or (ndim == 3 and chips < 4):
      raise ValueError(f"--topology={name}: {gen} slices have a power-of-two chip count"
                       f"{' >= 4' if ndim == 3 else ''}, {cores} core(s) per chip")
    dims = [2, 2, 1] if ndim == 3 else [1, 1]
    while math.prod(dims) < chips:  # double the smallest dimension, the last one on ties
      i = max(range(ndim), key=lambda j: (-dims[j], j))
      dims[i] *= 2
  return Slice(f"{prefix}:{'x'.join(map(str, dims))}", math.prod(dims), chip_config, kind,
               gib * GIB)


def libtpu_version() -> str | None:
  """The installed libtpu's version, or None when it cannot be imported."""
  import importlib.metadata
  import importlib.util
  if importlib.util.find_spec("libtpu") is None:
    return None
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return "unknown version"


def libtpu_compile_only_env(topology: str):
  """libtpu as a compiler only, on a machine without TPUs: no TPU VM metadata look-up (and its
  page of warnings), and no lock file, so several plans (or a plan and the tests) can run at
  once. Only variables the user has not set, and never on a TPU VM."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                     ("TPU_ACCELERATOR_TYPE", topology), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
    os.environ.setdefault(key, value)


def make_target(topology: str | None = None) -> Target:
  """The devices to compile for: TPU compile-only devices for `topology` (libtpu), else as
  many of this process's CPU devices (the fallback), else (no topology) all local devices."""
  if not topology:
    devices = tuple(jax.devices())
    return Target("local", devices, devices[0].device_kind, _device_hbm(devices[0]),
                  f"{jax.default_backend()} compiler on this machine's devices",
                  jax.process_count())
  spec = parse_topology(topology)
  version = libtpu_version()
  if version is not None:
    from jax.experimental import topologies
    devices = tuple(topologies.get_topology_desc(
        spec.topology_name, platform="tpu", chip_config_name=spec.chip_config_name).devices)
    return Target(topology, devices, devices[0].device_kind,
                  compiler_hbm(devices[0]) or spec.hbm_bytes,
                  f"TPU compiler (libtpu {version}), topology {spec.topology_name}",
                  len({d.process_index for d in devices}))
  cpus, chips = jax.devices("cpu"), spec.chips
  if len(cpus) < chips:
    raise ValueError(f"--topology={topology} needs {chips} fake CPU devices without libtpu and "
                     f"this process has {len(cpus)}: start it with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={chips}, or install "
                     "jax[tpu]")
  return Target(topology, tuple(cpus[:chips]), spec.device_kind, spec.hbm_bytes,
                f"XLA:CPU on {chips} fake devices (libtpu not importable: install jax[tpu] "
                "for the TPU compiler's figures)", 1)


def _device_hbm(device) -> int | None:
  """The device's own memory limit when it reports one (real accelerators), else by kind."""
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # compile-only and CPU devices report nothing
    limit = None
  return int(limit) if limit else HBM_BY_KIND.get(device.device_kind)


_OOM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGTP]?)\) exceeds available HBM "
                  r"\(([\d.]+)([KMGTP]?)\)")


def _oom_figures(message: str) -> tuple[int, int] | None:
  """(bytes required, bytes available) from the TPU compiler's out-of-HBM error, else None.
  Its figures count the program's arguments and outputs too, in 1024-based units."""
  m = _OOM.search(message)
  if not m:
    return None
  to_bytes = lambda num, unit: int(float(num) * 1024 ** "_KMGTP".index(unit or "_"))
  return to_bytes(*m.group(1, 2)), to_bytes(*m.group(3, 4))


def compiler_hbm(device) -> int | None:
  """The HBM the TPU compiler lets a program use on `device`, read from its error for a
  program that cannot fit (a 1 TiB argument): exactly what it checks plans against."""
  mesh = jax.sharding.Mesh(np.asarray([device]), ("x",))
  huge = jax.ShapeDtypeStruct((2 ** 40,), np.uint8, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()))
  try:
    jax.jit(lambda x: x + 1).lower(huge).compile()
  except jax.errors.JaxRuntimeError as e:
    figures = _oom_figures(str(e))
    return figures[1] if figures else None
  return None
