r"""Where a GRPO step's time goes, read back from a profiler trace.

    python benchmarks/trace_analysis.py WORKDIR/profile            # the newest run in it
    python benchmarks/trace_analysis.py path/to/HOST.trace.json.gz  # one trace file

Write the trace with `--config.profile.start_step=S --config.profile.num_steps=K` (profile a
few steps after the first, which compiles). Prints Markdown and writes `analysis.json` beside
the trace file:
  - loop phases: the host spans train.py names (grpo_jax.run.profiling.PHASES), mean ms per step and
    share of the step (the `grpo_step` span); phases that only dispatch device work end early,
    the wait shows up in the phase that blocks ("update", "rollout"; grpo_jax/run/profiling.py);
  - device time by op category (matmul, attention, elementwise/fusion, collective,
    copy/transfer, other) and the idle gaps between ops, over the profiled steps;
  - the top 15 ops by time; per step, device busy time (the union of op intervals) and the
    idle fraction 1 - busy / step wall time;
  - device idle by host phase: the idle time split by the phase the host was in meanwhile.
    Idle while the host waits on the device (WAITING_PHASES) is a gap inside or between device
    programs; idle in any other phase, or outside the phases, is the host keeping the device
    waiting: their sum is the "host overhead" (ms per step and share of the step).

It reads the Chrome trace-event JSON (`*.trace.json.gz`) that jax.profiler writes next to the
`.xplane.pb` on every backend, with the standard library: no trace server, no binary to
download. Device ops are, per device, the events of an accelerator process ("/device:GPU:0",
"/device:TPU:0": its "XLA Ops" line when there is one, else the events naming an `hlo_op`);
on CPU they are the XLA:CPU thunk events on the executor threads (tf_XLAEigen/...,
tf_XLAExecute/...), which carry `hlo_op`, `hlo_module` and `device_ordinal`. Op times are
self times (ops nested in an op on the same thread are subtracted) summed over devices;
control-flow ops (while, call, conditional) count as busy time but not as op time, their
body's ops do. Categories come from op names (XLA's names say what a fusion holds).
"""

import argparse
import bisect
import collections
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_jax.run import profiling  # noqa: E402

PHASE_PREFIX = profiling.PHASE_PREFIX  # profiling.phase(name) names its span "phase/<name>"
OUTSIDE = "(outside the phases)"
# Phases in which the host waits on the device (rollout copies the completions to the host,
# update blocks on the new state, the log-prob passes are dispatched and read by the update):
# device idle there is not host work. Idle in every other phase, and outside them, is.
WAITING_PHASES = ("rollout", "old_logprobs", "ref_logprobs", "update")
CATEGORIES = ("matmul", "attention", "elementwise", "collective", "copy", "other")
LABELS = {
    "matmul": "matmul / dot / conv",
    "attention": "attention kernels",
    "elementwise": "elementwise / fusion / reduce",
    "collective": "collectives",
    "copy": "copies / transfers / layout",
    "other": "other",
    "idle": "idle (no op running)",
}
CONTAINERS = {"while", "call", "conditional"}  # their time is their body's ops
TOP_K = 15

_COLLECTIVE = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
    "nccl",
    "send",
    "recv",
)
_ATTENTION = ("attention", "flash", "fmha", "splash", "sdpa", "mha")
_MATMUL_TOKENS = {"dot", "convolution", "conv", "matmul", "gemv", "ynn"}
_MATMUL_TEXT = ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul", "onednn")
_TRANSFER_TEXT = ("memcpy", "memset", "h2d", "d2h", "transfer", "infeed", "outfeed")
_MOVE_TOKENS = {
    "copy",
    "copy-start",
    "copy-done",
    "transpose",
    "bitcast",
    "reshape",
    "broadcast",
    "concatenate",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "pad",
    "gather",
    "reverse",
}
_GENERIC_TOKENS = {"fusion", "wrapped", "kernel", "loop", "input", "start", "done"}
_ELEMENTWISE_TOKENS = {
    "add",
    "subtract",
    "multiply",
    "divide",
    "remainder",
    "power",
    "negate",
    "abs",
    "sign",
    "maximum",
    "minimum",
    "clamp",
    "select",
    "compare",
    "convert",
    "and",
    "or",
    "not",
    "xor",
    "exponential",
    "exponential-minus-one",
    "exp",
    "log",
    "log-plus-one",
    "tanh",
    "logistic",
    "sqrt",
    "rsqrt",
    "cbrt",
    "sine",
    "cosine",
    "tan",
    "atan2",
    "erf",
    "floor",
    "ceil",
    "round-nearest-even",
    "round-nearest-afz",
    "is-finite",
    "shift-left",
    "shift-right-logical",
    "shift-right-arithmetic",
    "popcnt",
    "reduce",
    "reduce-window",
    "reduce-precision",
    "scatter",
    "map",
    "iota",
    "softmax",
    "triton",
}


