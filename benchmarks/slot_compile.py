r"""Compile seconds of the slot engine's programs (rollout/slots.py) vs the lockstep sampler's
(rollout/sampler.py), for a recipe's model and shapes, with abstract inputs (no weights made).

    # XLA:GPU's deviceless compile for one H100 (the CUDA plugin: .venv-aot, scripts/test_aot.sh)
    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/slot_compile.py --platform=h100
    python benchmarks/slot_compile.py --platform=cpu          # XLA:CPU, this machine
    python benchmarks/slot_compile.py --platform=cpu --layers=4 --programs=decode  # depth check
    # libtpu's compile for a v5p-8 (one chip), and each program's optimized HLO into a folder
    JAX_PLATFORMS=cpu .venv-aot/bin/python benchmarks/slot_compile.py --platform=v5p-8 \
        --programs=decode --dump_hlo=/tmp/hlo   # grpo_jax/plan/hlo_inspect.py reads them

The model is the recipe's (--config: configs/qwen3_0p6b.py, Qwen3-0.6B, f32 master weights,
scanned, bf16 compute); shapes are its own: prompts P = max_prompt_length, completions C =
max_completion_length, slots = batch_size x num_generations (every row of a step at once), its
generation (temperature, top-k). Each program is lowered from ShapeDtypeStructs with the
loop's shardings (a one-device mesh) and compiled once; the time is lower + compile, in one
process, programs in order, after a warm-up compile of a trivial program:
  lockstep   the sampler's one program (weight copy, prefill, every decode step), as the loop
             compiles it (memory_plan's sampler row)
  copy       the engine's compute-dtype weight copy (once per weight version)
  admit      prefill of `--admit` prompts into their G slots each (one program per admission
             width, powers of two; the on-policy step with slots = B x G admits all B at once)
  decode     a chunk of decode steps over every slot (admitting from the device queue with
             --admission=decode, the engine's default without tools)
  decode_narrow  the same over a quarter of the slots (a step's last rows; CPU only)
  push       the device queue's prefill of slots / G prompts (--admission=decode)
  refresh    re-prefill of every slot (new weights in flight)
  take       a step's rows as a Rollout
  init       the empty state
for the engine's per-layer programs (scan_layers=False: one program per layer, as the lockstep
sampler) and its scanned ones (scan_layers=True: one lax.scan over stacked layers and caches).
On the H100 every program compiles with XLA's sort kernel instead of cub
(xla_gpu_deviceless_cub_mode: a top-k > 16 otherwise fails at the deviceless compile's end;
grpo_jax/plan/tpu_targets.compile_program), the same for all.
Printed: seconds per program (and its temporaries, XLA's memory analysis), each engine's sum and its ratio to the lockstep sampler, and the
sum without refresh: what an on-policy run (rollout.max_staleness=0) compiles, as refresh runs
only when new weights land while rows are in flight (streaming). --workers=N: the engine's
programs once more as the engine compiles them ahead (rollout/slot_ahead.py,
rollout.slot_compile_threads; jax's caches cleared first): copy, with init compiling beside it,
then the admission of every group, the decode (and the narrow one), the push (admission in the
decode) and the take ("on_policy"; streaming, "total": also a refill's admission and the
refresh) lowered in order, each compiled by one of N threads as soon as it is lowered (XLA
compiles with the GIL released): the wall time of the set, and the time before the first
decode: the engine waits for all but the LATER programs (rollout/slot_ahead.py: the refresh
and the narrow decode, lowered last and compiled once the others are), which compile behind
it.
"""

