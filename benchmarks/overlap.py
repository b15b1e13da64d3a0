r"""Rollout/update overlap: the loop's steps per second, colocated on-policy vs disaggregated
one step off (rollout.placement, rollout.max_staleness), on the same cores.

    python benchmarks/overlap.py                 # 2 processes, one core each (taskset), + 1x8
    python benchmarks/overlap.py --quick         # fewer steps (the test)
    python benchmarks/overlap.py --layouts=pair --steps=16 --completion=24

Layouts:
  pair   2 JAX processes (jax.distributed on 127.0.0.1, launch/multihost.sh), one CPU device
         each, each pinned to its own core with taskset. colocated: a data=2 mesh over both,
         rollout and update take turns on both cores. disaggregated: the trainer's mesh is
         process 0's device, the sampler's process 1's; the weights move after each update by
         parallel/transfer.py's collective, the batches back the same way; max_staleness=1 samples step
         s+1 while step s updates.
  single 1 process, 8 fake CPU devices (4 + 4 when disaggregated) on the machine's cores. Fake
         devices share one thread pool, so what overlaps here is whatever XLA:CPU runs at once.

Workload: configs/tiny.py's model (0.4M parameters), no warm start, 32 prompts x G=8 per step,
--completion new tokens per row (a random model never stops early: every row is that long),
the digit-count plug-in reward (tests/data): chosen so that the rollout and the update take
about as long (the run prints both, from the colocated run's metrics). The figure is steady
steps per second: steps after the --warmup first, timed between process 0's log lines of
those steps (wall clock, so the two processes' waits are in it).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LINE = re.compile(r"^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*\[grpo\] step (\d+)/")


def args_for(steps: int, completion: int, placement: str, staleness: int, extra=()) -> list[str]:
  return [
      "--config=configs/tiny.py",
      "--config.sft_steps=0",
      f"--config.num_steps={steps}",
      "--config.batch_size=32",
      "--config.num_generations=8",
      f"--config.max_completion_length={completion}",
      f"--config.model.max_position_embeddings={max(64, 8 + completion)}",
      "--config.data.arithmetic.num_train=2048",
      "--config.eval.num_examples=16",
      "--config.eval.batch_size=16",
      "--config.eval.generation_configs=('greedy',)",
      "--config.log_interval_steps=1",
      "--config.save_interval_steps=100000",
      "--config.reward.custom_file=tests/data/digit_count_reward.py",
      "--config.reward.functions=()",
      "--config.reward.weights=()",
      "--config.report_at_end=False",
      "--config.compile_ahead=False",
      f"--config.rollout.placement={placement}",
      f"--config.rollout.max_staleness={staleness}",
      *extra,
  ]


def step_times(log: str) -> dict[int, float]:
  """step -> wall-clock seconds of its progress line in an absl log."""
  out = {}
  for line in log.splitlines():
    m = STEP_LINE.match(line)
    if m:
      t = datetime.strptime(m.group(2), "%H:%M:%S.%f")
      out[int(m.group(3))] = t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6
  return out


def steady_rate(times: dict[int, float], warmup: int) -> float:
  steps = sorted(s for s in times if s > warmup)
  if len(steps) < 2:
    raise RuntimeError(f"too few steps logged after the warm-up: {sorted(times)}")
  return (steps[-1] - steps[0]) / (times[steps[-1]] - times[steps[0]])


def metric_medians(workdir: str, keys, warmup: int) -> dict[str, float]:
  rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
  rows = [r for r in rows if "loss/policy_loss" in r and r["step"] > warmup]
  return {
      k: statistics.median(r[k] for r in rows if k in r) for k in keys if any(k in r for r in rows)
  }


def run_pair(workdir: str, args: list[str], cores: list[int]) -> str:
  """Both processes, each pinned to its core; -> process 0's log."""
  import socket

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, LOCAL_DEVICES="1", PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
  procs = [
      subprocess.Popen(
          [
              "taskset",
              "-c",
              str(cores[pid]),
              "bash",
              "launch/multihost.sh",
              f"127.0.0.1:{port}",
              "2",
              str(pid),
              "--",
              f"--workdir={workdir}",
              *args,
          ],
          cwd=ROOT,
          env=env,
          stderr=logs[pid],
          stdout=subprocess.DEVNULL,
          text=True,
      )
      for pid in range(2)
  ]
  for p in procs:
    p.wait(timeout=1800)
  text = []
  for log in logs:
    log.seek(0)
    text.append(log.read())
  if any(p.returncode for p in procs):
    raise RuntimeError("a process failed:\n" + text[0][-3000:] + text[1][-3000:])
  return text[0]


def run_single(workdir: str, args: list[str]) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  p = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", f"--workdir={workdir}", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=1800,
  )
  if p.returncode:
    raise RuntimeError(p.stderr[-3000:])
  return p.stderr


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layouts", default="pair,single")
  ap.add_argument("--steps", type=int, default=14)
  ap.add_argument("--warmup", type=int, default=4)
  ap.add_argument("--completion", type=int, default=48)
  ap.add_argument("--cores", default="0,1")
  ap.add_argument("--quick", action="store_true", help="8 steps, warm-up 3")
  ap.add_argument("--json", default="")
  ap.add_argument(
      "--set",
      action="append",
      default=[],
      help="more config overrides, e.g. --set=micro_batch_size=64 (repeatable)",
  )
  a = ap.parse_args()
  if a.quick:
    a.steps, a.warmup = 8, 3
  cores = [int(c) for c in a.cores.split(",")]
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for layout in a.layouts.split(","):
      for name, placement, staleness in (
          ("colocated", "colocated", 0),
          ("disaggregated+1", "disaggregated", 1),
      ):
        workdir = os.path.join(tmp, f"{layout}-{name}")
        t0 = time.time()
        args = args_for(
            a.steps, a.completion, placement, staleness, [f"--config.{x}" for x in a.set]
        )
        log = run_pair(workdir, args, cores) if layout == "pair" else run_single(workdir, args)
        rate = steady_rate(step_times(log), a.warmup)
        med = metric_medians(
            workdir,
            (
                "perf/rollout_sec",
                "perf/update_sec",
                "perf/weight_sync_sec",
                "perf/batch_transfer_sec",
            ),
            a.warmup,
        )
        results[f"{layout}/{name}"] = {"steps_per_sec": rate, **med, "wall_sec": time.time() - t0}
        print(
            f"{layout:6s} {name:16s} {rate:6.3f} steps/s  "
            + "  ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in med.items()),
            flush=True,
        )
      ratio = (
          results[f"{layout}/disaggregated+1"]["steps_per_sec"]
          / results[f"{layout}/colocated"]["steps_per_sec"]
      )
      results[f"{layout}/ratio"] = ratio
      print(
          f"{layout:6s} disaggregated one-step-off / colocated on-policy: {ratio:.2f}x", flush=True
      )
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=2)


if __name__ == "__main__":
  main()
