"""Compiling a GRPO step's programs in the background, before their first call.

    ahead = CompileAhead(config, fns, stats_fn, policy, mesh, needs_old_logp=...)
    ahead.submit(prompt, state, ref_params)  # as soon as a batch's prompt width is known
    ...                                      # rollout, rewards: the main thread goes on
    ahead.wait(width)                        # before step 4: its programs are compiled

Every prompt width (`data.prompt_width`) is one set of programs: the advantages/assembly,
the log-prob pass (policy and reference), the KL fold, the update and the step's statistics.
Their input shapes follow from the config and the width alone, so they can be lowered on
abstract inputs (`jax.ShapeDtypeStruct` with the shardings the loop's arrays will carry) and
compiled in a worker thread while the main thread compiles and runs the rollout; jit's own
caches then serve the real calls. The loop submits the first batch's width before the
evaluation that precedes GRPO, and each later new width when it prefetches the next step's
prompts, so a new width compiles while the device runs the current step. XLA compiles with the
GIL released: the two compiles (and the device) overlap.

The abstract inputs are made by the same jitted functions the loop calls (`jax.eval_shape` of
each, chained as in train.py's steps 4-6), starting from the engine-independent `Rollout.spec`,
so they carry the out_shardings the real arrays get. Where they still differ from a real call
(e.g. DAPO's combined rounds), that call compiles at its first use as it would without this;
a failure here is logged and changes nothing else.
"""
import concurrent.futures
import threading
import time

from absl import logging
import jax
import jax.numpy as jnp

from grpo_jax import sharding
from grpo_jax.rollout.types import Rollout


def abstract(tree):
  """Arrays (or ShapeDtypeStructs) -> ShapeDtypeStructs with their shape, dtype, sharding."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, "sharding", None),
      weak_type=getattr(x, "weak_type", False)), tree)


def _on_device(tree):
  """The reference's arrays as the loop passes them: host-offloaded ones moved to device."""
  def one(x):
    s = x.sharding
    if getattr(s, "memory_kind", None) == "pinned_host":
      s = s.with_memory_kind("device")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type)
  return jax.tree.map(one, tree)


class CompileAhead:
  """One worker thread that compiles the step programs of each new prompt width once."""

  def __init__(self, config, fns, stats_fn, policy, mesh, *, needs_old_logp: bool,
               matches_trainer: bool):
    self.config, self.fns, self.stats_fn, self.policy, self.mesh = (
        config, fns, stats_fn, policy, mesh)
    self.needs_old_logp, self.matches_trainer = needs_old_logp, matches_trainer
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile_ahead")
    self._futures: dict[int, concurrent.futures.Future] = {}
    self._lock = threading.Lock()

  def submit(self, prompt: dict, state: dict, ref_params) -> bool:
    """Starts compiling for the width of `prompt` ({"ids", "mask"}: global [B, P] arrays)
    unless that width was submitted before. -> whether it started."""
    width = prompt["ids"].shape[1]
    with self._lock:
      if width in self._futures:
        return False
      # Abstract copies now, in the caller's thread: `state` is donated by the next update.
      args = (abstract(prompt["ids"]), abstract(prompt["mask"]), abstract(state),
              None if ref_params is None else _on_device(abstract(ref_params)))
      self._futures[width] = self._pool.submit(self._compile, width, *args)
    return True

  def wait(self, width: int) -> None:
    """Blocks until the programs for `width` are compiled (or failed); no-op if never
    submitted."""
    future = self._futures.get(width)
    if future is not None:
      future.result()

  def close(self):
    self._pool.shutdown(wait=True, cancel_futures=True)

  def _compile(self, width, ids, mask, state, ref):
    try:
      t0 = time.perf_counter()
      for fn, args in self._programs(ids, mask, state, ref):
        fn.lower(*args).compile()
      logging.info("compiled ahead the step programs for prompt width %d in %.1f s", width,
                   time.perf_counter() - t0)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("compiling ahead for prompt width %d failed (the step's programs compile "
                      "at their first call instead): %s: %s", width, type(e).__name__, e)

  def _programs(self, ids, mask, state, ref):
    """(jitted fn, abstract args) in train.py's order, the update first: it compiles longest
    and the main thread needs it last."""
    c, fns, mesh = self.config, self.fns, self.mesh
    rows = ids.shape[0] * c.num_generations
    rollout = Rollout.spec(rows, c.max_completion_length, mesh)
    rewards = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=sharding.batch_sharding(mesh, 1))
    assemble = (fns.assemble, (ids, mask, rollout, rewards))
    upd = jax.eval_shape(fns.assemble, *assemble[1])
    programs = [assemble]
    if self.needs_old_logp:
      programs.append((fns.logprobs, (state["params"], upd["input_ids"], upd["attention_mask"])))
      upd["old_logp"] = jax.eval_shape(fns.logprobs, *programs[-1][1])
    if c.beta > 0:  # LoRA: the base of the state's own params; else the stored reference
      ref = self.policy.reference(state["params"]) if self.policy.reference else ref
      programs.append((fns.logprobs, (ref, upd["input_ids"], upd["attention_mask"])))
      upd["ref_logp"] = jax.eval_shape(fns.logprobs, *programs[-1][1])
    kl_rewards = None
    if c.kl_in_reward:
      programs.append((fns.fold_kl, (upd, rewards)))
      upd, kl_rewards = jax.eval_shape(fns.fold_kl, upd, rewards)
    update = (fns.update, (state, upd))
    mismatch = {} if self.matches_trainer else dict(sampler_logp_nc=rollout.logprobs,
                                                   trainer_logp_nc=upd["old_logp"])
    if kl_rewards is not None:
      mismatch["kl_rewards_n"] = kl_rewards
    stats = (_with_kwargs(self.stats_fn, mismatch),
             (rewards, upd["advantages"], rollout.mask))
    return [update, *programs, stats]


class _with_kwargs:
  """fn.lower(*args) with keyword arguments bound (the loop calls stats_fn(..., **kw))."""

  def __init__(self, fn, kwargs):
    self.fn, self.kwargs = fn, kwargs

  def lower(self, *args):
    return self.fn.lower(*args, **self.kwargs)
