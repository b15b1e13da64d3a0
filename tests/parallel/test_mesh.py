"""Mesh shapes from config.mesh: per-slice sizes, the DCN data factor (mesh.dcn_data), the
one-line validation messages, and a 2-process (2 x 4 fake CPU devices) multi-slice mesh."""

import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from configs import tiny
from grpo_jax import configuration
from grpo_jax.parallel import sharding
from grpo_jax.models import build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**mesh):
  config = tiny.get_config()
  for k, v in mesh.items():
    config.mesh[k] = v
  return config


def _fake_devices(n=8, per_process=2, per_slice=None):
  """Stand-ins with what mesh_utils reads (id, platform, device_kind, process/slice index)."""
  out = []
  for i in range(n):
    d = SimpleNamespace(id=i, platform="cpu", device_kind="fake", process_index=i // per_process)
    if per_slice:
      d.slice_index = i // per_slice
    out.append(d)
  return out


def _ids(array):
  return np.vectorize(lambda d: d.id)(array)


# ------------------------------------------------------------------------- shape resolution


@pytest.mark.parametrize(
    "sizes,devices,dcn,ici,global_shape",
    [
        ((-1, 1, 1), 8, 1, (8, 1, 1), (8, 1, 1)),
        ((-1, 1, 1), 8, 2, (4, 1, 1), (8, 1, 1)),  # data=-1 fills one slice
        ((-1, 2, 1), 16, 2, (4, 2, 1), (8, 2, 1)),
        ((1, -1, 2), 16, 4, (1, 2, 2), (4, 2, 2)),
        ((2, 2, 2), 16, 2, (2, 2, 2), (4, 2, 2)),
    ],
)
def test_resolve_per_slice_and_global(sizes, devices, dcn, ici, global_shape):
  assert sharding.resolve_ici_shape(sizes, devices, dcn) == ici
  assert sharding.resolve_mesh_shape(sizes, devices, dcn) == global_shape
  assert sharding.data_parallel_size(global_shape) == global_shape[0] * global_shape[1]


@pytest.mark.parametrize(
    "sizes,devices,dcn,words",
    [
        ((3, 1, 1), 8, 2, ["does not fit the 4 devices of one slice", "mesh.dcn_data=2"]),
        ((2, 2, 2), 8, 2, ["does not fit the 4 devices of one slice"]),
        ((1, 1, 2), 8, 2, ["uses 2 devices", "a slice has 4", "make data * fsdp * tensor = 4"]),
        ((-1, 1, 1), 8, 3, ["mesh.dcn_data=3 does not split 8 devices"]),
        ((-1, -1, 1), 8, 2, ["at most one axis may be -1"]),
        ((3, 1, 1), 8, 1, ["does not fit 8 devices"]),  # dcn_data=1: the old wording
    ],
)
def test_resolve_errors_name_the_shape(sizes, devices, dcn, words):
  with pytest.raises(ValueError) as e:
    sharding.resolve_mesh_shape(sizes, devices, dcn)
  for w in words:
    assert w in str(e.value), str(e.value)


# ----------------------------------------------------------------- device layout (fake devices)


@pytest.mark.parametrize(
    "ici,dcn,rows",
    [
        ((4, 1, 1), 2, [[0], [1], [2], [3], [4], [5], [6], [7]]),  # 2 granules of 2 processes each
        ((2, 1, 1), 4, [[0], [1], [2], [3], [4], [5], [6], [7]]),  # one process per DCN slice
        ((2, 2, 1), 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ((1, 4, 1), 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # fsdp spans 2 processes inside a DCN slice
    ],
)
def test_hybrid_layout_puts_dcn_outermost_on_data(ici, dcn, rows):
  devices = _fake_devices(8, per_process=2)
  array = sharding.hybrid_device_array(ici, dcn, devices)
  assert array.shape == (dcn * ici[0], *ici[1:])
  assert _ids(array).reshape(array.shape[0], -1).tolist() == rows
  half = array.shape[0] // dcn
  for s in range(dcn):  # DCN slice s = the s-th block of `data`, its own processes only
    procs = {d.process_index for d in array[s * half : (s + 1) * half].ravel()}
    assert procs == set(range(s * 4 // dcn, (s + 1) * 4 // dcn))


def test_slices_are_the_granules_when_devices_have_slice_index():
  devices = _fake_devices(8, per_process=1, per_slice=4)  # 8 processes, 2 slices
  assert sharding.granule_attr(devices) == "slice_index"
  assert sharding.num_granules(devices=devices) == (2, "slices")
  array = sharding.hybrid_device_array((2, 2, 1), 2, devices)
  assert {d.slice_index for d in array[:2].ravel()} == {0}
  assert {d.slice_index for d in array[2:].ravel()} == {1}
  # 4 slices, 2 per DCN slice: the per-slice data axis must split over them
  four = _fake_devices(8, per_process=1, per_slice=2)
  with pytest.raises(ValueError, match=r"mesh.dcn_data=2: puts 2 slices in each DCN slice"):
    sharding.hybrid_device_array((1, 4, 1), 2, four)
  assert _ids(sharding.hybrid_device_array((2, 2, 1), 2, four)).shape == (4, 2, 1)


def test_processes_are_the_granules_without_slice_index():
  devices = _fake_devices(8, per_process=4)
  assert sharding.granule_attr(devices) == "process_index"
  assert sharding.num_granules(2, devices) == (2, "JAX processes")
  assert sharding.num_granules(1, devices) == (1, "JAX process")
  with pytest.raises(ValueError, match=r"mesh.dcn_data=4: must divide the 2 JAX processes"):
    sharding.hybrid_device_array((2, 1, 1), 4, devices)


# ------------------------------------------------------------------ the single-process mesh


@pytest.mark.parametrize("data,fsdp,tensor", [(-1, 1, 1), (2, 2, 2), (1, -1, 2), (2, 1, -1)])
def test_dcn_data_1_is_the_mesh_as_before(data, fsdp, tensor):
  config = _config(data=data, fsdp=fsdp, tensor=tensor)
  assert config.mesh.dcn_data == 1  # the default
  mesh = build.make_mesh(config)
  shape = sharding.resolve_mesh_shape((data, fsdp, tensor), jax.device_count())
  before = jax.make_mesh(
      shape,
      sharding.MESH_AXES[:3],
      axis_types=(jax.sharding.AxisType.Auto,) * 3,
      devices=jax.devices(),
  )
  assert mesh.axis_names == sharding.MESH_AXES  # (data, fsdp, tensor) + expert of size 1
  assert dict(mesh.shape) == dict(before.shape, expert=1)
  assert (mesh.devices[..., 0] == before.devices).all()


def test_dcn_data_2_needs_two_processes_here():
  with pytest.raises(ValueError, match="must divide the 1 JAX process"):
    build.make_mesh(_config(dcn_data=2))


def test_maxtext_layout_keeps_the_dcn_order():
  """impl=maxtext re-lays our mesh over MaxText's axes: same devices in the same data order."""
  from grpo_jax.models.maxtext import adapter as maxtext_adapter

  devices = np.asarray(jax.devices()[::-1]).reshape(4, 2, 1, 1)  # any order: it must survive
  base = jax.sharding.Mesh(devices, sharding.MESH_AXES)
  mt = SimpleNamespace(
      mesh_axes=["data", "stage", "fsdp", "fsdp_transpose", "sequence", "tensor", "expert"]
  )
  mesh = maxtext_adapter.maxtext_mesh(mt, base)
  assert mesh.shape["data"] == 4 and mesh.shape["fsdp"] == 2
  assert (mesh.devices.reshape(4, 2) == devices.reshape(4, 2)).all()


# ------------------------------------------------------------------------------ validation


def _errors(config, devices=8, processes=2):
  errors = configuration.validate(config, num_devices=devices, num_processes=processes)
  assert all("\n" not in e for e in errors), errors
  return errors


def test_valid_multi_slice_config():
  assert _errors(_config(dcn_data=2)) == []
  assert _errors(_config(dcn_data=2, data=-1, fsdp=2), devices=16) == []
  assert _errors(_config(dcn_data=2, data=2, tensor=4), devices=16) == []
  assert _errors(_config(dcn_data=1), processes=1) == []


@pytest.mark.parametrize(
    "mesh,devices,processes,words",
    [
        (
            dict(dcn_data=3),
            8,
            2,
            ["mesh.dcn_data=3: must divide the 2 JAX processes", "Fix: use a divisor of 2"],
        ),
        (dict(dcn_data=2), 8, 1, ["mesh.dcn_data=2: must divide the 1 JAX process", "Fix: use 1"]),
        (dict(dcn_data=0), 8, 2, ["mesh.dcn_data=0: must be an integer >= 1", "Fix: use 1"]),
        (dict(dcn_data=-1), 8, 2, ["mesh.dcn_data=-1: must be an integer >= 1"]),
        (
            dict(dcn_data=2, data=3),
            8,
            2,
            [
                "mesh.data=3:",
                "does not fit the 4 devices of one slice",
                "Fix: make data * fsdp * tensor equal the 4 devices per DCN slice (8 devices / "
                "mesh.dcn_data=2)",
            ],
        ),
        (
            dict(dcn_data=2, data=1, fsdp=1, tensor=1),
            8,
            2,
            [
                "mesh.data=1:",
                "uses 1 devices but a slice has 4",
                "equal the 4 devices per DCN slice",
            ],
        ),
        (
            dict(data=1, tensor=8),
            8,
            1,
            [
                "mesh.tensor=8: does not divide the model's 4 attention heads",
                "Fix: use a divisor of 4",
            ],
        ),
        (
            dict(data=3),
            8,
            1,
            ["mesh.data=3:", "Fix: make data * fsdp * tensor equal the 8 available"],
        ),
    ],
    ids=[
        "dcn-not-dividing-processes",
        "dcn-one-process",
        "dcn-zero",
        "dcn-negative",
        "bad-product-per-slice",
        "too-small-per-slice",
        "tensor-not-dividing-heads",
        "bad-product-single-slice",
    ],
)
def test_bad_mesh_gives_one_line(mesh, devices, processes, words):
  errors = _errors(_config(**mesh), devices, processes)
  assert len(errors) == 1, errors
  for w in words:
    assert w in errors[0], errors[0]


def test_batch_checks_count_the_dcn_factor():
  config = _config(dcn_data=2)
  config.batch_size, config.num_generations = 8, 4  # 8 prompts over a data axis of 16
  errors = _errors(config, devices=16)
  assert errors == [
      "batch_size=8: the prompts of a step do not divide over the data-parallel "
      "mesh size data * fsdp (data includes mesh.dcn_data=2) = 16. Fix: use a "
      "multiple of 16."
  ]
  config.batch_size, config.micro_batch_size = 16, 8
  assert any(
      e.startswith("micro_batch_size=8: not divisible by the data-parallel mesh size 16")
      for e in _errors(config, devices=16)
  )


# ------------------------------------------------------------------- two processes, dcn_data=2

_SCRIPT = """
import sys
pid, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, root)
import jax
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from configs import tiny
from grpo_jax import configuration
from grpo_jax.parallel import sharding
from grpo_jax.models import build

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
config = tiny.get_config()
config.mesh.dcn_data = 2
assert configuration.validate(config) == [], configuration.validate(config)
mesh = build.make_mesh(config)
assert dict(mesh.shape) == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}, mesh.shape
assert sharding.data_parallel_size(mesh) == 8
owners = [d.process_index for d in mesh.devices[:, 0, 0, 0]]
assert owners == [0] * 4 + [1] * 4, owners  # the DCN factor is the outermost part of `data`

# Rows over (data, fsdp): process p holds rows 4p..4p+3, each filled with p + 1.
local = np.full((4, 3), pid + 1, np.float32)
x = jax.make_array_from_process_local_data(sharding.batch_sharding(mesh), local, (8, 3))

@jax.jit
def reduce(x):
  rows = jnp.arange(x.shape[0], dtype=x.dtype)[:, None]
  return jnp.sum(x), jnp.sum(x * rows)  # an all-reduce over data, both DCN slices

total, weighted = jax.device_get(reduce(x))
assert float(total) == 3 * (4 * 1 + 4 * 2), total
assert float(weighted) == 3 * (1 * (0 + 1 + 2 + 3) + 2 * (4 + 5 + 6 + 7)), weighted

config.mesh.dcn_data = 4
errors = configuration.validate(config)
assert errors == ["mesh.dcn_data=4: must divide the 2 JAX processes (each DCN slice of the data "
                  "axis is a whole number of them). Fix: use a divisor of 2, e.g. 2."], errors
print(f"process {pid}: ok", flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_dcn_data_2(tmp_path):
  script = tmp_path / "dcn_mesh.py"
  script.write_text(textwrap.dedent(_SCRIPT))
  port = str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  procs = [
      subprocess.Popen(
          [sys.executable, str(script), str(pid), port, ROOT],
          cwd=ROOT,
          env=env,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for pid in range(2)
  ]
  try:
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for pid, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {pid}: {err[-3000:]}"
    assert f"process {pid}: ok" in out