def _tokens(name: str) -> list[str]:
  """XLA op/fusion name -> its parts: "bitcast_dynamic-update-slice_fusion.3" ->
  ["bitcast", "dynamic-update-slice", "fusion"] (hyphenated HLO op names stay whole)."""
  return [t for t in re.split(r"[^a-z0-9\-]+", name.lower()) if t and not t.isdigit()]


def categorize(name: str) -> str:
  """One of CATEGORIES for an op (HLO instruction or kernel) name, first match wins:
  collectives, attention, matmul, copies (a name made only of data-movement ops, or a
  transfer), elementwise (any other fusion, elementwise op or reduction), other.

  XLA:CPU's YNNPACK fusions (`ynn_fusion.N`) count as matmul: they hold dots but some hold
  reductions, and the trace does not say which."""
  text, tokens = name.lower(), _tokens(name)
  if any(t.startswith(_COLLECTIVE) for t in tokens):
    return "collective"
  if any(s in text for s in _ATTENTION):
    return "attention"
  if _MATMUL_TOKENS.intersection(tokens) or any(s in text for s in _MATMUL_TEXT):
    return "matmul"
  specific = [t for t in tokens if t not in _GENERIC_TOKENS]
  if any(s in text for s in _TRANSFER_TEXT) or (specific and set(specific) <= _MOVE_TOKENS):
    return "copy"
  if "fusion" in tokens or _ELEMENTWISE_TOKENS.intersection(tokens):
    return "elementwise"
  return "other"


def _is_container(name: str) -> bool:
  return re.sub(r"\.\d+$", "", name.lower()) in CONTAINERS


# ----------------------------------------------------------------------------- reading


def find_trace(path: str) -> str:
  """A trace file, or the trace of the newest run under a folder: WORKDIR/profile holds
  plugins/profile/<run>/HOST.trace.json.gz (perfetto_trace.json.gz beside it has the same
  events, less the metadata; taken when it is the only one)."""
  if os.path.isfile(path):
    return path
  runs = collections.defaultdict(list)
  for root, _, files in os.walk(path):
    for f in files:
      if f.endswith(".trace.json.gz") or f == "perfetto_trace.json.gz":
        runs[root].append(os.path.join(root, f))
  if not runs:
    raise FileNotFoundError(
        f"no *.trace.json.gz under {path} (write one with " "--config.profile.start_step=S)"
    )
  newest = max(runs.values(), key=lambda files: max(map(os.path.getmtime, files)))
  return max(newest, key=lambda f: (f.endswith(".trace.json.gz"), os.path.getmtime(f)))


