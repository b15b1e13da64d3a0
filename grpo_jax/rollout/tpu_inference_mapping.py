"""vLLM on TPU, the mapping: native parameter names/layouts -> tpu-inference's JAX model state.

vLLM's TPU backend (`tpu-inference`, installed by `vllm-tpu`; `pip install -e '.[vllm-tpu]'`)
runs Qwen3 and Llama as Flax NNX modules (tpu_inference/models/jax/{qwen3,llama3}.py) whose
weights are JAX arrays in `worker.model_runner.state` (an nnx.State; the jitted step reads
`model_runner.state_leaves`). So a weight sync needs no torch and no host: each native
parameter is mapped onto tpu-inference's name and layout by a jitted function on the trainer's
devices (layer slice of a scanned stack, cast to the engine's dtype, padding) that also places
it in the sharding the engine's array already has (or, on other chips, `jax.device_put` from one
device's copy: device to device), and the engine's arrays are replaced in place (Syncer).

Names and layouts (read from tpu-inference 0.32.0; `rules`):

  native (models/decoder/layers.py)           Qwen3ForCausalLM                       LlamaForCausalLM
  embed          [V, D]               model.embed_tokens.weight [Vp, D]      model.embed.embedding
  final_norm.scale [D]                model.norm.weight                      model.norm.scale
  lm_head        [D, V] (untied)      lm_head.weight [D, Vp]                 model.lm_head
  layers[.i].attn_norm.scale          model.layers.{i}.input_layernorm.weight        .scale
  layers[.i].mlp_norm.scale           model.layers.{i}.post_attention_layernorm.weight .scale
  attn.q         [D, H, K]            model.layers.{i}.self_attn.q_proj.weight [D, H, Kp]  .kernel
  attn.k, attn.v [D, Hkv, K]          ....self_attn.{k,v}_proj.weight [D, Hkv', Kp]        .kernel
  attn.o         [H, K, D]            ....self_attn.o_proj.weight [H, Kp, D]               .kernel
  attn.q_norm/k_norm.scale [K]        ....self_attn.{q,k}_norm.weight (Qwen3)
  mlp.gate/up [D, F], mlp.down [F, D] ....mlp.{gate,up,down}_proj.weight              .kernel

Both use the native [in, out] / heads-as-a-dimension layouts, so most entries are identity
copies; the differences, all in `to_target` (and inverted by `from_target`):
  - layers: tpu-inference holds one array per layer (an nnx.List), scan_layers=True stacks ours
    [L, ...]: the stack is sliced per layer;
  - head_dim is zero-padded to a multiple of 128 (64 stays 64; tpu_inference.utils.
    get_padded_head_dim): q, k, v on their last axis, o on its head_dim axis (zeros add nothing
    to q.k, and padded v columns meet zero o rows). Qwen3's q_norm/k_norm cannot be padded that
    way (an RMSNorm over padded lanes is another function): Qwen3 needs head_dim 64 or a multiple
    of 128, as tpu-inference's own loader does;
  - KV heads are repeated when the tensor-parallel size exceeds them (get_padded_num_heads:
    head j of the padded set is head j // r of ours, which keeps grouped-query attention's
    q-head -> kv-head assignment; Llama only: tpu-inference's Qwen3 loader cannot, so neither
    can its engine start); q heads are never padded here (TP must divide num_heads);
  - Qwen3 pads the vocabulary rows of embed/lm_head up to a multiple of the TP size (zeros);
  - tied embeddings: no lm_head on either side (Llama's lm_head is the embedding Variable
    itself, so nnx.state lists it once, as model.embed.embedding);
  - tpu-inference's LAYOUT_Q_PROJ_AS_NDH=1 lays q out [H, D, K]: `Layout.q_layout="NDH"`.
Attention biases (Qwen2-style) have no place in either model and are refused.

`Layout.expected(cfg, tp)` predicts tpu-inference's shapes; `Layout.from_target(cfg, shapes)`
reads them from the live model (what the engine uses). `Syncer.push` does the transfer and
checks that every target parameter is written exactly once with its shape unchanged.

Pure functions of shapes and arrays (no vLLM, no TPU); rollout/tpu_inference_sync.py pushes
their results into a live engine.
"""

