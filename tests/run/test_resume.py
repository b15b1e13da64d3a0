"""Nothing lost: a damaged latest checkpoint falls back to the previous one (and the run still
ends bit-identical to an uninterrupted one), a workdir written with other settings is refused
in one line, metrics.jsonl holds every step once after a resume, and errors after start-up end
in one line with the traceback in WORKDIR/error.log."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax import train
from tests.test_train import checkpoint_state
from tests.test_train import flat
from tests.test_train import read_metrics
from tests.test_train import ROOT
from tests.test_train import tiny_config


def _damage(ckpt, how):
  state = os.path.join(ckpt, "state")
  data_files = sorted(
      (
          os.path.join(r, f)
          for r, _, fs in os.walk(state)
          for f in fs
          if os.sep + "d" + os.sep in os.path.join(r, f)
      ),
      key=os.path.getsize,
  )
  if how == "empty _METADATA":
    open(os.path.join(state, "_METADATA"), "w").close()
  elif how == "deleted array file":
    os.remove(data_files[-1])
  elif how == "truncated array file":
    with open(data_files[-1], "r+b") as f:
      f.truncate(os.path.getsize(data_files[-1]) // 2)
  elif how == "missing item":
    import shutil

    shutil.rmtree(os.path.join(ckpt, "data"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("straight"))
  train.run(tiny_config(num_steps=6, save_interval_steps=2), workdir)
  return workdir


@pytest.mark.parametrize(
    "how",
    [
        "truncated array file",  # seen when restoring; before restoring (slow, suite time):
        pytest.param("empty _METADATA", marks=pytest.mark.slow),
        pytest.param("deleted array file", marks=pytest.mark.slow),
        pytest.param("missing item", marks=pytest.mark.slow),
    ],
)
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, straight, how):
  workdir = str(tmp_path / "run")
  config = tiny_config(num_steps=6, save_interval_steps=2, max_steps_per_run=4)
  with pytest.raises(SystemExit):
    train.run(config, workdir)  # checkpoints 2 and 4, then a stop
  _damage(os.path.join(workdir, "checkpoints", "4"), how)
  summary = train.run(config, workdir)  # resumes from 2, redoes 3..6
  assert summary["final_step"] == 6
  assert os.path.isdir(os.path.join(workdir, "checkpoints_damaged", "4"))
  steps = [r["step"] for r in read_metrics(workdir) if "loss/policy_loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]  # each step once: rows after checkpoint 2 were dropped
  _, a = checkpoint_state(straight, 6)
  _, b = checkpoint_state(workdir, 6)
  fa, fb = flat(a["train"]), flat(b["train"])
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_no_intact_checkpoint_is_one_clear_line(tmp_path):
  workdir = str(tmp_path / "run")
  config = tiny_config(num_steps=4, save_interval_steps=2, max_steps_per_run=2)
  with pytest.raises(SystemExit):
    train.run(config, workdir)
  _damage(os.path.join(workdir, "checkpoints", "2"), "empty _METADATA")
  with pytest.raises(
      ValueError,
      match=r"no intact checkpoint is left under .*checkpoints \(2: "
      r".*_METADATA is empty\)\. Fix: a new --workdir",
  ):
    train.run(config, workdir)


def test_resuming_with_other_settings_names_the_fields(tmp_path):
  workdir = str(tmp_path / "run")
  with pytest.raises(SystemExit):
    train.run(tiny_config(num_steps=4, max_steps_per_run=2), workdir)
  with pytest.raises(ValueError) as e:
    train.run(tiny_config(num_steps=4, **{"model.hidden_size": 64, "seed": 3}), workdir)
  msg = str(e.value)
  assert "model.hidden_size: 128 -> 64" in msg and "seed: 0 -> 3" in msg
  assert "Fix: use a new --workdir (these fields fix the checkpoint's shapes)" in msg
  with pytest.raises(ValueError, match=r"allow_changes=seed"):
    train.run(tiny_config(num_steps=4, seed=3), workdir)
  # Safe-to-change fields need nothing; the others can be allowed explicitly.
  summary = train.run(
      tiny_config(
          num_steps=4,
          seed=3,
          **{"checkpoint.allow_changes": "seed", "optimizer.learning_rate": 1e-3},
      ),
      workdir,
  )
  assert summary["final_step"] == 4
  assert json.load(open(os.path.join(workdir, "config.json")))["seed"] == 3


def test_errors_after_start_up_are_one_line_with_the_traceback_in_the_workdir(tmp_path):
  data = tmp_path / "train.jsonl"
  data.write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "caf\xe9"}\n')
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny.py",
          f"--workdir={workdir}",
          "--config.data.train_source=gsm8k",
          f"--config.data.train_path={data}",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 1
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {data}:2: not UTF-8"), r.stderr[-2000:]
  assert f"traceback: {workdir}/error.log" in last
  assert "Traceback" not in r.stderr
  log = (workdir / "error.log").read_text()
  assert log.startswith("Traceback") and "not UTF-8" in log


def test_print_config_prints_and_exits(tmp_path):
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny.py",
          "--config.beta=0.25",
          "--print_config",
          f"--workdir={tmp_path}/w",
      ],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 0 and "beta: 0.25" in r.stdout
  assert not os.path.exists(tmp_path / "w")


def test_mistyped_override_is_named_even_after_good_ones():
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny.py",
          "--config.beta=0.1",
          "--config.loss.clip_epz=0.3",
      ],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 2
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: --config.loss.clip_epz: no such config field"), last
  assert "--print_config" in last


# ------------------------------------------------------------------ kill -9 at any moment

_KILL_ARGS = [
    "--config=configs/tiny.py",
    "--config.sft_steps=8",
    "--config.sft.stop_at_accuracy=0",
    "--config.num_steps=6",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=128",
    "--config.eval.num_examples=16",
    "--config.eval.batch_size=16",
    "--config.save_interval_steps=2",
    "--config.checkpoint.max_to_keep=10",
]


def _start(workdir):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen(
      [sys.executable, "-m", "grpo_jax.main", f"--workdir={workdir}", *_KILL_ARGS],
      cwd=ROOT,
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
  )


def _kill_when(proc, predicate, timeout=300):
  """SIGKILL `proc` as soon as `predicate()` holds; -> whether it was killed (not finished)."""
  import signal
  import time

  deadline = time.time() + timeout
  while proc.poll() is None and time.time() < deadline:
    if predicate():
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      return True
    time.sleep(0.005)
  proc.wait()
  return False


def _finish(workdir):
  proc = _start(workdir)
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]


def _final_train_state(workdir):
  _, state = checkpoint_state(workdir)
  return flat(state["train"])


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("straight_kill")
  _finish(workdir)
  return workdir


def _orbax_tmp(workdir):
  d = os.path.join(workdir, "checkpoints")
  return os.path.isdir(d) and any("tmp" in name for name in os.listdir(d))


def _compare(a, b):
  fa, fb = _final_train_state(a), _final_train_state(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)
  steps = [r["step"] for r in read_metrics(b) if "loss/policy_loss" in r]
  assert steps == list(range(1, 7))


def test_a_save_cut_short_leaves_no_temporary_folder_after_the_next_launch(tmp_path):
  """kill -9 mid-write leaves Orbax's temporary folder (as big as a checkpoint); the next
  launch's checkpointer removes it, and keeps the complete checkpoints."""
  import jax.numpy as jnp

  from grpo_jax import data as data_lib
  from grpo_jax.run import checkpoint as ckpt_lib

  d = tmp_path / "checkpoints"
  it = data_lib.make_prompt_iterator(16, batch_size=4, seed=0)
  first = ckpt_lib.Checkpointer(str(d), max_to_keep=4, async_save=False)
  first.save(2, {"w": jnp.ones(3)}, it, {"phase": "grpo"})
  first.wait()
  cut = d / "4.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"  # what the kill left
  cut.mkdir(parents=True)
  (cut / "shard").write_bytes(b"x" * 1000)
  again = ckpt_lib.Checkpointer(str(d), max_to_keep=4, async_save=False)
  again.save(6, {"w": jnp.ones(3)}, it, {"phase": "grpo"})  # (a save waits for the clean-up)
  again.wait()
  assert sorted(os.listdir(d)) == ["2", "6"]
  assert again.all_steps() == [2, 6]