import argparse
import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ENGINE_PROGRAMS = ("copy", "admit", "decode", "decode_narrow", "push", "refresh", "take", "init")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--platform", default="h100", choices=("h100", "v5p-8", "cpu"))
  p.add_argument("--config", default="configs/qwen3_0p6b.py")
  p.add_argument("--layers", type=int, default=0, help="override model.num_layers (0: as is)")
  p.add_argument(
      "--programs",
      default="lockstep," + ",".join(ENGINE_PROGRAMS),
      help="comma list of lockstep and engine programs",
  )
  p.add_argument("--engines", default="layers,scan", help="layers (per-layer) and/or scan")
  p.add_argument("--admit", type=int, default=0, help="admission width (0: batch_size)")
  p.add_argument(
      "--admission",
      default="decode",
      choices=("decode", "host"),
      help="the engine's rollout.slot_admission (decode: the default without tools)",
  )
  p.add_argument("--top_k", type=int, default=-1, help="override rollout.top_k (-1: as is)")
  p.add_argument(
      "--set", action="append", default=[], help="config override a.b=value (repeatable)"
  )
  p.add_argument(
      "--workers",
      type=int,
      default=0,
      help="also compile each engine's programs (but copy) again, lowered in order and "
      "compiled by this many threads at once, and print the wall time (0: not)",
  )
  p.add_argument(
      "--dump_hlo",
      default="",
      help="a folder: each compiled program's optimized HLO as <engine>_<program>.hlo.txt "
      "(grpo_jax/plan/hlo_inspect.py reads them)",
  )
  p.add_argument(
      "--xla",
      action="append",
      default=[],
      help="an extra XLA compiler option name=value for every program (repeatable)",
  )
  p.add_argument("--json", default="")
  return p.parse_args(argv)


def _xla_option(text: str):
  """'name=value' -> (name, value): true/false as bools, digits as ints, else the string."""
  name, _, value = text.partition("=")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  return name, int(value) if value.lstrip("-").isdigit() else value