import dataclasses
import importlib.util

from flax import nnx
import jax
import jax.numpy as jnp

from grpo_jax.models.decoder.config import ModelConfig

TPU_INFERENCE_VERSION = "0.32.0"  # the tpu-inference release the names/layouts were read from
ARCH_CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}


def available() -> bool:
  """True when vLLM on TPU can run here: tpu_inference importable and JAX's backend is TPU."""
  return importlib.util.find_spec("tpu_inference") is not None and jax.default_backend() == "tpu"


def padded_head_dim(k: int) -> int:
  """tpu_inference.utils.get_padded_head_dim: a multiple of 128, except 64 (own kernel)."""
  return 64 if k == 64 else -(-k // 128) * 128


def padded_num_heads(n: int, tp: int) -> int:
  """tpu_inference.utils.get_padded_num_heads: n if tp divides it, else tp (n must divide tp)."""
  if n >= tp:
    if n % tp:
      raise ValueError(f"{n} heads do not split over tensor_parallel_size={tp}")
    return n
  if tp % n:
    raise ValueError(f"{n} heads cannot be replicated onto tensor_parallel_size={tp}")
  return tp


# --------------------------------------------------------------------------- the mapping


@dataclasses.dataclass(frozen=True)
class Layout:
  """tpu-inference's sizes for a model (what differs from the native config)."""

  vocab_rows: int  # embed/lm_head vocabulary size (Qwen3: padded to a multiple of TP)
  num_heads: int
  num_kv_heads: int  # >= the native count: KV heads repeated for tensor parallelism
  head_dim: int  # >= the native head_dim: zero-padded lanes
  q_layout: str = "DNH"  # "NDH" with tpu-inference's LAYOUT_Q_PROJ_AS_NDH=1 (Qwen3 only)

  @classmethod
  def expected(
      cls, cfg: ModelConfig, tensor_parallel_size: int = 1, q_layout: str = "DNH"
  ) -> "Layout":
    """What tpu-inference 0.32.0 builds for `cfg` on `tensor_parallel_size` devices."""
    tp = int(tensor_parallel_size)
    vocab = cfg.vocab_size
    if cfg.arch == "qwen3":
      vocab = -(-vocab // tp) * tp  # utils.align_to(vocab_size, tp_size)
    return cls(
        vocab_rows=vocab,
        num_heads=padded_num_heads(cfg.num_heads, tp),
        num_kv_heads=padded_num_heads(cfg.num_kv_heads, tp),
        head_dim=padded_head_dim(cfg.head_dim),
        q_layout=q_layout,
    )

  @classmethod
  def from_target(cls, cfg: ModelConfig, shapes: dict[str, tuple]) -> "Layout":
    """Read from the target model's parameter shapes ({name: shape}, e.g. `target_shapes` of
    the live state): layer 0's q/k projections and the embedding."""
    names = _names(cfg)
    q = tuple(shapes[names["q"].format(i=0)])
    k = tuple(shapes[names["k"].format(i=0)])
    d = cfg.hidden_size
    if q[0] == d and len(q) == 3:
      q_layout, heads, kd = "DNH", q[1], q[2]
    elif len(q) == 3 and q[1] == d:
      q_layout, heads, kd = "NDH", q[0], q[2]
    else:
      raise ValueError(
          f"{names['q'].format(i=0)} has shape {q}: expected [D={d}, heads, "
          "head_dim] or [heads, D, head_dim]"
      )
    return cls(
        vocab_rows=int(shapes[names["embed"]][0]),
        num_heads=int(heads),
        num_kv_heads=int(k[1]),
        head_dim=int(kd),
        q_layout=q_layout,
    )


@dataclasses.dataclass(frozen=True)
class Rule:
  """One native parameter -> one target parameter (per layer when `per_layer`)."""

  path: tuple  # native path; per-layer params without the layers prefix, e.g. ("attn", "q")
  name: str  # target name; "{i}" stands for the layer index
  kind: str  # the transform in to_target / from_target
  per_layer: bool


def _names(cfg: ModelConfig) -> dict[str, str]:
  """Target names by role, from tpu-inference's model classes."""
  if cfg.arch == "qwen3":
    w, layer = ".weight", "model.layers.{i}."
    out = dict(
        embed="model.embed_tokens.weight",
        final_norm="model.norm.weight",
        lm_head="lm_head.weight",
        q_norm=layer + "self_attn.q_norm.weight",
        k_norm=layer + "self_attn.k_norm.weight",
    )
    norm = ".weight"
  elif cfg.arch == "llama3":
    w, layer, norm = ".kernel", "model.layers.{i}.", ".scale"
    out = dict(
        embed="model.embed.embedding", final_norm="model.norm.scale", lm_head="model.lm_head"
    )
  else:
    raise ValueError(
        f"model.arch={cfg.arch!r}: tpu-inference sync supports " f"{', '.join(ARCH_CLASSES)}"
    )
  out.update(
      attn_norm=layer + "input_layernorm" + norm,
      mlp_norm=layer + "post_attention_layernorm" + norm,
      q=layer + "self_attn.q_proj" + w,
      k=layer + "self_attn.k_proj" + w,
      v=layer + "self_attn.v_proj" + w,
      o=layer + "self_attn.o_proj" + w,
      gate=layer + "mlp.gate_proj" + w,
      up=layer + "mlp.up_proj" + w,
      down=layer + "mlp.down_proj" + w,
  )
  return out


def problems(cfg: ModelConfig, tensor_parallel_size: int = 1) -> list[str]:
  """Why `cfg` cannot be synced into tpu-inference on `tensor_parallel_size` devices (empty: it
  can). The engine's start-up check; each entry names the field and the fix."""
  out = []
  if cfg.arch not in ARCH_CLASSES:
    return [f"model.arch={cfg.arch!r}: vLLM-TPU sync supports {', '.join(ARCH_CLASSES)}"]
  if cfg.attention_bias:
    out.append("model.attention_bias=True: tpu-inference's Qwen3/Llama have no attention biases")
  if cfg.arch == "qwen3" and not cfg.qk_norm:
    out.append("model.qk_norm=False with arch=qwen3: tpu-inference's Qwen3 always has q/k norms")
  if cfg.arch == "llama3" and cfg.qk_norm:
    out.append("model.qk_norm=True with arch=llama3: tpu-inference's Llama has no q/k norms")
  if cfg.arch == "qwen3" and padded_head_dim(cfg.head_dim) != cfg.head_dim:
    out.append(
        f"model.head_dim={cfg.head_dim}: tpu-inference pads head_dim to "
        f"{padded_head_dim(cfg.head_dim)}, which Qwen3's q/k RMSNorm cannot follow; use "
        "64 or a multiple of 128"
    )
  tp = int(tensor_parallel_size)
  for field, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)):
    try:
      padded_num_heads(n, tp)
    except ValueError as e:
      out.append(
          f"model.{field}={n}: {e}; use a tensor-parallel size that divides it or that "
          "it divides"
      )
  if cfg.num_heads < tp:
    out.append(
        f"model.num_heads={cfg.num_heads} < tensor_parallel_size={tp}: tpu-inference "
        "would pad the query heads; use at most num_heads devices for vLLM"
    )
  if cfg.arch == "qwen3" and cfg.num_kv_heads < tp:
    out.append(
        f"model.num_kv_heads={cfg.num_kv_heads} < tensor_parallel_size={tp}: "
        f"tpu-inference {TPU_INFERENCE_VERSION}'s Qwen3 loader cannot replicate KV heads "
        "(its start-up load fails); use at most num_kv_heads devices for vLLM"
    )
  if cfg.intermediate_size % tp:
    out.append(
        f"model.intermediate_size={cfg.intermediate_size} does not split over "
        f"tensor_parallel_size={tp}"
    )
  if cfg.arch == "llama3" and cfg.vocab_size % tp:
    out.append(
        f"model.vocab_size={cfg.vocab_size} does not split over tensor_parallel_size={tp} "
        "(tpu-inference's Llama shards the vocabulary unpadded)"
    )
  return out


