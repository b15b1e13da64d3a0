"""LoRA adapters on the native decoder, optionally over a quantized frozen base (QLoRA-style).

    policy = lora_policy.lora_policy(config, mesh)  # models/lora/policy.py; make_policy
                                                    # does this when config.lora.rank > 0

What is stored. Each targeted projection weight W of a layer (`config.lora.target_modules`, a
regex over the paths `candidate_paths` lists: layers/<i>/attn/{q,k,v,o}, layers/<i>/mlp/{gate,up,
down}) gets two `nnx.LoRAParam`s beside it on the same module, named as qwix names them:
  W_lora_a [in..., r]     W's input (contracted) dims, then the rank     (init: he-uniform, qwix's)
  W_lora_b [r, out...]    the rank, then W's output dims                  (init: zeros)
(with model.scan_layers the layer axis leads both). Their logical axes are W's with None for the
rank, so on any mesh an adapter is sharded like the rows/columns of the weight it adapts and the
rank axis is replicated. With `quantize_base` (int8 / int4, weight-only, through qwix's QArray),
every projection weight of the base holds the integer values and a `QuantScale` beside it
(`W_qscale`, per output channel).

Mixture of experts (models/decoder/moe.py). On a routed layer the paths layers/<i>/mlp/{gate,up,
down} name the experts' weights, gate/up [E, D, F] and down [E, F, D]; each expert gets its own
adapter, the experts axis leading like a batch axis: A [E, in, r], B [E, r, out] (with the layer
axis first under scan_layers), W_eff[e] = W[e] + (alpha / r) A[e] @ B[e], logical axes W's
(experts, embed | moe_mlp) so an expert's adapter lives on the devices that hold its weight. A
quantized base is quantized per expert and output channel (scales [E, 1, out]). The default
target_modules thus reaches attention + experts on routed layers and attention + the dense MLP on
a mixed model's dense layers (mlp_only_layers / decoder_sparse_step). The router [D, E] is never
adapted (not a candidate path) and never quantized: it stays the frozen base's, so a token's
experts change only through its input, which the adapted layers below it move.

How it runs. `adapt(block)` (called by the decoder for every layer, models/decoder/transformer.py) turns
each weight into the one the layer should use, W_eff = dequantize(W) + (alpha / r) * A @ B, inside
the layer (under scan and remat): one layer's effective weights exist at a time, never a float
copy of the whole model. Costs of this merged form: the backward forms the full-size gradient of
W_eff before reducing it to A and B (about one more GEMM per adapted weight), and with bf16
compute W_eff is rounded to bf16 like any weight, so the forward sees the adapters' delta
dithered by W's rounding (A and B themselves stay f32 and accumulate exactly; per element a
delta below half of W's bf16 ulp is invisible, over many elements the mean effect is kept).
Modules without adapters or scales are left alone, so the reference is
the same program on the same base arrays with the adapters left out of the state (`base_of`): no
second copy of the weights. The optimizer sees only the LoRAParams (`split`).

Why not qwix's LoRA provider (qwix.LoraProvider / apply_lora_to_model): it intercepts
dot_general/einsum inside ONE method of an NNX model and creates the adapters on an eager first
call; our decoder scans over layers (params cannot be created inside lax.scan), runs training,
prefill and decode through three methods, concatenates gate/up into one GEMM and runs SwiGLU as a
custom VJP (qwix's `find_param` cannot trace those weights back to their Param and silently skips
them), and reshapes q/k/v [D, H, K] -> [D, H*K] (qwix's PTQ `WithAux.reshape` refuses that).
qwix supplies the quantization (`qarray.quantize` / `qwix.dequantize`, in qwix 0.1.2 and 0.1.8)
and the parameter naming and types follow its provider.
"""

import dataclasses
import importlib.util
import math
import re

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.moe import MoE
from grpo_jax.parallel import sharding

