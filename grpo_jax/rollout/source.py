"""The loop's rollout source: GRPO steps 1-3 (prompts, rollout, rewards) behind one call.

    source = RolloutSource(config, engine=..., prompts=..., scorer=Scorer(config, ...), ...)
    source.start(state, step)                # before the loop: the first width compiles ahead
    scored = source.next(state, step)        # the step's scored batch (Scored)
    source.while_updating(step)              # host work while the device updates
    source.after_update(state["params"])     # the sampler's weights follow the update

The loop asks it for "the next scored batch" and does not care how it was made:
- on-policy (rollout.max_staleness = 0): sampled now, from the weights of this step;
- k steps off (max_staleness = k > 0): the rollouts of the next k steps are in flight while
  the trainer updates on this one, each sampled from the weights of the step that dispatched
  it (rollout of step s: the weights after s - k updates; the first k steps are fresher);
  rollout/staleness logs s minus that version. The loss stays correct off-policy: the loop
  takes the old log-probs from the sampler (`Scored.behaviour_logp`), the behaviour policy.
- streaming (rollout.slots > 0 and max_staleness = k > 0; rollout/streaming.py): the prompts
  of up to k steps ahead are queued in the slot engine, each step with its own key
  step_key(rng, step); between updates the engine decodes until the step that is due has all
  its rows, while slots freed by its finished rows take the next steps' groups. After each
  update the new weights land between decode chunks (`set_weights`, version = updates
  applied; disaggregated: after their move to the sampler's devices), so a row may straddle
  versions; every token keeps the version that drew it and its log-prob under it (the
  loss's old log-probs). Step u is queued at step u - k at the earliest, so no token is more
  than k updates old. Disaggregated, the next step's rows are finished while the trainer
  updates (`while_updating`); colocated, the device takes turns. Logged: rollout/staleness
  (step - the oldest version in the batch), rollout/staleness_token_mean and _max (step - each
  completion token's version), rollout/slots_busy. A step waits for all its rows.
- partial rollouts (streaming with rollout.partial_rollout; APRIL / slime / Kimi k1.5): the
  batch of step t is the first B whole groups to finish among all groups in flight (step t's,
  the queued later steps', those carried from earlier steps), by decode chunk, the oldest
  queued first among those of one chunk (streaming.first_finished; the engine's first
  process's choice, sent to every process). A group still running keeps its slots and trains
  in the first step after it finishes, but no later than step u + k for a group queued for
  step u: that step waits for it. A group's tokens come from weights >= u - k (queued at step
  u - k at the earliest), so token staleness <= 2k (k without partial rollouts). Each group
  carries its prompt's train row (`NextPrompts.of`): rewards read its own answers whatever
  step trains it; groups are never split (advantages are per group). Logged besides:
  rollout/carried_groups (groups of the batch queued for an earlier step) and
  rollout/early_groups (for a later one). The trade: no step waits for its longest row, but
  each batch leans to short completions (a long row trains later, with older tokens).
- DAPO dynamic sampling's extra rounds (loss.dynamic_sampling) happen inside: on fresh prompts,
  from the current weights, until the step holds batch_size groups with signal (not with
  streaming).

Compiling ahead (run/compile_ahead.py, `ahead`): the source knows each batch's prompt width
first, so it submits it: the first before the loop (`start`), each next one while the device
samples the current step; it waits for the sampler's program before a rollout, and for the step
programs before it hands the batch over.

Checkpoints: the in-flight rollouts are saved with the step (`saved()`: their arrays; meta
"rollout_pending": the data iterator's position before each of their prompt batches) and put
back by `restore()`, so a resumed run trains on exactly the rollouts an uninterrupted one does.
Rewards are host functions of the saved completions: recomputed on resume.
Streaming saves no rows in flight: the source queues no step past the next checkpoint it can
foresee (every save_interval_steps, num_steps, the max_steps_per_run stop), so the engine is
empty at those and a resumed run equals one never stopped. At a checkpoint it cannot foresee
(a preemption's), the queued steps are dropped: meta "rollout_pending" holds the iterator
position before the first of them, and the resumed run draws them again from there with the
restored weights (same prompts and keys; the tokens match the uninterrupted run's only where
the weights that drew them would match, so from that checkpoint on the runs may differ).
Partial rollouts keep this: with no step queued past a foreseen checkpoint, the step before it
finds exactly B groups left and waits for them all (no carry), so the engine is empty there;
at an unforeseen one the carried groups of steps already trained are dropped too (their
prompts are not drawn again).

Multi-host: each process scores its own rows of the batch (multihost.local_rows).
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.rollout import dynamic_sampling as dyn_lib
from grpo_jax.parallel import multihost
from grpo_jax.run import profiling
from grpo_jax.parallel import sharding
from grpo_jax.parallel import transfer
from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rollout.types import GenerationConfig
from grpo_jax.rollout.types import Rollout


@dataclasses.dataclass
class Scored:
  """One step's batch. prompt: global {"ids", "mask"} [B, P]; rollout: global Rollout [N, C];
  rewards: global f32 [N]; host: this process's rows (tokens, mask, truncated, rewards,
  per_function, errors; versions [n, C] when streaming, else None); figures: host figures to
  log; behaviour_logp: the sampler's per-token log-probs [N, C] when the batch is off-policy
  (the old log-probs), else None."""

  prompt: dict
  rollout: Rollout
  rewards: jax.Array
  host: dict
  figures: dict
  behaviour_logp: jax.Array | None = None


@dataclasses.dataclass
class _Drawn:
  """A dispatched rollout: the host prompt batch, the global prompt arrays, the Rollout, the
  version of the weights that sampled it (updates applied) and the iterator state before its
  prompts were taken."""

  batch: dict
  prompt: dict
  rollout: Rollout
  version: int
  iterator_before: dict
  scored: tuple | None = None  # (prompt, rollout, host) once scored ahead (while_updating)
  step: int = -1  # streaming: the step it was queued for (rollout None until taken)
  versions: jax.Array | None = None  # streaming: each token's weight version [N, C]
  groups: np.ndarray | None = None  # partial rollouts: the batch's (step queued, index) [B, 2]
  timing: dict = dataclasses.field(default_factory=lambda: {"rollout": 0.0, "rewards": 0.0})


class RolloutSource:

  def __init__(
      self,
      config,
      *,
      engine,
      prompts,
      scorer,
      mesh,
      rng,
      sampler_mesh=None,
      policy=None,
      ahead=None
  ):
    """scorer: Scorer (step 3, on the host). mesh: the trainer's. sampler_mesh
    (placement=disaggregated; `engine` and `prompts` on it, `policy` for LoRA's split/combine):
    the sampler's, else the trainer's. The engine maps the moved weights for its sampler itself
    (policy.rollout_params, on the sampler's mesh). ahead: run/compile_ahead.py's CompileAhead
    (config.compile_ahead), else None."""
    self.config, self.engine, self.prompts, self.mesh = config, engine, prompts, mesh
    self.scorer = scorer
    self.ahead = ahead
    self.depth = config.rollout.max_staleness
    self.generation = generation(config)
    self.dynamic = config.loss.dynamic_sampling and config.loss.max_resample_rounds > 0
    self.sampler_mesh = sampler_mesh or mesh
    self.disaggregated = self.sampler_mesh is not mesh
    self.rng = rng
    self._pending = collections.deque()  # _Drawn, oldest first
    self._version = 0  # updates applied to the weights the sampler reads
    self._first_step = 0
    self.stream = engine.stream() if streaming(config) else None
    self.partial = self.stream is not None and config.rollout.partial_rollout
    self._indices = {}  # partial rollouts: step -> its prompts' train rows [B], while in flight
    # Rows with tool turns: rewards see them turn by turn (Scorer's tool_nc).
    self.tools = bool(config.rollout.tools.names.strip())
    if self.stream is not None:
      self.stream.reset(self.generation, rows_per_step=config.batch_size * config.num_generations)
    self._take_groups = jax.jit(
        functools.partial(dyn_lib.take, group_size=config.num_generations),
        out_shardings=sharding.batch_sharding(self.sampler_mesh, 1),
    )
    self._sync_figures = {}
    if self.disaggregated:
      self.rng = jax.random.wrap_key_data(
          multihost.replicated(  # the session's key, there
              jax.random.key_data(jax.random.key(config.seed)), self.sampler_mesh
          )
      )
      self._to_sampler = transfer.CrossMesh(mesh, self.sampler_mesh)
      self._to_trainer = transfer.CrossMesh(self.sampler_mesh, mesh)
      self._split, self._combine = policy.split, policy.combine  # LoRA: only adapters travel
      self._weights = None  # the sampler's copy (LoRA: its adapters), in config.model.dtype
      self._base = None  # LoRA: the frozen base on the sampler's devices, moved once

  # --------------------------------------------------------------------------- the loop

  def start(self, state: dict, step: int):
    """Before the first step (`step`: of a fresh or a resumed run): disaggregated, the weights
    move to the sampler (streaming: they land in the engine); the first batch's programs
    start compiling ahead."""
    self._version, self._first_step = step, step
    self._land(state["params"])
    self._look_ahead(state, step)

  def next(self, state: dict, step: int) -> Scored:
    """The scored batch of `step`; `state`: the trainer's update state now (after `step`
    updates). Off-policy, the rollouts of the next steps are dispatched before this returns."""
    timing = {"rollout": 0.0, "rewards": 0.0}
    weights = self._sampler_weights(state["params"])
    if not self._pending:
      self._pending.append(self._dispatch(weights, state, step, step, timing))
    if self.stream is not None:  # the next steps' groups fill the slots this step frees
      self._queue_ahead(weights, state, step, timing)
    drawn = self._pending.popleft()
    first = drawn.scored or self._score(drawn, timing)
    for k, v in drawn.timing.items():  # what scoring it ahead cost
      timing[k] += v
    figures, mesh = {}, self.sampler_mesh
    if self.dynamic:  # extra rounds on fresh prompts, from the current weights
      key = step_key(self.rng, step, mesh)
      draw = lambda k: self._score(
          self._dispatch(weights, state, step, step, timing, key=k), timing
      )
      prompt, rollout, host, figures = dyn_lib.choose(
          self.config, first, draw, key, mesh, self._take_groups
      )
    else:
      prompt, rollout, host = first
    rewards = multihost.to_global(host["rewards"], mesh, len(drawn.rollout.lengths))
    if self.disaggregated:  # to the trainer's devices, before the next rollouts start
      with profiling.phase("to_trainer") as span:
        prompt, rollout, rewards = self._to_trainer.move(
            (prompt, rollout, rewards),
            jax.tree.map(
                lambda x: sharding.batch_sharding(self.mesh, x.ndim), (prompt, rollout, rewards)
            ),
        )
      figures["perf/batch_transfer_sec"] = span.sec
    if self.stream is None:
      self._queue_ahead(weights, state, step, timing)
    if self.ahead:  # a width's first step: its step programs compiled meanwhile (the wait is
      with profiling.phase("advantages"):  # step 4's, as their first calls' compiles would be)
        self.ahead.wait(prompt["ids"].shape[1])
    figures.update(
        {
            "perf/rollout_sec": timing["rollout"],
            "perf/reward_sec": timing["rewards"],
            "rollout/staleness": step - drawn.version,
            **self._sync_figures,
            **self.engine.stats(),
        }
    )
    if self.stream is not None:
      figures.update(token_staleness(step, host["versions"], host["action_mask"]))
      figures.update(self.stream.stats())
    if self.partial:  # groups queued for an earlier step / a later one
      figures["rollout/carried_groups"] = int(np.sum(drawn.groups[:, 0] < step))
      figures["rollout/early_groups"] = int(np.sum(drawn.groups[:, 0] > step))
    return Scored(
        prompt=prompt,
        rollout=rollout,
        host=host,
        figures=figures,
        rewards=rewards,
        behaviour_logp=rollout.logprobs if self.depth else None,
    )

  def while_updating(self, step: int):
    """Host work while the device runs the update: off-policy, the next step's rollout is
    scored as soon as it is done (rewards on the host, beside the update); the next batch's
    prompts are prepared."""
    # (Streaming colocated, the next step's rows wait for the update's weights: the device
    # takes turns; disaggregated they are decoded here, beside the update.)
    ready = self.stream is None or self.disaggregated
    if self._pending and self._pending[0].scored is None and ready:
      drawn = self._pending[0]
      drawn.scored = self._score(drawn, drawn.timing)
    if step + 1 + len(self._pending) < self.config.num_steps:
      with profiling.phase("prompts"):
        self.prompts.prefetch()  # (done already when compiling ahead: _look_ahead)

  def after_update(self, params):
    """The trainer's weights changed (one more update applied). Colocated, the sampler reads
    them as they are; disaggregated, they move to the sampler's devices (device to device, in
    the compute dtype, into the buffers of the copy they replace), once an in-flight rollout
    that reads that copy is done. perf/weight_sync_sec includes that wait;
    perf/weight_sync_gb_per_sec is logged on-policy only, where there is none. Streaming,
    they land in the slot engine (between decode chunks)."""
    self._version += 1
    self._land(params)

  def _land(self, params):
    """The weights after self._version updates reach the sampler: moved when disaggregated,
    set in the slot engine when streaming."""
    self._move(params)
    if self.stream is not None:
      self.stream.set_weights(self._sampler_weights(params), self._version)

  def _sampler_weights(self, params):
    """The weights the sampler reads: the trainer's `params` colocated, else the moved copy
    (LoRA: the moved adapters on the base)."""
    if not self.disaggregated:
      return params
    return self._combine(self._weights, self._base) if self._split else self._weights

  def _move(self, params):
    """Disaggregated: the trainer's params to the sampler's devices (self._weights)."""
    if not self.disaggregated:
      return
    dtype = jnp.dtype(self.config.model.dtype)
    move = lambda tree, donate=None: self._to_sampler.move(
        tree, jax.tree.map(lambda x: x.sharding.spec, tree), dtype=dtype, donate=donate
    )
    with profiling.phase("weight_sync"):
      if self._split:  # LoRA: the adapters (and, the first time, the base)
        adapters, base = self._split(params)
        if self._base is None:
          self._base = move(base)
        self._weights = move(adapters, self._weights)
      else:
        self._weights = move(params, self._weights)
    sec, gb = self._to_sampler.last_sec, self._to_sampler.last_bytes / 1e9
    self._sync_figures = {"perf/weight_sync_sec": sec, "perf/weight_sync_gb": gb}
    if not self.depth:  # (off-policy the time includes waiting for the rollout in flight)
      self._sync_figures["perf/weight_sync_gb_per_sec"] = gb / max(sec, 1e-9)

  def as_trainer(self, prompt: dict) -> dict:
    """Global prompt arrays, or their abstract trainer-side twins when disaggregated (what the
    trainer's programs will get: for compiling them ahead)."""
    if not self.disaggregated or prompt is None:
      return prompt
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding.batch_sharding(self.mesh, x.ndim)
        ),
        prompt,
    )

  # ---------------------------------------------------------------------- checkpoints

  def saved(self) -> dict:
    """The in-flight rollouts' arrays for the checkpoint ({} on-policy and streaming), on the
    trainer's mesh (run/checkpoint.py writes arrays local to some processes from process 0, a
    trainer's)."""
    if not self._pending or self.stream is not None:
      return {}
    pending = [dataclasses.asdict(d.rollout) for d in self._pending]
    if self.disaggregated:
      pending = self._to_trainer.move(
          pending, jax.tree.map(lambda x: sharding.batch_sharding(self.mesh, x.ndim), pending)
      )
    return {"pending": pending}

  def pending_meta(self) -> list:
    """For the checkpoint's meta ("rollout_pending"): per in-flight rollout, the iterator
    position before its prompts and the version of the weights that sampled it. Streaming:
    the steps in flight are dropped (redrawn on resume): one entry, {"iterator": the position
    before the first one's prompts, "redraw": True}, or none (the usual case: nothing is in
    flight at a checkpoint the source foresaw)."""
    if self.stream is not None:
      return [{"iterator": d.iterator_before, "redraw": True} for d in self._pending][:1]
    return [
        dict(
            iterator=d.iterator_before,
            version=d.version,
            # routing replay's record (Rollout.routes): its shape, for the restore's target
            **({} if d.rollout.routes is None else {"routes": _routes_meta(d.rollout.routes)}),
        )
        for d in self._pending
    ]

  def target(self, meta: dict) -> dict:
    """The abstract arrays of the in-flight rollouts a checkpoint with `meta` holds."""
    entries = [e for e in meta.get("rollout_pending", []) if not e.get("redraw")]
    if not entries:
      return {}
    spec = Rollout.spec(
        self.config.batch_size * self.config.num_generations,
        self.config.max_completion_length,
        self.mesh,
    )

    def one(entry):
      if "routes" not in entry:
        return dataclasses.asdict(spec)
      shape, dtype = entry["routes"]["shape"], entry["routes"]["dtype"]
      routes = jax.ShapeDtypeStruct(
          tuple(shape), jnp.dtype(dtype), sharding=sharding.batch_sharding(self.mesh, len(shape))
      )
      return dataclasses.asdict(dataclasses.replace(spec, routes=routes))

    return {"pending": [one(e) for e in entries]}

  def restore(self, restored: dict, meta: dict):
    """Puts back a checkpoint's in-flight rollouts: their prompt batches taken again from the
    iterator positions in meta, their arrays restored (not sampled again). Streaming's dropped
    steps: the iterator goes back before their prompts, and they are drawn again."""
    entries = meta.get("rollout_pending", [])
    if entries and entries[0].get("redraw"):
      self.prompts.it.set_state(entries[0]["iterator"])
      return
    after, pending = self.prompts.it.get_state(), restored.get("pending", [])
    if self.disaggregated and pending:
      pending = self._to_sampler.move(
          pending,
          jax.tree.map(lambda x: sharding.batch_sharding(self.sampler_mesh, x.ndim), pending),
      )
    for i, (entry, arrays) in enumerate(zip(entries, pending)):
      self.prompts.it.set_state(entry["iterator"])
      batch, prompt = self.prompts.take()
      self._pending.append(
          _Drawn(
              batch,
              prompt,
              Rollout(**arrays),
              entry["version"],
              entry["iterator"],
              step=meta["grpo_step"] + i,
          )
      )
    self.prompts.it.set_state(after)

  # ------------------------------------------------------------------------- internals

  def _dispatch(
      self, params, state: dict, step: int, version: int, timing: dict, key=None
  ) -> _Drawn:
    """Takes the next prompts and dispatches their rollout (not waited for); `params`: the
    sampler's weights, `state`: the trainer's (after `version` updates)."""
    with profiling.phase("prompts"):
      before = self.prompts.it.get_state()
      batch, prompt = self.prompts.take()
    with profiling.phase("rollout") as span:
      if self.ahead:  # a width's first rollout: its sampler compiled meanwhile
        self.ahead.wait(prompt["ids"].shape[1], only="sampler")
      key = step_key(self.rng, step, self.sampler_mesh) if key is None else key
      if self.stream is not None:  # queued: decoded by _score's wait (and the next steps')
        self.stream.enqueue(step, prompt, key)
        self._indices[step] = batch["indices"]
        rollout = None
      else:
        rollout = self.engine.generate(params, batch, key, self.generation)
      self._look_ahead(state, version + 1)  # host work while the device samples
    timing["rollout"] += span.sec
    return _Drawn(batch, prompt, rollout, version, before, step=step)

  def _queue_ahead(self, params, state: dict, step: int, timing: dict):
    """Off-policy: dispatches (streaming: queues) the rollouts of the steps after `step`, up to
    max_staleness of them, none at or past num_steps; streaming, none past the next
    checkpoint the source foresees (`_horizon`)."""
    end = self.config.num_steps if self.stream is None else self._horizon(step)
    while True:
      ahead = self._pending[-1].step + 1 if self._pending else step + 1
      if ahead >= end or ahead > step + self.depth:
        return
      self._pending.append(self._dispatch(params, state, ahead, step, timing))

  def _horizon(self, step: int) -> int:
    """The first checkpoint after `step` (in updates applied: step s is trained by update
    s + 1) that the loop writes on schedule: every save_interval_steps, at num_steps, and at
    the max_steps_per_run stop. Streaming queues only steps below it."""
    c = self.config
    ends = [c.num_steps, (step // c.save_interval_steps + 1) * c.save_interval_steps]
    if c.max_steps_per_run:
      ends += [t for t in (self._first_step + c.max_steps_per_run,) if t > step]
    return min(ends)

  def _look_ahead(self, state: dict, step: int):
    """Compiling ahead: the prompts of `step` are taken early, and the programs of their width
    start compiling unless compiled before."""
    if self.ahead and step < self.config.num_steps:
      self.prompts.prefetch()
      self.ahead.submit(self.as_trainer(self.prompts.peek()), state)

  def _score(self, drawn: _Drawn, timing: dict):
    """Waits for a dispatched rollout and scores this process's rows of it. -> (prompt,
    rollout, host rows: tokens, mask, truncated, rewards (f32, + DAPO's overlong penalty),
    per_function, errors)."""
    with profiling.phase("rollout") as span:  # this process's rows, on the host (one transfer)
      if drawn.rollout is None and self.partial:  # the first groups to finish
        self._take_first(drawn)
      elif drawn.rollout is None:  # streaming: decode until its rows are done
        drawn.rollout, drawn.versions = self.stream.wait(drawn.step)
      tokens_nc, mask_nc, truncated_n, tool_nc = multihost.local_rows(
          (
              drawn.rollout.tokens,
              drawn.rollout.mask,
              drawn.rollout.truncated,
              drawn.rollout.tool_mask,
          )
      )
      versions_nc = None if drawn.versions is None else multihost.local_rows(drawn.versions)
    timing["rollout"] += span.sec
    with profiling.phase("rewards") as span:
      rewards_n, per_function, errors = self.scorer(
          drawn.batch, tokens_nc, mask_nc, tool_nc=tool_nc if self.tools else None
      )
    timing["rewards"] += span.sec
    return (
        drawn.prompt,
        drawn.rollout,
        dict(
            tokens=tokens_nc,
            mask=mask_nc,
            action_mask=mask_nc * (1 - tool_nc),  # the policy's tokens (lengths, staleness)
            truncated=truncated_n,
            rewards=rewards_n,
            per_function=per_function,
            errors=errors,
            versions=versions_nc,
        ),
    )

  def _take_first(self, drawn: _Drawn):
    """Partial rollouts: `drawn`'s step takes the first B groups to finish (stream.wait_first:
    its own, later steps', carried ones; every group queued k or more steps before it); its
    batch becomes theirs, each group with its own prompt's train row (answers for the
    rewards)."""
    out = self.stream.wait_first(drawn.step, due=drawn.step - self.depth)
    drawn.rollout, drawn.versions, drawn.groups = out
    drawn.batch, drawn.prompt = self.prompts.of([self._indices[t][i] for t, i in drawn.groups])
    live = set(self.stream.in_flight())
    self._indices = {t: rows for t, rows in self._indices.items() if t in live}


class Scorer:
  """GRPO step 3 on the host: this process's completions decoded and scored by the reward
  functions (a weighted sum), the judge (reward.judge) and DAPO's overlong penalty."""

  def __init__(self, config, reward_fn, decode, judge=None):
    """reward_fn: rewards.from_config's computer; decode: `decoder(tokenizer)`; judge:
    rewards/judge.py's model judge, or None."""
    self.config, self.reward_fn, self.decode, self.judge = config, reward_fn, decode, judge

  def __call__(self, batch: dict, tokens_nc, mask_nc, tool_nc=None):
    """batch: the host prompt batch (prompts, rows) of B prompts; tokens_nc, mask_nc: its
    N = B*G completions (this process's rows); tool_nc int [N, C]: 1 on tool-response tokens
    (rollouts with tools; None: none), scored turn by turn (rewards/conversation.py).
    -> (rewards f32 [N], per_function, errors)."""
    c, G = self.config, self.config.num_generations
    prompts_n = [p for p in batch["prompts"] for _ in range(G)]
    rows_n = [r for r in batch["rows"] for _ in range(G)]
    if tool_nc is None:
      completions_n = self.decode.rows(tokens_nc, mask_nc)
      scored = self.reward_fn(prompts_n, completions_n, rows_n)
    else:
      # The judge reads each row's whole text: model and tool tokens.
      completions_n = self.decode.rows(tokens_nc, np.maximum(mask_nc, tool_nc))
      scored = self.reward_fn.score_tool_rows(
          self.decode.tokenizer, prompts_n, rows_n, tokens_nc, mask_nc, tool_nc
      )
    per_function, total = dict(scored.per_function), scored.total
    if self.judge is not None:  # collective: every process, its own rows
      per_function["judge"] = self.judge(prompts_n, completions_n)
      total = total + c.reward.judge.weight * per_function["judge"]
    rewards_n = total + adv_lib.overlong_penalty(
        mask_nc.sum(-1), c.max_completion_length, c.loss.overlong_buffer, c.loss.overlong_factor
    )
    return rewards_n.astype(np.float32), per_function, scored.errors


def _routes_meta(routes) -> dict:
  """A routing record's shape and dtype, as the checkpoint's meta keeps them (JSON)."""
  return {"shape": list(routes.shape), "dtype": jnp.dtype(routes.dtype).name}


def streaming(config) -> bool:
  """The loop streams rollouts through the slot engine: rollout.slots > 0, max_staleness > 0."""
  return config.rollout.slots > 0 and config.rollout.max_staleness > 0


def token_staleness(step: int, versions_nc, mask_nc) -> dict:
  """Per completion token, `step` minus the weight version that drew it: its mean and max
  over the batch's masked tokens (versions_nc, mask_nc: [n, C], this process's rows; every
  process calls it: the sums go over processes, so a process without rows, the trainer's with
  rollout.placement=disaggregated, logs the batch's figures too); rollout/staleness: step minus
  the oldest version in the batch (the max)."""
  ages = step - np.asarray(versions_nc)[np.asarray(mask_nc) > 0]
  mine = np.array([ages.sum(), ages.size, ages.max() if ages.size else -1], np.int64)
  every = multihost.per_process(mine)  # [processes, 3]: one gather a step
  total, count, oldest = every[:, 0].sum(), every[:, 1].sum(), int(every[:, 2].max())
  if not count:
    return {}
  return {
      "rollout/staleness": oldest,
      "rollout/staleness_token_mean": float(total / count),
      "rollout/staleness_token_max": oldest,
  }


def generation(config) -> GenerationConfig:
  """The train rollout's sampling settings (rollout.temperature, top_k, top_p)."""
  return GenerationConfig(config.rollout.temperature, config.rollout.top_k, config.rollout.top_p)


def step_key(rng, step: int, mesh):
  """fold_in(rng, step), the step put beside the (replicated) key explicitly."""
  return jax.random.fold_in(rng, multihost.replicated(np.uint32(step), mesh))


def decoder(tokenizer):
  """decode(tokens [C], mask [C]) -> the completion's text; decode.rows(tokens [N, C], mask)
  -> N texts, the host lists built once for the batch (host time between device programs)."""

  def text(ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special=True)

  def decode(tokens, mask):
    return text(np.asarray(tokens).tolist(), np.asarray(mask).tolist())

  decode.tokenizer = tokenizer  # the Scorer's tool turns decode runs with and without markup
  decode.rows = lambda tokens, mask: list(
      map(text, np.asarray(tokens).tolist(), np.asarray(mask).tolist())
  )
  return decode
