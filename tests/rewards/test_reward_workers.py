"""Reward calls that hang or kill their process: the in-process timeout (num_workers=0), worker
deaths in the pool (os._exit, SIGKILL, segfault, abort), warnings for failing rows, and the
start-up check(). The plug-in is a custom_file, so spawned workers can import it."""

import multiprocessing
from multiprocessing import resource_tracker
import os
import signal
import threading
import time

import numpy as np
import pytest

from grpo_jax import rewards

# The score of a healthy row is its length, so innocent rows keep distinguishable real scores.
PLUGIN = """
import ctypes, os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  s = solution_str
  if s.startswith("nap:"):  # say "I am running" through a file, then take a while
    open(s[4:], "w").close()
    time.sleep(1.0)
    return float(len(s))
  if s.startswith("segv-after:"):  # die only while a nap: call runs in the other worker
    while not os.path.exists(s[11:]):
      time.sleep(0.01)
    ctypes.string_at(0)
  if s.startswith("term-once:"):  # SIGTERM from outside, the first time only
    if not os.path.exists(s[10:]):
      open(s[10:], "w").close()
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(30)
  if "slow" in s:
    try:
      time.sleep(30)
    except Exception:  # a timeout must not be swallowed by a broad except
      time.sleep(30)
  if "boom" in s:
    raise KeyError("missing key")
  if "exit" in s:
    os._exit(1)
  if "sigkill" in s:
    os.kill(os.getpid(), signal.SIGKILL)
  if "segv" in s:
    ctypes.string_at(0)
  if "abort" in s:
    os.abort()
  return float(len(s))
"""


def _plugin(tmp_path, body=PLUGIN):
  f = tmp_path / "plugin_reward.py"
  f.write_text(body)
  return str(f)


def _rows(n, truth="7", source="math"):
  return [
      dict(prompt="p", ground_truth=truth, data_source=source, extra_info={"i": i})
      for i in range(n)
  ]


def _children() -> set[int]:
  pids = set()
  for task in os.listdir(f"/proc/{os.getpid()}/task"):
    try:
      with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
        pids.update(int(p) for p in f.read().split())
    except OSError:
      pass
  return pids


@pytest.fixture
def no_leftover_processes():
  before = _children()
  yield
  leftover = {p.pid for p in multiprocessing.active_children()} | _children()
  # multiprocessing's resource tracker (one per process, for the pool's semaphores) stays.
  leftover -= before | {resource_tracker._resource_tracker._pid}
  assert not leftover, f"worker processes left behind: {leftover}"


# ------------------------------------------------------------ in-process timeout (no workers)


def test_inline_timeout_raises_naming_function_row_and_timeout(tmp_path):
  rc = rewards.build_reward_computer((), (), custom_file=_plugin(tmp_path), timeout_sec=0.5)
  t = time.monotonic()
  with pytest.raises(
      rewards.RewardError, match=r"'custom' timed out after 0.5s on row 1 \(in-process\).*'xx slow'"
  ):
    rc(["p"] * 3, ["a", "xx slow", "ccc"], _rows(3))
  assert time.monotonic() - t < 5
  assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
  assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_inline_timeout_scores_zero_and_the_next_call_works(tmp_path, caplog):
  rc = rewards.build_reward_computer(
      ("check_answer",), (1.0,), custom_file=_plugin(tmp_path), timeout_sec=0.5, on_error="zero"
  )
  t = time.monotonic()
  res = rc(["p"] * 3, ["a", "slow", "ccc"], _rows(3))
  assert time.monotonic() - t < 5  # the broad `except Exception` in the plug-in did not hold it
  np.testing.assert_array_equal(res.per_function["custom"], [1.0, 0.0, 3.0])
  assert res.errors == 1
  assert "'custom' failed on 1 of 3 rows" in caplog.text
  res = rc(["p"] * 2, ["a", "bb"], _rows(2))
  np.testing.assert_array_equal(res.per_function["custom"], [1.0, 2.0])
  assert res.errors == 0
  assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_inline_timeout_bounds_a_sigterm_during_a_hung_reward(tmp_path):
  """SIGTERM (preemption) only sets a flag; the timeout is what frees the loop to act on it."""
  got = []
  previous = signal.signal(signal.SIGTERM, lambda *_: got.append("SIGTERM"))
  try:
    rc = rewards.build_reward_computer(
        (), (), custom_file=_plugin(tmp_path), timeout_sec=1.0, on_error="zero"
    )
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t = time.monotonic()
    res = rc(["p"], ["slow"], _rows(1))
    assert time.monotonic() - t < 5
    assert got == ["SIGTERM"] and res.errors == 1
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_inline_timeout_off_the_main_thread_uses_one_worker(tmp_path, no_leftover_processes):
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path), timeout_sec=20.0, on_error="zero"
  )
  out = {}
  thread = threading.Thread(target=lambda: out.update(res=rc(["p"] * 2, ["a", "bb"], _rows(2))))
  thread.start()
  thread.join(60)
  try:
    assert rc._pool is not None and rc._pool.size == 1
    np.testing.assert_array_equal(out["res"].total, [1.0, 2.0])
  finally:
    rc.close()


