"""grpo_jax's modules import in one direction: no cycle among them, counting imports inside
functions too (a lazy import hides a cycle from Python, not from a reader)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "grpo_jax")


def _modules() -> dict[str, str]:
  out = {}
  for folder, _, files in os.walk(PACKAGE):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


def import_graph() -> dict[str, set[str]]:
  """module -> the grpo_jax modules it imports (anywhere in the file)."""
  mods = _modules()

  def resolve(name):
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  graph = {m: set() for m in mods}
  for mod, path in mods.items():
    for node in ast.walk(ast.parse(open(path).read(), path)):
      targets = []
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        targets = [
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
            for a in node.names
        ]
      for t in targets:
        t = resolve(t) if t.startswith("grpo_jax") else None
        if t and t != mod:
          graph[mod].add(t)
  return graph


def cycles(graph) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle_in_the_package():
  found = cycles(import_graph())
  assert not found, f"import cycles among {found}"


def test_the_cycle_finder_finds_one():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert cycles(graph) == [["a", "b", "c"]]
  assert "grpo_jax.models.decoder.transformer" in import_graph()["grpo_jax.models.policy"]
