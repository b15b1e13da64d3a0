"""The config is read one way: `config.rollout.placement`, never `config.rollout.get(...)`.

configs/common.py declares every field with its default, so a `.get(key, default)` read of the
config or of one of its blocks is dead code and a second copy of the truth that can drift from
it. This test parses every module of grpo_jax/ (and benchmarks/) and fails on such a read,
whatever the name the config goes by: `config`, `cfg`, a parameter annotated ConfigDict, an
attribute chain rooted at one (`config.rollout.get`), a local alias (`r = config.rollout;
r.get(...)`), an attribute of `self` assigned from one, or a parameter that some call passes a
config (block) to (`rewards.from_config(config.reward)` makes `from_config`'s `reward` a
config). Reads of plain dicts (HF config.json, rows, metas, summaries) are not config reads and
pass.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The package, and the benchmarks that drive its real programs with the shipped configs.
FOLDERS = ("grpo_jax", "benchmarks")

CONFIG_NAMES = ("config", "cfg")  # parameters by these names hold the config unless annotated
CONFIG_TYPES = ("ConfigDict", "FrozenConfigDict")
CONFIG_FLAGS = ("DEFINE_config_file", "DEFINE_config_dict")  # FLAG.value is the config
CONFIG_MAKERS = ("get_config",)  # a recipe's get_config() returns the config

# Tolerated reads as (path, stripped line text): none; every config read in grpo_jax/ and
# benchmarks/ is an attribute read.
KNOWN = set()


def _root(node):
  """The Name or `self.x` an attribute / subscript chain starts from, as a string."""
  while isinstance(node, (ast.Attribute, ast.Subscript)):
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
      return f"self.{node.attr}"
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def _annotation_name(ann) -> str | None:
  """The last dotted part of an annotation or callee (`ml_collections.ConfigDict`: ConfigDict)."""
  if ann is None:
    return None
  if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
    return ann.value.rpartition(".")[2]
  if isinstance(ann, ast.Attribute):
    return ann.attr
  return ann.id if isinstance(ann, ast.Name) else "?"


class _Module:
  """One module's functions, imports and the names under which a config travels."""

  def __init__(self, name: str, path: str, source: str):
    self.name, self.path, self.lines = name, path, source.splitlines()
    self.tree = tree = ast.parse(source, path)
    self.functions = {}  # qualified name ("f", "Class.m") -> FunctionDef
    self.imports = {}  # local name -> (module, attr or None)
    self.tainted_params = {}  # FunctionDef -> set of parameter names holding a config
    self.flags = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and _annotation_name(node.value.func) in CONFIG_FLAGS
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    for node in tree.body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        self.functions[node.name] = node
      elif isinstance(node, ast.ClassDef):
        for item in node.body:
          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.functions[f"{node.name}.{item.name}"] = item
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          if a.asname:
            self.imports[a.asname] = (a.name, None)
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        for a in node.names:
          self.imports[a.asname or a.name] = (node.module, a.name)


def _own_nodes(scope):
  """The nodes of `scope` outside the functions and classes defined in it."""
  for child in ast.iter_child_nodes(scope):
    yield child
    if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      yield from _own_nodes(child)


def _params(fn) -> list[ast.arg]:
  a = fn.args
  return [*a.posonlyargs, *a.args, *a.kwonlyargs]


def _is_method(fn, tree) -> bool:
  for node in ast.walk(tree):
    if isinstance(node, ast.ClassDef) and fn in node.body:
      return not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
  return False


