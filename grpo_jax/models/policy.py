"""The policy as the training loop sees it: trainable params + a log-prob function + rollout weights.

Built by `models.build.make_policy(config, mesh)`. The loop never touches a model class: it
holds `policy.params` (an nnx.State), trains them through `policy.logprobs(params, input_ids,
attention_mask, completion_len)`, and the rollout engine turns them into the native decoder's
weights with `policy.rollout_params(params)` for the jitted sampler (`policy.sampler_graphdef`).
The native policy samples from the trained arrays themselves (`sampler_is_trainer`); the
MaxText policy (models/maxtext/adapter.py) maps MaxText weights onto the native layout.

`t5_policy` (model.family="t5") is an encoder-decoder behind the same interface: each
[left-padded prompt; completion] row is split at S - C into the encoder's input and the
decoder's targets, and `decoder_start_id` tells the rollout engine to sample with the seq2seq
sampler (rollout/seq2seq_sampler.py), so the loop, SFT and evaluation run unchanged.
"""

import dataclasses
from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.t5 import hf as t5_hf
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.logprobs import completion_logprobs_routed
from grpo_jax.models.logprobs import packed_logprobs
from grpo_jax.models.logprobs import packed_logprobs_routed
from grpo_jax.models.t5.model import T5
from grpo_jax.models.t5.model import build_t5
from grpo_jax.models.t5.model import t5_logprobs
from grpo_jax.models.t5.config import T5Config
from grpo_jax.models.decoder.transformer import Transformer
from grpo_jax.models.decoder.transformer import build_model


@dataclasses.dataclass
class Policy:
  params: nnx.State
  graphdef: nnx.GraphDef
  logprobs: Callable  # (params, input_ids [B,S], attention_mask [B,S], C, temperature) -> [B, C]
  rollout_params: Callable  # params -> native decoder state for the sampler
  sampler_graphdef: nnx.GraphDef
  model_config: ModelConfig | T5Config
  save_hf: Callable  # (params, path) -> None: an HF folder transformers loads
  # True when the native sampler runs the very program the trainer differentiates (same
  # weights, same layers): its log-probs are the trainer's. False for the MaxText policy (the
  # sampler runs the native decoder on mapped weights), so the loop measures the mismatch.
  sampler_is_trainer: bool = True
  # The MaxText policy brings its own parameter shardings; None: from logical-axis metadata.
  shardings: Callable | None = None  # mesh -> State of NamedShardings
  # Encoder-decoder policies: the decoder's start token, and the native engine samples with
  # the seq2seq sampler (prompt -> encoder, completion <- decoder). None: a decoder-only policy.
  decoder_start_id: int | None = None
  # LoRA (models/lora/adapters.py): params -> (trained, frozen) and back; the optimizer sees only the
  # trained part. None: every parameter is trained.
  split: Callable | None = None
  combine: Callable | None = None
  # params -> the frozen reference made of the same arrays (LoRA: the base, run without the
  # adapters). None: the reference is a copy (as_reference).
  reference: Callable | None = None
  # Packed rows (rl/packing.py): (params, input_ids [R, L], segment_ids [R, L], positions
  # [R, L], head_slots, temperature, shards=1) -> [R, L], the log-prob of each token at
  # head_slots (flat slots within each of `shards` blocks of rows: the data-parallel shards)
  # given its sequence before it
  # (models/logprobs.py: packed_logprobs). None: the policy trains on padded rows only.
  packed_logprobs: Callable | None = None
  # Routing replay (an MoE native decoder; rl/replay.py): (params, input_ids [B,S],
  # attention_mask [B,S], routes [B,S,L_moe,k] (-1 = own top-k), C, temperature) -> (log-probs
  # [B, C], the MoE layers' own top-k [B, S, L_moe, k]). None: no MoE layers to replay.
  routed_logprobs: Callable | None = None
  # Routing replay on packed rows: (params, input_ids, segment_ids, positions [R, L],
  # head_slots, routes [R, L, L_moe, k], temperature, shards=1) -> (log-probs [R, L], own top-k [R, L,
  # L_moe, k]) (models/logprobs.py: packed_logprobs_routed). None: no MoE layers to replay.
  packed_routed_logprobs: Callable | None = None

  def param_shardings(self, mesh):
    if self.shardings is not None:
      return self.shardings(mesh)
    return sharding.state_shardings(self.params, mesh)


def as_reference(params, compute_dtype):
  """The frozen reference copy of `params`, stored in the compute dtype where that is narrower.

  The layers cast every weight to the activation dtype before use, so a bf16 copy of f32
  master weights gives the very same bf16 forward pass at half the memory. Works on arrays
  (a copy) and on abstract values (jax.ShapeDtypeStruct, e.g. restore targets)."""
  dt = jnp.dtype(compute_dtype)

  def one(x):
    narrower = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > dt.itemsize
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dt if narrower else x.dtype, sharding=x.sharding)
    return x.astype(dt) if narrower else jnp.copy(x)

  return jax.tree.map(one, params)


def model_config_from(config) -> ModelConfig:
  """ModelConfig from the config.model block (shape fields; hf_path handled by the caller)."""
  m = config.model
  fields = {f.name: m[f.name] for f in dataclasses.fields(ModelConfig)}
  return ModelConfig(**fields)


