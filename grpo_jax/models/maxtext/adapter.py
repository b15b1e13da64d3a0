"""A MaxText model as the GRPO policy: `maxtext_policy(config, mesh)` -> models.policy.Policy.

With `config.model.impl = "maxtext"` the trained policy (and the reference copy) is MaxText's NNX
`Transformer`, built by MaxText's own `pyconfig` from our config.model block, so its layers,
remat policies (`model.maxtext.remat_policy`, per-tensor `remat|device|offload` through
`model.maxtext.overrides`), scanned layers and attention kernels are MaxText's. The loop sees
the usual Policy interface:

  logprobs(params, ids, mask, C, temperature)  MaxText forward with positions = cumsum(mask) - 1
                                               and decoder_segment_ids = mask, so a real token
                                               never attends to left padding (segment 1 vs 0);
  rollout_params(params)                       the same weights in the native decoder's layout,
                                               for the jitted native sampler and the vLLM sync
                                               (which then goes native -> HF names, models/decoder/hf.py);
  sampler_is_trainer=False                     the sampler runs the native decoder, not this
                                               program, so the loop measures the mismatch.

The weight mapping (native <-> MaxText <-> HF, scanned or not) lives in models/maxtext/mapping.py,
which needs no MaxText; its names are re-exported here.

Mesh. MaxText shards over its own many-axis mesh. `make_mesh(config, base_mesh)` (called by
models/build.py) lays our (data, fsdp, tensor) mesh out as MaxText's: the same devices in the
same order, MaxText's other axes of size 1, so our PartitionSpecs mean the same thing on it and
the loop, the sampler and this policy share one mesh. `maxtext_policy` accepts that mesh or a
plain (data, fsdp, tensor) one (converted the same way); the params live on the MaxText mesh.

Initialization. MaxText initializes the token embedding N(0, 1) (models.py: `normal(stddev=1.0)`)
and, for tied-embedding models (`logits_via_embedding: true`, `normalize_embedding_logits: false`
as in qwen3-0.6b.yml), projects the final RMS-normalized hidden state on that same table. At
init the residual stream is dominated by the input token's own embedding e (|e|^2 ~ D), so the
logit of "repeat the input token" is about sqrt(D) * |e| ~ D while the others are ~N(0, D): the
model is confidently wrong and the cross-entropy is ~0.7 * D rather than log(V) (44.6 for D=64,
V=256; see tests/models/test_maxtext.py, which measures it). That is MaxText's choice for pretraining
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

Loading: `model.hf_path` streams an HF checkpoint through the native loader (models/decoder/hf.py) and
maps it on device into MaxText's layout (peak device memory: both copies, briefly);
`model.maxtext_checkpoint` restores a MaxText Orbax checkpoint (`.../<step>/items`, the
`{"params": {"params": ...}}` tree MaxText's trainer writes, scanned or unscanned, detected
from the stored shapes) straight into the sharded parameters.

Supported: Qwen3 dense, Llama 3 / 3.1, Gemma 2 and Gemma 3 (text), each as the MaxText decoder
block of its family (family_kwargs); maxtext_mapping.check_supported names what each needs.
MaxText is imported inside the functions that need it (through `import_maxtext`), so this module
(and ATTENTION_KERNELS, which the config validator reads) imports without it.

qwix 0.1.2 (tpu-inference 0.32.0's exact pin, the vLLM-TPU install) lacks two modules MaxText
0.2.2-0.2.5 import at module level for weight sparsity, a feature of its fp8 quantization
(`qwix._src.core.sparsity` in layers/quantizations.py, `qwix.contrib.sparsity` in layers/moe.py),
and MaxText 0.2.0-0.2.1 need tensorflow to import at all. `import_maxtext` therefore registers
placeholders for exactly those two modules when the installed qwix lacks them: MaxText's model
code imports, and nothing grpo_jax builds touches them (no quantization, dense layers); code
that does use them (weight sparsity turned on through `model.maxtext.overrides`) gets an
ImportError naming the cause from the placeholder. With a qwix that has them (0.1.8 in the main
test venv) nothing is replaced.
"""

import contextlib
import dataclasses
import importlib
import importlib.util
import logging as std_logging
import os
import sys
import types
from typing import Any

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf
from grpo_jax.models import policy as policy_lib
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.kernels import Kernels
from grpo_jax.models.logprobs import head_slot_mask
from grpo_jax.models.logprobs import token_logprobs
from grpo_jax.run import console