class Checker:
  """Finds `.get(` calls on the config in a set of modules: dotted name -> (path, source)."""

  def __init__(self, sources: dict[str, tuple[str, str]]):
    self.modules = {name: _Module(name, path, src) for name, (path, src) in sources.items()}
    self.flags = set().union(*(m.flags for m in self.modules.values()))
    for m in self.modules.values():
      for fn in (
          n for n in ast.walk(m.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
      ):
        m.tainted_params[fn] = {
            p.arg
            for p in _params(fn)
            if (p.arg in CONFIG_NAMES and p.annotation is None)
            or _annotation_name(p.annotation) in CONFIG_TYPES
        }
    changed = True
    while changed:  # spread through calls until nothing new holds a config
      changed = False
      for m in self.modules.values():
        changed |= self._spread(m)

  # --- which expressions hold a config --------------------------------------------------------

  def _is_config(self, expr, names: set[str]) -> bool:
    if isinstance(expr, ast.Name):
      return expr.id in names
    if (
        isinstance(expr, ast.Attribute)
        and expr.attr == "value"
        and isinstance(expr.value, ast.Name)
        and expr.value.id in self.flags
    ):
      return True  # _CONFIG.value of a config_flags flag
    if isinstance(expr, (ast.Attribute, ast.Subscript)):
      return _root(expr) in names
    if isinstance(expr, ast.BoolOp):
      return any(self._is_config(v, names) for v in expr.values)
    if isinstance(expr, ast.IfExp):
      return self._is_config(expr.body, names) or self._is_config(expr.orelse, names)
    if isinstance(expr, ast.NamedExpr):
      return self._is_config(expr.value, names)
    if isinstance(expr, ast.Call):
      f = expr.func
      if isinstance(f, ast.Attribute) and f.attr == "get":  # r = config.get("rollout")
        return self._is_config(f.value, names)
      return _annotation_name(f) in (*CONFIG_TYPES, *CONFIG_MAKERS)
    return False

  def _scopes(self, m: _Module):
    """(function, names holding a config in it) for every function, nested ones included."""
    attrs = {}  # class -> {"self.x"} assigned from a config in any of its methods
    for cls in (n for n in ast.walk(m.tree) if isinstance(n, ast.ClassDef)):
      found = set()
      for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        names = self._local_names(fn, set(m.tainted_params.get(fn, ())))
        for node in _own_nodes(fn):
          if isinstance(node, ast.Assign) and self._is_config(node.value, names):
            found |= {_root(t) for t in node.targets if isinstance(t, ast.Attribute)}
      attrs[cls] = found

    def visit(node, outer: set[str], cls_attrs: set[str]):
      for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
          yield from visit(child, outer, attrs[child])
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
          own = {p.arg for p in _params(child)}
          names = (outer - own) | cls_attrs | m.tainted_params.get(child, set())
          names = self._local_names(child, names)
          yield child, names
          yield from visit(child, names, cls_attrs)
        else:
          yield from visit(child, outer, cls_attrs)

    module_names = self._local_names(m.tree, set())
    yield m.tree, module_names
    yield from visit(m.tree, module_names, set())

  def _local_names(self, fn, names: set[str]) -> set[str]:
    """`names` plus the local names assigned from a config (alias chains: to a fixed point)."""
    names = set(names)
    body = [n for n in _own_nodes(fn) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.NamedExpr))]
    while True:
      before = len(names)
      for node in body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
          pairs = [(t, node.value)]
          if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
            pairs = zip(t.elts, node.value.elts)
          for target, value in pairs:
            if isinstance(target, ast.Name) and value is not None and self._is_config(value, names):
              names.add(target.id)
      if len(names) == before:
        return names

  # --- calls that hand a config to another function -------------------------------------------

  def _function(self, module: str, name: str, depth: int = 0):
    """Module `module`'s function `name`, through the imports that re-export it."""
    m = self.modules.get(module)
    if m is None or depth > 3:
      return None
    if name in m.functions:
      return m.functions[name]
    mod, attr = m.imports.get(name, (None, None))
    return self._function(mod, attr, depth + 1) if attr else None

  def _callee(self, m: _Module, func, cls_name: str | None):
    if isinstance(func, ast.Name):
      if func.id in m.functions:
        return m.functions[func.id], False
      mod, attr = m.imports.get(func.id, (None, None))
      fn = self._function(mod, attr) if attr else None
      if fn:
        return fn, False
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
      base = func.value.id
      if base in ("self", "cls") and cls_name:
        fn = m.functions.get(f"{cls_name}.{func.attr}")
        return (fn, True) if fn else (None, False)
      if f"{base}.{func.attr}" in m.functions:  # Class.method(...)
        fn = m.functions[f"{base}.{func.attr}"]
        return fn, _is_method(fn, m.tree)
      mod, attr = m.imports.get(base, (None, None))
      fn = self._function(f"{mod}.{attr}" if attr else mod, func.attr) if mod else None
      if fn:
        return fn, False
    return None, False

  def _spread(self, m: _Module) -> bool:
    changed = False
    owners = {
        fn: cls.name for cls in ast.walk(m.tree) if isinstance(cls, ast.ClassDef) for fn in cls.body
    }
    for scope, names in list(self._scopes(m)):
      for call in (n for n in _own_nodes(scope) if isinstance(n, ast.Call)):
        fn, bound = self._callee(m, call.func, owners.get(scope))
        if fn is None:
          continue
        params = _params(fn)[1 if bound else 0 :]
        hit = {
            params[i].arg
            for i, a in enumerate(call.args)
            if i < len(params) and self._is_config(a, names)
        }
        hit |= {k.arg for k in call.keywords if k.arg and self._is_config(k.value, names)}
        typed = {q.arg: _annotation_name(q.annotation) for q in params}
        hit = {p for p in hit if p in typed and typed[p] in (None, *CONFIG_TYPES)}
        owner = next(x for x in self.modules.values() if fn in x.tainted_params)
        if hit - owner.tainted_params[fn]:
          owner.tainted_params[fn] |= hit
          changed = True
    return changed

  # --- the reads ------------------------------------------------------------------------------

  def reads(self) -> list[tuple[str, int, str]]:
    """(path, line, stripped line text) of every `.get(` call on a config."""
    out = set()
    for m in self.modules.values():
      for scope, names in self._scopes(m):
        for call in (n for n in _own_nodes(scope) if isinstance(n, ast.Call)):
          f = call.func
          if isinstance(f, ast.Attribute) and f.attr == "get" and self._is_config(f.value, names):
            out.add((m.path, call.lineno, m.lines[call.lineno - 1].strip()))
    return sorted(out)


