r"""Resident bytes of a GRPO run, full-parameter vs LoRA (and a quantized base), from shapes.

    python benchmarks/lora_memory.py                               # qwen3_0p6b, ranks 8 and 16
    python benchmarks/lora_memory.py --config=configs/qwen3_8b.py --ranks=8 --json=/tmp/m.json

Builds each variant's policy abstractly (models.build.make_policy(abstract=True): shapes and
dtypes, nothing allocated) and the loop's own update state (rl.step.build(...).abstract_state),
then counts, for the whole model (divide by the device count for an even FSDP split):
  params      every weight the policy holds: the base (frozen under LoRA; int8/int4 values plus
              per-channel scales when quantized) and the adapters
  trained     the part the optimizer updates (all of params, or the adapters)
  optimizer   the optimizer state (AdamW: two moments of `trained`)
  reference   the frozen reference copy for beta > 0 (policy.as_reference, compute dtype); 0 for
              LoRA, whose reference is the base itself
  total       params + optimizer + reference (what stays resident through a step; activations
              and the KV cache come on top: python -m grpo_jax.memory_plan compiles for those)
  checkpoint  what one GRPO checkpoint stores: the trained params, their optimizer state and
              the reference (LoRA: adapters + their moments; the base is named, not stored)
"""

import argparse
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from grpo_jax.parallel import sharding  # noqa: E402
from grpo_jax.models import build  # noqa: E402
from grpo_jax.models import policy as policy_lib  # noqa: E402
from grpo_jax.rl import step as step_lib  # noqa: E402


def _bits(dtype) -> int:  # int4 counts as 4 bits (stored packed on TPU), not numpy's 1 byte
  return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo(dtype).bits


def _bytes(tree) -> int:
  return sum(x.size * _bits(x.dtype) // 8 for x in jax.tree.leaves(tree))


def _load(path):
  spec = importlib.util.spec_from_file_location("bench_cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def measure(config) -> dict:
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  pol = build.make_policy(config, mesh, abstract=True)
  state = step_lib.build(config, pol, mesh).abstract_state
  trained = pol.split(state["params"])[0] if pol.split else state["params"]
  ref = 0
  if config.beta > 0 and pol.reference is None:
    ref = _bytes(policy_lib.as_reference(state["params"], config.model.dtype))
  out = dict(
      params=_bytes(state["params"]),
      trained=_bytes(trained),
      optimizer=_bytes(state["opt_state"]),
      reference=ref,
  )
  out["total"] = out["params"] + out["optimizer"] + ref
  out["checkpoint"] = out["trained"] + out["optimizer"] + ref
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="configs/qwen3_0p6b.py")
  ap.add_argument("--ranks", default="8,16")
  ap.add_argument("--quantize", default="int8,int4", help="quantized bases at the first rank")
  ap.add_argument("--json", default="")
  args = ap.parse_args()
  base = _load(args.config)
  ranks = [int(r) for r in args.ranks.split(",") if r]
  variants = [("full", 0, "none")] + [(f"lora r{r}", r, "none") for r in ranks]
  variants += [(f"lora r{ranks[0]} {q} base", ranks[0], q) for q in args.quantize.split(",") if q]
  rows = []
  for name, rank, quant in variants:
    c = base.copy_and_resolve_references()
    c.lora.rank, c.lora.quantize_base = rank, quant
    if quant != "none":
      c.sft_steps = 0
    rows.append(dict(variant=name, **measure(c)))
  gb = lambda x: f"{x / 1e9:.3f}"
  print(
      f"{args.config}: beta={base.beta}, param_dtype={base.model.param_dtype}, "
      f"dtype={base.model.dtype} (GB = 1e9 bytes, whole model)\n"
  )
  print("| variant | params | trained | optimizer | reference | total | checkpoint |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(
        f"| {r['variant']} | {gb(r['params'])} | {gb(r['trained'])} | {gb(r['optimizer'])} | "
        f"{gb(r['reference'])} | {gb(r['total'])} | {gb(r['checkpoint'])} |"
    )
  full = rows[0]["total"]
  for r in rows[1:]:
    print(f"{r['variant']}: total {full / r['total']:.2f}x smaller than full")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
