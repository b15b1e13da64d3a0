r"""The loop on a long-tailed task: streaming slots (rollout.slots, max_staleness=1,
disaggregated) vs one step off (the lockstep sampler, max_staleness=1, disaggregated) vs
on-policy (colocated): steady steps per second and what each learns, over seeds.

    python benchmarks/streaming_loop.py                  # 3 seeds x 3 modes, ~20 min
    python benchmarks/streaming_loop.py --seeds=0 --steps=12 --sft_steps=100   # a quick look

Task: configs/tiny.py's model on the arithmetic family with long-tailed lengths
(data.arithmetic: 1-digit operands, "+-", 1 to 8 operations, half of them 1, geometric;
demonstration "working": one partial result per operation), so a warmed-up policy's
completions are long-tailed (~10 to ~80 tokens; C = 96). Each run: an SFT warm start of
--sft_steps, then --steps GRPO steps of 32 prompts x G 8, greedy accuracy on 128 held-out
problems before and after GRPO.

Layout (benchmarks/overlap.py's "pair"): 2 JAX processes with one CPU device each, each pinned
to its own core (taskset). Disaggregated: the trainer is process 0's device, the sampler
process 1's. Steps per second: process 0's [grpo] log lines after --warmup steps (wall clock),
and settled (`settled`): after the step that compiled the last new packed shape (packed rows'
shapes follow the lengths, and on CPU each new one compiles at its first use on the trainer's
core), with the median step interval of the steps that compiled none.
"""

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import overlap  # noqa: E402

MODES = {
    "on-policy": ["--config.rollout.placement=colocated", "--config.rollout.max_staleness=0"],
    "one step off": [
        "--config.rollout.placement=disaggregated",
        "--config.rollout.max_staleness=1",
    ],
    "streaming": [
        "--config.rollout.placement=disaggregated",
        "--config.rollout.max_staleness=1",
        "--config.rollout.slots=256",
    ],
}


def args_for(seed: int, steps: int, sft_steps: int, compile_ahead: bool = True) -> list[str]:
  return [
      "--config=configs/tiny.py",
      f"--config.seed={seed}",
      "--config.data.arithmetic.digits=1",
      "--config.data.arithmetic.ops=+-",
      "--config.data.arithmetic.max_ops=8",
      "--config.data.arithmetic.demonstration=working",
      "--config.data.arithmetic.num_train=4096",
      "--config.max_prompt_length=32",
      "--config.max_completion_length=96",
      "--config.model.max_position_embeddings=128",
      f"--config.sft_steps={sft_steps}",
      "--config.sft.stop_at_accuracy=0",
      f"--config.num_steps={steps}",
      "--config.eval.num_examples=128",
      "--config.eval.batch_size=128",
      "--config.eval.generation_configs=('greedy',)",
      "--config.log_interval_steps=1",
      "--config.save_interval_steps=100000",
      "--config.report_at_end=False",
      # packed rows' shapes follow the lengths: their likely next ones compile ahead
      f"--config.compile_ahead={compile_ahead}",
      # A warmed-up policy: tiny.py's 5e-4 (for a from-scratch one) undoes the warm start.
      "--config.optimizer.learning_rate=1e-4",
  ]


def _clock(line: str) -> float | None:
  m = re.match(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) ", line)
  return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])


