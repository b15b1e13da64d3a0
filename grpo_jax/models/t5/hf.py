"""Hugging Face T5ForConditionalGeneration folders <-> the native T5: load_t5_hf / save_t5_hf.

`t5_param_mapping(cfg)` is the one table between native parameter paths and HF tensor names
(HF Linear weights are [out, in]; native q/k/v are [D, H, K], o [H, K, D], MLP [in, out]).
Loading streams one tensor at a time into its sharding (models/decoder/hf.py's machinery); saving
writes config.json + safetensors (sharded with an index above `max_shard_bytes`) that
`transformers.T5ForConditionalGeneration.from_pretrained` loads with equal logits.

The LM head is tied when the checkpoint has no lm_head.weight of its own (or one equal to
shared.weight), as transformers 5 decides; the d_model**-0.5 output scaling comes from
config.json (`scale_decoder_outputs`, else `tie_word_embeddings`).
"""

import json
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.run import paths
from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf
from grpo_jax.models import safetensors_io
from grpo_jax.models.t5.model import T5
from grpo_jax.models.t5.config import T5Config


def t5_param_mapping(cfg: T5Config) -> list[hf.Entry]:
  """One Entry per tensor (layers spelled out): native path <-> HF name, both conversions."""
  d, h, k = cfg.d_model, cfg.num_heads, cfg.d_kv
  ident = (lambda w: w), (lambda w: w)
  lin = (lambda w: w.T), (lambda w: w.T)
  proj_in = (lambda w: w.T.reshape(d, h, k)), (lambda w: w.reshape(d, h * k).T)
  proj_out = (lambda w: w.T.reshape(h, k, d)), (lambda w: w.reshape(h * k, d).T)
  mlp = ("wi_0", "wi_1", "wo") if cfg.gated else ("wi", "wo")
  out = [hf.Entry(("shared",), "shared.weight", *ident, False)]

  def add(path, name, conv):
    out.append(hf.Entry(path, name, *conv, False))

  def attention(path, name):
    for p in ("q", "k", "v"):
      add((*path, p), f"{name}.{p}.weight", proj_in)
    add((*path, "o"), f"{name}.o.weight", proj_out)

  for side, n_layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
    add(
        (side, "rel_bias"),
        f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        ident,
    )
    add((side, "final_norm", "scale"), f"{side}.final_layer_norm.weight", ident)
    for i in range(n_layers):
      native, name = (side, "layers", i), f"{side}.block.{i}.layer."
      if side == "encoder":
        parts = [("attn_norm", "attn", "0.SelfAttention")]
      else:
        parts = [
            ("self_norm", "self_attn", "0.SelfAttention"),
            ("cross_norm", "cross_attn", "1.EncDecAttention"),
        ]
      for norm, attn, hf_attn in parts:
        add((*native, norm, "scale"), f"{name}{hf_attn[0]}.layer_norm.weight", ident)
        attention((*native, attn), name + hf_attn)
      ff = len(parts)
      add((*native, "mlp_norm", "scale"), f"{name}{ff}.layer_norm.weight", ident)
      for w in mlp:
        add((*native, "mlp", w), f"{name}{ff}.DenseReluDense.{w}.weight", lin)
  if not cfg.tie_word_embeddings:
    add(("lm_head",), "lm_head.weight", lin)
  return out


def _head_is_tied(ckpt, shared_name: str) -> bool:
  if "lm_head.weight" not in ckpt.files:
    return True
  return bool(np.array_equal(ckpt.get("lm_head.weight"), ckpt.get(shared_name)))


def _shared_name(ckpt) -> str:
  # older exports name only the stacks' copies of the shared embedding
  return "shared.weight" if "shared.weight" in ckpt.files else "encoder.embed_tokens.weight"