def rules(cfg: ModelConfig) -> list[Rule]:
  """Every native parameter with its target name and transform."""
  n = _names(cfg)
  out = [
      Rule(("embed",), n["embed"], "embed", False),
      Rule(("final_norm", "scale"), n["final_norm"], "same", False),
  ]
  if not cfg.tie_embeddings:
    out.append(Rule(("lm_head",), n["lm_head"], "unembed", False))
  layer = [
      (("attn_norm", "scale"), "attn_norm", "same"),
      (("mlp_norm", "scale"), "mlp_norm", "same"),
      (("attn", "q"), "q", "q"),
      (("attn", "k"), "k", "kv"),
      (("attn", "v"), "v", "kv"),
      (("attn", "o"), "o", "o"),
      (("mlp", "gate"), "gate", "same"),
      (("mlp", "up"), "up", "same"),
      (("mlp", "down"), "down", "same"),
  ]
  if cfg.arch == "qwen3":
    layer += [
        (("attn", "q_norm", "scale"), "q_norm", "head_norm"),
        (("attn", "k_norm", "scale"), "k_norm", "head_norm"),
    ]
  out += [Rule(path, n[role], kind, True) for path, role, kind in layer]
  return out


def target_names(cfg: ModelConfig) -> list[str]:
  return [
      r.name.format(i=i)
      for r in rules(cfg)
      for i in (range(cfg.num_layers) if r.per_layer else [None])
  ]


