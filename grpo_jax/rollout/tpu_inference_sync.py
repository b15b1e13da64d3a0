"""vLLM on TPU: the native policy's weights written into tpu-inference's JAX model, on device.

vLLM's TPU backend (`tpu-inference`, installed by `vllm-tpu`) holds Qwen3 and Llama weights as
JAX arrays in `worker.model_runner.state`, so a weight sync needs no torch and no host: each
native parameter is mapped by rollout/tpu_inference_mapping.py (names, layouts, padding) inside
a jitted function on the trainer's devices that also places it in the sharding the engine's
array already has (or, on other chips, `jax.device_put` from one device's copy: device to
device), and the engine's arrays are replaced in place (`Syncer.push` checks that every target
parameter is written exactly once with its shape unchanged).

The engine (`TPUInferenceEngine`) is rollout/vllm_engine.py's VLLMEngine with this sync in place
of the torch `reload_weights` path; generation, the probe fingerprint check (trainer vs vLLM
log-probs of a fixed sequence after every sync), the timeout and stats are VLLMEngine's. It
needs a TPU and is not exercised by the CPU tests (tests/rollout/test_tpu_inference.py tests the
mapping against tpu-inference's own model classes instantiated abstractly and against its own
checkpoint loaders fed our HF export, and the push into a sharded target state on CPU devices
with host transfers disallowed).
"""

import os
import time
from typing import Callable, Iterator

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.rollout.tpu_inference_mapping import Layout
from grpo_jax.rollout.tpu_inference_mapping import Rule
from grpo_jax.rollout.tpu_inference_mapping import TPU_INFERENCE_VERSION
from grpo_jax.rollout.tpu_inference_mapping import layer_inputs
from grpo_jax.rollout.tpu_inference_mapping import native_flat
from grpo_jax.rollout.tpu_inference_mapping import problems
from grpo_jax.rollout.tpu_inference_mapping import rules
from grpo_jax.rollout.tpu_inference_mapping import target_names
from grpo_jax.rollout.tpu_inference_mapping import target_params
from grpo_jax.rollout.tpu_inference_mapping import target_shapes
from grpo_jax.rollout.tpu_inference_mapping import to_target
from grpo_jax.rollout.tpu_inference_mapping import to_target_tree

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
          f"(grpo_jax/rollout/tpu_inference_mapping.py, read from tpu-inference "
          f"{TPU_INFERENCE_VERSION}): missing {missing[:6]}{'...' if len(missing) > 6 else ''}, "
          f"unexpected {extra[:6]}{'...' if len(extra) > 6 else ''}"
      )
    lay = Layout.from_target(self.cfg, shapes)
    got = jax.eval_shape(lambda st: to_target_tree(st, self.cfg, lay), _abstract_state(self.cfg))
    bad = {n: (tuple(got[n].shape), shapes[n]) for n in want if tuple(got[n].shape) != shapes[n]}
    if bad:
      raise ValueError(
          f"tpu-inference parameter shapes differ from the mapping's (mapped, "
          f"target): {dict(list(bad.items())[:6])}"
      )
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

  def produce(
      self, native_state, target_state, lay: Layout
  ) -> Iterator[tuple[str, jax.Array, jax.Array]]:
    """(target name, current target array, new array in its layout, dtype and sharding)."""
    params = target_params(target_state)
    flat = native_flat(native_state, self.cfg)
    for r in rules(self.cfg):
      x = layer_inputs(r, flat, self.cfg)
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
        raise ValueError(
            f"{name}: mapped {tuple(new.shape)} {new.dtype} != target "
            f"{tuple(old.shape)} {old.dtype}"
        )
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
  return jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.asarray(devices), ("d",)), jax.sharding.PartitionSpec()
  )


def _abstract_state(cfg: ModelConfig):
  """The native nnx.State of `cfg`, shapes only (jax.ShapeDtypeStruct leaves)."""
  from grpo_jax.models.decoder.transformer import Transformer

  return nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)


def push_into_runner(runner, syncer: Syncer, native_state, *, delete_old: bool = True) -> dict:
  """Writes into a tpu-inference TPUModelRunner (`worker.model_runner`) and re-points its
  dispatch view (`state_leaves`) at the new arrays. Needs a TPU (runs in the vLLM worker)."""
  state = getattr(runner, "state", None)
  if not isinstance(state, nnx.State):
    raise RuntimeError(
        "vLLM-TPU's model runner holds no nnx.State: the model did not load through "
        "tpu-inference's JAX path (MODEL_IMPL_TYPE=flax_nnx); the weight sync writes into "
        f"that state only (got {type(state).__name__})"
    )
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

    def __init__(
        self,
        model_dir: str,
        *,
        model_config: ModelConfig,
        devices=None,
        free_kv_cache: bool = False,
        delete_old: bool = True,
        **kw,
    ):
      os.environ.setdefault("MODEL_IMPL_TYPE", "flax_nnx")  # the JAX model, not torchax
      os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
      devices = list(devices if devices is not None else jax.local_devices())
      bad = problems(model_config, len(devices))
      if kw.get("lora_config") is not None:
        bad.append(
            "rollout.vllm.lora_sync='adapters' is for vLLM on CPU/GPU; on TPU the "
            "merged weights are written on device, chip to chip (no host copy). Fix: "
            "--config.rollout.vllm.lora_sync=merged"
        )
      if bad:
        raise ValueError("vLLM-TPU rollout engine: " + "; ".join(bad))
      llm_kwargs = dict(tensor_parallel_size=len(devices), enforce_eager=False)
      if devices != list(jax.local_devices()):
        llm_kwargs["additional_config"] = {
            "sharding": {"sharding_strategy": {"device_indexes": [d.id for d in devices]}}
        }
      llm_kwargs.update(kw.pop("llm_kwargs", None) or {})
      self.syncer = Syncer(model_config)
      self.free_kv_cache = free_kv_cache
      self.delete_old = delete_old
      self.last_sync_bytes = 0
      super().__init__(model_dir, llm_kwargs=llm_kwargs, **kw)

    @classmethod
    def extra_init_kwargs(cls, config, policy, mesh) -> dict:
      n = int(config.rollout.vllm.num_devices)
      return dict(model_config=policy.model_config, devices=vllm_local_devices(n))

    def _sync_and_verify(self, rollout_state):
      with jax.transfer_guard("allow"):  # the caller's guard does not reach this thread
        t0 = time.time()
        self.llm.reset_prefix_cache()  # cached KV blocks came from the old weights
        stats = self.llm.collective_rpc(
            _worker_push, args=(self.syncer, rollout_state, self.delete_old, self.free_kv_cache)
        )
        self.last_sync_bytes = int(stats[0]["bytes"]) if stats else 0
        self.last_sync_sec = time.time() - t0
        if self.verify_sync:
          self.verify(rollout_state)

  return TPUInferenceEngine


_ENGINE_CLASS: Callable | None = None


def engine_class():
  global _ENGINE_CLASS
  if _ENGINE_CLASS is None:
    _ENGINE_CLASS = make_engine_class()
  return _ENGINE_CLASS
