"""A watchdog that stops every process of a multi-process job soon after one of them dies.

When one JAX process is killed (OOM killer, preemption without SIGTERM, `kill -9`), the others
are typically blocked inside a collective or a barrier that will never complete. JAX notices
only when the dead process misses its heartbeats for `heartbeat_timeout_seconds` (100 s by
default), and then aborts the survivors from a C++ thread with a check-failure dump. That abort
cannot be replaced: jax.distributed.initialize passes no `missed_heartbeat_callback` to jaxlib's
client, and a Python one given to it directly crashes (jaxlib 0.12: its absl::Status argument
has no Python type, std::bad_cast). `client.get_live_nodes` is a barrier of the live processes
(with a dead one it returns at the heartbeat timeout too). So the watchdog gets there first:

  * every process writes a counter to the coordination service's key-value store each
    POLL_SECONDS (one `key_value_set`) and reads all processes' counters (one
    `key_value_dir_get`);
  * a peer whose counter has not moved for `timeout_seconds` is gone: the watchdog writes the
    details (the peer, the Python stacks of this process) to the error log, prints one line
    and ends this process with os._exit(EXIT_PEER_GONE): the main thread, stuck in C++,
    cannot be reached by an exception.

A process that returns from the run marks itself "done" (never judged gone); one that fails
marks itself "failed", so the others stop `timeout_seconds` later instead of hanging in the
next collective.

Limits: when process 0 (it hosts the coordination service) dies, JAX's C++ client in the other
processes aborts at once (a dump, exit status 134), before any Python code can run; when it
hangs (a frozen host, a network partition), the key-value calls hang too and JAX's heartbeat
timeout ends the others.
"""

import atexit
import os
import re
import sys
import threading
import time
import traceback

from absl import logging

EXIT_PEER_GONE = 75  # sysexits.h EX_TEMPFAIL: relaunching every process resumes the run
POLL_SECONDS = 1.0
_PREFIX = "grpo_jax/peers/"
_DONE, _FAILED = "done", "failed"


def relaunch_hint(workdir: str | None) -> str:
  where = f" in {workdir}" if workdir else ""
  return (
      "Relaunch every process with the same command: the run resumes from the last "
      f"checkpoint{where}."
  )


def error_log_name(process_id: int) -> str:
  """The error log's file name in the workdir (main.py writes its tracebacks there too)."""
  return "error.log" if process_id == 0 else f"error.process_{process_id}.log"


def lost_peer(e: BaseException) -> str | None:
  """What a CPU (gloo) collective said when a peer process died mid-way, in a few words (e.g.
  "Gloo AllGather failed: Connection reset by peer"), or None for any other error. Wrappers
  (the checkpoint writer's OSError) keep the collective's words in their message."""
  text = str(e)
  op = re.search(r"Gloo [\w -]+? failed", text)  # all-reduce, AllGather, collective permute
  why = re.search(r"Connection (closed|reset) by peer|Broken pipe", text)
  return f"{op.group(0)}: {why.group(0)}" if op and why else None


