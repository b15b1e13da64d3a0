r"""Padded vs packed rows (config.pack_sequences) for the update and both log-prob passes, on a
long-tailed batch built from GSM8K's real lengths.

    python benchmarks/packed_update.py               # ~1-2 min on 2 CPU cores
    python benchmarks/packed_update.py --quick       # < 60 s: a smaller model and batch (the test)
    python benchmarks/packed_update.py --data=DIR --tokenizer=DIR --json=out.json

Lengths (issue 42's Goals): a prompt is a GSM8K train question rendered as configs/qwen3_8b.py
renders it (its data.template and data.system_prompt, through data.PromptData: the loop's own
rendering) and counted in Qwen tokens (../shared/data/qwen_tokenizer), cut at the recipe's
max_prompt_length (its data.overlong_prompts=truncate); a completion is 1.5 x the Qwen tokens of a
GSM8K reference answer drawn at random (a reasoning trace runs longer than the reference), at
most max_completion_length, and 5% of the rows (chosen at random) run to max_completion_length
(cut there). Batches are B prompts x G completions; the padded row is the loop's: the prompt
width data.prompt_width=bucket picks (the power of two over the batch's longest prompt, <= P)
plus C.

It prints:
- fill = real tokens / slots issued, padded and packed (rl/row_plan.py's plan: `fewest_rows`
  rows of the padded width per data-parallel shard, row counts bucketed: rl/row_plan.py's
  bucket; one global plan over all rows, as before the plan went per shard; and the rows
  alone, unbucketed: fewest_rows' and first-fit decreasing's), over 400 batches at the
  recipe's shapes (B 8 x G 2, P 256, C 1024; on its 8-chip mesh with micro-batch 8 and with
  micro-batches by tokens, and on one chip) and at the CPU workload;
- wall time of the update plus the old-policy and reference log-prob passes, padded vs packed,
  on CPU: rl/step.py's own jitted functions (`build`) and the Packer / Padded object GrpoStep
  asks (`rows`, `logprobs`), timed to the end of each phase; the two layouts take turns, the
  same batches, medians over rounds; speedup = padded / packed, next to 1/fill and the issue's
  goal 0.8/fill. The CPU workload scales the recipe's lengths by 1/8 (P 32, C 128: every
  prompt and completion length / 8, rounded up) on a 4-layer d256 model whose LM head is the
  same share of its FLOPs as Qwen3-0.6B's (vocab 4096);
- model FLOPs of the real tokens / FLOPs issued, update + both log-prob passes (5 forward
  units: the update's forward + backward is 3, each pass 1), for Qwen3-0.6B and Qwen3-8B at
  the recipe's shapes. Per forward: 2 * N_nonembed per token slot, 2 * D * V per position the
  LM head runs on, 4 * L * H * K per attention score. Real: each sequence's own tokens, the
  l (l + 1) / 2 scores a causal model needs, the head over its completion tokens. Issued:
  padded rows run every slot, the head over the C completion positions and a causal tiled
  kernel's every tile (cuDNN, 128 x 128 tiles counted); packed rows run every slot of R rows,
  the head over the completion tokens' slots in whole bucketed rows (rl/row_plan.py: the plan's
  head_rows, rows of `head_width` = 128 positions; "head on every slot" is the layout before
  that), and the segment kernels' tiles
  (`packed_tiles`: GPU's Triton kernel at 128 x 128, TPU's splash at 256 x 256; each q tile
  visits the kv tiles from its sequence's start to the diagonal); the masked XLA form (the CPU
  path) computes every score of each packed row's [S, S]. The FLOPs use the first
  FLOPS_BATCHES batches.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import qwen3_8b  # noqa: E402
from configs import tiny as tiny_config  # noqa: E402
from grpo_jax import data as data_lib  # noqa: E402
from grpo_jax.configuration import validate  # noqa: E402
from grpo_jax.data.pipeline import bucket_width  # noqa: E402
from grpo_jax.models import PRESETS  # noqa: E402
from grpo_jax.models import build  # noqa: E402
from grpo_jax.rl import packing  # noqa: E402
from grpo_jax.rl import row_plan  # noqa: E402
from grpo_jax.rl import step as step_lib  # noqa: E402
from grpo_jax.rl.reference import Reference  # noqa: E402
from grpo_jax.rollout import Rollout  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared", "data")
CUT_FRACTION = 0.05  # rows that run to max_completion_length
COMPLETION_SCALE = 1.5  # a reasoning trace / the reference answer
FILL_BATCHES = 400  # (the FLOPs count the first FLOPS_BATCHES)
FLOPS_BATCHES = 100

# The CPU workloads: configs/tiny.py with these overrides; lengths = the recipe's / scale.
WORKLOADS = {
    "cpu": dict(
        scale=8,
        batch_size=16,
        num_generations=2,
        rounds=5,
        batches=2,
        model=dict(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=768,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
        ),
    ),
    "quick": dict(
        scale=16,
        batch_size=8,
        num_generations=2,
        rounds=3,
        batches=1,
        model=dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=384,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
        ),
    ),
}


# ------------------------------------------------------------------------------- lengths


def gsm8k_lengths(data_dir: str, tokenizer_dir: str, recipe) -> tuple[np.ndarray, np.ndarray]:
  """(rendered prompt tokens of every train question, at most max_prompt_length; Qwen tokens of
  every reference answer)."""
  rows = data_lib.read_gsm8k(os.path.join(data_dir, "gsm8k", "train.jsonl"))
  tok = data_lib.HFTokenizer(tokenizer_dir)
  prompts = data_lib.PromptData(
      rows,
      tok,
      template=recipe.data.template,
      system_prompt=data_lib.system_prompt(recipe.data.system_prompt),
      max_prompt_length=recipe.max_prompt_length,
      log_truncated=False,
  )
  answers = np.array([len(tok.encode(r["extra_info"]["answer"])) for r in rows], np.int64)
  return np.minimum(prompts.token_counts, recipe.max_prompt_length), answers


@dataclasses.dataclass(frozen=True)
class Batch:
  """One long-tailed batch: prompt lengths [B], completion lengths [B*G] (group-major), the
  prompt width the loop pads to, and the completion width C."""

  prompt_b: np.ndarray
  completion_n: np.ndarray
  width: int
  c: int

  @property
  def group(self) -> int:
    return self.completion_n.size // self.prompt_b.size

  @property
  def seq_n(self) -> np.ndarray:
    return np.repeat(self.prompt_b, self.group) + self.completion_n


def draw_batch(rng, lengths, b: int, g: int, p: int, c: int, scale: int = 1) -> Batch:
  """B prompts x G completions from the real lengths (module docstring), every length divided
  by `scale` (rounded up) for a workload `scale` times smaller."""
  prompt_n, answer_n = lengths
  prompt_b = prompt_n[rng.integers(0, prompt_n.size, b)]
  completion_n = np.ceil(COMPLETION_SCALE * answer_n[rng.integers(0, answer_n.size, b * g)])
  completion_n[rng.random(b * g) < CUT_FRACTION] = c * scale
  prompt_b = -(-prompt_b // scale)
  completion_n = np.minimum(-(-completion_n.astype(np.int64) // scale), c)
  return Batch(prompt_b, completion_n, bucket_width(prompt_b.max(), p), c)


def fills(batches, micro: row_plan.MicroBatching) -> dict:
  """Real tokens / slots over `batches`: padded (N rows of the width), packed (the plan: each
  of micro.shards shards packs its own rows), one global plan (first-fit decreasing over all
  N, each micro-batch's rows bucketed and rounded up to whole shares of one row per shard: how
  rl/packing.py planned before it packed per shard), and with no buckets, micro-batches or
  shards: `fewest_rows` alone (the rows the tokens need, as far as its search finds) and
  first-fit decreasing alone (the plan before that search)."""
  real = padded = packed = whole = fewest = ffd = 0
  for bt in batches:
    s = bt.width + bt.c
    plan = row_plan.plan_rows(bt.seq_n, s, micro)
    one = row_plan.plan_rows(bt.seq_n, s, dataclasses.replace(micro, shards=1))
    real += bt.seq_n.sum()
    padded += bt.seq_n.size * s
    packed += plan.rows * s
    per_micro = -(-one.rows // one.num_micro // micro.shards) * micro.shards
    whole += per_micro * one.num_micro * s
    fewest += row_plan.fewest_rows(bt.seq_n, s)[2] * s
    ffd += row_plan.first_fit_decreasing(bt.seq_n, s)[2] * s
  slots = dict(padded=padded, packed=packed, global_plan=whole, fewest=fewest, ffd=ffd)
  return {name: real / n for name, n in slots.items()}


# --------------------------------------------------------------------------------- FLOPs


# The fused kernels' tiles (models/decoder/attention.py): GPU's Triton kernel and TPU's splash
# attention at the recipe's P + C = 1280 slots (splash's block: the largest of 512, 256, 128
# dividing the row, 256 here); padded rows: cuDNN's causal kernel, counted at 128 x 128 tiles.
KERNEL_BLOCKS = dict(gpu=(128, 128), tpu=(256, 256), padded=(128, 128))


def forward_flops(cfg, slots: int, head_positions: int, scores: int) -> float:
  """One forward: 2 N_nonembed per slot, 2 D V per head position, 4 L H K per attention score
  (q.k and p.v, per head)."""
  d, h, k, l = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.num_layers
  n_nonembed = l * (d * (h + 2 * cfg.num_kv_heads) * k + h * k * d + 3 * d * cfg.intermediate_size)
  slots, head_positions, scores = (float(x) for x in (slots, head_positions, scores))
  return 2 * n_nonembed * slots + 2 * d * cfg.vocab_size * head_positions + 4 * l * h * k * scores


def causal_tiles(width: int, bq: int, bk: int, first: int = 0) -> int:
  """(q tile, kv tile) pairs a causal tiled kernel visits in a row of `width` slots (padded to
  whole tiles) from q tile `first` on, every kv tile up to the diagonal."""
  nq = -(-width // bq)
  return sum(((i + 1) * bq - 1) // bk + 1 for i in range(first, nq))


def packed_tiles(bt, plan, width: int, bq: int, bk: int, padding_diagonal: bool = False) -> int:
  """(q tile, kv tile) pairs the packed-row kernels visit (models/decoder/attention.py's
  segment kernels, GPU and TPU): for each q tile holding a real slot, the kv tiles from the one
  holding the start of that slot's sequence to the diagonal; a q tile of padding only visits
  none (GPU: segment_flash) or its diagonal tile alone (`padding_diagonal`, TPU:
  splash_segments), in every row of the plan, those of padding only too."""
  seq = bt.seq_n
  local = seq.size // plan.shards
  key = (np.arange(seq.size) // local) * plan.rows_per_shard + plan.row_of
  total = 0
  if padding_diagonal:
    used = np.bincount(key, weights=seq, minlength=plan.rows)
    total += int((-(-width // bq) - np.ceil(used / bq)).sum())
  for r in np.unique(key):
    members = np.flatnonzero(key == r)
    order = members[np.argsort(plan.offset_of[members])]
    starts, used = plan.offset_of[order], int(seq[order].sum())
    for i in range(-(-used // bq)):
      start = starts[np.searchsorted(starts, i * bq, side="right") - 1]
      total += ((i + 1) * bq - 1) // bk - int(start) // bk + 1
  return total


def flops_ratios(cfg, batches, micro: row_plan.MicroBatching) -> dict:
  """Model FLOPs of the real tokens / FLOPs issued (update + both passes: 5 forward units,
  the same factor on both sides, so the ratio of one forward). Attention: a causal model needs
  l (l + 1) / 2 scores per sequence of l tokens; a tiled kernel issues whole tiles
  (KERNEL_BLOCKS): padded rows every causal tile of the row, packed rows the tiles of
  `packed_tiles`; the masked XLA form (CPU) every score of its [S, S] matrix."""
  real = padded = gpu = tpu = masked = every_slot = 0.0
  for bt in batches:
    s, seq = bt.width + bt.c, bt.seq_n
    n = seq.size
    plan = row_plan.plan_rows(seq, s, micro, bt.completion_n)
    heads = plan.head_rows * row_plan.head_width(s)  # the LM head's positions
    real += forward_flops(cfg, seq.sum(), bt.completion_n.sum(), (seq * (seq + 1) // 2).sum())
    bq, bk = KERNEL_BLOCKS["padded"]
    padded += forward_flops(cfg, n * s, n * bt.c, n * causal_tiles(s, bq, bk) * bq * bk)
    for kind in ("gpu", "tpu"):
      bq, bk = KERNEL_BLOCKS[kind]
      scores = packed_tiles(bt, plan, s, bq, bk, padding_diagonal=kind == "tpu") * bq * bk
      issued = forward_flops(cfg, plan.rows * s, heads, scores)
      if kind == "gpu":
        gpu += issued
        every_slot += forward_flops(cfg, plan.rows * s, plan.rows * s, scores)
      else:
        tpu += issued
    masked += forward_flops(cfg, plan.rows * s, heads, plan.rows * s * s)
  return dict(
      padded=real / padded,
      packed=real / gpu,
      packed_tpu=real / tpu,
      packed_masked=real / masked,
      packed_head_every_slot=real / every_slot,
  )


# ------------------------------------------------------------------------------ the timing


def make_config(spec: dict, pack: bool, p: int, c: int):
  """configs/tiny.py as the workload: its model, B x G, P, C, a frozen reference (beta 0.04),
  one micro-batch, one CPU device; packed or padded rows."""
  config = tiny_config.get_config()
  for key, value in spec["model"].items():
    config.model[key] = value
  config.model.max_position_embeddings = p + c
  config.batch_size = spec["batch_size"]
  config.num_generations = spec["num_generations"]
  config.max_prompt_length, config.max_completion_length = p, c
  config.micro_batch_size = 0
  config.beta = 0.04
  config.pack_sequences = pack
  config.mesh.data = 1
  problems = validate(config, num_devices=1, num_processes=1)
  if problems:
    raise ValueError("; ".join(problems))
  return config


def device_batch(rng, bt: Batch, vocab: int) -> tuple:
  """(prompt ids, prompt mask [B, P'], Rollout [N, C], rewards [N]) of the batch's lengths."""
  b, n = bt.prompt_b.size, bt.completion_n.size
  pmask = (np.arange(bt.width)[None] >= (bt.width - bt.prompt_b)[:, None]).astype(np.int32)
  cmask = (np.arange(bt.c)[None] < bt.completion_n[:, None]).astype(np.int32)
  logprobs = jnp.asarray(cmask * rng.normal(-1.0, 0.3, (n, bt.c)), jnp.float32)
  rollout = Rollout(
      tokens=jnp.asarray(rng.integers(1, vocab, (n, bt.c)) * cmask, jnp.int32),
      mask=jnp.asarray(cmask),
      logprobs=logprobs,
      raw_logprobs=logprobs,
      lengths=jnp.asarray(bt.completion_n, jnp.int32),
      truncated=jnp.asarray(bt.completion_n == bt.c),
      tool_mask=jnp.zeros_like(jnp.asarray(cmask)),
  )
  ids = jnp.asarray(rng.integers(1, vocab, (b, bt.width)) * pmask, jnp.int32)
  rewards = jnp.asarray(rng.uniform(0, 1, n), jnp.float32)
  return ids, jnp.asarray(pmask), rollout, rewards


class HeadOnEverySlot(packing.Packer):
  """Packed rows with the LM head on all R x S slots (as before the plan's head_rows)."""

  def plan(self, lengths_n, completion_n, width):
    return row_plan.plan_rows(lengths_n, width, self.micro)


class Side:
  """One layout: rl/step.py's functions, the rows object GrpoStep asks, a state, a reference."""

  def __init__(self, config, packer=packing.Packer):
    self.mesh = build.make_mesh(config, devices=jax.devices()[:1])
    self.policy = build.make_policy(config, self.mesh)
    self.fns = step_lib.build(config, self.policy, self.mesh)
    self.state = self.fns.init(self.policy.params)
    self.reference = Reference(config, self.policy, self.fns, self.mesh)
    self.reference.start(self.state["params"])
    self.rows = (
        packer(config, self.fns, self.mesh) if config.pack_sequences else packing.Padded(self.fns)
    )

  def __call__(self, inputs) -> dict:
    """GrpoStep.inputs' rows and passes, then one update. -> {phase: seconds}."""
    times = {}

    def timed(name, fn):
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn())
      times[name] = time.perf_counter() - t0
      return out

    upd = jax.block_until_ready(self.fns.assemble(*inputs))
    upd = timed("pack", lambda: self.rows.rows(upd))
    params = self.state["params"]
    upd["old_logp"] = timed("old_lp", lambda: self.rows.logprobs(params, upd))
    ref = self.reference.weights(params)
    upd["ref_logp"] = timed("ref_lp", lambda: self.rows.logprobs(ref, upd))
    self.state, _ = timed("update", lambda: self.fns.update(self.state, upd))
    times["total"] = sum(times.values())
    return times


def draw_batches(lengths, n: int, b: int, g: int, p: int, c: int, scale: int, seed: int) -> list:
  """`n` long-tailed batches (draw_batch) of B x G at lengths / `scale`, P and C already scaled."""
  rng = np.random.default_rng(seed)
  return [draw_batch(rng, lengths, b, g, p, c, scale) for _ in range(n)]


def real_flops(cfg, bt: Batch) -> float:
  """Model FLOPs of one batch's real tokens, update (forward + backward: 3 forward units) + the
  old-policy and reference log-prob passes (1 each): each sequence's own slots, the l (l + 1) / 2
  scores a causal model needs, the LM head on its completion tokens."""
  seq = bt.seq_n
  return 5 * forward_flops(cfg, seq.sum(), bt.completion_n.sum(), (seq * (seq + 1) // 2).sum())


def timed_rounds(sides: dict, inputs: list, rounds: int, stop=None, failed=None) -> dict:
  """{side: [{phase: seconds, "batch": i}]}: `rounds` rounds, each every input through every
  side in turn. stop(): no further round starts (checked before each after the first). A side
  that raises is dropped from then on, its error in failed[name] (raised when failed is None)."""
  runs = {name: [] for name in sides}
  live = dict(sides)
  for r in range(rounds):
    if r and stop is not None and stop():
      break
    for i, x in enumerate(inputs):
      for name, side in list(live.items()):
        try:
          runs[name].append(dict(side(x), batch=i))
        except Exception as e:  # noqa: BLE001
          if failed is None:
            raise
          failed[name] = e
          del live[name]
  return runs


def medians(runs: list) -> dict:
  """{phase: median seconds} over a side's runs."""
  return {k: float(np.median([r[k] for r in runs])) for k in runs[0] if k != "batch"}


def time_layouts(spec: dict, lengths, recipe, seed: int) -> dict:
  """Padded and packed sides in turns over the same batches; medians over rounds."""
  scale = spec["scale"]
  p, c = recipe.max_prompt_length // scale, recipe.max_completion_length // scale
  rng = np.random.default_rng(seed)
  batches = [
      draw_batch(rng, lengths, spec["batch_size"], spec["num_generations"], p, c, scale)
      for _ in range(spec["batches"])
  ]
  padded, packed = make_config(spec, False, p, c), make_config(spec, True, p, c)
  sides = dict(
      padded=Side(padded), packed=Side(packed), head_every_slot=Side(packed, HeadOnEverySlot)
  )
  vocab = spec["model"]["vocab_size"]
  inputs = [device_batch(rng, bt, vocab) for bt in batches]
  t0 = time.perf_counter()
  for side in sides.values():  # compile every shape first
    for x in inputs:
      side(x)
  compile_sec = time.perf_counter() - t0
  runs = timed_rounds(sides, inputs, spec["rounds"])
  med = {name: medians(rs) for name, rs in runs.items()}
  paired = [a["total"] / b["total"] for a, b in zip(runs["padded"], runs["packed"])]
  fill = fills(batches, row_plan.MicroBatching())
  return dict(
      p=p,
      c=c,
      rows=spec["batch_size"] * spec["num_generations"],
      widths=[bt.width + bt.c for bt in batches],
      packed_rows=sorted({s[0] for s in sides["packed"].rows.shapes}),
      head_rows=sorted({s[1] for s in sides["packed"].rows.shapes}),
      fill=fill,
      **med,
      speedup=med["padded"]["total"] / med["packed"]["total"],
      speedup_paired=float(np.median(paired)),
      speedup_head_every_slot=med["padded"]["total"] / med["head_every_slot"]["total"],
      goal=0.8 / fill["padded"],
      compile_sec=compile_sec,
      steps=len(runs["packed"]),
  )


# ---------------------------------------------------------------------------------- main


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="the small workload (< 60 s)")
  ap.add_argument("--data", default=SHARED, help="folder with gsm8k/train.jsonl")
  ap.add_argument("--tokenizer", default=os.path.join(SHARED, "qwen_tokenizer"))
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default="", help="also write the results to this file")
  args = ap.parse_args(argv)
  recipe = qwen3_8b.get_config()
  p, c = recipe.max_prompt_length, recipe.max_completion_length
  b, g = recipe.batch_size, recipe.num_generations
  t0 = time.perf_counter()
  lengths = gsm8k_lengths(args.data, args.tokenizer, recipe)
  rng = np.random.default_rng(args.seed)
  recipe_batches = [draw_batch(rng, lengths, b, g, p, c) for _ in range(FILL_BATCHES)]
  rows = b * g
  recipe_micro = step_lib.num_micro_batches(recipe.micro_batch_size, rows)
  print(
      f"GSM8K train: {lengths[0].size} questions, rendered prompt {lengths[0].mean():.0f} tokens "
      f"(p95 {np.percentile(lengths[0], 95):.0f}), reference answer {lengths[1].mean():.0f} "
      f"(p95 {np.percentile(lengths[1], 95):.0f}); completion = {COMPLETION_SCALE} x answer, "
      f"{CUT_FRACTION:.0%} at C ({time.perf_counter() - t0:.1f} s to read)"
  )
  results = dict(recipe={}, flops={})
  print(f"\nfill = real tokens / slots, {FILL_BATCHES} batches of B {b} x G {g}, P {p}, C {c}")
  width = p + c  # micro_batch_tokens: the recipe's micro-batch rows at the widest prompt
  for name, micro in (
      (
          f"recipe: 8 chips, {recipe_micro} micro-batches",
          row_plan.MicroBatching(8, count=recipe_micro),
      ),
      (
          f"8 chips, micro_batch_tokens {rows // recipe_micro * width}",
          row_plan.MicroBatching(8, tokens=rows // recipe_micro * width),
      ),
      ("one chip, one micro-batch", row_plan.MicroBatching()),
  ):
    f = fills(recipe_batches, micro)
    results["recipe"][name] = f
    print(
        f"  {name:<38} padded {f['padded']:.3f}  packed per shard {f['packed']:.3f}  "
        f"one global plan {f['global_plan']:.3f}  (alone: fewest_rows {f['fewest']:.3f}, "
        f"first-fit decreasing {f['ffd']:.3f})"
    )
  print("\nmodel FLOPs of real tokens / FLOPs issued (update + old + ref passes), recipe shapes")
  for preset in ("qwen3-0.6b", "qwen3-8b"):
    for name, micro in (
        ("8 chips", row_plan.MicroBatching(8, count=recipe_micro)),
        ("one chip", row_plan.MicroBatching()),
    ):
      r = flops_ratios(PRESETS[preset], recipe_batches[:FLOPS_BATCHES], micro)
      results["flops"][f"{preset}, {name}"] = r
      print(
          f"  {preset:<11} {name:<9} padded {r['padded']:.3f}  packed: GPU kernel "
          f"{r['packed']:.3f}, TPU splash {r['packed_tpu']:.3f}, masked XLA form "
          f"{r['packed_masked']:.3f}  (GPU, head on every slot {r['packed_head_every_slot']:.3f})"
      )
  spec = WORKLOADS["quick" if args.quick else "cpu"]
  t = time_layouts(spec, lengths, recipe, args.seed)
  results["timing"] = t
  m = spec["model"]
  print(
      f"\nCPU ({jax.devices()[0].device_kind}, {os.cpu_count()} cores): lengths / {spec['scale']} "
      f"(P {t['p']}, C {t['c']}), {t['rows']} rows of {t['widths']}, packed rows "
      f"{t['packed_rows']}, LM head rows {t['head_rows']}; model L{m['num_layers']} d{m['hidden_size']} V{m['vocab_size']}; "
      f"median of {spec['rounds']} rounds x {spec['batches']} batches, turns"
  )
  f = t["fill"]
  print(
      f"  fill: padded {f['padded']:.3f}, packed {f['packed']:.3f} (alone: fewest_rows {f['fewest']:.3f}, FFD {f['ffd']:.3f})"
  )
  phases = ("pack", "old_lp", "ref_lp", "update", "total")
  print(f"  {'':<16}" + "".join(f"{ph:>10}" for ph in phases))
  for name in ("padded", "packed", "head_every_slot"):
    print(f"  {name:<16}" + "".join(f"{1e3 * t[name][ph]:>8.1f}ms" for ph in phases))
  print(
      f"  speedup padded / packed {t['speedup']:.2f}x (paired {t['speedup_paired']:.2f}x; "
      f"head on every slot {t['speedup_head_every_slot']:.2f}x); "
      f"1/fill {1 / t['fill']['padded']:.2f}x; goal 0.8/fill {t['goal']:.2f}x"
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return results


if __name__ == "__main__":
  main()