def load(trace_file: str):
  """-> complete events ("X") in µs, {pid: process name}, {(pid, tid): thread name}."""
  opener = gzip.open if trace_file.endswith(".gz") else open
  with opener(trace_file, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads, spans = {}, {}, []
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    elif e.get("ph") == "X":
      spans.append(e)
  return spans, processes, threads


Op = collections.namedtuple("Op", "device thread start end name module")


def device_ops(spans, processes, threads) -> tuple[list[Op], str]:
  """The device's op events (see the module docstring), and a line saying where from."""
  accel = {pid for pid, n in processes.items() if n.startswith("/device:")}
  by_pid = collections.defaultdict(list)
  for e in spans:
    if e["pid"] in accel:
      by_pid[e["pid"]].append(e)
  ops = []
  for pid, evs in by_pid.items():
    xla_ops = [e for e in evs if threads.get((pid, e.get("tid"))) == "XLA Ops"]
    chosen = xla_ops or [e for e in evs if "hlo_op" in e.get("args", {})]
    ops += [_op(processes[pid], e) for e in chosen]
  if ops:
    return ops, "accelerator op lines (" + ", ".join(sorted({o.device for o in ops})) + ")"
  ops = [
      _op("cpu:" + str(e["args"].get("device_ordinal", 0)), e)
      for e in spans
      if "hlo_op" in e.get("args", {})
  ]
  names = sorted(
      {
          threads.get((e["pid"], e.get("tid")), "?").split("/")[0]
          for e in spans
          if "hlo_op" in e.get("args", {})
      }
  )
  return ops, "XLA:CPU thunk events on " + ", ".join(names) + " threads"


def _op(device, e) -> Op:
  args = e.get("args", {})
  return Op(
      device,
      (e["pid"], e.get("tid")),
      float(e["ts"]),
      float(e["ts"]) + float(e["dur"]),
      e["name"],
      args.get("hlo_module", ""),
  )


def _self_times(ops: list[Op]) -> list[float]:
  """Each op's duration less the ops nested inside it on the same thread (µs)."""
  self_us = [o.end - o.start for o in ops]
  by_thread = collections.defaultdict(list)
  for i, o in enumerate(ops):
    by_thread[o.thread].append(i)
  for idx in by_thread.values():
    idx.sort(key=lambda i: (ops[i].start, -ops[i].end))
    stack = []
    for i in idx:
      while stack and ops[stack[-1]].end <= ops[i].start:
        stack.pop()
      if stack:
        self_us[stack[-1]] -= min(ops[i].end, ops[stack[-1]].end) - ops[i].start
      stack.append(i)
  return self_us


def _union_us(intervals, lo: float, hi: float) -> float:
  """Length of the union of sorted (start, end) intervals clipped to [lo, hi]."""
  total, cur_s, cur_e = 0.0, None, None
  for s, e in intervals:
    s, e = max(s, lo), min(e, hi)
    if e <= s:
      continue
    if cur_e is None or s > cur_e:
      total += (cur_e - cur_s) if cur_e is not None else 0.0
      cur_s, cur_e = s, e
    else:
      cur_e = max(cur_e, e)
  return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


# ----------------------------------------------------------------------------- analysis


def analyze(trace_file: str) -> dict:
  spans, processes, threads = load(trace_file)
  step_spans = sorted((e for e in spans if e["name"] == profiling.STEP_SPAN), key=lambda e: e["ts"])
  windows = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in step_spans]
  ops, source = device_ops(spans, processes, threads)
  if not windows and ops:  # a trace without step spans: the whole op window is one "step"
    windows = [(min(o.start for o in ops), max(o.end for o in ops))]
  starts = [w[0] for w in windows]

  def window_of(t):
    i = bisect.bisect_right(starts, t) - 1
    return i if i >= 0 and t < windows[i][1] else None

  # Loop phases: the phase spans inside each step span (same thread as the step).
  steps = []
  phase_spans = [[] for _ in windows]  # per step: (start, end, phase) in time order
  for e, (lo, hi) in zip(step_spans, windows):
    steps.append(
        {
            "step": int(e.get("args", {}).get("step_num", len(steps))),
            "wall_ms": (hi - lo) / 1e3,
            "phases": collections.Counter(),
        }
    )
  for e in spans:
    if e["name"].startswith(PHASE_PREFIX) and step_spans:
      i = window_of(float(e["ts"]))
      if i is not None and e.get("tid") == step_spans[i].get("tid"):
        steps[i]["phases"][e["name"][len(PHASE_PREFIX) :]] += float(e["dur"]) / 1e3
        phase_spans[i].append(
            (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"][len(PHASE_PREFIX) :])
        )

  # Device busy time per step: the union of each device's op intervals, averaged over devices.
  devices = sorted({o.device for o in ops})
  intervals = {d: sorted((o.start, o.end) for o in ops if o.device == d) for d in devices}
  busy_us = [
      sum(_union_us(intervals[d], lo, hi) for d in devices) / max(len(devices), 1)
      for lo, hi in windows
  ]
  for s, b, (lo, hi) in zip(steps, busy_us, windows):
    s["device_busy_ms"] = b / 1e3
    s["idle_fraction"] = 1.0 - b / (hi - lo) if hi > lo else 0.0
  # Device idle by what the host was doing meanwhile (the phase span covering the idle time;
  # OUTSIDE when none does), averaged over devices: idle during a host-work phase (prompts,
  # rewards, log, ...) is the host keeping the device waiting; idle while the host waits on
  # the device ("rollout", "update" block) is a gap inside or between the device's programs.
  for s, spans_i, (lo, hi) in zip(steps, phase_spans, windows):
    idle = collections.Counter()
    cuts = sorted({lo, hi, *(min(max(t, lo), hi) for a, b, _ in spans_i for t in (a, b))})
    for a, b in zip(cuts, cuts[1:]):
      name = next((p for x, y, p in spans_i if x <= a and b <= y), OUTSIDE)
      busy = sum(_union_us(intervals[d], a, b) for d in devices) / max(len(devices), 1)
      idle[name] += ((b - a) - busy) / 1e3
    s["idle_ms_by_phase"] = dict(idle)
    s["host_idle_ms"] = sum(ms for p, ms in idle.items() if p not in WAITING_PHASES)

  # Op time (self time, summed over devices) by category and by op, inside the windows.
  categories = dict.fromkeys(CATEGORIES, 0.0)
  per_op = collections.defaultdict(lambda: [0.0, 0])
  for o, t in zip(ops, _self_times(ops)):
    if _is_container(o.name) or window_of(o.start) is None:
      continue
    categories[categorize(o.name)] += t / 1e3
    per_op[(o.name, o.module)][0] += t / 1e3
    per_op[(o.name, o.module)][1] += 1
  idle_us = sum((hi - lo) - b for (lo, hi), b in zip(windows, busy_us))  # mean per device
  categories["idle"] = idle_us * len(devices) / 1e3
  top = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:TOP_K]

  order = [p for p in profiling.PHASES if any(p in s["phases"] for s in steps)]
  order += sorted({p for s in steps for p in s["phases"]} - set(order))
  n = max(len(steps), 1)
  wall = sum(s["wall_ms"] for s in steps)
  idle_by_phase = collections.Counter()
  for s in steps:
    idle_by_phase.update(s.get("idle_ms_by_phase", {}))
  idle_by_phase = {p: ms / n for p, ms in sorted(idle_by_phase.items(), key=lambda kv: -kv[1])}
  host_idle = sum(ms for p, ms in idle_by_phase.items() if p not in WAITING_PHASES)
  return {
      "trace": os.path.abspath(trace_file),
      "device_ops": source,
      "num_devices": len(devices),
      "steps": [dict(s, phases={p: s["phases"].get(p, 0.0) for p in order}) for s in steps],
      "phases": {p: sum(s["phases"].get(p, 0.0) for s in steps) / n for p in order},
      "step_wall_ms": wall / n,
      "phase_sum_fraction": (sum(sum(s["phases"].values()) for s in steps) / wall if wall else 0.0),
      "idle_ms_by_phase": idle_by_phase,
      "host_idle_ms": host_idle,
      "host_idle_fraction": host_idle / (wall / n) if wall else 0.0,
      "categories": categories,
      "top_ops": [
          {
              "name": name,
              "module": module,
              "category": categorize(name),
              "total_ms": ms,
              "count": count,
          }
          for (name, module), (ms, count) in top
      ],
  }