def read_t5_config(
    path: str, dtype=jnp.float32, *, param_dtype=None, remat_policy: str = "none", ckpt=None
) -> T5Config:
  """The T5Config of an HF folder as load_t5_hf builds it (the head's tying read from the
  weights), without loading the model: e.g. the shapes to restore a checkpoint into."""
  ckpt = ckpt or hf._Checkpoint(path)
  return T5Config.from_hf_dict(
      hf.read_hf_config(path),
      tie_word_embeddings=_head_is_tied(ckpt, _shared_name(ckpt)),
      dtype=jnp.dtype(dtype).name,
      param_dtype=jnp.dtype(param_dtype or dtype).name,
      remat_policy=remat_policy,
  )


def load_t5_hf(
    path: str, dtype=jnp.float32, *, mesh=None, param_dtype=None, remat_policy: str = "none"
) -> T5:
  """Loads a T5 / flan-t5 Hugging Face folder (config.json + safetensors) into a native T5.

  `dtype` is the compute dtype and, unless `param_dtype` is given, the parameter dtype. With
  `mesh`, parameters land directly in their shardings (one tensor in host memory at a time)."""
  ckpt = hf._Checkpoint(path)
  cfg = read_t5_config(path, dtype, param_dtype=param_dtype, remat_policy=remat_policy, ckpt=ckpt)
  shared_name = _shared_name(ckpt)
  abstract = nnx.eval_shape(lambda: T5(cfg, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(abstract_state))
  flat_shardings = (
      {
          p: v.get_value()
          for p, v in nnx.to_flat_state(sharding.state_shardings(abstract_state, mesh))
      }
      if mesh is not None
      else {}
  )
  default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  values = {}
  for e in t5_param_mapping(cfg):
    name = shared_name if e.hf_name == "shared.weight" else e.hf_name
    value = flat[e.path].get_value()
    values[e.path] = hf._array(
        ckpt, name, e, value.shape, value.dtype, flat_shardings.get(e.path, default)
    )
  missing = set(flat) - set(values)
  if missing:
    raise ValueError(f"{path}: no mapping for native parameters {sorted(missing)}")
  state = nnx.from_flat_state({p: flat[p].replace(values[p]) for p in flat})
  return nnx.merge(graphdef, state)


def save_t5_hf(
    model_or_params,
    config: T5Config | None,
    path: str,
    *,
    dtype=None,
    max_shard_bytes: int = 4 << 30,
):
  """Writes a T5ForConditionalGeneration folder from a T5 module, or from its parameter
  nnx.State with `config`. In multi-host runs every process calls it (the gathers are
  collective); process 0 writes."""
  if isinstance(model_or_params, T5):
    model = model_or_params
  else:
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: T5(config, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, model_or_params)
  cfg = model.cfg
  out_dtype = np.dtype(dtype or jnp.dtype(cfg.param_dtype))
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  entries = t5_param_mapping(cfg)
  shapes = {
      e.hf_name: tuple(
          e.to_hf(np.broadcast_to(np.float32(0), flat[e.path].get_value().shape)).shape
      )
      for e in entries
  }
  writer = jax.process_index() == 0
  if writer:
    paths.makedirs(path)
  shards, current, size = [], [], 0
  for e in entries:
    nbytes = int(np.prod(shapes[e.hf_name])) * out_dtype.itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(e)
    size += nbytes
  shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = (
        "model.safetensors"
        if len(shards) == 1
        else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    )
    items = [
        (
            e.hf_name,
            shapes[e.hf_name],
            out_dtype,
            lambda e=e: e.to_hf(hf._to_host(flat[e.path][...])),
        )
        for e in shard
    ]
    if writer:
      safetensors_io.write(os.fspath(paths.path(path) / fname), items, metadata={"format": "pt"})
    else:
      for *_, produce in items:  # take part in the collective gathers
        produce()
    weight_map.update({e.hf_name: fname for e in shard})
  if writer:
    if len(shards) > 1:
      total = sum(int(np.prod(s)) * out_dtype.itemsize for s in shapes.values())
      paths.write_atomic(
          paths.path(path) / "model.safetensors.index.json",
          json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
      )
    paths.write_atomic(
        paths.path(path) / "config.json",
        json.dumps(cfg.to_hf_dict(torch_dtype=out_dtype.name), indent=2),
    )
