r"""HBM plan: the per-device memory of one GRPO step, from the compiler, without allocating.

    python -m grpo_jax.memory_plan --config=configs/qwen3_8b.py --topology=v5p-8 \
        --remat=none,full,save_dots,offload_dots --micro_batch=8,16 --json=/tmp/plan.json
    python -m grpo_jax.memory_plan --config=configs/qwen3_0p6b.py --topology=h100 \
        --dump_hlo=/tmp/hlo          # + the optimized HLO of each program (plan/hlo_inspect.py)
    python -m grpo_jax.memory_plan --config=configs/tiny.py          # this machine's devices
    python -m grpo_jax.memory_plan --config=configs/qwen3_8b.py --topology=v5p-16 \
        --config.rollout.placement=disaggregated   # trainer and sampler halves, each its own

The loop's own jitted functions (rl/step.py's `update` and `logprobs`, rollout/sampler.py's
generate) are lowered on abstract inputs (jax.ShapeDtypeStruct with the run's shardings) and
compiled ahead of time; `compiled.memory_analysis()` gives the temporaries. Nothing is
allocated, so an 8B plan runs on a CPU-only machine (about 2 minutes per compile on 2 cores).

--topology=v5p-8 (also v4-8, v5e-16, v6e-8, ..., or a raw name such as v5p:2x2x1) compiles for
that TPU slice with the TPU compiler itself when libtpu is importable (`pip install jax[tpu]`,
best in a separate venv; compile-only devices from jax.experimental.topologies, no TPU needed);
--topology=h100 (h200; h100-8: eight on one host) compiles for NVIDIA GPUs with XLA:GPU's
deviceless compile when jax-cuda13-plugin is importable (requirements/aot.txt; JAX_PLATFORMS=cpu,
which this command sets; the GPU's target config is the one the plugin embeds; no autotuning, so
GEMM tilings may differ from a real run). Without the chip's compiler (libtpu, the CUDA plugin)
the same program is compiled for as many fake CPU devices, and the plan says so in one line.
No --topology: this machine's devices. The mesh is the config's (`mesh.*`, -1 filled) over the
target's devices, and the config is validated against that device count first. The HBM
capacity is the one the TPU compiler checks programs against (read from its own out-of-memory
message); a program it refuses as too large still gets a row, from the bytes that message gives.
A GPU's HBM is the device memory of its target config (79.1 GiB for the H100 80GB); JAX itself
preallocates 75% of it unless XLA_PYTHON_CLIENT_MEM_FRACTION / _PREALLOCATE say otherwise.

--dump_hlo=DIR writes each compiled program's optimized HLO as DIR/<program>.hlo.txt: sampler,
logprobs, and update_<remat>_mb<micro-batch> per setting (e.g. update_save_dots_mb16). On a GPU
target a top_k with k > 16 becomes a cub sort whose deviceless compile fails at its very last
step ("invalid device ordinal"): the HLO then comes from XLA's own dump of that compile, and the
figures from a recompile with XLA's sort kernel (xla_gpu_deviceless_cub_mode; the row's
`compiled` figures say `deviceless_cub_disabled`).

Per device, for each compiled function (update per remat policy and micro-batch size; the
forward-only log-prob pass and sampler once: no backward pass, so remat does not change them):

  params       the parameters (their shards; LoRA: the     resident through the whole step
               frozen base and the adapters)
  optimizer    AdamW moments (+ counters; LoRA: of the     resident
               adapters only)
  reference    the frozen reference copy (beta > 0; LoRA:  resident unless reference.offload_to_host
               0, the base is the reference)
  rollout_w    the sampler's own weights: a mapped copy (impl=maxtext), or (native) the
               compute-dtype, per-layer copy the sampler makes once per rollout inside its
               program (param_dtype != dtype, scan_layers or LoRA (merged); else it reads the
               params: 0)
  temp         compiled temporaries: activations, gradients, logits (the sampler's minus its
               cache and, native, minus its weight copy)
  kv_cache     the sampler's [L, B*G, Hkv, P+C, K] cache (its shape and sharding)
  io           the function's other inputs and outputs (batch, log-probs, rollout)
  host_offload bytes in pinned host memory (offloaded activations, an offloaded reference)
  total        everything above but host_offload, against the chip's HBM

The step fits when, for its remat policy and micro-batch size, the update and both forward rows
fit (the last lines of the printout). --json writes the rows, bytes per device.
"""

