r"""Run report: PNG plots and report.md from one workdir, or several overlaid.

    python -m grpo_jax.report --workdir=runs/tiny                      # -> runs/tiny/report/
    python -m grpo_jax.report --workdir=runs/a,gs://b/runs/b --out=/tmp/cmp   # one color per run

Reads WORKDIR/metrics.jsonl (curves; the last value of a (step, key) wins), summary.json (the
before/after table; absent while a run is in progress: then metrics.jsonl's evaluations) and
config.json (differences from configs/common.py `base()`); any of them may be missing. Paths
go through `grpo_jax.run.paths` (local or gs://); plots are matplotlib `Figure`s (Agg, no pyplot).
The command prints the path of report.md; an error is one line (`--verbose`: the traceback and
the libraries' log lines).
"""

import dataclasses
import functools
import importlib
import io
import json
import math
import os
import pkgutil
import sys

from absl import logging
import numpy as np

from grpo_jax.run import paths

# One PNG per topic: (file, title, panels); a panel is the keys drawn on one axes.
_TOPICS = (
    ("sft", "SFT warm start", (("sft/loss",), ("sft/validation_accuracy",))),
    ("kl", "KL divergence", (("loss/kl_divergence",), ("loss/ppo_kl",))),
    (
        "clip",
        "PPO clip fraction",
        (("loss/clip_fraction", "loss/clip_fraction_low", "loss/clip_fraction_high"),),
    ),
    ("length", "Completions", (("completions/mean_length",), ("completions/truncated_fraction",))),
    ("loss", "Optimization", (("loss/total",), ("loss/policy_loss",), ("loss/grad_norm",))),
)
_DIAGNOSTICS = ("reward/std_within_group", "reward/zero_std_group_fraction", "reward/errors")
_PHASES = (
    ("perf/rollout_sec", "rollout"),
    ("perf/reward_sec", "rewards"),
    ("perf/update_sec", "update (+log-probs)"),
)
_PHASE_COLORS = ("#8172B3", "#64B5CD", "#CCB974", "#BBBBBB")  # apart from the runs' C0, C1, ...
_STYLE = {
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "font.size": 9,
    "axes.titlesize": 9,
    "legend.fontsize": 8,
    "legend.frameon": False,
}
_LINES = ("-", "--", ":", "-.")
_ABSENT = object()  # a config field one side does not have


@dataclasses.dataclass
class Run:
  name: str
  workdir: str
  series: dict  # metric name -> (steps, values), sorted by step
  summary: dict | None
  config: dict | None

  @property
  def sft_steps(self) -> int:
    """Eval rows are at the global step: GRPO step s + config.sft_steps."""
    return int((self.config or self.summary or {}).get("sft_steps") or 0)


def load_run(workdir: str, name: str) -> Run:
  root, by_key = paths.path(workdir), {}
  jsonl = root / "metrics.jsonl"
  for line in (paths.read_text(jsonl) if paths.exists(jsonl) else "").splitlines():
    try:
      row = json.loads(line)
      step = int(row.pop("step"))
    except (ValueError, KeyError, TypeError, AttributeError):
      continue  # a line being written, or cut short by a crash
    for k, v in row.items():
      try:
        by_key.setdefault(k, {})[step] = float(v)  # "nan", "inf" too
      except (TypeError, ValueError):
        pass
  series = {
      k: (np.array(sorted(d)), np.array([d[s] for s in sorted(d)], np.float64))
      for k, d in by_key.items()
  }
  return Run(
      name, workdir, series, _read_json(root / "summary.json"), _read_json(root / "config.json")
  )


def _read_json(p):
  try:
    return json.loads(paths.read_text(p)) if paths.exists(p) else None
  except ValueError:
    logging.warning("report: %s is not valid JSON; left out", p)
    return None


# ================================================================================ evaluation


def eval_series(run: Run) -> dict:
  """{metric: {generation config: (global steps, values)}}; plain eval/<metric> is greedy."""
  out = {}
  for key, sv in run.series.items():
    if key.startswith("eval/"):
      metric, _, generation = key[len("eval/") :].rpartition("/")
      metric, generation = (metric, generation) if metric else (generation, "greedy")
      if metric != "num_examples":
        out.setdefault(metric, {})[generation] = sv
  return out


