"""Steps around a new prompt width, with the sampler and step programs compiled ahead or not.

With data.prompt_width=bucket (the default) a batch whose longest prompt falls in another
bucket needs its own sampler, log-prob and update programs. run/compile_ahead.py compiles them on a
worker thread from the moment the step before dispatches its rollout; this benchmark runs the
loop itself (train.run, the tiny model) on a schedule of widths, batches 0-3 at --width_a
columns and 4-7 at --width_b, with config.compile_ahead and without, each run a fresh process
(nothing compiled before), in turns, and prints each step's time (perf/step_time_sec) and the
medians of the first step, the step before the new width and the new width's first step.

How much of a compile the step before can hide depends on how long that step keeps the host's
CPUs free: on an accelerator, the device's time; here, --reward_wait_ms per completion of a
host reward that waits (a sandbox run or a remote judge). With 0 on this 2-core machine there
is nothing to hide behind (a step of the tiny model is ~0.4 s, a width's compiles ~4 s).

    python benchmarks/new_width.py                      # 25 ms per completion, 2 rounds
    python benchmarks/new_width.py --reward_wait_ms=0
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpo_jax import train  # noqa: E402
from tests.test_train import grpo_rows  # noqa: E402
from tests.test_train import tiny_config  # noqa: E402

_REWARD = """import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  time.sleep({wait})
  return sum(ch.isdigit() for ch in solution_str) / max(len(solution_str), 1)
"""


def run(ahead: bool, args, reward_file: str) -> list[float]:
  calls = [0]

  def width(self, indices, mode):  # batch k's width, in the order the loop prepares them
    calls[0] += 1
    return args.width_a if calls[0] <= 4 else args.width_b

  train.data_lib.PromptData.width = width
  workdir = tempfile.mkdtemp()
  train.run(
      tiny_config(
          **{
              "eval.generation_configs": (),
              "num_steps": 8,
              "compile_ahead": ahead,
              "max_prompt_length": max(args.width_a, args.width_b),
              "max_completion_length": 64,
              "batch_size": 16,
              "num_generations": 8,
              "micro_batch_size": 32,
              "reward.custom_file": reward_file,
          }
      ),
      workdir,
  )
  return [r["perf/step_time_sec"] for r in grpo_rows(workdir)]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument(
      "--reward_wait_ms", type=float, default=25.0, help="host wait per completion (128 per step)"
  )
  ap.add_argument("--width_a", type=int, default=16)
  ap.add_argument("--width_b", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--json", default="")
  ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # ahead|off: one run, here
  args = ap.parse_args()
  if args.one:
    reward_file = os.path.join(tempfile.mkdtemp(), "waiting_reward.py")
    with open(reward_file, "w") as f:
      f.write(_REWARD.format(wait=args.reward_wait_ms / 1000))
    t0 = time.perf_counter()
    steps = run(args.one == "ahead", args, reward_file)
    print(json.dumps(dict(steps=steps, wall=time.perf_counter() - t0)))
    return
  runs = {"ahead": [], "off": []}
  for _ in range(args.rounds):
    for name in runs:
      out = subprocess.run(
          [
              sys.executable,
              os.path.abspath(__file__),
              f"--one={name}",
              f"--reward_wait_ms={args.reward_wait_ms}",
              f"--width_a={args.width_a}",
              f"--width_b={args.width_b}",
          ],
          capture_output=True,
          text=True,
          check=True,
      )
      runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
  print(
      f"\nwidths {args.width_a} (steps 1-4) then {args.width_b} (steps 5-8); host reward wait "
      f"{args.reward_wait_ms:g} ms x 128 completions per step; step times in s"
  )
  for name, rs in runs.items():
    for r in rs:
      print(f"{name:6s} wall {r['wall']:5.1f}  " + " ".join(f"{t:5.2f}" for t in r["steps"]))
  med = {
      name: {
          k: statistics.median(r["steps"][i] for r in rs)
          for k, i in (("first", 0), ("before", 3), ("new", 4))
      }
      for name, rs in runs.items()
  }
  for k, label in (
      ("first", "first step"),
      ("before", "step before the new width"),
      ("new", "the new width's first step"),
  ):
    print(
        f"{label:27s} ahead {med['ahead'][k]:5.2f} s   off {med['off'][k]:5.2f} s   "
        f"off/ahead {med['off'][k] / med['ahead'][k]:.2f}x"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(args=vars(args), runs=runs, median=med), f, indent=1)


if __name__ == "__main__":
  main()
