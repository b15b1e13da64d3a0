"""vLLM on TPU: the native policy's weights written into tpu-inference's JAX model, on device.

vLLM's TPU backend (`tpu-inference`, installed by `vllm-tpu`; `pip install -e '.[vllm-tpu]'`)
runs Qwen3 and Llama as Flax NNX modules (tpu_inference/models/jax/{qwen3,llama3}.py) whose
weights are JAX arrays in `worker.model_runner.state` (an nnx.State; the jitted step reads
`model_runner.state_leaves`). So a weight sync needs no torch and no host: each native
parameter is mapped onto tpu-inference's name and layout by a jitted function on the trainer's
devices (layer slice of a scanned stack, cast to the engine's dtype, padding) that also places
it in the sharding the engine's array already has (or, on other chips, `jax.device_put` from one
device's copy: device to device), and the engine's arrays are replaced in place (Syncer).

Names and layouts (read from tpu-inference 0.32.0; `rules`):

  native (models/layers.py)           Qwen3ForCausalLM                       LlamaForCausalLM
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

The engine (`TPUInferenceEngine`) is rollout/vllm_engine.py's VLLMEngine with this sync in place
of the torch `reload_weights` path; generation, the probe fingerprint check (trainer vs vLLM
log-probs of a fixed sequence after every sync), the timeout and stats are VLLMEngine's. It
needs a TPU and is not exercised by the CPU tests (tests/test_tpu_inference.py tests the
mapping against tpu-inference's own model classes instantiated abstractly and against its own
checkpoint loaders fed our HF export, and the push into a sharded target state on CPU devices
with host transfers disallowed).
"""
import dataclasses
import importlib.util
import os
import time
from typing import Callable, Iterator

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import sharding
from grpo_jax.models.config import ModelConfig

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
  def expected(cls, cfg: ModelConfig, tensor_parallel_size: int = 1,
               q_layout: str = "DNH") -> "Layout":
    """What tpu-inference 0.32.0 builds for `cfg` on `tensor_parallel_size` devices."""
    tp = int(tensor_parallel_size)
    vocab = cfg.vocab_size
    if cfg.arch == "qwen3":
      vocab = -(-vocab // tp) * tp  # utils.align_to(vocab_size, tp_size)
    return cls(vocab_rows=vocab, num_heads=padded_num_heads(cfg.num_heads, tp),
               num_kv_heads=padded_num_heads(cfg.num_kv_heads, tp),
               head_dim=padded_head_dim(cfg.head_dim), q_layout=q_layout)

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
      raise ValueError(f"{names['q'].format(i=0)} has shape {q}: expected [D={d}, heads, "
                       "head_dim] or [heads, D, head_dim]")
    return cls(vocab_rows=int(shapes[names["embed"]][0]), num_heads=int(heads),
               num_kv_heads=int(k[1]), head_dim=int(kd), q_layout=q_layout)


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
    out = dict(embed="model.embed_tokens.weight", final_norm="model.norm.weight",
               lm_head="lm_head.weight",
               q_norm=layer + "self_attn.q_norm.weight", k_norm=layer + "self_attn.k_norm.weight")
    norm = ".weight"
  elif cfg.arch == "llama3":
    w, layer, norm = ".kernel", "model.layers.{i}.", ".scale"
    out = dict(embed="model.embed.embedding", final_norm="model.norm.scale",
               lm_head="model.lm_head")
  else:
    raise ValueError(f"model.arch={cfg.arch!r}: tpu-inference sync supports "
                     f"{', '.join(ARCH_CLASSES)}")
  out.update(
      attn_norm=layer + "input_layernorm" + norm,
      mlp_norm=layer + "post_attention_layernorm" + norm,
      q=layer + "self_attn.q_proj" + w, k=layer + "self_attn.k_proj" + w,
      v=layer + "self_attn.v_proj" + w, o=layer + "self_attn.o_proj" + w,
      gate=layer + "mlp.gate_proj" + w, up=layer + "mlp.up_proj" + w,
      down=layer + "mlp.down_proj" + w)
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
    out.append(f"model.head_dim={cfg.head_dim}: tpu-inference pads head_dim to "
               f"{padded_head_dim(cfg.head_dim)}, which Qwen3's q/k RMSNorm cannot follow; use "
               "64 or a multiple of 128")
  tp = int(tensor_parallel_size)
  for field, n in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.num_kv_heads)):
    try:
      padded_num_heads(n, tp)
    except ValueError as e:
      out.append(f"model.{field}={n}: {e}; use a tensor-parallel size that divides it or that "
                 "it divides")
  if cfg.num_heads < tp:
    out.append(f"model.num_heads={cfg.num_heads} < tensor_parallel_size={tp}: tpu-inference "
               "would pad the query heads; use at most num_heads devices for vLLM")
  if cfg.arch == "qwen3" and cfg.num_kv_heads < tp:
    out.append(f"model.num_kv_heads={cfg.num_kv_heads} < tensor_parallel_size={tp}: "
               f"tpu-inference {TPU_INFERENCE_VERSION}'s Qwen3 loader cannot replicate KV heads "
               "(its start-up load fails); use at most num_kv_heads devices for vLLM")
  if cfg.intermediate_size % tp:
    out.append(f"model.intermediate_size={cfg.intermediate_size} does not split over "
               f"tensor_parallel_size={tp}")
  if cfg.arch == "llama3" and cfg.vocab_size % tp:
    out.append(f"model.vocab_size={cfg.vocab_size} does not split over tensor_parallel_size={tp} "
               "(tpu-inference's Llama shards the vocabulary unpadded)")
  return out


