"""Weighted sum of named reward functions over a batch, with errors you can act on.

    rc = build_reward_computer(("check_answer", "match_format_exactly"), (1.0, 0.5))
    result = rc(prompts, completions, rows)     # rows: dicts with ground_truth, data_source, ...
    result.total        np.float32 [N]          weighted sum
    result.per_function {name: np.float32 [N]}  unweighted, for the reward/<name> metrics
    result.errors       int                     rows scored 0 because of an error (on_error=zero)

A function that raises, returns the wrong number of values, or returns NaN/inf/non-numbers is
reported with its name, the row index and a snippet of the completion. `on_error="raise"`
(default) stops the run with that message; `"zero"` scores the row 0 and counts it.
With `num_workers > 0` every row is scored in a spawned process pool with a per-call timeout
(a call past it counts as an error; the pool is restarted so a hung call cannot block).
"""
import dataclasses
import math
import multiprocessing
import numbers

import numpy as np

from grpo_jax.rewards import registry
from grpo_jax.rewards import scoring

CUSTOM = "custom"
# What a failing reward call does: stop the run, or score the row 0 and count it.
ON_ERROR = ("raise", "zero")


class RewardError(RuntimeError):
  pass


@dataclasses.dataclass
class RewardResult:
  total: np.ndarray
  per_function: dict[str, np.ndarray]
  errors: int


def _snippet(text: str, n: int = 120) -> str:
  text = text.replace("\n", "\\n")
  return repr(text if len(text) <= n else text[:n] + "...")


def _resolve(spec):
  """A reward function from ("builtin", name) or ("custom", path): picklable across processes."""
  kind, arg = spec
  if kind == "builtin":
    return registry.get(arg)
  return scoring.as_reward_fn(_custom_cache(arg))


_CUSTOM_FNS: dict = {}


def _custom_cache(path):
  if path not in _CUSTOM_FNS:
    _CUSTOM_FNS[path] = scoring.load_custom_file(path)
  return _CUSTOM_FNS[path]


def _call_row(spec, prompt, completion, fields):
  """Worker entry: one row through one function."""
  out = _resolve(spec)([prompt], [completion], **{k: [v] for k, v in fields.items()})
  return list(out)


