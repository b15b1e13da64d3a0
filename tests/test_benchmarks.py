"""The benchmark scripts run and report sane figures (speed targets are in the printouts, not here)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # suite time; benchmarks/grpo_step.py --quick below runs the same sampler
def test_rollout_benchmark_quick(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one real CPU device, as a user runs it
  r = subprocess.run([sys.executable, "benchmarks/rollout.py", "--quick", "--no_transformers",
                      "--no_vllm", "--batch=4", "--generations=4", f"--json={out}"],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())["results"][0]
  assert res["model"] == "tiny" and res["ours_tok_s"] > 0
  assert min(res["prefill_g1_ms"], res["prefill_shared_ms"], res["naive_prefill_ms"]) > 0
  assert "ours tok/s" in r.stdout


def test_grpo_step_benchmark_quick(tmp_path):
  out = tmp_path / "step.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one real CPU device, as a user runs it
  r = subprocess.run([sys.executable, "benchmarks/grpo_step.py", "--quick", "--no_tunix",
                      f"--json={out}"], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())["results"][0]
  assert res["workload"] == "tiny" and res["rows"] == 32 * 8
  # The loop's phases of this config (beta 0, on-policy native engine: no log-prob passes).
  assert set(res["phases"]) == {"prompts", "rollout", "rewards", "advantages", "update", "log",
                                "step"}
  assert all(v > 0 for v in res["phases"].values())
  assert res["steady_step_sec"] >= res["phases"]["rollout"] + res["phases"]["update"]
  # Compilation is reported apart: JAX's own compile time of the first step, mostly in the
  # rollout and the update, and the steady steps compile nothing.
  assert res["first_step_sec"] > res["steady_step_sec"]
  assert 0 < res["compile_sec"] < res["first_step_sec"]
  assert res["compile_phases"]["rollout"] > 0
  # config.compile_ahead: the update compiled on the worker thread while the rollout ran
  assert res["compile_phases"]["update"] == 0 and res["compile_ahead_sec"] > 0
  assert res["steady_compile_sec"] == 0
  assert 0 < res["update_mfu"] <= 1 and res["update_flops"] > 0
  assert res["generated_tokens"] > 0 and res["rollout_tok_s"] > 0
  assert "upd MFU" in r.stdout