def rules(cfg: ModelConfig) -> list[Rule]:
  """Every native parameter with its target name and transform."""
  n = _names(cfg)
  out = [Rule(("embed",), n["embed"], "embed", False),
         Rule(("final_norm", "scale"), n["final_norm"], "same", False)]
  if not cfg.tie_embeddings:
    out.append(Rule(("lm_head",), n["lm_head"], "unembed", False))
  layer = [(("attn_norm", "scale"), "attn_norm", "same"),
           (("mlp_norm", "scale"), "mlp_norm", "same"),
           (("attn", "q"), "q", "q"), (("attn", "k"), "k", "kv"), (("attn", "v"), "v", "kv"),
           (("attn", "o"), "o", "o"), (("mlp", "gate"), "gate", "same"),
           (("mlp", "up"), "up", "same"), (("mlp", "down"), "down", "same")]
  if cfg.arch == "qwen3":
    layer += [(("attn", "q_norm", "scale"), "q_norm", "head_norm"),
              (("attn", "k_norm", "scale"), "k_norm", "head_norm")]
  out += [Rule(path, n[role], kind, True) for path, role, kind in layer]
  return out


def target_names(cfg: ModelConfig) -> list[str]:
  return [r.name.format(i=i) for r in rules(cfg)
          for i in (range(cfg.num_layers) if r.per_layer else [None])]


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
      raise ValueError(f"tpu-inference pads {cfg.num_heads} query heads to {lay.num_heads} "
                       "(tensor_parallel_size > num_heads): not supported")
    y = _pad_to(x, 2, lay.head_dim)
    return y.transpose(1, 0, 2) if lay.q_layout == "NDH" else y
  if kind == "kv":  # [D, Hkv, K] -> [D, Hkv * r, Kp], head j <- head j // r
    r, rem = divmod(lay.num_kv_heads, cfg.num_kv_heads)
    if rem:
      raise ValueError(f"{lay.num_kv_heads} target KV heads are not a multiple of "
                       f"{cfg.num_kv_heads}")
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
    return y[:, ::lay.num_kv_heads // cfg.num_kv_heads, :k]
  if kind == "o":
    return y[:, :k, :]
  raise ValueError(f"unknown transform {kind!r}")


def native_flat(state, cfg: ModelConfig) -> dict[tuple, jax.Array]:
  """{native path: array} of a native nnx.State (scanned stacks kept whole)."""
  del cfg
  return {tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v)
          for p, v in nnx.to_flat_state(state)}