def main(argv=None):
  args = parse_args(argv)
  if args.platform != "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin then wants no driver
  import jax
  import jax.numpy as jnp
  from grpo_jax.models import build
  from grpo_jax.plan import tpu_targets
  from grpo_jax.rollout import sampler as sampler_lib
  from grpo_jax.rollout.slots import SlotEngine
  from grpo_jax.rollout.types import GenerationConfig
  from grpo_jax.parallel import sharding

  name = os.path.splitext(os.path.basename(args.config))[0]
  cfg = importlib.import_module(f"configs.{name}").get_config()
  if args.layers:
    cfg.model.num_layers = args.layers
  if args.top_k >= 0:
    cfg.rollout.top_k = args.top_k
  for item in args.set:
    path, value = item.split("=", 1)
    *parents, leaf = path.split(".")
    node = cfg
    for part in parents:
      node = node[part]
    node[leaf] = type(node[leaf])(value) if not isinstance(node[leaf], bool) else value == "True"
  if args.platform == "h100":
    if tpu_targets.cuda_plugin_version() is None:
      sys.exit("no jax-cuda13-plugin: run with .venv-aot (scripts/test_aot.sh), or --platform=cpu")
    target = tpu_targets.make_target("h100")
  elif args.platform == "v5p-8":
    if tpu_targets.libtpu_version() is None:
      sys.exit("no libtpu: run with .venv-aot (scripts/test_aot.sh), or --platform=cpu")
    target = tpu_targets.make_target("v5p-8")
  else:
    target = tpu_targets.make_target(None)
    target = target.__class__(**{**target.__dict__, "devices": target.devices[:1]})
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 1, 1
  mesh = build.make_mesh(cfg, devices=target.devices[:1])
  policy = build.make_policy(cfg, mesh, abstract=True)
  params = policy.params
  b, g = cfg.batch_size, cfg.num_generations
  p, c = cfg.max_prompt_length, cfg.max_completion_length
  gen = GenerationConfig(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
  rep = sharding.replicated(mesh)
  sds = lambda shape, dt, s=rep: jax.ShapeDtypeStruct(shape, dt, sharding=s)  # noqa: E731
  key = jax.eval_shape(lambda: jax.random.key(0))
  gpu = target.devices[0].platform == "gpu"
  options = {"xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED"} if gpu else {}
  options.update(_xla_option(o) for o in args.xla)
  options = options or None
  programs = args.programs.split(",")
  print(
      f"[slot_compile] {target.compiler}; {name}: L={cfg.model.num_layers} "
      f"d={cfg.model.hidden_size} V={cfg.model.vocab_size} scan_layers={cfg.model.scan_layers} "
      f"param {cfg.model.param_dtype} / compute {cfg.model.dtype}; P={p} C={c} B x G={b}x{g}; "
      f"top_k={gen.top_k}",
      flush=True,
  )

  def timed(label, lower):
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
      lowered = lower()
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=options)
    t2 = time.perf_counter()
    if args.dump_hlo:
      os.makedirs(args.dump_hlo, exist_ok=True)
      name = label.replace(": ", "_").replace(" ", "_").replace("(", "").replace(")", "")
      with open(os.path.join(args.dump_hlo, name + ".hlo.txt"), "w") as fh:
        fh.write(compiled.as_text())
    mem = compiled.memory_analysis()
    temp = f", temp {mem.temp_size_in_bytes / 2**30:6.2f} GiB" if mem is not None else ""
    print(f"  {label:<22} {t2 - t0:7.2f} s  (lower {t1 - t0:5.2f}, compile {t2 - t1:6.2f}{temp})")
    return compiled, t2 - t0

  timed("warm-up (a + 1)", lambda: jax.jit(lambda x: x + 1).lower(sds((8,), jnp.float32)))
  results = {}
  if "lockstep" in programs:
    sampler = sampler_lib.Sampler(
        policy.sampler_graphdef,
        max_prompt_length=p,
        max_new_tokens=c,
        num_generations=g,
        eos_ids=(0,),
        mesh=mesh,
        **sampler_lib.config_options(cfg),
    )
    fn = sampler._fn(0 if gen.is_greedy else int(gen.top_k), gen.top_p < 1.0, gen.is_greedy)
    prompt = sds((b, p), jnp.int32, sharding.batch_sharding(mesh, 2))
    scalar = sds((), jnp.float32)
    sargs = (params, prompt, prompt, sds(key.shape, key.dtype), scalar, scalar)
    _, results["lockstep"] = timed("lockstep sampler", lambda: fn.lower(*sargs))

  for kind in args.engines.split(","):
    scan = kind == "scan"
    engine = SlotEngine(
        policy.sampler_graphdef,
        slots=b * g,
        max_prompt_length=p,
        max_new_tokens=c,
        num_generations=g,
        eos_ids=(0,),
        mesh=mesh,
        chunk=cfg.rollout.slot_chunk,
        scan_layers=scan,
        admit_in_decode=args.admission == "decode",
        decode_attention=cfg.rollout.decode_attention,
        step_graphs=cfg.rollout.step_graphs,
    )
    engine.reset(gen, rows_per_step=b * g)
    engine._model_known(policy.model_config)  # what set_weights reads from the weights
    copy, secs = timed(f"{kind}: copy", lambda: engine._program("copy").lower(params))
    if "copy" in programs:
      results[f"{kind}:copy"] = secs
    weights = jax.tree.map(
        lambda x, s: sds(x.shape, x.dtype, s),
        jax.eval_shape(engine._copy, params),
        copy.output_shardings,
    )
    shardings = engine._state_shardings()
    with jax.set_mesh(mesh):
      st = jax.eval_shape(engine._init)
    st = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), st, shardings)
    i32, f32 = jnp.int32, jnp.float32
    a = args.admit or b
    scalars = (sds((), f32), sds((), f32))

    def admit_at(a):
      n = a * g
      return engine._program("admit", a, p).lower(
          st,
          weights,
          sds((a, p), i32),
          sds((a, p), i32),
          *(sds((n,), i32) for _ in range(4)),
          sds((a, *key.shape), key.dtype),
      )

    q = engine.queue_len
    decode_args = (st, weights, sds((), i32), sds((), i32), sds((3,), i32), *scalars)
    push_args = (st, weights, sds((q, p), i32), sds((q, p), i32))
    push_args += tuple(sds((q, g), i32) for _ in range(3))
    push_args += (sds((q, *key.shape), key.dtype), sds((), i32))
    lowers = {
        "admit": lambda: admit_at(a),
        "decode": lambda: engine._program("decode").lower(*decode_args),
        "decode_narrow": lambda: engine._program("decode_narrow").lower(*decode_args),
        "push": lambda: engine._program("push").lower(*push_args),
        "refresh": lambda: engine._program("refresh").lower(st, weights),
        "take": lambda: engine._program("take").lower(st, sds((b * g,), i32)),
        "init": lambda: engine._program("init").lower(),
    }
    used = set(ENGINE_PROGRAMS) - ({"push"} if not engine.admit_in_decode else set())
    used -= {"decode_narrow"} if not engine.narrow else set()
    programs_here = [x for x in programs if x in used or x == "lockstep"]
    for prog in ENGINE_PROGRAMS[1:]:
      if prog in programs_here:
        _, results[f"{kind}:{prog}"] = timed(f"{kind}: {prog}", lowers[prog])
    total = sum(v for k, v in results.items() if k.startswith(kind + ":"))
    results[f"{kind}:total"] = total
    line = f"  {kind + ': all programs':<28} {total:7.2f} s"
    if "lockstep" in results:
      line += f"   engine / lockstep = {total / results['lockstep']:.3f}"
    print(line, flush=True)
    # On-policy (max_staleness 0) steps never run refresh: weights land between steps, with no
    # row in flight (rollout/slots.py: set_weights), and the loop compiles on first use.
    if "refresh" in programs:  # (admission in the decode: no admit program, the push instead)
      on_policy = total - results[f"{kind}:refresh"]
      if engine.admit_in_decode:
        on_policy -= results.get(f"{kind}:admit", 0.0)
      results[f"{kind}:on_policy"] = on_policy
      line = f"  {kind + ': on-policy (no refresh)':<28} {on_policy:7.2f} s"
      if "lockstep" in results:
        line += f"   engine / lockstep = {on_policy / results['lockstep']:.3f}"
      print(line, flush=True)
    if args.workers:
      lowers["copy"] = lambda: engine._program("copy").lower(params)
      # as the engine compiles ahead (rollout/slots.py: _compile_ahead): on-policy one admission
      # of every group; streaming a refill's too
      lowers["admit"] = lambda: admit_at(engine.num_slots // g)
      lowers["admit_refill"] = lambda: admit_at(engine.refill // g)
      results.update(
          _parallel(kind, lowers, programs_here, args.workers, options, timed, results, mesh)
      )
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(vars(args), target=target.compiler, seconds=results), fh, indent=1)


def _parallel(kind, lowers, programs, workers, options, timed, results, mesh) -> dict:
  """Wall seconds of `kind`'s programs compiled again by `workers` threads (module docstring)."""
  import concurrent.futures
  import jax

  out = {}
  # admission in the decode: the push (its prefill), no admit program; between chunks the
  # admission of every group, and streaming a refill's too
  admit = ("push",) if "push" in programs else ("admit",)
  refill = () if "push" in programs else ("admit_refill",)
  on_policy = (*admit, "decode", "decode_narrow", "take")
  streaming = (*admit, *refill, "decode", "decode_narrow", "take", "refresh")
  from grpo_jax.rollout.slot_ahead import LATER

  later = [n for n in LATER if n in programs]  # compiled behind the first decode
  for label, names in (("on_policy", on_policy), ("total", streaming)):
    names = [n for n in names if n.removesuffix("_refill") in programs]
    names.sort(key=lambda n: n in later)  # (stable) submitted last, as the engine does
    jax.clear_caches()  # nothing compiled before is reused
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, jax.set_mesh(mesh):
      # the engine's first set_weights: the empty state's program compiles in the pool while
      # the weight copy compiles on the caller's thread (rollout/slot_ahead.py `_init_ahead`)
      init = pool.submit(lowers["init"]().compile, compiler_options=options)
      timed(f"{kind}: copy (first)", lowers["copy"])
      init.result()
      compiles = [
          pool.submit(lowers[n]().compile, compiler_options=options)
          for n in names
          if n not in later
      ]
      lowered = [lowers[n]() for n in names if n in later]
      for done in compiles:
        done.result()
      first = time.perf_counter() - t0  # what the engine waits for before its first decode
      compiles = [pool.submit(x.compile, compiler_options=options) for x in lowered]
      for done in compiles:
        done.result()
    wall = time.perf_counter() - t0
    out[f"{kind}:{label}_wall_{workers}"] = wall
    out[f"{kind}:{label}_first_decode_{workers}"] = first
    line = f"  {kind + f': {label}, {workers} threads':<28} {wall:7.2f} s wall"
    if "lockstep" in results:
      line += f"   engine / lockstep = {wall / results['lockstep']:.3f}"
    line += f"   (before the first decode: {first:.2f} s"
    if "lockstep" in results:
      line += f", {first / results['lockstep']:.3f}"
    print(line + ")", flush=True)
  return out


if __name__ == "__main__":
  main()
