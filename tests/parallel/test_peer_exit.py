"""When one process of a 2-process job dies, the other stops within seconds (not JAX's ~100 s
heartbeat abort) with one line that says so and how to resume, exit status 75, and the details
in WORKDIR/error.log; relaunching both resumes from the last checkpoint to the same numbers as
a run never interrupted (grpo_jax/parallel/peers.py, the watchdog; main.py, the collective's error).
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from etils import epath
import pytest

from grpo_jax.parallel import peers
from tests.parallel import test_multihost as multihost_test

# Well below JAX's own abort (heartbeat_timeout_seconds=100): the watchdog's 10 s, a 1 s poll,
# and slack for 2 busy CPU cores.
EXIT_WITHIN_SEC = 30
FAST_ARGS = [
    *multihost_test.ARGS,
    "--config.sft_steps=2",
    "--config.num_steps=20",
    "--config.save_interval_steps=1",
]


class _FakeClient:
  """The coordination service's key-value store, in memory."""

  def __init__(self):
    self.kv, self.lock = {}, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.lock:
      assert allow_overwrite or key not in self.kv
      self.kv[key] = value

  def key_value_dir_get(self, prefix):
    with self.lock:
      return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class _Recording(peers.Watchdog):
  """Records what the watchdog would end the process for, instead of ending it."""

  ended = None

  def _end(self, pid, detail, what):
    self.ended = (pid, what, time.monotonic())
    self._stop.set()


def _watch(client, num_processes, timeout):
  started = time.monotonic()
  dog = _Recording(client, 0, num_processes, timeout)
  dog.started = started
  return dog


def test_watchdog_judges_silent_peers_not_beating_or_done_ones(monkeypatch):
  monkeypatch.setattr(peers, "POLL_SECONDS", 0.02)
  client = _FakeClient()
  client.key_value_set("grpo_jax/peers/2", "7")  # beat once, then silent: killed
  client.key_value_set("grpo_jax/peers/3", "done")  # finished cleanly: never judged
  beating = threading.Event()

  def beat():  # process 1, alive
    n = 0
    while not beating.wait(0.02):
      n += 1
      client.key_value_set("grpo_jax/peers/1", str(n), allow_overwrite=True)

  threading.Thread(target=beat, daemon=True).start()
  dog = _watch(client, 4, timeout=0.5)
  dog._thread.join(5)
  pid, what, when = dog.ended
  assert (pid, what) == (2, "is gone (killed or crashed)")
  assert 0.5 <= when - dog.started < 2.0
  assert int(client.kv["grpo_jax/peers/0"]) > 10  # this process beats too

  # A peer that stopped with an error marks itself: the others stop a timeout later.
  client.key_value_set("grpo_jax/peers/2", "done", allow_overwrite=True)
  dog = _watch(client, 4, timeout=0.5)
  time.sleep(0.3)
  beating.set()
  client.key_value_set("grpo_jax/peers/1", "failed", allow_overwrite=True)
  failed_at = time.monotonic()
  dog._thread.join(5)
  pid, what, when = dog.ended
  assert pid == 1 and what.startswith("stopped early"), what
  assert 0.5 <= when - failed_at < 2.0

  # stop(): the thread ends and the others learn how this process ended.
  dog = _watch(client, 2, timeout=0.5)
  dog.stop(clean=False)
  assert not dog._thread.is_alive() and client.kv["grpo_jax/peers/0"] == "failed"
  time.sleep(0.7)
  assert dog.ended is None


_SILENT_PEER = """
import sys, time
from grpo_jax.parallel import peers
from tests.parallel.test_peer_exit import _FakeClient
peers.POLL_SECONDS = 0.05
client = _FakeClient()
client.key_value_set("grpo_jax/peers/0", "3")  # process 0 beat thrice, then went silent
dog = peers.Watchdog(client, 1, 2, timeout_seconds=0.5)
dog.workdir = sys.argv[1]
def stuck_in_a_collective():
  time.sleep(30)
stuck_in_a_collective()
"""


