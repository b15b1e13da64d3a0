"""benchmarks/trace_analysis.py: the op categorizer, the busy/idle/self-time arithmetic on a
hand-made trace, and a real 2-step profiled GRPO run read back (phases, device ops)."""

import gzip
import importlib.util
import json
import os

import pytest

from grpo_jax.run import profiling
from grpo_jax import train
from tests.test_train import ROOT
from tests.test_train import tiny_config

# Compiles watched here (XLA's compile events / the profiler's trace): no cache loads.
pytestmark = pytest.mark.usefixtures("no_compilation_cache")


_spec = importlib.util.spec_from_file_location(
    "trace_analysis", os.path.join(ROOT, "benchmarks", "trace_analysis.py")
)
ta = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ta)


@pytest.mark.parametrize(
    "name, category",
    [
        ("dot.52", "matmul"),
        ("convolution.3", "matmul"),
        ("ynn_fusion.65", "matmul"),  # XLA:CPU YNNPACK dot fusion
        ("gemm_fusion_dot.1", "matmul"),  # XLA:GPU Triton gemm
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", "matmul"),  # cuBLAS kernel
        ("custom-call.7 __cudnn$fmha", "attention"),
        ("splash_mha_fwd", "attention"),
        ("all-reduce.3", "collective"),
        ("all-gather-start.1", "collective"),
        ("reduce-scatter-fusion", "collective"),
        ("collective-permute-done", "collective"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collective"),
        ("copy.142", "copy"),
        ("transpose_copy_fusion.8", "copy"),
        ("bitcast_dynamic-update-slice_fusion", "copy"),  # the KV-cache write
        ("concatenate.15", "copy"),
        ("MemcpyD2H", "copy"),
        ("add_rsqrt_fusion", "elementwise"),
        ("copy_rsqrt_fusion", "elementwise"),  # data movement fused with arithmetic
        ("wrapped_reduce-window.2", "elementwise"),
        ("is-finite_select_fusion", "elementwise"),
        ("loop_multiply_fusion", "elementwise"),
        ("convert_reduce_fusion", "elementwise"),  # "convert" is not "conv"
        ("custom-call.3", "other"),
        ("sort.1", "other"),
    ],
)
def test_categorize(name, category):
  assert ta.categorize(name) == category


def _x(name, ts, dur, tid, **args):
  return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def test_hand_made_trace(tmp_path):
  """One step [0, 100) µs on thread 1 with two phases; ops of device 0 on threads 2 and 3:
  a fusion with a copy nested in it, an overlapping dot on the other thread, a `while`
  container, an op after the step (not counted), and one op of device 1."""
  op = lambda name, ts, dur, tid, dev=0: _x(
      name, ts, dur, tid, hlo_op=name, hlo_module="jit_f", device_ordinal=str(dev)
  )
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      _x("grpo_step", 0, 100, 1, step_num="7"),
      _x("phase/rollout", 1, 40, 1),
      _x("phase/update", 45, 50, 1),
      _x("phase/update", 200, 10, 1),  # outside every step: ignored
      op("add_select_fusion", 10, 20, 2),
      op("copy.1", 12, 5, 2),  # nested: the fusion's self time is 15
      op("dot.1", 25, 15, 3),  # overlaps the fusion: busy union [10, 40)
      op("while.2", 50, 30, 2),  # container: busy, but no op time
      op("dot.1", 60, 10, 3),
      op("dot.1", 150, 10, 3),  # after the step
      op("add_select_fusion", 0, 10, 2, dev=1),
  ]
  run = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
  run.mkdir(parents=True)
  with gzip.open(run / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:  # written after, same events
    json.dump({"traceEvents": events}, f)
  assert ta.find_trace(str(tmp_path)) == str(run / "host.trace.json.gz")

  r = ta.main([str(tmp_path)])
  assert r == json.loads((run / "analysis.json").read_text())
  assert r["num_devices"] == 2
  (step,) = r["steps"]
  assert step["step"] == 7 and step["wall_ms"] == pytest.approx(0.1)
  assert step["phases"] == pytest.approx({"rollout": 0.040, "update": 0.050})
  assert r["phase_sum_fraction"] == pytest.approx(0.9)
  # Device 0 busy [10, 40) + [50, 80) = 60 µs, device 1 10 µs: mean 35 of 100.
  assert step["device_busy_ms"] == pytest.approx(0.035)
  assert step["idle_fraction"] == pytest.approx(0.65)
  # The idle time by what the host was doing: outside [0, 1) (device 1 busy: 0.5 µs mean),
  # [41, 45), [95, 100); rollout [1, 41) minus (30 + 9) / 2; update [45, 95) minus 30 / 2.
  assert step["idle_ms_by_phase"] == pytest.approx(
      {ta.OUTSIDE: 0.0095, "rollout": 0.0205, "update": 0.035}
  )
  assert sum(step["idle_ms_by_phase"].values()) == pytest.approx(0.065)
  assert r["host_idle_ms"] == pytest.approx(0.0095)  # rollout and update wait on the device
  assert r["host_idle_fraction"] == pytest.approx(0.095)
  assert r["categories"] == pytest.approx(
      {
          "matmul": 0.025,
          "elementwise": 0.025,
          "copy": 0.005,
          "attention": 0,
          "collective": 0,
          "other": 0,
          "idle": 0.130,
      }
  )
  assert {o["name"]: o["count"] for o in r["top_ops"]} == {
      "dot.1": 2,
      "add_select_fusion": 2,
      "copy.1": 1,
  }
  assert {o["name"]: o["total_ms"] for o in r["top_ops"]} == pytest.approx(
      {"dot.1": 0.025, "add_select_fusion": 0.025, "copy.1": 0.005}
  )


def test_profiled_grpo_steps(tmp_path, capsys):
  """Steps 1-2 of a tiny run (beta > 0 and 2 iterations: every phase runs) traced, read back:
  the phases cover the step span, each named phase is there, XLA:CPU ops of all 8 devices."""
  workdir = tmp_path / "run"
  train.run(
      tiny_config(
          num_steps=3,
          beta=0.05,
          num_iterations=2,
          **{"profile.start_step": 1, "profile.num_steps": 2}
      ),
      str(workdir),
  )
  r = ta.main([str(workdir / "profile")])
  out = capsys.readouterr().out

  assert [s["step"] for s in r["steps"]] == [1, 2]
  core = set(profiling.PHASES) - set(profiling.OPTIONAL_PHASES)
  assert core <= set(r["phases"]) <= set(profiling.PHASES)
  for s in r["steps"]:
    assert core <= set(s["phases"]) <= set(profiling.PHASES)
    assert sum(s["phases"].values()) == pytest.approx(s["wall_ms"], rel=0.10)
    assert 0 < s["device_busy_ms"] <= s["wall_ms"] and 0 <= s["idle_fraction"] < 1
  assert 0.9 <= r["phase_sum_fraction"] <= 1.0
  assert r["num_devices"] == 8  # conftest's fake CPU devices, told apart by device_ordinal
  assert r["categories"]["matmul"] > 0 and r["categories"]["idle"] > 0
  assert r["top_ops"] and all(o["total_ms"] > 0 and o["count"] > 0 for o in r["top_ops"])
  modules = {o["module"] for o in r["top_ops"]}
  assert modules <= {
      "jit_update",
      "jit__generate",
      "jit_logprobs",
      "jit_packed_logprobs_all",  # packed rows (the default): the log-prob passes
      "jit_pack",
      "jit_lengths",  # packing's sequence lengths
      "jit_assemble",
      "jit_rollout_stats",
      "jit__threefry_fold_in",
  }, modules
  assert "| update |" in out and "## Top 15 ops" in out
  for s in r["steps"]:  # the idle time, split by phase, adds up to the step's
    assert sum(s["idle_ms_by_phase"].values()) == pytest.approx(
        s["wall_ms"] - s["device_busy_ms"], rel=1e-6
    )
  assert 0 <= r["host_idle_fraction"] < 1 and "host overhead" in out
