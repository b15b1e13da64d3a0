"""Compiling a GRPO step's programs in the background, before their first call.

    ahead = CompileAhead(config, grpo, engine=engine, generation=train_gen, key=a_step_key)
    ahead.submit(prompt, state)              # as soon as a batch's prompt width is known
    ahead.wait(width, only="sampler")        # before the rollout: the sampler is compiled
    ...                                      # rollout, rewards: the main thread goes on
    ahead.wait(width)                        # before step 4: its programs are compiled

Every prompt width (`data.prompt_width`) is one set of programs: the sampler's (native engine),
the advantages/assembly, the log-prob pass (policy and reference), the KL fold, the update and
the step's statistics. Their input shapes follow from the config and the width alone, so they
can be lowered on abstract inputs (`jax.ShapeDtypeStruct` with the shardings the loop's arrays
will carry) and compiled in a worker thread while the main thread runs the evaluation or the
step before (when the main thread needs them, `wait` compiles in it those the worker has not
started yet); jit's own caches then serve the real calls. The rollout source (rollout/source.py)
submits the first batch's width before the evaluation that precedes GRPO, and each later new
width when it prefetches the next step's prompts, so a new width compiles while the device runs
the current step. XLA compiles with the GIL released: the compiles (and the device) overlap.

Packed rows (config.pack_sequences): their shapes follow each step's lengths, so the first
packed shape of a run compiles at its first use; from then on every step the Packer sends the
shapes its lengths are likely to drift to (`packed`: the gather, the log-prob passes, the KL fold, the update,
the unpack on the same arrays with other row counts), and the Packer waits for a shape's
programs (`wait_packed`) before its first call. The loop asks this on GPU and TPU only
(train.py: on CPU the background compiles would take the cores the steps run on).

The abstract inputs are made by the same jitted functions the loop calls (`jax.eval_shape` of
each, chained as in rl/step.py's GrpoStep: steps 4-6), starting from the engine-independent
`Rollout.spec`,
so they carry the out_shardings the real arrays get; the sampler's come from the engine
(`NativeEngine.program`). Where they still differ from a real call (e.g. DAPO's combined
rounds), that call compiles at its first use as it would without this; a failure here is
logged and changes nothing else.
"""

import concurrent.futures
import dataclasses
import threading
import time

from absl import logging
import jax
import jax.numpy as jnp

from grpo_jax.parallel import sharding
from grpo_jax.rl import packing
from grpo_jax.rl import replay
from grpo_jax.rollout.types import Rollout


def abstract(tree, *, on_device: bool = False):
  """Arrays (or ShapeDtypeStructs) -> ShapeDtypeStructs with their shape, dtype, sharding and
  weak type (all part of jit's cache key; checkpoint.abstract_like drops the weak type).
  on_device: host-offloaded (pinned_host) ones as the loop passes them, moved to device."""

  def one(x):
    s = getattr(x, "sharding", None)
    if on_device and getattr(s, "memory_kind", None) == "pinned_host":
      s = s.with_memory_kind("device")
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=s, weak_type=getattr(x, "weak_type", False)
    )

  return jax.tree.map(one, tree)


class _Width:
  """The programs of one prompt width (or of one packed shape at a width): a list the worker
  thread and `wait` both take from."""

  def __init__(self, width: int, first: bool, label: str = ""):
    self.width = width
    self.label = label or f"prompt width {width}"
    self.first = first  # the first width submitted (its sampler goes after the update)
    self.state = self.ref = None  # the width's abstract state and reference (packed shapes')
    self.tasks = None  # [(name, jitted fn, abstract args)], set once planned
    self.planned = threading.Event()
    self._taken, self._done, self._lock = set(), set(), threading.Condition()
    self.errors: list[str] = []
    self.reported = False
    self.t0 = time.perf_counter()

  def run(self, only: str | None = None):
    """Compiles in this thread, one at a time and in order, the programs no thread has taken
    yet (`only`: just the one of that name, if no thread has); -> once those (that one) are
    compiled, after waiting for the ones another thread is compiling."""
    names = [name for name, _, _ in self.tasks]
    wanted = ([names.index(only)] if only in names else []) if only else range(len(names))
    for i in wanted:
      with self._lock:
        if i in self._taken:
          continue
        self._taken.add(i)
      name, fn, args = self.tasks[i]
      try:
        fn.lower(*args).compile()
      except Exception as e:  # pylint: disable=broad-except
        self.errors.append(f"{name}: {type(e).__name__}: {e}")
      finally:
        with self._lock:
          self._done.add(i)
          self._lock.notify_all()
    with self._lock:
      while not all(i in self._done for i in wanted):
        self._lock.wait()