class Watchdog:
  """Heartbeats of this process and judgement of the others' (see the module docstring)."""

  def __init__(self, client, process_id: int, num_processes: int, timeout_seconds: float):
    self.client, self.process_id, self.num_processes = client, process_id, num_processes
    self.timeout_seconds = timeout_seconds
    self.workdir = None  # set once known: where the error log goes
    self.longest_silence = 0.0  # seconds, over all peers: the margin below the timeout
    self._stop = threading.Event()
    self._stopped = False
    self._thread = threading.Thread(target=self._loop, name="peer-watchdog", daemon=True)
    self._thread.start()
    atexit.register(self.stop)  # runs before jax's own atexit shutdown of the client

  def stop(self, clean: bool = True):
    """Stops the watchdog and tells the others this process is done (or failed)."""
    if self._stopped:
      return
    self._stopped = True
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join()
    logging.info(
        "peers: the longest silence of another process was %.1f s (timeout %g s)",
        self.longest_silence,
        self.timeout_seconds,
    )
    try:
      self.client.key_value_set(
          _PREFIX + str(self.process_id), _DONE if clean else _FAILED, allow_overwrite=True
      )
    except Exception as e:  # the coordinator may be gone already
      logging.warning("peers: could not mark this process %s: %s", "done" if clean else "failed", e)

  def _loop(self):
    beat = 0
    seen = {}  # process id -> (value, when it last changed)
    while not self._stop.wait(POLL_SECONDS):
      beat += 1
      now = time.monotonic()
      try:
        self.client.key_value_set(_PREFIX + str(self.process_id), str(beat), allow_overwrite=True)
        values = dict(self.client.key_value_dir_get(_PREFIX))
      except Exception as e:  # noqa: BLE001 (the service is going away: JAX's C++ ends us)
        logging.log_first_n(logging.WARNING, "peers: no heartbeat exchange: %s", 1, e)
        continue
      for pid in range(self.num_processes):
        if pid == self.process_id:
          continue
        value = values.get(_PREFIX + str(pid))
        if value == _DONE:
          continue
        if pid not in seen or seen[pid][0] != value:
          seen[pid] = (value, now)
        silent = now - seen[pid][1]
        self.longest_silence = max(self.longest_silence, silent)
        if silent > self.timeout_seconds and not self._stop.is_set():
          what = (
              "stopped early (an error or an interrupt: see its log)"
              if value == _FAILED
              else "is gone (killed or crashed)"
          )
          self._end(pid, f"last heartbeat {value!r}, {silent:.1f} s ago", what)

  def _end(self, pid: int, detail: str, what: str):
    """Error log, one console line, exit: the main thread may be stuck in a collective."""
    where = self._write_log(
        f"JAX process {pid} of {self.num_processes} {what}: {detail} (this is process "
        f"{self.process_id}; the watchdog's timeout is {self.timeout_seconds:g} s).\n\n"
        f"Python stacks of this process:\n{_stacks()}"
    )
    if self.process_id == 0 and self.num_processes > 2:
      # Leaving ends the coordination service, which aborts the processes still running (with
      # a dump): give the other survivors' watchdogs (polling every second) time to end first.
      time.sleep(3 * POLL_SECONDS)
    line = (
        f"\nerror: JAX process {pid} of {self.num_processes} {what}; this process stops "
        f"too. {relaunch_hint(self.workdir)}{f' (details: {where})' if where else ''}\n"
    )
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # noqa: BLE001
        pass
    os.write(2, line.encode())
    os._exit(EXIT_PEER_GONE)

  def _write_log(self, text: str) -> str | None:
    """-> where the text went (the workdir's error log), or None; at most 5 s (a remote
    workdir may hang)."""
    if self.workdir is None:
      return None
    from grpo_jax.run import paths

    target = paths.path(self.workdir) / error_log_name(self.process_id)
    done = []

    def write():
      paths.write_atomic(target, text)
      done.append(True)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(5.0)
    return os.fspath(target) if done else None


def _stacks() -> str:
  names = {t.ident: t.name for t in threading.enumerate()}
  frames = sorted(
      sys._current_frames().items(),  # the main thread first
      key=lambda kv: kv[0] != threading.main_thread().ident,
  )
  return "\n".join(
      f"Thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(f))}"
      for ident, f in frames
  )


class Off:
  """The watchdog of a single-process run (or one turned off): nothing to watch."""

  workdir = None

  def stop(self, clean: bool = True):
    del clean


def start(timeout_seconds: float) -> Watchdog | Off:
  """A running watchdog on a multi-process job. Call right after jax.distributed.initialize
  (every process is connected then); reads its state without initializing a backend."""
  from jax._src import distributed

  state = distributed.global_state
  if state.client is None or state.num_processes == 1 or timeout_seconds <= 0:
    return Off()
  return Watchdog(state.client, state.process_id, state.num_processes, timeout_seconds)