def to_markdown(r: dict) -> str:
  n = max(len(r["steps"]), 1)
  lines = [
      f"# Trace analysis: `{r['trace']}`",
      "",
      f"{len(r['steps'])} GRPO step(s) ({', '.join(str(s['step']) for s in r['steps'])}), "
      f"mean {r['step_wall_ms']:.1f} ms; device ops: {r['device_ops']}, "
      f"{r['num_devices']} device(s).",
      "",
      "## Loop phases (host spans)",
      "",
      "| phase | mean ms/step | share of step |",
      "|---|---:|---:|",
  ]
  wall = r["step_wall_ms"] or 1.0
  for p, ms in r["phases"].items():
    lines.append(f"| {p} | {ms:.2f} | {100 * ms / wall:.1f}% |")
  phase_sum = sum(r["phases"].values())
  lines += [
      f"| (outside the phases) | {r['step_wall_ms'] - phase_sum:.2f} | "
      f"{100 * (1 - r['phase_sum_fraction']):.1f}% |",
      f"| **step (grpo_step span)** | **{r['step_wall_ms']:.2f}** | 100% |",
      "",
      "| step | wall ms | sum of phases ms | device busy ms | device idle | idle in host "
      "phases |",
      "|---:|---:|---:|---:|---:|---:|",
  ]
  for s in r["steps"]:
    lines.append(
        f"| {s['step']} | {s['wall_ms']:.2f} | {sum(s['phases'].values()):.2f} | "
        f"{s['device_busy_ms']:.2f} | {100 * s['idle_fraction']:.1f}% | "
        f"{100 * s.get('host_idle_ms', 0) / s['wall_ms']:.1f}% |"
    )
  if r.get("idle_ms_by_phase"):
    lines += [
        "",
        "## Device idle by host phase",
        "",
        "Mean ms per step the device is idle while the host is in each phase. Idle in "
        f"{', '.join(WAITING_PHASES)} is the host waiting on the device (gaps inside or "
        "between programs); elsewhere the host keeps the device waiting.",
        "",
        "| phase | idle ms/step | share of step |",
        "|---|---:|---:|",
    ]
    for p, ms in r["idle_ms_by_phase"].items():
      lines.append(
          f"| {p}{'' if p in WAITING_PHASES else ' (host)'} | {ms:.2f} | "
          f"{100 * ms / wall:.1f}% |"
      )
    lines.append(
        f"| **host overhead (idle in host phases)** | **{r['host_idle_ms']:.2f}** | "
        f"**{100 * r['host_idle_fraction']:.1f}%** |"
    )
  total = sum(r["categories"].values()) or 1.0
  lines += [
      "",
      "## Device time by category",
      "",
      "Op self time over the steps, summed over devices (ops running at once on several "
      "threads each count); idle: no op of the device running.",
      "",
      "| category | ms | ms/step | share |",
      "|---|---:|---:|---:|",
  ]
  for c, ms in sorted(r["categories"].items(), key=lambda kv: -kv[1]):
    lines.append(f"| {LABELS[c]} | {ms:.2f} | {ms / n:.2f} | {100 * ms / total:.1f}% |")
  lines += [
      "",
      f"## Top {TOP_K} ops",
      "",
      "| op | module | category | total ms | count | mean µs |",
      "|---|---|---|---:|---:|---:|",
  ]
  for o in r["top_ops"]:
    lines.append(
        f"| `{o['name']}` | {o['module']} | {o['category']} | {o['total_ms']:.2f} | "
        f"{o['count']} | {1e3 * o['total_ms'] / o['count']:.1f} |"
    )
  if any(o["name"].startswith("ynn_fusion") for o in r["top_ops"]):
    lines += [
        "",
        "`ynn_fusion.N` (XLA:CPU YNNPACK) counts as matmul; some of them are "
        "reductions, which the trace does not tell apart.",
    ]
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path", help="WORKDIR/profile (newest run in it) or a *.trace.json.gz")
  args = parser.parse_args(argv)
  trace_file = find_trace(args.path)
  result = analyze(trace_file)
  with open(os.path.join(os.path.dirname(trace_file), "analysis.json"), "w") as f:
    json.dump(result, f, indent=1)
  sys.stdout.write(to_markdown(result))
  return result


if __name__ == "__main__":
  main()
