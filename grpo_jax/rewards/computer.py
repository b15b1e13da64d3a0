"""Weighted sum of named reward functions over a batch, with errors you can act on.

    rc = build_reward_computer(("check_answer", "match_format_exactly"), (1.0, 0.5))
    rc.check(rows[0])                           # start-up: every function once on a sample row
    result = rc(prompts, completions, rows)     # rows: dicts with ground_truth, data_source, ...
    result = rc.score_turns(turns, rows)        # completions with tool turns (conversation.py)
    result = rc.score_tool_rows(tokenizer, prompts, rows, tokens_nc, mask_nc, tool_nc)  # the same
    result.total        np.float32 [N]          weighted sum
    result.per_function {name: np.float32 [N]}  unweighted, for the reward/<name> metrics
    result.errors       int                     rows scored 0 because of an error (on_error=zero)

A function that raises, returns the wrong number of values, returns NaN/inf/non-numbers, runs
past `timeout_sec`, or kills the process scoring it is reported with its name, the row index
and a snippet of the completion. `on_error="raise"` (default) stops the run with that message;
`"zero"` scores the row 0, counts it, and logs one warning per batch and function (a louder
one when every row of the batch failed: that function then gives no learning signal).

Where the calls run:
  num_workers = 0, timeout_sec = 0   in this process, one batch call per function (a failing
                                     batch is re-run row by row to find the rows at fault).
  num_workers = 0, timeout_sec > 0   in this process, one call per row under a SIGALRM timer
                                     (signal.setitimer): a call past the timeout is interrupted
                                     by an exception raised inside it (a BaseException, so a
                                     broad `except Exception` in the function does not swallow
                                     it). This stops pure-Python hangs (loops, time.sleep, I/O
                                     waits), so a SIGTERM (preemption) that arrives meanwhile is
                                     acted on once the call times out. Code that holds the GIL in
                                     C (a C extension, a catastrophically backtracking regex)
                                     cannot be interrupted in-process: use num_workers > 0 for
                                     such functions. Off the main thread, or while something else
                                     runs an ITIMER_REAL timer, the calls go to one worker process.
  num_workers > 0                    one call per row in a pool of spawned worker processes
                                     (concurrent.futures.ProcessPoolExecutor). The timeout counts
                                     from the moment a worker starts the call (not from worker
                                     start-up); a call past it has the pool killed and restarted
                                     (the other calls in flight are re-run). A worker that dies
                                     (segfault, os._exit, SIGKILL, os.abort) breaks the pool:
                                     finished rows keep their scores, the pool is restarted, and
                                     the rows that were running are re-run one at a time, so only
                                     the row that kills its worker is scored per on_error
                                     (innocent rows keep their real scores). A worker stopped by
                                     SIGTERM (a preemption signalling the whole process group) is
                                     not blamed on its row: the row is re-run. Nothing waits on a
                                     dead worker; with timeout_sec = 0 a call that hangs without
                                     dying still blocks, so set a timeout.
The timeout bounds each call, not the batch: a function that hangs on every row costs
rows x timeout_sec (divided by num_workers with a pool) before the step can finish.
"""

import collections
import concurrent.futures
from concurrent.futures import process as futures_process
import dataclasses
import math
import numbers
import signal
import time

from absl import logging
import numpy as np

from grpo_jax.rewards import conversation
from grpo_jax.rewards import registry
from grpo_jax.rewards import scoring
from grpo_jax.rewards import workers

CUSTOM = "custom"
# What a failing reward call does: stop the run, or score the row 0 and count it.
ON_ERROR = ("raise", "zero")
# A worker that has not started a call this long after it was submitted: the pool cannot start.
WORKER_START_SEC = 120.0
# Pool restarts in a row that score nothing before giving up on the worker pool.
_MAX_FRUITLESS_RESTARTS = 5
_POLL_SEC = 0.5
# Calls in flight per worker: enough to keep workers busy between round trips.
_QUEUE_DEPTH = 4
_FIX = (
    "Fix the function, or set --config.reward.on_error=zero to score such rows 0 (counted "
    "in reward/errors)"
)


# Built-in functions that are verl's compute_score: with tool turns they score the final answer.
ANSWER_BUILTINS = ("verl_default",)

# Value types accepted in one vectorized check (bool is not among them: it is refused per row).
_PLAIN_NUMBERS = frozenset({float, int, np.float64, np.float32, np.float16, np.int64, np.int32})


class RewardError(RuntimeError):
  pass


@dataclasses.dataclass
class RewardResult:
  total: np.ndarray
  per_function: dict[str, np.ndarray]
  errors: int


