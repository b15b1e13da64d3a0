"""The HBM planner (grpo_jax/memory_plan.py): byte split vs an analytic count, remat's effect on
temporaries, the JSON rows, the sampler's weight copy, --dump_hlo's files, the fallback lines
(no libtpu, no CUDA plugin), and TPU / H100 compiles when their compilers are here
(scripts/test_aot.sh)."""

import importlib.util
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
from grpo_jax.models.lora import adapters as lora
from grpo_jax.rl import step as step_lib
from tests.conftest import ROOT

JSON_KEYS = {
    "params",
    "optimizer",
    "reference",
    "temp",
    "kv_cache",
    "host_offload",
    "total",
    "hbm_capacity",
    "device_kind",
    "num_devices",
}


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
def remat_rows(tmp_path_factory):
  target = mp.make_target()  # the test process's 8 CPU devices
  dump = tmp_path_factory.mktemp("hlo")
  rows, mesh_shape = mp.plan(
      _deep_config(),
      target,
      remat_policies=["none", "full"],
      micro_batches=[0],
      functions=("update",),
      log=lambda _: None,
      dump_hlo=str(dump),
  )
  return target, {r.remat: r for r in rows}, mesh_shape, dump


def test_params_and_optimizer_bytes_match_the_analytic_count(remat_rows):
  target, rows, mesh_shape, _ = remat_rows
  assert mesh_shape == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}
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
  _, rows, _, _ = remat_rows
  assert rows["full"].temp < 0.6 * rows["none"].temp, (rows["full"].temp, rows["none"].temp)
  assert rows["full"].total < rows["none"].total


def test_json_rows_have_the_planner_keys(remat_rows):
  target, rows, mesh_shape, _ = remat_rows
  out = json.loads(json.dumps([r.to_json(target, mesh_shape) for r in rows.values()]))
  for obj in out:
    assert JSON_KEYS <= set(obj)
    assert obj["num_devices"] == 8 and obj["function"] == "update"
    assert obj["total"] == sum(
        obj[k]
        for k in ("params", "optimizer", "reference", "rollout_weights", "temp", "kv_cache", "io")
    )


def test_dump_hlo_writes_each_program_under_its_name(remat_rows):
  _, rows, _, dump = remat_rows
  assert sorted(p.name for p in dump.iterdir()) == [
      "update_full_mb256.hlo.txt",
      "update_none_mb256.hlo.txt",
  ]  # all 32 * 8 rows at once
  text = (dump / "update_full_mb256.hlo.txt").read_text()
  assert text.startswith("HloModule") and "ENTRY" in text


