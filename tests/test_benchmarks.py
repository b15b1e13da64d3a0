"""The benchmark scripts run and report sane figures (speed targets are in the printouts, not here)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax.rl import row_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # suite time; benchmarks/grpo_step.py --quick below runs the same sampler
def test_rollout_benchmark_quick(tmp_path):
  out = tmp_path / "bench.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one real CPU device, as a user runs it
  r = subprocess.run(
      [
          sys.executable,
          "benchmarks/rollout.py",
          "--quick",
          "--no_transformers",
          "--no_vllm",
          "--batch=4",
          "--generations=4",
          f"--json={out}",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())["results"][0]
  assert res["model"] == "tiny" and res["ours_tok_s"] > 0
  assert min(res["prefill_g1_ms"], res["prefill_shared_ms"], res["naive_prefill_ms"]) > 0
  assert "ours tok/s" in r.stdout


def test_grpo_step_benchmark_quick(tmp_path):
  out = tmp_path / "step.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one real CPU device, as a user runs it
  r = subprocess.run(
      [sys.executable, "benchmarks/grpo_step.py", "--quick", "--no_tunix", f"--json={out}"],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())["results"][0]
  assert res["workload"] == "tiny" and res["rows"] == 32 * 8
  # The loop's phases of this config (beta 0, on-policy native engine: no log-prob passes).
  assert set(res["phases"]) == {
      "prompts",
      "rollout",
      "rewards",
      "advantages",
      "update",
      "log",
      "step",
  }
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


def _accelerator(tmp_path, *flags):
  out = tmp_path / "accel.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one real CPU device, as the GPU run has one device
  r = subprocess.run(
      [
          sys.executable,
          "benchmarks/accelerator.py",
          f"--json={out}",
          f"--out={tmp_path / 'out'}",
          *flags,
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return json.loads(out.read_text()), r.stdout


@pytest.mark.slow  # suite time (~35 s): every section of a GPU benchmark on CPU
def test_accelerator_benchmark_quick(tmp_path):
  """benchmarks/accelerator.py --quick: every section's code path on a tiny model (CPU)."""
  res, stdout = _accelerator(tmp_path, "--quick", "--compile_workers=2")
  assert res["meta"]["quick"] and res["meta"]["platform"] == "cpu"
  loop_data = os.path.isdir(os.path.join(ROOT, ".gpudata", "gsm8k")) or os.path.isdir(
      os.path.join(ROOT, "..", "shared", "data", "gsm8k")
  )
  for name in ("ceilings", "sampler", "exactness", "transformers", "update", "loop"):
    if name == "loop" and not loop_data:
      assert res[name]["status"] == "failed" and "FileNotFoundError" in res[name]["error"]
      continue
    assert res[name]["status"] == "ok", (name, res[name])
    assert f"-- section {name}: " in stdout
  c = res["ceilings"]
  assert c["matmul_bf16_tflops"] > 0 and c["hbm_tb_s"] > 0
  s = res["sampler"]
  runs = s["runs"]
  assert set(runs) == {
      "bf16/recipe",
      "bf16/recipe/prefill",
      "bf16/full_vocab",
      "bf16/recipe/graphs",
      "f32/recipe",
  }
  w = s["workload"]
  for name in ("bf16/recipe", "bf16/full_vocab", "bf16/recipe/graphs", "f32/recipe"):
    r = runs[name]
    assert r["tokens"] == w["rows"] * w["new_tokens"] and r["tok_s"] > 0
    assert r["decode_step_ms"] > 0 and r["roofline_step_ms"] > 0 and r["roofline_fraction"] > 0
  assert runs["bf16/recipe/prefill"]["tokens"] == w["rows"]
  assert (
      s["roofline"]["weight_gb"] > 0
      and s["roofline"]["kv_alloc_gb"] > s["roofline"]["kv_in_use_gb"] > 0
  )
  assert all(
      s["draw"][g]["ms"] > 0 and s["draw"][g]["of_decode_step"] > 0
      for g in ("recipe", "full_vocab")
  )
  e = res["exactness"]
  # f32 masters, bf16 compute: bf16-sized differences, no more
  assert 0 < e["logprobs"]["mean_abs_diff"] <= e["logprobs"]["max_abs_diff"] < 0.5
  assert 0 <= e["greedy"]["before_first_divergence"] <= 1
  t = res["transformers"]["runs"]
  assert t["full_vocab"]["tok_s"] > 0 and t["full_vocab"]["ours_over_transformers"] > 0
  u = res["update"]["settings"]
  assert len(u) == 3
  for name, r in u.items():
    assert 0 < r["mfu"] <= 1 and r["flops"] > 0 and r["median_s"] > 0, (name, r)
    assert r["memory"]["argument_gib"] > 0
  if loop_data:
    lp = res["loop"]
    assert lp["steps_logged"] == 3 and lp["prompt_widths"] == [128]
    assert lp["first_step_s"] > lp["steady_step_s"] > 0
    assert lp["rollout_tok_s"] > 0 and lp["rollout_of_hbm_roofline"] > 0
    assert {"rollout", "update"} <= set(lp["trace_analysis"]["phases"])
    assert (tmp_path / "out" / "trace_analysis.md").exists()
  summary = res["summary"]
  assert summary["sampler_bf16/recipe_tok_s"] > 0 and "== summary" in stdout


