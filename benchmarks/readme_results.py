r"""The README's "Results" table, measured and written by this script, never by hand.

    python benchmarks/readme_results.py --rows=demo,lora --seeds=0,1,2   # measure, record, write
    python benchmarks/readme_results.py --write                            # README from the record
    python benchmarks/readme_results.py --check                            # exit 1 if they differ

Each row runs its README command once per seed (as a whole process, in a fresh workdir under
--workdir, default a temp folder), reads the run's own summary.json, and records what it
measured (the figures, wall time of the whole process, date, cores, load average at the start)
in benchmarks/results/readme_results.json. The README table between the `results:` markers is
rendered from that record only (`render_table`); tests/test_readme.py fails when the two differ,
so a figure typed into the README by hand, or a stale one, fails CI.

Rows (ROWS): demo (configs/tiny.py, what `bash scripts/demo.sh` runs), one_step_off (the demo
with rollout.max_staleness=1), lora (configs/tiny_lora.py), mnist (the GRPO-MNIST example; needs
the MNIST files: --mnist_dir), xsum_rouge and xsum_t5 (~30 min each on 2 cores; their data from
--shared_data). A row measured under load says so (its load average is in the table).
"""

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "benchmarks", "results", "readme_results.json")
README = os.path.join(ROOT, "README.md")
BEGIN = "<!-- results: written by benchmarks/readme_results.py from its record; do not edit -->"
END = "<!-- results: end -->"


@dataclasses.dataclass(frozen=True)
class Row:
  title: str  # the table's first column
  command: str  # the README's command for it (second column)
  argv: tuple  # what runs: arguments after `python -m` ({seed}, {workdir}, {mnist_dir} filled)
  kind: str  # grpo | mnist | rouge


ROWS = {
    "demo": Row(
        "CPU demo: 2-digit addition, 0.4M-param decoder, SFT then GRPO",
        "bash scripts/demo.sh",
        ("grpo_jax.main", "--config=configs/tiny.py"),
        "grpo",
    ),
    "one_step_off": Row(
        "the same, one step off (`--config.rollout.max_staleness=1`)",
        "bash scripts/demo.sh --config.rollout.max_staleness=1",
        ("grpo_jax.main", "--config=configs/tiny.py", "--config.rollout.max_staleness=1"),
        "grpo",
    ),
    "lora": Row(
        "the same with GRPO through rank-8 LoRA (base frozen, reference = base)",
        "python -m grpo_jax.main --config=configs/tiny_lora.py",
        ("grpo_jax.main", "--config=configs/tiny_lora.py"),
        "grpo",
    ),
    "moe": Row(
        "the same task with a mixture-of-experts policy: 8 experts per layer, top-2 (0.70M "
        "params, 0.26M active per token)",
        "python -m grpo_jax.main --config=configs/tiny_moe.py",
        ("grpo_jax.main", "--config=configs/tiny_moe.py"),
        "grpo",
    ),
    "tools": Row(
        "CPU tool demo: 3-digit x 2-digit products, a calculator tool (slot engine, rows pause "
        "for it), SFT on traces that call it, then GRPO",
        "python -m grpo_jax.main --config=configs/tiny_tools.py",
        ("grpo_jax.main", "--config=configs/tiny_tools.py"),
        "tools",
    ),
    "tools_off": Row(
        "the same model and budget without the tool (its SFT traces answer directly)",
        "python -m grpo_jax.main --config=configs/tiny_tools.py --config.rollout.tools.names=",
        ("grpo_jax.main", "--config=configs/tiny_tools.py", "--config.rollout.tools.names="),
        "grpo",
    ),
    "mnist": Row(
        "GRPO-MNIST, 784-128-128-10 policy, G=32",
        "python -m grpo_jax.examples.mnist --data_dir=DIR --seed=S",
        ("grpo_jax.examples.mnist", "--data_dir={mnist_dir}"),
        "mnist",
    ),
    "xsum_rouge": Row(
        "XSum summarization, 2-layer model from scratch, Qwen2 BPE, SFT then GRPO (ROUGE + length)",
        "python -m grpo_jax.main --config=configs/xsum_rouge.py",
        ("grpo_jax.main", "--config=configs/xsum_rouge.py"),
        "rouge",
    ),
    "xsum_t5": Row(
        "XSum summarization, small T5 encoder-decoder from scratch, SFT (300 steps) then GRPO "
        "(40 steps)",
        "python -m grpo_jax.main --config=configs/xsum_t5.py",
        ("grpo_jax.main", "--config=configs/xsum_t5.py"),
        "rouge",
    ),
}