def test_watchdog_ends_the_process_with_one_line_and_the_details_in_the_log(tmp_path):
  p = subprocess.run(
      [sys.executable, "-c", _SILENT_PEER, str(tmp_path)],
      cwd=multihost_test.ROOT,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert p.returncode == peers.EXIT_PEER_GONE == 75
  log = tmp_path / "error.process_1.log"
  assert p.stderr.endswith(
      "\nerror: JAX process 0 of 2 is gone (killed or crashed); this process stops too. Relaunch "
      "every process with the same command: the run resumes from the last checkpoint in "
      f"{tmp_path}. (details: {log})\n"
  ), p.stderr
  text = log.read_text()
  assert text.startswith("JAX process 0 of 2 is gone (killed or crashed): last heartbeat '3'")
  main_thread = text.split("Thread MainThread:\n", 1)[1].split("\nThread ", 1)[0]
  assert "in stuck_in_a_collective" in main_thread, text  # where the main thread was


def test_lost_peer_names_what_the_collective_said():
  wrapped = OSError(
      "writing a checkpoint under /w/checkpoints failed (at step 4): UNKNOWN: Gloo AllGather "
      "failed: [external/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:33682: "
      "Connection reset by peer. Fix: free space or fix write access there"
  )
  assert peers.lost_peer(wrapped) == "Gloo AllGather failed: Connection reset by peer"
  assert peers.lost_peer(
      RuntimeError(
          "UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed by peer [::1]:1"
      )
  ) == ("Gloo all-reduce failed: Connection closed by peer")
  assert peers.lost_peer(RuntimeError("Connection reset by peer")) is None  # not a collective
  assert peers.lost_peer(ValueError("Gloo all-reduce failed: bad shape")) is None


def _start_pair(workdir, *args):
  port = multihost_test._free_port()
  env = dict(os.environ, LOCAL_DEVICES="4", PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)  # the launcher sets the per-process device count
  logs = [open(os.path.join(os.path.dirname(workdir), f"stderr.{i}"), "w+") for i in range(2)]
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
              *args,
          ],
          cwd=multihost_test.ROOT,
          env=env,
          stderr=logs[pid],
          stdout=subprocess.DEVNULL,
          text=True,
      )
      for pid in range(2)
  ]
  return procs, logs


def _wait_for(predicate, procs, timeout=300):
  deadline = time.time() + timeout
  while not predicate():
    assert time.time() < deadline and all(p.poll() is None for p in procs), "no progress"
    time.sleep(0.05)


