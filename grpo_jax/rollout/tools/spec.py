"""A tool as the model sees it: its name and JSON schema, derived from the Python a user wrote.

    tool = make_tool(fn)            # a function with type hints and a Google-style docstring
    tool = make_tool(MyToolClass)   # a class with create / call / release (stateful)
    ToolSet([tool, ...]).schemas()  # what a chat template's `tools=` takes

Two conventions, so tools written for TRL or verl plug in as they are:
- A function (TRL's): the schema comes from the signature and the docstring exactly as
  transformers.utils.get_json_schema derives it (description = the docstring up to `Args:`;
  one `name: description` per parameter; a trailing `(choices: [...])` becomes an enum; the
  return hint becomes "return"). The same dict, key for key, so a template renders the same text.
- A class (verl's): `create(self) -> instance_id`, `call(self, instance_id, **arguments) -> str`,
  `release(self, instance_id)`; one object per run (built with no arguments), one instance per
  row (runner.py). Its schema, first found: a `schema` attribute or method (the full
  {"type": "function", "function": {...}} dict or just the inner one); class attributes `name`,
  `description` and `parameters`; else `call`'s signature and docstring (the class docstring
  when `call` has none), without `instance_id`. `name` and `description` attributes override.

Where this is stricter than transformers (each a ToolConfigError naming the tool and the fix):
a type the schema cannot express (a custom class; transformers writes {"type": "object"}, which
no model can fill in), *args / **kwargs, a parameter the docstring does not describe.
"""

import dataclasses
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Literal, Union


class ToolConfigError(ValueError):
  """A tool that cannot be used as configured; the message is one line with the fix."""


# transformers.utils.chat_template_utils' docstring sections, rewritten here (same behaviour).
_DESCRIPTION_RE = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
_ARGS_RE = re.compile(r"\n\s*Args:\n\s*(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
_ARG_SPLIT_RE = re.compile(r"(?:^|\n)\s*(\w+):\s*(.*?)\s*(?=\n\s*\w+:|\Z)", re.DOTALL)
_RETURNS_RE = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
_CHOICES_RE = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

_BASIC = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}
TYPES_HINT = "str, int, float, bool, list[...], dict[str, ...], Literal[...], X | None or Any"


@dataclasses.dataclass(frozen=True)
class Tool:
  """One callable tool. `fn(**arguments)` for a function; for a class tool `obj` is its object
  and `fn` is `obj.call` (called as fn(instance_id, **arguments)). `takes_timeout`: fn also
  accepts `timeout_sec=` (built-ins that enforce their own limit, like the python sandbox)."""

  name: str
  schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
  fn: Callable
  obj: Any = None
  takes_timeout: bool = False

  @property
  def stateful(self) -> bool:
    return self.obj is not None


class ToolSet:
  """The tools of a run, by the name the model calls them with (in the configured order)."""

  def __init__(self, tools: list[Tool]):
    self._tools: dict[str, Tool] = {}
    for t in tools:
      if t.name in self._tools:
        raise ToolConfigError(f"two tools are named '{t.name}'; fix: give each tool its own name")
      self._tools[t.name] = t

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(self._tools)

  def schemas(self) -> list[dict]:
    return [t.schema for t in self._tools.values()]

  def get(self, name) -> Tool | None:
    return self._tools.get(name) if isinstance(name, str) else None

  def __len__(self):
    return len(self._tools)

  def __repr__(self):
    return f"ToolSet({', '.join(self._tools)})"


def make_tool(obj, *, name: str = "", hidden: tuple[str, ...] = ()) -> Tool:
  """A Tool from a function or a create/call/release class. `name`: how the config refers to it
  (for messages); `hidden`: keyword parameters left out of the schema (built-ins' timeout_sec)."""
  label = name or getattr(obj, "__name__", repr(obj))
  if inspect.isclass(obj):
    return _class_tool(obj, label)
  if not callable(obj):
    raise ToolConfigError(
        f"tool '{label}' is a {type(obj).__name__}, not a function or class; fix: name a "
        "function with type hints and a docstring, or a class with create/call/release"
    )
  schema = function_schema(obj, label, hidden=hidden)
  return Tool(
      name=schema["function"]["name"], schema=schema, fn=obj, takes_timeout="timeout_sec" in hidden
  )


