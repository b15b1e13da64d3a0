"""A MaxText model as the GRPO policy: `maxtext_policy(config, mesh)` -> models.policy.Policy.

With `config.model.impl = "maxtext"` the trained policy (and the reference copy) is MaxText's NNX
`Transformer`, built by MaxText's own `pyconfig` from our config.model block, so its layers,
remat policies (`model.maxtext.remat_policy`, per-tensor `remat|device|offload` through
`model.maxtext.overrides`), scanned layers and attention kernels are MaxText's. The loop sees
the usual Policy interface:

  logprobs(params, ids, mask, L, temperature)  MaxText forward with positions = cumsum(mask) - 1
                                               and decoder_segment_ids = mask, so a real token
                                               never attends to left padding (segment 1 vs 0);
  rollout_params(params)                       the same weights in the native decoder's layout,
                                               for the jitted native sampler and the vLLM sync
                                               (which then goes native -> HF names, models/hf.py).

Weight mapping (`maxtext_to_native` / `native_to_maxtext`, pure dicts, exact both ways):

  native (models/transformer.py)      MaxText (decoder_block qwen3)            HF
  embed [V, D]                        token_embedder.embedding [V, D]          model.embed_tokens
  final_norm.scale                    decoder.decoder_norm.scale               model.norm
  lm_head [D, V] (untied only)        decoder.logits_dense.kernel [D, V]       lm_head (transposed)
  layers[i].attn_norm.scale           decoder.layers_i.pre_self_attention_layer_norm.scale
  layers[i].mlp_norm.scale            decoder.layers_i.post_self_attention_layer_norm.scale
  layers[i].attn.{q,k,v} [D, n, K]    decoder.layers_i.self_attention.{query,key,value}.kernel
  layers[i].attn.o [H, K, D]          decoder.layers_i.self_attention.out.kernel
  layers[i].attn.{q,k}_norm.scale     decoder.layers_i.self_attention.{query,key}_norm.scale
  layers[i].mlp.{gate,up,down}        decoder.layers_i.mlp.{wi_0,wi_1,wo}.kernel

Per-layer tensors have the same shapes on both sides (no transposes). Scanned layers stack
them: native on axis 0 (`layers.attn.q` [L, D, H, K]), MaxText on `param_scan_axis` (1 by
default: `decoder.layers.self_attention.query.kernel` [D, L, H, K]).

Initialization. MaxText initializes the token embedding N(0, 1) (models.py: `normal(stddev=1.0)`)
and, for tied-embedding models (`logits_via_embedding: true`, `normalize_embedding_logits: false`
as in qwen3-0.6b.yml), projects the final RMS-normalized hidden state on that same table. At
init the residual stream is dominated by the input token's own embedding e (|e|^2 ~ D), so the
logit of "repeat the input token" is about sqrt(D) * |e| ~ D while the others are ~N(0, D): the
model is confidently wrong and the cross-entropy is ~0.7 * D rather than log(V) (44.6 for D=64,
V=256; see tests/test_maxtext.py, which measures it). That is MaxText's choice for pretraining
from scratch and irrelevant when loading a checkpoint; for a random-init GRPO run it makes the
first steps meaningless, so this adapter initializes with the native decoder's fan-in init
(embedding std 1/sqrt(D)) mapped into MaxText's layout: for the same seed both impls start from
the same weights, and the initial loss is ~log(V). `model.maxtext.native_init=False` keeps
MaxText's own init.

Tied embeddings: MaxText 0.2.5 rounds the tied embedding table to bfloat16 for the output
projection (layers/embeddings.py, `attend_on_embedding`) whatever `dtype` says, so a tied
MaxText policy's log-probs differ from the native sampler's (f32 head) by ~1e-3 (logged as
rollout/logprob_abs_diff_*; ~7e-4 mean on configs/tiny_maxtext.py). Untied models (Qwen3-4B and
up, e.g. qwen3-8b) match the native decoder to <= 1e-4 in f32.

Loading: `model.hf_path` streams an HF checkpoint through the native loader (models/hf.py) and
maps it on device into MaxText's layout (peak device memory: both copies, briefly);
`model.maxtext_checkpoint` restores a MaxText Orbax checkpoint (`.../<step>/items`, the
`{"params": {"params": ...}}` tree MaxText's trainer writes, scanned or unscanned, detected
from the stored shapes) straight into the sharded parameters.

Supported: Qwen3 dense (decoder_block qwen3). Llama 3 with impl=maxtext is refused with a clear
error (its MaxText RoPE layout is not yet parity-tested here).
"""
import dataclasses
import os
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding
from grpo_jax.models import hf
from grpo_jax.models import policy as policy_lib
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.logprobs import token_logprobs
from grpo_jax.models.transformer import Transformer
from grpo_jax.models.transformer import positions_from_mask

