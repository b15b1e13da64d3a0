"""The policy as the training loop sees it: trainable params + a log-prob function + rollout weights.

Built by `models.build.make_policy(config, mesh)`. The loop never touches a model class: it
holds `policy.params` (an nnx.State), trains them through `policy.logprobs(params, input_ids,
attention_mask, completion_len)`, and the rollout engine turns them into the native decoder's
weights with `policy.rollout_params(params)` for the jitted sampler (`policy.sampler_graphdef`).
The native policy samples from the trained arrays themselves (`sampler_is_trainer`); the
MaxText policy (models/maxtext_adapter.py) maps MaxText weights onto the native layout.
"""
import dataclasses
from typing import Callable

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.models import hf
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.transformer import Transformer
from grpo_jax.models.transformer import build_model


@dataclasses.dataclass
class Policy:
  params: nnx.State
  graphdef: nnx.GraphDef
  logprobs: Callable  # (params, input_ids [B,S], attention_mask [B,S], C, temperature) -> [B, C]
  rollout_params: Callable  # params -> native decoder state for the sampler
  sampler_graphdef: nnx.GraphDef
  model_config: ModelConfig
  save_hf: Callable  # (params, path) -> None
  # True when the native sampler runs the very program the trainer differentiates (same
  # weights, same layers): its log-probs are the trainer's. False for the MaxText policy (the
  # sampler runs the native decoder on mapped weights), so the loop measures the mismatch.
  sampler_is_trainer: bool = True
  # The MaxText policy brings its own parameter shardings; None: from logical-axis metadata.
  shardings: Callable | None = None  # mesh -> State of NamedShardings

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
    model = hf.load_hf(m.hf_path, jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype),
                       mesh=mesh, remat_policy=m.remat_policy, scan_layers=m.scan_layers)
    cfg = model.cfg
  else:
    cfg = model_config_from(config)
    if m.hf_path:  # abstract restore of an HF-initialized run: the shape comes from the folder
      cfg = ModelConfig.from_hf_config(hf.read_hf_config(m.hf_path), dtype=m.dtype,
                                       param_dtype=m.param_dtype, remat_policy=m.remat_policy,
                                       scan_layers=m.scan_layers)
    if abstract:
      model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=config.seed)))
    else:
      model = build_model(cfg, seed=config.seed, mesh=mesh)
  graphdef, params = nnx.split(model)
  if abstract:
    shardings = sharding.state_shardings(params, mesh)
    params = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          params, shardings)  # same structure: Variables holding leaves

  def logprobs(params, input_ids, attention_mask, completion_len, temperature=1.0):
    return completion_logprobs(nnx.merge(graphdef, params), input_ids, attention_mask,
                               completion_len, temperature)

  def save(params, path):
    hf.save_hf(nnx.merge(graphdef, params), path)

  return Policy(params=params, graphdef=graphdef, logprobs=logprobs,
                rollout_params=lambda p: p, sampler_graphdef=graphdef, model_config=cfg,
                save_hf=save)