def function_schema(fn, label: str, *, skip: int = 0, hidden: tuple[str, ...] = ()) -> dict:
  """transformers.utils.get_json_schema(fn), with ToolConfigErrors. `skip`: leading parameters
  after self that the model does not fill (a class tool's instance_id)."""
  doc = inspect.getdoc(fn)
  if not doc or not doc.strip():
    raise ToolConfigError(
        f"tool '{label}' has no docstring; fix: add one: a description, then 'Args:' with one "
        "'name: description' line per parameter (the model sees them)"
    )
  description, arg_docs, return_doc = _parse_docstring(doc.strip())
  try:
    hints = typing.get_type_hints(fn)
  except Exception as e:  # noqa: BLE001 -- a forward reference that does not resolve, ...
    raise ToolConfigError(
        f"tool '{label}': its type hints do not resolve ({type(e).__name__}: {e}); fix: use "
        f"types defined where the tool is ({TYPES_HINT})"
    ) from None
  params = list(inspect.signature(fn).parameters.values())
  if params and params[0].name in ("self", "cls") and params[0].annotation is inspect._empty:
    params = params[1:]
  params = [p for p in params[skip:] if p.name not in hidden]
  properties, required = {}, []
  for p in params:
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      raise ToolConfigError(
          f"tool '{label}' takes {'*' if p.kind == p.VAR_POSITIONAL else '**'}{p.name}; fix: "
          "name every parameter the model may pass (or give a class tool a `schema`)"
      )
    if p.annotation is inspect._empty:
      raise ToolConfigError(
          f"tool '{label}': parameter '{p.name}' has no type hint; fix: annotate it ({TYPES_HINT})"
      )
    if p.default is inspect._empty:
      required.append(p.name)
    properties[p.name] = _json_type(hints[p.name], label, p.name)
  for pname, prop in properties.items():
    if pname not in arg_docs:
      raise ToolConfigError(
          f"tool '{label}': the docstring does not describe parameter '{pname}'; fix: add "
          f"'{pname}: what it is' under 'Args:'"
      )
    desc = arg_docs[pname]
    choices = _CHOICES_RE.search(desc)
    if choices:
      prop["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
      desc = desc[: choices.start()].strip()
    prop["description"] = desc
  parameters = {"type": "object", "properties": properties}
  if required:
    parameters["required"] = required
  function = {"name": fn.__name__, "description": description, "parameters": parameters}
  if "return" in hints:
    returns = _json_type(hints["return"], label, "return")
    if return_doc is not None:
      returns["description"] = return_doc
    function["return"] = returns
  return {"type": "function", "function": function}


def _parse_docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
  description = _DESCRIPTION_RE.search(doc)
  args = _ARGS_RE.search(doc)
  returns = _RETURNS_RE.search(doc)
  arg_docs = {}
  if args:
    block = "\n".join(line for line in args.group(1).strip().split("\n") if line.strip())
    for pname, text in _ARG_SPLIT_RE.findall(block):
      arg_docs[pname] = re.sub(r"\s*\n+\s*", " ", text.strip())
  return (
      description.group(1).strip() if description else None,
      arg_docs,
      returns.group(1).strip() if returns else None,
  )


def _json_type(hint, label: str, pname: str) -> dict:
  """transformers' _parse_type_hint, except that a type it cannot express is an error."""
  origin, args = typing.get_origin(hint), typing.get_args(hint)

  def fail(why=""):
    shown = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
    raise ToolConfigError(
        f"tool '{label}': parameter '{pname}' has type {shown}, which a JSON schema cannot "
        f"express{why}; fix: use {TYPES_HINT} (parse richer values inside the tool)"
    )

  if origin is None:
    if hint in _BASIC:
      return dict(_BASIC[hint])
    fail()
  if origin is Union or origin is types.UnionType:
    subtypes = [_json_type(t, label, pname) for t in args if t is not type(None)]
    if len(subtypes) == 1:
      out = subtypes[0]
    elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
      names = sorted({s["type"] for s in subtypes})
      out = {"type": names[0] if len(names) == 1 else names}
    else:
      out = {"anyOf": subtypes}
    if type(None) in args:
      out["nullable"] = True
    return out
  if origin is Literal and args:
    kinds = []
    for a in args:
      if type(a) not in (int, float, str, bool, type(None)):
        fail(" (Literal takes only str, int, float, bool and None values)")
      kind = _BASIC[type(a)]["type"]
      if kind not in kinds:
        kinds.append(kind)
    return {"type": kinds.pop() if len(kinds) == 1 else list(kinds), "enum": list(args)}
  if origin is list:
    return (
        {"type": "array", "items": _json_type(args[0], label, pname)} if args else {"type": "array"}
    )
  if origin is tuple:
    if not args:
      return {"type": "array"}
    if len(args) == 1 or ... in args:
      fail(" (a tuple of one element or tuple[X, ...]; use list[X])")
    return {"type": "array", "prefixItems": [_json_type(t, label, pname) for t in args]}
  if origin is dict:
    out = {"type": "object"}
    if len(args) == 2:
      out["additionalProperties"] = _json_type(args[1], label, pname)
    return out
  fail()


def _class_tool(cls, label: str) -> Tool:
  missing = [m for m in ("create", "call", "release") if not callable(getattr(cls, m, None))]
  if missing:
    raise ToolConfigError(
        f"tool '{label}' is a class without {', '.join(missing)}; fix: define create(self) -> "
        "instance_id, call(self, instance_id, **arguments) -> str and release(self, instance_id)"
        " (or make the tool a function)"
    )
  try:
    obj = cls()
  except Exception as e:  # noqa: BLE001 -- the user's constructor
    raise ToolConfigError(
        f"tool '{label}': {cls.__name__}() failed ({type(e).__name__}: {e}); fix: a tool class "
        "must build with no arguments"
    ) from None
  schema = _class_schema(cls, obj, label)
  return Tool(name=schema["function"]["name"], schema=schema, fn=obj.call, obj=obj)


def _class_schema(cls, obj, label: str) -> dict:
  given = getattr(obj, "schema", None)
  if callable(given):
    given = given()
  if given is None and isinstance(getattr(cls, "parameters", None), dict):
    given = {"parameters": cls.parameters}
  if given is not None:
    function = given.get("function", given) if isinstance(given, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("parameters"), dict):
      raise ToolConfigError(
          f"tool '{label}': its schema is not {{'name', 'description', 'parameters': {{JSON "
          "schema}}}; fix: give `schema` (or `parameters`) that shape, or drop it to derive the "
          "schema from call's signature and docstring"
      )
    function = dict(function)
  else:
    fn = cls.call if inspect.getdoc(cls.call) else _with_doc(cls.call, inspect.getdoc(cls))
    function = dict(function_schema(fn, label, skip=1)["function"])
  name = getattr(cls, "name", None)
  if isinstance(name, str) and name:
    function["name"] = name
  elif given is None or not function.get("name"):  # derived: call's name is "call"
    function["name"] = cls.__name__
  if isinstance(getattr(cls, "description", None), str):
    function["description"] = cls.description
  if not isinstance(function["name"], str) or not function.get("description"):
    raise ToolConfigError(
        f"tool '{label}' has no description; fix: give call (or the class) a docstring, or a "
        "`description` class attribute"
    )
  ordered = {"name": function.pop("name"), "description": function.pop("description")}
  return {"type": "function", "function": {**ordered, **function}}


def _with_doc(fn, doc):
  """`fn` under a docstring of its own (a class tool documented on the class, not on call)."""

  def documented(*args, **kwargs):
    return fn(*args, **kwargs)

  documented.__signature__ = inspect.signature(fn)
  documented.__annotations__ = fn.__annotations__
  documented.__doc__ = doc
  documented.__name__ = fn.__name__
  documented.__wrapped__ = fn
  return documented