@pytest.mark.slow  # suite time (-m slow runs it)
def test_kill_during_a_checkpoint_write_resumes_bit_identical(tmp_path, straight_run):
  """SIGKILL while Orbax is writing a checkpoint (its temporary folder exists): the same
  command resumes from the last complete checkpoint and ends bit-identical."""
  workdir = tmp_path / "run"
  killed = _kill_when(_start(workdir), lambda: _orbax_tmp(workdir))
  assert killed, "the run ended before a checkpoint write was seen"
  _finish(workdir)
  _compare(straight_run, workdir)
  assert not _orbax_tmp(workdir)  # the cut write's folder is gone


@pytest.mark.slow
@pytest.mark.parametrize("delay", [3.0, 6.0, 9.0, 12.0, 15.0, 18.0, 21.0, 24.0])
def test_kill_at_a_moment_resumes_bit_identical(tmp_path, straight_run, delay):
  """The sweep: SIGKILL after `delay` seconds (mid-start-up, mid-SFT, mid-rollout, mid-update,
  mid-write), twice when the run allows, then finish: always bit-identical."""
  import time

  workdir = tmp_path / "run"
  for _ in range(2):
    t0 = time.time()
    _kill_when(_start(workdir), lambda t0=t0: time.time() - t0 > delay)
  _finish(workdir)
  _compare(straight_run, workdir)


