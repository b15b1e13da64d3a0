"""memory_plan's printout: its rows (memory_plan.Row) as the fixed-width table, the per-setting
fit lines and the header, in GiB (MiB for tiny configs)."""

import json

from grpo_jax.plan.tpu_targets import GIB


def unit_of(rows: list) -> tuple[str, int]:
  """GiB, or MiB when every total is under 1 GiB (tiny configs)."""
  return ("GiB", GIB) if max(r.total for r in rows) >= GIB else ("MiB", 1024**2)


def fit_text(row, unit=("GiB", GIB)) -> str:
  if not row.hbm_capacity:
    return "n/a (HBM unknown)"
  margin = (row.hbm_capacity - row.total) / unit[1]
  refused = "*" if "oom_required" in row.compiled else ""  # the TPU compiler itself said so
  return f"FITS (+{margin:.2f})" if margin >= 0 else f"DOES NOT FIT ({margin:.2f}){refused}"


def table(rows: list) -> str:
  """Rows as a fixed-width table, per device (unit_of's unit)."""
  unit = unit_of(rows)
  cols = [
      "function",
      "remat",
      "micro",
      "params",
      "optim",
      "ref",
      "rollout_w",
      "temp",
      "kv",
      "io",
      "host",
      "total",
      "HBM",
      f"fits (margin {unit[0]})",
  ]
  if not any(r.rollout_weights for r in rows):
    cols.remove("rollout_w")
  gib = lambda b: f"{b / unit[1]:.2f}"
  cells = {
      "function": lambda r: r.function,
      "remat": lambda r: r.remat or "-",
      "micro": lambda r: str(r.micro_batch or "-"),
      "params": lambda r: gib(r.params),
      "optim": lambda r: gib(r.optimizer),
      "ref": lambda r: gib(r.reference),
      "rollout_w": lambda r: gib(r.rollout_weights),
      "temp": lambda r: gib(r.temp),
      "kv": lambda r: gib(r.kv_cache),
      "io": lambda r: gib(r.io),
      "host": lambda r: gib(r.host_offload),
      "total": lambda r: gib(r.total),
      "HBM": lambda r: gib(r.hbm_capacity) if r.hbm_capacity else "?",
      cols[-1]: lambda r: fit_text(r, unit),
  }
  body = [[cells[c](r) for c in cols] for r in rows]
  widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
  fmt = lambda vals: "  ".join(
      v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths))
  ).rstrip()
  return "\n".join([fmt(cols), fmt(["-" * w for w in widths]), *map(fmt, body)])


def step_summary(rows: list, unit=("GiB", GIB)) -> list[str]:
  """One line per update setting: the step's peak, the largest of that update and the
  forward-only rows (the sampler and log-prob passes run with the same state resident)."""
  forward = [r for r in rows if r.function != "update"]
  settings = [r for r in rows if r.function == "update"] or [None]
  lines = []
  for u in settings:
    peak = max([r for r in (u, *forward) if r is not None], key=lambda r: r.total)
    what = f"remat {u.remat}, micro-batch {u.micro_batch}" if u else "forward passes"
    lines.append(
        f"step with {what}: peak {peak.total / unit[1]:.2f} {unit[0]} "
        f"({peak.function}): {fit_text(peak, unit)}"
    )
  return lines


def header(config, target, mesh_shape: dict, unit: str = "GiB") -> str:
  m = config.model
  return (
      f"HBM plan: model {m.preset} ({m.impl}, params {m.param_dtype}, compute {m.dtype}), "
      f"B={config.batch_size} G={config.num_generations} P={config.max_prompt_length} "
      f"C={config.max_completion_length} beta={config.beta}\n"
      f"target: {target.name}, {len(target.devices)} x {target.device_kind}, mesh "
      f"{mesh_shape}; {target.compiler}\n"
      f"{unit} per device. total = params + optim + ref + rollout_w + temp + kv + io (host: "
      "pinned host memory, not in total); a step fits when its update row and the forward "
      "rows fit."
  )


def print_disaggregated(config, got: dict, json_path: str | None = None):
  """The printout of memory_plan.plan_disaggregated: each role's table, the weight transfer's
  bytes per step; `json_path`: its rows (with "role") and transfer_bytes as JSON."""
  out = []
  for role in ("trainer", "sampler"):
    rows, mesh_shape, part = got[role]
    unit = unit_of(rows)
    print(f"--- the {role}'s devices")
    print(header(config, part, mesh_shape, unit[0]))
    print(table(rows))
    print("\n".join(step_summary(rows, unit)))
    out += [dict(r.to_json(part, mesh_shape), role=role) for r in rows]
  pairs = len(got["sampler"][2].devices)
  gb = got["transfer_bytes"] / 1e9
  print(
      f"weight transfer trainer -> sampler per step ({config.model.dtype}): {gb:.3f} GB, "
      f"{gb / pairs:.3f} GB per device pair ({pairs} pairs)"
  )
  if json_path:
    with open(json_path, "w") as fh:
      json.dump({"rows": out, "transfer_bytes": got["transfer_bytes"]}, fh, indent=1)
    print(f"wrote {json_path}")
