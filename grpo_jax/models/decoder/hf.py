"""Hugging Face checkpoint interop: load_hf / save_hf and the parameter name mapping.

`param_mapping(cfg)` is the one table between native parameter paths and Hugging Face tensor
names (with the reshape/transpose each needs). save_hf, load_hf and the vLLM weight sync all
use it; the MaxText adapter maps onto the same HF names.

Loading streams: each parameter is built with `jax.make_array_from_callback` directly in its
sharding, its callback slicing a memory-mapped safetensors tensor, so peak host memory is about
one tensor, never the model.
"""

import dataclasses
import json
import os
from typing import Callable, Iterator

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.run import paths
from grpo_jax.parallel import sharding
from grpo_jax.models import safetensors_io
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.decoder.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class Entry:
  """One native parameter <-> one HF tensor per layer (or one tensor for non-layer params)."""

  path: tuple  # native path; for per-layer params without the layer index, e.g. ("attn", "q")
  hf_name: str  # may contain "{i}" for the layer index (and "{j}" for the expert, `experts`)
  to_native: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  per_layer: bool
  # Which layers hold it: None every layer, True the MoE layers only, False the dense ones.
  moe: bool | None = None
  # One HF tensor per expert ("{j}"), stacked on the native tensor's expert axis (moe.py).
  experts: bool = False


def _identity(x):
  return x


def param_mapping(cfg: ModelConfig, prefix: str = "model.") -> list[Entry]:
  """The native <-> HF table; `prefix`: where the decoder's tensors live ("model."; a Gemma 3
  multimodal folder's text tower: "model.language_model." or "language_model.model.")."""
  d, h, g, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  layer = prefix + "layers.{i}."

  def proj_in(n):  # HF Linear [n*K, D] <-> native [D, n, K]
    return (lambda w: w.T.reshape(d, n, k)), (lambda w: w.reshape(d, n * k).T)

  def bias(n):
    return (lambda b: b.reshape(n, k)), (lambda b: b.reshape(n * k))

  t = (lambda w: w.T), (lambda w: w.T)
  ident = _identity, _identity
  dense = False if cfg.num_experts else None  # with MoE layers, the dense MLP's are the others
  entries = [
      Entry(("embed",), prefix + "embed_tokens.weight", *ident, False),
      Entry(("final_norm", "scale"), prefix + "norm.weight", *ident, False),
      Entry(("attn_norm", "scale"), layer + "input_layernorm.weight", *ident, True),
      Entry(("attn", "q"), layer + "self_attn.q_proj.weight", *proj_in(h), True),
      Entry(("attn", "k"), layer + "self_attn.k_proj.weight", *proj_in(g), True),
      Entry(("attn", "v"), layer + "self_attn.v_proj.weight", *proj_in(g), True),
      Entry(
          ("attn", "o"),
          layer + "self_attn.o_proj.weight",
          lambda w: w.T.reshape(h, k, d),
          lambda w: w.reshape(h * k, d).T,
          True,
      ),
      Entry(("mlp", "gate"), layer + "mlp.gate_proj.weight", *t, True, dense),
      Entry(("mlp", "up"), layer + "mlp.up_proj.weight", *t, True, dense),
      Entry(("mlp", "down"), layer + "mlp.down_proj.weight", *t, True, dense),
  ]
  if cfg.num_experts:  # Qwen3-MoE: the router is HF's mlp.gate, each expert its own Linear
    expert = layer + "mlp.experts.{j}."
    entries += [
        Entry(("mlp", "router"), layer + "mlp.gate.weight", *t, True, True),
        Entry(("mlp", "gate"), expert + "gate_proj.weight", *t, True, True, True),
        Entry(("mlp", "up"), expert + "up_proj.weight", *t, True, True, True),
        Entry(("mlp", "down"), expert + "down_proj.weight", *t, True, True, True),
    ]
  if cfg.gemma:  # HF's post_attention_layernorm is Gemma's norm after attention
    entries += [
        Entry(("post_attn_norm", "scale"), layer + "post_attention_layernorm.weight", *ident, True),
        Entry(("mlp_norm", "scale"), layer + "pre_feedforward_layernorm.weight", *ident, True),
        Entry(
            ("post_mlp_norm", "scale"), layer + "post_feedforward_layernorm.weight", *ident, True
        ),
    ]
  else:
    entries.append(
        Entry(("mlp_norm", "scale"), layer + "post_attention_layernorm.weight", *ident, True)
    )
  if cfg.qk_norm:
    entries += [
        Entry(("attn", "q_norm", "scale"), layer + "self_attn.q_norm.weight", *ident, True),
        Entry(("attn", "k_norm", "scale"), layer + "self_attn.k_norm.weight", *ident, True),
    ]
  if cfg.attention_bias:
    entries += [
        Entry(("attn", "q_bias"), layer + "self_attn.q_proj.bias", *bias(h), True),
        Entry(("attn", "k_bias"), layer + "self_attn.k_proj.bias", *bias(g), True),
        Entry(("attn", "v_bias"), layer + "self_attn.v_proj.bias", *bias(g), True),
        Entry(("attn", "o_bias"), layer + "self_attn.o_proj.bias", *ident, True),
    ]
  if not cfg.tie_embeddings:
    entries.append(Entry(("lm_head",), "lm_head.weight", *t, False))
  return entries


