"""Runs the tool calls of many rows at once, on host threads, without ever raising into the engine.

    runner = ToolRunner(toolset, timeout_sec=10.0, max_workers=16, max_response_chars=16384)
    handle = runner.submit(row_id, fmt.parse_calls(turn_text))  # returns at once
    for handle in runner.poll():                                  # finished, each once
      text = fmt.response_text([r.text for r in handle.results])
    runner.finish(row_id)                                         # the row is done: release
    runner.stats()                                                # {"tool_call/calls": ...}

One result per call, in call order: ToolResult(name, text, status, seconds), status one of
STATUSES. Everything that can go wrong becomes a result whose text tells the model what happened:
a malformed call, an unknown tool, arguments over max_argument_bytes (refused before calling),
an exception ("ValueError: ..." with no traceback), a TimeoutError raised by the tool, and a
call still running timeout_sec after it started (time waiting for a free worker does not
count). A text longer than max_response_chars is cut (noted).

Threads: a pool of max_workers daemon threads. Calls of different rows, and the calls of one row
to different tools, run in parallel; calls of one row to the same stateful (class) tool run one
after another in call order (one job), since they share an instance. A watchdog thread answers
"timeout" for a call still running after timeout_sec and starts a fresh worker in its place: the
stuck thread is abandoned, not stopped (Python cannot stop a thread). If its call ever returns,
the result is dropped and the thread ends; if it never returns, it stays until the process
exits, so a tool that hangs for good leaks one thread per call. The python built-in is not
abandoned this way in practice: its sandbox process is killed a little before timeout_sec.
Function tools are called from several threads at once: they must be thread-safe.

Stateful tools: the first call of a class tool for a row calls create() (in the worker), later
calls of that row reuse the instance id, finish(row_id) releases every instance of the row.
"""

import dataclasses
import json
import queue
import threading
import time
from typing import Any

from grpo_jax.rollout.tools import formats
from grpo_jax.rollout.tools import spec

STATUSES = ("ok", "error", "timeout", "malformed", "unknown_tool", "too_large")
_COUNTERS = ("calls", "errors", "timeouts", "seconds")


@dataclasses.dataclass(frozen=True)
class ToolResult:
  name: str  # the tool called ("" when the call did not say)
  text: str  # what the model reads in its <tool_response>
  status: str  # one of STATUSES
  seconds: float  # time in the tool (0 for calls refused before running)


class ToolHandle:
  """One submit: a row's calls of one turn. `results` (in call order) once `ready()`."""

  def __init__(self, row_id, calls: list[formats.ParsedCall], collect: bool = True):
    self.row_id = row_id
    self.calls = calls
    self._results: list[ToolResult | None] = [None] * len(calls)
    self._left = len(calls)
    self._done = threading.Event()
    self._collect = collect  # poll() returns it (not so for finish()'s releases)
    if not calls:
      self._done.set()

  def ready(self) -> bool:
    return self._done.is_set()

  @property
  def results(self) -> list[ToolResult]:
    if not self._done.is_set():
      raise RuntimeError(f"the tool calls of row {self.row_id} are still running")
    return list(self._results)

  def __repr__(self):
    return f"ToolHandle(row={self.row_id}, calls={len(self.calls)}, ready={self.ready()})"


class _Job:
  """Calls run one after another by one worker: one call, or one row's calls of one stateful
  tool. `current` is the index running now, `deadline` its end."""

  def __init__(self, handle, indices, tool, release_id=None):
    self.handle, self.indices, self.tool = handle, indices, tool
    self.release_id = release_id  # a release job's instance id (finish)
    self.current = None
    self.deadline = None
    self.abandoned = False