def _layer_inputs(rule: Rule, flat: dict, cfg: ModelConfig):
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
    ys = rule_outputs(r, _layer_inputs(r, flat, cfg), cfg, lay, dtype)
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
    ys = [from_target(r.kind, target[r.name.format(i=i)], cfg, lay)
          for i in range(cfg.num_layers)]
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


# ----------------------------------------------------------------------------- the push


class Syncer:
  """Writes native weights into a tpu-inference model state, on device.

      syncer = Syncer(cfg)
      stats = syncer.push(rollout_state, runner.state)     # then runner.refresh_state_leaves()

  One target array at a time (a layer of a parameter), by a jitted function per rule (compiled
  once; the layer index is a device scalar): slice the layer off a scanned stack, pad, cast to
  the engine's dtype. Placement, never through the host:
    - target on the trainer's own devices: the jitted function's out_shardings is the target's
      sharding (XLA moves the shards);
    - target on other devices (other chips, or the local chips of a multi-host trainer mesh):
      the function's output is replicated over the trainer's devices, and one device's copy is
      `jax.device_put` into the target sharding (slices cut on that device, copied device to
      device).
  `delete_old` frees each replaced buffer at once, so the peak extra memory is one tensor.
  """

  def __init__(self, cfg: ModelConfig):
    bad = problems(cfg)  # the model's own limits (the device count is the engine's check)
    if bad:
      raise ValueError("; ".join(bad))
    self.cfg = cfg
    self.layout = None
    self._fns: dict = {}
    self._index: dict = {}

  def check(self, state) -> Layout:
    """The target's layout, after checking its parameter names and shapes against the mapping:
    every target parameter written exactly once, with the shape it already has."""
    shapes = target_shapes(state)
    want = target_names(self.cfg)
    missing = sorted(set(want) - set(shapes))
    extra = sorted(set(shapes) - set(want))
    if missing or extra or len(want) != len(set(want)):
      raise ValueError(
          f"tpu-inference model parameters do not match the {self.cfg.arch} mapping "
          f"(grpo_jax/rollout/tpu_inference_sync.py, read from tpu-inference "
          f"{TPU_INFERENCE_VERSION}): missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
          f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}")
    lay = Layout.from_target(self.cfg, shapes)
    got = jax.eval_shape(lambda st: to_target_tree(st, self.cfg, lay),
                         _abstract_state(self.cfg))
    bad = {n: (tuple(got[n].shape), shapes[n]) for n in want if tuple(got[n].shape) != shapes[n]}
    if bad:
      raise ValueError(f"tpu-inference parameter shapes differ from the mapping's (mapped, "
                       f"target): {dict(list(bad.items())[:6])}")
    return lay

  def _fn(self, rule: Rule, lay: Layout, dtype, stacked: bool, out_sharding):
    """jit((x[, i]) -> one target array), cached per rule, dtype and output sharding."""
    key = (rule, lay, jnp.dtype(dtype).name, stacked, out_sharding)
    if key not in self._fns:
      cfg = self.cfg

      def one(x, *i):
        if stacked:
          x = jax.lax.dynamic_index_in_dim(x, i[0], 0, keepdims=False)
        return to_target(rule.kind, x, cfg, lay).astype(dtype)

      self._fns[key] = jax.jit(one, out_shardings=out_sharding)
    return self._fns[key]

  def _layer_index(self, i: int, sharding):
    key = (i, sharding)
    if key not in self._index:  # an explicit transfer, once per layer and device set
      self._index[key] = jax.device_put(np.int32(i), sharding)
    return self._index[key]

  def produce(self, native_state, target_state, lay: Layout
              ) -> Iterator[tuple[str, jax.Array, jax.Array]]:
    """(target name, current target array, new array in its layout, dtype and sharding)."""
    params = target_params(target_state)
    flat = native_flat(native_state, self.cfg)
    for r in rules(self.cfg):
      x = _layer_inputs(r, flat, self.cfg)
      stacked = r.per_layer and self.cfg.scan_layers
      for i in range(self.cfg.num_layers) if r.per_layer else [None]:
        name = r.name if i is None else r.name.format(i=i)
        old = params[name].get_value()
        src = x if (i is None or stacked) else x[i]
        same = old.sharding.device_set == src.sharding.device_set
        out = old.sharding if same else _replicated_on(src)
        args = [src] + ([self._layer_index(i, _replicated_on(src))] if stacked else [])
        y = self._fn(r, lay, old.dtype, stacked, out)(*args)
        if not same:  # one device's full copy, cut and copied into the target's devices
          y = jax.device_put(y.addressable_shards[0].data, old.sharding)
        yield name, old, y

  def push(self, native_state, target_state, *, delete_old: bool = True) -> dict:
    """Writes `native_state` (the sampler graph's nnx.State) into `target_state` in place.
    Returns {"tensors": count, "bytes": total}."""
    if self.layout is None:
      self.layout = self.check(target_state)
    params = target_params(target_state)
    written, nbytes = set(), 0
    for name, old, new in self.produce(native_state, target_state, self.layout):
      if name in written:
        raise ValueError(f"{name} written twice")
      if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
        raise ValueError(f"{name}: mapped {tuple(new.shape)} {new.dtype} != target "
                         f"{tuple(old.shape)} {old.dtype}")
      params[name].set_value(new)
      if delete_old and old is not new and not old.is_deleted():
        old.delete()
      written.add(name)
      nbytes += new.size * new.dtype.itemsize
    if written != set(params):
      raise ValueError(f"not written: {sorted(set(params) - written)[:6]}")
    return {"tensors": len(written), "bytes": int(nbytes)}


