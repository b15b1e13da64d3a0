"""The built-in tools, usable by name without a file: `python` and `calculator`.

    calculator(expression="123*45")       # -> "5535"
    python(code="print(2**10)")           # -> "1024\n", run in grpo_jax/rewards/sandbox.py

Both are plain functions in the user convention (spec.py derives their schemas), so they read
as examples of a tool. Failures raise: the runner turns an exception into an error message for
the model ("ValueError: ..."), and a TimeoutError into a "timeout" result.

calculator: + - * / // % ** and parentheses, unary + and -, int and float literals. The
expression is parsed with `ast` and evaluated by walking the tree (no eval, no names, no calls,
no attributes). Before an operation that can grow a number it checks the size of the result:
an integer of more than MAX_INT_BITS bits (9**9**9, 10**10**6 * ...) is refused at once, as are
non-finite and complex results.

python: the code runs in a fresh sandbox process (the code reward's: namespaces, rlimits, the
audit hook; see that module's docstring) with its stdout and stderr captured, at most
OUTPUT_BYTES of each (truncation noted). An exception in the code is part of the output (its
traceback on stderr, as a terminal shows it), not a tool error; running out of time is a
TimeoutError (status "timeout") with the output so far. The runner passes its own timeout_sec;
the sandbox gets a little less so that it answers before the runner gives up on it.
"""

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 2000
MAX_INT_BITS = 4000  # ~1200 decimal digits
OUTPUT_BYTES = 4096  # python: stdout and stderr, each
MEMORY_BYTES = 1 << 30  # python: RLIMIT_AS of the sandbox

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression and returns the result.

  Args:
    expression: Numbers with + - * / // % ** (power) and parentheses, e.g. "(3 + 4.5) * 2**3".
  """
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError) as e:
    raise ValueError(f"not an arithmetic expression: {getattr(e, 'msg', e)}") from None
  try:
    value = _evaluate(tree.body)
  except RecursionError:
    raise ValueError("the expression is nested too deeply") from None
  return str(value)


def _evaluate(node):
  if isinstance(node, ast.Constant):
    if type(node.value) not in (int, float):
      raise ValueError(f"only numbers are allowed, not {node.value!r}")
    return _checked(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    _check_growth(type(node.op), left, right)
    try:
      return _checked(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise ValueError("division by zero") from None
    except OverflowError:
      raise ValueError("the result is too large") from None
  what = type(node).__name__
  if isinstance(node, ast.Name):
    what = f"the name '{node.id}'"
  elif isinstance(node, ast.Call):
    what = "a function call"
  raise ValueError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_growth(op, left, right):
  """Refuses an integer result of more than MAX_INT_BITS before computing it."""
  if not (isinstance(left, int) and isinstance(right, int)):
    return
  if op is ast.Pow and right > 0 and abs(left) > 1:
    if right > MAX_INT_BITS or (abs(left).bit_length() - 1) * right > MAX_INT_BITS:
      raise ValueError(f"the result would have more than {MAX_INT_BITS} bits")
  if op is ast.Mult and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
    raise ValueError(f"the result would have more than {MAX_INT_BITS} bits")


def _checked(value):
  if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
    raise ValueError(f"the result has more than {MAX_INT_BITS} bits")
  if isinstance(value, float) and not math.isfinite(value):
    raise ValueError("the result is not a finite number")
  if not isinstance(value, (int, float)):  # (-8) ** 0.5 is complex
    raise ValueError("the result is not a real number")
  return value


def python(code: str, *, timeout_sec: float = 10.0) -> str:
  """Runs Python code in a fresh sandbox (no network, no state kept) and returns its output.

  Args:
    code: The Python program to run; print() the values you want to see.
  """
  from grpo_jax.rewards import sandbox

  limit = max(0.5, timeout_sec - min(1.0, 0.2 * timeout_sec))  # answer before the runner quits
  res = sandbox.run_sandboxed(
      _wrapped(code), [], timeout_sec=limit, memory_bytes=MEMORY_BYTES, capture_bytes=OUTPUT_BYTES
  )
  if res.setup_error:
    raise RuntimeError(f"the sandbox failed to start: {res.setup_error}")
  text = _clip(res.stdout, res.stdout_size)
  if res.stderr_size:
    text += ("\n" if text and not text.endswith("\n") else "") + _clip(res.stderr, res.stderr_size)
  if res.timed_out or res.load_error == "timeout":
    raise TimeoutError(f"the code ran longer than {limit:g} s; its output so far:\n{text}")
  if not res.loaded:  # killed by a limit, or an exception the wrapper does not catch
    why = res.load_error or "killed: a memory, CPU or process limit"
    text += ("\n" if text and not text.endswith("\n") else "") + f"[the program ended: {why}]"
  return text or "(no output)"


def _clip(text, size) -> str:
  if size <= OUTPUT_BYTES:
    return text
  return f"{text}\n[truncated: {size - OUTPUT_BYTES} more bytes]\n"


def _wrapped(code: str) -> str:
  """The program the sandbox runs: `code` as __main__, an exception's traceback on stderr (the
  wrapper's own frame left out), SystemExit as a normal end. BaseExceptions other than
  SystemExit pass (the sandbox's own timeout is one)."""
  return (
      "import sys\n"
      f"_source = {code!r}\n"
      "try:\n"
      "  import linecache\n"
      "  linecache.cache['<code>'] = (len(_source), None, _source.splitlines(True), '<code>')\n"
      "except ImportError:\n"
      "  pass\n"
      "try:\n"
      "  exec(compile(_source, '<code>', 'exec'), {'__name__': '__main__'})\n"
      "except SystemExit as e:\n"
      "  if e.code not in (None, 0):\n"
      "    print(f'SystemExit: {e.code}', file=sys.stderr)\n"
      "except Exception as e:\n"
      "  try:\n"
      "    import traceback\n"
      "    traceback.print_exception(type(e), e, e.__traceback__.tb_next)\n"
      "  except ImportError:\n"
      "    print(f'{type(e).__name__}: {e}', file=sys.stderr)\n"
  )


BUILTINS = {"calculator": calculator, "python": python}
HIDDEN = {"python": ("timeout_sec",)}  # parameters the runner fills, not the model