def _grpo_steps(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  return sum("loss/policy_loss" in line for line in open(path))


def _kill_one(workdir, sig, *, args=FAST_ARGS, ready=None):
  """Starts a pair, sends `sig` to process 1 once `ready()` (default: GRPO step 2 is logged,
  after a checkpoint) -> (process 0's exit status, seconds it took to exit, its stderr)."""
  procs, logs = _start_pair(workdir, *args)
  try:
    _wait_for(ready or (lambda: _grpo_steps(workdir) >= 2), procs)
    procs[1].send_signal(sig)
    sent = time.time()
    rc = procs[0].wait(timeout=120)
    took = time.time() - sent
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  logs[0].seek(0)
  stderr = logs[0].read()
  for log in logs:
    log.close()
  return rc, took, stderr


def _last_line(stderr: str) -> str:
  return stderr.rstrip("\n").rsplit("\n", 1)[-1]


@pytest.mark.slow  # ~40 s; the default suite checks the watchdog's exit without a JAX job
def test_stalled_peer_ends_the_other_within_seconds(tmp_path):
  """A peer that stops heartbeating (SIGSTOP: its sockets stay open, so no collective fails)
  is found by the watchdog."""
  workdir = str(tmp_path / "run")
  rc, took, stderr = _kill_one(workdir, signal.SIGSTOP)
  line = _last_line(stderr)
  assert rc == peers.EXIT_PEER_GONE, stderr[-3000:]
  assert took < EXIT_WITHIN_SEC
  assert line == (
      "error: JAX process 1 of 2 is gone (killed or crashed); this process stops "
      "too. Relaunch every process with the same command: the run resumes from the "
      f"last checkpoint in {workdir}. (details: {workdir}/error.log)"
  ), line
  assert "Check failure" not in stderr and "Fatal Python error" not in stderr
  log = open(os.path.join(workdir, "error.log")).read()
  assert "JAX process 1 of 2 is gone" in log and "last heartbeat" in log
  assert "Thread MainThread:" in log and "grpo_jax/main.py" in log  # where it was stuck
  print(f"process 0 exited {took:.1f} s after SIGSTOP of process 1")


def test_killed_peer_ends_the_other_within_seconds(tmp_path):
  """kill -9: the collective process 0 is in usually fails at once (gloo: connection reset);
  otherwise the watchdog ends it. Either way: one line, exit status 75, details in the log."""
  workdir = str(tmp_path / "run")
  rc, took, stderr = _kill_one(workdir, signal.SIGKILL)
  line = _last_line(stderr)
  assert rc == peers.EXIT_PEER_GONE, stderr[-3000:]
  assert took < EXIT_WITHIN_SEC
  hint = (
      "this process stops too. Relaunch every process with the same command: the run "
      f"resumes from the last checkpoint in {workdir}."
  )
  assert re.fullmatch(  # the collective failed at once, or the watchdog found the peer silent
      r"error: (a peer JAX process is gone \(Gloo [\w-]+ failed: [\w ]+\)|"
      r"JAX process 1 of 2 is gone \(killed or crashed\)); "
      + re.escape(hint)
      + r" \((traceback|details): "
      + re.escape(f"{workdir}/error.log")
      + r"\)",
      line,
  ), line
  assert "Check failure" not in stderr and "Fatal Python error" not in stderr
  assert os.path.getsize(os.path.join(workdir, "error.log")) > 500
  print(f"process 0 exited {took:.1f} s after kill -9 of process 1: {line[:80]}")


@pytest.mark.slow  # ~1.5 min on 2 cores: three 2-process runs
def test_relaunch_after_a_killed_peer_resumes_to_the_same_numbers(tmp_path):
  """kill -9 of process 1 once GRPO step 2's checkpoint is committed, process 0 exits 75, both
  relaunched: every logged figure equals an uninterrupted 2-process run's, bit for bit (the same
  programs on the same mesh; the last logging of a redone step counts)."""
  ref, run = epath.Path(tmp_path / "ref"), epath.Path(tmp_path / "run")
  for rc, err in multihost_test._launch_pair(ref):
    assert rc == 0, err[-3000:]

  ckpt = multihost_test.SFT_STEPS + 2  # GRPO step 2's
  committed = run / "checkpoints" / str(ckpt) / "commit_success.txt"
  rc, took, stderr = _kill_one(
      str(run), signal.SIGKILL, args=multihost_test.ARGS, ready=committed.exists
  )
  assert rc == peers.EXIT_PEER_GONE and took < EXIT_WITHIN_SEC, stderr[-3000:]
  assert not (run / "summary.json").exists()

  for rc, err in multihost_test._launch_pair(run):
    assert rc == 0, err[-3000:]
    resumed = re.search(r"resuming from \S+/checkpoints/(\d+)", err)
    assert resumed and int(resumed.group(1)) >= ckpt, err[-3000:]

  for d in (ref, run):
    summary = json.loads((d / "summary.json").read_text())
    assert summary["final_step"] == multihost_test.NUM_STEPS
  want, got = multihost_test._logged(ref), multihost_test._logged(run)
  assert sorted(want) == sorted(got)
  for key in want:
    assert want[key] == got[key], key
