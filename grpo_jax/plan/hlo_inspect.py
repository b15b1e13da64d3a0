"""Questions about an optimized HLO module, asked of its text (what `compiled.as_text()` prints,
or XLA's *after_optimizations.txt dump; memory_plan --dump_hlo writes them). Pure Python.

    hlo = open("/tmp/hlo/sampler.hlo.txt").read()
    (decode,) = [l for l in while_loops(hlo) if "s32[16,48]" in l.carry]   # the token loop
    converts(hlo, min_elements=1 << 16, within=decode.reach)  # f32->bf16 weight casts per step
    sorts(hlo, within=decode.reach)       # sorts (XLA's, cub's) run per step, operand shapes
    copies(hlo, within=decode.reach)      # copies per step and their bytes
    slices(hlo, 1 << 20, within=decode.reach)  # dynamic slices written per step (not addresses)
    thunks_outside_graphs(thunks, "kWhile")  # XLA:GPU's loops driven from the host
    square_arrays(hlo, 144)               # f32 [..., 144, 144] arrays: attention scores
    collectives(hlo)                      # all-gathers, all-reduces, ... (largest_array: size)

Each `Op` names its computation, instruction and opcode (custom calls: their target too), its
result type and its operands' types. `within` is a set of computation names; None = every
computation reachable from any while loop's body (`loop_computations`).
"""

import dataclasses
import functools
import math
import re

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_NAME = r"%?([\w.\-]+)"
_HEADER = re.compile(r"^(?:ENTRY\s+)?" + _NAME + r"\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?" + _NAME + r"\s*=\s*")
# Attributes that name other computations: calls=, body=, to_apply=, branch_computations={..}.
_CALLED = re.compile(
    r"\b(?:calls|to_apply|condition|body|true_computation|false_computation|"
    r"branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)


@dataclasses.dataclass(frozen=True)
class Op:
  computation: str
  name: str
  opcode: str  # "convert", "sort", "copy", "custom-call:xla.gpu.ext.cub_sort_pairs", ...
  type: str  # result type text, e.g. "bf16[1024,1024]{1,0}" (a tuple: "(s32[], ...)")
  operands: tuple  # operand type texts, in order ("?" where not found)
  line: str


@dataclasses.dataclass(frozen=True)
class Loop:
  op: Op  # the while instruction
  carry: str  # its result (= carried) type text
  reach: frozenset  # its body and every computation called from it, nested loops included


def _closing(text: str, i: int) -> int:
  """Index just past the bracket group opening at text[i]."""
  depth = 0
  for j in range(i, len(text)):
    depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return j + 1
  return len(text)


def _element(type_text: str, index: str) -> str:
  """Element `index` of a tuple type (operands such as %tuple#2 name one); "" = the whole."""
  if not index:
    return type_text
  inner, parts, depth, start = re.sub(r"/\*.*?\*/", "", type_text)[1:-1], [], 0, 0
  for j, ch in enumerate(inner + ","):
    depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(inner[start:j].strip())
      start = j + 1
  return parts[int(index)] if int(index) < len(parts) else "?"


@functools.lru_cache(maxsize=8)
def parse(hlo: str) -> dict:
  """-> {computation name: [Op, ...]} in text order (the entry computation among them); cached:
  do not change it."""
  texts, current = {}, None  # computation -> its instructions' text (some span lines)
  for line in hlo.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m and not line.startswith(("HloModule", " ")):
        current = m.group(1)
        texts[current] = []
    elif line.rstrip() == "}":
      current = None
    elif _INSTR.match(line) or not texts[current]:
      texts[current].append(line)
    else:  # a string attribute with a newline in it (e.g. a Pallas kernel's metadata)
      texts[current][-1] += "\n" + line
  return {name: _ops_of(name, lines) for name, lines in texts.items()}


def _ops_of(computation: str, lines: list[str]) -> list[Op]:
  ops, types = [], {}
  for line in lines:
    m = _INSTR.match(line)
    if not m:
      continue
    rest = line[m.end() :]
    end = _closing(rest, 0) if rest.startswith("(") else rest.find(" ")
    typ, rest = rest[:end], rest[end:].lstrip()
    opcode = re.match(r"[\w\-]*", rest).group(0)
    args = rest[len(opcode) : _closing(rest, len(opcode))]
    if opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]*)"', rest)
      opcode += ":" + (target.group(1) if target else "?")
    types[m.group(1)] = typ
    operands = tuple(
        _element(types.get(n, "?"), i) for n, i in re.findall(r"%([\w.\-]+)(?:#(\d+))?", args)
    )
    ops.append(Op(computation, m.group(1), opcode, typ, operands, line))
  return ops