def test_native_sampler_counts_its_compute_dtype_copy():
  """The native sampler casts f32 master weights to bf16 (and unstacks scanned layers) once
  per rollout inside its program: rollout_w = the params in the compute dtype, taken out of
  its temporaries; none when it can read the params as they are."""

  def weight_copy(param_dtype, dtype, scan):
    c = _deep_config()
    c.model.param_dtype, c.model.dtype, c.model.scan_layers = param_dtype, dtype, scan
    mesh = build.make_mesh(c)
    policy = build.make_policy(c, mesh, abstract=True)
    params = step_lib.build(c, policy, mesh).abstract_state["params"]
    return mp.sampler_weight_copy_bytes(c, policy, params), mp.shard_bytes(params)

  copy, params = weight_copy("float32", "bfloat16", True)
  assert copy == params // 2
  assert weight_copy("float32", "bfloat16", False) == (params // 2, params)
  assert weight_copy("float32", "float32", True) == (params, params)  # unstacked, same dtype
  assert weight_copy("float32", "float32", False) == (0, params)
  c = _deep_config()
  c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
  rows, _ = mp.plan(c, mp.make_target(), functions=("sampler",), log=lambda _: None)
  (row,) = rows
  assert row.rollout_weights == row.params // 2 > 0
  assert row.total == (
      row.params
      + row.optimizer
      + row.reference
      + row.rollout_weights
      + row.temp
      + row.kv_cache
      + row.io
  )


def test_disaggregated_plans_each_role_on_its_half():
  """placement=disaggregated: update and log-probs on the trainer's 4 devices with the master
  weights and optimizer state; the sampler on the other 4 with only the weights it is sent,
  in the compute dtype (half the f32 params, no optimizer, no reference, no in-program copy);
  the transfer is the whole model in the compute dtype."""
  c = tiny.get_config()
  c.model.param_dtype, c.model.dtype, c.beta = "float32", "bfloat16", 0.04
  c.rollout.placement = "disaggregated"
  got = mp.plan_disaggregated(c, mp.make_target(), log=lambda _: None)
  trainer, _, trainer_t = got["trainer"]
  (sampler,), _, sampler_t = got["sampler"]
  assert len(trainer_t.devices) == len(sampler_t.devices) == 4
  assert not set(trainer_t.devices) & set(sampler_t.devices)
  assert sorted(r.function for r in trainer) == ["logprobs", "update"]
  update = next(r for r in trainer if r.function == "update")
  assert update.optimizer >= 2 * update.params and update.reference == update.params // 2
  assert sampler.params == update.params // 2  # bf16 of the same shards (data-parallel mesh)
  assert sampler.optimizer == sampler.reference == sampler.rollout_weights == 0
  n = sum(
      x.size
      for x in jax.tree.leaves(build.make_policy(c, build.make_mesh(c), abstract=True).params)
  )
  assert got["transfer_bytes"] == 2 * n


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
  h100 = mp.parse_topology("h100")
  assert (h100.platform, h100.topology_name, h100.chips) == ("cuda", "1x1x1", 1)
  assert h100.device_kind == "NVIDIA H100 80GB HBM3" and h100.hbm_bytes == 80 * mp.GIB
  assert mp.parse_topology("h100-8").topology_name == "1x1x8"
  assert mp.parse_topology("h200").hbm_bytes == 141 * mp.GIB
  for bad in ("v5p-6", "v7x-8", "tpu", "v5p-2", "h100-9", "h300", "a100"):
    with pytest.raises(ValueError, match="--topology"):
      mp.parse_topology(bad)


def test_cli_writes_json_for_a_topology(tmp_path):
  """The command line end to end: a v5p-8 target (TPU compiler with libtpu, else 4 fake CPU
  devices and one line saying so), the table, and the JSON file."""
  out = tmp_path / "plan.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.memory_plan",
          "--config=configs/tiny.py",
          "--topology=v5p-8",
          "--functions=logprobs",
          f"--json={out}",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
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


def test_cli_plans_an_h100(tmp_path):
  """--topology=h100: XLA:GPU's deviceless compile with the CUDA plugin (its HBM: the target
  config's device memory, 79.1 GiB), the optimized HLO dumped; else one fake CPU device and
  one line saying so."""
  out, dump = tmp_path / "plan.json", tmp_path / "hlo"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.memory_plan",
          "--config=configs/tiny.py",
          "--topology=h100",
          "--functions=logprobs",
          f"--json={out}",
          f"--dump_hlo={dump}",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  (row,) = json.loads(out.read_text())
  assert row["num_devices"] == 1 and row["device_kind"] == "NVIDIA H100 80GB HBM3"
  assert (dump / "logprobs.hlo.txt").read_text().startswith("HloModule")
  if mp.cuda_plugin_version() is None:
    assert "note: XLA:CPU on 1 fake device (jax-cuda13-plugin not importable" in proc.stderr
    assert row["hbm_capacity"] == 80 * mp.GIB
  else:
    assert "note:" not in proc.stderr and "XLA:GPU deviceless compile" in row["compiler"]
    assert row["hbm_capacity"] == 84942979072  # the H100 80GB's target config


@pytest.fixture(scope="module")
def v6e_8():
  pytest.importorskip(
      "libtpu",
      reason="libtpu not installed: pip install 'jax[tpu]' to plan " "with the TPU compiler",
  )
  mp.libtpu_compile_only_env("v6e-8")
  return mp.make_target("v6e-8")


def test_compiles_for_a_tpu_topology(v6e_8):
  target = v6e_8
  assert len(target.devices) == 8 and target.devices[0].platform == "tpu"
  assert "TPU compiler" in target.compiler
  rows, _ = mp.plan(
      tiny.get_config(), target, functions=("update",), micro_batches=[0], log=lambda _: None
  )
  (row,) = rows
  num_params = sum(
      int(np.prod(x.shape))
      for x in jax.tree.leaves(
          mp.build.make_policy(
              tiny.get_config(),
              mp.build.make_mesh(tiny.get_config(), devices=target.devices),
              abstract=True,
          ).params
      )
  )
  assert row.params == 4 * num_params  # data=-1: the params are replicated, float32
  # The HBM the compiler itself allows a v6e chip (31.24 GiB with libtpu 0.0.50).
  assert 30 * mp.GIB < target.hbm_bytes <= 32 * mp.GIB
  assert 0 < row.temp and row.total < target.hbm_bytes


def test_compiler_out_of_hbm_message_is_read():
  msg = (
      "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total "
      "memory required for HLO temporaries (126.43G) exceeds available HBM (95.73G). HLO "
      "module: jit_update."
  )
  assert mp._oom_figures(msg) == (int(126.43 * mp.GIB), int(95.73 * mp.GIB))
  assert mp._oom_figures("INTERNAL: something else") is None


def test_a_plan_the_tpu_compiler_refuses_does_not_fit(v6e_8):
  """A 4 GiB-per-layer MLP (x2 layers, replicated: data=-1) cannot fit a 32 GiB chip: the
  compiler refuses it and the row says so with the bytes from its message."""
  c = tiny.get_config()
  c.model.intermediate_size = 2**23  # 3 * 128 * 2^23 * 4 bytes = 12 GiB of MLP per layer
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


def test_lora_moe_plan_holds_no_reference_copy_and_a_merged_sampler_copy():
  """LoRA on an MoE decoder (f32 base, bf16 compute, beta > 0): the reference is the base
  itself (0 bytes), the optimizer holds moments of the adapters only, and the sampler's copy
  is the plain decoder's weights in bf16 (adapters merged, nothing else kept); the update
  compiles with the per-expert adapters."""
  moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

  def built(**lora):
    c = _deep_config(beta=0.04)
    c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
    for k, v in {**moe, "norm_topk_prob": True}.items():
      c.model[k] = v
    for k, v in lora.items():
      c.lora[k] = v
    mesh = build.make_mesh(c)
    policy = build.make_policy(c, mesh, abstract=True)
    return c, policy, step_lib.build(c, policy, mesh)

  c, policy, fns = built()
  full = mp.shard_bytes(fns.abstract_state["params"])
  assert mp._resident(c, fns)["reference"] == full // 2
  for lora_fields in ({"rank": 4}, {"rank": 4, "quantize_base": "int8"}):
    if "quantize_base" in lora_fields and importlib.util.find_spec("qwix") is None:
      continue  # .venv-aot has no qwix (scripts/test_aot.sh): the float base only
    c, policy, fns = built(**lora_fields)
    params = fns.abstract_state["params"]
    adapters = mp.shard_bytes(lora.split(params)[0])
    resident = mp._resident(c, fns)
    assert resident["reference"] == 0 and adapters > 0
    assert 2 * adapters <= resident["optimizer"] < 2 * adapters + 1024  # + Adam's counters
    assert mp.sampler_weight_copy_bytes(c, policy, params) == full // 2
  c, policy, fns = built(rank=4)
  (row,) = mp.plan(c, mp.make_target(), functions=("update",), log=lambda _: None)[0]
  assert row.reference == 0 and row.temp > 0


def test_slot_engine_is_planned_by_its_programs():
  """rollout.slots > 0: the sampler row is the slot engine's: kv = its slot caches (2 x layers x
  slots x Hkv x (P + C) x K in the compute dtype, slots split over the data-parallel devices),
  rollout_w = its bf16 weight copy, temporaries from its admit / decode / refresh compiles."""
  c = _deep_config()
  c.model.param_dtype, c.model.dtype = "float32", "bfloat16"
  c.mesh.data, c.mesh.fsdp = -1, 1  # slots over 8 data-parallel devices
  c.rollout.slots = 64
  logged = []
  rows, _ = mp.plan(c, mp.make_target(), functions=("sampler",), log=logged.append)
  (row,) = rows
  m = c.model
  slots_per_device = 64 // 8
  heads = m.num_kv_heads
  kv = 2 * m.num_layers * slots_per_device * heads * (16 + 16) * m.head_dim * 2  # bf16
  assert row.kv_cache == kv
  assert row.rollout_weights == row.params // 2 > 0
  assert row.temp > 0
  assert any("slot engine: 64 slots" in line for line in logged)


def test_slot_engine_with_tools_plans_its_extend_program():
  """rollout.tools: the slot engine's extend program (tool responses appended into the live
  caches) is compiled and counted with the others."""
  c = _deep_config()
  c.mesh.data, c.mesh.fsdp = -1, 1
  c.rollout.slots = 64
  c.rollout.tools.names = "calculator"
  c.rollout.max_tool_response_tokens = 8
  logged = []
  rows, _ = mp.plan(c, mp.make_target(), functions=("sampler",), log=logged.append)
  assert any("compiling slot engine extend" in line for line in logged), logged
  assert any(" extend " in line for line in logged if line.startswith("slot engine:")), logged


def test_token_budgets_plan_the_update_by_their_rows():
  """--micro_batch_tokens: each budget T plans the update with micro-batches of T // (P + C)
  rows (whole rows per device): the packed update's worst case. A smaller budget, fewer rows
  per micro-batch, smaller temporaries."""
  c = _deep_config()
  width = c.max_prompt_length + c.max_completion_length  # tiny's prompts fit P = 16
  rows, _ = mp.plan(
      c,
      mp.make_target(),
      micro_batch_tokens=[8 * width, 32 * width],
      functions=("update",),
      log=lambda _: None,
  )
  by_rows = {r.micro_batch: r for r in rows}
  assert sorted(by_rows) == [8, 32], sorted(by_rows)
  assert by_rows[8].temp < by_rows[32].temp
