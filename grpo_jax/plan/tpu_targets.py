"""The chips the HBM planner (memory_plan.py) compiles for: TPU slice names -> compile-only
devices through libtpu, GPU names -> XLA:GPU's deviceless compile through the CUDA plugin (both
`jax.experimental.topologies`, no accelerator needed), or this machine's / fake CPU devices.

    make_target("v5p-8")   # 4 v5p chips (v5p-N counts TensorCores), topology v5:2x2x1
    make_target("h100")    # one H100 (h100-8: eight on one host), platform "gpu"
    make_target(None)      # this machine's devices

A GPU target needs jax-cuda13-plugin (+ jax-cuda13-pjrt) of jax's version and JAX_PLATFORMS=cpu
(else the plugin looks for a CUDA driver at start-up): requirements/aot.txt, scripts/test_aot.sh.
"""

import dataclasses
import glob
import importlib.util
import math
import mmap
import os
import re
import tempfile

import jax
import numpy as np

GIB = 1024**3

# generation -> (topology-name prefix, TensorCores per chip (the "-N" of v5p-8 counts cores),
# topology dimensions, chip config, HBM GiB per chip, jax device_kind)
GENERATIONS = {
    "v4": ("v4", 2, 3, "megacore", 32, "TPU v4"),
    "v5p": ("v5", 2, 3, "megacore", 95, "TPU v5"),
    "v5e": ("v5e", 1, 2, "default", 16, "TPU v5 lite"),
    "v5litepod": ("v5e", 1, 2, "default", 16, "TPU v5 lite"),
    "v6e": ("v6e", 1, 2, "default", 32, "TPU v6 lite"),
}
# GPU name -> (device_description_str of the GpuTargetConfigProto embedded in the CUDA plugin,
# the device's memory in GiB when the plugin is absent: nominal, the config's own is a little
# less, e.g. 79.1 GiB for the H100 80GB)
GPUS = {
    "h100": ("NVIDIA H100 80GB HBM3", 80),
    "h200": ("NVIDIA H200 141GB HBM3e", 141),
}
CUDA_PLUGIN = "jax_plugins.xla_cuda13"  # jax-cuda13-plugin (and jax-cuda13-pjrt)
HBM_BY_KIND = {kind: gib * GIB for _, _, _, _, gib, kind in GENERATIONS.values()}
HBM_BY_KIND.update({kind: gib * GIB for kind, gib in GPUS.values()})

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

  topology_name: str  # e.g. "v5:2x2x1"; GPUs: "1x1xN" (partitions x hosts x GPUs per host)
  chips: int
  chip_config_name: str
  device_kind: str
  hbm_bytes: int
  platform: str = "tpu"  # or "cuda" (a GPU name)


def parse_topology(name: str) -> Slice:
  """'v5p-8' -> Slice('v5:2x2x1', 4 chips, ...); 'v6e-8' -> Slice('v6e:2x4', 8 chips, ...);
  'h100' -> Slice('1x1x1', 1 GPU, platform="cuda"); 'h100-8' -> eight H100s on one host.

  The "-N" suffix counts TensorCores as Cloud TPU names slices: v4/v5p chips have two (v5p-8 is
  4 chips), v5e/v6e one (v6e-8 is 8 chips). A raw 'v5p:2x2x1' / 'v6e:2x4' is taken as is."""
  gpu = re.fullmatch(r"([a-z]\d+)(?:-(\d+))?", name)
  if gpu and gpu.group(1) in GPUS:
    count = int(gpu.group(2) or 1)
    if not 1 <= count <= 8:
      raise ValueError(f"--topology={name}: 1 to 8 GPUs on one host ({gpu.group(1)}-N)")
    kind, gib = GPUS[gpu.group(1)]
    return Slice(f"1x1x{count}", count, "", kind, gib * GIB, platform="cuda")
  raw = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+)+)", name)
  named = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
  gen = (raw or named).group(1) if (raw or named) else None
  gen = {"v5": "v5p"}.get(gen, gen)
  if gen not in GENERATIONS:
    raise ValueError(
        f"--topology={name}: use a slice name like v5p-8, v6e-8, v5e-16, v4-8 "
        f"(generations {', '.join(GENERATIONS)}), a raw one like v5p:2x2x1, or "
        f"a GPU: {', '.join(GPUS)} (h100-8: eight on one host)"
    )
  prefix, cores, ndim, chip_config, gib, kind = GENERATIONS[gen]
  if raw:
    dims = [int(d) for d in raw.group(2).split("x")]
  else:
    chips, rem = divmod(int(named.group(2)), cores)
    if rem or chips < 1 or chips & (chips - 1) or (ndim == 3 and chips < 4):
      raise ValueError(
          f"--topology={name}: {gen} slices have a power-of-two chip count"
          f"{' >= 4' if ndim == 3 else ''}, {cores} core(s) per chip"
      )
    dims = [2, 2, 1] if ndim == 3 else [1, 1]
    while math.prod(dims) < chips:  # double the smallest dimension, the last one on ties
      i = max(range(ndim), key=lambda j: (-dims[j], j))
      dims[i] *= 2
  return Slice(
      f"{prefix}:{'x'.join(map(str, dims))}", math.prod(dims), chip_config, kind, gib * GIB
  )


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


