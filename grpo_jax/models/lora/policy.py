"""LoRA as a policy, and its base across checkpoints: what the loop, infer and build ask of LoRA.

`lora_policy` wraps the native policy with adapters (on a dense or an MoE decoder; with MoE the
log-prob passes can replay the sampler's routes, rl/replay.py) (models/lora/adapters.py holds the adapters
themselves: attach, split/combine, merge, fold); `after_sft` / `load_base` / `restore_params`
keep the frozen base that a checkpoint's adapters go with. Split from lora.py so the decoder
(transformer.py -> lora.py) and the policy/HF layer (policy.py, hf.py -> transformer.py) import
in one direction only.
"""

from flax import nnx
import jax
import orbax.checkpoint as ocp

from grpo_jax.run import paths
from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf
from grpo_jax.models import policy as policy_lib
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.logprobs import completion_logprobs_routed
from grpo_jax.models.logprobs import packed_logprobs_routed
from grpo_jax.models.logprobs import packed_logprobs
from grpo_jax.models.lora.adapters import attach
from grpo_jax.models.lora.adapters import base_of
from grpo_jax.models.lora.adapters import combine
from grpo_jax.models.lora.adapters import fold
from grpo_jax.models.lora.adapters import has_adapters
from grpo_jax.models.lora.adapters import merged
from grpo_jax.models.lora.adapters import split

# ------------------------------------------------------------------------------ the policy


def lora_policy(config, mesh, *, abstract: bool = False):
  """The native policy with adapters (models.policy.Policy): params = base + adapters, the
  optimizer trains `split(params)[0]`, the reference is `base_of(params)` run without adapters."""
  lc = config.lora
  plain = policy_lib.native_policy(config, mesh, abstract=abstract)
  model = nnx.merge(plain.graphdef, plain.params)
  base_graphdef, graphdef = attach(model, lc, seed=config.seed, mesh=mesh, abstract=abstract)
  params = nnx.state(model)

  def logprobs(params, input_ids, attention_mask, completion_len, temperature=1.0):
    gd = graphdef if has_adapters(params) else base_graphdef  # no adapters: the reference
    return completion_logprobs(
        nnx.merge(gd, params), input_ids, attention_mask, completion_len, temperature
    )

  def packed(params, input_ids, segment_ids, positions, head_slots, temperature=1.0, shards=1):
    gd = graphdef if has_adapters(params) else base_graphdef  # no adapters: the reference
    return packed_logprobs(
        nnx.merge(gd, params),
        input_ids,
        segment_ids,
        positions,
        head_slots,
        temperature,
        shards=shards,
    )

  def routed(params, input_ids, attention_mask, routes, completion_len, temperature=1.0):
    # routing replay (rl/replay.py) through the adapted layers, or the base's (the reference)
    gd = graphdef if has_adapters(params) else base_graphdef
    return completion_logprobs_routed(
        nnx.merge(gd, params), input_ids, attention_mask, routes, completion_len, temperature
    )

  def packed_routed(
      params, input_ids, segment_ids, positions, head_slots, routes, temp=1.0, shards=1
  ):
    gd = graphdef if has_adapters(params) else base_graphdef
    return packed_logprobs_routed(
        nnx.merge(gd, params),
        input_ids,
        segment_ids,
        positions,
        head_slots,
        routes,
        temp,
        shards=shards,
    )

  merge_fn = jax.jit(lambda p: merged(p, graphdef))

  def save(params, path):
    hf.save_hf(nnx.merge(plain.graphdef, merge_fn(params)), path)

  # vLLM (any engine but the native one) holds the plain decoder: its sync gets merged weights
  # (rollout.vllm.lora_sync=merged) or the base once and then the adapters alone through
  # vLLM's own LoRA (adapters; rollout/vllm_engine.py); its probe check uses the merged form.
  if lc.merge_for_rollout or config.rollout.engine != "native":
    # the sampler runs the plain decoder on merged weights
    rollout = dict(
        rollout_params=lambda p: merged(p, graphdef),
        sampler_graphdef=plain.graphdef,
        sampler_is_trainer=False,
    )
  else:  # the sampler runs the trainer's own program (adapters applied per layer)
    rollout = dict(rollout_params=lambda p: p, sampler_graphdef=graphdef, sampler_is_trainer=True)
  return policy_lib.Policy(
      params=params,
      graphdef=graphdef,
      logprobs=logprobs,
      model_config=plain.model_config,
      save_hf=save,
      split=split,
      combine=combine,
      reference=base_of,
      packed_logprobs=packed,
      routed_logprobs=routed if plain.routed_logprobs is not None else None,
      packed_routed_logprobs=packed_routed if plain.packed_routed_logprobs is not None else None,
      **rollout,
  )


# ------------------------------------------------------------- the base across checkpoints
# GRPO checkpoints hold the adapters and their optimizer state, and the meta item names where
# the base comes from (meta["lora_base"]): model.hf_path, the seed's init, or WORKDIR/lora_base
# (the SFT'd base, written once when SFT hands over to GRPO).

BASE_DIR = "lora_base"


def after_sft(config, session, policy, params, mesh, workdir):
  """The params GRPO starts from: after an SFT warm start, the adapters folded into the base,
  which is then written to WORKDIR/lora_base (all processes; Orbax). Records meta["lora_base"]."""
  if not session.meta.get("sft_step"):
    session.meta["lora_base"] = config.model.hf_path or f"init:seed={config.seed}"
    return params
  params = jax.jit(lambda p: fold(p, policy.graphdef), out_shardings=policy.param_shardings(mesh))(
      params
  )
  where = paths.path(workdir) / BASE_DIR
  with ocp.StandardCheckpointer() as ckpt:  # (disaggregated: the trainer's on some processes)
    ckpt.save(where, jax.tree.map(multihost.savable, split(params)[1]), force=True)
  session.meta["lora_base"] = str(where)
  return params


def load_base(config, policy, mesh, where: str):
  """The frozen base a checkpoint's adapters go with (`where`: its meta["lora_base"])."""
  if where and not where.startswith("init:") and where != config.model.hf_path:
    target = sharding.abstract_with(split(policy.params)[1], split(policy.param_shardings(mesh))[1])
    with ocp.StandardCheckpointer() as ckpt:
      restored = ckpt.restore(where, jax.tree.map(multihost.readable, target))
    return jax.tree.map(multihost.placed, restored, target)
  return split(lora_policy(config, mesh).params)[1]  # model.hf_path or the seed's init again


def restore_params(config, ckpt, step: int, policy, mesh):
  """The full params (base + adapters) of checkpoint `step` (infer, export)."""
  meta = ckpt.restore_meta(step)
  if meta["phase"] == "sft":
    return ckpt.restore_params(step, policy.params)
  adapters = ckpt.restore_params(step, split(policy.params)[0])
  return combine(adapters, load_base(config, policy, mesh, meta.get("lora_base", "")))