def _called(op: Op) -> list[str]:
  return [n for group in _CALLED.findall(op.line) for n in re.findall(_NAME, group)]


def while_loops(hlo: str) -> list[Loop]:
  """Every while instruction, with its carry type and the computations its body reaches."""
  comps = parse(hlo)
  loops = []
  for op in (o for ops in comps.values() for o in ops if o.opcode == "while"):
    body = re.search(r"\bbody=" + _NAME, op.line).group(1)
    reach, todo = set(), [body]
    while todo:
      name = todo.pop()
      if name in comps and name not in reach:
        reach.add(name)
        todo += [c for o in comps[name] for c in _called(o)]
    loops.append(Loop(op, op.type, frozenset(reach)))
  return loops


def every_iteration(hlo: str) -> frozenset:
  """The computations some while loop's body runs on every iteration: its reach without what
  only a conditional's branches run (e.g. a decode step's admission, taken on some steps),
  from the loops that are not themselves inside such a branch."""
  comps = parse(hlo)
  branch = re.compile(
      r"\b(?:true_computation|false_computation|branch_computations)=(\{[^}]*\}|%?[\w.\-]+)"
  )
  todo = [
      n
      for ops in comps.values()
      for o in ops
      if o.opcode == "conditional"
      for g in branch.findall(o.line)
      for n in re.findall(_NAME, g)
  ]
  some = set()
  while todo:
    name = todo.pop()
    if name in comps and name not in some:
      some.add(name)
      todo += [c for o in comps[name] for c in _called(o)]
  return (
      frozenset(
          c for loop in while_loops(hlo) if loop.op.computation not in some for c in loop.reach
      )
      - some
  )


def loop_computations(hlo: str) -> frozenset:
  """Every computation reachable from some while loop's body (runs once per iteration)."""
  return frozenset().union(*(loop.reach for loop in while_loops(hlo)))


def _ops(hlo: str, within) -> list[Op]:
  within = loop_computations(hlo) if within is None else within
  return [o for name, ops in parse(hlo).items() if name in within for o in ops]


def dims(type_text: str) -> tuple:
  """(dtype, shape) of an array type text: "bf16[2,3]{1,0}" -> ("bf16", (2, 3))."""
  m = _ARRAY.search(type_text)
  return (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) if m else ("?", ())


def nbytes(type_text: str) -> int:
  """Bytes of an array type (a tuple: the sum over its arrays)."""
  return sum(
      _DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in shape.split(",") if d)
      for dt, shape in _ARRAY.findall(type_text)
  )


def converts(hlo: str, min_elements: int, *, src="f32", dst="bf16", within=None) -> list[Op]:
  """src -> dst converts in `within` whose result has >= min_elements elements (weight-sized
  casts that run once per loop iteration)."""
  return [
      o
      for o in _ops(hlo, within)
      if o.opcode == "convert"
      and dims(o.type)[0] == dst
      and o.operands
      and dims(o.operands[0])[0] == src
      and math.prod(dims(o.type)[1]) >= min_elements
  ]


def sorts(hlo: str, *, within=None) -> list[Op]:
  """Sort ops and sort custom calls (cub: a target containing "sort") in `within`; each Op's
  operands give the sorted shapes."""
  return [
      o
      for o in _ops(hlo, within)
      if o.opcode == "sort" or (o.opcode.startswith("custom-call:") and "sort" in o.opcode.lower())
  ]


