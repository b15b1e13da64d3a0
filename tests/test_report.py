"""grpo_jax.report: plots and report.md from a real 2-step run, two runs overlaid (through the
command line), a run in progress (metrics.jsonl only, a cut-back resume, a half-written line),
and a gs:// workdir."""

import json
import os
import re
import subprocess
import sys

import pytest

from configs import tiny
from grpo_jax.run import paths
from grpo_jax import report
from grpo_jax import train
from tests.test_train import ROOT
from tests.test_train import tiny_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def image_links(md: str) -> list[str]:
  return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def assert_pngs(folder, names):
  for name in names:
    data = paths.read_bytes(paths.path(folder) / name)
    assert data.startswith(PNG_MAGIC) and len(data) > 1000, name


def eval_result(accuracy: float, n: int = 16) -> dict:
  return {
      "accuracy": accuracy,
      "partial_accuracy": accuracy / 2,
      "format_accuracy": 0.9,
      "num_examples": n,
  }


def write_run(
    workdir,
    *,
    lr: float,
    before: float,
    after: float,
    sft_steps=20,
    steps=60,
    summary=True,
    config=True,
):
  """A synthetic finished run (SFT, then GRPO with an eval half way), no training."""
  rows = [
      {"step": s, "sft/loss": 2.0 / s, "sft/validation_accuracy": s / 100}
      for s in range(1, sft_steps + 1)
  ]
  for s in range(1, steps + 1):
    rows.append(
        {
            "step": s,
            "reward/total": after * s / steps,
            "reward/answer_match": 0.5,
            "reward/answer_format": 0.1,
            "reward/zero_std_group_fraction": 0.2,
            "completions/mean_length": 40.0 + s,
            "completions/truncated_fraction": 0.05,
            "loss/kl_divergence": 1e-3 * s,
            "loss/clip_fraction": 0.02,
            "loss/clip_fraction_low": 0.01,
            "loss/clip_fraction_high": 0.01,
            "loss/total": 0.1,
            "loss/policy_loss": 0.1,
            "loss/grad_norm": "nan",
            "perf/rollout_sec": 2.0,
            "perf/reward_sec": 0.25,
            "perf/update_sec": 1.0,
            "perf/step_time_sec": 3.5 + (10 if s == 1 else 0),
        }
    )
  evals = {
      0: 0.0,
      sft_steps: before,
      sft_steps + steps // 2: (before + after) / 2,
      sft_steps + steps: after,
  }
  for s, a in evals.items():  # evaluate.as_scalars: greedy also under the plain names
    scalars = {k: v for k, v in eval_result(a).items() if k != "num_examples"}
    rows.append(
        {
            "step": s,
            **{f"eval/{k}/greedy": v for k, v in scalars.items()},
            **{f"eval/{k}": v for k, v in scalars.items()},
        }
    )
  paths.write_atomic(f"{workdir}/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
  if summary:
    paths.write_atomic(
        f"{workdir}/summary.json",
        json.dumps(
            {
                "final_step": steps,
                "wall_time_sec": 321.0,
                "sft_steps": sft_steps,
                "eval_initial": {"greedy": eval_result(0.0)},
                "eval_before": {"greedy": eval_result(before)},
                "eval_after": {"greedy": eval_result(after)},
                "eval_history": [
                    {"step": steps // 2, "eval": {"greedy": eval_result((before + after) / 2)}}
                ],
            }
        ),
    )
  if config:
    c = tiny.get_config()
    c.sft_steps, c.num_steps, c.optimizer.learning_rate = sft_steps, steps, lr
    paths.write_atomic(f"{workdir}/config.json", c.to_json_best_effort(indent=2))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("report") / "tiny")
  train.run(tiny_config(num_steps=2, report_at_end=True, **{"rollout.temperature": 0.7}), workdir)
  return workdir


def test_report_of_a_real_two_step_run(tiny_run):
  assert os.path.exists(f"{tiny_run}/report/report.md")  # written by the loop (report_at_end)
  md_path = report.write_report(tiny_run)
  assert md_path == os.path.join(tiny_run, "report", "report.md")
  md = open(md_path).read()
  summary = json.load(open(os.path.join(tiny_run, "summary.json")))
  assert "finished: 2 GRPO steps" in md
  for generation, after in summary["eval_after"].items():  # the table holds summary.json's numbers
    before, n = summary["eval_before"][generation], after["num_examples"]
    for metric in (m for m in after if m != "num_examples"):
      assert (
          f"| {generation} (n={n}) | {metric} | {before[metric]:.3f} | {after[metric]:.3f} | "
          f"{after[metric] - before[metric]:+.3f} |"
      ) in md
  links = image_links(md)
  assert {
      "reward.png",
      "eval.png",
      "kl.png",
      "clip.png",
      "length.png",
      "loss.png",
      "step_time.png",
  } <= set(links)
  assert_pngs(os.path.dirname(md_path), links)
  # The config: what differs from common.base(), and from the closest shipped config.
  assert "| `rollout.temperature` | 0.9 | 0.7 |" in md
  assert "closest shipped config `configs/tiny.py`" in md and "`rollout.temperature`=0.7" in md


def test_two_runs_overlaid_from_the_command_line(tmp_path):
  a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "cmp"
  write_run(a, lr=5e-4, before=0.25, after=0.75)
  write_run(b, lr=1e-3, before=0.25, after=0.5625)
  # b also reports another metric under another generation config (an evaluation per task)
  with open(b / "metrics.jsonl", "a") as f:
    f.write(json.dumps({"step": 80, "eval/pass@4/standard": 0.875}) + "\n")
  subprocess.run(
      [sys.executable, "-m", "grpo_jax.report", f"--workdir={a},{b}", f"--out={out}"],
      check=True,
      cwd=ROOT,
      capture_output=True,
      timeout=120,
  )
  md = (out / "report.md").read_text()
  assert "# GRPO report: a, b" in md
  assert "| a | greedy (n=16) | accuracy | 0.250 | 0.750 | +0.500 |" in md
  assert "| b | greedy (n=16) | accuracy | 0.250 | 0.562 | +0.312 |" in md
  assert "| **optimizer.learning_rate** | 3e-06 | 0.0005 | 0.001 |" in md  # the runs differ
  assert "| `sft_steps` | 0 | 20 | 20 |" in md  # the same in both
  links = image_links(md)
  assert {"reward.png", "eval.png", "sft.png", "step_time.png"} <= set(links)
  assert_pngs(out, links)
  assert not (a / "report").exists()  # --out, not the first workdir
  evals = report.eval_series(report.load_run(str(b), "b"))
  assert set(evals) == {"accuracy", "partial_accuracy", "format_accuracy", "pass@4"}
  assert list(evals["pass@4"]) == ["standard"]


def test_run_in_progress(tmp_path):
  """metrics.jsonl only: a resumed run logged steps 6-7 again (the last value counts) and the
  last line is half written."""
  write_run(
      tmp_path, lr=1e-3, before=0.25, after=0.5, sft_steps=0, steps=7, summary=False, config=False
  )
  with open(tmp_path / "metrics.jsonl", "a") as f:
    for s in (6, 7):
      f.write(json.dumps({"step": s, "reward/total": 1.0 + s, "perf/step_time_sec": 3.0}) + "\n")
    f.write('{"step": 8, "reward/to')
  run = report.load_run(str(tmp_path), "run")
  steps, values = run.series["reward/total"]
  assert steps.tolist() == list(range(1, 8)) and values[-2:].tolist() == [7.0, 8.0]
  md = open(report.write_report(str(tmp_path))).read()
  assert "`): run in progress: GRPO step 7\n" in md
  # No summary.json: the table comes from the evaluations metrics.jsonl holds.
  assert "| generation | metric | before GRPO | latest (step 7) | change |" in md
  assert "| greedy | accuracy | 0.250 | 0.500 | +0.250 |" in md
  assert "No config.json in the workdir." in md
  links = image_links(md)
  assert {"reward.png", "eval.png", "step_time.png"} <= set(links)
  assert_pngs(tmp_path / "report", links)


def test_a_folder_that_is_no_run_is_one_error_line(tmp_path):
  """A folder a run never wrote (no config.json, no metrics.jsonl: a typo'd or parent folder)
  is an error naming it, not a report of nothing written into it."""
  (tmp_path / "notes.txt").write_text("x")
  r = subprocess.run(
      [sys.executable, "-m", "grpo_jax.report", f"--workdir={tmp_path}"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 1
  assert r.stderr.strip().splitlines() == [
      f"error: --workdir={tmp_path} holds neither config.json nor metrics.jsonl: not a training "
      "run's folder. Fix: name the --workdir a run wrote (the demo's: runs/tiny-<date>-<time>)"
  ]
  assert not (tmp_path / "report").exists()


def test_gcs_workdir(gcs):
  workdir = f"{gcs}/runs/r1"
  write_run(workdir, lr=1e-3, before=0.125, after=0.375)
  rows = [json.loads(line) for line in paths.read_text(f"{workdir}/metrics.jsonl").splitlines()]
  paths.write_atomic(
      f"{workdir}/metrics.jsonl",
      "".join(  # two plots are enough here
          json.dumps({k: v for k, v in r.items() if k in ("step", "reward/total") or "eval/" in k})
          + "\n"
          for r in rows
      ),
  )
  md_path = report.write_report(workdir)
  assert md_path == f"{workdir}/report/report.md"
  md = paths.read_text(md_path)
  assert "| greedy (n=16) | accuracy | 0.000 | 0.125 | 0.375 | +0.250 |" in md  # initial too
  assert image_links(md) == ["reward.png", "eval.png"]
  assert_pngs(f"{workdir}/report", image_links(md))


def test_tool_call_and_error_rates_first_and_last_steps(tmp_path):
  """A run that called tools: the report's tool table holds the call and error rates of its
  first and last tenth of GRPO steps (errors / calls summed over the span, per tool too)."""
  rows = []
  for s in range(1, 21):
    calls, errors = 10.0 * s, float(s < 10) * s  # errors stop after step 9
    rows.append(
        {
            "step": s,
            "tool_call/row_fraction": s / 20,
            "tool_call/calls": calls,
            "tool_call/errors": errors,
            "tool_call/calculator/calls": calls,
            "tool_call/calculator/errors": errors,
        }
    )
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  lines = report.tool_table([report.load_run(str(tmp_path), "t")])
  by = {line.split(" | ")[1]: line.split(" | ")[2:4] for line in lines[2:]}
  assert by["rows that called a tool"] == ["0.075", "0.975"]  # steps 1-2 vs 19-20
  assert by["error rate (errors / calls)"] == ["0.100", "0.000"]  # (1 + 2) / (10 + 20)
  assert by["calculator: error rate"] == ["0.100", "0.000"]
  md = open(report.write_report(str(tmp_path))).read()
  assert "## Tool calls: first / last GRPO steps" in md
  assert report.tool_table([report.load_run(str(tmp_path / "none"), "x")]) == []