@pytest.mark.slow  # ~30 s: the 8B section's loop on a tiny model
def test_accelerator_loop_8b_quick(tmp_path):
  """loop_8b: configs/qwen3_8b.py's loop with LoRA in a child process; its figures; on CPU the
  memory comparison says why it has no device peak."""
  if not os.path.isdir(os.path.join(ROOT, "..", "shared", "data", "gsm8k")):
    pytest.skip("no ../shared/data/gsm8k")
  res, stdout = _accelerator(tmp_path, "--quick", "--sections=ceilings,loop_8b")
  lp = res["loop_8b"]
  assert lp["status"] == "ok" and lp["steps_logged"] == 3
  assert "--config=configs/qwen3_8b.py" in lp["command"] and "--config.lora.rank=8" in lp["command"]
  assert 0 < lp["update_mfu"] < 1 and lp["update_flops"] > 0
  assert "memory_stats" in lp["memory_vs_plan"]["error"]
  assert res["summary"]["loop_8b_update_mfu"] == lp["update_mfu"]


def test_plan_peak_reads_the_memory_plan_rows():
  """The 8B section's prediction: memory_plan's JSON rows -> the largest program's total."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import accelerator

  rows = json.load(open(os.path.join(ROOT, accelerator.PLAN_8B)))
  got = accelerator.plan_peak_gib(rows)
  assert set(got) == {"logprobs", "sampler", "update", "step"}
  assert got["step"] == max(r["total"] for r in rows) / 2**30
  assert rows[0]["device_kind"].startswith("NVIDIA H200") and rows[0]["num_devices"] == 1


def test_accelerator_benchmark_failures_and_deadline(tmp_path):
  """A failing section is one line and the next one runs; past the deadline sections are
  skipped with a line; the JSON holds both."""
  res, stdout = _accelerator(
      tmp_path, "--quick", "--sections=loop,ceilings", f"--data_dir={tmp_path / 'nothing'}"
  )
  assert res["loop"]["status"] == "failed" and res["ceilings"]["status"] == "ok"
  assert "section loop failed: FileNotFoundError" in stdout
  res, stdout = _accelerator(tmp_path, "--quick", "--sections=1,2", "--deadline_s=0")
  assert res["ceilings"]["status"] == res["sampler"]["status"] == "skipped"
  assert "== section sampler: skipped (deadline" in stdout


_GSM8K = os.path.isdir(os.path.join(ROOT, ".gpudata", "gsm8k")) or os.path.isdir(
    os.path.join(ROOT, "..", "shared", "data", "gsm8k")
)


@pytest.mark.slow  # ~45 s: the two opt-in sections on a tiny model (CPU)
@pytest.mark.skipif(
    not _GSM8K, reason="needs GSM8K and the Qwen tokenizer (.gpudata/ or ../shared/data)"
)
def test_accelerator_packed_and_slots_quick(tmp_path):
  """benchmarks/accelerator.py --quick --sections=ceilings,packed,slots: padded vs packed rows
  (phases, fill, speedup, MFU on real tokens) and the slot engine vs lockstep (tok/s, ratios,
  HBM roofline share), in the JSON and the summary."""
  res, stdout = _accelerator(tmp_path, "--quick", "--sections=ceilings,packed,slots")
  for name in ("ceilings", "packed", "slots"):
    assert res[name]["status"] == "ok", (name, res[name])
  pk = res["packed"]
  assert pk["workload"]["p"] == 16 and pk["workload"]["c"] == 64 and pk["workload"]["rows"] == 8
  for layout in ("padded", "packed"):
    r = pk[layout]
    assert all(r["ms"][ph] > 0 for ph in ("old_lp", "ref_lp", "update", "total")), r
    assert r["rounds"] == 2 and 0 < r["mfu_real"] < 1
    assert pk["compile_round"][layout]["seconds"] > r["ms"]["total"] / 1e3
  assert 0 < pk["fill"]["padded"] < pk["fill"]["packed"] <= 1
  assert pk["speedup"] > 0 and pk["goal"] == pytest.approx(0.8 / pk["fill"]["padded"])
  sl = res["slots"]
  modes = sl["modes"]
  assert set(modes) == {
      "lockstep",
      "streaming slots",
      "streaming slots step graphs",
      "on-policy slots",
      "streaming slots per layer",
      "streaming slots per layer step graphs",
      "lockstep step graphs",
  }
  assert sl["workload"]["slot_scan_layers"] is False  # (CPU: auto = a program per layer)
  for name, m in modes.items():
    assert m["tokens_per_sec"] > 0 and m["first_s"] > m["sec"] and m["of_hbm_roofline"] > 0, name
  assert modes["lockstep"]["vs_lockstep"] == 1
  assert modes["streaming slots"]["busy"] > sl["workload"]["lockstep_fill"]
  s = res["summary"]
  assert s["packed_speedup"] > 0 and s["slots_streaming_slots_vs_lockstep"] > 0
  assert "speedup padded / packed" in stdout and "lockstep's tok/s" in stdout


def test_accelerator_packed_and_slots_without_data(tmp_path):
  """Without GSM8K both opt-in sections fail with one clear line; the next section runs."""
  res, stdout = _accelerator(
      tmp_path, "--quick", "--sections=packed,slots,ceilings", f"--data_dir={tmp_path / 'none'}"
  )
  for name in ("packed", "slots"):
    assert res[name]["status"] == "failed" and "FileNotFoundError" in res[name]["error"]
    assert f"section {name} failed: FileNotFoundError: GSM8K" in stdout
  assert res["ceilings"]["status"] == "ok"


@pytest.mark.slow  # ~2 min: four 2-process / 8-device runs of the loop
def test_overlap_benchmark_quick(tmp_path):
  """benchmarks/overlap.py --quick: both placements on both layouts, steps/s and the ratio."""
  out = tmp_path / "overlap.json"
  r = subprocess.run(
      [sys.executable, "benchmarks/overlap.py", "--quick", "--completion=16", f"--json={out}"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  for layout in ("pair", "single"):
    assert res[f"{layout}/colocated"]["steps_per_sec"] > 0
    assert res[f"{layout}/disaggregated+1"]["perf/weight_sync_sec"] > 0
    assert res[f"{layout}/ratio"] > 0


def test_weight_transfer_benchmark_runs():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  r = subprocess.run(
      [sys.executable, "benchmarks/weight_transfer.py", "--mb=4", "--repeats=2"],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "GB/s" in r.stdout


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(ROOT, "..", "shared", "data", "gsm8k")),
    reason="needs ../shared/data (GSM8K and the Qwen tokenizer)",
)
def test_packed_update_benchmark_quick(tmp_path):
  """benchmarks/packed_update.py --quick (~15 s): fills, FLOPs ratios and both layouts timed."""
  out = tmp_path / "packed.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one real CPU device, as a user runs it
  r = subprocess.run(
      [sys.executable, "benchmarks/packed_update.py", "--quick", f"--json={out}"],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(out.read_text())
  for f in list(res["recipe"].values()) + [res["timing"]["fill"]]:
    assert 0 < f["padded"] <= f["packed"] <= 1, f
  one_chip = res["recipe"]["one chip, one micro-batch"]
  assert one_chip["packed"] > 2 * one_chip["padded"]  # long-tailed: most slots are padding
  for name, f in res["flops"].items():
    assert 0 < f["padded"] < 1 and 0 < f["packed_head_every_slot"] <= f["packed"] < 1, name
    # the masked form computes every [S, S] score; the segment kernels skip whole tiles
    assert f["packed_masked"] <= min(f["packed"], f["packed_tpu"]), name
  # The segment kernels' tile count (`packed_tiles`) on a hand-made plan: one row of 8 slots,
  # sequences of 3 and 5 tokens, 2 x 2 tiles: q tiles 0-1 start at 0 (kv tiles 0..0, 0..1),
  # q tile 2's sequence starts at 3 (kv tile 1..2), q tile 3 (1..3): 1 + 2 + 2 + 3 = 8 tiles.
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import packed_update  # pylint: disable=import-outside-toplevel

  bt = packed_update.Batch(np.array([1, 1]), np.array([2, 4]), width=1, c=7)
  plan = row_plan.Plan(np.array([0, 0]), np.array([0, 3]), 1, 1, 1, 1, 1.0)
  assert packed_update.packed_tiles(bt, plan, 8, 2, 2) == 8
  assert packed_update.causal_tiles(8, 2, 2) == 1 + 2 + 3 + 4
  # one shard, one micro-batch: the plan is fewest_rows' rows bucketed, and buckets only add rows
  assert one_chip["packed"] <= one_chip["fewest"] + 1e-9, one_chip
  assert one_chip["ffd"] <= one_chip["fewest"] + 1e-9, one_chip  # the search never adds a row
  t = res["timing"]
  assert t["padded"]["pack"] < t["packed"]["pack"]  # the padded rows are not moved
  for layout in ("padded", "packed"):
    assert all(t[layout][ph] > 0 for ph in ("old_lp", "ref_lp", "update")), t[layout]
  assert t["speedup"] > 1 and t["packed_rows"] and max(t["packed_rows"]) < t["rows"]
  assert 0 < max(t["head_rows"]) <= max(t["packed_rows"])  # the LM head on completions only
  assert "speedup padded / packed" in r.stdout


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(ROOT, "..", "shared", "data", "gsm8k")),
    reason="needs ../shared/data (GSM8K and the Qwen tokenizer)",
)
@pytest.mark.slow  # suite time (~70 s: seven engine modes, each compiled, and the uniform batch)
def test_slot_engine_benchmark_quick(tmp_path):
  """benchmarks/slot_engine.py --quick (~50 s): every mode produced the batch's lengths (the
  script asserts it), with admission between chunks and inside the decode; the streaming
  slots were busier than lockstep's rows were useful."""
  res = _quick_run("benchmarks/slot_engine.py", tmp_path)
  modes = res["modes"]
  slot_modes = {"on-policy slots", "streaming slots", "streaming 2x slots"}
  inside = {m + " +admit in decode" for m in slot_modes}
  assert set(modes) == {"lockstep"} | slot_modes | inside
  assert 0 < res["lockstep_fill"] < 0.5  # long-tailed: most lockstep row-steps are wasted
  for mode in ("streaming slots", "streaming slots +admit in decode"):
    assert modes[mode]["busy"] > 1.5 * res["lockstep_fill"], mode
  assert {"slots_sec", "slots_inside_sec"} <= set(res["uniform"])
  assert all(m["tokens_per_sec"] > 0 for m in modes.values())