def custom_call_targets(hlo: str) -> set[str]:
  """Every custom call's target in the module (e.g. "__cudnn$fmhaSoftmax", "tpu_custom_call")."""
  return {
      o.opcode.split(":", 1)[1]
      for ops in parse(hlo).values()
      for o in ops
      if o.opcode.startswith("custom-call:")
  }


def copies(hlo: str, *, within=None) -> list[tuple[Op, int]]:
  """(copy op, bytes it writes) in `within`: HLO copies and memcpy-like custom calls (not the
  asynchronous copy-start/-done pairs a TPU uses to prefetch into on-chip memory)."""
  return [
      (o, nbytes(o.type))
      for o in _ops(hlo, within)
      if o.opcode == "copy"
      or (o.opcode.startswith("custom-call:") and "memcpy" in o.opcode.lower())
  ]


def slices(hlo: str, min_bytes: int, *, within=None) -> list[tuple[Op, int]]:
  """(dynamic-slice op, bytes) of at least `min_bytes` written to memory by an instruction of
  `within` (a loop body's own instructions, not those inside fusions): a dynamic-slice, or a
  fusion (XLA:GPU's asynchronous fusion-start too) whose result is one; e.g. a layer's weights
  copied out of a stack [L, ...] under a layer scan. Not a slice a fusion reads in place (one
  fused into a dot's operand, or XLA:GPU's dynamic-slice fusion: the address of a cuBLAS
  call's operand, offset from the loop index), nor one into a TPU's on-chip memory (S(1): a
  prefetch, as copy-start)."""
  comps = parse(hlo)
  within = loop_computations(hlo) if within is None else within
  fused = {
      c for ops in comps.values() for o in ops if o.opcode.startswith("fusion") for c in _called(o)
  }

  def sliced(name):  # a fusion body's result: its root, through bitcasts, a dynamic-slice
    by_name = {o.name: o for o in comps.get(name, ())}
    root = next((o for o in comps.get(name, ()) if o.line.lstrip().startswith("ROOT")), None)
    while root is not None and root.opcode == "bitcast":
      operand = re.search(r"bitcast\(%([\w.\-]+)", root.line)
      root = by_name.get(operand.group(1)) if operand else None
    return root if root is not None and root.opcode == "dynamic-slice" else None

  out = []
  for name, ops in comps.items():  # (in text order)
    if name not in within or name in fused:
      continue
    for o in ops:
      if o.opcode == "dynamic-slice":
        hit = o
      elif o.opcode in ("fusion", "fusion-start"):
        hit = next(filter(None, map(sliced, _called(o))), None)
      else:
        continue
      if hit is not None and "S(1)" not in hit.type and nbytes(hit.type) >= min_bytes:
        out.append((hit, nbytes(hit.type)))
  return out


def thunks_outside_graphs(thunks: str, kind: str) -> list[str]:
  """The thunks of `kind` ("kWhile", "kConditional", ...) in XLA:GPU's thunk sequence (the
  text of a compile's *thunk_sequence_after_thunk_passes.txt: tpu_targets.gpu_thunk_sequence)
  that are not inside a command buffer (a CUDA graph): each is driven from the host (a
  while's or conditional's predicate read back per iteration, a graph launched per body)."""
  graphs, out = [], []  # the indents of the command buffers open at a line
  for line in thunks.splitlines():
    m = re.match(r"^(\s*)\d+: (k\w+)", line)
    if not m:
      continue  # (condition: / body: / branch labels)
    indent = len(m.group(1))
    while graphs and indent <= graphs[-1]:
      graphs.pop()
    if m.group(2) == kind and not graphs:
      out.append(line.strip())
    if m.group(2) == "kCommandBuffer":
      graphs.append(indent)
  return out