# The mapping, re-exported: callers and tests use it as maxtext_adapter.<name>.
from grpo_jax.models.maxtext.mapping import check_supported
from grpo_jax.models.maxtext.mapping import GLOBAL_MAP  # noqa: F401
from grpo_jax.models.maxtext.mapping import LAYER_MAP  # noqa: F401
from grpo_jax.models.maxtext.mapping import maxtext_hf_names  # noqa: F401
from grpo_jax.models.maxtext.mapping import maxtext_to_native
from grpo_jax.models.maxtext.mapping import native_to_maxtext
from grpo_jax.models.decoder.transformer import Transformer
from grpo_jax.models.decoder.transformer import positions_from_mask

# MaxText's `attention` kernels that model.maxtext.attention may name (configuration.py).
ATTENTION_KERNELS = ("dot_product", "flash", "cudnn_flash_te", "autoselected")

# The qwix modules MaxText 0.2.5 imports for weight sparsity only (see the module docstring).
QWIX_SPARSITY_MODULES = ("qwix._src.core.sparsity", "qwix.contrib.sparsity.sparsity_module")


def import_maxtext(name: str):
  """`importlib.import_module(name)` for a maxtext module, after `_qwix_placeholders()`."""
  _qwix_placeholders()
  with _quiet_transformers_configs():
    return importlib.import_module(name)


@contextlib.contextmanager
def _quiet_transformers_configs():
  """MaxText's import builds HF configs of models grpo_jax never runs (DeepSeek V3.2 and V4, in
  maxtext/checkpoint_conversion/utils/hf_model_configs.py), and transformers warns about each
  one's RoPE fields: those warnings are dropped during the import unless --verbose
  (run/console.py)."""
  logger = std_logging.getLogger("transformers.configuration_utils")
  level = logger.level
  if not console.verbose():
    logger.setLevel(std_logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _qwix_placeholders():
  """Registers a placeholder for each of QWIX_SPARSITY_MODULES (and each package above it) that
  the installed qwix lacks, as an attribute of its parent too, as an import would."""
  if importlib.util.find_spec("qwix") is None:
    return  # MaxText's own import then names the missing package
  for name in QWIX_SPARSITY_MODULES:
    parts = name.split(".")
    for i in range(2, len(parts) + 1):
      prefix = ".".join(parts[:i])
      if prefix in sys.modules:
        continue
      try:
        importlib.import_module(prefix)
      except ImportError:
        sys.modules[prefix] = _placeholder(prefix)
        setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], sys.modules[prefix])


def _placeholder(name: str) -> types.ModuleType:
  from importlib import metadata

  why = (
      f"{name} is absent from the installed qwix {metadata.version('qwix')} (tpu-inference "
      "pins qwix 0.1.2); MaxText uses it only for weight sparsity with fp8 quantization, "
      "which this qwix cannot run. Fix: drop the weight_sparsity_* / quantization settings "
      "from model.maxtext.overrides, or use a qwix that has it (the main venv's 0.1.8)"
  )
  module = types.ModuleType(name, why)
  module.__path__ = []  # a package, so a placeholder below it can be imported from it
  module.PLACEHOLDER = True

  def __getattr__(attr):
    if attr.startswith("__"):
      raise AttributeError(attr)
    raise ImportError(f"{name}.{attr}: {why}")

  module.__getattr__ = __getattr__
  return module


# ------------------------------------------------------------------------- MaxText config


def _parse_overrides(text: str) -> dict[str, Any]:
  """ "k=v,k2=v2" -> dict; values parsed as int / float / bool where they look like one."""
  out = {}
  for item in filter(None, (s.strip() for s in text.split(","))):
    if "=" not in item:
      raise ValueError(
          f"model.maxtext.overrides: {item!r} is not key=value (e.g. "
          "'decoder_layer_input=offload,mlpwo=remat')"
      )
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
  pyconfig = import_maxtext("maxtext.configs.pyconfig")  # optional dependency

  check_supported(cfg)
  if not set(sharding.MESH_AXES) <= set(mesh.axis_names):
    raise ValueError(
        f"mesh axes {mesh.axis_names} lack some of {sharding.MESH_AXES}: build "
        "the mesh with models.build.make_mesh"
    )
  mx = config.model.maxtext
  base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  kw = dict(
      override_model_config=True,  # the family's block (family_kwargs); our shapes below
      base_emb_dim=cfg.hidden_size,
      base_num_query_heads=cfg.num_heads,
      base_num_kv_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim,
      base_mlp_dim=cfg.intermediate_size,
      base_num_decoder_layers=cfg.num_layers,
      vocab_size=cfg.vocab_size,
      normalization_layer_epsilon=cfg.rms_norm_eps,
      rope_max_timescale=int(cfg.rope_theta),
      use_qk_norm=cfg.qk_norm,
      logits_via_embedding=cfg.tie_embeddings,
      normalize_embedding_logits=False,
      dtype=cfg.dtype,
      weight_dtype=cfg.param_dtype,
      scan_layers=cfg.scan_layers,
      remat_policy=mx.remat_policy,
      attention=mx.attention,
      max_target_length=config.max_prompt_length + config.max_completion_length,
      ici_data_parallelism=mesh.shape[sharding.DATA],
      ici_fsdp_parallelism=mesh.shape[sharding.FSDP],
      ici_tensor_parallelism=mesh.shape[sharding.TENSOR],
      per_device_batch_size=1,
      enable_dropout=False,
      enable_checkpointing=False,
      skip_jax_distributed_system=True,
      run_name="grpo_jax",
      dataset_type="synthetic",
      base_output_directory="/tmp/grpo_jax_maxtext",
      log_config=console.verbose(),  # MaxText's 1,700+ "Config param" lines: with --verbose
  )
  kw.update(family_kwargs(cfg))
  if jax.default_backend() == "cpu":
    kw["hardware"] = "cpu"
  kw.update(_parse_overrides(mx.overrides))
  return pyconfig.initialize(["", base], **kw)


