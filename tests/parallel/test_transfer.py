"""grpo_jax.parallel.transfer.CrossMesh: trees moved between two disjoint meshes, on one process (8 fake
devices split 4/4) and on two (jax.distributed over 127.0.0.1): values, the cast, shardings,
donated buffers reused, both directions."""

import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.parallel import sharding
from grpo_jax.parallel import transfer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _meshes(src_shape=(1, 4, 1), dst_shape=(1, 4, 1)):
  d = jax.devices()
  return (
      sharding.make_mesh(*src_shape, devices=d[:4]),
      sharding.make_mesh(*dst_shape, devices=d[4:]),
  )


def _put(value, mesh, spec):
  return jax.device_put(value, NamedSharding(mesh, spec))


def _ids(x):
  return {a.device.id for a in x.addressable_shards}


# (src mesh, src spec, dst mesh, dst spec, shape, dtype)
CASES = [
    ((1, 4, 1), P("fsdp", None), (1, 4, 1), P("fsdp", None), (8, 6), np.float32),  # same layout
    ((1, 4, 1), P("fsdp", None), (4, 1, 1), P("data", None), (8, 6), np.float32),  # other shape
    ((1, 4, 1), P(None, "fsdp"), (1, 2, 2), P("fsdp", "tensor"), (6, 8), np.float32),
    ((2, 2, 1), P(("data", "fsdp")), (1, 1, 4), P(None), (16,), np.float32),
    ((1, 4, 1), P(), (1, 4, 1), P(), (5, 3), np.float32),  # replicated
    ((1, 4, 1), P(), (1, 4, 1), P("fsdp"), (8,), np.float32),
    ((1, 4, 1), P(), (2, 2, 1), P(), (), np.float32),  # scalar
    ((1, 4, 1), P("fsdp", None), (1, 2, 2), P(None, "tensor"), (8, 4), np.int32),  # no cast
    ((4, 1, 1), P(("data", "fsdp"), None), (1, 4, 1), P(("data", "fsdp"), None), (8, 3), bool),
]


@pytest.mark.parametrize("src_shape,src_spec,dst_shape,dst_spec,shape,dtype", CASES)
def test_move_values_cast_and_sharding(src_shape, src_spec, dst_shape, dst_spec, shape, dtype):
  src, dst = _meshes(src_shape, dst_shape)
  value = (np.arange(int(np.prod(shape))).reshape(shape) % 7 + 0.25).astype(dtype)
  x = _put(value, src, src_spec)
  want = NamedSharding(dst, dst_spec)
  cm = transfer.CrossMesh(src, dst)
  y = cm.move({"w": x}, {"w": want}, dtype=jnp.bfloat16)["w"]
  moved = jnp.bfloat16 if np.issubdtype(dtype, np.floating) else dtype
  assert y.dtype == moved and y.shape == shape
  assert y.sharding == want
  assert _ids(y) == {d.id for d in dst.devices.flat}
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x.astype(moved)))
  assert cm.last_bytes == value.size * np.dtype(moved).itemsize
  assert not x.is_deleted()  # the src tree is the trainer's: never donated
  np.testing.assert_array_equal(np.asarray(x), value)