def native_policy(config, mesh, *, abstract: bool = False) -> Policy:
  """The native decoder: from model.hf_path when set, else random init from config.model.

  `abstract=True` builds only shapes and shardings (for restoring a checkpoint into).
  """
  m = config.model
  if m.hf_path and not abstract:
    model = hf.load_hf(
        m.hf_path,
        jnp.dtype(m.dtype),
        param_dtype=jnp.dtype(m.param_dtype),
        mesh=mesh,
        remat_policy=m.remat_policy,
        scan_layers=m.scan_layers,
        attention_impl=m.attention_impl,
    )
    cfg = model.cfg
  else:
    cfg = model_config_from(config)
    if m.hf_path:  # abstract restore of an HF-initialized run: the shape comes from the folder
      cfg = ModelConfig.from_hf_config(
          hf.read_hf_config(m.hf_path),
          dtype=m.dtype,
          param_dtype=m.param_dtype,
          remat_policy=m.remat_policy,
          scan_layers=m.scan_layers,
          attention_impl=m.attention_impl,
      )
    if abstract:
      kernels = Kernels.for_mesh(cfg, mesh)  # the mesh's platform: a memory plan's target chip
      model = nnx.eval_shape(
          lambda: Transformer(cfg, rngs=nnx.Rngs(params=config.seed), kernels=kernels)
      )
    else:
      model = build_model(cfg, seed=config.seed, mesh=mesh)
  graphdef, params = nnx.split(model)
  if abstract:
    params = _abstract_params(params, mesh)

  def logprobs(params, input_ids, attention_mask, completion_len, temperature=1.0):
    return completion_logprobs(
        nnx.merge(graphdef, params), input_ids, attention_mask, completion_len, temperature
    )

  def packed(params, input_ids, segment_ids, positions, head_slots, temperature=1.0, shards=1):
    return packed_logprobs(
        nnx.merge(graphdef, params),
        input_ids,
        segment_ids,
        positions,
        head_slots,
        temperature,
        shards=shards,
    )

  def routed(params, input_ids, attention_mask, routes, completion_len, temperature=1.0):
    return completion_logprobs_routed(
        nnx.merge(graphdef, params), input_ids, attention_mask, routes, completion_len, temperature
    )

  def packed_routed(
      params, input_ids, segment_ids, positions, head_slots, routes, temp=1.0, shards=1
  ):
    return packed_logprobs_routed(
        nnx.merge(graphdef, params),
        input_ids,
        segment_ids,
        positions,
        head_slots,
        routes,
        temp,
        shards=shards,
    )

  def save(params, path):
    hf.save_hf(nnx.merge(graphdef, params), path)

  return Policy(
      params=params,
      graphdef=graphdef,
      logprobs=logprobs,
      rollout_params=lambda p: p,
      sampler_graphdef=graphdef,
      model_config=cfg,
      save_hf=save,
      packed_logprobs=packed,
      routed_logprobs=routed if any(cfg.moe_layers) else None,
      packed_routed_logprobs=packed_routed if any(cfg.moe_layers) else None,
  )


def _abstract_params(params, mesh):
  """Shapes and shardings only (restore targets): same structure, Variables holding leaves."""
  shardings = sharding.state_shardings(params, mesh)
  return jax.tree.map(
      lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), params, shardings
  )


def t5_policy(config, mesh, *, abstract: bool = False) -> Policy:
  """A T5 encoder-decoder (model.family="t5"): from model.hf_path (a T5ForConditionalGeneration
  folder) when set, else random init from config.model (T5Config.from_model_block).

  logprobs(params, input_ids [N, S], attention_mask [N, S], C) splits every row at S - C:
  the left-padded prompt [N, P] is the encoder's input, the completion [N, C] (its mask: the
  last C mask columns) the decoder's targets after the start token; -> [N, C], 0 where masked.
  """
  m = config.model
  dtypes = dict(param_dtype=jnp.dtype(m.param_dtype), remat_policy=m.remat_policy)
  if m.hf_path and not abstract:
    model = t5_hf.load_t5_hf(m.hf_path, jnp.dtype(m.dtype), mesh=mesh, **dtypes)
    cfg = model.cfg
  else:
    cfg = (
        t5_hf.read_t5_config(m.hf_path, jnp.dtype(m.dtype), **dtypes)
        if m.hf_path
        else T5Config.from_model_block(m).validate()
    )
    if abstract:
      model = nnx.eval_shape(lambda: T5(cfg, rngs=nnx.Rngs(params=config.seed)))
    else:
      model = build_t5(cfg, seed=config.seed, mesh=mesh)
  graphdef, params = nnx.split(model)
  if abstract:
    params = _abstract_params(params, mesh)

  def logprobs(params, input_ids, attention_mask, completion_len, temperature=1.0):
    p = input_ids.shape[1] - completion_len
    return t5_logprobs(
        nnx.merge(graphdef, params),
        input_ids[:, :p],
        attention_mask[:, :p],
        input_ids[:, p:],
        attention_mask[:, p:],
        temperature,
    )

  def save(params, path):
    t5_hf.save_t5_hf(nnx.merge(graphdef, params), None, path)

  return Policy(
      params=params,
      graphdef=graphdef,
      logprobs=logprobs,
      rollout_params=lambda p: p,
      sampler_graphdef=graphdef,
      model_config=cfg,
      save_hf=save,
      decoder_start_id=cfg.decoder_start_token_id,
  )