def family_kwargs(cfg: ModelConfig) -> dict[str, Any]:
  """The pyconfig values that pick and shape MaxText's decoder block for cfg's family (see
  models/maxtext/mapping.py for each block's layout; check_supported has refused the rest).
  model_name picks the block's fixed choices: Llama 3.1's interleaved RoPE (by the name), Gemma
  3's query scale (head_dim ** -0.5 for gemma3-4b, (D / H) ** -0.5 for gemma3-27b)."""
  if cfg.arch == "qwen3":
    return dict(model_name="qwen3-0.6b")
  if cfg.arch == "llama3":
    return dict(
        model_name="llama3.1-8b", rope_type="llama3.1", rope_use_scale=bool(cfg.rope_scaling_factor)
    )
  gemma = dict(
      sliding_window_size=cfg.sliding_window,
      use_post_attn_norm=True,
      normalize_embedding_logits=True,  # tied head / sqrt(D): see mapping.embed_scale
      use_post_ffw_norm=True,
      mlp_activations=["gelu", "linear"],
      attn_logits_soft_cap=cfg.attn_logit_softcap,
      final_logits_soft_cap=cfg.final_logit_softcap,
  )
  if cfg.arch == "gemma2":  # one MaxText layer = a (local, global) pair
    return dict(gemma, model_name="gemma2-2b", base_num_decoder_layers=cfg.num_layers // 2)
  scale = cfg.query_pre_attn_scalar or cfg.head_dim
  return dict(
      gemma,
      model_name="gemma3-4b" if scale == cfg.head_dim else "gemma3-27b",
      local_rope_max_timescale=int(cfg.rope_local_theta or cfg.rope_theta),
      rope_linear_scaling_factor=cfg.rope_linear_factor,
      use_qk_norm=True,
  )


def make_mesh(config, base_mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """MaxText's many-axis mesh for `config` over `base_mesh`'s devices (models/build.py)."""
  return maxtext_mesh(maxtext_config(config, _native_cfg(config), base_mesh), base_mesh)


def maxtext_mesh(mt_cfg, mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """MaxText's many-axis mesh over the same devices in the same order as our (data, fsdp, tensor)
  mesh: the extra axes have size 1, so our PartitionSpecs mean the same thing on it. A mesh that
  already has MaxText's axes (from make_mesh) is returned as is."""
  names = tuple(mt_cfg.mesh_axes)
  if tuple(mesh.axis_names) == names:
    _check_extra_axes(mesh)
    return mesh
  if set(mesh.axis_names) != set(sharding.MESH_AXES):
    raise ValueError(
        f"mesh axes {mesh.axis_names}: expected {sharding.MESH_AXES} (from "
        f"sharding.make_mesh) or MaxText's {names} (from build.make_mesh)"
    )
  missing = set(sharding.MESH_AXES) - set(names)
  if missing:
    raise ValueError(f"MaxText mesh_axes {names} lack {sorted(missing)}")
  ours = [a for a in names if a in sharding.MESH_AXES]  # our axes in MaxText's order
  devices = np.asarray(mesh.devices).transpose([mesh.axis_names.index(a) for a in ours])
  devices = devices.reshape(tuple(mesh.shape.get(a, 1) for a in names))
  return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _check_extra_axes(mesh: jax.sharding.Mesh):
  """maxtext_config reads only the data/fsdp/tensor sizes; any other axis must be trivial."""
  extra = {a: n for a, n in mesh.shape.items() if a not in sharding.MESH_AXES and n != 1}
  if extra:
    raise ValueError(
        f"MaxText mesh axes {extra} have size > 1: only data, fsdp and tensor "
        "(config.mesh) may shard"
    )


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
  """MaxText's abstract model for `config` on `mesh` (ours or MaxText's; see maxtext_mesh)."""
  model_creation_utils = import_maxtext("maxtext.utils.model_creation_utils")  # optional

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
  kernels = Kernels.for_mesh(cfg, mesh)
  native_model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0), kernels=kernels))
  native_graphdef, native_abstract = nnx.split(native_model)
  return MaxTextParts(
      mt_cfg, mt_mesh, graphdef, rest, abstract_params, native_graphdef, native_abstract, cfg
  )