def test_tree_in_both_directions_with_donation_and_one_program_set():
  """Trainer -> sampler weights (f32 -> bf16, a tree of mixed leaves) twice, the second move
  into the first one's buffers; then sampler -> trainer a rollout batch (int, bool, f32)."""
  src, dst = _meshes((1, 4, 1), (1, 2, 2))
  rng = np.random.default_rng(0)
  params = {
      "embed": rng.normal(size=(16, 8)).astype(np.float32),
      "mlp": {
          "up": rng.normal(size=(8, 12)).astype(np.float32),
          "down": rng.normal(size=(12, 8)).astype(np.float32),
      },
      "scale": np.float32(0.5),
      "step": np.int32(7),
  }
  specs = {
      "embed": P("fsdp", None),
      "mlp": {"up": P("fsdp", None), "down": P(None, "fsdp")},
      "scale": P(),
      "step": P(),
  }
  want = {
      "embed": P(("fsdp", "tensor"), None),
      "mlp": {"up": P(None, "tensor"), "down": P("tensor")},
      "scale": P(),
      "step": P(),
  }
  want = jax.tree.map(lambda s: NamedSharding(dst, s), want)
  tree = jax.tree.map(lambda v, s: _put(v, src, s), params, specs)
  cm = transfer.CrossMesh(src, dst)
  first = cm.move(tree, want, dtype=jnp.bfloat16)
  embed_ptrs = {
      a.device.id: a.data.unsafe_buffer_pointer() for a in first["embed"].addressable_shards
  }
  with jax.transfer_guard("disallow"):  # device to device only: the loop's guard holds
    second = cm.move(tree, want, dtype=jnp.bfloat16, donate=first)
  assert all(x.is_deleted() for x in jax.tree.leaves(first))
  assert not any(x.is_deleted() for x in jax.tree.leaves(tree))
  # embed lands where it is wanted (row block i on dst device i): the donated buffers are reused
  assert embed_ptrs == {
      a.device.id: a.data.unsafe_buffer_pointer() for a in second["embed"].addressable_shards
  }
  for got, ref, w in zip(jax.tree.leaves(second), jax.tree.leaves(params), jax.tree.leaves(want)):
    moved = jnp.bfloat16 if np.issubdtype(np.asarray(ref).dtype, np.floating) else ref.dtype
    assert got.sharding == w and got.dtype == moved
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref).astype(moved))
  assert cm.last_bytes == 2 * (16 * 8 + 8 * 12 + 12 * 8 + 1) + 4 and cm.last_sec > 0
  cm.move(tree, want, dtype=jnp.bfloat16)
  assert len(cm._programs) == 2  # per (structure, landing buffers), not per call or leaf

  rows = sharding.batch_sharding
  batch = {
      "tokens_bt": np.arange(8 * 5, dtype=np.int32).reshape(8, 5),
      "mask_bt": np.arange(8 * 5).reshape(8, 5) % 3 > 0,
      "logp_bt": -np.arange(8 * 5, dtype=np.float32).reshape(8, 5) / 10,
  }
  on_dst = {k: jax.device_put(v, rows(dst)) for k, v in batch.items()}
  back = transfer.CrossMesh(dst, src).move(on_dst, rows(src))
  for k, v in batch.items():
    assert back[k].sharding == rows(src) and back[k].dtype == v.dtype
    np.testing.assert_array_equal(np.asarray(back[k]), v)


def test_nnx_state_moves_and_loads_into_a_module():
  src, dst = _meshes((1, 4, 1), (4, 1, 1))
  model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
  state = nnx.state(model)
  on_src = jax.tree.map(lambda v: _put(v, src, P(None, "fsdp") if v.ndim == 2 else P()), state)
  out = transfer.CrossMesh(src, dst).move(on_src, P(), dtype=jnp.bfloat16)
  assert isinstance(out, nnx.State)
  twin = nnx.Linear(8, 16, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16)
  nnx.update(twin, out)
  x = np.ones((2, 8), np.float32)
  ref = np.asarray(
      x @ np.asarray(model.kernel[...].astype(jnp.bfloat16), np.float32)
      + np.asarray(model.bias[...].astype(jnp.bfloat16), np.float32)
  )
  np.testing.assert_allclose(np.asarray(twin(x), np.float32), ref, rtol=1e-2)
  assert twin.kernel[...].sharding == NamedSharding(dst, P())


def test_bad_meshes_and_arguments_say_the_fix():
  d = jax.devices()
  with pytest.raises(ValueError, match="same device count"):
    transfer.CrossMesh(
        sharding.make_mesh(1, 4, 1, devices=d[:4]), sharding.make_mesh(1, 2, 1, devices=d[4:6])
    )
  with pytest.raises(ValueError, match=r"devices \[2, 3\] are in both"):
    transfer.CrossMesh(
        sharding.make_mesh(1, 4, 1, devices=d[:4]), sharding.make_mesh(1, 4, 1, devices=d[2:6])
    )
  src, dst = _meshes()
  cm = transfer.CrossMesh(src, dst)
  x = _put(np.zeros((4, 4), np.float32), src, P("fsdp"))
  with pytest.raises(ValueError, match="not a NamedSharding on the dst mesh"):
    cm.move([x], NamedSharding(src, P()))
  with pytest.raises(ValueError, match="not a NamedSharding on the src mesh"):
    cm.move([_put(np.zeros(4), dst, P())], P())
  old = cm.move([x], P("fsdp"))
  with pytest.raises(ValueError, match="does not match the moved leaf"):
    cm.move([x], P("fsdp"), dtype=jnp.bfloat16, donate=old)


# --------------------------------------------------------------------------- two processes