class CompileAhead:
  """A worker thread that compiles the step programs of each new prompt width once; the main
  thread, when it needs them (`wait`), compiles those the worker has not started yet."""

  def __init__(self, config, grpo, *, engine=None, generation=None, key=None):
    """grpo: rl/step.py's GrpoStep, whose programs (and the reference's) these are. engine,
    generation, key: the rollout engine, the train generation config and a step's RNG key (its
    shape and sharding): the sampler's program is compiled ahead too when the engine has one to
    give (`engine.program`: the native engine; vLLM's compiles its own)."""
    self.config, self.grpo = config, grpo
    self.engine, self.generation, self.key = engine, generation, key
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile_ahead")
    self._widths: dict[int, _Width] = {}
    self._lock = threading.Lock()

  def submit(self, prompt: dict, state: dict) -> bool:
    """Starts compiling for the width of `prompt` ({"ids", "mask"}: global [B, P] arrays)
    unless that width was submitted before. -> whether it started."""
    width, ref_params = prompt["ids"].shape[1], self.grpo.reference.params
    with self._lock:
      if width in self._widths:
        return False
      job = self._widths[width] = _Width(width, first=not self._widths)
      # Abstract copies now, in the caller's thread: `state` is donated by the next update.
      args = (
          abstract(prompt["ids"]),
          abstract(prompt["mask"]),
          abstract(state),
          None if ref_params is None else abstract(ref_params, on_device=True),
          self._sampler(job, prompt, state),
      )
      job.state, job.ref = args[2], args[3]
      self._pool.submit(self._work, job, *args)
    return True

  def packed(self, width: int, shapes, upd: dict, where, packed: dict) -> None:
    """Packed rows (rl/packing.py's Packer, every step): the programs of each of `shapes` not
    submitted before [(rows, head rows, micro-batches)] at prompt `width` (the gather, the
    log-prob passes, the update, the unpack) compile in the worker, so a later step whose
    lengths land on one of them finds it compiled (`wait_packed`). upd: the padded update batch,
    where: the plan's two [N] arrays, packed: the packed batch of this step (its shardings are
    the ones every packed shape's arrays carry; only the row counts differ). Abstract copies
    are taken here. Routing replay's packed passes compile at their first use."""
    parent = self._widths.get(width)
    shapes = [s for s in shapes if (width, s) not in self._widths]
    if parent is None or self.grpo.replay or not shapes:
      return
    args = (abstract(upd), abstract(where), abstract(packed))
    with self._lock:
      for shape in shapes:
        label = f"packed rows {shape[0]} (LM head {shape[1]}, {shape[2]} micro-batches) x {width}"
        job = self._widths[(width, shape)] = _Width(width, first=False, label=label)
        self._pool.submit(self._work_packed, job, parent, shape, *args)

  def wait_packed(self, width: int, shape) -> bool:
    """-> whether the packed `shape` at `width` was submitted (`packed`); if so, returns once
    its programs are compiled (or failed), compiling in this thread those not started."""
    job = self._widths.get((width, tuple(shape)))
    if job is None:
      return False
    self.wait((width, tuple(shape)))
    return True

  def _sampler(self, job: _Width, prompt: dict, state: dict):
    """("sampler", program, abstract args) for the engine's program at this width, or None."""
    program = getattr(self.engine, "program", None)
    if program is None or self.key is None:
      return None
    try:
      got = program(state["params"], prompt, self.key, self.generation)
    except Exception as e:  # pylint: disable=broad-except
      job.errors.append(f"sampler: {type(e).__name__}: {e}")
      return None
    return None if got is None else ("sampler", got[0], abstract(got[1]))

  def wait(self, width, only: str | None = None) -> None:
    """Returns once the programs for `width` (or a packed shape's (width, shape) key) are
    compiled (or failed), compiling in this thread
    those the worker has not started; no-op if `width` was never submitted. only="sampler":
    just the sampler's program (before the rollout; none with the vLLM engine)."""
    job = self._widths.get(width)
    if job is not None:
      job.planned.wait()
      job.run(only)
      if job.errors and not job.reported:
        job.reported = True
        logging.warning(
            "compiling ahead for %s failed (those programs compile at their first call "
            "instead): %s",
            job.label,
            "; ".join(job.errors),
        )

  def close(self):
    """Drops the widths not started; a compile in flight is waited for (XLA's cannot be
    interrupted), so an exit can take up to one compile longer; a stop's checkpoint save is
    under way by then and finishes beside it."""
    self._pool.shutdown(wait=True, cancel_futures=True)

  def _work(self, job: _Width, ids, mask, state, ref, sampler):
    try:
      job.tasks = self._programs(ids, mask, state, ref)
    except Exception as e:  # pylint: disable=broad-except
      job.tasks = []
      job.errors.append(f"planning: {type(e).__name__}: {e}")
    if sampler:  # a later width: first, it is needed first; the first width: after the
      # update, which compiles longest, so that the first rollout's wait compiles the sampler
      # beside it when the loop gets there before the worker (no evaluation before GRPO)
      job.tasks.insert(min(int(job.first), len(job.tasks)), sampler)
    job.planned.set()
    job.run()
    logging.info(
        "compiled ahead the step programs for %s in %.1f s", job.label, time.perf_counter() - job.t0
    )

  def _work_packed(self, job: _Width, parent: _Width, shape, upd, where, packed):
    parent.planned.wait()  # the width's own programs first
    try:
      job.tasks = self._packed_programs(parent, shape, upd, where, packed)
    except Exception as e:  # pylint: disable=broad-except
      job.tasks = []
      job.errors.append(f"planning: {type(e).__name__}: {e}")
    job.planned.set()
    job.run()
    logging.info(
        "compiled ahead the step programs for %s in %.1f s", job.label, time.perf_counter() - job.t0
    )

  def _packed_programs(self, parent: _Width, shape, upd, where, packed):
    """[(name, jitted fn, abstract args)] of one packed shape, in the loop's order (GrpoStep:
    the gather, the old and reference passes, the KL fold, the update, the unpack of the old
    log-probs for the step's figures), on `packed`'s arrays given `shape`'s row counts."""
    c, grpo, fns, mesh = self.config, self.grpo, self.grpo.fns, self.grpo.mesh
    rows, heads, n = shape
    batch = {}
    for k, v in packed.items():
      if k in ("sequences", "micro_batches"):  # per sequence [N, ...]; static
        batch[k] = v
        continue
      lead = heads if k == "head_slots" else rows
      batch[k] = jax.ShapeDtypeStruct(
          (lead, *v.shape[1:]), v.dtype, sharding=v.sharding, weak_type=v.weak_type
      )
    batch["micro_batches"] = packing.MicroBatches(n)
    programs = [("pack", fns.pack, (upd, *where, rows, heads, n))]
    args = tuple(
        batch[k] for k in ("input_ids", "segment_ids", "positions", "head_slots", "micro_batches")
    )
    logp = jax.ShapeDtypeStruct(
        batch["input_ids"].shape, jnp.float32, sharding=sharding.batch_sharding(mesh, 2)
    )
    if grpo.old_logp == "trainer":
      programs.append(("old logprobs", fns.packed_logprobs, (parent.state["params"], *args)))
      batch["old_logp"] = logp
    if grpo.reference.enabled:  # LoRA: the base of the state's own params; else the reference
      policy = grpo.reference.policy
      ref = policy.reference(parent.state["params"]) if policy.reference else parent.ref
      programs.append(("ref logprobs", fns.packed_logprobs, (ref, *args)))
      batch["ref_logp"] = logp
    if c.kl_in_reward:
      rewards = jax.ShapeDtypeStruct(
          upd["advantages"].shape, jnp.float32, sharding=sharding.batch_sharding(mesh, 1)
      )
      # the same arrays back (the advantages again): the same shapes and shardings
      programs.append(("fold_kl", fns.packed_fold_kl, (batch, rewards)))
    programs.append(("update", fns.update, (parent.state, batch)))
    if "old_logp" in batch:
      programs.append(("unpack", fns.unpack, (batch["old_logp"], batch["sequences"]["slot"])))
    return programs

  def _programs(self, ids, mask, state, ref):
    """[(name, jitted fn, abstract args)]: the update first (it compiles longest, so the worker
    starts on it), then the loop's order (what the main thread will take when it waits)."""
    c, grpo, fns, mesh = self.config, self.grpo, self.grpo.fns, self.grpo.mesh
    rows = ids.shape[0] * c.num_generations
    rollout = Rollout.spec(rows, c.max_completion_length, mesh)
    if grpo.replay:  # the sampler's routing record rides the rollout (rl/replay.py)
      width = ids.shape[1] + c.max_completion_length
      routes = replay.routes_spec(grpo.reference.policy.model_config, rows, width, mesh)
      rollout = dataclasses.replace(rollout, routes=routes)
    rewards = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=sharding.batch_sharding(mesh, 1))
    assemble = ("assemble", fns.assemble, (ids, mask, rollout, rewards))
    if packing.packs(c):  # packed shapes follow the step's lengths: the first compiles at its
      return [assemble]  # first use, the likely next ones ahead from there (`packed`)
    upd = jax.eval_shape(fns.assemble, *assemble[2])
    programs = [assemble]
    # Routing replay (rl/replay.py): every log-prob pass is the routed program, on the rows
    # and their routes (assemble's: -1 where the spec has none), and the old pass runs even
    # with the sampler's log-probs (it measures rollout/route_mismatch).
    if grpo.replay:
      fn = fns.routed_logprobs  # -> (log-probs, route_mismatch)
      rows_args = (upd["input_ids"], upd["attention_mask"], upd["routes"], upd["completion_mask"])
    else:
      fn, rows_args = fns.logprobs, (upd["input_ids"], upd["attention_mask"])

    def logprobs(name, params):  # the program, and its log-probs' shape
      programs.append((name, fn, (params, *rows_args)))
      out = jax.eval_shape(fn, params, *rows_args)
      return out[0] if grpo.replay else out

    if grpo.old_logp == "sampler":
      upd["old_logp"] = rollout.logprobs
    if grpo.old_logp == "trainer" or grpo.replay:
      logp = logprobs("old logprobs", state["params"])
      if grpo.old_logp == "trainer":
        upd["old_logp"] = logp
    if c.beta > 0:  # LoRA: the base of the state's own params; else the stored reference
      policy = grpo.reference.policy
      ref = policy.reference(state["params"]) if policy.reference else ref
      upd["ref_logp"] = logprobs("ref logprobs", ref)
    kl_rewards = None
    if c.kl_in_reward:
      programs.append(("fold_kl", fns.fold_kl, (upd, rewards)))
      upd, kl_rewards = jax.eval_shape(fns.fold_kl, upd, rewards)
    update = ("update", fns.update, (state, upd))
    mismatch = (
        {}
        if grpo.matches_trainer
        else dict(sampler_logp_nc=rollout.logprobs, trainer_logp_nc=upd["old_logp"])
    )
    if kl_rewards is not None:
      mismatch["kl_rewards_n"] = kl_rewards
    stats = (
        "statistics",
        _with_kwargs(grpo.stats_fn, mismatch),
        (rewards, upd["advantages"], rollout.mask),
    )
    return [update, *programs, stats]


class _with_kwargs:
  """fn.lower(*args) with keyword arguments bound (the loop calls stats_fn(..., **kw))."""

  def __init__(self, fn, kwargs):
    self.fn, self.kwargs = fn, kwargs

  def lower(self, *args):
    return self.fn.lower(*args, **self.kwargs)