# ------------------------------------------------------------------------- worker deaths


@pytest.mark.parametrize(
    "how,exit_words",
    [
        ("exit", "exited with code 1"),
        ("sigkill", "killed by SIGKILL"),
        ("segv", "killed by SIGSEGV"),
        ("abort", "killed by SIGABRT"),
    ],
)
def test_dead_worker_is_replaced_and_innocent_rows_keep_their_scores(
    tmp_path, caplog, how, exit_words, no_leftover_processes
):
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path), num_workers=2, on_error="zero", timeout_sec=30.0
  )
  try:
    comps = ["a", "bb", f"{how}!", "dddd", "eeeee", "ffffff"]
    t = time.monotonic()
    res = rc(["p"] * 6, comps, _rows(6))
    np.testing.assert_array_equal(res.per_function["custom"], [1, 2, 0, 4, 5, 6])
    assert res.errors == 1
    assert time.monotonic() - t < 25
    assert f"killed the worker process scoring row 2 ({exit_words})" in caplog.text
    # The next batch runs normally on a fresh pool.
    res = rc(["p"] * 2, ["xyz", "ab"], _rows(2))
    np.testing.assert_array_equal(res.total, [3.0, 2.0])
    assert res.errors == 0
  finally:
    rc.close()


def test_a_death_with_several_calls_running_reruns_them_one_at_a_time(
    tmp_path, caplog, no_leftover_processes
):
  """The pool cannot tell which of the running calls killed it: the fresh pool re-runs them
  alone, and only the one that kills its worker again is scored 0."""
  marker = tmp_path / "napping"
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path), num_workers=2, on_error="zero", timeout_sec=30.0
  )
  try:
    comps = [f"nap:{marker}", f"segv-after:{marker}", "ccc"]
    res = rc(["p"] * 3, comps, _rows(3))
    np.testing.assert_array_equal(res.per_function["custom"], [len(comps[0]), 0.0, 3.0])
    assert res.errors == 1
    assert "died with 2 calls running; restarting the pool and re-running" in caplog.text
    assert "killed the worker process scoring row 1 (killed by SIGSEGV)" in caplog.text
  finally:
    rc.close()


def test_a_worker_terminated_from_outside_is_not_blamed_on_its_row(
    tmp_path, caplog, no_leftover_processes
):
  """A preemption may SIGTERM the whole process group: the step must still finish, with real
  scores, so the run can save and exit cleanly (on_error=raise must not fire)."""
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path), num_workers=1, timeout_sec=30.0
  )
  try:
    comps = ["a", f"term-once:{tmp_path / 'termed'}", "ccc"]
    res = rc(["p"] * 3, comps, _rows(3))
    np.testing.assert_array_equal(res.total, [1.0, len(comps[1]), 3.0])
    assert res.errors == 0 and "was terminated (SIGTERM)" in caplog.text
  finally:
    rc.close()


def test_dead_worker_with_on_error_raise_names_function_row_and_cause(
    tmp_path, no_leftover_processes
):
  rc = rewards.build_reward_computer((), (), custom_file=_plugin(tmp_path), num_workers=2)
  try:
    with pytest.raises(
        rewards.RewardError,
        match=r"'custom' killed the worker process scoring "
        r"row 1 \(exited with code 1\), completion 'exit'.*on_error=zero",
    ):
      rc(["p"] * 3, ["a", "exit", "ccc"], _rows(3))
  finally:
    rc.close()


def test_hung_worker_times_out_and_other_rows_keep_their_scores(tmp_path, no_leftover_processes):
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path), num_workers=2, on_error="zero", timeout_sec=1.0
  )
  try:
    t = time.monotonic()
    res = rc(["p"] * 4, ["a", "slow", "ccc", "dddd"], _rows(4))
    assert time.monotonic() - t < 20
    np.testing.assert_array_equal(res.total, [1.0, 0.0, 3.0, 4.0])
    assert res.errors == 1
  finally:
    rc.close()


