"""The HBM planner (grpo_jax/memory_plan.py): byte split vs an analytic count, remat's effect on
temporaries, the JSON rows, the no-libtpu fallback line, and a TPU compile when libtpu is here."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from grpo_jax import memory_plan as mp
from grpo_jax.models import build
from grpo_jax.rl import step as step_lib
from tests.conftest import ROOT

JSON_KEYS = {"params", "optimizer", "reference", "temp", "kv_cache", "host_offload", "total",
             "hbm_capacity", "device_kind", "num_devices"}


def _deep_config(**over):
  """tiny, deeper and longer so activations dominate the update's temporaries; all 8 devices
  on fsdp so every matrix is sharded (its hidden dim, 128, splits 8 ways)."""
  c = tiny.get_config()
  c.model.num_layers = 4
  c.model.scan_layers = True
  c.max_prompt_length = 16
  c.max_completion_length = 16
  c.mesh.data = 1
  c.mesh.fsdp = -1
  for k, v in over.items():
    c[k] = v
  return c


@pytest.fixture(scope="module")
def remat_rows():
  target = mp.make_target()  # the test process's 8 CPU devices
  rows, mesh_shape = mp.plan(_deep_config(), target, remat_policies=["none", "full"],
                             micro_batches=[0], functions=("update",), log=lambda _: None)
  return target, {r.remat: r for r in rows}, mesh_shape


def test_params_and_optimizer_bytes_match_the_analytic_count(remat_rows):
  target, rows, mesh_shape = remat_rows
  assert mesh_shape == {"data": 1, "fsdp": 8, "tensor": 1}
  cfg = _deep_config().model
  d, f, v, k = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
  h, kv, layers = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
  # Matrices (each has the hidden dim, sharded over fsdp=8) and vectors (replicated), float32.
  matrices = v * d + layers * (d * h * k + 2 * d * kv * k + h * k * d + 3 * d * f)
  vectors = d + layers * (2 * d + 2 * k)  # final norm; per layer 2 norms + q/k norms
  params = 4 * (matrices // 8 + vectors)
  row = rows["none"]
  assert row.params == params
  # AdamW keeps mu and nu like the params (float32 here); the rest is int32 counters.
  assert 0 <= row.optimizer - 2 * params <= 64
  assert row.reference == 0  # tiny has beta = 0: no reference copy
  # The split adds up to what the compiler sees: arguments = state + the batch, whose rows
  # (input_ids, attention_mask [N, P+C], completion_mask [N, C], advantages [N]) split 8 ways.
  n, s, c = 32 * 8, 32, 16
  batch = 4 * n * (2 * s + c + 1) // 8
  assert row.compiled["argument"] == row.params + row.optimizer + batch


def test_full_remat_shrinks_the_update_temporaries(remat_rows):
  _, rows, _ = remat_rows
  assert rows["full"].temp < 0.6 * rows["none"].temp, (rows["full"].temp, rows["none"].temp)
  assert rows["full"].total < rows["none"].total


def test_json_rows_have_the_planner_keys(remat_rows):
  target, rows, mesh_shape = remat_rows
  out = json.loads(json.dumps([r.to_json(target, mesh_shape) for r in rows.values()]))
  for obj in out:
    assert JSON_KEYS <= set(obj)
    assert obj["num_devices"] == 8 and obj["function"] == "update"
    assert obj["total"] == sum(obj[k] for k in ("params", "optimizer", "reference",
                                                "rollout_weights", "temp", "kv_cache", "io"))


def test_topology_names():
  assert mp.parse_topology("v5p-8").topology_name == "v5:2x2x1"  # 8 cores = 4 chips
  assert mp.parse_topology("v5p-8").chips == 4
  assert mp.parse_topology("v5p-16").topology_name == "v5:2x2x2"
  assert mp.parse_topology("v5p-128").topology_name == "v5:4x4x4"
  assert mp.parse_topology("v4-8").topology_name == "v4:2x2x1"
  assert mp.parse_topology("v6e-8").topology_name == "v6e:2x4"
  assert mp.parse_topology("v6e-256").topology_name == "v6e:16x16"
  assert mp.parse_topology("v5e-16").topology_name == "v5e:4x4"
  assert mp.parse_topology("v5e-16").hbm_bytes == 16 * mp.GIB
  assert mp.parse_topology("v5p:2x2x1").hbm_bytes == 95 * mp.GIB
  for bad in ("v5p-6", "v7x-8", "tpu", "v5p-2"):
    with pytest.raises(ValueError, match="--topology"):
      mp.parse_topology(bad)


def test_cli_writes_json_for_a_topology(tmp_path):
  """The command line end to end: a v5p-8 target (TPU compiler with libtpu, else 4 fake CPU
  devices and one line saying so), the table, and the JSON file."""
  out = tmp_path / "plan.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "grpo_jax.memory_plan", "--config=configs/tiny.py",
       "--topology=v5p-8", "--functions=logprobs", f"--json={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "logprobs" in proc.stdout and "FITS" in proc.stdout
  if mp.libtpu_version() is None:
    assert "note: XLA:CPU on 4 fake devices (libtpu not importable" in proc.stderr
  (row,) = json.loads(out.read_text())
  assert JSON_KEYS <= set(row)
  assert row["num_devices"] == 4 and row["device_kind"] == "TPU v5"
  # v5p's 95 GiB by table; with libtpu, what the compiler allows (95.73 GiB with 0.0.50).
  assert 95 * mp.GIB <= row["hbm_capacity"] < 96 * mp.GIB
  assert row["total"] < row["hbm_capacity"]


@pytest.fixture(scope="module")
def v6e_8():
  pytest.importorskip("libtpu", reason="libtpu not installed: pip install 'jax[tpu]' to plan "
                      "with the TPU compiler")
  mp.libtpu_compile_only_env("v6e-8")
  return mp.make_target("v6e-8")


def test_compiles_for_a_tpu_topology(v6e_8):
  target = v6e_8
  assert len(target.devices) == 8 and target.devices[0].platform == "tpu"
  assert "TPU compiler" in target.compiler
  rows, _ = mp.plan(tiny.get_config(), target, functions=("update",), micro_batches=[0],
                    log=lambda _: None)
  (row,) = rows
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      mp.build.make_policy(tiny.get_config(), mp.build.make_mesh(
          tiny.get_config(), devices=target.devices), abstract=True).params))
  assert row.params == 4 * num_params  # data=-1: the params are replicated, float32
  # The HBM the compiler itself allows a v6e chip (31.24 GiB with libtpu 0.0.50).
  assert 30 * mp.GIB < target.hbm_bytes <= 32 * mp.GIB
  assert 0 < row.temp and row.total < target.hbm_bytes


def test_compiler_out_of_hbm_message_is_read():
  msg = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
         "memory required for HLO temporaries (126.43G) exceeds available HBM (95.73G). HLO "
         "module: jit_update.")
  assert mp._oom_figures(msg) == (int(126.43 * mp.GIB), int(95.73 * mp.GIB))
  assert mp._oom_figures("INTERNAL: something else") is None


def test_a_plan_the_tpu_compiler_refuses_does_not_fit(v6e_8):
  """A 4 GiB-per-layer MLP (x2 layers, replicated: data=-1) cannot fit a 32 GiB chip: the
  compiler refuses it and the row says so with the bytes from its message."""
  c = tiny.get_config()
  c.model.intermediate_size = 2 ** 23  # 3 * 128 * 2^23 * 4 bytes = 12 GiB of MLP per layer
  rows, _ = mp.plan(c, v6e_8, functions=("logprobs",), log=lambda _: None)
  (row,) = rows
  assert row.compiled["oom_available"] == v6e_8.hbm_bytes
  assert row.total >= row.compiled["oom_required"] > v6e_8.hbm_bytes
  assert row.params > 24 * mp.GIB
  assert mp.fit_text(row).startswith("DOES NOT FIT")


def test_reference_is_planned_in_the_compute_dtype():
  """The loop stores the frozen reference in model.dtype (policy.as_reference): with f32
  master weights and bf16 compute the reference is half the params' bytes."""
  c = _deep_config(beta=0.04)
  c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
  mesh = build.make_mesh(c)
  policy = build.make_policy(c, mesh, abstract=True)
  fns = step_lib.build(c, policy, mesh)
  params = mp.shard_bytes(fns.abstract_state["params"])
  assert mp.reference_bytes(c, fns) == params // 2
  assert mp._resident(c, fns)["reference"] == params // 2