# (native per-layer path, MaxText per-layer path); qk-norm entries only when cfg.qk_norm.
LAYER_MAP = (
    (("attn_norm", "scale"), ("pre_self_attention_layer_norm", "scale")),
    (("mlp_norm", "scale"), ("post_self_attention_layer_norm", "scale")),
    (("attn", "q"), ("self_attention", "query", "kernel")),
    (("attn", "k"), ("self_attention", "key", "kernel")),
    (("attn", "v"), ("self_attention", "value", "kernel")),
    (("attn", "o"), ("self_attention", "out", "kernel")),
    (("attn", "q_norm", "scale"), ("self_attention", "query_norm", "scale")),
    (("attn", "k_norm", "scale"), ("self_attention", "key_norm", "scale")),
    (("mlp", "gate"), ("mlp", "wi_0", "kernel")),
    (("mlp", "up"), ("mlp", "wi_1", "kernel")),
    (("mlp", "down"), ("mlp", "wo", "kernel")),
)
GLOBAL_MAP = (
    (("embed",), ("token_embedder", "embedding")),
    (("final_norm", "scale"), ("decoder", "decoder_norm", "scale")),
    (("lm_head",), ("decoder", "logits_dense", "kernel")),
)


# ------------------------------------------------------------------------- weight mapping


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _set(tree, path, value):
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def _layer_entries(cfg: ModelConfig):
  return [(n, m) for n, m in LAYER_MAP if cfg.qk_norm or "norm" not in n[1]]


def _global_entries(cfg: ModelConfig):
  return [(n, m) for n, m in GLOBAL_MAP if n != ("lm_head",) or not cfg.tie_embeddings]


def _check_supported(cfg: ModelConfig):
  if cfg.arch != "qwen3":
    raise ValueError(
        f"model.impl=maxtext supports arch qwen3 only (got {cfg.arch!r}): use "
        "--config.model.impl=native for Llama 3")
  if cfg.attention_bias:
    raise ValueError("model.impl=maxtext: attention_bias=True has no MaxText qwen3 "
                              "counterpart; use model.impl=native")


def native_to_maxtext(native: dict, cfg: ModelConfig, *, scan_layers: bool,
                      scan_axis: int = 1) -> dict:
  """Native decoder params (pure dict, scanned or not per cfg.scan_layers) -> MaxText params."""
  _check_supported(cfg)
  out: dict = {}
  for n, m in _global_entries(cfg):
    _set(out, m, _get(native, n))
  for n, m in _layer_entries(cfg):
    if cfg.scan_layers:
      stacked = _get(native, ("layers", *n))  # [L, ...]
      per_layer = [stacked[i] for i in range(cfg.num_layers)]
    else:
      per_layer = [_get(native, ("layers", i, *n)) for i in range(cfg.num_layers)]
    if scan_layers:
      _set(out, ("decoder", "layers", *m), jnp.stack(per_layer, axis=scan_axis))
    else:
      for i, x in enumerate(per_layer):
        _set(out, ("decoder", f"layers_{i}", *m), x)
  return out


def maxtext_to_native(mt: dict, cfg: ModelConfig, *, scan_layers: bool,
                      scan_axis: int = 1) -> dict:
  """MaxText params (pure dict) -> native decoder params (scanned or not per cfg.scan_layers)."""
  _check_supported(cfg)
  out: dict = {}
  for n, m in _global_entries(cfg):
    _set(out, n, _get(mt, m))
  for n, m in _layer_entries(cfg):
    if scan_layers:
      stacked = _get(mt, ("decoder", "layers", *m))
      per_layer = [jnp.take(stacked, i, axis=scan_axis) for i in range(cfg.num_layers)]
    else:
      per_layer = [_get(mt, ("decoder", f"layers_{i}", *m)) for i in range(cfg.num_layers)]
    if cfg.scan_layers:
      _set(out, ("layers", *n), jnp.stack(per_layer, axis=0))
    else:
      for i, x in enumerate(per_layer):
        _set(out, ("layers", i, *n), x)
  return out