def test_tool_turns_benchmark_quick(tmp_path):
  """benchmarks/tool_turns.py --quick (~30 s): both engines drew the same rows (the script
  asserts it); the live cache prefills the response and one token per append, the baseline
  every row's whole history."""
  res = _quick_run("benchmarks/tool_turns.py", tmp_path)
  assert res["live"]["turns_per_row"] > 2  # the task has several turns per row
  assert res["live"]["prefill_tokens_per_append"] == res["workload"]["response"] + 1
  assert res["reprefill"]["prefill_tokens_per_append"] > 3 * res["workload"]["response"]


def _quick_run(script: str, tmp_path) -> dict:
  """`python SCRIPT --quick --json=OUT` on one real CPU device, as a user runs it -> its JSON."""
  out = tmp_path / "out.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  r = subprocess.run(
      [sys.executable, script, "--quick", f"--json={out}"],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(out.read_text())


def test_packed_tiles_count_what_the_kernels_visit():
  """benchmarks/packed_update.py's issued attention tiles == the kernels' own rule on the
  plan's rows: segment_flash.visited_blocks (GPU) and splash_segments.visited_blocks (TPU, a q
  tile of padding only on its diagonal), rows of padding only included."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import packed_update  # pylint: disable=import-outside-toplevel
  from grpo_jax.models.decoder import segment_flash
  from grpo_jax.models.decoder import splash_segments

  rng = np.random.default_rng(0)
  s = 512
  for _ in range(3):
    bt = packed_update.Batch(np.zeros(12, np.int64), rng.integers(20, 300, 12), width=0, c=s)
    plan = row_plan.plan_rows(bt.seq_n, s, row_plan.MicroBatching(count=2))
    seg = np.zeros((plan.rows, s), np.int32)
    for i, (r, o, n) in enumerate(zip(plan.row_of, plan.offset_of, bt.seq_n)):
      seg[r, o : o + n] = i + 1
    assert packed_update.packed_tiles(bt, plan, s, 64, 64) == segment_flash.visited_blocks(
        seg, 64, 64
    )
    tpu = sum(
        int(
            np.asarray(
                splash_segments.visited_blocks(row, tp=s, bq=128, bk=128, window=None)[0]
            ).sum()
        )
        for row in seg
    )
    assert packed_update.packed_tiles(bt, plan, s, 128, 128, padding_diagonal=True) == tpu


def test_streaming_loop_reads_the_settled_rate_from_a_log():
  """benchmarks/streaming_loop.py `settled`: the steps logged at or after a new packed shape's
  line are the compiles; the rate after the last of them; the median of the other intervals."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import streaming_loop  # pylint: disable=import-outside-toplevel

  lines, t = [], 0.0
  for step in range(1, 21):
    if step in (3, 7):  # a compile of 8 s inside these steps
      lines.append(f"I1128 10:00:{t + 0.5:09.6f} 1 packing.py:568] ... packed shapes so far: 2")
      t += 8.0
    t += 1.0 if step < 7 else 0.5
    lines.append(f"I1128 10:00:{t:09.6f} 1 train.py:1] [grpo] step {step}/20 loss 0.1")
  r = streaming_loop.settled("\n".join(lines))
  assert r["compile_steps"] == [3, 7] and r["settled_from"] == 7
  assert r["settled_steps_per_sec"] == pytest.approx(2.0)  # 0.5 s a step after step 7
  assert r["median_interval"] == pytest.approx(0.5)  # 17 quiet intervals: 4 of 1 s, 13 of 0.5 s
  assert r["whole_steps_per_sec"] == pytest.approx(19 / (t - 1.0))
