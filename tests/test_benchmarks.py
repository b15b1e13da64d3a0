"""The benchmark scripts run and report sane figures (speed targets are in the printouts, not here)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