def _native_paths(cfg: ModelConfig, e: Entry):
  """[(native path, at, hf name)] for one entry: `at` indexes the native tensor's stacked
  leading axes, () when it is the HF tensor's whole: (i,) layer i of the scanned stack, (j,)
  expert j, (i, j) both."""
  if not e.per_layer:
    return [(e.path, (), e.hf_name)]
  layers = [i for i in range(cfg.num_layers) if e.moe is None or cfg.layer_is_moe(i) == e.moe]
  experts = [(j,) for j in range(cfg.num_experts)] if e.experts else [()]
  out = []
  for i in layers:
    path, at = (("layers", *e.path), (i,)) if cfg.scan_layers else (("layers", i, *e.path), ())
    out += [(path, at + x, e.hf_name.format(i=i, j=x[0] if x else 0)) for x in experts]
  return out


# ---------------------------------------------------------------------------------- reading


class _Checkpoint:
  """All tensors of an HF folder (single file or sharded with model.safetensors.index.json)."""

  def __init__(self, path: str):
    folder = paths.path(path)
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.exists():
      weight_map = json.loads(index.read_text())["weight_map"]
      files = {n: os.fspath(folder / fn) for n, fn in weight_map.items()}
    elif single.exists():
      single = os.fspath(single)
      files = {n: single for n in safetensors_io.SafetensorsFile(single).keys()}
    else:
      found = paths.listdir(path)
      raise FileNotFoundError(
          f"{path}: no model.safetensors or model.safetensors.index.json (found: "
          f"{', '.join(found) or 'nothing'}). Fix: point at a Hugging Face checkpoint folder "
          "saved with safetensors (save_pretrained(..., safe_serialization=True))."
      )
    self.files = files
    self._open: dict[str, safetensors_io.SafetensorsFile] = {}

  def get(self, name: str) -> np.ndarray:
    if name not in self.files:
      raise KeyError(f"tensor {name} is missing from the checkpoint")
    fn = self.files[name]
    if fn not in self._open:
      if not paths.exists(fn):
        raise FileNotFoundError(f"{fn}: listed in model.safetensors.index.json but missing")
      self._open[fn] = safetensors_io.SafetensorsFile(fn)
    return self._open[fn].get(name)


def read_hf_config(path: str) -> dict:
  cfg_path = paths.path(path) / "config.json"
  if not paths.isdir(path):
    raise FileNotFoundError(
        f"{path}: not a directory. Fix: pass a Hugging Face checkpoint folder "
        "(config.json + *.safetensors)"
    )
  if not cfg_path.exists():
    raise FileNotFoundError(
        f"{cfg_path}: missing. Fix: a Hugging Face checkpoint folder holds "
        "config.json beside its *.safetensors files"
    )
  return json.loads(cfg_path.read_text())


def load_hf(
    path: str,
    dtype=jnp.float32,
    *,
    mesh=None,
    param_dtype=None,
    remat_policy="none",
    scan_layers=False,
    **overrides,
) -> Transformer:
  """Loads a Qwen3 / Qwen3-MoE / Llama / Gemma 2 / Gemma 3 (text) Hugging Face checkpoint folder into a
  native Transformer (a Gemma 3 multimodal folder: its text tower).

  `dtype` is the compute dtype and, unless `param_dtype` is given, the parameter dtype.
  With `mesh`, parameters land directly in their shardings (one tensor or shard in host
  memory at a time). Errors name the file, tensor and shapes at fault. `overrides` replace
  ModelConfig fields read from config.json (e.g. tie_embeddings=True to load the decoder of a
  *ForSequenceClassification folder, which has no LM head).
  """
  hf_cfg = read_hf_config(path)
  dt = jnp.dtype(dtype).name
  cfg = ModelConfig.from_hf_config(
      hf_cfg,
      dtype=dt,
      param_dtype=jnp.dtype(param_dtype or dtype).name,
      remat_policy=remat_policy,
      scan_layers=scan_layers,
      **overrides,
  )
  ckpt = _Checkpoint(path)
  prefix = next(
      (
          p
          for p in ("model.", "model.language_model.", "language_model.model.")
          if p + "embed_tokens.weight" in ckpt.files
      ),
      "model.",
  )
  kernels = Kernels.for_mesh(cfg, mesh)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), kernels=kernels))
  graphdef, abstract_state = nnx.split(abstract)
  shardings = sharding.state_shardings(abstract_state, mesh) if mesh is not None else None
  flat = dict(nnx.to_flat_state(abstract_state))
  flat_shardings = (
      {p: v.get_value() for p, v in nnx.to_flat_state(shardings)} if shardings is not None else {}
  )
  values = {}
  one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  for e in param_mapping(cfg, prefix):
    by_path: dict[tuple, list] = {}
    for p, at, name in _native_paths(cfg, e):
      by_path.setdefault(p, []).append((at, name))
    for p, named in by_path.items():
      shape, pdtype = flat[p].get_value().shape, flat[p].get_value().dtype
      target = flat_shardings.get(p) or one_device
      if named[0][0] == ():
        values[p] = _array(ckpt, named[0][1], e, shape, pdtype, target)
      else:  # HF tensors stacked on the leading axes `at` indexes (layers, experts)
        names = np.empty(shape[: len(named[0][0])], object)
        for at, name in named:
          names[at] = name
        values[p] = _stacked_array(ckpt, names, e, shape, pdtype, target)
  missing = set(flat) - set(values)
  if missing:
    raise ValueError(f"{path}: no mapping for native parameters {sorted(missing)}")
  state = nnx.from_flat_state({p: flat[p].replace(values[p]) for p in flat})
  return nnx.merge(graphdef, state)