def square_arrays(hlo: str, s: int, dtypes=("f32",)) -> list[tuple[str, str, str, tuple]]:
  """(computation, instruction, dtype, shape) of every array of `dtypes` anywhere in the module
  (results and operands, fusions included) whose shape ends in [..., s, s]: attention score
  matrices over s slots."""
  out = []
  for name, ops in parse(hlo).items():
    for o in ops:
      for typ in (o.type, *o.operands):
        for dt, shape in _ARRAY.findall(typ):
          shape = tuple(int(d) for d in shape.split(",") if d)
          if dt in dtypes and len(shape) >= 2 and shape[-2:] == (s, s):
            out.append((name, o.name, dt, shape))
  return out


# ------------------------------------------------------------------ mixture-of-experts programs


def _shapes(op: Op) -> list[tuple[str, tuple]]:
  """(dtype, shape) of every array in an op's result and operands (tuples flattened)."""
  return [
      (dt, tuple(int(d) for d in shape.split(",") if d))
      for typ in (op.type, *op.operands)
      for dt, shape in _ARRAY.findall(typ)
  ]


def grouped_matmuls(hlo: str) -> list[Op]:
  """The experts' grouped GEMMs: what `jax.lax.ragged_dot` became, a `ragged-dot` instruction
  left as is or the TPU compiler's kernel (a tpu_custom_call named ragged-dot-*, beside its
  ragged-dot-metadata calls, which are not counted), or moe.py's GPU kernels
  (models/decoder/grouped_matmul.py: Triton custom calls named grouped_matmul*, the forward's,
  the input gradient's and the weight gradient's). XLA:GPU has no kernel for ragged-dot: it
  rewrites it into dense dots over every group (`dense_expert_dots` finds them)."""
  return [
      o
      for ops in parse(hlo).values()
      for o in ops
      if o.opcode == "ragged-dot"
      or (
          o.opcode.startswith("custom-call:")
          and o.name.startswith("ragged-dot")
          and not o.name.startswith("ragged-dot-metadata")
      )
      or (o.opcode.endswith("xla.gpu.triton") and 'name = "grouped_matmul' in o.line)
  ]


def all_to_alls(hlo: str) -> list[Op]:
  """All-to-all collectives (dense or ragged; an asynchronous pair counted once, by its
  start)."""
  kinds = ("all-to-all", "all-to-all-start", "ragged-all-to-all")
  return [o for ops in parse(hlo).values() for o in ops if o.opcode in kinds]


COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "reduce-scatter",
)


def collectives(hlo: str) -> list[Op]:
  """Cross-device collectives (an asynchronous pair counted once, by its start): all-gather,
  all-reduce, all-to-all, collective-permute, reduce-scatter."""
  kinds = COLLECTIVES + tuple(k + "-start" for k in COLLECTIVES)
  return [o for ops in parse(hlo).values() for o in ops if o.opcode in kinds]


def largest_array(op: Op) -> int:
  """Elements of the largest array among an op's result and operands."""
  return max((math.prod(shape) for _, shape in _shapes(op)), default=0)


def dense_expert_dots(hlo: str, rows: int, width: int) -> list[Op]:
  """Dots and convolutions (fused computations included) that compute experts densely: one of
  their arrays (result or operand) is batched (rank >= 3) and holds >= 2 * rows * width
  elements, rows = the grouped GEMMs' rows on the device (its (token, expert) pairs), width =
  min(D, F). Every expert (or a chunk of >= 2 experts) over every row is such an array, e.g.
  XLA:GPU's ragged-dot rewrite, [experts, rows, F] products of a masked [experts, rows, D]
  copy; the grouped GEMMs' own arrays are rows x D or F, and their weights' E x D x F stay
  under it where E * max(D, F) < 2 * rows."""
  return [
      o
      for ops in parse(hlo).values()
      for o in ops
      if o.opcode in ("dot", "convolution")
      and any(len(shape) >= 3 and math.prod(shape) >= 2 * rows * width for _, shape in _shapes(o))
  ]