def _native_cfg(config) -> ModelConfig:
  m = config.model
  if m.hf_path:
    return ModelConfig.from_hf_config(
        hf.read_hf_config(m.hf_path),
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        remat_policy=m.remat_policy,
        scan_layers=m.scan_layers,
        attention_impl=m.attention_impl,
    )
  return policy_lib.model_config_from(config)


def _fill_state(template: nnx.State, pure: dict) -> nnx.State:
  """A new State shaped like `template` holding the arrays of the pure dict `pure`."""
  state = jax.tree.map(lambda x: x, template)
  nnx.replace_by_pure_dict(state, pure)
  return state


def _shardings(abstract_state):
  return jax.tree.map(lambda x: x.sharding, abstract_state)


def _params_of(parts: MaxTextParts, make_pure_fn):
  """Runs `make_pure_fn() -> MaxText pure dict` under jit, straight into the param shardings."""
  out_sh = nnx.to_pure_dict(_shardings(parts.abstract_params))
  pure = jax.jit(make_pure_fn, out_shardings=out_sh)()
  return _fill_state(parts.abstract_params, pure)


def maxtext_policy(config, mesh, *, abstract: bool = False) -> policy_lib.Policy:
  """The Policy for `config.model.impl == "maxtext"` (see the module docstring). `mesh` is
  build.make_mesh's (or a plain data/fsdp/tensor one); the params live on MaxText's mesh."""
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
    native = hf.load_hf(
        m.hf_path,
        jnp.dtype(m.dtype),
        param_dtype=jnp.dtype(m.param_dtype),
        mesh=parts.mesh,
        remat_policy=m.remat_policy,
        scan_layers=m.scan_layers,
        attention_impl=m.attention_impl,
    )
    native_pure = nnx.to_pure_dict(nnx.state(native))
    params = _params_of(parts, lambda: to_maxtext(native_pure))
    del native, native_pure
  elif mx.native_init:
    seed = config.seed
    params = _params_of(
        parts,
        lambda: to_maxtext(
            nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(params=seed))))
        ),
    )
  else:
    params = _maxtext_random_init(parts, config.seed)

  graphdef, rest = parts.graphdef, parts.rest

  def logprobs(params, input_ids, attention_mask, completion_len, temperature=1.0):
    logits = forward(graphdef, params, rest, input_ids, attention_mask)
    s = input_ids.shape[1]
    return token_logprobs(
        logits[:, s - completion_len - 1 : s - 1], input_ids[:, s - completion_len :], temperature
    )

  def packed(params, input_ids, segment_ids, positions, head_slots, temperature=1.0, shards=1):
    """Packed rows (rl/packing.py): MaxText's own segment ids and positions (as its pre-training
    packs), every slot's log-prob from the slot before it, kept at the head's slots."""
    model = _merged(graphdef, params, rest)
    logits = model(input_ids, positions, decoder_segment_ids=segment_ids, enable_dropout=False)
    logp = token_logprobs(logits[:, :-1].astype(jnp.float32), input_ids[:, 1:], temperature)
    logp = jnp.pad(logp, ((0, 0), (1, 0)))  # slot 0 starts a sequence: never a head slot
    return logp * head_slot_mask(head_slots, *input_ids.shape, shards)

  def rollout_params(params):
    return _fill_state(parts.native_abstract, to_native(nnx.to_pure_dict(params)))

  def save(params, path):
    native = jax.jit(rollout_params)(params)
    hf.save_hf(nnx.merge(parts.native_graphdef, native), path)

  shardings = _shardings(parts.abstract_params)
  return policy_lib.Policy(
      params=params,
      graphdef=graphdef,
      logprobs=logprobs,
      packed_logprobs=packed,
      rollout_params=rollout_params,
      sampler_graphdef=parts.native_graphdef,
      model_config=cfg,
      save_hf=save,
      sampler_is_trainer=False,
      shardings=lambda mesh: shardings,
  )