def _checked(ckpt, name, e: Entry, shape_native, layer_shape=None):
  w = ckpt.get(name)
  want = shape_native if layer_shape is None else layer_shape
  try:
    out = e.to_native(w)
    ok = tuple(out.shape) == tuple(want)
  except ValueError:
    ok = False
  if not ok:
    hf_want = tuple(e.to_hf(np.zeros(want, np.float32)).shape)
    raise ValueError(
        f"shape mismatch for tensor {name}: checkpoint has {tuple(w.shape)}, the "
        f"model config (config.json) implies {hf_want}"
    )
  return out


def _array(ckpt, name, e, shape, pdtype, target):
  cache = {}

  def cb(index):
    if "w" not in cache:
      cache["w"] = _checked(ckpt, name, e, shape)
    return np.asarray(cache["w"][index], dtype=pdtype)

  return jax.make_array_from_callback(shape, target, cb, dtype=pdtype)


def _stacked_array(ckpt, names, e, shape, pdtype, target):
  """`names` [*lead] (an object array): the HF tensors stacked on the native tensor's leading
  axes; each shard reads the tensors of its own slice of them."""
  lead = names.ndim

  def cb(index):
    picked = names[index[:lead]]
    out = None
    for at in np.ndindex(picked.shape):
      w = _checked(ckpt, picked[at], e, shape, shape[lead:])[index[lead:]]
      if out is None:
        out = np.empty(picked.shape + w.shape, pdtype)
      out[at] = w
    return out

  return jax.make_array_from_callback(shape, target, cb, dtype=pdtype)


# ---------------------------------------------------------------------------------- writing


def hf_tensors(model: Transformer, dtype=None) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
  """(HF name, producer of the host array) for every tensor, in HF layout, one at a time.

  Producers fetch lazily (multi-host: all-gathered), so callers hold one tensor at a time.
  """
  cfg = model.cfg
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for e in param_mapping(cfg):
    for p, at, name in _native_paths(cfg, e):
      var = flat[p]

      def produce(var=var, at=at, e=e):
        x = _to_host(var[...][at])
        return e.to_hf(x if dtype is None else x.astype(dtype))

      yield name, produce


def _to_host(x: jax.Array) -> np.ndarray:
  if jax.process_count() > 1 and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def save_hf(
    model: Transformer,
    path: str,
    *,
    dtype=None,
    max_shard_bytes: int = 4 << 30,
    every_process: bool = False,
):
  """Writes config.json + safetensors (sharded with an index above `max_shard_bytes`) that
  `transformers.AutoModelForCausalLM.from_pretrained(path)` loads with equal logits.
  In multi-host runs every process must call it (the gather is collective); process 0 writes
  (every_process: each writes its own copy to `path`, a folder of its own machine).
  """
  cfg = model.cfg
  out_dtype = np.dtype(dtype or jnp.dtype(cfg.param_dtype))
  shapes = {}
  abstract = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for e in param_mapping(cfg):
    for p, at, name in _native_paths(cfg, e):
      shape = abstract[p].get_value().shape[len(at) :]
      shapes[name] = tuple(e.to_hf(np.broadcast_to(np.zeros((), np.float32), shape)).shape)
  writer = every_process or jax.process_index() == 0
  if writer:
    paths.makedirs(path)
  shards, current, size = [], [], 0
  for name, produce in hf_tensors(model):
    nbytes = int(np.prod(shapes[name])) * out_dtype.itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((name, produce))
    size += nbytes
  shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = (
        "model.safetensors"
        if len(shards) == 1
        else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    )
    items = [(n, shapes[n], out_dtype, p) for n, p in shard]
    if writer:
      safetensors_io.write(os.fspath(paths.path(path) / fname), items, metadata={"format": "pt"})
    else:
      for *_, p in items:  # take part in the collective gathers
        p()
    weight_map.update({n: fname for n, _ in shard})
  if writer:
    if len(shards) > 1:
      total = sum(int(np.prod(s)) * out_dtype.itemsize for s in shapes.values())
      paths.write_atomic(
          paths.path(path) / "model.safetensors.index.json",
          json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2),
      )
    paths.write_atomic(
        paths.path(path) / "config.json",
        json.dumps(cfg.to_hf_config(torch_dtype=out_dtype.name), indent=2),
    )
