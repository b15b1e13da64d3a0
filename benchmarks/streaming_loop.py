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
process 1's. Steps per second: process 0's [grpo] log lines after --warmup steps (wall clock).
"""

import argparse
import json
import os
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
        entry = dict(
            seed=seed,
            steps_per_sec=rate,
            packed_shapes=len(shapes),
            packed_shapes_ahead=sum("compiled ahead" in line for line in shapes),
            before=summary["eval_before"]["greedy"]["accuracy"],
            after=summary["eval_after"]["greedy"]["accuracy"],
            wall_sec=time.time() - t0,
            **med,
        )
        results[mode].append(entry)
        print(
            f"seed {seed} {mode:<13} {rate:6.3f} steps/s  accuracy {entry['before']:.3f} -> "
            f"{entry['after']:.3f}  packed shapes {entry['packed_shapes']} "
            f"({entry['packed_shapes_ahead']} compiled ahead)  "
            + "  ".join(f"{k.split('/')[1]}={v:.3f}" for k, v in med.items()),
            flush=True,
        )
  print()
  base = results.get("one step off")
  for mode, runs in results.items():
    rate = statistics.median(r["steps_per_sec"] for r in runs)
    after = statistics.mean(r["after"] for r in runs)
    vs = f"  x{rate / statistics.median(r['steps_per_sec'] for r in base):.2f}" if base else ""
    print(f"{mode:<13} median {rate:.3f} steps/s{vs}  mean accuracy after {after:.3f}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
