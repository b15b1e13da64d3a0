"""What XLA builds for the accelerators: the loop's sampler, log-prob pass and update compiled
for one H100 (XLA:GPU's deviceless compile, jax-cuda13-plugin) and for a v5p-8 (libtpu), through
memory_plan's own path (plan(..., dump_hlo=...)), and read as optimized HLO (plan/hlo_inspect.py).
Each target skips with one line when its compiler is not importable (scripts/test_aot.sh
installs both into .venv-aot).

The model is Qwen3-0.6B's recipe (configs/qwen3_0p6b.py: f32 master weights, bf16 compute,
top-k 50, the real 151936-token vocabulary) with two narrow layers (hidden 256, 4 query / 2 kv
heads of 128), scanned and not. Per decode step of the sampler:
  (a) no weight-sized f32 -> bf16 convert (the weights are cast once per rollout, not per token)
  (b) no sort over the vocabulary (top-k without sorting [rows, V])
  (c) no bf16 copy of a layer's KV cache size or more (the cache is updated in place, and no
      weight is re-laid out per token either)
  (e) on the H100, attention by the ragged decode kernel (written slots only), no dot over a
      layer's keys/values
and (d) no [..., S, S] attention scores (f32, or bf16 as the GPU's forward keeps them) in the
update, the log-prob pass (S = P + C) or the sampler's prefill (S = P) where the fused
attention is on; and on packed rows (pack_sequences: the update and the log-prob pass, built
here on fixed packed shapes) the fused kernel with segment ids, no [..., S, S] scores either.
Decode activations (MLP [rows, F] = 16 x 768, attention probabilities
[rows, Hkv, P + C, H / Hkv] = 16 x 2 x 144 x 2) stay under (a)'s weight size, and S = 144 / 96
is no other dimension of the model.
"""

import glob
import math
import os
import re

import jax
import jax.numpy as jnp
import pytest

from configs import qwen3_0p6b
from grpo_jax.plan import hlo_inspect as hi
from grpo_jax import memory_plan as mp
from grpo_jax.models import build
from grpo_jax.parallel import sharding
from grpo_jax.rl import packing
from grpo_jax.rl import step as step_lib
from grpo_jax.rollout import sampler as sampler_lib
from grpo_jax.plan import tpu_targets

B, G, P, C = 4, 4, 96, 48  # prompts, samples per prompt, prompt and completion lengths
VOCAB, HIDDEN, KV_HEADS, HEAD_DIM = 151936, 256, 2, 128
SMALLEST_WEIGHT = HIDDEN * KV_HEADS * HEAD_DIM  # elements of a layer's k projection
SHOW = 6  # offending ops an assertion message lists
# The fused attention's custom call: cuDNN flash attention (forward, backward), Pallas on TPU.
FUSED_KERNEL = {"gpu": "__cudnn$fmha", "tpu": "tpu_custom_call"}


def small_qwen3(scan_layers: bool):
  c = qwen3_0p6b.get_config()
  m = c.model
  m.num_layers, m.hidden_size, m.intermediate_size = 2, HIDDEN, 3 * HIDDEN
  m.num_heads, m.num_kv_heads, m.head_dim = 4, KV_HEADS, HEAD_DIM
  m.scan_layers = scan_layers
  assert m.vocab_size == VOCAB and m.param_dtype == "float32" and m.dtype == "bfloat16"
  assert c.rollout.top_k == 50 and c.rollout.temperature > 0
  c.batch_size, c.num_generations = B, G
  c.max_prompt_length, c.max_completion_length = P, C
  c.micro_batch_size = 8  # two micro-batches of the 16 rows
  return c


def _target(name: str):
  if name.split("-")[0] in tpu_targets.GPUS:  # h100, h100-4: XLA:GPU's deviceless compile
    if tpu_targets.cuda_plugin_version() is None:
      pytest.skip(
          "jax-cuda13-plugin not installed (XLA:GPU's deviceless compile): " "scripts/test_aot.sh"
      )
  elif tpu_targets.libtpu_version() is None:
    pytest.skip("libtpu not installed (the TPU compiler): scripts/test_aot.sh")
  else:
    tpu_targets.libtpu_compile_only_env(name)
  return tpu_targets.make_target(name)