class ToolRunner:
  """See the module docstring. `close()` (or a with block) stops the threads."""

  def __init__(
      self,
      toolset: spec.ToolSet,
      *,
      timeout_sec: float = 10.0,
      max_workers: int = 16,
      max_response_chars: int = 16384,
      max_argument_bytes: int = 1 << 20,
  ):
    self.toolset = toolset
    self.timeout_sec = float(timeout_sec)
    self.max_workers = int(max_workers)
    self.max_response_chars = int(max_response_chars)
    self.max_argument_bytes = int(max_argument_bytes)
    self._lock = threading.Condition()
    self._queue = queue.SimpleQueue()
    self._running: set[_Job] = set()
    self._finished: list[ToolHandle] = []
    self._instances: dict[Any, dict[str, Any]] = {}  # row -> {tool name: instance id}
    self._rows: set = set()
    self._threads: list[threading.Thread] = []
    self._abandoned = 0
    self._closed = False
    self._stats: dict[str, float] = {}
    self.reset_stats()

  # ---------------------------------------------------------------------------------- the API

  def start(self, row_id):
    """Marks a row as started (optional: submit starts it too). A row still holding instances
    must be finished first."""
    with self._lock:
      if self._instances.get(row_id):
        raise ValueError(f"row {row_id} still holds tool instances: finish(row_id) it first")
      self._rows.add(row_id)

  def submit(self, row_id, calls: list[formats.ParsedCall]) -> ToolHandle:
    """Queues a row's calls of one turn; returns at once."""
    handle = ToolHandle(row_id, list(calls))
    jobs: dict[Any, _Job] = {}
    with self._lock:
      if self._closed:
        raise RuntimeError("the tool runner is closed")
      self._rows.add(row_id)
      if not calls:
        self._finished.append(handle)
      for i, call in enumerate(handle.calls):
        refused = self._refuse(call)
        if refused is not None:
          self._set(handle, i, refused)
          continue
        tool = self.toolset.get(call.name)
        key = tool.name if tool.stateful else i  # a stateful tool's calls: one job, in order
        if key in jobs:
          jobs[key].indices.append(i)
        else:
          jobs[key] = _Job(handle, [i], tool)
      self._ensure_threads()
    for job in jobs.values():
      self._queue.put(job)
    return handle

  def poll(self) -> list[ToolHandle]:
    """The handles finished since the last poll (each returned once); never blocks."""
    with self._lock:
      done, self._finished = self._finished, []
    return done

  def wait(self, handles: list[ToolHandle], timeout: float | None = None) -> list[list[ToolResult]]:
    """Blocks until every handle is ready (at most about timeout_sec per call: the watchdog
    answers the stuck ones); their results. They are no longer returned by poll()."""
    end = None if timeout is None else time.monotonic() + timeout
    for h in handles:
      if not h._done.wait(None if end is None else max(0.0, end - time.monotonic())):
        raise TimeoutError(f"tool calls of row {h.row_id} not done after {timeout} s")
    with self._lock:
      ids = {id(h) for h in handles}
      self._finished = [h for h in self._finished if id(h) not in ids]
    return [h.results for h in handles]

  def finish(self, row_id) -> ToolHandle:
    """The row is done: release() every instance created for it (in the workers). The handle's
    results say how each release went; nothing waits for it unless you do."""
    with self._lock:
      self._rows.discard(row_id)
      instances = self._instances.pop(row_id, {})
      calls = [formats.ParsedCall(name, {}, None, "") for name in instances]
      handle = ToolHandle(row_id, calls, collect=False)
      jobs = [
          _Job(handle, [i], self.toolset.get(name), release_id=instance_id)
          for i, (name, instance_id) in enumerate(instances.items())
      ]
      if jobs:
        self._ensure_threads()
    for job in jobs:
      self._queue.put(job)
    return handle

  def stats(self) -> dict[str, float]:
    """Counters since the last reset: per tool and in total, metric names."""
    with self._lock:
      out = dict(self._stats)
      out["tool_call/abandoned_threads"] = self._abandoned
    return out

  def reset_stats(self):
    with self._lock:
      self._stats = {f"tool_call/{k}": 0 for k in _COUNTERS}
      self._stats.update({"tool_call/malformed": 0, "tool_call/unknown_tool": 0})
      for name in self.toolset.names:
        self._stats.update({f"tool_call/{name}/{k}": 0 for k in _COUNTERS})

  def close(self):
    """Stops the workers and the watchdog (an abandoned thread stays until its call returns)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      workers = [t for t in self._threads if t.name.startswith("tool-worker")]
      self._lock.notify_all()
    for _ in workers:
      self._queue.put(None)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -------------------------------------------------------------------------------- internals

  def _refuse(self, call: formats.ParsedCall) -> ToolResult | None:
    """The result of a call that is not run: malformed, unknown tool, arguments too large."""
    name = call.name or ""
    if call.error is not None:
      return ToolResult(name, f"Error: malformed tool call: {call.error}", "malformed", 0.0)
    if self.toolset.get(call.name) is None:
      known = ", ".join(self.toolset.names)
      return ToolResult(
          name, f"Error: unknown tool '{call.name}'; the tools are: {known}", "unknown_tool", 0.0
      )
    size = len(call.raw.encode("utf-8", "surrogatepass"))
    if size > self.max_argument_bytes:
      return ToolResult(
          name,
          f"Error: the call is {size} bytes; calls may be at most {self.max_argument_bytes}",
          "too_large",
          0.0,
      )
    return None

  def _ensure_threads(self):
    """Starts the workers and the watchdog on first use (under the lock)."""
    if not self._threads:
      self._threads.append(threading.Thread(target=self._watch, name="tool-watchdog", daemon=True))
      self._threads[0].start()
      for _ in range(self.max_workers):
        self._start_worker()

  def _start_worker(self):
    t = threading.Thread(target=self._work, name=f"tool-worker-{len(self._threads)}", daemon=True)
    self._threads.append(t)
    t.start()

  def _work(self):
    while (job := self._queue.get()) is not None:
      for i in job.indices:
        with self._lock:
          if job.abandoned:
            return
          job.current, job.deadline = i, time.monotonic() + self.timeout_sec
          self._running.add(job)
          self._lock.notify_all()  # the watchdog's next deadline
        start = time.monotonic()
        result = self._run_one(job, i)
        with self._lock:
          if job.abandoned:  # the watchdog answered for us: this thread is the spare one
            return
          self._running.discard(job)
          job.current = job.deadline = None
          self._set(job.handle, i, dataclasses.replace(result, seconds=time.monotonic() - start))

  def _run_one(self, job: _Job, i: int) -> ToolResult:
    tool, call = job.tool, job.handle.calls[i]
    try:
      if job.release_id is not None:
        tool.obj.release(job.release_id)
        return ToolResult(tool.name, "released", "ok", 0.0)
      kwargs = dict(call.arguments)
      if tool.takes_timeout:
        kwargs["timeout_sec"] = self.timeout_sec
      if tool.stateful:
        value = tool.fn(self._instance(job.handle.row_id, tool), **kwargs)
      else:
        value = tool.fn(**kwargs)
      return ToolResult(tool.name, self._clip(_as_text(value)), "ok", 0.0)
    except TimeoutError as e:
      return ToolResult(tool.name, self._clip(f"Error: TimeoutError: {e}"), "timeout", 0.0)
    except BaseException as e:  # noqa: BLE001 -- the tool's failure (SystemExit too) is the
      # model's to read; a worker thread has no KeyboardInterrupt to pass on
      return ToolResult(tool.name, self._clip(f"Error: {type(e).__name__}: {e}"), "error", 0.0)

  def _instance(self, row_id, tool: spec.Tool):
    """The row's instance id of a stateful tool, created at its first call (its calls in a row
    run in one job, so two creates cannot race)."""
    with self._lock:
      ids = self._instances.setdefault(row_id, {})
      if tool.name in ids:
        return ids[tool.name]
    instance_id = tool.obj.create()
    with self._lock:
      self._instances.setdefault(row_id, {})[tool.name] = instance_id
    return instance_id

  def _watch(self):
    with self._lock:
      while not self._closed:
        now = time.monotonic()
        for job in [j for j in self._running if j.deadline <= now]:
          self._abandon(job)
        deadlines = [j.deadline for j in self._running]
        self._lock.wait(None if not deadlines else max(0.0, min(deadlines) - now))

  def _abandon(self, job: _Job):
    """A call past its deadline: answer it (and the job's later calls) "timeout", leave its
    thread, start a worker in its place. Under the lock."""
    self._running.discard(job)
    job.abandoned = True
    self._abandoned += 1
    name = job.tool.name
    text = f"Error: the tool '{name}' did not answer within {self.timeout_sec:g} s"
    for i in job.indices[job.indices.index(job.current) :]:
      skipped = i != job.current
      self._set(
          job.handle,
          i,
          ToolResult(
              name,
              text + (" (an earlier call of this row timed out)" if skipped else ""),
              "timeout",
              0.0 if skipped else self.timeout_sec,
          ),
      )
    if not self._closed:
      self._start_worker()

  def _set(self, handle: ToolHandle, i: int, result: ToolResult):
    """Records one result and its counters; completes the handle with its last. Under the lock."""
    handle._results[i] = result
    if handle._collect:
      self._count(result)
    handle._left -= 1
    if handle._left == 0:
      handle._done.set()
      if handle._collect:
        self._finished.append(handle)

  def _count(self, r: ToolResult):
    prefixes = ["tool_call/"]
    if f"tool_call/{r.name}/calls" in self._stats:
      prefixes.append(f"tool_call/{r.name}/")
    bad = r.status not in ("ok", "timeout")
    for p in prefixes:
      self._stats[p + "calls"] += 1
      self._stats[p + "errors"] += bad
      self._stats[p + "timeouts"] += r.status == "timeout"
      self._stats[p + "seconds"] += r.seconds
    if r.status in ("malformed", "unknown_tool"):
      self._stats[f"tool_call/{r.status}"] += 1

  def _clip(self, text: str) -> str:
    if len(text) <= self.max_response_chars:
      return text
    cut = len(text) - self.max_response_chars
    return f"{text[: self.max_response_chars]}\n[truncated: {cut} more characters]"


def _as_text(value) -> str:
  """A tool's return value as the model reads it: a str as is, else JSON when it is JSON."""
  if isinstance(value, str):
    return value
  try:
    return json.dumps(value, ensure_ascii=False)
  except (TypeError, ValueError):
    return str(value)