def _snippet(text, n: int = 120) -> str:
  text = str(text).replace("\n", "\\n")
  return repr(text if len(text) <= n else text[:n] + "...")


def _one_line(text: str) -> str:
  return " ".join(str(text).split())


def row_fields(rows: list[dict]) -> dict[str, list]:
  """The keyword arguments reward functions get, one list entry per row: ground_truth,
  data_source, extra_info, and every column a table source carries (rows[i]["columns"]:
  parquet / hf_dataset pass their columns as TRL passes dataset columns). The three named
  fields win over columns of the same name (they are the checked, normalized values)."""
  fields = {k: [r.get(k) for r in rows] for k in ("ground_truth", "data_source", "extra_info")}
  for k in rows[0].get("columns", ()) if rows else ():
    if k not in fields and k not in ("prompts", "completions"):
      fields[k] = [r.get("columns", {}).get(k) for r in rows]
  return fields


def _row_fields(fields, i):
  return {k: [f[i]] for k, f in fields.items()}


class RewardComputer:

  def __init__(
      self,
      specs: dict[str, tuple],
      weights: dict[str, float],
      *,
      on_error: str = "raise",
      num_workers: int = 0,
      timeout_sec: float = 0.0,
  ):
    if on_error not in ON_ERROR:
      raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    self.specs = specs
    self.weights = weights
    self.fns = {name: workers.resolve(spec) for name, spec in specs.items()}
    self.on_error = on_error
    self.num_workers = num_workers
    self.timeout = timeout_sec if timeout_sec > 0 else None
    self._pool = None
    self._told_fallback = False

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.specs)

  def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> RewardResult:
    """Every function gets the prompt texts and completion texts."""
    return self._combine({name: (prompts, completions) for name in self.specs}, rows)

  def score_turns(self, turns: conversation.Turns, rows: list[dict]) -> RewardResult:
    """Completions with tool turns (rewards/conversation.py): TRL-style functions get TRL's
    shapes (message lists for conversational rows), compute_score (custom_file, verl_default)
    the final answer, the other built-in functions the whole texts."""
    views = {
        "builtin": (turns.prompts, turns.texts),
        "custom": (turns.prompts, turns.answers),
        "custom_trl": (turns.trl_prompts, turns.trl_completions),
    }
    picked = {}
    for name, (kind, arg) in self.specs.items():
      answer = kind == "builtin" and arg in ANSWER_BUILTINS
      picked[name] = views["custom"] if answer else views[kind]
    return self._combine(picked, rows)

  def score_tool_rows(
      self, tokenizer, prompts: list[str], rows: list[dict], tokens_nc, mask_nc, tool_nc
  ) -> RewardResult:
    """score_turns of N rollout rows: tokens_nc, mask_nc, tool_nc [N, C] (tool_nc: 1 on the
    tool-response tokens; conversation.build)."""
    turns = conversation.build(tokenizer, prompts, rows, tokens_nc, mask_nc, tool_nc)
    return self.score_turns(turns, rows)

  def _combine(self, inputs: dict[str, tuple[list, list]], rows: list[dict]) -> RewardResult:
    """inputs: function name -> (prompts, completions) it is called with."""
    n = len(rows)
    fields = row_fields(rows)
    stop = self.on_error == "raise"
    per_fn, errors = {}, 0
    for name in self.specs:
      prompts, completions = inputs[name]
      scores, failures = self._score(name, prompts, completions, fields, stop)
      if failures:
        if stop:
          raise RewardError(f"{failures[0]}. {_FIX}")
        self._warn(name, failures, n)
      per_fn[name] = scores
      errors += len(failures)
    total = np.zeros(n, np.float32)
    for name, s in per_fn.items():
      total += np.float32(self.weights[name]) * s
    return RewardResult(total=total, per_function=per_fn, errors=errors)

  def check(self, row: dict) -> dict[str, float]:
    """Every reward function once on a sample row (its prompt, its ground truth as the
    completion), under the same timeout and worker pool as training: a broken plug-in or a
    function that cannot read these rows fails here, at start-up, with one line. -> {name: score}
    """
    truth = row.get("ground_truth")
    if isinstance(truth, (list, tuple)):
      truth = truth[0] if truth else ""
    completion = "" if truth is None else str(truth)
    fields = row_fields([row])
    scores = {}
    for name, (kind, arg) in self.specs.items():
      try:
        out, failures = self._score(name, [row.get("prompt", "")], [completion], fields, True)
      except RewardError as e:
        out, failures = None, [str(e)]
      if failures:
        where = (
            f"reward.custom_file={arg}"
            if kind == "custom"
            else f"{arg[1]} in reward.custom_file={arg[0]}"
            if kind == "custom_trl"
            else f"'{arg}' (or drop it from reward.functions; check the rows carry the "
            "ground_truth/data_source it needs)"
        )
        raise RewardError(
            _one_line(
                f"reward start-up check failed: {failures[0]} (sample row: its ground truth as the "
                f"completion, data_source {row.get('data_source')!r}). Fix {where} before training"
            )
        )
      scores[name] = float(out[0])
    return scores

  def _score(self, name, prompts, completions, fields, stop):
    """-> (scores [N] float32, failure messages). stop: return at the first failure."""
    if self.num_workers > 0:
      return self._score_pool(name, prompts, completions, fields, stop)
    if self.timeout is None:
      return self._score_inline(name, prompts, completions, fields, stop)
    if workers.alarm_usable():
      return self._score_inline_timed(name, prompts, completions, fields, stop)
    if not self._told_fallback:
      self._told_fallback = True
      logging.info(
          "reward.timeout_sec with reward.num_workers=0, but SIGALRM is not usable here "
          "(not the main thread, or a timer is already running): scoring in 1 worker "
          "process"
      )
    return self._score_pool(name, prompts, completions, fields, stop)

  def _warn(self, name, failures, n):
    if len(failures) == n:
      logging.warning(
          "reward function '%s' FAILED ON EVERY ROW (%d of %d) of this batch: it scores every row "
          "0 and gives no learning signal (reward.on_error=zero). First error: %s",
          name,
          len(failures),
          n,
          failures[0],
      )
    else:
      logging.warning(
          "reward function '%s' failed on %d of %d rows of this batch (scored 0, "
          "reward.on_error=zero). First error: %s",
          name,
          len(failures),
          n,
          failures[0],
      )

  # -------------------------------------------------------------------- messages and values

  def _checked(self, name, value, row, completion) -> float:
    ok = (
        isinstance(value, (numbers.Real, np.number))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )
    if not ok:
      raise RewardError(
          f"reward function '{name}' returned {value!r} (not a finite number) "
          f"for row {row}, completion {_snippet(completion)}"
      )
    return float(value)

  @staticmethod
  def _raised(name, e, i, completion) -> str:
    return (
        f"reward function '{name}' raised {type(e).__name__}: {_one_line(e)} on row {i}, "
        f"completion {_snippet(completion)}"
    )

  def _timed_out(self, name, i, completion, where) -> str:
    return (
        f"reward function '{name}' timed out after {self.timeout}s on row {i} ({where}), "
        f"completion {_snippet(completion)}"
    )

  def _row_value(self, name, values, i, completion) -> float:
    if len(values) != 1:
      raise RewardError(
          f"reward function '{name}' returned {len(values)} values for 1 " f"completion (row {i})"
      )
    return self._checked(name, values[0], i, completion)

  # ---------------------------------------------------------------------------- in-process

  def _score_inline(self, name, prompts, completions, fields, stop):
    fn = self.fns[name]
    n = len(completions)
    try:
      values = list(fn(prompts, completions, **fields))
      if len(values) != n:
        raise RewardError(
            f"reward function '{name}' returned {len(values)} values for {n} " "completions"
        )
    except RewardError:
      raise
    except Exception:  # find the row(s) at fault, one at a time
      values = None
    if values is not None and all(type(v) in _PLAIN_NUMBERS for v in values):
      try:  # every value fine: no per-row checks (host time between device programs)
        out = np.asarray(values, np.float64)
        if np.isfinite(out).all():
          return out.astype(np.float32), []
      except OverflowError:  # an int beyond float range: the per-row pass names the row
        pass
    out = np.zeros(n, np.float32)
    failures = []
    for i in range(n):
      try:
        if values is None:
          v = fn([prompts[i]], [completions[i]], **_row_fields(fields, i))[0]
        else:
          v = values[i]
        out[i] = self._checked(name, v, i, completions[i])
        continue
      except RewardError as e:
        failures.append(str(e))
      except Exception as e:
        failures.append(self._raised(name, e, i, completions[i]))
      if stop:
        break
    return out, failures

  def _score_inline_timed(self, name, prompts, completions, fields, stop):
    """One call per row, each under a SIGALRM timer (main thread only)."""
    fn = self.fns[name]
    n = len(completions)
    out = np.zeros(n, np.float32)
    failures = []
    previous = signal.signal(signal.SIGALRM, workers.on_alarm)
    try:
      for i in range(n):
        try:
          values = workers.alarm_call(
              self.timeout, fn, [prompts[i]], [completions[i]], **_row_fields(fields, i)
          )
          out[i] = self._row_value(name, values, i, completions[i])
          continue
        except workers.CallTimeout:
          failures.append(self._timed_out(name, i, completions[i], "in-process"))
        except RewardError as e:
          failures.append(str(e))
        except Exception as e:
          failures.append(self._raised(name, e, i, completions[i]))
        if stop:
          break
    finally:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, previous)
    return out, failures

  # ------------------------------------------------------------------------- process pool

  def _pool_handle(self) -> workers.WorkerPool:
    if self._pool is None:
      self._pool = workers.WorkerPool(max(1, self.num_workers), self.specs.values())
    return self._pool

  def _restart_pool(self):
    if self._pool is not None:
      pool, self._pool = self._pool, None
      pool.kill()

  def _score_pool(self, name, prompts, completions, fields, stop):
    """Rows go to the pool, up to _QUEUE_DEPTH per worker in flight (one at a time while
    isolating suspects). A call past the timeout gets the pool killed and restarted (the other
    calls in flight are re-queued). A worker that dies breaks the pool: finished calls keep
    their scores, calls that had not started are re-queued, and of those that had started (the
    dead worker's among them) a single one is the culprit; several become suspects, re-run one
    at a time in the fresh pool until each has scored or killed its worker alone."""
    n = len(completions)
    out = np.zeros(n, np.float32)
    failures = []
    todo, suspects = collections.deque(range(n)), collections.deque()
    spec = self.specs[name]
    fruitless = 0

    def failed(msg) -> bool:  # -> stop scoring now
      failures.append(msg)
      if stop:
        self._restart_pool()  # calls still in flight would hold up the next batch
      return stop

    def take(f, i) -> bool:
      try:
        out[i] = self._row_value(name, f.result(), i, completions[i])
        return False
      except RewardError as e:
        return failed(str(e))
      except Exception as e:
        return failed(self._raised(name, e, i, completions[i]))

    while todo or suspects:
      pool = self._pool_handle()
      inflight = {}  # future -> (row, token, submit time, came from suspects)
      broken = None  # "dead": a worker died; "timeout": we kill it; "unusable": submit refused
      progress = False
      while (todo or suspects or inflight) and not broken:
        limit = 1 if suspects else pool.size * _QUEUE_DEPTH
        while (todo or suspects) and len(inflight) < limit:
          source = suspects or todo
          i = source.popleft()
          try:
            f, token = pool.submit(
                spec, prompts[i], completions[i], {k: v[i] for k, v in fields.items()}
            )
          except (futures_process.BrokenProcessPool, RuntimeError):
            source.appendleft(i)
            broken = "unusable"
            break
          inflight[f] = (i, token, time.monotonic(), source is suspects)
        if broken:
          break
        # -- wait for a result, a death, or the nearest deadline
        pool.drain()
        deadlines = [
            pool.started[token][0] + self.timeout
            for (_, token, _, _) in inflight.values()
            if self.timeout and token in pool.started
        ]
        if not pool.ever_started:  # workers still starting up
          deadlines += [submitted + WORKER_START_SEC for (_, _, submitted, _) in inflight.values()]
        wait = min([_POLL_SEC] + [max(0.0, d - time.monotonic()) for d in deadlines])
        done, _ = concurrent.futures.wait(
            list(inflight), timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED
        )
        pool.drain()
        for f in done:
          if workers.lost(f):
            broken = "dead"
            continue
          progress = True
          i, token, _, _ = inflight.pop(f)
          pool.started.pop(token, None)
          if take(f, i):
            return out, failures
        if broken:
          break
        # -- calls past their deadline
        now = time.monotonic()
        for f, (i, token, submitted, _) in list(inflight.items()):
          if token in pool.started:
            if self.timeout and now >= pool.started[token][0] + self.timeout and not f.done():
              del inflight[f]
              broken, progress = "timeout", True
              if failed(self._timed_out(name, i, completions[i], "in a worker process")):
                return out, failures
          elif not pool.ever_started and now >= submitted + WORKER_START_SEC:
            self._restart_pool()
            raise RewardError(
                f"reward worker processes did not start a call within {WORKER_START_SEC:.0f}s "
                f"(reward.num_workers={self.num_workers}): check that the reward functions "
                "import cleanly in a fresh process"
            )
      if not broken:
        continue  # every row scored
      # -- the pool has to go: keep what finished, sort out what was lost
      self._pool = None
      pool.kill()
      started_lost = []
      for f, (i, token, _, was_suspect) in inflight.items():
        if not workers.lost(f):
          progress = True
          if take(f, i):
            return out, failures
        elif token in pool.started:
          started_lost.append((i, token, was_suspect))
        else:  # never started: innocent (a call tells the parent before it runs)
          (suspects if was_suspect else todo).appendleft(i)
      code = pool.exitcode_of(started_lost[0][1]) if len(started_lost) == 1 else None
      if broken == "dead" and code == -signal.SIGTERM:
        # Terminated from outside (a preemption's SIGTERM to the whole process group, or the
        # executor stopping it because another worker died): not this row's fault.
        logging.warning(
            "reward function '%s': a reward worker process was terminated "
            "(SIGTERM); restarting the pool and re-running its row",
            name,
        )
        i, _, was_suspect = started_lost[0]
        (suspects if was_suspect else todo).appendleft(i)
      elif broken == "dead" and len(started_lost) == 1:
        i, token, _ = started_lost[0]
        progress = True
        how = workers.describe_exit(code)
        logging.warning(
            "reward function '%s': the worker process scoring row %d died (%s); "
            "restarting the reward worker pool",
            name,
            i,
            how,
        )
        if failed(
            f"reward function '{name}' killed the worker process scoring row {i} "
            f"({how}), completion {_snippet(completions[i])}"
        ):
          return out, failures
      elif broken == "dead" and started_lost:
        logging.warning(
            "reward function '%s': a reward worker process died with %d calls "
            "running; restarting the pool and re-running them one at a time",
            name,
            len(started_lost),
        )
        suspects.extendleft(i for i, _, _ in reversed(started_lost))
      else:  # we killed it (timeout), or a worker died idle: the calls were innocent
        for i, _, was_suspect in reversed(started_lost):
          (suspects if was_suspect else todo).appendleft(i)
      # A pool that dies before starting a call (or keeps dying) is retried a few times: a
      # SIGTERM to the process group can hit workers that are still starting up.
      fruitless = 0 if progress else fruitless + 1
      if fruitless > _MAX_FRUITLESS_RESTARTS:
        why = (
            "its worker processes died before starting any call"
            if not pool.ever_started
            else "it broke without scoring a row"
        )
        raise RewardError(
            f"reward worker pool (reward.num_workers={self.num_workers}) restarted {fruitless} "
            f"times in a row for '{name}': {why}. Check that the reward functions import "
            "cleanly in a fresh process (python -c 'import ...'), or set reward.num_workers=0"
        )
    return out, failures

  def close(self):
    self._restart_pool()

  def __del__(self):
    try:
      self.close()
    except Exception:
      pass