class Programs(dict):
  """platform, rows and prompts per device, hlo: {program: optimized HLO text}."""

  def __repr__(self):
    return f"Programs({self['platform']}, rows={self['rows']}, {sorted(self['hlo'])})"


@pytest.fixture(
    scope="module",
    params=[("h100", False), ("h100", True), ("v5p-8", False), ("v5p-8", True)],
    ids=lambda p: f"{p[0]}-{'scan' if p[1] else 'layers'}",
)
def programs(request, tmp_path_factory):
  """-> Programs: the sampler, log-prob pass and update compiled for the target."""
  name, scan = request.param
  target = _target(name)
  out = tmp_path_factory.mktemp(f"hlo_{name}_{scan}")
  _, mesh = mp.plan(small_qwen3(scan), target, log=lambda _: None, dump_hlo=str(out))
  dp = mesh["data"] * mesh["fsdp"]
  hlo = {
      os.path.basename(p)[: -len(".hlo.txt")]: open(p).read()
      for p in glob.glob(str(out / "*.hlo.txt"))
  }
  assert {"sampler", "logprobs", "update_save_dots_mb8"} <= set(hlo), sorted(hlo)
  return Programs(platform=target.devices[0].platform, rows=B * G // dp, prompts=B // dp, hlo=hlo)


def decode_step(p) -> frozenset:
  """The computations one decode step runs: the while loop(s) carrying the [rows, C] tokens."""
  hlo = p["hlo"]["sampler"]
  block = sampler_lib.block_size(0, p["platform"])  # the loops' columns: whole blocks of steps
  cols = 1 + block * -(-(C - 1) // block)
  loops = [l for l in hi.while_loops(hlo) if f"s32[{p['rows']},{cols}]" in l.carry]
  assert loops, f"no while loop carries s32[{p['rows']},{cols}] tokens"
  return frozenset().union(*(l.reach for l in loops))


def _show(ops) -> str:
  return "; ".join(str(o) for o in ops[:SHOW]) + (f" ... ({len(ops)} in all)" if ops else "")


def test_decode_step_casts_no_weights(programs):
  hlo = programs["hlo"]["sampler"]
  casts = hi.converts(hlo, SMALLEST_WEIGHT, within=decode_step(programs))
  if casts:
    pytest.fail(
        "f32 -> bf16 converts of weight size per decode step: "
        + _show([f"{o.operands[0]} -> {o.type} ({o.computation})" for o in casts])
    )


def test_decode_step_sorts_no_vocabulary(programs):
  hlo = programs["hlo"]["sampler"]
  sorts = [
      o
      for o in hi.sorts(hlo, within=decode_step(programs))
      if any(VOCAB in hi.dims(t)[1] for t in o.operands)
  ]
  if sorts:
    pytest.fail(
        "sorts over the vocabulary per decode step: "
        + _show([f"{o.opcode}({', '.join(o.operands)})" for o in sorts])
    )


def test_decode_step_updates_the_kv_cache_in_place(programs):
  hlo = programs["hlo"]["sampler"]
  layer_cache = programs["rows"] * KV_HEADS * C * HEAD_DIM * 2  # one layer's keys, bf16
  # Copies in the cache's dtype (small f32 ones, e.g. the top-k candidates' layout, are not it).
  big = [
      (o, n)
      for o, n in hi.copies(hlo, within=decode_step(programs))
      if n >= layer_cache and hi.dims(o.type)[0] == "bf16"
  ]
  if big:
    pytest.fail(
        f"bf16 copies of >= one layer's cache ({layer_cache} bytes) per decode step: "
        + _show([f"{o.type} {n} bytes ({o.computation})" for o, n in big])
    )


@pytest.mark.parametrize("program", ["update_save_dots_mb8", "logprobs", "sampler"])
def test_no_attention_scores_with_fused_attention(programs, program):
  """attention_impl=auto: cuDNN flash attention on the H100, Pallas splash attention on the
  v5p (head_dim 128), in the update, the log-prob pass and the sampler's prefill."""
  hlo = programs["hlo"][program]
  s = P if program == "sampler" else P + C  # the sampler's only [S, S] attention: its prefill
  scores = hi.square_arrays(hlo, s, dtypes=("f32", "bf16", "f16"))
  if scores:
    pytest.fail(
        f"[..., {s}, {s}] score arrays in {program}: "
        + _show([f"{dt}{list(shape)} {name} ({comp})" for comp, name, dt, shape in scores])
    )
  # And the kernel is there (so a padded length cannot hide XLA's scores from the check above).
  kernel = FUSED_KERNEL[programs["platform"]]
  targets = hi.custom_call_targets(hlo)
  assert any(kernel in t for t in targets), f"no {kernel} custom call in {program}: {targets}"


def test_gpu_decode_attention_reads_written_slots_only(programs):
  """GPU: each decode step's attention is the ragged kernel (models/decoder/decode_attention.py: one
  Triton call per layer, reading the prompt and the written cache slots), and no dot of the
  step reads a layer's keys/values (the XLA attention's products over every slot, [rows * Hkv,
  S, head_dim] or the prompt's [prompts * Hkv, P, head_dim]). TPU keeps the XLA attention."""
  hlo = programs["hlo"]["sampler"]
  within = decode_step(programs)
  ops = [o for name, ops in hi.parse(hlo).items() if name in within for o in ops]
  kernels = [
      o
      for o in ops
      if o.opcode == "custom-call:__gpu$xla.gpu.triton" and "ragged_decode_attention" in o.line
  ]
  prompt_keys = programs["prompts"] * KV_HEADS * P * HEAD_DIM  # fewer than a layer's cache
  kv_dots = [
      o
      for o in ops
      if o.opcode == "dot"
      for t in o.operands
      if hi.dims(t)[1][-1:] == (HEAD_DIM,)
      and HIDDEN not in hi.dims(t)[1]
      and math.prod(hi.dims(t)[1]) >= prompt_keys
  ]
  if programs["platform"] != "gpu":
    assert not kernels, "TPU: the XLA decode attention (the ragged kernel is Triton's)"
    return
  assert len(kernels) >= 2, f"{len(kernels)} ragged decode kernels per decode step (2 layers)"
  if kv_dots:
    pytest.fail(
        "dots over a layer's keys/values per decode step: "
        + _show([f"{o.type} <- {', '.join(o.operands)} ({o.computation})" for o in kv_dots])
    )


# ------------------------------------------------------------- the slot engine's layer scan


SLOT_KERNEL = {"gpu": "ragged_decode_attention", "tpu": "ragged_decode_attention_tpu"}


def _slot_decode(name: str, scan, dims=(1, 1, 1), **engine_kw):
  """-> (config, the slot engine on the target's first prod(dims) devices (mesh data x fsdp x
  tensor), its decode lowered): Qwen3-shaped, B x G slots, abstract weights."""
  from grpo_jax.rollout.slots import SlotEngine
  from grpo_jax.rollout.types import GenerationConfig

  target = _target(name)
  cfg = small_qwen3(bool(scan))
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = dims
  mesh = build.make_mesh(cfg, devices=target.devices[: math.prod(dims)])
  policy = build.make_policy(cfg, mesh, abstract=True)
  engine = SlotEngine(
      policy.sampler_graphdef,
      slots=B * G,
      max_prompt_length=P,
      max_new_tokens=C,
      num_generations=G,
      eos_ids=(0,),
      mesh=mesh,
      scan_layers=scan,
      **engine_kw,
  )
  gen = GenerationConfig(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
  programs = engine.abstract_programs(policy.params, policy.model_config, gen, rows_per_step=B * G)
  fn, args = programs["decode"]
  with jax.set_mesh(mesh):
    return cfg, engine, fn.lower(*args)


def _slot_engine(name: str, scan, dims=(1, 1, 1)):
  """-> (config, the slot engine, its compiled decode's HLO text): `_slot_decode`'s."""
  cfg, engine, lowered = _slot_decode(name, scan, dims)
  _, hlo, _ = tpu_targets.compile_program(lowered, engine.platform, hlo=True)
  return cfg, engine, hlo


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scan"])
def test_slot_decode_step_is_one_cuda_graph_with_step_graphs(scan):
  """SlotEngine(step_graphs=True) (rollout.step_graphs) on the H100: in XLA:GPU's thunk
  sequence the decode step's layer loop and its admission (a conditional) run inside a
  command buffer (a CUDA graph), not from the host; per layer the whole chunk's loop too.
  Without it the layer loop and the admission are host-driven (the control)."""
  from grpo_jax.plan.tpu_targets import gpu_thunk_sequence

  # (admission inside the decode, the default without tools: a conditional per step)
  _, engine, lowered = _slot_decode("h100", scan, step_graphs=True, admit_in_decode=True)
  assert engine.scan_layers == scan
  thunks = gpu_thunk_sequence(lowered)
  outside = hi.thunks_outside_graphs(thunks, "kWhile")
  assert len(outside) == (1 if scan else 0), outside  # (scanned: the steps' loop, host-driven)
  assert not hi.thunks_outside_graphs(thunks, "kConditional")
  _, _, control = _slot_decode("h100", scan, admit_in_decode=True)
  thunks = gpu_thunk_sequence(control)
  assert len(hi.thunks_outside_graphs(thunks, "kWhile")) >= (2 if scan else 1)
  assert hi.thunks_outside_graphs(thunks, "kConditional")


def _lockstep_generate(step_graphs: bool):
  """-> the lockstep Sampler's generate (small_qwen3, one H100, the recipe's top-k draw),
  lowered with abstract weights."""
  target = _target("h100")
  cfg = small_qwen3(False)
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 1, 1
  mesh = build.make_mesh(cfg, devices=target.devices[:1])
  policy = build.make_policy(cfg, mesh, abstract=True)
  sampler = sampler_lib.Sampler(
      policy.sampler_graphdef,
      max_prompt_length=P,
      max_new_tokens=C,
      num_generations=G,
      eos_ids=(0,),
      mesh=mesh,
      step_graphs=step_graphs,
  )
  assert sampler.step_graphs == step_graphs and len(sampler.phase_ends) == 1  # (ragged: 1 loop)
  rep = sharding.replicated(mesh)
  prompt = jax.ShapeDtypeStruct((B, P), jnp.int32, sharding=sharding.batch_sharding(mesh, 2))
  key = jax.eval_shape(lambda: jax.random.key(0))
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
  keys = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
  fn = sampler._fn(int(cfg.rollout.top_k), cfg.rollout.top_p < 1.0, False)
  with jax.set_mesh(mesh):
    return fn.lower(policy.params, prompt, prompt, keys, scalar, scalar)


def test_lockstep_generate_is_one_cuda_graph_with_step_graphs():
  """Sampler(step_graphs=True) (rollout.step_graphs) on the H100: in XLA:GPU's thunk sequence
  the decode's loops (over blocks of 8 steps, and the block's steps) run inside a command
  buffer (a CUDA graph), not from the host. Without it both loops are host-driven (the
  control: a predicate read and a graph launch per step)."""
  from grpo_jax.plan.tpu_targets import gpu_thunk_sequence

  thunks = gpu_thunk_sequence(_lockstep_generate(True))
  assert not hi.thunks_outside_graphs(thunks, "kWhile")
  assert not hi.thunks_outside_graphs(thunks, "kConditional")
  control = gpu_thunk_sequence(_lockstep_generate(False))
  assert len(hi.thunks_outside_graphs(control, "kWhile")) >= 2


@pytest.mark.parametrize("scan", [False, True], ids=["layers", "scan"])
@pytest.mark.parametrize("name", ["h100", "v5p-8"])
def test_slot_decode_reads_written_blocks_in_place(name, scan):
  """The slot engine's decode (rollout.slots, decode_attention auto): per step, one kernel per
  layer over each row's written slots (decode_attention.ragged on the H100, ragged_tpu on the
  v5p), reading the caches where they lie: no [1, slots, Hkv, S, K] layer slice of the stacked
  caches (scan_layers; 2 x 168 MB per layer per step at Qwen3-0.6B's recipe shapes before) and
  no copy of a layer's cache or more in what every step runs (the TPU's layout: the kernel
  reads a cache written one slot per row as [.., S, Hkv, K], no relayout; benchmarks/README.md
  "Slot engine"); nor, scanned, a layer's weights copied out of the stacked weights. Each
  fails on the code before 2026-12-07."""
  cfg, engine, hlo = _slot_engine(name, scan)
  platform = engine.platform
  layers, s = cfg.model.num_layers, engine.cache_len
  layer_cache = (B * G, KV_HEADS, s, HEAD_DIM)
  ops = [o for ops in hi.parse(hlo).values() for o in ops]
  slices = [
      o for o in ops if o.opcode == "dynamic-slice" and hi.dims(o.type)[1] == (1, *layer_cache)
  ]
  assert not slices, "a layer's cache sliced out of the stack: " + _show(slices)
  step = hi.every_iteration(hlo)
  big = [
      (o, n)
      for o, n in hi.copies(hlo, within=step)
      if n >= math.prod(layer_cache) * 2 and hi.dims(o.type)[0] == "bf16"
  ]
  assert not big, "copies of >= a layer's cache per decode step: " + _show(
      [f"{o.type} {n} bytes ({o.computation})" for o, n in big]
  )
  kernel = SLOT_KERNEL[platform]
  kernels = [
      o
      for o in ops
      if o.opcode.startswith("custom-call") and re.search(rf'"?{kernel}\b(?!_tpu)', o.line)
  ]
  want = 1 if scan else layers
  assert len(kernels) == want, f"{len(kernels)} {kernel} calls, want {want}: " + _show(kernels)
  # Nor a layer's weights sliced out of the stacked weights (scan_layers): each matmul reads
  # them where they lie (on the H100 a cuBLAS call at an offset from the loop index, XLA's
  # dynamic-slice fusion: slot_programs.SCANNED_GPU_OPTIONS; on the v5p the slice fused into
  # the matmul's operand). Before 2026-12-07 the H100's were async copies before Triton GEMMs.
  smallest = HIDDEN * KV_HEADS * HEAD_DIM * 2  # bytes of a k or v projection (bf16)
  weights = hi.slices(hlo, smallest, within=step)
  assert not weights, "a layer's weights copied out of the stacks per step: " + _show(
      [f"{o.type} {n} bytes ({o.computation})" for o, n in weights]
  )


@pytest.mark.parametrize("dims", [(4, 1, 1), (1, 1, 4)], ids=["data", "tensor"])
def test_slot_scanned_decode_reads_weights_in_place_on_4_gpus(dims):
  """The scanned decode (the GPU's default) on 4 H100s, data- or tensor-parallel: each GEMM
  still reads its layer's (local) weights in the stacks, no slice of them written per step.
  (With fsdp each layer's shard is sliced out for its all-gather, which writes the whole
  layer anyway: the per-layer engine gathers as much.)"""
  _, engine, hlo = _slot_engine("h100-4", "auto", dims)
  assert engine.scan_layers
  smallest = HIDDEN * KV_HEADS * HEAD_DIM * 2 // 4  # a k projection's bytes on one of 4 chips
  weights = hi.slices(hlo, smallest, within=hi.every_iteration(hlo))
  assert not weights, "a layer's weights copied out of the stacks per step: " + _show(
      [f"{o.type} {n} bytes ({o.computation})" for o, n in weights]
  )


@pytest.mark.parametrize("name", ["h100", "v5p-8"])
def test_slot_engine_scans_on_accelerators_by_default(name):
  """rollout.slot_scan_layers None ("auto"): the layer scan on GPU and TPU, where the ragged
  kernels read a stacked layer's caches in place (and the matmuls their weights: above); one
  program per layer on CPU (tests/rollout/test_slots.py)."""
  _, engine, _ = _slot_engine(name, "auto")
  assert engine.scan_layers and engine.ragged


# ----------------------------------------------------------------------------- packed rows

PACKED_ROWS = 8  # packed rows of P + C slots (the plan's count, bucketed: abstract here)
# The fused attention's custom call on packed rows (attention.segment_attention), forward and
# backward kernels by name: segment_flash.py's Triton flash attention on GPU, splash
# attention's segmented kernels on TPU.
PACKED_KERNEL = {
    "gpu": ("custom-call:__gpu$xla.gpu.triton", ("segment_flash_fwd",)),
    "tpu": ("custom-call:tpu_custom_call", ("splash_mha_fwd_segmented",)),
}
PACKED_BACKWARD = {  # the update's kernels, by name
    "gpu": ("segment_flash_dq", "segment_flash_dkv"),
    "tpu": ("splash_mha_dq_segmented", "splash_mha_dkv_segmented"),
}


@pytest.fixture(scope="module", params=["h100", "v5p-8"])
def packed_programs(request, tmp_path_factory):
  """-> {"platform", "hlo": {"update", "logprobs"}}: the update and the old/reference log-prob
  pass on packed rows (pack_sequences=True), compiled for the target. memory_plan plans padded
  rows only, so the programs are the loop's own (rl/step.py's TrainFunctions) lowered here on
  packed shapes: PACKED_ROWS rows of P + C slots, the LM head on all of them."""
  target = _target(request.param)
  cfg = small_qwen3(False)
  cfg.pack_sequences = True
  mesh = build.make_mesh(cfg, devices=target.devices)
  policy = build.make_policy(cfg, mesh, abstract=True)
  fns = step_lib.build(cfg, policy, mesh)
  padded = mp._step_inputs(cfg, policy, fns, mesh)["batch"]
  where = [jax.ShapeDtypeStruct((B * G,), jnp.int32)] * 2  # each sequence's row and offset
  packed = jax.eval_shape(
      lambda b, r, o: fns.pack(b, r, o, PACKED_ROWS, PACKED_ROWS, 1), padded, *where
  )
  rows = sharding.batch_sharding(mesh, 2)
  packed = {
      k: (
          mp._rows_abstract(v, mesh)
          if k == "sequences"
          else jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rows)
      )
      for k, v in packed.items()
  }
  packed["micro_batches"] = packing.MicroBatches(1)  # static (as Packer.rows adds it)
  params = fns.abstract_state["params"]
  args = ("input_ids", "segment_ids", "positions", "head_slots", "micro_batches")
  lowered = dict(
      update=fns.update.lower(fns.abstract_state, packed),
      logprobs=fns.packed_logprobs.lower(params, *(packed[k] for k in args)),
  )
  platform = target.devices[0].platform
  hlo = {k: tpu_targets.compile_program(v, platform, hlo=True)[1] for k, v in lowered.items()}
  return dict(platform=platform, hlo=hlo)


@pytest.mark.parametrize("program", ["update", "logprobs"])
def test_packed_rows_run_the_fused_kernel(packed_programs, program):
  """pack_sequences with attention_impl=auto: the fused kernel with segment ids (Triton on the
  H100, splash on the v5p), no [..., S, S] scores (S = P + C), in the packed update and the
  packed log-prob pass."""
  hlo = packed_programs["hlo"][program]
  s = P + C
  scores = hi.square_arrays(hlo, s, dtypes=("f32", "bf16", "f16"))
  if scores:
    pytest.fail(
        f"[..., {s}, {s}] score arrays in the packed {program}: "
        + _show([f"{dt}{list(shape)} {name} ({comp})" for comp, name, dt, shape in scores])
    )
  target, names = PACKED_KERNEL[packed_programs["platform"]]
  if program == "update":
    names += PACKED_BACKWARD[packed_programs["platform"]]
  calls = [o.line for ops in hi.parse(hlo).values() for o in ops if o.opcode == target]
  for name in names:
    assert any(name in line for line in calls), f"no {target} {name} in the packed {program}"