def _replicated_on(x: jax.Array):
  """A replicated sharding over the devices of x (its mesh when it has one)."""
  sh = x.sharding
  if isinstance(sh, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec())
  devices = sorted(sh.device_set, key=lambda d: d.id)
  return jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices), ("d",)),
                                    jax.sharding.PartitionSpec())


def _abstract_state(cfg: ModelConfig):
  """The native nnx.State of `cfg`, shapes only (jax.ShapeDtypeStruct leaves)."""
  from grpo_jax.models.transformer import Transformer
  return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def push_into_runner(runner, syncer: Syncer, native_state, *, delete_old: bool = True) -> dict:
  """Writes into a tpu-inference TPUModelRunner (`worker.model_runner`) and re-points its
  dispatch view (`state_leaves`) at the new arrays. Needs a TPU (runs in the vLLM worker)."""
  state = getattr(runner, "state", None)
  if not isinstance(state, nnx.State):
    raise RuntimeError(
        "vLLM-TPU's model runner holds no nnx.State: the model did not load through "
        "tpu-inference's JAX path (MODEL_IMPL_TYPE=flax_nnx); the weight sync writes into "
        f"that state only (got {type(state).__name__})")
  stats = syncer.push(native_state, state, delete_old=delete_old)
  if hasattr(runner, "refresh_state_leaves"):
    runner.refresh_state_leaves()
  else:  # tpu-inference before refresh_state_leaves: what it does
    runner.state_leaves = tuple(jax.tree_util.tree_leaves(runner.state))
  return stats


def _worker_push(worker, syncer: Syncer, native_state, delete_old: bool, free_kv_cache: bool):
  """Runs inside the vLLM worker (collective_rpc, in-process): the push, with the KV cache
  released around it when asked (tpu-inference's weight-update session)."""
  if free_kv_cache:
    worker.start_weight_update(free_kv_cache=True)
  try:
    return push_into_runner(worker.model_runner, syncer, native_state, delete_old=delete_old)
  finally:
    if free_kv_cache:
      worker.finish_weight_update()


