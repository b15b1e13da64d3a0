"""Sandboxed code-execution reward: the fraction of a row's test statements a completion passes.

    score(solution_str, tests, *, timeout_sec=5.0) -> float      (the stable entry point)

`tests` is a list of Python statements (typically `assert f(2) == 4`). The program is the LAST
fenced code block of the completion tagged python/py/python3 or untagged (models tend to show
drafts first and the final answer last; an unterminated last fence, as in a cut-off generation,
runs to the end of the text), else the whole completion. It runs once with
`__name__ == "__solution__"` (an `if __name__ == "__main__":` block is skipped, stdin is
/dev/null); if it does not load (syntax error, exception, exit) the score is 0 and no test runs.
Then every test runs in the program's namespace, each in its own try/except with its own
share of the remaining time (per-test SIGALRM); the score is passed / len(tests). Programs see
the standard library only (`python -I -S`: no site-packages, no environment variables read).

Registered as the reward `code_tests` (rows: tests in `ground_truth`, a list of statements or a
JSON string of one, else `extra_info["tests"]`; a plain non-JSON string is one test), and routed
from verl_default for data_source "code" / "code_generation". The per-row timeout is
`extra_info["timeout_sec"]` if given, else DEFAULT_TIMEOUT_SEC (5 s); `reward.timeout_sec` is
the process pool's per-call timeout (rows are scored one per call there), so it should be at
least the sandbox timeout + a few seconds when both are used. A batch runs its completions
concurrently, up to min(16, CPU count) sandboxes at a time.

The sandbox (process tree, guards, what each OS layer enforces) is grpo_jax/rewards/sandbox.py.
"""

import json
import os

from grpo_jax.rewards.sandbox import DEFAULT_TIMEOUT_SEC
from grpo_jax.rewards.sandbox import MAX_WORKERS
from grpo_jax.rewards.sandbox import run_sandboxed
from grpo_jax.rewards.sandbox import sandbox_info  # noqa: F401  (re-exported)
from grpo_jax.rewards.sandbox import SandboxResult  # noqa: F401  (re-exported)

DATA_SOURCES = ("code", "code_generation")
_PY_LANGS = ("", "python", "py", "python3", "py3")


# ================================================================================ extraction


def extract_program(text: str) -> str:
  """The last ```python / ```py / ```python3 / untagged fenced block, else the whole text.

  A line whose stripped form starts with ``` opens a block (its first word is the language) or
  closes the open one; an unterminated block at the end runs to the end of the text."""
  blocks, cur, lang = [], None, ""
  for line in text.splitlines(keepends=True):
    s = line.strip()
    if cur is None:
      if s.startswith("```"):
        words = s[3:].strip().split()
        lang, cur = (words[0].lower() if words else ""), []
    elif s.startswith("```"):
      blocks.append((lang, "".join(cur)))
      cur = None
    else:
      cur.append(line)
  if cur is not None:
    blocks.append((lang, "".join(cur)))
  python = [b for lang, b in blocks if lang in _PY_LANGS]
  return python[-1] if python else text


def parse_tests(ground_truth=None, extra_info=None) -> list[str]:
  """Test statements of a row: ground_truth as a list, a JSON list, a dict with "tests" /
  "test_list", or a plain string (one test); else extra_info["tests"] likewise."""
  for src in (
      ground_truth,
      (extra_info or {}).get("tests") if isinstance(extra_info, dict) else None,
  ):
    tests = _as_tests(src)
    if tests:
      return tests
  raise ValueError(
      "code reward: the row has no test cases; give a list of test statements "
      '(e.g. ["assert f(2) == 4"]) in ground_truth (or a JSON string of one) '
      "or in extra_info['tests']"
  )


def _as_tests(src):
  if src is None:
    return None
  if isinstance(src, dict):
    return _as_tests(src.get("tests", src.get("test_list")))
  if isinstance(src, (bytes, bytearray)):
    src = src.decode("utf-8", "replace")
  if isinstance(src, str):
    s = src.strip()
    if not s:
      return None
    if s[0] in "[{":
      try:
        return _as_tests(json.loads(s))
      except ValueError:
        pass
    return [src]
  try:
    tests = [str(t) for t in src]  # list, tuple, numpy array of str
  except TypeError:
    return None
  return tests or None


def score(solution_str: str, tests, *, timeout_sec: float = DEFAULT_TIMEOUT_SEC) -> float:
  """Fraction of `tests` (Python statements) that pass after the program extracted from
  `solution_str` runs, in a fresh sandbox (see the module docstring). Raises RuntimeError only
  when the sandbox itself cannot start; whatever the program does scores in [0, 1]."""
  res = run_sandboxed(extract_program(solution_str), tests, timeout_sec=timeout_sec)
  if res.setup_error:
    raise RuntimeError(f"code reward: the sandbox failed to start: {res.setup_error}")
  return res.score


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
  """verl's interface, for data_source "code" / "code_generation"."""
  del data_source
  timeout = DEFAULT_TIMEOUT_SEC
  if isinstance(extra_info, dict) and extra_info.get("timeout_sec"):
    timeout = float(extra_info["timeout_sec"])
  return score(solution_str, parse_tests(ground_truth, extra_info), timeout_sec=timeout)


def code_tests(
    prompts, completions, ground_truth=None, extra_info=None, data_source=None, **_
) -> list[float]:
  """Reward: fraction of the row's test statements passed, each completion in its own sandbox
  (concurrently). Tests: ground_truth (list / JSON list / one statement) or extra_info["tests"]."""
  del prompts, data_source
  n = len(completions)
  ground_truth = list(ground_truth) if ground_truth is not None else [None] * n
  extra_info = list(extra_info) if extra_info is not None else [None] * n
  jobs = [(c, gt, ei) for c, gt, ei in zip(completions, ground_truth, extra_info)]
  if n <= 1:
    return [compute_score("code", *job) for job in jobs]
  from concurrent.futures import ThreadPoolExecutor

  with ThreadPoolExecutor(max_workers=min(n, MAX_WORKERS, os.cpu_count() or 1)) as pool:
    return list(pool.map(lambda job: compute_score("code", *job), jobs))