@pytest.mark.slow  # suite time (-m slow runs it)
def test_a_failing_checkpoint_write_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
  """A full disk, simulated with a file-size limit (writes past 64 KiB fail with EFBIG): the
  run stops with one line, no incomplete checkpoint counts as the latest, and the same
  command on a healthy disk resumes from the last complete one."""
  import resource
  import signal

  def small_disk():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failing write, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          f"--workdir={workdir}",
          *_KILL_ARGS,
          "--config.compilation_cache_dir=",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
      preexec_fn=small_disk,
  )
  assert r.returncode != 0
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("error: ") and "traceback:" in last, r.stderr[-3000:]
  from grpo_jax.run import checkpoint

  steps = checkpoint.steps_in(workdir / "checkpoints")
  assert all(checkpoint.problem(workdir / "checkpoints", s) is None for s in steps)
  _finish(workdir)
  assert json.loads((workdir / "summary.json").read_text())["final_step"] == 6


def _tb_events(workdir):
  """(file, [(step, kind, tag)]) for each TensorBoard event file, oldest first; kind is
  "scalar" or "purge" (a SessionLog START, after which TensorBoard drops later points)."""
  import struct
  from tensorboardX.proto import event_pb2

  out = []
  for name in sorted(f for f in os.listdir(workdir) if f.startswith("events.out.tfevents")):
    data, pos, events = open(os.path.join(workdir, name), "rb").read(), 0, []
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos : pos + 8])
      e = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
      pos += 12 + n + 4
      if e.HasField("session_log") and e.session_log.status == e.session_log.START:
        events.append((e.step, "purge", ""))
      for v in e.summary.value:
        events.append((e.step, "scalar", v.tag))
    out.append((name, events))
  return out


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
  """The resumed run's event file starts with a purge at the checkpoint's step + 1, so
  TensorBoard hides what the crashed run logged past its checkpoint; GRPO points sit at the
  global (checkpoint) step."""
  workdir = str(tmp_path / "run")
  config = tiny_config(num_steps=4, sft_steps=0, save_interval_steps=2, max_steps_per_run=3)
  with pytest.raises(SystemExit):
    train.run(config, workdir)  # checkpoints 2 and 3 (the stop)
  import shutil

  shutil.rmtree(os.path.join(workdir, "checkpoints", "3"))  # as if killed after step 3's log
  train.run(tiny_config(num_steps=4, sft_steps=0, save_interval_steps=2), workdir)
  (_, first), (_, second) = _tb_events(workdir)
  assert [s for s, kind, _ in second if kind == "purge"] == [3]
  assert {s for s, kind, tag in first if tag == "loss/policy_loss"} == {1, 2, 3}
  assert {s for s, kind, tag in second if tag == "loss/policy_loss"} == {3, 4}
  steps = [r["step"] for r in read_metrics(workdir) if "loss/policy_loss" in r]
  assert steps == [1, 2, 3, 4]