def _pad_to(x, axis: int, size: int):
  extra = size - x.shape[axis]
  if extra < 0:
    raise ValueError(f"cannot pad axis {axis} of shape {x.shape} down to {size}")
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def to_target(kind: str, x, cfg: ModelConfig, lay: Layout):
  """One native parameter (one layer's) in tpu-inference's layout (jnp ops: traceable)."""
  if kind == "same":
    return x
  if kind == "embed":  # [V, D] -> [Vp, D]
    return _pad_to(x, 0, lay.vocab_rows)
  if kind == "unembed":  # [D, V] -> [D, Vp]
    return _pad_to(x, 1, lay.vocab_rows)
  if kind == "q":  # [D, H, K] -> [D, H, Kp] (or [H, D, Kp])
    if lay.num_heads != cfg.num_heads:
      raise ValueError(
          f"tpu-inference pads {cfg.num_heads} query heads to {lay.num_heads} "
          "(tensor_parallel_size > num_heads): not supported"
      )
    y = _pad_to(x, 2, lay.head_dim)
    return y.transpose(1, 0, 2) if lay.q_layout == "NDH" else y
  if kind == "kv":  # [D, Hkv, K] -> [D, Hkv * r, Kp], head j <- head j // r
    r, rem = divmod(lay.num_kv_heads, cfg.num_kv_heads)
    if rem:
      raise ValueError(
          f"{lay.num_kv_heads} target KV heads are not a multiple of " f"{cfg.num_kv_heads}"
      )
    y = _pad_to(x, 2, lay.head_dim)
    return jnp.repeat(y, r, axis=1) if r > 1 else y
  if kind == "o":  # [H, K, D] -> [H, Kp, D]
    return _pad_to(x, 1, lay.head_dim)
  if kind == "head_norm":  # [K]
    if lay.head_dim != x.shape[0]:
      raise ValueError(f"q/k norm over head_dim {x.shape[0]} cannot be padded to {lay.head_dim}")
    return x
  raise ValueError(f"unknown transform {kind!r}")