# Projection weights that can carry adapters, with how many dims of W (after the layers and
# experts axes) are its input dims.
PROJECTIONS = {
    ("attn", "q"): 1,
    ("attn", "k"): 1,
    ("attn", "v"): 1,
    ("attn", "o"): 2,
    ("mlp", "gate"): 1,
    ("mlp", "up"): 1,
    ("mlp", "down"): 1,
}
# An MoE layer's weights with a leading experts axis (an adapter per expert).
EXPERT_WEIGHTS = ("gate", "up", "down")
DEFAULT_TARGETS = r"layers/\d+/(attn/(q|k|v|o)|mlp/(gate|up|down))"
QUANTIZE_BASE = ("none", "int8", "int4")
# qwix quantizes the base; the core install lacks it (the maxtext extra brings it).
QWIX_FIX = (
    "needs qwix, which the core install does not include. Fix: pip install qwix -c "
    "requirements/constraints.txt (or the maxtext extra: pip install -e '.[maxtext]' -c "
    "requirements/constraints.txt), or --config.lora.quantize_base=none"
)
B_INITS = ("zeros", "normal")
# PEFT / transformers module names of the projections (model.layers.<i>.<name>).
HF_MODULES = {
    ("attn", "q"): "self_attn.q_proj",
    ("attn", "k"): "self_attn.k_proj",
    ("attn", "v"): "self_attn.v_proj",
    ("attn", "o"): "self_attn.o_proj",
    ("mlp", "gate"): "mlp.gate_proj",
    ("mlp", "up"): "mlp.up_proj",
    ("mlp", "down"): "mlp.down_proj",
}


class QuantScale(nnx.Variable):
  """The per-output-channel scales of a quantized base weight (frozen, not a Param)."""


# ------------------------------------------------------------------------------- targets


def candidate_paths(num_layers: int) -> list[str]:
  """Every weight path target_modules can match, e.g. "layers/0/attn/q"."""
  return [f"layers/{i}/{m}/{w}" for i in range(num_layers) for m, w in PROJECTIONS]


def targets(num_layers: int, regex: str) -> list[tuple[int, str, str]]:
  """(layer, module, weight) of every projection whose path `regex` fully matches."""
  pat = re.compile(regex)
  return [
      (i, m, w)
      for i in range(num_layers)
      for m, w in PROJECTIONS
      if pat.fullmatch(f"layers/{i}/{m}/{w}")
  ]


def problems(config) -> list[str]:
  """One line per bad config.lora field (value, why, fix); [] when LoRA is off or valid."""
  lc, m = config.lora, config.model
  if lc.rank == 0:
    return []
  out = []
  if lc.rank < 0:
    out.append(f"lora.rank={lc.rank}: must be >= 0 (0 = LoRA off)")
  if m.impl != "native" or m.family != "decoder":
    out.append(
        f"lora.rank={lc.rank} with model.impl={m.impl!r}, model.family={m.family!r}: "
        "adapters are built for the native decoder only (MaxText's layers and T5 have no "
        "hook). Fix: --config.lora.rank=0 (full fine-tuning)"
        + (
            ", or --config.model.impl=native"
            if m.impl != "native" and m.family == "decoder"
            else ""
        )
    )
  if lc.alpha <= 0:
    out.append(f"lora.alpha={lc.alpha}: must be > 0 (the update is scaled by alpha / rank)")
  if lc.dropout != 0:
    out.append(
        f"lora.dropout={lc.dropout}: not supported (adapters are merged into each layer's "
        "weights inside the forward, where there is no per-token input to drop). Fix: 0"
    )
  if lc.init not in B_INITS:
    out.append(f"lora.init={lc.init!r}: the B matrix's init is one of {', '.join(B_INITS)}")
  if lc.quantize_base not in QUANTIZE_BASE:
    out.append(f"lora.quantize_base={lc.quantize_base!r}: use one of {', '.join(QUANTIZE_BASE)}")
  elif lc.quantize_base != "none" and config.sft_steps > 0:
    out.append(
        f"lora.quantize_base={lc.quantize_base!r} with sft_steps={config.sft_steps}: SFT "
        "trains the full model and a quantized base cannot be trained. Fix: "
        "--config.sft_steps=0 (start from an SFT'd model.hf_path)"
    )
  if lc.quantize_base in QUANTIZE_BASE[1:] and importlib.util.find_spec("qwix") is None:
    out.append(f"lora.quantize_base={lc.quantize_base!r} {QWIX_FIX}")
  try:
    found = targets(m.num_layers, lc.target_modules)
  except re.error as e:
    return out + [f"lora.target_modules={lc.target_modules!r} is not a regex: {e}"]
  if not found:
    some = candidate_paths(m.num_layers)
    out.append(
        f"lora.target_modules={lc.target_modules!r} matches no weight. It is matched in "
        f"full against paths like {', '.join(some[:7])} (layers 0..{m.num_layers - 1})"
    )
  if m.scan_layers:
    for mw in PROJECTIONS:
      layers = [i for i, *t in found if tuple(t) == mw]
      if layers and len(layers) != m.num_layers:
        out.append(
            f"lora.target_modules={lc.target_modules!r} matches {'/'.join(mw)} in "
            f"{len(layers)} of {m.num_layers} layers: with model.scan_layers the adapters "
            "are stacked over layers. Fix: target every layer, or scan_layers=False"
        )
  mcfg = model_config(m)
  for moe, mw in sorted({(mcfg.layer_is_moe(i), tuple(t)) for i, *t in found}):
    d_in, d_out = _dims(mcfg, moe)[mw]
    if lc.rank > min(d_in, d_out):
      out.append(
          f"lora.rank={lc.rank} > min(d_in, d_out) = min({d_in}, {d_out}) of "
          f"{'/'.join(mw)}{' (an expert)' if moe and mw[0] == 'mlp' else ''}: a rank past the "
          f"smaller side adds no capacity. Fix: lora.rank <= {min(d_in, d_out)}"
      )
  if config.reference.refresh_every_steps:
    out.append(
        "lora with reference.refresh_every_steps > 0: the reference is the frozen base "
        "itself. Fix: --config.reference.refresh_every_steps=0"
    )
  if config.reference.offload_to_host:
    out.append(
        "lora with reference.offload_to_host: the reference is the base the policy "
        "runs on, there is no copy to offload. Fix: reference.offload_to_host=False"
    )
  return out