def cuda_plugin_dir() -> str | None:
  """The folder of the installed CUDA 13 PJRT plugin (jax-cuda13-plugin), else None. Found
  without importing it (its import looks for CUDA libraries)."""
  try:
    spec = importlib.util.find_spec(CUDA_PLUGIN)
  except ModuleNotFoundError:  # no jax_plugins namespace at all
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  folder = list(spec.submodule_search_locations)[0]
  return folder if os.path.exists(os.path.join(folder, "xla_cuda_plugin.so")) else None


def cuda_plugin_version() -> str | None:
  import importlib.metadata

  if cuda_plugin_dir() is None:
    return None
  try:
    return importlib.metadata.version("jax-cuda13-plugin")
  except importlib.metadata.PackageNotFoundError:
    return "unknown version"


def gpu_target_config(device_kind: str) -> str:
  """The GpuTargetConfigProto (text format) of `device_kind` that the CUDA plugin embeds in
  xla_cuda_plugin.so (XLA's xla/backends/gpu/target_config/specs/*.txtpb, so it matches the
  plugin's proto version): what XLA:GPU's deviceless compile targets."""
  path = os.path.join(cuda_plugin_dir(), "xla_cuda_plugin.so")
  with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
    i = data.find(f'device_description_str: "{device_kind}"'.encode())
    if i < 0:
      raise ValueError(f"{path} holds no GPU target config for {device_kind!r}")
    return data[data.rfind(b"\x00", 0, i) + 1 : data.find(b"\x00", i)].decode()


def libtpu_compile_only_env(topology: str):
  """libtpu as a compiler only, on a machine without TPUs: no TPU VM metadata look-up (and its
  page of warnings), and no lock file, so several plans (or a plan and the tests) can run at
  once. Only variables the user has not set, and never on a TPU VM."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  for key, value in (
      ("TPU_SKIP_MDS_QUERY", "1"),
      ("TPU_WORKER_HOSTNAMES", "localhost"),
      ("TPU_ACCELERATOR_TYPE", topology),
      ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
  ):
    os.environ.setdefault(key, value)


def make_target(topology: str | None = None) -> Target:
  """The devices to compile for: TPU compile-only devices for a TPU `topology` (libtpu), GPU
  ones for a GPU name (the CUDA plugin), else as many of this process's CPU devices (the
  fallback), else (no topology) all local devices."""
  if not topology:
    devices = tuple(jax.devices())
    return Target(
        "local",
        devices,
        devices[0].device_kind,
        _device_hbm(devices[0]),
        f"{jax.default_backend()} compiler on this machine's devices",
        jax.process_count(),
    )
  spec = parse_topology(topology)
  if spec.platform == "cuda":
    return _gpu_target(topology, spec)
  version = libtpu_version()
  if version is not None:
    from jax.experimental import topologies

    devices = tuple(
        topologies.get_topology_desc(
            spec.topology_name, platform="tpu", chip_config_name=spec.chip_config_name
        ).devices
    )
    return Target(
        topology,
        devices,
        devices[0].device_kind,
        compiler_hbm(devices[0]) or spec.hbm_bytes,
        f"TPU compiler (libtpu {version}), topology {spec.topology_name}",
        len({d.process_index for d in devices}),
    )
  return _cpu_fallback(
      topology, spec, "libtpu not importable: install jax[tpu] for the TPU " "compiler's figures"
  )


def _gpu_target(topology: str, spec: Slice) -> Target:
  """XLA:GPU's deviceless compile for spec's GPUs (the CUDA plugin's topology: "1x1xN" and the
  embedded target config), else as many fake CPU devices."""
  version = cuda_plugin_version()
  if version is None:
    return _cpu_fallback(
        topology,
        spec,
        "jax-cuda13-plugin not importable: pip install "
        "-r requirements/aot.txt for XLA:GPU's figures",
    )
  if _cudnn_version() is None:
    raise ValueError(
        f"--topology={topology}: cuDNN's library is not loadable; tracing for a GPU "
        "(jax.nn.dot_product_attention's cuDNN kernels) asks it for its version. "
        "Fix: pip install -r requirements/aot.txt (nvidia-cudnn-cu13)"
    )
  from jax.experimental import topologies

  config = gpu_target_config(spec.device_kind)
  try:
    devices = tuple(
        topologies.get_topology_desc(
            platform="cuda", topology=spec.topology_name, target_config=config
        ).devices
    )
  except (NotImplementedError, jax.errors.JaxRuntimeError) as e:
    raise ValueError(
        f"--topology={topology}: the CUDA plugin gave no compile-only devices "
        f"({str(e).splitlines()[0]}). Fix: JAX_PLATFORMS=cpu (set before jax "
        "starts; otherwise the plugin looks for a CUDA driver and is not "
        "registered without one)"
    ) from e
  memory = re.search(r"device_memory_size: (\d+)", config)
  return Target(
      topology,
      devices,
      devices[0].device_kind,
      int(memory.group(1)) if memory else spec.hbm_bytes,
      f"XLA:GPU deviceless compile (jax-cuda13-plugin {version}), "
      f"{spec.chips} x {spec.device_kind}",
      1,
  )


def _cudnn_version() -> int | None:
  try:
    from jax._src.lib import cuda_versions

    return cuda_versions.cudnn_get_version() if cuda_versions is not None else None
  except RuntimeError:  # "cuDNN not found."
    return None


def _cpu_fallback(topology: str, spec: Slice, why: str) -> Target:
  cpus, chips = jax.devices("cpu"), spec.chips
  if len(cpus) < chips:
    raise ValueError(
        f"--topology={topology} needs {chips} fake CPU devices without the "
        f"accelerator's compiler and this process has {len(cpus)}: start it with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={chips}, or install "
        "that compiler (requirements/aot.txt)"
    )
  return Target(
      topology,
      tuple(cpus[:chips]),
      spec.device_kind,
      spec.hbm_bytes,
      f"XLA:CPU on {chips} fake device{'s' * (chips > 1)} ({why})",
      1,
  )


def _device_hbm(device) -> int | None:
  """The device's own memory limit when it reports one (real accelerators), else by kind."""
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
  except Exception:  # compile-only and CPU devices report nothing
    limit = None
  return int(limit) if limit else HBM_BY_KIND.get(device.device_kind)


