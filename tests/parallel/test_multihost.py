"""Two JAX processes (jax.distributed over 127.0.0.1, 4 fake CPU devices each) == one process
with 8: SFT warm start, GRPO steps, checkpoints, a clean stop on the step budget, a hard kill
(SIGKILL of both processes mid-run) and the resume give the same losses, rewards and final
parameters as one uninterrupted single-process run.

The two-process job's workdir is gs://bucket/pair on an offline GCS emulator
(tests/fake_gcs.py, the `gcs` fixture): checkpoints (tensorstore's gcs driver), events, metrics.jsonl and
summary.json go over the same clients as on Google Cloud, and the restarts resume from there."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
from etils import epath
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_STEPS, NUM_STEPS = 10, 6
ARGS = [
    "--config=configs/tiny.py",
    f"--config.sft_steps={SFT_STEPS}",
    "--config.sft.stop_at_accuracy=0",
    f"--config.num_steps={NUM_STEPS}",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=128",
    "--config.eval.num_examples=32",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.save_interval_steps=2",
    # Issue 18's knobs that touch the data and the reference ride along: DAPO dynamic
    # sampling (its choice of groups over extra rounds must not depend on the process
    # count), advantage clipping, a KL term against a reference refreshed every 3 steps.
    "--config.loss.advantage_clip=2.0",
    "--config.loss.dynamic_sampling=True",
    "--config.loss.max_resample_rounds=2",
    "--config.beta=0.02",
    "--config.reference.refresh_every_steps=3",
]
# Final params of the two jobs agree to this. Measured: 1.9e-5 with the knobs above (< 1e-5
# without): the meshes' last-bit gradient differences grow through AdamW's normalized steps
# where gradients are tiny; a real divergence (a skipped or repeated step, other data) moves
# params by ~lr = 5e-4 per step.
PARAM_TOL = 5e-5
# Figures that measure time or memory, not the arithmetic.
_UNTIMED = (
    "perf/",
    "time",
    "_sec",
    "/seconds",
    "memory",
    "eta",
    "throughput",
    "tokens_per_sec",
)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch_pair(workdir, *args, kill_when=None, base=ARGS, local_devices=4):
  """Both processes of a 2-process job -> [(returncode, stderr)] by process id. `kill_when`:
  a predicate polled while they run; when it turns true both get SIGKILL (a hard crash)."""
  port = _free_port()
  env = dict(os.environ, LOCAL_DEVICES=str(local_devices), PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)  # the launcher sets the per-process device count
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
  procs = [
      subprocess.Popen(
          [
              "bash",
              "launch/multihost.sh",
              f"127.0.0.1:{port}",
              "2",
              str(pid),
              "--",
              f"--workdir={workdir}",
              *base,
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
  if kill_when is not None:
    deadline = time.time() + 600
    while any(p.poll() is None for p in procs) and time.time() < deadline:
      if kill_when():
        for p in procs:
          p.send_signal(signal.SIGKILL)
        break
      time.sleep(0.02)
  out = []
  for p, log in zip(procs, logs):
    rc = p.wait(timeout=600)
    log.seek(0)
    out.append((rc, log.read()))
  return out


def _launch_single(workdir, *args, base=ARGS):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  p = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", f"--workdir={workdir}", *base, *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert p.returncode == 0, p.stderr[-3000:]


def _logged(workdir) -> dict[tuple[str, int], dict]:
  """(what, step) -> the figures logged there; what is sft, eval or grpo. The last logging of
  a step wins: a step redone after a crash is logged twice, only the redone one counts."""
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    what = (
        "sft"
        if "sft/loss" in row
        else "grpo"
        if "loss/policy_loss" in row
        else "eval"
        if any(k.startswith("eval/") for k in row)
        else "other"
    )
    out[what, row["step"]] = {
        k: v
        for k, v in row.items()
        if isinstance(v, (int, float)) and not any(u in k for u in _UNTIMED)
    }
  return out


def _final_params(workdir):
  step = max(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  path = workdir / "checkpoints" / str(step) / "state"
  meta = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
  state = ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(restore_args=restore_args)
  )
  return step, state["train"]["params"]


def test_two_processes_equal_one_through_stop_kill_and_resume(tmp_path, gcs):
  single, pair = epath.Path(tmp_path / "single"), epath.Path(gcs) / "pair"
  t0 = time.time()
  _launch_single(single)
  single_sec = time.time() - t0

  # 1. A hard kill of both processes once GRPO step 2's checkpoint is committed. (A clean stop
  # on the step budget and its resume, 2 processes: tests/rollout/test_staleness.py's
  # test_disaggregated_two_processes_equal_one_through_a_resume; with the slot engine:
  # test_slot_engine_two_processes_equal_one_through_a_resume, -m slow.)
  t0 = time.time()
  committed = pair / "checkpoints" / str(SFT_STEPS + 2) / "commit_success.txt"  # GCS: no rename
  killed = _launch_pair(pair, kill_when=committed.exists)
  if all(rc == -signal.SIGKILL for rc, _ in killed):
    assert not (pair / "summary.json").exists()
  else:  # the job outran the poll: it must then have finished cleanly
    assert all(rc == 0 for rc, _ in killed), killed[0][1][-3000:]

  # 2. Restart: resumes from the last committed checkpoint and finishes.
  for rc, err in _launch_pair(pair):
    assert rc == 0, err[-3000:]
    assert "resuming from" in err
  pair_sec = time.time() - t0

  assert not os.path.exists(os.path.join(ROOT, "gs:"))  # no local ./gs:/bucket/... copy
  summaries = [json.loads((d / "summary.json").read_text()) for d in (single, pair)]
  for s in summaries:
    assert s["final_step"] == NUM_STEPS and s["sft_steps"] == SFT_STEPS
  ref, got = _logged(single), _logged(pair)
  assert sorted(ref) == sorted(got)
  assert sorted(s for what, s in ref if what == "grpo") == list(range(1, NUM_STEPS + 1))
  assert sorted(s for what, s in ref if what == "sft") == list(range(1, SFT_STEPS + 1))
  worst = {}
  for step in ref:
    assert set(ref[step]) == set(got[step])
    for k, v in ref[step].items():
      worst[k] = max(worst.get(k, 0.0), abs(v - got[step][k]) / max(1.0, abs(v)))
  assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
  for k in (
      "reward/total",
      "loss/policy_loss",
      "loss/grad_norm",
      "sft/loss",
      "eval/accuracy/greedy",
  ):
    assert k in worst
  assert max(ref[k].get("dynamic_sampling/rounds", 0) for k in ref) > 1  # resampling ran

  (s1, p1), (s2, p2) = _final_params(single), _final_params(pair)
  assert s1 == s2 == SFT_STEPS + NUM_STEPS
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p1, p2)
  assert max(jax.tree.leaves(diffs)) <= PARAM_TOL, diffs
  print(
      f"1x8 {single_sec:.1f}s; 2x4 kill+resume {pair_sec:.1f}s (kill rcs "
      f"{[rc for rc, _ in killed]}); "
      f"max metric diff {max(worst.values()):.2e}; max param diff "
      f"{max(jax.tree.leaves(diffs)):.2e}"
  )


LORA_ARGS = [
    "--config=configs/tiny_lora.py",
    "--config.sft_steps=4",
    "--config.sft.stop_at_accuracy=0",
    "--config.num_steps=3",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=64",
    "--config.eval.num_examples=16",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.save_interval_steps=1",
    "--config.beta=0.05",
]


@pytest.mark.slow  # ~2 min each: LoRA over 2 processes (the default suite runs the full-model pair)
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_lora_two_processes_equal_one_through_a_resume(tmp_path, gcs, placement):
  """LoRA after a full SFT warm start on 2 processes x 4 devices, stopped after one GRPO step
  and resumed (the folded base reloaded from the gs:// workdir's lora_base) == 1 x 8 straight.
  Disaggregated, each process holds one role: the folded base lives on process 0's devices
  only, and its lora_base save and reload go through multihost.savable / placed (before: the
  save refused the array, a config fuzz found it)."""
  single, pair = epath.Path(tmp_path / "single"), epath.Path(gcs) / "pair"
  args = [*LORA_ARGS, f"--config.rollout.placement={placement}"]
  _launch_single(single, base=args)
  for rc, err in _launch_pair(pair, "--config.max_steps_per_run=1", base=args):
    assert rc == 0, err[-3000:]
  for rc, err in _launch_pair(pair, base=args):
    assert rc == 0, err[-3000:]
    assert "resuming from" in err
  ref, got = _logged(single), _logged(pair)
  assert sorted(ref) == sorted(got)
  assert sorted(s for what, s in ref if what == "grpo") == [1, 2, 3]
  for step in ref:
    for k, v in ref[step].items():
      assert abs(v - got[step][k]) <= 1e-5 * max(1.0, abs(v)), (step, k, v, got[step][k])
  assert any(ref[k].get("loss/kl_divergence", 0) > 0 for k in ref)
  (s1, p1), (s2, p2) = _final_params(single), _final_params(pair)
  leaves = jax.tree_util.tree_leaves_with_path(p2)
  assert s1 == s2 and leaves and all("_lora_" in jax.tree_util.keystr(k) for k, _ in leaves)
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p1, p2)
  assert max(jax.tree.leaves(diffs)) <= PARAM_TOL, diffs


TABLE_ARGS = [
    "--config=configs/tiny.py",
    "--config.sft_steps=2",
    "--config.sft.stop_at_accuracy=0",
    "--config.num_steps=2",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=32",
    "--config.data.arithmetic.num_test=16",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
]


@pytest.mark.slow  # ~35 s (suite time): the tables' rows enter the same pipeline as any source's
def test_two_processes_read_table_sources_like_one_reads_the_same_rows(tmp_path):
  """verl's parquet (train) and a TRL-style datasets folder (eval) on 2 processes x 4 devices
  == the arithmetic task's same rows generated in 1 process x 8: each process reads the whole
  table and keeps its rows of every global batch (SFT demonstrations from a column, GRPO, eval)."""
  pytest.importorskip("pyarrow")
  pytest.importorskip("datasets")
  from tests.data import tables_fixtures as fx
  from tests.test_train import tiny_config
  from grpo_jax import data as data_lib

  train_rows, eval_rows = data_lib.load_rows(
      tiny_config(**{"data.arithmetic.num_train": 32, "data.arithmetic.num_test": 16})
  )
  tr = fx.write_parquet(fx.verl_records_from_rows(train_rows), str(tmp_path / "train.parquet"))
  # One column map serves both splits: the eval folder names its fields as the defaults do.
  ev = fx.save_dataset(
      [
          dict(
              prompt=[{"role": "user", "content": r["prompt"]}],
              ground_truth=r["ground_truth"],
              data_source=r["data_source"],
          )
          for r in eval_rows
      ],
      str(tmp_path / "eval_ds"),
  )
  tables = [
      "--config.data.train_source=parquet",
      f"--config.data.train_path={tr}",
      "--config.data.columns.demonstration=extra_info.demonstration",
      "--config.data.eval_source=hf_dataset",
      f"--config.data.eval_path={ev}",
  ]
  single, pair = epath.Path(tmp_path / "single"), epath.Path(tmp_path / "pair")
  _launch_single(single, base=TABLE_ARGS)
  for rc, err in _launch_pair(pair, *tables, base=TABLE_ARGS):
    assert rc == 0, err[-3000:]
  ref, got = _logged(single), _logged(pair)
  assert sorted(ref) == sorted(got)
  assert sorted(s for what, s in ref if what == "grpo") == [1, 2]
  assert sorted(s for what, s in ref if what == "sft") == [1, 2]
  for step in ref:
    for k, v in ref[step].items():
      assert abs(v - got[step][k]) <= 1e-5 * max(1.0, abs(v)), (step, k, v, got[step][k])


SLOT_ARGS = [
    "--config=configs/tiny.py",
    "--config.sft_steps=2",
    "--config.sft.stop_at_accuracy=0",
    "--config.num_steps=3",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=64",
    "--config.eval.num_examples=16",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.save_interval_steps=1",
    # The slot engine (rollout/slots.py) with fewer slots than a step's 32 rows: groups queue
    # and refill freed slots; every process holds every prompt and reads the replicated slot
    # status, so both make the same admissions.
    "--config.rollout.slots=16",
    "--config.rollout.slot_chunk=4",
]


@pytest.mark.slow  # ~2-3 min; the slot engine on 2 processes stays in the default suite
# (test_streaming_slots_disaggregated_two_processes_equal_one) and so does a 2-process
# resume (test_two_processes_equal_one_through_stop_kill_and_resume)
def test_slot_engine_two_processes_equal_one_through_a_resume(tmp_path):
  """~1 min: the slot engine's rollouts, losses and final parameters on 2 processes x 4 devices
  (stopped after one GRPO step and resumed) == one uninterrupted process with 8."""
  single, pair = epath.Path(tmp_path / "single"), epath.Path(tmp_path / "pair")
  _launch_single(single, base=SLOT_ARGS)
  # A clean stop on the step budget after one GRPO step: exit 0 on both processes, no summary.
  for rc, err in _launch_pair(pair, "--config.max_steps_per_run=1", base=SLOT_ARGS):
    assert rc == 0, err[-3000:]
    assert "max_steps_per_run=1 reached" in err
  assert not (pair / "summary.json").exists()
  for rc, err in _launch_pair(pair, base=SLOT_ARGS):
    assert rc == 0, err[-3000:]
    assert "resuming from" in err
  _assert_same_run(single, pair)


PACK_ARGS = [
    "--config=configs/tiny.py",
    "--config.sft_steps=2",
    "--config.sft.stop_at_accuracy=0",
    "--config.num_steps=3",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=64",
    "--config.eval.num_examples=16",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.save_interval_steps=10",
    "--config.beta=0.04",
    # Packed rows (rl/packing.py): every process reads the lengths, makes the same plan and
    # provides its own shards of it; each of the 8 shards packs its 4 sequences. Micro-batches
    # by tokens: one row of P + C = 13 slots per device, as many as the packed rows need.
    "--config.pack_sequences=True",
    "--config.micro_batch_size=0",
    "--config.micro_batch_tokens=104",
]


@pytest.mark.slow  # ~1 min on 2 cores: a single run and a pair
def test_packed_rows_two_processes_equal_one(tmp_path):
  """pack_sequences with micro-batches by tokens on 2 processes x 4 devices == one process
  with 8: the same logged figures and final parameters."""
  single, pair = epath.Path(tmp_path / "single"), epath.Path(tmp_path / "pair")
  _launch_single(single, base=PACK_ARGS)
  for rc, err in _launch_pair(pair, base=PACK_ARGS):
    assert rc == 0, err[-3000:]
    assert "packed rows:" in err
  _assert_same_run(single, pair)


@pytest.mark.parametrize(
    "partial", [False, pytest.param(True, marks=pytest.mark.slow, id="partial_rollout")]
)
def test_streaming_slots_disaggregated_two_processes_equal_one(tmp_path, partial):
  """~1 min: streaming (slots, max_staleness=1) with the sampler on process 1's device and the
  trainer on process 0's == one process holding both devices: the same rewards, losses and
  final parameters (the trainer's process schedules nothing; the sampler's reads its slots).
  partial_rollout: the batches of groups the sampler's process chose, sent to the trainer's."""
  args = [
      *SLOT_ARGS[:-2],
      "--config.rollout.slots=32",
      "--config.rollout.slot_chunk=4",
      "--config.rollout.placement=disaggregated",
      "--config.rollout.max_staleness=1",
      f"--config.rollout.partial_rollout={partial}",
  ]
  single, pair = epath.Path(tmp_path / "single"), epath.Path(tmp_path / "pair")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  p = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", f"--workdir={single}", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  for rc, err in _launch_pair(pair, base=args, local_devices=1):
    assert rc == 0, err[-3000:]
  # Every figure, those of the sampler's process too: process 0 (the trainer's, which writes
  # the metrics) holds no sampler rows; the per-token staleness sums over processes and the
  # slots' busy fraction comes from the sampler's (before: missing from the pair's metrics).
  _assert_same_run(single, pair)


TOOL_SFT = 60
TOOL_ARGS = [
    "--config=configs/tiny_tools.py",
    f"--config.sft_steps={TOOL_SFT}",  # enough for the policy to call the calculator
    "--config.num_steps=3",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=512",
    "--config.eval.num_examples=16",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.save_interval_steps=1",
    "--config.rollout.slots=16",  # fewer than the 32 rows: paused rows hold slots others wait for
    "--config.rollout.slot_chunk=4",
    "--config.report_at_end=False",
    # Rewards that vary within every group (the exact answer is still rare after 60 SFT
    # steps), so each step updates the weights.
    f"--config.reward.custom_file={os.path.join(ROOT, 'tests', 'data', 'digit_count_reward.py')}",
]


def _eval_logged(workdir, step) -> bool:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return False
  text = path.read_text()
  return f'{{"step": {step}, "eval/' in text


@pytest.mark.slow
def test_tool_turns_two_processes_equal_one_through_a_kill_mid_episode(tmp_path):
  """~3 min: multi-turn rows with the calculator on 2 processes x 4 devices, SIGKILLed once
  the GRPO step's rollout has started (after the eval that precedes it: rows mid-episode,
  tool calls in flight) and resumed from the SFT checkpoint == one uninterrupted process with
  8 devices: the same rollouts (tool calls included), rewards, update figures, evals and final
  parameters. The first process runs the tools and sends the responses to the other
  (SlotEngine._agree), so both append the same tokens.

  One GRPO step: later steps of 2 x 4 runs part from 1 x 8 (and from each other) by last
  bits (the processes' gradient sums), and over ~2,000 sampled tokens a step a draw can flip."""
  args = [*TOOL_ARGS, "--config.num_steps=1"]
  single, pair = epath.Path(tmp_path / "single"), epath.Path(tmp_path / "pair")
  _launch_single(single, base=args)
  _launch_pair(pair, base=args, kill_when=lambda: _eval_logged(pair, TOOL_SFT))
  assert not (pair / "summary.json").exists(), "the kill came after the run ended"
  for rc, err in _launch_pair(pair, base=args):
    assert rc == 0, err[-3000:]
  calls = [row.get("tool_call/calls", 0) for row in _logged(single).values()]
  assert sum(calls) > 0, "no tool was called: the test would prove nothing"
  # Every logged figure (rewards, tool calls, loss, grad norm, evals) to 1e-5. The parameters:
  # 60 AdamW SFT steps at lr 1e-3 turn the meshes' last-bit gradient differences into up to
  # ~4e-4 where gradients are near zero (measured); a lost or repeated step moves them by ~lr.
  _assert_same_run(single, pair, param_tol=1e-3)


@pytest.mark.slow
def test_vllm_tool_turns_on_two_processes(tmp_path):
  """~70 s: rollout.engine=vllm with the calculator on 2 processes x 1 device. Each process
  boots its own vLLM (on its own copy of the weights), samples its own rows and runs their
  tools; the logged tool figures are the sums over both (one call per row: ~32 a step), the
  log-probs the trainer's."""
  from tests.conftest import vllm_unusable

  if vllm_unusable():
    pytest.skip(vllm_unusable())
  os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
  pair = epath.Path(tmp_path / "pair")
  args = [
      "--config=configs/tiny_tools.py",
      "--config.sft_steps=150",
      "--config.num_steps=2",
      "--config.batch_size=8",
      "--config.num_generations=4",
      "--config.eval.num_examples=16",
      "--config.eval.batch_size=16",
      "--config.log_interval_steps=1",
      "--config.report_at_end=False",
      "--config.rollout.engine=vllm",
      "--config.rollout.slots=0",
      "--config.rollout.max_logprob_gap=0.5",
  ]
  for rc, err in _launch_pair(pair, base=args, local_devices=1):
    assert rc == 0, err[-3000:]
  steps = [row for (what, _), row in sorted(_logged(pair).items()) if what == "grpo"]
  assert len(steps) == 2
  for row in steps:
    assert 26 <= row["tool_call/calls"] <= 32  # 32 rows over both processes, not 16 of one
    assert row["tool_call/turns_per_row"] > 1.5
    assert row["rollout/logprob_abs_diff_max"] <= 1e-4


def _assert_same_run(single, pair, param_tol=PARAM_TOL):
  """Both runs logged the same figures at every step, agreeing to 1e-5 (relative above 1),
  and the final parameters agree to PARAM_TOL."""
  ref, got = _logged(single), _logged(pair)
  assert sorted(ref) == sorted(got)
  for step in ref:
    assert set(ref[step]) == set(got[step]), (step, set(ref[step]) ^ set(got[step]))
    for k, v in ref[step].items():
      assert abs(v - got[step][k]) <= 1e-5 * max(1.0, abs(v)), (step, k, v, got[step][k])
  assert any("reward/total" in row for row in ref.values())
  (s1, p1), (s2, p2) = _final_params(single), _final_params(pair)
  assert s1 == s2
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p1, p2)
  assert max(jax.tree.leaves(diffs)) <= param_tol, diffs