def model_config(m) -> ModelConfig:
  """The decoder's shape from a config.model block (which layers are routed, their widths)."""
  return ModelConfig(**{f.name: m[f.name] for f in dataclasses.fields(ModelConfig)})


def expert_targets(config) -> list[int]:
  """The layers whose experts (an MoE layer's mlp/{gate,up,down}) target_modules adapts."""
  mcfg = model_config(config.model)
  return sorted(
      {
          i
          for i, m, _ in targets(mcfg.num_layers, config.lora.target_modules)
          if m == "mlp" and mcfg.layer_is_moe(i)
      }
  )


def _dims(m: ModelConfig, moe: bool) -> dict:
  """(d_in, d_out) of each projection of a dense layer, or of one expert of a routed layer."""
  h, g, k, d = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size
  f = m.moe_intermediate_size if moe else m.intermediate_size
  return {
      ("attn", "q"): (d, h * k),
      ("attn", "k"): (d, g * k),
      ("attn", "v"): (d, g * k),
      ("attn", "o"): (h * k, d),
      ("mlp", "gate"): (d, f),
      ("mlp", "up"): (d, f),
      ("mlp", "down"): (f, d),
  }


# --------------------------------------------------------------------------- the forward


def experts_axis(module, name: str) -> int:
  """1 when weight `name` of `module` is an MoE layer's expert weight ([E, in, out]: an adapter
  and a quantization scale per expert), else 0."""
  return int(isinstance(module, MoE) and name in EXPERT_WEIGHTS)


def effective_weight(module, name: str, stacked: bool = False):
  """The weight `name` of `module` as its layer should use it: dequantized, adapters added.
  None when it has neither (the stored weight is used as is). `stacked`: the module holds
  every layer (scan_layers, outside the scan) on a leading axis. An MoE layer's expert weight
  merges per expert: W[e] + (alpha / r) A[e] . B[e]."""
  scale = getattr(module, f"{name}_qscale", None)
  a = getattr(module, f"{name}_lora_a", None)
  if scale is None and a is None:
    return None
  w = getattr(module, name)[...]
  if scale is not None:
    w = _dequantize(w, scale[...])
  if a is not None:
    b = getattr(module, f"{name}_lora_b")[...]
    ab = lambda a, b: jnp.tensordot(a, b, axes=1)  # [in..., r] . [r, out...] -> W's shape
    for _ in range(int(stacked) + experts_axis(module, name)):  # layers, experts: batch axes
      ab = jax.vmap(ab)
    delta = ab(a[...], b)
    w = w + (module.lora_scale * delta).astype(w.dtype)
  return w