import dataclasses
import functools
import json
import math
import os
import sys

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax import configuration
from grpo_jax.parallel import sharding
from grpo_jax.models import build
from grpo_jax.models import policy as policy_lib
from grpo_jax.models.lora import adapters as lora
from grpo_jax.rl import corrections
from grpo_jax.rl import step as step_lib
from grpo_jax.rollout import sampler as sampler_lib
from grpo_jax.rollout import streaming
from grpo_jax.rollout.types import GenerationConfig
from grpo_jax.plan.table import fit_text  # noqa: F401  (the tests read it here)
from grpo_jax.plan.table import header
from grpo_jax.plan.table import print_disaggregated
from grpo_jax.plan.table import step_summary
from grpo_jax.plan.table import table
from grpo_jax.plan.table import unit_of
from grpo_jax.plan.tpu_targets import GIB  # noqa: F401  (re-exported for the tests)
from grpo_jax.plan.tpu_targets import Target
from grpo_jax.plan.tpu_targets import _oom_figures  # noqa: F401  (re-exported for the tests)
from grpo_jax.plan.tpu_targets import compile_program
from grpo_jax.plan.tpu_targets import cuda_plugin_version
from grpo_jax.plan.tpu_targets import libtpu_compile_only_env
from grpo_jax.plan.tpu_targets import libtpu_version
from grpo_jax.plan.tpu_targets import make_target
from grpo_jax.plan.tpu_targets import parse_topology

FUNCTIONS = ("logprobs", "sampler", "update")

# Config problems that concern the data and tokenizer files, not memory: ignored here.
_NOT_MEMORY_FIELDS = ("data.", "tokenizer.", "reward.custom_file", "model.maxtext_checkpoint")


# ================================================================================= the plan


@dataclasses.dataclass
class Row:
  """Bytes per device of one compiled function (see the module docstring for each field)."""

  function: str
  remat: str | None
  micro_batch: int | None
  params: int
  optimizer: int
  reference: int
  rollout_weights: int
  temp: int
  kv_cache: int
  io: int
  host_offload: int
  hbm_capacity: int | None
  compiled: dict  # the raw memory_analysis() figures

  @property
  def total(self) -> int:
    return (
        self.params
        + self.optimizer
        + self.reference
        + self.rollout_weights
        + self.temp
        + self.kv_cache
        + self.io
    )

  def to_json(self, target: Target, mesh_shape: dict) -> dict:
    out = dataclasses.asdict(self)
    out.update(
        total=self.total,
        device_kind=target.device_kind,
        num_devices=len(target.devices),
        mesh=mesh_shape,
        compiler=target.compiler,
    )
    return out