MOE_SFT = 10
MOE_ARGS = [
    "--config=configs/tiny_moe.py",
    f"--config.sft_steps={MOE_SFT}",
    "--config.sft.stop_at_accuracy=0",
    "--config.num_steps=3",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=128",
    "--config.eval.num_examples=32",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.save_interval_steps=1",
    "--config.report_at_end=False",
    # The 8 experts of each MoE layer split over all 8 devices, so over both processes (each
    # holds 4 experts; data = 1, the rows shard over the expert axis), and every trainer
    # forward replays the sampler's recorded routes.
    "--config.mesh.expert=8",
    "--config.rollout.routing_replay=rollout",
]


@pytest.mark.slow
def test_moe_expert_parallel_two_processes_equal_one_through_a_kill(tmp_path):
  """~4 min: configs/tiny_moe.py with its experts split over 2 processes x 4 devices and
  routing replay, SIGKILLed once GRPO step 1's checkpoint is committed and resumed == one
  uninterrupted process with 8 devices on the same (1, 1, 1, 8) mesh: every logged figure
  (SFT and GRPO losses, grad norms, rewards, rollout/route_mismatch, evals) to 1e-5, the final
  parameters to PARAM_TOL (measured: 3.8e-5, the meshes' last-bit gradient differences through
  10 AdamW SFT steps at lr 1e-3 and 3 GRPO steps at 5e-4; a lost or repeated step moves them
  by ~lr)."""
  single, pair = epath.Path(tmp_path / "single"), epath.Path(tmp_path / "pair")
  _launch_single(single, base=MOE_ARGS)
  committed = pair / "checkpoints" / str(MOE_SFT + 1) / "commit_success.txt"
  killed = _launch_pair(pair, base=MOE_ARGS, kill_when=committed.exists)
  assert committed.exists()
  if all(rc == -signal.SIGKILL for rc, _ in killed):
    assert not (pair / "summary.json").exists()
  else:  # the job outran the poll: it must then have finished cleanly
    assert all(rc == 0 for rc, _ in killed), killed[0][1][-3000:]
  for rc, err in _launch_pair(pair, base=MOE_ARGS):
    assert rc == 0, err[-3000:]
    assert "resuming from" in err
  ref = _logged(single)
  mismatch = [row["rollout/route_mismatch"] for (what, _), row in ref.items() if what == "grpo"]
  assert len(mismatch) == 3 and all(0.0 <= v <= 1.0 for v in mismatch), mismatch
  assert all(row["loss/grad_norm"] > 0 for (what, _), row in ref.items() if what == "grpo")
  _assert_same_run(single, pair)
  (_, p1), (_, p2) = _final_params(single), _final_params(pair)
  diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), p1, p2)))
  print(
      f"kill rcs {[rc for rc, _ in killed]}; route_mismatch {mismatch}; max param diff {diff:.2e}"
  )