def adapt(block):
  """Replaces every adapted or quantized weight of one decoder layer (a module merged inside the
  layer function) by its effective value; a no-op on a plain layer. Returns `block`."""
  for _, module in nnx.iter_modules(block):
    for _, name in PROJECTIONS:
      if hasattr(module, name):
        w = effective_weight(module, name)
        if w is not None:  # a new Variable: the merged one may belong to an outer trace
          setattr(module, name, getattr(module, name).replace(w))
  return block


def _qarray():
  """qwix's QArray module (in qwix 0.1.2 and 0.1.8); without qwix, an error naming the fix."""
  try:
    from qwix._src.core import qarray
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "qwix":
      raise
    raise ModuleNotFoundError(f"lora.quantize_base {QWIX_FIX}", name="qwix") from None
  return qarray


def _dequantize(qvalue, scale):
  qarray = _qarray()
  return qarray.dequantize(qarray.QArray(qvalue, scale, None, _qtype(qvalue.dtype)))


def _qtype(dtype) -> str:
  return {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.int4): "int4"}[jnp.dtype(dtype)]


def _quantize(w, qtype: str, channel_axes):
  qarray = _qarray()
  q = qarray.quantize(w, qarray.HowToQuantize(qtype=qtype, channelwise_axes=channel_axes))
  return q.qvalue, q.scale


# ------------------------------------------------------------------------ building a model


def attach(model, lc, *, seed: int, mesh=None, abstract: bool = False):
  """Quantizes the base (lc.quantize_base) and adds the adapters, in place. -> (base graphdef,
  graphdef): the model without and with adapters (the reference and the policy)."""
  cfg = model.cfg
  lead = 1 if cfg.scan_layers else 0
  weights = {}  # (layer or None, module, name) -> (module object, Param)
  blocks = [(None, model.layers)] if cfg.scan_layers else list(enumerate(model.layers))
  for i, blk in blocks:
    for m, w in PROJECTIONS:
      mod = getattr(blk, m)
      weights[(i, m, w)] = (mod, getattr(mod, w))
  if lc.quantize_base != "none":
    for (i, m, w), (mod, var) in weights.items():
      n_in, nb = PROJECTIONS[(m, w)], lead + experts_axis(mod, w)  # nb: the batch axes
      channel_axes = tuple(range(nb)) + tuple(range(nb + n_in, var.get_value().ndim))
      axes = var.get_metadata()["logical_axes"]
      q, s = _values(
          lambda x, ca=channel_axes: _quantize(x, lc.quantize_base, ca),
          var.get_value(),
          mesh,
          abstract,
          ((axes, tuple(None if d in range(nb, nb + n_in) else a for d, a in enumerate(axes)))),
      )
      var.set_value(q)
      setattr(
          mod,
          f"{w}_qscale",
          QuantScale(
              s,
              logical_axes=tuple(
                  None if d in range(nb, nb + n_in) else a for d, a in enumerate(axes)
              ),
          ),
      )
  base_graphdef, _ = nnx.split(model)
  key = jax.random.key(seed)
  found = targets(cfg.num_layers, lc.target_modules)
  chosen = {(None if lead else i, m, w) for i, m, w in found}
  for n, ((i, m, w), (mod, var)) in enumerate(weights.items()):
    if (i, m, w) not in chosen:
      continue
    n_in, nb = PROJECTIONS[(m, w)], lead + experts_axis(mod, w)  # nb: layers, experts
    shape, axes = var.get_value().shape, var.get_metadata()["logical_axes"]
    a_shape = shape[: nb + n_in] + (lc.rank,)
    b_shape = shape[:nb] + (lc.rank,) + shape[nb + n_in :]
    a_axes, b_axes = axes[: nb + n_in] + (None,), axes[:nb] + (None,) + axes[nb + n_in :]
    ka, kb = jax.random.split(jax.random.fold_in(key, n))
    dtype = jnp.dtype(cfg.param_dtype)
    a, b = _values(
        lambda ka=ka, kb=kb: _init_ab(ka, kb, a_shape, b_shape, nb, n_in, lc.init, dtype),
        None,
        mesh,
        abstract,
        (a_axes, b_axes),
    )
    setattr(mod, f"{w}_lora_a", nnx.LoRAParam(a, logical_axes=a_axes))
    setattr(mod, f"{w}_lora_b", nnx.LoRAParam(b, logical_axes=b_axes))
    mod.lora_scale = lc.alpha / lc.rank
  graphdef, _ = nnx.split(model)
  return base_graphdef, graphdef


