"""Where reward calls run when not as one batch call in the trainer (grpo_jax/rewards/computer.py
decides when): reward specs resolved the same way in any process, a spawn process pool that
knows which worker started which call (so a death or a hang is blamed on the right row), and
the in-process SIGALRM timeout.
"""

import concurrent.futures
from concurrent.futures import process as futures_process
import multiprocessing
import os
import signal
import struct
import threading
import time

from grpo_jax.rewards import registry
from grpo_jax.rewards import scoring

# After the first SIGALRM, re-fire this often in case the function swallowed the exception.
_ALARM_REPEAT_SEC = 0.1


def resolve(spec):
  """A reward function from ("builtin", name), ("custom", path) (verl's compute_score) or
  ("custom_trl", (path, function name)) (a TRL-style batch function): picklable across
  processes."""
  kind, arg = spec
  if kind == "builtin":
    return registry.get(arg)
  if kind == "custom_trl":
    return scoring.as_trl_reward_fn(_custom_cache(*arg))
  return scoring.as_reward_fn(_custom_cache(arg))


_CUSTOM_FNS: dict = {}


def _custom_cache(path, name: str = ""):
  if (path, name) not in _CUSTOM_FNS:
    _CUSTOM_FNS[path, name] = scoring.load_custom_file(path, name)
  return _CUSTOM_FNS[path, name]


# ------------------------------------------------------------------------ worker processes

_START_MSG = struct.Struct("<qq")  # (call token, worker pid)
_started_pipe = None  # in a worker: where it says "I started call <token>"


def _worker_init(specs, started_pipe):
  global _started_pipe
  _started_pipe = started_pipe
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes the pool
  for spec in specs:  # load plug-ins before the first timed call
    resolve(spec)


def _call_row(spec, token, prompt, completion, fields):
  """Worker entry: one row through one function."""
  if _started_pipe is not None:  # one write < PIPE_BUF: atomic, no lock a dead worker could hold
    _started_pipe.send_bytes(_START_MSG.pack(token, os.getpid()))
  out = resolve(spec)([prompt], [completion], **{k: [v] for k, v in fields.items()})
  return list(out)


def lost(future) -> bool:
  """A call that never came back: its pool broke under it, or it was cancelled at a kill."""
  if not future.done() or future.cancelled():
    return True
  return isinstance(future.exception(), futures_process.BrokenProcessPool)


def describe_exit(code) -> str:
  if code is None:
    return "exit status unknown"
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exited with code {code}"


class WorkerPool:
  """A spawn ProcessPoolExecutor that knows when (and in which process) each call started."""

  def __init__(self, size: int, specs):
    ctx = multiprocessing.get_context("spawn")
    self.size = size
    self._reader, self._writer = ctx.Pipe(duplex=False)
    self.executor = concurrent.futures.ProcessPoolExecutor(
        size, mp_context=ctx, initializer=_worker_init, initargs=(tuple(specs), self._writer)
    )
    self.started: dict[int, tuple[float, int]] = {}  # running: token -> (monotonic time, pid)
    self.ever_started = False  # has any worker got as far as starting a call?
    self._procs: dict = {}  # pid -> multiprocessing.Process, every worker this pool had
    self._next_token = 0

  def submit(self, spec, prompt, completion, fields):
    """-> (future, token). Raises BrokenProcessPool/RuntimeError on a pool that cannot take it."""
    token = self._next_token
    self._next_token += 1
    future = self.executor.submit(_call_row, spec, token, prompt, completion, fields)
    self._procs.update(getattr(self.executor, "_processes", None) or {})
    return future, token

  def drain(self):
    try:
      while self._reader.poll():
        token, pid = _START_MSG.unpack(self._reader.recv_bytes())
        self.started[token] = (time.monotonic(), pid)
        self.ever_started = True
    except (EOFError, OSError):
      pass

  def exitcode_of(self, token):
    """The exit code of the worker that started call `token` (None: unknown)."""
    proc = self._procs.get(self.started.get(token, (None, None))[1])
    if proc is None:
      return None
    proc.join(timeout=5)
    return proc.exitcode

  def kill(self):
    """SIGKILL every worker (a hung call never returns), then reap them and the executor."""
    self._procs.update(getattr(self.executor, "_processes", None) or {})
    for proc in self._procs.values():
      try:
        if proc.is_alive():
          proc.kill()
      except (OSError, ValueError, AssertionError):
        pass
    self.executor.shutdown(wait=True, cancel_futures=True)
    for proc in self._procs.values():
      try:
        proc.join(timeout=5)
      except (OSError, ValueError, AssertionError):
        pass
    self.drain()
    for conn in (self._reader, self._writer):
      try:
        conn.close()
      except OSError:
        pass


# ---------------------------------------------------------------- in-process timeout (SIGALRM)


class CallTimeout(BaseException):
  """Raised inside a reward call by SIGALRM. BaseException, so `except Exception` in the reward
  function does not swallow it."""


def alarm_call(seconds, fn, *args, **kwargs):
  signal.setitimer(signal.ITIMER_REAL, seconds, _ALARM_REPEAT_SEC)
  try:
    return list(fn(*args, **kwargs))
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)


def on_alarm(signum, frame):
  del signum
  # Only inside the reward function: not in _alarm_call itself (before the call starts or after
  # it returned, while the timer is being cleared); the repeat fires again inside the call.
  if frame is not None and frame.f_code is alarm_call.__code__:
    return
  raise CallTimeout()


def alarm_usable() -> bool:
  return (
      hasattr(signal, "setitimer")
      and threading.current_thread() is threading.main_thread()
      and signal.getitimer(signal.ITIMER_REAL)[0] == 0
  )