def eval_columns(run: Run) -> list[tuple[str, dict]]:
  """[(label, {generation: {metric: value}})]: summary.json's evaluations, or (in progress)
  metrics.jsonl's before SFT, before GRPO and the latest one."""
  if run.summary:
    cols = [
        ("initial", run.summary.get("eval_initial")),
        ("before GRPO", run.summary.get("eval_before")),
        ("after GRPO", run.summary.get("eval_after")),
    ]
    return [(label, e) for label, e in cols if e]
  by_step = {}
  for metric, gens in eval_series(run).items():
    for generation, (steps, values) in gens.items():
      for step, v in zip(steps.tolist(), values.tolist()):
        by_step.setdefault(step, {}).setdefault(generation, {})[metric] = v
  start, later = run.sft_steps, [s for s in by_step if s > run.sft_steps]
  cols = [("initial", by_step.get(0) if start else None), ("before GRPO", by_step.get(start))]
  if later:
    cols.append((f"latest (step {max(later)})", by_step[max(later)]))
  return [(label, e) for label, e in cols if e]


def eval_table(runs: list[Run]) -> list[str]:
  """Markdown rows: one per (run, generation config, metric); one run: all its columns, else
  before GRPO and the last evaluation."""
  multi, lines = len(runs) > 1, []
  for run in runs:
    cols = eval_columns(run)
    if multi and cols:
      cols = [next((c for c in cols if c[0] == "before GRPO"), cols[0]), cols[-1]]
    if cols and not lines:
      labels = ["before GRPO", "after (or latest)"] if multi else [c[0] for c in cols]
      lines = _table(["run"] * multi + ["generation", "metric", *labels, "change"])
    for generation, last in (cols[-1][1].items() if cols else ()):
      n = last.get("num_examples")
      for metric in (m for m in last if m != "num_examples"):
        vals = [c[1].get(generation, {}).get(metric) for c in cols]
        change = "" if len(vals) < 2 or None in vals[-2:] else f"{vals[-1] - vals[-2]:+.3f}"
        lines.append(
            _row(
                [run.name] * multi
                + [generation + (f" (n={n})" if n else ""), metric, *map(_num, vals), change]
            )
        )
  return lines or ["No evaluation yet."]


# The tool-call figures (rollout/turns.py's ToolTurns, summed over processes): label, numerator,
# denominator (None: the figure itself, a per-step ratio).
_TOOL_RATES = (
    ("rows that called a tool", "tool_call/row_fraction", None),
    ("model turns per row", "tool_call/turns_per_row", None),
    ("calls per step", "tool_call/calls", None),
    ("error rate (errors / calls)", "tool_call/errors", "tool_call/calls"),
    ("timeout rate", "tool_call/timeouts", "tool_call/calls"),
    ("malformed calls / calls", "tool_call/malformed", "tool_call/calls"),
)