def shard_bytes(tree) -> int:
  """Bytes one device holds of a pytree of ShapeDtypeStructs carrying shardings (the largest
  shard when they differ; replicated leaves count whole)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize  # (key dtypes have an itemsize too)
  return total


def _abstract(shape, dtype, sharding_):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_)


def _rows_abstract(tree, mesh):
  """`tree`'s shapes with rows (dim 0) over (data, fsdp), as the loop's batches are."""
  return jax.tree.map(
      lambda x: _abstract(x.shape, x.dtype, sharding.batch_sharding(mesh, len(x.shape))), tree
  )


def _stats(compiled) -> dict:
  m = compiled.memory_analysis()
  names = (
      "argument",
      "output",
      "alias",
      "temp",
      "generated_code",
      "host_argument",
      "host_output",
      "host_alias",
      "host_temp",
  )
  stats = {n: int(getattr(m, f"{n}_size_in_bytes", 0) or 0) for n in names}
  stats["peak"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0)  # args + temp, as XLA counts
  return stats


def _host(stats: dict) -> int:
  if "host_temp" not in stats:  # the compiler refused the program: no figures
    return 0
  return stats["host_temp"] + stats["host_argument"] + stats["host_output"] - stats["host_alias"]


def kv_cache_bytes(
    model_cfg, rows: int, length: int, mesh, *, prompts: int = 0, prompt_len: int = 0
) -> int:
  """Per-device bytes of the sampler's cache (rows over (data, fsdp), kv heads over tensor):
  `length` slots per row (a local layer's ring: its window), `prompt_len` per kept prompt."""

  def one(n, s, ring):  # ring: a local layer's completion cache holds its window only
    local = getattr(model_cfg, "local_layers", None) or [False] * model_cfg.num_layers
    shapes = [
        (
            n,
            model_cfg.num_kv_heads,
            min(s, model_cfg.sliding_window) if ring and x else s,
            model_cfg.head_dim,
        )
        for x in local
    ]
    per_layer = [
        math.prod(
            jax.sharding.NamedSharding(
                mesh, sharding.logical_to_spec(("batch", "kv_heads", "length", "head_dim"), x, mesh)
            ).shard_shape(x)
        )
        for x in shapes
    ]
    kv = 2 * sum(per_layer) * jnp.dtype(model_cfg.dtype).itemsize
    return kv + shard_bytes(_abstract((n, s), jnp.int32, sharding.batch_sharding(mesh, 2)))

  return one(rows, length, True) + (one(prompts, prompt_len, False) if prompts else 0)


def with_overrides(config, **fields):
  """A copy of the (locked) config with dotted fields set: with_overrides(c, **{"a.b": 1})."""
  config = config.copy_and_resolve_references()
  for path, value in fields.items():
    *parents, leaf = path.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def check_config(config, target: Target) -> list[str]:
  """configuration.validate against the target's device count, less the file checks."""
  errors = configuration.validate(
      config, num_devices=len(target.devices), num_processes=target.num_processes
  )
  return [e for e in errors if not e.startswith(_NOT_MEMORY_FIELDS)]


def remat_field(config) -> str:
  """The field --remat sets: MaxText has its own policy names (full, minimal, ...)."""
  return "model.maxtext.remat_policy" if config.model.impl == "maxtext" else "model.remat_policy"


def plan(
    config,
    target: Target,
    *,
    remat_policies=None,
    micro_batches=None,
    micro_batch_tokens=None,
    functions=FUNCTIONS,
    log=print,
    dump_hlo: str | None = None,
):
  """-> (rows, mesh shape): the step's compiled `functions` on `target`, the update per remat
  policy and micro-batch size, or token budget (`micro_batch_tokens`: config.micro_batch_tokens
  values; defaults: the config's own). `dump_hlo`: a folder that gets each program's optimized
  HLO as <program>.hlo.txt (program_name; the module docstring).

  pack_sequences: the update is planned on padded rows, the packed update's worst case (a
  packed batch never has more rows than the padded one, nor a micro-batch more than its token
  budget's rows: rl/packing.py), so a token budget that fits here fits packed."""
  if config.model.family != "decoder":
    raise ValueError(
        f"model.family={config.model.family!r}: the memory planner models "
        "decoder-only policies (its KV cache and sampler). Fix: plan a decoder "
        "config (--config.model.family=decoder)"
    )
  config = with_overrides(config, pack_sequences=False)  # padded rows: the packed worst case
  default_remat = (
      config.model.maxtext.remat_policy
      if config.model.impl == "maxtext"
      else config.model.remat_policy
  )
  remat_policies = list(remat_policies or [default_remat])
  if micro_batch_tokens:  # each a token budget (micro-batches by tokens)
    micro_batches = [dict(micro_batch_size=0, micro_batch_tokens=t) for t in micro_batch_tokens]
  elif micro_batches:
    micro_batches = [dict(micro_batch_size=mb, micro_batch_tokens=0) for mb in micro_batches]
  else:
    micro_batches = [
        dict(micro_batch_size=config.micro_batch_size, micro_batch_tokens=config.micro_batch_tokens)
    ]
  for mb in micro_batches:
    errors = check_config(with_overrides(config, **mb), target)
    if errors:
      raise ValueError(
          f"the config does not fit {target.name} ({len(target.devices)} devices):"
          f" {' | '.join(errors)}"
      )
  if dump_hlo:
    os.makedirs(dump_hlo, exist_ok=True)
  compile_ = functools.partial(
      measure, platform=target.devices[0].platform, dump_hlo=dump_hlo, log=log
  )
  # The policies are built on `target`'s devices, so their kernels are the chip's
  # (Kernels.for_mesh), whatever the host that traces them.
  return _plan(config, target, remat_policies, micro_batches, functions, log, compile_)


def plan_disaggregated(config, target: Target, *, log=print, **kw):
  """rollout.placement=disaggregated: the trainer's programs (update, logprobs) on the first
  devices of `target` with the trainer's resident state; the sampler on the last
  rollout.num_devices (0 = half) with only what it is sent, the weights in the compute dtype.
  -> {role: (rows, mesh shape, its Target), "transfer_bytes": weights moved per step}."""
  n = build.sampler_devices(config.rollout.num_devices, len(target.devices))
  trainer_t, sampler_t = (
      dataclasses.replace(
          target, devices=tuple(d), name=(f"{target.name} {what} ({len(d)} devices)")
      )
      for d, what in ((target.devices[:-n], "trainer"), (target.devices[-n:], "sampler"))
  )
  colocated = with_overrides(config, **{"rollout.placement": "colocated"})
  trainer = plan(colocated, trainer_t, functions=("update", "logprobs"), log=log, **kw)
  sent = with_overrides(colocated, **{"model.param_dtype": config.model.dtype, "beta": 0.0})
  rows, shape = plan(sent, sampler_t, functions=("sampler",), log=log, dump_hlo=kw.get("dump_hlo"))
  weights = build.make_policy(
      sent, build.make_mesh(sent, devices=sampler_t.devices), abstract=True
  ).params
  return {
      "trainer": (*trainer, trainer_t),
      "sampler": ([dataclasses.replace(r, optimizer=0) for r in rows], shape, sampler_t),
      "transfer_bytes": sum(
          math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(weights)
      ),
  }


def program_name(function: str, remat: str | None = None, micro_batch: int | None = None):
  """The name --dump_hlo files a program under: "sampler", "logprobs", "update_none_mb16"."""
  return function if function != "update" else f"update_{remat}_mb{micro_batch}"


def _plan(config, target, remat_policies, micro_batches, functions, log, measure_):
  rows = []
  for i, remat in enumerate(remat_policies):
    cfg = with_overrides(config, **{remat_field(config): remat})
    mesh = build.make_mesh(cfg, devices=target.devices)
    policy = build.make_policy(cfg, mesh, abstract=True)
    fns = step_lib.build(cfg, policy, mesh)
    resident = _resident(cfg, fns)
    row = functools.partial(Row, **resident, hbm_capacity=target.hbm_bytes)
    if i == 0:  # shapes, and the forward-only programs, do not depend on the remat policy
      inputs = _step_inputs(cfg, policy, fns, mesh)
      rows += _forward_rows(cfg, policy, fns, mesh, inputs, row, functions, log, measure_)
    for mb in micro_batches if "update" in functions else ():
      fns_mb = step_lib.build(with_overrides(cfg, **mb), policy, mesh)
      n, width = inputs["num_rows"], inputs["batch"]["input_ids"].shape[1]
      rows_mb = n // fns_mb.micro.padded_count(n, width)  # the rows of one micro-batch
      tokens = f", micro_batch_tokens={mb['micro_batch_tokens']}" * bool(mb["micro_batch_tokens"])
      log(f"compiling update (remat={remat}, micro_batch={rows_mb} rows{tokens}) ...")
      io = shard_bytes(inputs["batch"])
      temp, stats = measure_(
          fns_mb.update.lower(fns_mb.abstract_state, inputs["batch"]),
          resident["params"] + resident["optimizer"] + io,
          name=program_name("update", remat, rows_mb),
      )
      rows.append(
          row(
              function="update",
              remat=remat,
              micro_batch=rows_mb,
              rollout_weights=0,
              temp=temp,
              kv_cache=0,
              io=io,
              host_offload=resident_host(cfg, fns) + _host(stats),
              compiled=stats,
          )
      )
  return rows, {k: int(v) for k, v in mesh.shape.items() if v > 1 or k in sharding.MESH_AXES}


def measure(
    lowered,
    outside_temp: int,
    *,
    platform: str = "",
    name: str = "",
    dump_hlo: str | None = None,
    log=print,
) -> tuple[int, dict]:
  """(temp bytes, figures) of a lowered function: memory_analysis() when it compiles. The TPU
  compiler refuses a program that does not fit in HBM, and its error gives the bytes required;
  the temporaries are then those less `outside_temp` (the arguments and outputs counted in
  the other columns), and the figures hold {"oom_required", "oom_available"}. With `dump_hlo`,
  the optimized HLO goes to dump_hlo/<name>.hlo.txt (none for a refused program)."""
  try:
    compiled, hlo, notes = compile_program(lowered, platform, hlo=dump_hlo is not None)
  except jax.errors.JaxRuntimeError as e:
    figures = _oom_figures(str(e))
    if figures is None:
      raise
    if dump_hlo:
      log(f"{name}: refused by the compiler, no HLO to write")
    return max(figures[0] - outside_temp, 0), dict(
        oom_required=figures[0], oom_available=figures[1]
    )
  if dump_hlo:
    with open(os.path.join(dump_hlo, f"{name}.hlo.txt"), "w") as fh:
      fh.write(hlo)
  stats = dict(_stats(compiled), **notes)
  return stats["temp"], stats


def _resident(cfg, fns) -> dict:
  """Params, optimizer state and the device-resident reference, per device: alive all step."""
  state = fns.abstract_state
  params = shard_bytes(state["params"])
  optimizer = shard_bytes({k: v for k, v in state.items() if k != "params"})
  # LoRA (lora.rank > 0): the reference is the frozen base itself, run without the adapters
  # (models/lora/policy.py: policy.reference = base_of), no copy to hold.
  on_device = cfg.beta > 0 and not cfg.reference.offload_to_host and not cfg.lora.rank
  return dict(
      params=params, optimizer=optimizer, reference=reference_bytes(cfg, fns) if on_device else 0
  )


def reference_bytes(cfg, fns) -> int:
  """The frozen reference as the loop stores it: in the compute dtype (policy.as_reference)."""
  return shard_bytes(policy_lib.as_reference(fns.abstract_state["params"], cfg.model.dtype))


def resident_host(cfg, fns) -> int:
  if cfg.beta > 0 and cfg.reference.offload_to_host and not cfg.lora.rank:
    return reference_bytes(cfg, fns)
  return 0


def _sampler_weights(policy, params):
  """The sampler's weights: the params themselves (native), or the mapped copy the engine
  makes with jax.jit(policy.rollout_params) (MaxText), with the shardings that jit gives it."""
  if policy.sampler_is_trainer:
    return params
  mapped = jax.jit(policy.rollout_params).lower(params).compile()
  return jax.tree.map(
      lambda x, s: _abstract(x.shape, x.dtype, s),
      jax.eval_shape(policy.rollout_params, params),
      mapped.output_shardings,
  )


def _step_inputs(cfg, policy, fns, mesh) -> dict:
  """Abstract inputs and outputs of each function, shaped by the loop's own functions."""
  b, g = cfg.batch_size, cfg.num_generations
  p, c = cfg.max_prompt_length, cfg.max_completion_length
  prompt = _abstract((b, p), jnp.int32, sharding.batch_sharding(mesh, 2))
  replicated = sharding.replicated(mesh)
  key = jax.eval_shape(lambda: jax.random.key(0))
  scalar = _abstract((), jnp.float32, replicated)
  sampler = sampler_lib.Sampler(
      policy.sampler_graphdef,
      max_prompt_length=p,
      max_new_tokens=c,
      num_generations=g,
      eos_ids=(0,),
      mesh=mesh,
      **sampler_lib.config_options(cfg),
  )
  gen = GenerationConfig(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
  generate = sampler._fn(0 if gen.is_greedy else int(gen.top_k), gen.top_p < 1.0, gen.is_greedy)
  sampler_args = (
      _sampler_weights(policy, fns.abstract_state["params"]),
      prompt,
      prompt,
      _abstract(key.shape, key.dtype, replicated),
      scalar,
      scalar,
  )
  with jax.set_mesh(mesh):
    rollout = _rows_abstract(jax.eval_shape(generate, *sampler_args), mesh)
  rewards = _abstract((b * g,), jnp.float32, sharding.batch_sharding(mesh, 1))
  batch = jax.eval_shape(fns.assemble, prompt, prompt, rollout, rewards)
  logp = jax.eval_shape(
      fns.logprobs, fns.abstract_state["params"], batch["input_ids"], batch["attention_mask"]
  )
  needs_old = (
      cfg.num_iterations > 1
      or corrections.active(cfg.loss.offpolicy_correction, cfg.loss.tis_cap)
      or not policy.sampler_is_trainer
      or cfg.rollout.engine != "native"
  )
  batch = dict(
      batch,
      **({"old_logp": logp} if needs_old else {}),
      **({"ref_logp": logp} if cfg.beta > 0 else {}),
  )
  return dict(
      generate=generate,
      sampler_args=sampler_args,
      rollout=rollout,
      num_rows=b * g,
      num_prompts=b,
      batch=_rows_abstract(batch, mesh),
      logp=_rows_abstract(logp, mesh),
      prompt_len=p,
      completion_len=c,
  )


def sampler_weight_copy_bytes(cfg, policy, weights) -> int:
  """Per-device bytes of the sampler's own weights (the rollout_w column): MaxText's mapped
  copy (an argument of the sampler), or the native sampler's compute-dtype, per-layer copy that
  its program makes once per rollout (a temporary of it), when the params are not already that
  (param_dtype != dtype, or scanned layers to unstack). With LoRA the native copy is the plain
  decoder's weights made effective (adapters merged, a quantized base dequantized: every
  projection in the compute dtype, no adapter or scale kept)."""
  if not policy.sampler_is_trainer:
    return shard_bytes(weights)
  m = cfg.model
  if cfg.lora.rank:
    base = nnx.split_state(lora.base_of(weights), lora.QuantScale, ...)[1]
    dt = jnp.dtype(m.dtype)
    return shard_bytes(jax.tree.map(lambda x: _abstract(x.shape, dt, x.sharding), base))
  if m.param_dtype == m.dtype and not m.scan_layers:
    return 0
  return shard_bytes(policy_lib.as_reference(weights, m.dtype))


def _forward_rows(cfg, policy, fns, mesh, inputs, row, functions, log, measure_) -> list[Row]:
  """The log-prob pass (old/reference) and the sampler: no backward pass, remat-independent.
  `row`: Row with the resident figures filled in; `measure_`: measure with the target's
  compile options bound."""
  rows, host_ref = [], resident_host(cfg, fns)
  params = fns.abstract_state["params"]
  params_b = shard_bytes(params)
  if "logprobs" in functions:
    log("compiling logprobs ...")
    batch = inputs["batch"]
    io = shard_bytes((batch["input_ids"], batch["attention_mask"], inputs["logp"]))
    temp, stats = measure_(
        fns.logprobs.lower(params, batch["input_ids"], batch["attention_mask"]),
        params_b + io,
        name=program_name("logprobs"),
    )
    # The reference pass runs on a device copy of an offloaded reference: count it here.
    extra = dict(reference=host_ref) if host_ref else {}
    rows.append(
        row(
            function="logprobs",
            remat=None,
            micro_batch=None,
            rollout_weights=0,
            temp=temp,
            kv_cache=0,
            io=io,
            host_offload=host_ref + _host(stats),
            compiled=stats,
            **extra,
        )
    )
  if "sampler" not in functions:
    return rows
  if cfg.rollout.engine != "native":
    log(f"rollout.engine={cfg.rollout.engine}: its memory is its own; no sampler row")
    return rows
  if cfg.rollout.slots:
    rows.append(_plan_slots(cfg, policy, inputs, mesh, measure_, row, log, host_ref))
    return rows
  weights, *other_args = inputs["sampler_args"]
  rollout_w = sampler_weight_copy_bytes(cfg, policy, weights)
  copy_in_temp = rollout_w if policy.sampler_is_trainer else 0  # native: made in the program
  kv = kv_cache_bytes(
      policy.model_config,
      inputs["num_rows"],
      inputs["completion_len"],
      mesh,
      prompts=inputs["num_prompts"],
      prompt_len=inputs["prompt_len"],
  )
  io = shard_bytes((other_args, inputs["rollout"]))
  log("compiling sampler ...")
  with jax.set_mesh(mesh):
    temp, stats = measure_(
        inputs["generate"].lower(weights, *other_args),
        shard_bytes(weights) + io,
        name=program_name("sampler"),
    )
  rows.append(
      row(
          function="sampler",
          remat=None,
          micro_batch=None,
          rollout_weights=rollout_w,
          temp=max(temp - kv - copy_in_temp, 0),
          kv_cache=kv,
          io=io,
          host_offload=host_ref + _host(stats),
          compiled=stats,
      )
  )
  return rows


def tools_on(cfg) -> bool:
  return bool(cfg.rollout.tools.names.strip())


def _plan_slots(cfg, policy, inputs, mesh, measure_, row, log, host_ref):
  """The slot engine's row (rollout.slots > 0): its weight copy (made once per version, kept
  between programs: rollout_w), its slot caches [slots, Hkv, P + C, K] per layer (kv_cache) and
  the largest temporaries of its admit (whole engine), decode and refresh programs (and the
  device queue's push, whose prefills it keeps: in io)."""
  from grpo_jax.rollout import slots as slots_lib

  weights = inputs["sampler_args"][0]
  b, g = cfg.batch_size, cfg.num_generations
  engine = slots_lib.SlotEngine(
      policy.sampler_graphdef,
      slots=cfg.rollout.slots,
      max_prompt_length=cfg.max_prompt_length,
      max_new_tokens=cfg.max_completion_length,
      num_generations=g,
      eos_ids=(0,),
      mesh=mesh,
      chunk=cfg.rollout.slot_chunk,
      scan_layers=slots_lib.scan_layers_option(cfg),
      steps_in_flight=streaming.steps_in_flight(cfg),
      decode_attention=cfg.rollout.decode_attention,
      # Multi-turn rows (rollout.tools): the extend program appends tool responses.
      max_append=cfg.rollout.max_tool_response_tokens if tools_on(cfg) else 0,
      admit_in_decode=slots_lib.admits_in_decode(cfg.rollout.slot_admission, tools_on(cfg)),
  )
  gen = GenerationConfig(cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p)
  programs = engine.abstract_programs(weights, policy.model_config, gen, rows_per_step=b * g)
  st, copy = programs["decode"][1][0], programs["decode"][1][1]
  kv = shard_bytes((st["k"], st["v"]))
  rollout_w = shard_bytes(copy)
  state_b = shard_bytes(st)
  temps, stats = {}, {}
  for name in ("admit_all", "decode", "refresh", "extend", "push"):
    if name not in programs or (name == "admit_all" and engine.admit_in_decode):
      continue  # (admission in the decode runs no admit program: the push prefills)
    fn, args = programs[name]
    log(f"compiling slot engine {name} ...")
    temps[name], stats[name] = measure_(
        fn.lower(*args), shard_bytes(args), name=program_name(f"slots_{name}")
    )
  worst = max(temps, key=temps.get)
  log(
      f"slot engine: {cfg.rollout.slots} slots; temporaries by program "
      + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in temps.items())
  )
  return row(
      function="sampler",
      remat=None,
      micro_batch=None,
      rollout_weights=rollout_w,
      temp=max(temps[worst] - (state_b - kv), 0),
      kv_cache=kv,
      io=state_b - kv,
      host_offload=host_ref + _host(stats[worst]),
      compiled=stats[worst],
  )


# ================================================================================== main


def _csv(text: str | None, cast=str) -> list | None:
  return [cast(v) for v in text.split(",") if v.strip()] if text else None


def main(argv):
  import logging as std_logging

  from absl import flags
  from absl import logging

  del argv
  f = flags.FLAGS
  if f["verbosity"].using_default_value:  # optax's schedule notes, MaxText's config dump
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger().setLevel(std_logging.WARNING)
  config = _CONFIG.value
  from grpo_jax import configuration

  configuration.split_comma_lists(config)  # --config.reward.functions=a,b
  try:
    if _TOPOLOGY.value:
      # Compile-only targets need no accelerator here; keep jax off any local TPU runtime.
      # (XLA:GPU's deviceless compile needs it too: the CUDA plugin then wants no driver.)
      jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
      spec = parse_topology(_TOPOLOGY.value)
      compiler = libtpu_version() if spec.platform == "tpu" else cuda_plugin_version()
      if compiler is None:
        jax.config.update("jax_num_cpu_devices", spec.chips)
      elif spec.platform == "tpu":
        libtpu_compile_only_env(_TOPOLOGY.value)
    target = make_target(_TOPOLOGY.value)
    if _TOPOLOGY.value and target.devices[0].platform == "cpu":  # no compiler for the chip
      print(f"note: {target.compiler}", file=sys.stderr)
    kw = dict(
        remat_policies=_csv(_REMAT.value),
        micro_batches=_csv(_MICRO.value, int),
        micro_batch_tokens=_csv(_MICRO_TOKENS.value, int),
        log=lambda s: print(s, file=sys.stderr, flush=True),
        dump_hlo=_DUMP_HLO.value,
    )
    if config.rollout.placement == "disaggregated":
      return print_disaggregated(config, plan_disaggregated(config, target, **kw), _JSON.value)
    rows, mesh_shape = plan(config, target, functions=_csv(_FUNCTIONS.value) or FUNCTIONS, **kw)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  unit = unit_of(rows)
  print(header(config, target, mesh_shape, unit[0]))
  print(table(rows))
  if any("oom_required" in r.compiled for r in rows):
    print(
        "* the TPU compiler refused the program (out of HBM); its temp is the bytes the "
        "compiler asked for less the other columns"
    )
  print("\n".join(step_summary(rows, unit)))
  if _JSON.value:
    with open(_JSON.value, "w") as fh:
      json.dump([r.to_json(target, mesh_shape) for r in rows], fh, indent=1)
    print(f"wrote {_JSON.value} ({f['config'].config_filename})")
  if _DUMP_HLO.value:
    print(f"optimized HLO of each program in {_DUMP_HLO.value}/<program>.hlo.txt")


if __name__ == "__main__":
  from absl import app
  from absl import flags
  from ml_collections import config_flags

  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "Experiment config file (configs/*.py).", lock_config=True
  )
  _TOPOLOGY = flags.DEFINE_string(
      "topology",
      None,
      "TPU slice or GPUs to plan for: v5p-8, v6e-8, v5e-16, v4-8, ... (or "
      "v5p:2x2x1); h100, h200 (h100-8: eight on one host). Default: this machine's devices.",
  )
  _REMAT = flags.DEFINE_string(
      "remat",
      None,
      "Comma-separated remat policies (models/remat.py POLICIES; MaxText's "
      "names with impl=maxtext). Default: the config's.",
  )
  _MICRO = flags.DEFINE_string(
      "micro_batch",
      None,
      "Comma-separated micro_batch_size values (0 = all rows at once). " "Default: the config's.",
  )
  _MICRO_TOKENS = flags.DEFINE_string(
      "micro_batch_tokens",
      None,
      "Comma-separated micro_batch_tokens values (token budgets per micro-batch over all "
      "devices: (budget // (P + C)) rows; the packed update's worst case). Instead of "
      "--micro_batch. Default: the config's.",
  )
  _FUNCTIONS = flags.DEFINE_string(
      "functions", None, f"Comma-separated subset of {','.join(FUNCTIONS)}. Default: all."
  )
  _JSON = flags.DEFINE_string("json", None, "Write the rows (bytes per device) to this file.")
  _DUMP_HLO = flags.DEFINE_string(
      "dump_hlo",
      None,
      "Write each program's optimized HLO to DIR/<program>.hlo.txt (sampler, "
      "logprobs, update_<remat>_mb<micro-batch>).",
  )
  flags.mark_flag_as_required("config")
  from grpo_jax.run import paths

  app.run(main, flags_parser=lambda argv: flags.FLAGS(paths.config_file_args(argv)))