# ------------------------------------------------------------------------------ measuring


def measure(row_id: str, seed: int, workdir: str, mnist_dir: str) -> dict:
  """One run of a row's command (a whole process) -> its recorded figures."""
  row = ROWS[row_id]
  argv = [a.format(mnist_dir=mnist_dir) for a in row.argv]
  seed_flag = "--seed" if row.kind == "mnist" else "--config.seed"
  cmd = [sys.executable, "-m", *argv, f"{seed_flag}={seed}", f"--workdir={workdir}"]
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it
  start = time.perf_counter()
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if r.returncode:
    raise SystemExit(f"{row_id} seed {seed} failed ({r.returncode}):\n{r.stderr[-3000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  out = dict(seed=seed, wall_sec=round(wall, 1))
  if row.kind == "mnist":
    acc = [e["heldout_accuracy"] for e in summary["epochs"]]
    out.update(
        heldout_accuracy=summary["heldout_accuracy"],
        epochs=len(acc),
        first_epoch_95=next((i + 1 for i, a in enumerate(acc) if a >= 0.95), None),
    )
    return out
  metrics = ("accuracy",) if row.kind in ("grpo", "tools") else ("rouge1", "rouge2", "rougeL")
  for when in ("eval_initial", "eval_before", "eval_after"):
    if when in summary:
      out[when] = {m: summary[when]["greedy"][m] for m in metrics}
  if row.kind == "tools":  # the rows' tool use at the first and the last logged GRPO step
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      logged = [json.loads(line) for line in f if "tool_call/calls" in line]
    for when, m in (("first_step", logged[0]), ("last_step", logged[-1])):
      calls = max(1.0, m["tool_call/calls"])
      out[when] = dict(
          calls_per_row=m["tool_call/turns_per_row"] - 1,
          error_rate=round(m["tool_call/errors"] / calls, 4),
      )
  return out


def record_rows(row_ids, seeds, workdir, mnist_dir):
  record = load_record()
  for row_id in row_ids:
    load = os.getloadavg()[0]
    runs = []
    for seed in seeds:
      wd = os.path.join(workdir, f"{row_id}-seed{seed}")
      print(f"[readme_results] {row_id} seed {seed} -> {wd}", flush=True)
      runs.append(measure(row_id, seed, wd, mnist_dir))
      print(f"[readme_results]   {runs[-1]}", flush=True)
    record[row_id] = dict(
        measured=datetime.date.today().isoformat(),
        cpus=os.cpu_count(),
        load_at_start=round(load, 1),
        load_at_end=round(os.getloadavg()[0], 1),
        runs=runs,
    )
    save_record(record)  # each row as soon as it is measured
  return record


def load_record() -> dict:
  if not os.path.exists(RECORD):
    return {}
  with open(RECORD) as f:
    return json.load(f)


def save_record(record: dict):
  os.makedirs(os.path.dirname(RECORD), exist_ok=True)
  with open(RECORD, "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
    f.write("\n")


# ------------------------------------------------------------------------------ rendering


def _seeds(runs) -> str:
  return "/".join(str(r["seed"]) for r in runs)


def _figures(row: Row, runs: list) -> str:
  if row.kind == "mnist":
    accs = " / ".join(f"{100 * r['heldout_accuracy']:.2f}" for r in runs)
    first = "/".join(str(r["first_epoch_95"]) for r in runs)
    return f"{accs}% (seeds {_seeds(runs)}, {runs[0]['epochs']} epochs; 95% first at epoch {first})"
  if row.kind in ("grpo", "tools"):
    pairs = " / ".join(
        f"{r['eval_before']['accuracy']:.3f} -> {r['eval_after']['accuracy']:.3f}" for r in runs
    )
    text = f"greedy accuracy after SFT -> after GRPO {pairs} (seeds {_seeds(runs)})"
    if row.kind == "tools":
      use = " / ".join(
          f"{r['first_step']['calls_per_row']:.2f} -> {r['last_step']['calls_per_row']:.2f}"
          for r in runs
      )
      err = " / ".join(
          f"{100 * r['first_step']['error_rate']:.1f}% -> {100 * r['last_step']['error_rate']:.1f}%"
          for r in runs
      )
      text += f"; tool calls per row, first -> last GRPO step {use}; calls that erred {err}"
    return text
  r = runs[0]  # rouge rows: one seed
  parts = ", ".join(
      f"{name} {r['eval_before'][m]:.4g} -> {r['eval_after'][m]:.4g}"
      for name, m in (("ROUGE-1", "rouge1"), ("ROUGE-2", "rouge2"), ("ROUGE-L", "rougeL"))
  )
  initial = r.get("eval_initial", {}).get("rouge1")
  before = f"; ROUGE-1 {initial:.4g} before SFT" if initial is not None else ""
  return f"after SFT -> after GRPO: {parts} (seed {r['seed']}{before})"


def _wall(entry: dict) -> str:
  walls = [r["wall_sec"] for r in entry["runs"]]
  span = f"{min(walls):.0f} s" if len(walls) == 1 else f"{min(walls):.0f}-{max(walls):.0f} s"
  if "note" in entry:  # a row carried over from before this script, not re-measured by it
    return f"{span} per run ({entry['note']})"
  load = f"load {entry['load_at_start']} at start"
  if "load_at_end" in entry:
    load += f", {entry['load_at_end']} at end"
  if "load_note" in entry:  # what else ran on the machine meanwhile
    load += f"; {entry['load_note']}"
  return f"{span} per run ({entry['measured']}, {entry['cpus']} cores, {load})"


def render_table(record: dict) -> str:
  lines = [
      BEGIN,
      "| example | command | held-out figures | wall time (whole process) |",
      "|---|---|---|---|",
  ]
  for row_id, row in ROWS.items():
    if row_id not in record:
      continue
    entry = record[row_id]
    lines.append(
        f"| {row.title} | `{row.command}` | {_figures(row, entry['runs'])} | {_wall(entry)} |"
    )
  lines.append(END)
  return "\n".join(lines)


def readme_with_table(readme: str, record: dict) -> str:
  if BEGIN not in readme or END not in readme:
    raise SystemExit(f"README.md has no results markers ({BEGIN!r} ... {END!r})")
  head, rest = readme.split(BEGIN, 1)
  _, tail = rest.split(END, 1)
  return head + render_table(record) + tail


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="", help=f"comma-separated, of {','.join(ROWS)}")
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--workdir", default="", help="runs go here (default: a temp folder)")
  p.add_argument(
      "--mnist_dir",
      default=os.path.join(ROOT, "..", "shared", "data", "mnist"),
      help="the MNIST idx files (grpo_jax/examples/mnist.py)",
  )
  p.add_argument("--write", action="store_true", help="rewrite README.md's table")
  p.add_argument("--check", action="store_true", help="exit 1 if README.md's table is stale")
  args = p.parse_args(argv)
  rows = [r for r in args.rows.split(",") if r]
  unknown = [r for r in rows if r not in ROWS]
  if unknown:
    p.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
  record = load_record()
  if rows:
    workdir = args.workdir or tempfile.mkdtemp(prefix="readme_results_")
    seeds = [int(s) for s in args.seeds.split(",")]
    record = record_rows(rows, seeds, workdir, args.mnist_dir)
  with open(README) as f:
    readme = f.read()
  want = readme_with_table(readme, record)
  if args.check:
    if want != readme:
      print(
          "README.md's results table differs from benchmarks/results/readme_results.json. "
          "Fix: python benchmarks/readme_results.py --write",
          file=sys.stderr,
      )
      sys.exit(1)
    print("README.md's results table matches the record")
    return
  if rows or args.write:
    with open(README, "w") as f:
      f.write(want)
    print(render_table(record))


if __name__ == "__main__":
  main()