def forward(graphdef, params, rest, input_ids, attention_mask):
  """MaxText logits [B, S, V] (float32) for left-padded rows: positions from the mask, padding
  in its own segment (0) so real tokens (segment 1) never attend to it."""
  model = _merged(graphdef, params, rest)
  mask = attention_mask.astype(jnp.int32)
  logits = model(
      input_ids, positions_from_mask(mask), decoder_segment_ids=mask, enable_dropout=False
  )
  return logits.astype(jnp.float32)


def _merged(graphdef, params, rest):
  """The MaxText model for one trace: fresh Variables (MaxText's remat'd layers update their RNG
  counters in place)."""
  copy = lambda tree: jax.tree.map(lambda x: x, tree)  # noqa: E731
  return nnx.merge(graphdef, copy(params), copy(rest))


def _maxtext_random_init(parts: MaxTextParts, seed: int) -> nnx.State:
  """MaxText's own initializers (model.maxtext.native_init=False)."""
  model_creation_utils = import_maxtext("maxtext.utils.model_creation_utils")

  def make():
    model = model_creation_utils.from_config(
        parts.mt_config, mesh=parts.mesh, rngs=nnx.Rngs(params=seed, dropout=seed + 1, aqt=seed + 2)
    )
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))

  return _params_of(parts, make)


# ----------------------------------------------------------------- MaxText checkpoints


def load_maxtext_checkpoint(path: str, parts: MaxTextParts) -> nnx.State:
  """Restores MaxText's Orbax parameter checkpoint (`.../<step>/items`, or its parent step
  folder) into the sharded MaxText params. The stored tree is MaxText's
  {"params": {"params": {"decoder": ..., "token_embedder": ...}}}; a checkpoint with scanned
  layers loads into an unscanned model (and vice versa) by restacking on the host."""
  import orbax.checkpoint as ocp

  from grpo_jax.run import paths

  if (paths.path(path) / "items").is_dir():
    path = os.fspath(paths.path(path) / "items")
  if not paths.isdir(path):
    raise FileNotFoundError(
        f"model.maxtext_checkpoint={path}: no such directory (expected "
        "MaxText's <run>/checkpoints/<step>/items)"
    )
  ckptr = ocp.PyTreeCheckpointer()
  why = ""
  try:
    meta = ckptr.metadata(path)
  except (FileNotFoundError, ValueError) as e:
    meta, why = None, f" ({' '.join(str(e).split())[:200]})"
  tree = meta.item_metadata if hasattr(meta, "item_metadata") else meta
  tree = getattr(tree, "tree", tree)
  if tree is None:
    raise FileNotFoundError(
        f"model.maxtext_checkpoint={path}: no Orbax checkpoint there{why}. Fix: point at "
        "MaxText's <run>/checkpoints/<step>/items (or the <step> folder above it)"
    )
  try:
    stored = tree["params"]["params"]
  except (KeyError, TypeError) as e:
    raise ValueError(
        f"{path}: not a MaxText parameter checkpoint (no params/params tree; "
        f"top-level keys {list(tree)[:5]})"
    ) from e
  stored_scan = "layers" in stored["decoder"]
  cfg, axis = parts.native_cfg, parts.mt_config.param_scan_axis
  want = nnx.to_pure_dict(parts.abstract_params)
  model_scan = "layers" in want["decoder"]
  if stored_scan == model_scan:  # straight into the shardings
    target = {"params": {"params": want}}
    restored = ckptr.restore(
        path,
        args=ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        ),
    )
    pure = restored["params"]["params"]
  else:
    logging.info(
        "restacking %s layers of %s on the host", "scanned" if stored_scan else "unscanned", path
    )
    host = ckptr.restore(path)["params"]["params"]
    native = maxtext_to_native(
        host, cfg.replace(scan_layers=False), scan_layers=stored_scan, scan_axis=axis
    )
    pure_host = native_to_maxtext(
        native, cfg.replace(scan_layers=False), scan_layers=model_scan, scan_axis=axis
    )
    pure = jax.tree.map(
        lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding), pure_host, want
    )
  _check_shapes(path, pure, want)
  return _fill_state(parts.abstract_params, pure)


def _check_shapes(path, got: dict, want: dict):
  for (k, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    if tuple(g.shape) != tuple(w.shape):
      raise ValueError(
          f"{path}: tensor {jax.tree_util.keystr(k)} has shape {tuple(g.shape)}, "
          f"the model expects {tuple(w.shape)} (does the checkpoint match "
          "config.model?)"
      )