def maxtext_hf_names(cfg: ModelConfig, *, scan_layers: bool) -> dict[str, str]:
  """MaxText parameter path ("decoder/layers_3/mlp/wo/kernel") -> HF tensor name (per layer;
  with scan_layers the stacked path maps to the name with "{i}"). Shapes: see hf.param_mapping
  (native <-> HF); MaxText <-> native needs no reshapes."""
  by_native = {e.path: e.hf_name for e in hf.param_mapping(cfg)}
  out = {}
  for n, m in _global_entries(cfg):
    out["/".join(m)] = by_native[n]
  for n, m in _layer_entries(cfg):
    if scan_layers:
      out["/".join(("decoder", "layers", *m))] = by_native[n]
    else:
      for i in range(cfg.num_layers):
        out["/".join(("decoder", f"layers_{i}", *m))] = by_native[n].format(i=i)
  return out


def _fill_state(template: nnx.State, pure: dict) -> nnx.State:
  """A new State shaped like `template` holding the arrays of the pure dict `pure`."""
  state = jax.tree.map(lambda x: x, template)
  nnx.replace_by_pure_dict(state, pure)
  return state


# ------------------------------------------------------------------------- MaxText config


def _parse_overrides(text: str) -> dict[str, Any]:
  """"k=v,k2=v2" -> dict; values parsed as int / float / bool where they look like one."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    if "=" not in item:
      raise ValueError(f"model.maxtext.overrides: {item!r} is not key=value (e.g. "
                       "'decoder_layer_input=offload,mlpwo=remat')")
    k, v = (s.strip() for s in item.split("=", 1))
    low = v.lower()
    if low in ("true", "false"):
      out[k] = low == "true"
    else:
      for cast in (int, float):
        try:
          out[k] = cast(v)
          break
        except ValueError:
          continue
      else:
        out[k] = v
  return out


def maxtext_config(config, cfg: ModelConfig, mesh):
  """MaxText HyperParameters for our model shape, dtypes, remat and mesh sizes."""
  from maxtext.configs import pyconfig  # optional dependency

  _check_supported(cfg)
  mx = config.model.maxtext
  base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  kw = dict(
      model_name="qwen3-0.6b", override_model_config=True,  # the qwen3 block; shapes below
      base_emb_dim=cfg.hidden_size, base_num_query_heads=cfg.num_heads,
      base_num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
      base_mlp_dim=cfg.intermediate_size, base_num_decoder_layers=cfg.num_layers,
      vocab_size=cfg.vocab_size, normalization_layer_epsilon=cfg.rms_norm_eps,
      rope_max_timescale=int(cfg.rope_theta), use_qk_norm=cfg.qk_norm,
      logits_via_embedding=cfg.tie_embeddings, normalize_embedding_logits=False,
      dtype=cfg.dtype, weight_dtype=cfg.param_dtype, scan_layers=cfg.scan_layers,
      remat_policy=mx.remat_policy, attention=mx.attention,
      max_target_length=config.max_prompt_length + config.max_completion_length,
      ici_data_parallelism=mesh.shape[sharding.DATA],
      ici_fsdp_parallelism=mesh.shape[sharding.FSDP],
      ici_tensor_parallelism=mesh.shape[sharding.TENSOR],
      per_device_batch_size=1, enable_dropout=False, enable_checkpointing=False,
      skip_jax_distributed_system=True, run_name="grpo_jax", dataset_type="synthetic",
      base_output_directory="/tmp/grpo_jax_maxtext",
  )
  if jax.default_backend() == "cpu":
    kw["hardware"] = "cpu"
  kw.update(_parse_overrides(mx.overrides))
  return pyconfig.initialize(["", base], **kw)


def maxtext_mesh(mt_cfg, mesh):
  """MaxText's many-axis mesh over the same devices in the same order as our (data, fsdp, tensor)
  mesh: the extra axes have size 1, so our PartitionSpecs mean the same thing on it."""
  sizes = {sharding.DATA: mesh.shape[sharding.DATA], sharding.FSDP: mesh.shape[sharding.FSDP],
           sharding.TENSOR: mesh.shape[sharding.TENSOR]}
  names = tuple(mt_cfg.mesh_axes)
  missing = set(sizes) - set(names)
  if missing:
    raise ValueError(f"MaxText mesh_axes {names} lack {sorted(missing)}")
  shape = tuple(sizes.get(a, 1) for a in names)
  devices = np.asarray(mesh.devices).transpose(
      [list(mesh.axis_names).index(a) for a in sharding.MESH_AXES]).reshape(shape)
  return jax.sharding.Mesh(devices, names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(names))


# ------------------------------------------------------------------------------- policy


@dataclasses.dataclass
class MaxTextParts:
  """What the adapter built, for tests and tools."""
  mt_config: Any
  mesh: jax.sharding.Mesh
  graphdef: nnx.GraphDef
  rest: nnx.State  # non-parameter state (RNG streams), fixed
  abstract_params: nnx.State
  native_graphdef: nnx.GraphDef
  native_abstract: nnx.State
  native_cfg: ModelConfig


def build_parts(config, mesh, cfg: ModelConfig | None = None) -> MaxTextParts:
  from maxtext.utils import model_creation_utils  # optional dependency

  if cfg is None:
    cfg = _native_cfg(config)
  mt_cfg = maxtext_config(config, cfg, mesh)
  mt_mesh = maxtext_mesh(mt_cfg, mesh)
  _, abstract_model = model_creation_utils.create_nnx_abstract_model(mt_cfg, mesh=mt_mesh)
  graphdef, abstract_params, abstract_rest = nnx.split(abstract_model, nnx.Param, ...)

  def concrete(x):  # RNG streams: dropout is off and nothing is quantized, values unused
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.key(0)
    return jnp.zeros(x.shape, x.dtype)
  rest = jax.tree.map(concrete, abstract_rest)
  native_model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
  native_graphdef, native_abstract = nnx.split(native_model)
  return MaxTextParts(mt_cfg, mt_mesh, graphdef, rest, abstract_params, native_graphdef,
                      native_abstract, cfg)


def _native_cfg(config) -> ModelConfig:
  m = config.model
  if m.hf_path:
    return ModelConfig.from_hf_config(hf.read_hf_config(m.hf_path), dtype=m.dtype,
                                      param_dtype=m.param_dtype, remat_policy=m.remat_policy,
                                      scan_layers=m.scan_layers)
  return policy_lib.model_config_from(config)


def _shardings(abstract_state):
  return jax.tree.map(lambda x: x.sharding, abstract_state)


def _params_of(parts: MaxTextParts, make_pure_fn):
  """Runs `make_pure_fn() -> MaxText pure dict` under jit, straight into the param shardings."""
  out_sh = nnx.to_pure_dict(_shardings(parts.abstract_params))
  pure = jax.jit(make_pure_fn, out_shardings=out_sh)()
  return _fill_state(parts.abstract_params, pure)


def maxtext_policy(config, mesh, *, abstract: bool = False) -> policy_lib.Policy:
  """The Policy for `config.model.impl == "maxtext"` (see the module docstring)."""
  parts = build_parts(config, mesh)
  cfg, mx = parts.native_cfg, config.model.maxtext
  scan, scan_axis = cfg.scan_layers, parts.mt_config.param_scan_axis

  def to_native(mt_pure):
    return maxtext_to_native(mt_pure, cfg, scan_layers=scan, scan_axis=scan_axis)

  def to_maxtext(native_pure):
    return native_to_maxtext(native_pure, cfg, scan_layers=scan, scan_axis=scan_axis)

  m = config.model
  if abstract:
    params = parts.abstract_params
  elif m.maxtext_checkpoint:
    params = load_maxtext_checkpoint(m.maxtext_checkpoint, parts)
  elif m.hf_path:
    native = hf.load_hf(m.hf_path, jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype),
                        mesh=mesh, remat_policy=m.remat_policy, scan_layers=m.scan_layers)
    native_pure = nnx.to_pure_dict(nnx.state(native))
    params = _params_of(parts, lambda: to_maxtext(native_pure))
    del native, native_pure
  elif mx.native_init:
    seed = config.seed
    params = _params_of(parts, lambda: to_maxtext(nnx.to_pure_dict(nnx.state(
        Transformer(cfg, rngs=nnx.Rngs(params=seed))))))
  else:
    params = _maxtext_random_init(parts, config.seed)

  graphdef, rest = parts.graphdef, parts.rest

  def logprobs(params, input_ids, attention_mask, completion_len, temperature=1.0):
    logits = forward(graphdef, params, rest, input_ids, attention_mask)
    s = input_ids.shape[1]
    return token_logprobs(logits[:, s - completion_len - 1:s - 1],
                          input_ids[:, s - completion_len:], temperature)

  def rollout_params(params):
    return _fill_state(parts.native_abstract, to_native(nnx.to_pure_dict(params)))

  def save(params, path):
    native = jax.jit(rollout_params)(params)
    hf.save_hf(nnx.merge(parts.native_graphdef, native), path)

  shardings = _shardings(parts.abstract_params)
  return policy_lib.Policy(params=params, graphdef=graphdef, logprobs=logprobs,
                           rollout_params=rollout_params, sampler_graphdef=parts.native_graphdef,
                           model_config=cfg, save_hf=save, mesh=parts.mesh,
                           shardings=lambda mesh: shardings)


def forward(graphdef, params, rest, input_ids, attention_mask):
  """MaxText logits [B, S, V] (float32) for left-padded rows: positions from the mask, padding
  in its own segment (0) so real tokens (segment 1) never attend to it."""
  # Fresh Variables in this trace: MaxText's remat'd layers update their RNG counters in place.
  copy = lambda tree: jax.tree.map(lambda x: x, tree)  # noqa: E731
  model = nnx.merge(graphdef, copy(params), copy(rest))
  mask = attention_mask.astype(jnp.int32)
  logits = model(input_ids, positions_from_mask(mask), decoder_segment_ids=mask,
                 enable_dropout=False)
  return logits.astype(jnp.float32)


def _maxtext_random_init(parts: MaxTextParts, seed: int) -> nnx.State:
  """MaxText's own initializers (model.maxtext.native_init=False)."""
  from maxtext.utils import model_creation_utils

  def make():
    model = model_creation_utils.from_config(
        parts.mt_config, mesh=parts.mesh, rngs=nnx.Rngs(params=seed, dropout=seed + 1,
                                                        aqt=seed + 2))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return _params_of(parts, make)