class RewardComputer:

  def __init__(self, specs: dict[str, tuple], weights: dict[str, float], *,
               on_error: str = "raise", num_workers: int = 0, timeout_sec: float = 0.0):
    if on_error not in ON_ERROR:
      raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    self.specs = specs
    self.weights = weights
    self.fns = {name: _resolve(spec) for name, spec in specs.items()}
    self.on_error = on_error
    self.num_workers = num_workers
    self.timeout = timeout_sec if timeout_sec > 0 else None
    self._pool = None

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self.specs)

  def __call__(self, prompts: list[str], completions: list[str], rows: list[dict]) -> RewardResult:
    n = len(completions)
    fields = {k: [r.get(k) for r in rows] for k in ("ground_truth", "data_source", "extra_info")}
    per_fn, errors = {}, 0
    for name in self.specs:
      scores, errs = (self._score_pool(name, prompts, completions, fields) if self.num_workers
                      else self._score_inline(name, prompts, completions, fields))
      per_fn[name] = scores
      errors += errs
    total = np.zeros(n, np.float32)
    for name, s in per_fn.items():
      total += np.float32(self.weights[name]) * s
    return RewardResult(total=total, per_function=per_fn, errors=errors)

  # -------------------------------------------------------------------- validation of values

  def _checked(self, name, value, row, completion) -> float:
    ok = (isinstance(value, (numbers.Real, np.number)) and not isinstance(value, bool)
          and math.isfinite(float(value)))
    if not ok:
      raise RewardError(f"reward function '{name}' returned {value!r} (not a finite number) "
                        f"for row {row}, completion {_snippet(completion)}")
    return float(value)

  def _fail(self, msg: str) -> float:
    if self.on_error == "raise":
      raise RewardError(msg + ". Fix the function, or set --config.reward.on_error=zero to "
                        "score such rows 0 (counted in reward/errors)")
    return 0.0

  # ---------------------------------------------------------------------------- in-process

  def _score_inline(self, name, prompts, completions, fields):
    fn = self.fns[name]
    n = len(completions)
    try:
      values = list(fn(prompts, completions, **fields))
      if len(values) != n:
        raise RewardError(f"reward function '{name}' returned {len(values)} values for {n} "
                          "completions")
    except RewardError:
      raise
    except Exception:  # find the row(s) at fault, one at a time
      values = None
    out = np.zeros(n, np.float32)
    errors = 0
    for i in range(n):
      try:
        if values is None:
          v = fn([prompts[i]], [completions[i]], **{k: [f[i]] for k, f in fields.items()})[0]
        else:
          v = values[i]
        out[i] = self._checked(name, v, i, completions[i])
      except RewardError as e:
        out[i] = self._fail(str(e))
        errors += 1
      except Exception as e:
        out[i] = self._fail(f"reward function '{name}' raised {type(e).__name__}: {e} on row "
                            f"{i}, completion {_snippet(completions[i])}")
        errors += 1
    return out, errors

  # ------------------------------------------------------------------------- process pool

  def _pool_handle(self):
    if self._pool is None:
      self._pool = multiprocessing.get_context("spawn").Pool(self.num_workers)
    return self._pool

  def _score_pool(self, name, prompts, completions, fields):
    n = len(completions)
    out = np.zeros(n, np.float32)
    errors, pending = 0, list(range(n))
    while pending:
      pool = self._pool_handle()
      jobs = [(i, pool.apply_async(_call_row, (self.specs[name], prompts[i], completions[i],
                                               {k: f[i] for k, f in fields.items()})))
              for i in pending]
      pending = []
      for k, (i, job) in enumerate(jobs):
        try:
          out[i] = self._checked(name, job.get(timeout=self.timeout)[0], i, completions[i])
          continue
        except multiprocessing.TimeoutError:
          msg = (f"reward function '{name}' timed out after {self.timeout}s on row {i}, "
                 f"completion {_snippet(completions[i])}")
          self.close()  # a hung call would block its worker: restart the pool
          pending = [j for j, _ in jobs[k + 1:]]
        except RewardError as e:
          msg = str(e)
        except Exception as e:
          msg = (f"reward function '{name}' raised {type(e).__name__}: {e} on row {i}, "
                 f"completion {_snippet(completions[i])}")
        out[i] = self._fail(msg)
        errors += 1
        if pending:
          break
    return out, errors

  def close(self):
    if self._pool is not None:
      self._pool.terminate()
      self._pool.join()
      self._pool = None

  def __del__(self):
    try:
      self.close()
    except Exception:
      pass


def build_reward_computer(functions, weights, *, custom_file: str = "", custom_weight: float = 1.0,
                          on_error: str = "raise", num_workers: int = 0,
                          timeout_sec: float = 0.0) -> RewardComputer:
  """From config values: named functions with weights, plus an optional user file."""
  functions, weights = tuple(functions), tuple(weights)
  if len(functions) != len(weights):
    raise ValueError(f"{len(weights)} reward weights for {len(functions)} functions")
  specs = {name: ("builtin", name) for name in functions}
  w = dict(zip(functions, map(float, weights)))
  for name in functions:
    registry.get(name)  # unknown names fail here, with the list of known ones
  if custom_file:
    scoring.load_custom_file(custom_file)  # fail at start-up, not mid-run
    specs[CUSTOM] = ("custom", custom_file)
    w[CUSTOM] = float(custom_weight)
  if not specs:
    raise ValueError("no reward functions: set reward.functions or reward.custom_file")
  return RewardComputer(specs, w, on_error=on_error, num_workers=num_workers,
                        timeout_sec=timeout_sec)
