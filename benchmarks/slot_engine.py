r"""The slot engine (rollout/slots.py) vs the lockstep sampler (rollout/sampler.py) on a
long-tailed batch built from GSM8K's real lengths: finished completion tokens per second.

    python benchmarks/slot_engine.py            # ~2-4 min on 2 CPU cores
    python benchmarks/slot_engine.py --quick    # < 60 s (the test)
    python benchmarks/slot_engine.py --json=out.json
    python benchmarks/slot_engine.py --loop_k=1   # + the loop's queueing, partial rollouts on/off

Lengths: benchmarks/packed_update.py's (issue 42's): a prompt is a GSM8K train question rendered
as configs/qwen3_8b.py renders it, in Qwen tokens; a completion is 1.5 x the Qwen tokens of a
GSM8K reference answer, 5% of the rows at the 1024 cap; the CPU workload divides every length
by 8 (P 32, C 128) on packed_update's CPU model (L4 d256, vocab 4096, f32).

A row's length is imposed, not drawn: no stop token, each row's completion budget set to its
length (the slot engine's per-row `caps`). The lockstep sampler decodes every row of a batch
until its longest row is done: it runs with max_new_tokens = the batch's longest length (a
program per distinct maximum, compiled before timing), which is what its stop check gives when
every row stops at its own length. Useful tokens = the rows' lengths.

Modes, each timed after a warm-up run that compiles every program it uses:
- lockstep: one batch at a time (B x G rows);
- on-policy slots: one batch at a time with half as many slots as rows (rows queued, refilled
  as slots free), the step's rollout taken when its last row is done;
- streaming slots: every batch queued at once (steps in flight), slots = B x G (the lockstep
  sampler's rows: the same KV cache memory, P + C per row): the engine admits the next steps'
  groups as slots free (rollout.max_staleness >= 1's generation);
- streaming 2x slots: the same with 2 x B x G slots (twice the KV memory): rows of two steps
  decode together, which a lockstep batch cannot (its rows are one step's).
Printed: tokens/s, ratios vs lockstep (one run), lockstep's fill (useful / issued row-steps)
and the slots' busy fraction (live slots / slots, per decode step). Streaming is also given
"while queued": tokens drawn per second until the queue ran dry, before the last rows drain
(the loop's steady state, where new steps keep arriving; the whole run includes one drain).

--loop_k=k adds the loop's own queueing (rollout/source.py, rollout.max_staleness = k, no
update between steps: rollout only): at step t the batches up to t + k are queued and the step
waits for its batch, slots = B x G. "loop" waits for step t's own rows (streaming);
"loop, partial" takes the first B groups to finish (rollout.partial_rollout: streaming.Stream's
wait_first, groups due k steps after their own step). Both decode the same rows; the figure is
useful tokens per second over the run (the last step drains either way).
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import packed_update  # noqa: E402
from configs import qwen3_8b  # noqa: E402
from grpo_jax.models import PRESETS  # noqa: E402
from grpo_jax.models import build_model  # noqa: E402
from grpo_jax.rollout import Sampler  # noqa: E402
from grpo_jax.rollout import streaming as streaming_lib  # noqa: E402
from grpo_jax.rollout.slots import SlotEngine  # noqa: E402

WORKLOADS = {
    "cpu": dict(scale=8, batch_size=16, num_generations=2, batches=16, model="cpu"),
    "quick": dict(scale=16, batch_size=8, num_generations=2, batches=4, model="quick"),
}
GENERATION = "standard"


def model_for(name: str):
  spec = packed_update.WORKLOADS[name]["model"]
  cfg = PRESETS["tiny-qwen3"].replace(**spec, dtype="float32", param_dtype="float32")
  return build_model(cfg.replace(max_position_embeddings=4096), seed=0)


def prompt_arrays(rng, bt, vocab: int):
  b, w = bt.prompt_b.size, bt.width
  mask = (np.arange(w)[None] >= (w - bt.prompt_b)[:, None]).astype(np.int32)
  ids = rng.integers(1, vocab, (b, w)) * mask
  return jnp.asarray(ids, jnp.int32), jnp.asarray(mask)


def run_lockstep(samplers, state, batches, key, generation=GENERATION):
  out = []
  for bt, ids, mask in batches:
    r = samplers[int(bt.completion_n.max())](state, ids, mask, key, generation)
    out.append(r)
  jax.block_until_ready(out)
  return out


def run_slots(engine, state, batches, key, streaming: bool, generation=GENERATION):
  n = batches[0][0].completion_n.size
  engine.reset(generation, rows_per_step=n)
  engine.set_weights(state, version=0)
  out = []
  steady = None
  if streaming:
    t0 = time.perf_counter()
    for i, (bt, ids, mask) in enumerate(batches):
      engine.enqueue(i, ids, mask, jax.random.fold_in(key, i), caps=bt.completion_n)
    for i in range(len(batches)):
      while not engine.finished(i):
        engine.advance(tag=i)
        if steady is None and not engine.pending():  # the queue ran dry: the drain begins
          # every live slot of a decode step drew one token (a row's first too: admit draws none)
          steady = (engine.stats()["live_steps"], time.perf_counter() - t0)
      out.append(engine.take(i)[0])
  else:
    for i, (bt, ids, mask) in enumerate(batches):
      engine.enqueue(i, ids, mask, jax.random.fold_in(key, i), caps=bt.completion_n)
      while not engine.finished(i):
        engine.advance(tag=i)
      out.append(engine.take(i)[0])
  jax.block_until_ready(out)
  run_slots.steady = steady
  return out


MODES = ("lockstep", "on-policy slots", "streaming slots", "streaming 2x slots")
# The same slot modes with admission inside the decode (SlotEngine(admit_in_decode=True)).
INSIDE = " +admit in decode"
# A slot mode with a program per layer (SlotEngine(scan_layers=False)), whatever engine_kw says.
LAYERS = " per layer"
# A mode whose decode loops run inside CUDA graphs (rollout.step_graphs; GPU): "lockstep step
# graphs" (Sampler(step_graphs=True): its generate one graph) or a slot mode's (SlotEngine(
# step_graphs=True): each decode step one graph).
GRAPHS = " step graphs"


def make_runs(
    graphdef,
    state,
    batches,
    key,
    *,
    p: int,
    c: int,
    g: int,
    chunk: int,
    modes=MODES,
    generation=GENERATION,
    sampler_kw=None,
    engine_kw=None,
):
  """The modes of the module docstring on (bt, ids, mask) batches: (lockstep samplers by
  max_new_tokens, {mode: (run, engine or None, streaming)}); nothing compiled yet. sampler_kw /
  engine_kw: further Sampler / SlotEngine arguments (mesh, decode_phases, ...)."""
  n = batches[0][0].completion_n.size
  lengths = sorted({int(bt.completion_n.max()) for bt, _, _ in batches})

  def lockstep_samplers(**variant):
    kw = dict(max_prompt_length=p, num_generations=g) | (sampler_kw or {}) | variant
    return {m: Sampler(graphdef, max_new_tokens=m, **kw) for m in lengths}

  samplers = lockstep_samplers()
  kw = dict(max_prompt_length=p, max_new_tokens=c, num_generations=g, chunk=chunk)
  kw.update(engine_kw or {})
  slots = {"on-policy slots": (n // 2, False), "streaming slots": (n, True)}
  slots["streaming 2x slots"] = (2 * n, True)
  runs = {}
  for name in modes:
    inside = name.endswith(INSIDE)
    base = name.removesuffix(INSIDE)
    graphs = base.endswith(GRAPHS)
    base = base.removesuffix(GRAPHS)
    per_layer = base.endswith(LAYERS)
    base = base.removesuffix(LAYERS)
    if base == "lockstep":
      by_length = lockstep_samplers(step_graphs=True) if graphs else samplers
      runs[name] = (
          lambda s=by_length: run_lockstep(s, state, batches, key, generation),
          None,
          False,
      )
      continue
    count, streaming = slots[base]
    flight = dict(steps_in_flight=len(batches)) if streaming else {}
    variant = (dict(scan_layers=False) if per_layer else {}) | (
        dict(step_graphs=True) if graphs else {}
    )
    engine = SlotEngine(graphdef, slots=count, **flight, **(kw | variant), admit_in_decode=inside)
    runs[name] = (
        lambda e=engine, s=streaming: run_slots(e, state, batches, key, s, generation),
        engine,
        streaming,
    )
  return samplers, runs


def check_run(name: str, run, want: int) -> float:
  """Runs a mode once (its warm-up: every program compiled), checks it drew `want` completion
  tokens -> seconds."""
  t0 = time.perf_counter()
  got = run()
  sec = time.perf_counter() - t0
  assert sum(int(r.lengths.sum()) for r in got) == want, (name, want)
  return sec


def time_run(run, engine, streaming, useful: int) -> dict:
  """One timed run of a warm mode: seconds, useful tokens/s, the engine's stats and (streaming)
  tokens/s while queued."""
  t0 = time.perf_counter()
  run()
  sec = time.perf_counter() - t0
  entry = dict(sec=sec, tokens_per_sec=useful / sec)
  if engine is not None:
    entry.update(engine.stats())
    entry["slots"] = engine.num_slots
    if streaming and run_slots.steady is not None:
      tokens, at = run_slots.steady
      entry["steady_tokens_per_sec"] = tokens / at
  return entry


def run_loop(engine, state, batches, key, k: int, partial: bool):
  """The loop's queueing, rollout only: at step t the batches up to t + k are queued (as
  RolloutSource._queue_ahead), then step t's batch is waited for: its own rows, or (partial)
  the first B groups to finish."""
  stream = streaming_lib.Stream(engine, lambda p: p)
  stream.reset(GENERATION, rows_per_step=batches[0][0].completion_n.size)
  stream.set_weights(state, version=0)
  out, queued, carried = [], 0, 0
  for t in range(len(batches)):
    while queued < len(batches) and queued <= t + k:
      bt, ids, mask = batches[queued]
      stream.enqueue(
          queued, {"ids": ids, "mask": mask}, jax.random.fold_in(key, queued), caps=bt.completion_n
      )
      queued += 1
    if partial:
      rollout, _, groups = stream.wait_first(t, due=t - k)
      carried += int(np.sum(groups[:, 0] < t))
    else:
      rollout, _ = stream.wait(t)
    out.append(rollout)
  jax.block_until_ready(out)
  run_loop.carried = carried
  return out


def uniform(graphdef, state, batches, samplers, kw, key, admission=("host",)) -> dict:
  """On-policy on a batch whose rows all have the same length (the batches' largest maximum,
  so the lockstep sampler compiled for it serves): slots = rows, no refill to gain.
  admission: "host" (slots_sec) and/or "decode" (slots_inside_sec)."""
  bt, ids, mask = batches[0]
  length = max(samplers)
  n = bt.completion_n.size
  caps = np.full(n, length)
  runs = dict(lockstep_sec=lambda: samplers[length](state, ids, mask, key, GENERATION))
  for how in admission:
    engine = SlotEngine(graphdef, slots=n, **kw, admit_in_decode=how == "decode")
    name = "slots_sec" if how == "host" else "slots_inside_sec"
    runs[name] = lambda e=engine: e(state, ids, mask, key, GENERATION, caps=caps)
  out = dict(length=length)
  for run in runs.values():
    jax.block_until_ready(run())
  times = {name: [] for name in runs}
  for _ in range(5):  # interleaved: a slow spell of the machine hits every engine alike
    for name, run in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - t0)
  out.update({name: float(np.median(t)) for name, t in times.items()})
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--data", default=packed_update.SHARED)
  ap.add_argument("--tokenizer", default=os.path.join(packed_update.SHARED, "qwen_tokenizer"))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
      "--chunk",
      type=int,
      default=64,
      help="rollout.slot_chunk: most decode steps between admissions",
  )
  ap.add_argument(
      "--loop_k",
      type=int,
      default=0,
      help="> 0: also the loop's queueing k steps ahead, partial rollouts off and on",
  )
  ap.add_argument(
      "--admission",
      choices=("host", "decode", "both"),
      default="both",
      help="the slot modes' admission: between decode calls (host), inside the decode, or both",
  )
  ap.add_argument("--json", default="")
  args = ap.parse_args(argv)
  w = WORKLOADS["quick" if args.quick else "cpu"]
  recipe = qwen3_8b.get_config()
  p, c = recipe.max_prompt_length // w["scale"], recipe.max_completion_length // w["scale"]
  lengths = packed_update.gsm8k_lengths(args.data, args.tokenizer, recipe)
  rng = np.random.default_rng(args.seed)
  b, g = w["batch_size"], w["num_generations"]
  n = b * g
  model = model_for(w["model"])
  graphdef, state = nnx.split(model)
  batches = []
  for _ in range(w["batches"]):
    bt = packed_update.draw_batch(rng, lengths, b, g, p, c, w["scale"])
    batches.append((bt, *prompt_arrays(rng, bt, model.cfg.vocab_size)))
  useful = sum(int(bt.completion_n.sum()) for bt, _, _ in batches)
  issued = sum(n * int(bt.completion_n.max()) for bt, _, _ in batches)
  key = jax.random.key(args.seed)
  kw = dict(max_prompt_length=p, max_new_tokens=c, num_generations=g, chunk=args.chunk)
  slot_modes = [m for m in MODES if m != "lockstep"]
  chosen = ["lockstep"]
  chosen += slot_modes if args.admission != "decode" else []
  chosen += [m + INSIDE for m in slot_modes] if args.admission != "host" else []
  samplers, modes = make_runs(
      graphdef, state, batches, key, p=p, c=c, g=g, chunk=args.chunk, modes=chosen
  )
  engines = {name: (e, s) for name, (_, e, s) in modes.items() if e is not None}
  print(
      f"{len(batches)} batches of B {b} x G {g}: lengths / {w['scale']} (P {p}, C {c}), "
      f"completion mean {useful / len(batches) / n:.1f}, max per batch "
      f"{[int(bt.completion_n.max()) for bt, _, _ in batches]}; model L{model.cfg.num_layers} "
      f"d{model.cfg.hidden_size} V{model.cfg.vocab_size} f32; {GENERATION} sampling; "
      f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
  )
  results = dict(
      rows=n, batches=len(batches), useful_tokens=useful, lockstep_fill=useful / issued, modes={}
  )
  runs = {name: run for name, (run, _, _) in modes.items()}
  k = args.loop_k
  if k:  # (output rows for 2k + 1 steps: partial rollouts' carried groups)
    for name, partial in ((f"loop k={k}", False), (f"loop k={k}, partial", True)):
      engine = SlotEngine(
          graphdef, slots=n, steps_in_flight=2 * k + 1, **kw, admit_in_decode=inside
      )
      engines[name] = (engine, None)
      runs[name] = lambda e=engine, p=partial: run_loop(e, state, batches, key, k, p)
  for name, run in runs.items():  # warm-up: every program compiled
    check_run(name, run, issued if name == "lockstep" else useful)  # lockstep: rows to the max
  for name, run in runs.items():
    engine, streaming = engines.get(name, (None, False))
    entry = time_run(run, engine, streaming, useful)
    if name.endswith("partial"):
      entry["carried_groups"] = run_loop.carried
    results["modes"][name] = entry
  base = results["modes"]["lockstep"]["tokens_per_sec"]
  for name, entry in results["modes"].items():
    entry["vs_lockstep"] = entry["tokens_per_sec"] / base
    if "steady_tokens_per_sec" in entry:
      entry["steady_vs_lockstep"] = entry["steady_tokens_per_sec"] / base
    extra = (
        f"fill {results['lockstep_fill']:.3f}"
        if name == "lockstep"
        else f"{entry['slots']} slots, busy {entry['busy']:.3f}, {entry['steps']} decode steps"
    )
    if "carried_groups" in entry:
      extra += f", {entry['carried_groups']} groups carried"
    print(
        f"  {name:<34} {entry['tokens_per_sec']:>9.0f} tok/s  {entry['sec']:6.2f} s  "
        f"x{entry['vs_lockstep']:.2f}  ({extra})"
    )
    if "steady_tokens_per_sec" in entry:
      print(
          f"  {'  while queued':<34} {entry['steady_tokens_per_sec']:>9.0f} tok/s            "
          f"x{entry['steady_vs_lockstep']:.2f}  (until the queue ran dry, before the drain)"
      )
  how = ("host", "decode") if args.admission == "both" else (args.admission,)
  results["uniform"] = uniform(graphdef, state, batches, samplers, kw, key, how)
  u = results["uniform"]
  for name, label in (("slots_sec", ""), ("slots_inside_sec", INSIDE)):
    if name in u:
      print(
          f"  uniform batch (every row {u['length']} tokens), on-policy slots = rows{label} vs "
          f"lockstep: {u['lockstep_sec'] * 1e3:.0f} ms vs {u[name] * 1e3:.0f} ms, "
          f"x{u['lockstep_sec'] / u[name]:.2f} (medians of 5, interleaved)"
      )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