def from_config(reward, **overrides) -> RewardComputer:
  """build_reward_computer from config.reward (`overrides` replace its keyword values)."""
  kwargs = dict(
      custom_file=reward.custom_file,
      custom_function=reward.custom_function,
      custom_weight=reward.custom_weight,
      on_error=reward.on_error,
      num_workers=reward.num_workers,
      timeout_sec=reward.timeout_sec,
  )
  kwargs.update(overrides)
  return build_reward_computer(reward.functions, reward.weights, **kwargs)


def build_reward_computer(
    functions,
    weights,
    *,
    custom_file: str = "",
    custom_function: str = "",
    custom_weight: float = 1.0,
    on_error: str = "raise",
    num_workers: int = 0,
    timeout_sec: float = 0.0,
) -> RewardComputer:
  """From config values: named functions with weights, plus an optional user file: verl's
  `compute_score` in it, or (custom_function set) that TRL-style batch function."""
  functions, weights = tuple(functions), tuple(weights)
  if len(functions) != len(weights):
    raise ValueError(f"{len(weights)} reward weights for {len(functions)} functions")
  specs = {name: ("builtin", name) for name in functions}
  w = dict(zip(functions, map(float, weights)))
  for name in functions:
    registry.get(name)  # unknown names fail here, with the list of known ones
  if custom_function and not custom_file:
    raise ValueError("reward.custom_function needs reward.custom_file (the .py defining it)")
  if custom_file:
    scoring.load_custom_file(custom_file, custom_function)  # fail at start-up, not mid-run
    specs[CUSTOM] = (
        ("custom_trl", (custom_file, custom_function))
        if custom_function
        else ("custom", custom_file)
    )
    w[CUSTOM] = float(custom_weight)
  if not specs:
    raise ValueError("no reward functions: set reward.functions or reward.custom_file")
  return RewardComputer(
      specs, w, on_error=on_error, num_workers=num_workers, timeout_sec=timeout_sec
  )
