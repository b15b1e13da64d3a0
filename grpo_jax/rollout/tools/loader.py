"""The run's tools from the config: built-in names and a user's .py file, like reward plug-ins.

    toolset = load_tools(config.rollout.tools.file, config.rollout.tools.names)  # None: no tools

`names` is comma-separated ("" = no tools). Each name is a top-level function or class of the
file (spec.py: the two conventions), or a built-in (builtin.py: python, calculator); a name the
file defines wins over a built-in of the same name. The file is imported once, by path (local
or gs://, as rewards/scoring.py imports a reward file). Every problem is one ToolConfigError line
naming the file, the tool and the fix, raised at start-up rather than mid-run.
"""

import importlib.util
import inspect
import traceback

from grpo_jax.rollout.tools import builtin
from grpo_jax.rollout.tools import spec
from grpo_jax.run import paths


def load_tools(file: str, names: str) -> spec.ToolSet | None:
  """The ToolSet of `names` (comma-separated; "" -> None), from `file` and the built-ins."""
  wanted = [n.strip() for n in names.split(",") if n.strip()]
  if not wanted:
    return None
  module = _import(file) if file else None
  tools = []
  for name in wanted:
    obj = getattr(module, name, None) if module is not None else None
    where = f"rollout.tools.file={file}" if obj is not None else "built-in"
    if obj is None and name in builtin.BUILTINS:
      obj = builtin.BUILTINS[name]
    if obj is None:
      raise spec.ToolConfigError(_not_found(file, module, name))
    try:
      tools.append(spec.make_tool(obj, name=name, hidden=builtin.HIDDEN.get(name, ())))
    except spec.ToolConfigError as e:
      raise spec.ToolConfigError(f"rollout.tools ({where}): {e}") from None
  try:
    return spec.ToolSet(tools)
  except spec.ToolConfigError as e:
    raise spec.ToolConfigError(f"rollout.tools.names={names!r}: {e}") from None


def _import(file: str):
  if not paths.exists(file):
    raise spec.ToolConfigError(
        f"rollout.tools.file={file!r} does not exist; fix: the path of a .py file defining the "
        "tools (or '' for built-ins only)"
    )
  local = str(paths.local_copy(file, ".py"))
  module_spec = importlib.util.spec_from_file_location(f"grpo_user_tools_{abs(hash(file))}", local)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # noqa: BLE001 -- anything the user's file raises
    line = _line_in(e, local)
    raise spec.ToolConfigError(
        f"rollout.tools.file={file}{f':{line}' if line else ''}: importing it failed: "
        f"{type(e).__name__}: {_one_line(e)}; fix: the file must import on its own "
        f"(python {file})"
    ) from None
  return module


def _line_in(e: Exception, local: str) -> int | None:
  """The line of the user's file where the import failed (the innermost frame in it)."""
  if isinstance(e, SyntaxError) and e.filename == local:
    return e.lineno
  lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == local]
  return lines[-1] if lines else None


def _one_line(e: Exception) -> str:
  text = e.msg if isinstance(e, SyntaxError) else str(e)
  return " ".join(text.split())[:300]


def _not_found(file: str, module, name: str) -> str:
  builtins = ", ".join(builtin.BUILTINS)
  if module is None:
    return (
        f"rollout.tools.names: '{name}' is not a built-in tool ({builtins}) and "
        "rollout.tools.file is empty; fix: set rollout.tools.file to the .py file defining it"
    )
  defined = sorted(
      k
      for k, v in vars(module).items()
      if not k.startswith("_")
      and (inspect.isfunction(v) or inspect.isclass(v))
      and getattr(v, "__module__", None) == module.__name__
  )
  return (
      f"rollout.tools.file={file} defines no tool '{name}' (it defines "
      f"{', '.join(defined) or 'no functions or classes'}; built-ins: {builtins}); fix: the name "
      "of a top-level function or class there, in rollout.tools.names"
  )