def tool_table(runs: list[Run]) -> list[str]:
  """Markdown rows: the tool-call and tool-error rates of the first and the last tenth of each
  run's GRPO steps (at least one step each); [] when no run called tools."""
  lines = []
  for run in runs:
    if "tool_call/calls" not in run.series:
      continue
    steps = run.series["tool_call/calls"][0]
    k = max(1, len(steps) // 10)
    spans = {"first": steps[:k], "last": steps[-k:]}

    def over(key, den, span):
      if key not in run.series:
        return None
      at = dict(zip(*(a.tolist() for a in run.series[key])))
      num = [at[s] for s in span if s in at]
      if den is None:
        return float(np.mean(num)) if num else None
      below = dict(zip(*(a.tolist() for a in run.series[den])))
      total = sum(below.get(s, 0.0) for s in span)
      return sum(num) / total if total else None

    def tools_of(run):
      return sorted(
          {k.split("/")[1] for k in run.series if k.count("/") == 2 and k.endswith("/calls")}
      )

    rates = list(_TOOL_RATES) + [
        (f"{t}: error rate", f"tool_call/{t}/errors", f"tool_call/{t}/calls") for t in tools_of(run)
    ]
    if not lines:
      lines = _table(["run", "figure", "first GRPO steps", "last GRPO steps", "change"])
    for label, key, den in rates:
      first, last = (over(key, den, spans[w]) for w in ("first", "last"))
      if first is None and last is None:
        continue
      change = "" if None in (first, last) else f"{last - first:+.3f}"
      lines.append(
          _row(
              [
                  run.name,
                  label,
                  _num(first),
                  _num(last),
                  change,
              ]
          )
      )
    lines.append(
        _row(
            [
                run.name,
                f"(steps {int(spans['first'][0])}-{int(spans['first'][-1])} vs "
                f"{int(spans['last'][0])}-{int(spans['last'][-1])})",
                "",
                "",
                "",
            ]
        )
    )
  return lines


def _num(v) -> str:
  if not isinstance(v, (int, float)):
    return "" if v is None else str(v)
  return f"{v:.3f}" if abs(v) < 1000 else f"{v:.4g}"


def _row(cells) -> str:
  return "| " + " | ".join(cells) + " |"


def _table(head) -> list[str]:
  return [_row(head), "|" + "---|" * len(head)]


# ==================================================================================== config


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
  return out


def _diff(a: dict, b: dict) -> list[str]:
  return [k for k in sorted(set(a) | set(b)) if a.get(k, _ABSENT) != b.get(k, _ABSENT)]


def _cell(v) -> str:
  s = "(absent)" if v is _ABSENT else json.dumps(v)
  return (s if len(s) <= 48 else "…" + s[-47:]).replace("|", "\\|")


def config_section(runs: list[Run]) -> list[str]:
  """Fields that differ from configs/common.py `base()` (a column per run), and per run the
  closest shipped configs/*.py (config.json does not record the file) and what differs."""
  flats = {r.name: _flat(r.config) for r in runs if r.config}
  if not flats:
    return ["No config.json in the workdir."]
  try:
    import configs

    shipped = {
        f"configs/{m.name}.py": importlib.import_module(f"configs.{m.name}")
        for m in pkgutil.iter_modules(configs.__path__)
    }  # common + experiments
    as_flat = lambda c: _flat(json.loads(c.to_json_best_effort()))  # noqa: E731
    default = as_flat(shipped.pop("configs/common.py").base())
    shipped = {
        name: as_flat(m.get_config()) for name, m in shipped.items() if hasattr(m, "get_config")
    }
  except Exception as e:  # outside the repo's environment
    return [f"(no config comparison: {type(e).__name__}: {e})"]
  lines = []
  for name, flat in flats.items():
    best = min(shipped, key=lambda c: len(_diff(shipped[c], flat)), default=None)
    changed = _diff(shipped[best], flat) if best else []
    if best and len(changed) < len(_diff(default, flat)):
      listed = ", ".join(f"`{k}`={_cell(flat.get(k, _ABSENT))}" for k in changed[:20])
      lines.append(
          f"- {name}: closest shipped config `{best}`, "
          + (f"changed: {listed}{' ...' if len(changed) > 20 else ''}" if changed else "unchanged")
      )
  keys = sorted({k for flat in flats.values() for k in _diff(default, flat)})
  if not keys:
    return lines + ["", "Every field has its default value."]
  lines += [
      "",
      "Differences from the defaults (`configs/common.py` `base()`)"
      + ("; **bold**: the runs differ:" if len(flats) > 1 else ":"),
      "",
      *_table(["field", "default", *flats]),
  ]
  for k in keys:
    vals = [_cell(flat.get(k, _ABSENT)) for flat in flats.values()]
    field = f"**{k}**" if len(set(vals)) > 1 else f"`{k}`"
    lines.append(_row([field, _cell(default.get(k, _ABSENT)), *vals]))
  return lines


# ===================================================================================== plots


def _figure(num_panels: int, title: str):
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator

  cols = min(num_panels, 3)
  rows = -(-num_panels // cols)
  fig = Figure(figsize=(8, 1.6 + 2.6 * rows), dpi=100, layout="constrained")
  axes = fig.subplots(rows, cols, squeeze=False).ravel()
  for ax in axes:
    ax.set_visible(ax in axes[:num_panels])
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # steps
  fig.suptitle(title, fontsize=11)
  return fig, axes[:num_panels]


def _ema(y, span: int):
  """Exponential moving average over `span` points (the finite ones), from the first value."""
  out, acc = [], y[0]
  for v in y:
    acc = 2 / (span + 1) * v + (1 - 2 / (span + 1)) * acc
    out.append(acc)
  return np.array(out)


def _curve(ax, x, y, color, label, ls="-"):
  """The series; with many points a faint raw line under an exponential moving average."""
  span, ok = len(y) // 25, np.isfinite(y)
  if span < 2 or not ok.any():
    ax.plot(
        x, y, ls, color=color, label=label, lw=1.5, ms=3.5, marker="o" if len(y) <= 30 else None
    )
    return
  ax.plot(x, y, ls, color=color, lw=0.8, alpha=0.25)
  ax.plot(x[ok], _ema(y[ok], span), ls, color=color, label=label, lw=1.6)


def plot_panels(runs, title, panels, xlabel):
  """One axes per panel (keys); one run: a color per key; several: a color per run and a line
  style per key."""
  fig, axes = _figure(len(panels), title)
  multi = len(runs) > 1
  for i, (ax, keys) in enumerate(zip(axes, panels)):
    for r, run in enumerate(runs):
      for j, key in (kv for kv in enumerate(keys) if kv[1] in run.series):
        label = " ".join([run.name] * multi + [key.rsplit("/", 1)[-1]] * (len(keys) > 1))
        _curve(
            ax,
            *run.series[key],
            f"C{r if multi else j}",
            label or None,
            _LINES[j % 4] if multi else "-",
        )
    ax.set(title=os.path.commonprefix(list(keys)).rstrip("_"), xlabel=xlabel)
    if (i == 0 and multi) or len(keys) > 1:
      ax.legend()
  return fig


def plot_eval(runs):
  """A panel per metric, a line per generation config; o: before GRPO, *: after."""
  per_run = [eval_series(r) for r in runs]
  metrics = list(dict.fromkeys(m for e in per_run for m in e))
  fig, axes = _figure(len(metrics), "Held-out evaluation (o: before GRPO, *: after)")
  multi = len(runs) > 1
  for ax, metric in zip(axes, metrics):
    for r, (run, evals) in enumerate(zip(runs, per_run)):
      start = run.sft_steps
      end = start + (run.summary or {}).get("final_step", math.inf)
      for j, (generation, (steps, values)) in enumerate(evals.get(metric, {}).items()):
        color, ls = (f"C{r}", _LINES[j % 4]) if multi else (f"C{j}", "-")
        ax.plot(
            steps,
            values,
            ls,
            color=color,
            lw=1.5,
            marker=".",
            label=f"{run.name} {generation}" if multi else generation,
        )
        ax.plot(steps[steps == start], values[steps == start], "o", ms=9, mfc="none", color=color)
        ax.plot(steps[steps == end], values[steps == end], "*", ms=10, color=color)
        if not multi and (steps == end).any():
          ax.annotate(
              f"{values[steps == end][0]:.3f}",
              (end, values[steps == end][0]),
              xytext=(4, 4),
              textcoords="offset points",
              fontsize=8,
          )
      if start and not multi:
        ax.axvline(start, color="0.5", ls=":", lw=1)  # GRPO starts
    if all(np.nanmin(v) >= 0 for e in per_run for _, v in e.get(metric, {}).values()):
      ax.set_ylim(bottom=0)
    ax.set(title=metric, xlabel="step (SFT + GRPO)" if any(r.sft_steps for r in runs) else "step")
    ax.legend()
  return fig


def plot_step_time(runs):
  """Seconds per step by phase over steps (one run: stacked; several: totals), and the mean
  per phase of each run as stacked bars; the first step (compilation) left out if > 2 steps."""
  from matplotlib.ticker import AutoLocator

  fig, (over, mean) = _figure(2, "Step time by phase")
  labels, keys = [p[1] for p in _PHASES] + ["other"], [p[0] for p in _PHASES]
  longest = 0.0
  for r, run in enumerate(runs):
    value = {k: dict(zip(*run.series.get(k, ((), ())))) for k in keys + ["perf/step_time_sec"]}
    steps = np.array(sorted(set.intersection(*map(set, value.values()))), dtype=int)
    if not len(steps):
      continue
    total = np.array([value["perf/step_time_sec"][s] for s in steps])
    parts = np.array([[value[k][s] for s in steps] for k in keys])  # [phase, steps]
    parts = np.concatenate([parts, np.maximum(total - parts.sum(0), 0)[None]])
    keep = (steps > steps[0]) | (len(steps) <= 2)
    if len(runs) > 1:
      _curve(over, steps[keep], total[keep], f"C{r}", run.name)
    elif keep.sum() > 40:
      over.stackplot(
          steps[keep], [_ema(p, keep.sum() // 25) for p in parts[:, keep]], colors=_PHASE_COLORS
      )  # smoothed: stacked raw spikes are unreadable
    else:
      for p, bottom in enumerate(np.cumsum(parts[:, keep], 0) - parts[:, keep]):
        over.bar(steps[keep], parts[p, keep], bottom=bottom, color=_PHASE_COLORS[p], width=0.8)
    left = np.concatenate([[0], np.cumsum(parts[:, keep].mean(1))])
    for p, label in enumerate(labels):
      mean.barh(
          run.name,
          left[p + 1] - left[p],
          left=left[p],
          color=_PHASE_COLORS[p],
          height=0.5,
          label=None if r else label,
      )
    longest = max(longest, left[-1])
    mean.annotate(
        f"{left[-1]:.3g} s",
        (left[-1], r),
        xytext=(3, 0),
        textcoords="offset points",
        va="center",
        fontsize=8,
    )
  over.set(title="seconds per step", xlabel="GRPO step")
  mean.xaxis.set_major_locator(AutoLocator())  # seconds, not steps
  mean.set(
      title="mean seconds per step, by phase",
      xlabel="seconds",
      ylim=(-0.75, max(len(runs), 2) - 0.25),
      xlim=(0, 1.15 * longest or None),
  )
  fig.legend(*mean.get_legend_handles_labels(), loc="outside lower center", ncols=len(labels))
  if len(runs) > 1:
    over.legend()
  return fig


# ==================================================================================== report


def _names(workdirs: list[str]) -> list[str]:
  parts = [os.fspath(w).rstrip("/").split("/") for w in workdirs]
  names = [p[-1] for p in parts]
  return names if len(set(names)) == len(names) else ["/".join(p[-2:]) for p in parts]


def _status(run: Run) -> str:
  if s := run.summary:
    sec = float(s.get("wall_time_sec") or 0)
    return (
        f"finished: {s.get('final_step')} GRPO steps"
        + (f" after {s['sft_steps']} SFT steps" if s.get("sft_steps") else "")
        + " in "
        + (f"{sec:.0f} s" if sec < 600 else f"{sec / 3600:.2f} h")
    )
  steps, sft = (run.series.get(k, ((),))[0] for k in ("reward/total", "sft/loss"))
  if not len(steps):
    return (
        f"run in progress: SFT step {int(sft[-1])}"
        if len(sft)
        else "run in progress: no step logged yet"
        if run.series
        else "no metrics yet"
    )
  total = (run.config or {}).get("num_steps")
  return f"run in progress: GRPO step {int(steps[-1])}" + (f" of {total}" if total else "")


def _plots(runs: list[Run]) -> list[tuple[str, str, functools.partial]]:
  """(file name, title, draw) of each topic some run has data for, in report order."""
  has = lambda key: any(key in r.series for r in runs)  # noqa: E731
  rewards = sorted(
      {k for r in runs for k in r.series if k.startswith("reward/")}
      - {"reward/total", *_DIAGNOSTICS}
  )
  errors = any(np.any(r.series.get("reward/errors", ((), np.zeros(1)))[1] > 0) for r in runs)
  topics = [
      (
          "reward",
          "Reward (mean over the rollout batch)",
          (
              ("reward/total",),
              *((k,) for k in rewards),
              ("reward/zero_std_group_fraction",),
              *((("reward/errors",),) if errors else ()),
          ),
      )
  ] + list(_TOPICS)
  plots = []
  for name, title, panels in topics:
    if panels := [keys for keys in panels if any(map(has, keys))]:
      plots.append(
          (
              name,
              title,
              functools.partial(
                  plot_panels, runs, title, panels, "SFT step" if name == "sft" else "GRPO step"
              ),
          )
      )
  if any(eval_series(r) for r in runs):
    plots.insert(1, ("eval", "Held-out evaluation", functools.partial(plot_eval, runs)))
  if any(all(k in r.series for k, _ in _PHASES + (("perf/step_time_sec", ""),)) for r in runs):
    plots.append(("step_time", "Step time by phase", functools.partial(plot_step_time, runs)))
  return plots


def write_report(workdirs, out: str | None = None) -> str:
  """Writes the report of `workdirs` (one path, or a list to overlay) into `out` (default:
  FIRST_WORKDIR/report): one PNG per topic and report.md. -> the path of report.md."""
  workdirs = [workdirs] if isinstance(workdirs, (str, os.PathLike)) else list(workdirs)
  for w in workdirs:
    if not paths.isdir(w):
      raise FileNotFoundError(f"--workdir={w}: no such folder")
    if not any(paths.exists(paths.path(w) / f) for f in ("config.json", "metrics.jsonl")):
      raise FileNotFoundError(  # a run writes config.json at its start, then metrics.jsonl
          f"--workdir={w} holds neither config.json nor metrics.jsonl: not a training run's "
          "folder. Fix: name the --workdir a run wrote (the demo's: runs/tiny-<date>-<time>)"
      )
  runs = [load_run(w, n) for w, n in zip(workdirs, _names(workdirs))]
  out = paths.path(out or paths.path(workdirs[0]) / "report")
  paths.makedirs(out)
  md = [
      "# GRPO report: " + ", ".join(r.name for r in runs),
      "",
      *(f"- **{r.name}** (`{r.workdir}`): {_status(r)}" for r in runs),
      "",
      "## Evaluation before / after",
      "",
      *eval_table(runs),
      "",
  ]
  tools = tool_table(runs)
  if tools:
    md += ["## Tool calls: first / last GRPO steps", "", *tools, ""]
  md += [
      "## Curves",
      "",
  ]
  plots = _plots(runs)
  import matplotlib

  with matplotlib.rc_context(_STYLE):
    for name, title, draw in plots:
      md += [f"### {title}", ""]
      try:
        buf = io.BytesIO()
        draw().savefig(buf, format="png", dpi=100)
        paths.write_atomic(out / f"{name}.png", buf.getvalue())
        md += [f"![{title}]({name}.png)", ""]
      except Exception as e:  # one plot missing beats no report at the end of a run
        logging.warning("report: the %s plot failed: %s: %s", name, type(e).__name__, e)
        md += [f"(plot failed: {type(e).__name__}: {e})", ""]
  md += [] if plots else ["No curves yet.", ""]
  md += ["## Config", "", *config_section(runs), ""]
  paths.write_atomic(out / "report.md", "\n".join(md))
  return os.fspath(out / "report.md")


if __name__ == "__main__":
  # Flags only here: grpo_jax.main (which imports train, which imports this) owns --workdir.
  from absl import app
  from absl import flags

  _WORKDIR = flags.DEFINE_string(
      "workdir", None, "Run folder; several (a,b) overlay.", required=True
  )
  _OUT = flags.DEFINE_string("out", None, "Report folder (default: FIRST_WORKDIR/report).")
  _VERBOSE = flags.DEFINE_bool(
      "verbose", False, "Show the libraries' log lines, and on an error the traceback."
  )

  def main(argv):
    del argv
    from grpo_jax.run import console

    console.quiet_libraries(verbose=_VERBOSE.value)
    try:
      print(write_report(_WORKDIR.value.split(","), _OUT.value))
    except FileNotFoundError as e:
      sys.exit(f"error: {e}")
    except Exception as e:  # one line; the traceback with --verbose
      if _VERBOSE.value:
        raise
      sys.exit(
          f"error: {type(e).__name__}: {' '.join(str(e).split())} (--verbose prints the traceback)"
      )

  app.run(main)