_OOM = re.compile(
    r"required for HLO temporaries \(([\d.]+)([KMGTP]?)\) exceeds available HBM "
    r"\(([\d.]+)([KMGTP]?)\)"
)


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
  huge = jax.ShapeDtypeStruct(
      (2**40,), np.uint8, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  )
  try:
    jax.jit(lambda x: x + 1).lower(huge).compile()
  except jax.errors.JaxRuntimeError as e:
    figures = _oom_figures(str(e))
    return figures[1] if figures else None
  return None


def compile_program(lowered, platform: str = "", *, hlo: bool = False):
  """-> (compiled, its optimized HLO text when `hlo`, else None, notes for the figures).

  On a GPU without a device (XLA:GPU's deviceless compile) a cub sort (top_k with k > 16)
  fails at thunk emission, after optimization: the HLO is then read from the compile's own
  dump (*_gpu_after_optimizations.txt) and the Compiled object comes from a recompile with
  XLA's sort kernel instead of cub (notes: deviceless_cub_disabled=1)."""
  if platform != "gpu":
    compiled = lowered.compile()
    return compiled, compiled.as_text() if hlo else None, {}
  with tempfile.TemporaryDirectory(prefix="grpo_jax_hlo_") as dump:
    try:
      compiled = lowered.compile(compiler_options={"xla_dump_to": dump} if hlo else None)
      return compiled, compiled.as_text() if hlo else None, {}
    except jax.errors.JaxRuntimeError as e:
      if "invalid device ordinal" not in str(e):
        raise
      text = _dumped_hlo(dump) if hlo else None
  compiled = lowered.compile(
      compiler_options={"xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED"}
  )
  return compiled, text, {"deviceless_cub_disabled": 1}


def gpu_thunk_sequence(lowered) -> str:
  """XLA:GPU's thunk sequence of a lowered program (deviceless: compiled with XLA's sort kernel
  instead of cub), the text of its *thunk_sequence_after_thunk_passes.txt: what the runtime
  launches, command buffers (CUDA graphs) included (hlo_inspect.thunks_outside_graphs)."""
  with tempfile.TemporaryDirectory(prefix="grpo_jax_thunks_") as dump:
    lowered.compile(
        compiler_options={
            "xla_dump_to": dump,
            "xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED",
        }
    )
    paths = glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt"))
    if not paths:
      raise RuntimeError(f"XLA:GPU wrote no *thunk_sequence_after_thunk_passes.txt into {dump}")
    with open(max(paths, key=os.path.getsize)) as fh:
      return fh.read()


def _dumped_hlo(folder: str) -> str:
  """The optimized module XLA:GPU dumped into `folder` (xla_dump_to): the largest
  *_gpu_after_optimizations.txt (one per module it compiled; the program is the largest)."""
  paths = glob.glob(os.path.join(folder, "*_gpu_after_optimizations.txt"))
  if not paths:
    raise RuntimeError(f"XLA:GPU wrote no *_gpu_after_optimizations.txt into {folder}")
  with open(max(paths, key=os.path.getsize)) as fh:
    return fh.read()