def _init_ab(ka, kb, a_shape, b_shape, nb, n_in, init, dtype):
  """A: he-uniform over W's input dims (qwix's default, fan_in = their product; the first `nb`
  axes are batch axes: layers, experts); B: zeros (the adapted model starts as the base) or
  N(0, 0.02^2) (tests of a non-trivial adapter)."""
  fan_in = math.prod(a_shape[nb : nb + n_in])
  lim = math.sqrt(6.0 / fan_in)
  a = jax.random.uniform(ka, a_shape, jnp.float32, -lim, lim).astype(dtype)
  b = (
      jnp.zeros(b_shape, dtype)
      if init == "zeros"
      else (0.02 * jax.random.normal(kb, b_shape, jnp.float32)).astype(dtype)
  )
  return a, b


def _values(fn, x, mesh, abstract, axes):
  """fn(x) (or fn()), jitted straight into the shardings its logical `axes` give on `mesh` (each
  device makes only its shards; the same on every process); abstract: shapes only."""
  args = () if x is None else (x,)
  if abstract:
    out = jax.eval_shape(fn, *args)
    if mesh is None:
      return out
    return tuple(
        jax.ShapeDtypeStruct(
            o.shape,
            o.dtype,
            sharding=jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(ax, o.shape, mesh)),
        )
        for o, ax in zip(out, axes)
    )
  if mesh is None:
    return jax.jit(fn)(*args)
  shapes = jax.eval_shape(fn, *args)
  outs = tuple(
      jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(ax, s.shape, mesh))
      for s, ax in zip(shapes, axes)
  )
  return jax.jit(fn, out_shardings=outs)(*args)


# ------------------------------------------------------------------- params: split, merge


def split(params):
  """(adapters, base): the LoRAParams (trained) and everything else (frozen)."""
  return nnx.split_state(params, nnx.LoRAParam, ...)


def combine(adapters, base):
  return nnx.merge_state(base, adapters)


def base_of(params):
  """The frozen base of `params`: the very same arrays (the reference; no copy)."""
  return split(params)[1]


def has_adapters(params) -> bool:
  return any(
      isinstance(v, nnx.LoRAParam)
      for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )


def merged(params, graphdef):
  """The plain decoder's state (no adapters, not quantized): W + (alpha / r) A @ B, dequantized,
  with the structure of the model before `attach` (merge it with that graphdef). For export,
  vLLM and the merged-weights sampler (jit it: one pass over the weights)."""
  model = nnx.merge(graphdef, params)
  blocks = (
      [((), model.layers)]
      if model.cfg.scan_layers
      else [((i,), blk) for i, blk in enumerate(model.layers)]
  )
  eff = {}
  for idx, blk in blocks:
    for m, w in PROJECTIONS:
      e = effective_weight(getattr(blk, m), w, stacked=model.cfg.scan_layers)
      if e is not None:
        eff[("layers", *idx, m, w)] = e
  flat = [
      (path, var.replace(eff[path]) if path in eff else var)
      for path, var in nnx.to_flat_state(split(params)[1])
      if not isinstance(var, QuantScale)
  ]
  return nnx.State.from_flat_path(flat)


def zero_delta(params):
  """`params` with every B at zero: the adapted model computes exactly its base."""
  adapters, base = split(params)
  flat = [
      (
          path,
          var.replace(jnp.zeros_like(var.get_value()))
          if str(path[-1]).endswith("_lora_b")
          else var,
      )
      for path, var in nnx.to_flat_state(adapters)
  ]
  return combine(nnx.State.from_flat_path(flat), base)


def fold(params, graphdef):
  """After a full-parameter SFT warm start: the adapters' delta folded into the base (which is
  then the reference GRPO starts from) and B back to zeros, so the policy is unchanged."""
  return combine(split(zero_delta(params))[0], merged(params, graphdef))