def _package_sources() -> dict[str, tuple[str, str]]:
  out = {}
  for folder, _, files in (w for top in FOLDERS for w in os.walk(os.path.join(ROOT, top))):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        rel = os.path.relpath(path, ROOT)
        out[rel[:-3].replace(os.sep, ".").removesuffix(".__init__")] = (rel, open(path).read())
  return out


def _check_snippets(**snippets: str) -> list[tuple[str, int, str]]:
  """reads() over in-memory modules: name -> source (path = name)."""
  return Checker({name: (name, src) for name, src in snippets.items()}).reads()


def test_grpo_jax_reads_the_config_by_attribute_only():
  found = [
      (p, n, text) for p, n, text in Checker(_package_sources()).reads() if (p, text) not in KNOWN
  ]
  assert not found, (
      "read these config fields as attributes (configs/common.py declares every "
      "field with its default):\n" + "\n".join(f"{p}:{n}: {t}" for p, n, t in found)
  )


def test_the_checker_catches_every_form_and_passes_dict_reads():
  src = """
import json
import ml_collections

def direct(config):
  return config.get("beta", 0.04)

def block(config):
  return config.rollout.get("placement", "colocated")

def alias(config):
  r = config.rollout
  v = r.vllm
  return r.get("max_staleness", 0), v.get("num_devices", 0)

def mesh(cfg):
  return cfg.mesh.get("dcn_data", 1)

def annotated(settings: ml_collections.ConfigDict):
  return settings.get("seed")

def built():
  c = ml_collections.ConfigDict({"a": 1})
  return c.get("a")

class Engine:
  def __init__(self, config):
    self.config = config

  def run(self):
    return self.config.rollout.get("top_k")

class Report:
  def __init__(self, path):
    self.config = json.load(open(path))  # a saved run's config.json: a dict

  def steps(self):
    return self.config.get("num_steps")

def lazy():
  class Engine:  # defined where an optional dependency is imported
    @classmethod
    def extra(cls, config):
      return config.rollout.vllm.get("num_devices", 0)
  return Engine

_CONFIG = config_flags.DEFINE_config_file("config")

def main(argv):
  run = _CONFIG.value
  recipe = tiny.get_config()
  return run.get("seed"), recipe.mesh.get("data")

def from_config(reward):  # a block handed over under another name
  return reward.get("custom_function", "")

def caller(config):
  return from_config(config.reward)

def dicts(path, row, meta, hf: dict):
  config = json.load(open(path))  # a config.json dict, not the run's config
  cfg = {"program": path}
  return (config.get("vocab_size"), cfg.get("program"), row.get("prompt"), meta.get("step"),
          hf.get("model_type"))

def json_param(config: dict):
  return config.get("chat_template")
"""
  found = {text for _, _, text in _check_snippets(m=src)}
  assert found == {
      'return config.get("beta", 0.04)',
      'return config.rollout.get("placement", "colocated")',
      'return r.get("max_staleness", 0), v.get("num_devices", 0)',
      'return cfg.mesh.get("dcn_data", 1)',
      'return settings.get("seed")',
      'return c.get("a")',
      'return self.config.rollout.get("top_k")',
      'return reward.get("custom_function", "")',
      'return config.rollout.vllm.get("num_devices", 0)',
      'return run.get("seed"), recipe.mesh.get("data")',
  }


def test_the_checker_follows_a_config_into_an_imported_module():
  found = _check_snippets(
      a="from b import rewards\n\ndef main(config):\n  return rewards.build(config.reward)\n",
      c="import b as pkg\n\ndef main(config):\n  return pkg.make(config.mesh)\n",
      b="from b.scores import build as make\n",  # a package re-exporting a function
      **{
          "b.rewards": 'def build(spec):\n  return spec.get("weights")\n',
          "b.scores": 'def build(spec):\n  return spec.get("weights")\n',
          "b.other": 'def build(spec):\n  return spec.get("weights")\n',
      },
  )  # never given one
  assert [(p, n) for p, n, _ in found] == [("b.rewards", 2), ("b.scores", 2)]