# ----------------------------------------------------------------- MaxText checkpoints


def load_maxtext_checkpoint(path: str, parts: MaxTextParts) -> nnx.State:
  """Restores MaxText's Orbax parameter checkpoint (`.../<step>/items`, or its parent step
  folder) into the sharded MaxText params. The stored tree is MaxText's
  {"params": {"params": {"decoder": ..., "token_embedder": ...}}}; a checkpoint with scanned
  layers loads into an unscanned model (and vice versa) by restacking on the host."""
  import orbax.checkpoint as ocp

  if os.path.isdir(os.path.join(path, "items")):
    path = os.path.join(path, "items")
  if not os.path.isdir(path):
    raise FileNotFoundError(f"model.maxtext_checkpoint={path}: no such directory (expected "
                            "MaxText's <run>/checkpoints/<step>/items)")
  ckptr = ocp.PyTreeCheckpointer()
  meta = ckptr.metadata(path)
  tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
  tree = getattr(tree, "tree", tree)
  try:
    stored = tree["params"]["params"]
  except (KeyError, TypeError) as e:
    raise ValueError(f"{path}: not a MaxText parameter checkpoint (no params/params tree; "
                     f"top-level keys {list(tree)[:5]})") from e
  stored_scan = "layers" in stored["decoder"]
  cfg, axis = parts.native_cfg, parts.mt_config.param_scan_axis
  want = nnx.to_pure_dict(parts.abstract_params)
  model_scan = "layers" in want["decoder"]
  if stored_scan == model_scan:  # straight into the shardings
    target = {"params": {"params": want}}
    restored = ckptr.restore(path, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
    pure = restored["params"]["params"]
  else:
    logging.info("restacking %s layers of %s on the host",
                 "scanned" if stored_scan else "unscanned", path)
    host = ckptr.restore(path)["params"]["params"]
    native = maxtext_to_native(host, cfg.replace(scan_layers=False), scan_layers=stored_scan,
                               scan_axis=axis)
    pure_host = native_to_maxtext(native, cfg.replace(scan_layers=False),
                                  scan_layers=model_scan, scan_axis=axis)
    pure = jax.tree.map(lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding),
                        pure_host, want)
  _check_shapes(path, pure, want)
  return _fill_state(parts.abstract_params, pure)


def _check_shapes(path, got: dict, want: dict):
  for (k, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    if tuple(g.shape) != tuple(w.shape):
      raise ValueError(f"{path}: tensor {jax.tree_util.keystr(k)} has shape {tuple(g.shape)}, "
                       f"the model expects {tuple(w.shape)} (does the checkpoint match "
                       "config.model?)")