def settled(log: str, min_steps: int = 5) -> dict:
  """Process 0's log -> the steps that met a new packed shape (the first step logged at or
  after its "packed shapes so far" line), the rate after the last of them (None with fewer than
  `min_steps` steps after it) and the median interval of the steps after step 1 that met none."""
  times = overlap.step_times(log)
  steps = sorted(times)
  shape_at = [
      t
      for line in log.splitlines()
      if "packed shapes so far" in line
      for t in [_clock(line)]
      if t is not None
  ]
  compiled = sorted({next((s for s in steps if times[s] >= t), steps[-1]) for t in shape_at})
  last = compiled[-1] if compiled else steps[0]
  after = [s for s in steps if s >= last]
  rate = None
  if len(after) > min_steps:
    rate = (after[-1] - after[0]) / (times[after[-1]] - times[after[0]])
  quiet = [times[s] - times[s - 1] for s in steps[1:] if s - 1 in times and s not in compiled]
  return dict(
      compile_steps=compiled,
      settled_steps_per_sec=rate,
      settled_from=last,
      median_interval=statistics.median(quiet) if quiet else None,
      whole_steps_per_sec=(steps[-1] - steps[0]) / (times[steps[-1]] - times[steps[0]]),
  )


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--modes", default=",".join(MODES))
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--sft_steps", type=int, default=400)
  ap.add_argument("--warmup", type=int, default=4)
  ap.add_argument("--cores", default="0,1")
  ap.add_argument("--compile_ahead", type=int, default=1)
  ap.add_argument("--json", default="")
  a = ap.parse_args(argv)
  cores = [int(c) for c in a.cores.split(",")]
  results = {m: [] for m in a.modes.split(",")}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in [int(s) for s in a.seeds.split(",")]:
      for mode in results:
        workdir = os.path.join(tmp, f"{mode}-{seed}".replace(" ", "_"))
        t0 = time.time()
        log = overlap.run_pair(
            workdir,
            args_for(seed, a.steps, a.sft_steps, bool(a.compile_ahead)) + MODES[mode],
            cores,
        )
        rate = overlap.steady_rate(overlap.step_times(log), a.warmup)
        summary = json.load(open(os.path.join(workdir, "summary.json")))
        med = overlap.metric_medians(
            workdir,
            (
                "completions/mean_length",
                "rollout/staleness_token_mean",
                "rollout/slots_busy",
                "perf/rollout_sec",
                "perf/update_sec",
            ),
            a.warmup,
        )
        shapes = [line for line in log.splitlines() if "packed shapes so far" in line]
        rates = settled(log)
        entry = dict(
            seed=seed,
            steps_per_sec=rate,
            packed_shapes=len(shapes),
            packed_shapes_ahead=sum("compiled ahead" in line for line in shapes),
            before=summary["eval_before"]["greedy"]["accuracy"],
            after=summary["eval_after"]["greedy"]["accuracy"],
            wall_sec=time.time() - t0,
            **rates,
            **med,
        )
        results[mode].append(entry)
        print(
            f"seed {seed} {mode:<13} {rate:6.3f} steps/s  accuracy {entry['before']:.3f} -> "
            f"{entry['after']:.3f}  packed shapes {entry['packed_shapes']} "
            f"({entry['packed_shapes_ahead']} compiled ahead, at steps {rates['compile_steps']})  "
            f"settled {_fmt(rates['settled_steps_per_sec'])} steps/s from step "
            f"{rates['settled_from']}, median quiet interval {_fmt(rates['median_interval'])} s, "
            f"whole run {rates['whole_steps_per_sec']:.3f} steps/s  "
            + "  ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in med.items()),
            flush=True,
        )
  print()
  base = results.get("one step off")
  for mode, runs in results.items():
    rate = statistics.median(r["steps_per_sec"] for r in runs)
    after = statistics.mean(r["after"] for r in runs)
    vs = f"  x{rate / statistics.median(r['steps_per_sec'] for r in base):.2f}" if base else ""
    line = f"{mode:<13} median {rate:.3f} steps/s{vs}"
    if all(r["settled_steps_per_sec"] for r in runs + (base or [])):
      cut = statistics.median(r["settled_steps_per_sec"] for r in runs)
      line += f"  settled {cut:.3f}"
      if base:
        per_seed = [
            r["settled_steps_per_sec"] / b["settled_steps_per_sec"] for r, b in zip(runs, base)
        ]
        line += " (x" + ", x".join(f"{x:.2f}" for x in per_seed) + " per seed)"
    print(line + f"  mean accuracy after {after:.3f}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


def _fmt(x) -> str:
  return "-" if x is None else f"{x:.3f}"


if __name__ == "__main__":
  main()