def from_target(kind: str, y, cfg: ModelConfig, lay: Layout):
  """The inverse of to_target (padding and replicas dropped)."""
  k, v = cfg.head_dim, cfg.vocab_size
  if kind in ("same", "head_norm"):
    return y
  if kind == "embed":
    return y[:v]
  if kind == "unembed":
    return y[:, :v]
  if kind == "q":
    y = y.transpose(1, 0, 2) if lay.q_layout == "NDH" else y
    return y[:, :, :k]
  if kind == "kv":
    return y[:, :: lay.num_kv_heads // cfg.num_kv_heads, :k]
  if kind == "o":
    return y[:, :k, :]
  raise ValueError(f"unknown transform {kind!r}")


def native_flat(state, cfg: ModelConfig) -> dict[tuple, jax.Array]:
  """{native path: array} of a native nnx.State (scanned stacks kept whole)."""
  del cfg
  return {
      tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
      for p, v in nnx.to_flat_state(state)
  }


def layer_inputs(rule: Rule, flat: dict, cfg: ModelConfig):
  """The native array(s) a rule reads: one array (global or scanned stack) or a per-layer list."""
  if not rule.per_layer:
    return flat[rule.path]
  if cfg.scan_layers:
    return flat[("layers", *rule.path)]
  return [flat[("layers", i, *rule.path)] for i in range(cfg.num_layers)]


def rule_outputs(rule: Rule, x, cfg: ModelConfig, lay: Layout, dtype=None) -> list:
  """The target arrays of one rule (one per layer for per-layer rules), cast to `dtype`."""
  cast = (lambda a: a) if dtype is None else (lambda a: a.astype(dtype))
  if not rule.per_layer:
    return [cast(to_target(rule.kind, x, cfg, lay))]
  layers = [x[i] for i in range(cfg.num_layers)] if cfg.scan_layers else x
  return [cast(to_target(rule.kind, a, cfg, lay)) for a in layers]


def to_target_tree(state, cfg: ModelConfig, lay: Layout, dtype=None) -> dict[str, jax.Array]:
  """{target name: array} for the whole model (tests; the engine goes rule by rule)."""
  flat = native_flat(state, cfg)
  out = {}
  for r in rules(cfg):
    ys = rule_outputs(r, layer_inputs(r, flat, cfg), cfg, lay, dtype)
    names = [r.name.format(i=i) for i in range(cfg.num_layers)] if r.per_layer else [r.name]
    out.update(zip(names, ys))
  return out


def from_target_tree(target: dict, cfg: ModelConfig, lay: Layout) -> dict[tuple, jax.Array]:
  """{native path: array} back from {target name: array} (scanned: stacked again)."""
  out = {}
  for r in rules(cfg):
    if not r.per_layer:
      out[r.path] = from_target(r.kind, target[r.name], cfg, lay)
      continue
    ys = [from_target(r.kind, target[r.name.format(i=i)], cfg, lay) for i in range(cfg.num_layers)]
    if cfg.scan_layers:
      out[("layers", *r.path)] = jnp.stack(ys)
    else:
      out.update({("layers", i, *r.path): y for i, y in enumerate(ys)})
  return out


def target_shapes(state) -> dict[str, tuple]:
  """{dotted name: shape} of the nnx.Param leaves of a target state (concrete or abstract)."""
  return {name: tuple(var.get_value().shape) for name, var in target_params(state).items()}


def target_params(state) -> dict[str, nnx.Variable]:
  """{dotted name: Variable} of the nnx.Param leaves of a target (tpu-inference) state."""
  out = {}
  for path, var in nnx.to_flat_state(state):
    if isinstance(var, nnx.Param):
      out[".".join(str(p) for p in path)] = var
  return out


def layout_summary(cfg: ModelConfig, lay: Layout) -> str:
  """One line for logs: what the mapping changes for this model."""
  parts = []
  if lay.head_dim != cfg.head_dim:
    parts.append(f"head_dim {cfg.head_dim}->{lay.head_dim} (zero-padded)")
  if lay.num_kv_heads != cfg.num_kv_heads:
    parts.append(f"kv heads {cfg.num_kv_heads}->{lay.num_kv_heads} (repeated)")
  if lay.vocab_rows != cfg.vocab_size:
    parts.append(f"vocab {cfg.vocab_size}->{lay.vocab_rows} (zero rows)")
  if lay.q_layout != "DNH":
    parts.append("q as [H, D, K]")
  return ", ".join(parts) or "identity layouts"