_SCRIPT = r"""
import sys
pid, port, root, layout = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
sys.path.insert(0, root)
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from grpo_jax.parallel import transfer
from grpo_jax.parallel import sharding

d = sorted(jax.devices(), key=lambda x: (x.process_index, x.id))  # [p0 a, p0 b, p1 a, p1 b]
if layout == "split":  # process 0 holds the whole src mesh, process 1 the whole dst mesh
  src_devs, dst_devs = d[:2], d[2:]
else:  # each process holds half of each mesh
  src_devs, dst_devs = [d[0], d[2]], [d[1], d[3]]
src = sharding.make_mesh(1, 2, 1, devices=src_devs)
dst = sharding.make_mesh(1, 1, 2, devices=dst_devs)


def make(value, mesh, spec):  # built on device by every process, no host transfer
  return jax.jit(lambda: jnp.asarray(value), out_shardings=NamedSharding(mesh, spec))()


def check(tree, ref):  # this process's shards against the known values
  n = 0
  for x, r in zip(jax.tree.leaves(tree), jax.tree.leaves(ref)):
    for s in x.addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data), np.asarray(r)[s.index])
      n += 1
  return n


w = {"w": np.arange(48, dtype=np.float32).reshape(8, 6) / 8, "b": np.arange(6, dtype=np.float32),
     "s": np.float32(2.5), "i": np.arange(8, dtype=np.int32),
     "e": np.arange(32, dtype=np.float32).reshape(4, 8) - 9}
tree = {"w": make(w["w"], src, P("fsdp", None)), "b": make(w["b"], src, P()),
        "s": make(w["s"], src, P()), "i": make(w["i"], src, P("fsdp")),
        "e": make(w["e"], src, P("fsdp", None))}
want = {"w": NamedSharding(dst, P(None, "tensor")), "b": NamedSharding(dst, P("tensor")),
        "s": NamedSharding(dst, P()), "i": NamedSharding(dst, P("tensor")),
        "e": NamedSharding(dst, P("tensor", None))}  # lands in place: its buffers are reused
ref = {k: v.astype(jnp.bfloat16) if v.dtype == np.float32 else v for k, v in w.items()}
cm = transfer.CrossMesh(src, dst)
first = cm.move(tree, want, dtype=jnp.bfloat16)
ptrs = [a.data.unsafe_buffer_pointer() for a in first["e"].addressable_shards]
second = cm.move(tree, want, dtype=jnp.bfloat16, donate=first)
assert ptrs == [a.data.unsafe_buffer_pointer() for a in second["e"].addressable_shards]
assert not any(x.is_deleted() for x in jax.tree.leaves(tree))
if any(x.process_index == pid for x in dst_devs):
  assert all(x.is_deleted() for x in jax.tree.leaves(first))
assert all(x.sharding == want[k] for k, x in second.items())
n = check(second, ref)

rows = {"tokens_bt": np.arange(40, dtype=np.int32).reshape(8, 5),
        "mask_bt": np.arange(40).reshape(8, 5) % 3 > 0,
        "logp_bt": -np.arange(40, dtype=np.float32).reshape(8, 5) / 10}
batch = {k: make(v, dst, P(("data", "fsdp"), None)) for k, v in rows.items()}
back = transfer.CrossMesh(dst, src).move(batch, P(("data", "fsdp"), None))
m = check(back, rows)
print(f"process {pid}: ok {n} {m}", flush=True)
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("layout", ["split", "shared"])
def test_two_processes(tmp_path, layout):
  """split: process 0 owns the src mesh, process 1 the dst mesh (each runs the same calls, one
  side with no local work); shared: each process owns half of each mesh."""
  script = tmp_path / "cross_mesh.py"
  script.write_text(textwrap.dedent(_SCRIPT))
  port = str(_free_port())
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the script sets 2 devices per process
  procs = [
      subprocess.Popen(
          [sys.executable, str(script), str(pid), port, ROOT, layout],
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
  counts = []
  for pid, (p, (out, err)) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {pid}: {err[-3000:]}"
    assert f"process {pid}: ok" in out, out
    counts.append([int(c) for c in out.split("ok")[1].split()])
  # shards checked (dst of the weights, src of the batch): 5 leaves x 2 devices, 3 x 2
  if layout == "split":
    assert counts == [[0, 6], [10, 0]]
  else:
    assert counts == [[5, 3], [5, 3]]
