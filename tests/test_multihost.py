"""Two JAX processes (jax.distributed over 127.0.0.1, 4 fake CPU devices each) run the whole
loop: SFT warm start, GRPO steps, checkpoints, a stop on the step budget, and the resume."""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(workdir, *args):
  """Both processes of a 2-process job; -> [(returncode, stderr)] by process id."""
  port = _free_port()
  env = dict(os.environ, LOCAL_DEVICES="4", PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)  # the launcher sets the per-process device count
  procs = [subprocess.Popen(
      ["bash", "launch/multihost.sh", f"127.0.0.1:{port}", "2", str(pid), "--",
       "--config=configs/tiny.py", f"--workdir={workdir}", "--config.sft_steps=10",
       "--config.sft.stop_at_accuracy=0", "--config.num_steps=4",
       "--config.batch_size=8", "--config.num_generations=4",
       "--config.data.arithmetic.num_train=128", "--config.eval.num_examples=32",
       "--config.eval.batch_size=16", "--config.log_interval_steps=1",
       "--config.save_interval_steps=2", *args],
      cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for pid in range(2)]
  return [(p.wait(timeout=600), p.stderr.read()) for p in procs]


def test_two_processes_train_stop_and_resume(tmp_path):
  workdir = tmp_path / "run"
  first = _launch(workdir, "--config.max_steps_per_run=2")
  for rc, err in first:
    assert rc == 0, err[-3000:]
    assert "max_steps_per_run=2 reached: checkpoint 12 written" in err
  assert not (workdir / "summary.json").exists()
  second = _launch(workdir)
  for rc, err in second:
    assert rc == 0, err[-3000:]
    assert "resuming from" in err
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["final_step"] == 4 and summary["sft_steps"] == 10
  rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  grpo = sorted({r["step"] for r in rows if "loss/policy_loss" in r})
  assert grpo == [1, 2, 3, 4]  # only process 0 writes, every step once per run
  assert sorted(os.listdir(workdir / "checkpoints"))[-1] == "14"