# ---------------------------------------------------------------------------------- warnings


def test_warning_per_batch_names_function_count_error_and_snippet(tmp_path, caplog):
  rc = rewards.build_reward_computer(
      ("check_answer",), (1.0,), custom_file=_plugin(tmp_path), on_error="zero"
  )
  rc(["p"] * 4, ["a", "xx boom", "c", "boom yy"], _rows(4))
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1, warnings
  for w in ("'custom' failed on 2 of 4 rows", "KeyError", "row 1", "'xx boom'"):
    assert w in warnings[0], warnings[0]
  caplog.clear()
  rc(["p"] * 2, ["boom", "boom"], _rows(2))
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert len(warnings) == 1 and "'custom' FAILED ON EVERY ROW (2 of 2)" in warnings[0]
  assert "scores every row 0" in warnings[0]
  caplog.clear()
  rc(["p"] * 2, ["a", "b"], _rows(2))
  assert not [r for r in caplog.records if r.levelname == "WARNING"]


# -------------------------------------------------------------------------- start-up check


def test_check_passes_on_good_functions(tmp_path):
  rc = rewards.build_reward_computer(
      ("check_answer", "verl_default"), (1.0, 1.0), custom_file=_plugin(tmp_path)
  )
  scores = rc.check(_rows(1, truth="72")[0])
  assert scores == {"check_answer": 0.0, "verl_default": 1.0, "custom": 2.0}


def test_check_on_a_broken_plugin_is_one_clear_line(tmp_path):
  body = (
      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
      "  return extra_info['answer']\n"
  )
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path, body), on_error="zero"
  )  # check() fails whatever on_error says
  with pytest.raises(rewards.RewardError) as e:
    rc.check(_rows(1)[0])
  msg = str(e.value)
  assert "\n" not in msg
  for w in (
      "reward start-up check failed",
      "'custom' raised KeyError: 'answer'",
      "Fix reward.custom_file=",
      "plugin_reward.py",
  ):
    assert w in msg, msg


def test_check_on_a_builtin_that_cannot_read_the_rows(tmp_path):
  rc = rewards.build_reward_computer(("verl_default",), (1.0,))
  with pytest.raises(
      rewards.RewardError,
      match=r"'verl_default' raised ValueError: no built-in "
      r"scorer for data_source 'poetry'.*Fix 'verl_default' \(or drop it",
  ):
    rc.check(_rows(1, source="poetry")[0])


def test_check_respects_the_timeout(tmp_path):
  rc = rewards.build_reward_computer((), (), custom_file=_plugin(tmp_path), timeout_sec=0.5)
  t = time.monotonic()
  with pytest.raises(rewards.RewardError, match="start-up check failed: .*'custom' timed out"):
    rc.check(_rows(1, truth="slow")[0])
  assert time.monotonic() - t < 5


def test_check_in_the_worker_pool_catches_a_crashing_plugin(tmp_path, no_leftover_processes):
  rc = rewards.build_reward_computer(
      ("check_answer",),
      (1.0,),
      custom_file=_plugin(tmp_path),
      num_workers=2,
      on_error="zero",
      timeout_sec=30.0,
  )
  try:
    assert rc.check(_rows(1, truth="72")[0]) == {"check_answer": 0.0, "custom": 2.0}
    with pytest.raises(rewards.RewardError) as e:
      rc.check(_rows(1, truth="segv")[0])
    msg = str(e.value)
    assert "\n" not in msg and "killed the worker process scoring row 0 (killed by SIGSEGV)" in msg
    assert "Fix reward.custom_file=" in msg
  finally:
    rc.close()


def test_workers_that_cannot_start_give_a_clear_error_not_a_hang(
    tmp_path, monkeypatch, no_leftover_processes
):
  # The plug-in imports in this process but kills any other process that imports it.
  monkeypatch.setenv("GRPO_TEST_PARENT_PID", str(os.getpid()))
  body = (
      "import os\nif os.environ.get('GRPO_TEST_PARENT_PID') != str(os.getpid()):\n"
      "  os._exit(3)\n" + PLUGIN
  )
  rc = rewards.build_reward_computer(
      (), (), custom_file=_plugin(tmp_path, body), num_workers=1, on_error="zero", timeout_sec=5.0
  )
  try:
    with pytest.raises(
        rewards.RewardError,
        match="restarted 6 times in a row for 'custom': its "
        "worker processes died before starting any call",
    ):
      rc(["p"] * 2, ["a", "bb"], _rows(2))
  finally:
    rc.close()