# ------------------------------------------------------------------- devices and the engine


def vllm_local_devices(num_devices: int = 0) -> list:
  """The local devices vLLM runs on: all of this process's (0: shared with the trainer), or its
  last `num_devices` (sharding.split_off_local; the trainer's mesh must then leave them out)."""
  if num_devices <= 0:
    return list(jax.local_devices())
  return sharding.split_off_local(num_devices)[1]


def _engine_base():
  from grpo_jax.rollout import vllm_engine
  return vllm_engine.VLLMEngine


def make_engine_class():
  """TPUInferenceEngine, defined on first use (vllm_engine imports stay lazy)."""
  base = _engine_base()

  class TPUInferenceEngine(base):
    """VLLMEngine on vLLM-TPU with the on-device sync of this module (needs a TPU).

    vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: a TPU chip belongs to one
    process, and the sync hands JAX arrays over by reference) on `devices` (default all local
    chips, shared with the trainer; gpu_memory_utilization then caps vLLM's share of HBM),
    with tensor parallelism over them.
    """

    def __init__(self, model_dir: str, *, model_config: ModelConfig, devices=None,
                 free_kv_cache: bool = False, delete_old: bool = True, **kw):
      os.environ.setdefault("MODEL_IMPL_TYPE", "flax_nnx")  # the JAX model, not torchax
      os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
      devices = list(devices if devices is not None else jax.local_devices())
      bad = problems(model_config, len(devices))
      if bad:
        raise ValueError("vLLM-TPU rollout engine: " + "; ".join(bad))
      llm_kwargs = dict(tensor_parallel_size=len(devices), enforce_eager=False)
      if devices != list(jax.local_devices()):
        llm_kwargs["additional_config"] = {"sharding": {"sharding_strategy": {
            "device_indexes": [d.id for d in devices]}}}
      llm_kwargs.update(kw.pop("llm_kwargs", None) or {})
      self.syncer = Syncer(model_config)
      self.free_kv_cache = free_kv_cache
      self.delete_old = delete_old
      self.last_sync_bytes = 0
      super().__init__(model_dir, llm_kwargs=llm_kwargs, **kw)

    @classmethod
    def extra_init_kwargs(cls, config, policy, mesh) -> dict:
      n = int(config.rollout.vllm.get("num_devices", 0))
      return dict(model_config=policy.model_config, devices=vllm_local_devices(n))

    def _sync_and_verify(self, rollout_state):
      with jax.transfer_guard("allow"):  # the caller's guard does not reach this thread
        t0 = time.time()
        self.llm.reset_prefix_cache()  # cached KV blocks came from the old weights
        stats = self.llm.collective_rpc(
            _worker_push, args=(self.syncer, rollout_state, self.delete_old, self.free_kv_cache))
        self.last_sync_bytes = int(stats[0]["bytes"]) if stats else 0
        self.last_sync_sec = time.time() - t0
        if self.verify_sync:
          self.verify(rollout_state)

    def stats(self) -> dict[str, float]:
      return dict(super().stats(), **{"perf/weight_sync_gib": self.last_sync_bytes / 2**30})

  return TPUInferenceEngine


_ENGINE_CLASS: Callable | None = None


def engine_class():
  global _ENGINE_CLASS
  if _ENGINE_CLASS is None:
    _ENGINE_CLASS = make_engine_class()
  return _ENGINE_CLASS


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


__all__ = ["Layout", "Rule", "Syncer", "available", "engine_class", "from_target",
           "from_target_tree", "layout_summary", "padded_head_dim", "padded_num_heads",
           "problems", "push_into_runner", "rules", "target_names", "target_params",
           "target_shapes", "to_target", "to_target_tree", "vllm_local_devices"]
