"""The GRPO training loop: setup -> loop -> finish, the loop read top to bottom.

    run(config, workdir)

  setup       (`_setup` -> Parts, one value) session (checkpoints, metrics, preemption, one
              teardown), the trainer's and the sampler's mesh (one mesh unless
              rollout.placement=disaggregated), data, policy, rollout engine, evaluator,
              rewards, the jitted update functions; the optional supervised warm start
              (config.sft_steps; sft.py owns that stage); the reference (rl/reference.py),
              GRPO steps 4-6 (rl/step.py's GrpoStep), the rollout source (rollout/source.py,
              which submits each prompt width to run/compile_ahead.py), the update state
              started or restored, the evaluation before GRPO
  loop        per step, docs/design.md's numbered steps: the source's scored batch (1-3: prompts ->
              rollout -> rewards; on-policy or rollout.max_staleness steps ahead) -> advantages
              and old/ref log-probs (4-5) -> num_iterations updates, the sampler's weights and
              the reference follow (6) -> the step's figures (7a) -> log / eval / checkpoint /
              stop when the Schedule says (7b)
  finish      evaluation after training, DIR/summary.json

Timing: each region is a profiling.phase span (run/profiling.py), which marks it in the trace
and times it; the step's perf/* figures are those spans' seconds.

Shapes: B prompts per step, G samples per prompt, N = B*G rows, P prompt length, C completion
length. Multi-host: every process runs this same function on its own rows of each batch
(prompts, decoding, rewards); arrays that meet on the device are global, sharded over the
mesh. Only process 0 writes logs and summary.json (Orbax coordinates checkpoint writes).

Host traffic is on purpose only: prompts and rewards go to the device, completions come back
for scoring, and every other figure waits on the device until the log interval (run/metrics.py).
`config.debug.transfer_guard="disallow"` enforces that on every step after the first.
"""

import dataclasses
from typing import Any

from absl import logging
import jax
import ml_collections

from grpo_jax.run import checkpoint as ckpt_lib
from grpo_jax.run import compile_ahead
from grpo_jax import data as data_lib
from grpo_jax.eval import tasks as eval_tasks
from grpo_jax.eval import evaluate as eval_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import profiling
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rollout import source as source_lib
from grpo_jax.rollout import turns as turns_lib
from grpo_jax import report as report_lib
from grpo_jax import rewards as rewards_lib
from grpo_jax import rollout as rollout_lib
from grpo_jax.run import session as session_lib
from grpo_jax import sft as sft_lib
from grpo_jax.run.metrics import NonFiniteError  # noqa: F401  (raised by StepLog.flush)
from grpo_jax.rl.reference import Reference
from grpo_jax.models import build
from grpo_jax.models.lora import policy as lora_lib
from grpo_jax.parallel import sharding
from grpo_jax.rewards import judge as judge_lib
from grpo_jax.rl import step as step_lib


def run(config, workdir: str) -> dict:
  """Trains per `config`, writing everything under `workdir`; returns the summary dict.

  A checkpoint whose arrays fail to restore is moved aside (run/session.py) and the run starts
  over from the previous one."""
  while True:
    try:
      return _run(config, workdir)
    except ckpt_lib.DamagedCheckpoint as e:
      logging.warning("%s; resuming from the checkpoint before it", e)


def _run(config, workdir: str) -> dict:
  mesh, sampler_mesh = build.make_meshes(config)  # the same mesh unless disaggregated
  with session_lib.open_session(config, workdir, mesh) as session:
    # ------------------------------------------------------------------------------ setup
    parts, state = _setup(config, session, mesh, sampler_mesh)
    config, meta = parts.config, session.meta

    # ------------------------------------------------------------------ GRPO: steps
    while meta["grpo_step"] < config.num_steps:
      step = meta["grpo_step"]
      parts.profiler.step_begin(step)
      guard = config.debug.transfer_guard if step > parts.first_step else "allow"  # 1st: setup
      with jax.transfer_guard(guard), profiling.step_span(step) as span:
        # 1-3. Prompts, rollout (G completions per prompt; on-policy or max_staleness steps
        # behind), rewards on the host (+ DAPO's overlong penalty; dynamic sampling's rounds).
        batch = parts.source.next(state, step)

        # 4-5. Advantages per group and the [prompt; completion] rows to train on; log-probs:
        # the old policy's (the sampler's when off-policy) and the reference's (beta > 0).
        upd, kl_rewards_n = parts.grpo.inputs(state, batch)

        # 6. num_iterations optimizer updates over the whole rollout batch; meanwhile the host
        # prepares the next step's prompts. Then the sampler's weights and the reference follow.
        state, upd_metrics = parts.grpo.update(state, upd)
        parts.source.while_updating(step)
        parts.grpo.wait(state)
        meta["grpo_step"] = step = step + 1
        parts.source.after_update(state["params"])
        parts.reference.after_update(step, state["params"])

        # 7a. This step's figures stay where they are until the log interval (run/metrics.py).
        with profiling.phase("log"):
          device = {**parts.grpo.figures(batch, upd, kl_rewards_n), **upd_metrics}
          _log_step(parts, step, batch, span, device)

      # 7b. What the Schedule says is due: log, evaluate, checkpoint; stop on SIGTERM or the
      # step budget.
      _every_n_steps(parts, step, state)

    # ------------------------------------------------------------------------- finish
    return _finish(parts, state)


# ======================================================================== setup


@dataclasses.dataclass
class Parts:
  """What setup builds for the GRPO loop, one value. first_step: the GRPO step this run starts
  at (0, or the checkpoint's); steps_per_epoch: batches of prompts per pass over the data."""

  config: ml_collections.ConfigDict  # num_epochs: num_steps resolved (_run_length)
  session: session_lib.Session
  mesh: jax.sharding.Mesh  # the trainer's
  sampler_mesh: jax.sharding.Mesh  # the same mesh unless rollout.placement=disaggregated
  policy: Any
  engine: Any  # the rollout engine
  fns: step_lib.TrainFunctions
  grpo: step_lib.GrpoStep
  reference: Reference
  source: source_lib.RolloutSource
  evaluator: eval_lib.Evaluator
  log: metrics_lib.StepLog
  profiler: profiling.StepProfiler
  memory_profile: profiling.MemoryProfile
  train_iter: Any
  first_step: int
  steps_per_epoch: int
  schedule: "Schedule"  # 7b: when logging, evaluation, checkpoints and the budget stop are due


def _setup(config, session, mesh, sampler_mesh) -> tuple[Parts, dict]:
  """-> (the run's parts, the update state GRPO starts from: after the SFT warm start, or the
  checkpoint's), the evaluation before GRPO done."""
  logging.info(
      "mesh %s over %d devices, %d process(es)%s",
      dict(mesh.shape),
      mesh.size,
      jax.process_count(),
      ""
      if sampler_mesh is mesh
      else f"; the sampler's {dict(sampler_mesh.shape)} over {sampler_mesh.size} more",
  )
  tokenizer = data_lib.build_tokenizer(
      config.tokenizer.kind, config.tokenizer.path or config.model.hf_path
  )
  train_data, eval_data = prompts_lib.prompt_data(
      config,
      tokenizer,
      turns_lib.system_prompt(config, data_lib.system_prompt(config.data.system_prompt)),
  )
  config = _run_length(config, len(train_data))
  decode = source_lib.decoder(tokenizer)
  policy = build.make_policy(config, mesh, abstract=session.resume_step is not None)
  logging.info(
      "policy: %s (%s), %.2fM parameters",
      config.model.impl,
      config.model.preset,
      sum(x.size for x in jax.tree.leaves(policy.params)) / 1e6,
  )
  profiling.log_memory("loading the policy")
  replay = config.rollout.routing_replay == "rollout"  # rl/replay.py: the sampler records routes
  engine = session.closing(
      rollout_lib.make_engine(config, policy, tokenizer, sampler_mesh, record_routes=replay)
  )
  evaluator = _evaluator(config, session, policy, tokenizer, mesh, eval_data, decode)
  reward_fn = session.closing(rewards_lib.from_config(config.reward))
  reward_fn.check(train_data.rows[0])  # a broken plug-in fails now, not after SFT
  judge = session.closing(judge_lib.build_judge(config, mesh))  # None: reward.judge.path ""
  scorer = source_lib.Scorer(config, reward_fn, decode, judge)
  fns = step_lib.build(config, policy, mesh)

  # SFT warm start (sft.py); LoRA: the base GRPO's adapters go on.
  params = sft_lib.run(config, session, policy, mesh, train_data, evaluator)
  if config.lora.rank and session.resume_phase != "grpo":
    params = lora_lib.after_sft(config, session, policy, params, mesh, session.workdir)

  # GRPO: the reference, steps 4-6, the rollout source (global batches of row indices, each
  # process takes its rows: prompts.NextPrompts), then the state: started or restored.
  train_iter = data_lib.make_prompt_iterator(
      len(train_data), batch_size=config.batch_size, seed=config.seed
  )
  reference = Reference(config, policy, fns, mesh)
  grpo = step_lib.GrpoStep(config, fns, reference, mesh, matches_trainer=engine.matches_trainer)
  prompts = prompts_lib.NextPrompts(config, train_data, train_iter, sampler_mesh)
  ahead = _compile_ahead(config, session, grpo, engine, sampler_mesh)
  source = source_lib.RolloutSource(
      config,
      engine=engine,
      prompts=prompts,
      scorer=scorer,
      mesh=mesh,
      rng=session.rng,
      sampler_mesh=sampler_mesh,
      policy=policy,
      ahead=ahead,
  )
  state = _start_grpo(config, session, fns, policy, mesh, params, train_iter, reference, source)
  first_step = session.meta["grpo_step"]
  if config.sft_steps:
    logging.info(
        "step numbers: checkpoints/ and TensorBoard count the %d SFT steps first, so GRPO step "
        "s is saved and plotted at step %d+s (%d-%d); metrics.jsonl and the [grpo] lines count "
        "GRPO steps from 1",
        config.sft_steps,
        config.sft_steps,
        config.sft_steps + 1,
        config.sft_steps + config.num_steps,
    )
  source.start(state, first_step)  # the first batch's programs compile from here on
  _evaluate_before(config, session, evaluator, state, mesh)
  log = metrics_lib.StepLog(
      session.writer,
      metrics_lib.Progress(config.num_steps, first_step, "grpo"),
      num_rows=config.batch_size * config.num_generations,
      max_consecutive_nonfinite=config.max_consecutive_nonfinite,
      max_logprob_gap=config.rollout.max_logprob_gap,
      step_offset=config.sft_steps,
      mesh=mesh,
  )
  profiler = session.closing(
      profiling.StepProfiler(
          session.workdir,
          config.profile.start_step,
          config.profile.num_steps,
          python_tracer=config.profile.python_tracer,
      )
  )
  return (
      Parts(
          config=config,
          session=session,
          mesh=mesh,
          sampler_mesh=sampler_mesh,
          policy=policy,
          engine=engine,
          fns=fns,
          grpo=grpo,
          reference=reference,
          source=source,
          evaluator=evaluator,
          log=log,
          profiler=profiler,
          memory_profile=profiling.MemoryProfile(session.workdir, config.profile.memory_profile),
          train_iter=train_iter,
          first_step=first_step,
          steps_per_epoch=data_lib.batches_per_epoch(len(train_data), config.batch_size),
          schedule=Schedule.of(config, first_step),
      ),
      state,
  )


def _compile_ahead(config, session, grpo, engine, sampler_mesh):
  """config.compile_ahead: the step programs of each prompt width compile in the background
  (run/compile_ahead.py), the first width's during the evaluation before GRPO and the first
  rollout; the sampler's too when colocated. The rollout source submits the widths."""
  if not config.compile_ahead:
    return None
  mesh = grpo.mesh
  ahead = session.closing(
      compile_ahead.CompileAhead(
          config,
          grpo,
          engine=engine if sampler_mesh is mesh else None,
          generation=source_lib.generation(config),
          key=source_lib.step_key(session.rng, 0, mesh),
      )
  )
  # Packed rows: each step's likely next shapes, on GPU and TPU (on CPU those compiles would
  # take the cores the steps run on: a CPU run compiles a packed shape at its first use)
  if hasattr(grpo.rows, "ahead") and mesh.devices.flat[0].platform != "cpu":
    grpo.rows.ahead = ahead
  return ahead


def _evaluate_before(config, session, evaluator, state, mesh):
  meta = session.meta
  if meta["eval_before"] is None:
    meta["eval_before"] = evaluator(
        state["params"], config.sft_steps, source_lib.step_key(session.rng, 2 << 20, mesh)
    )
    eval_lib.log_results("before GRPO", meta["eval_before"])


# ======================================================================== the loop's steps


def _log_step(parts: Parts, step: int, batch, span, device: dict):
  """7a. The step's figures (run/metrics.py's StepLog reads them at the log interval): host
  sums over this process's rows, the phases' seconds (span: the step's, run/profiling.py), and
  `device`: jax scalars where they were computed."""
  host = batch.host
  lengths_n = host.get("action_mask", host["mask"]).sum(-1)  # the policy's tokens (no tool's)
  parts.log.add(
      step,
      means={
          "reward/total": host["rewards"].sum(),
          **{f"reward/{k}": v.sum() for k, v in host["per_function"].items()},
          "completions/mean_length": lengths_n.sum(),
          "completions/truncated_fraction": host["truncated"].sum(),
      },
      totals={"reward/errors": host["errors"], "completions/tokens": lengths_n.sum()},
      host={
          "perf/update_sec": span.seconds(profiling.UPDATE_PHASES),
          "perf/step_time_sec": span.elapsed(),
          "data/epoch": _epoch(parts.train_iter, parts.steps_per_epoch),
          **batch.figures,
      },
      device=device,
  )


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When 7b's periodic work is due after GRPO step `step` (updates done; counted from 1):
  the loop asks, the config's intervals answer. first_step: the step this process started at
  (max_steps_per_run counts from there)."""

  num_steps: int
  first_step: int
  log_every: int
  eval_every: int  # 0: only before and after training
  save_every: int
  max_steps_per_run: int  # 0: no limit

  @classmethod
  def of(cls, config, first_step: int) -> "Schedule":
    return cls(
        config.num_steps,
        first_step,
        config.log_interval_steps,
        config.eval_interval_steps,
        config.save_interval_steps,
        config.max_steps_per_run,
    )

  def budget_spent(self, step: int) -> bool:
    """This process has run its max_steps_per_run and steps remain (stop, checkpointed)."""
    return (
        self.max_steps_per_run > 0
        and step < self.num_steps
        and step - self.first_step >= self.max_steps_per_run
    )

  def log(self, step: int) -> bool:
    """The figures reach the log: every log_every steps, at the end and at a budget stop."""
    return step % self.log_every == 0 or step == self.num_steps or self.budget_spent(step)

  def evaluate(self, step: int) -> bool:
    """Every eval_every steps but the last (the evaluation after training covers it)."""
    return bool(self.eval_every) and step % self.eval_every == 0 and step < self.num_steps

  def save(self, step: int) -> bool:
    return step % self.save_every == 0 or step == self.num_steps


def _every_n_steps(parts: Parts, step: int, state: dict):
  """7b. The trace window and the memory profile; what the Schedule says is due: log,
  evaluate, checkpoint; the stop on SIGTERM or at the step budget. `step`: updates done."""
  session, log, when = parts.session, parts.log, parts.schedule
  parts.profiler.step_end(step - 1, block_on=state["params"])
  parts.memory_profile.step_end(step)
  if step == parts.first_step + 1:
    profiling.log_memory("the first step (sampler cache, update)")
  ckpt_step = parts.config.sft_steps + step  # checkpoints and TensorBoard count SFT's too
  if when.log(step):
    log.flush()
  if when.evaluate(step):
    session.meta["history"].append(
        {
            "step": step,
            "eval": parts.evaluator(
                state["params"], ckpt_step, source_lib.step_key(session.rng, step - 1, parts.mesh)
            ),
        }
    )
  if when.save(step):
    log.flush()  # the checkpoint records how many metric rows precede it
    session.save(ckpt_step, _saved(parts, state), parts.train_iter)
  if session.stop_requested(budget_spent=when.budget_spent(step)):
    log.flush()
    session.stop(ckpt_step, _saved(parts, state), parts.train_iter)


def _saved(parts: Parts, state: dict) -> dict:
  """The checkpoint's arrays: the update state (LoRA: the adapters and their moments; the base
  is named in meta), the reference's copy, the in-flight rollouts (named in meta too)."""
  parts.session.meta["rollout_pending"] = parts.source.pending_meta()
  split = parts.policy.split
  train = dict(state, params=split(state["params"])[0]) if split else state
  return {"train": train, **parts.reference.saved(), **parts.source.saved()}


def _finish(parts: Parts, state: dict) -> dict:
  """The evaluation after training and DIR/summary.json (and the report) -> the summary."""
  config, session, meta = parts.config, parts.session, parts.session.meta
  eval_after = parts.evaluator(
      state["params"],
      config.sft_steps + config.num_steps,
      source_lib.step_key(session.rng, 3 << 20, parts.mesh),
  )
  eval_lib.log_results("after GRPO", eval_after)
  session.ckpt.wait()
  summary = {
      "final_step": meta["grpo_step"],
      "wall_time_sec": round(session.wall_time(), 2),
      "sft_steps": meta["sft_step"],
      "eval_initial": meta["eval_initial"],
      "eval_before": meta["eval_before"],
      "eval_after": eval_after,
      "eval_history": meta["history"],
  }
  session.write_summary(summary)
  _log_summary(summary, session.workdir)
  if config.report_at_end and session.is_main:
    _write_report(session, session.workdir)
  return summary


# ======================================================================== loop helpers


def _run_length(config, num_train_prompts: int):
  """num_epochs > 0: a copy of `config` with num_steps = epochs x batches per epoch."""
  if not config.num_epochs:
    return config
  per_epoch = data_lib.batches_per_epoch(num_train_prompts, config.batch_size)
  if per_epoch == 0:
    raise ValueError(
        f"num_epochs={config.num_epochs}: {num_train_prompts} train prompts cannot "
        f"fill one batch of batch_size={config.batch_size}. Fix: lower batch_size"
    )
  config = config.copy_and_resolve_references()
  config.num_steps = config.num_epochs * per_epoch
  logging.info(
      "num_epochs=%d: %d train prompts // batch_size %d = %d steps per epoch -> " "num_steps=%d",
      config.num_epochs,
      num_train_prompts,
      config.batch_size,
      per_epoch,
      config.num_steps,
  )
  return config


def _epoch(train_iter, steps_per_epoch: int) -> float:
  """Epochs of prompts drawn so far (data/epoch), from the iterator's position."""
  return train_iter.get_state()["next_index"] / max(steps_per_epoch, 1)


def _evaluator(config, session, policy, tokenizer, mesh, eval_data, decode):
  """The evaluation (eval/evaluate.py) on its own native engines: greedy, and eval.num_samples."""

  def engine(samples_per_prompt):
    return session.closing(
        rollout_lib.make_engine(
            config,
            policy,
            tokenizer,
            mesh,
            kind="native",
            num_generations=samples_per_prompt,
            max_new_tokens=config.eval.max_new_tokens or config.max_completion_length,
        )
    )

  return eval_lib.Evaluator(
      config,
      engine(1),
      eval_data,
      mesh,
      decode=decode,
      writer=session.writer,
      sample_engine=(engine(config.eval.num_samples) if config.eval.num_samples > 1 else None),
  )


def _start_grpo(config, session, fns, policy, mesh, params, train_iter, reference, source):
  """The update state, restored when GRPO was interrupted (with the reference's copy and the
  in-flight rollouts), else fresh from `params` (the reference then starts from it too).
  LoRA checkpoints hold the adapters; the base is loaded from where meta["lora_base"] says."""
  if session.resume_phase == "grpo":
    abstract = fns.abstract_state
    if policy.split:
      abstract = dict(abstract, params=policy.split(abstract["params"])[0])
    restored = session.restore(
        {"train": abstract, **reference.target(), **source.target(session.meta)}, train_iter
    )
    state = restored["train"]
    if policy.split:
      base = lora_lib.load_base(config, policy, mesh, session.meta.get("lora_base", ""))
      state = dict(state, params=policy.combine(state["params"], base))
    profiling.log_memory("restoring the optimizer state")
    reference.restore(restored)
    source.restore(restored, session.meta)
  else:
    # The state takes the starting weights' buffers (donated) and the policy keeps their shapes
    # only, as a resumed run's does: no second copy of the weights (the initial ones, or the
    # pre-SFT ones) stays on the device beside the trained ones (30.6 GiB for Qwen3-8B in f32).
    policy.params = sharding.abstract_with(policy.params, policy.param_shardings(mesh))
    state = fns.start(params)
    del params
    profiling.log_memory("the optimizer state")
    reference.start(state["params"])
  return state


def _write_report(session, workdir):
  session.writer.flush()  # the report reads metrics.jsonl, the last eval row included
  try:
    logging.info("report: %s", report_lib.write_report(workdir))
  except Exception as e:  # noqa: BLE001  a finished run must not fail over its report
    logging.warning("report not written: %s: %s", type(e).__name__, e)


def _log_summary(summary, workdir):
  before, after = summary["eval_before"], summary["eval_after"]
  if jax.process_index() != 0 or not after:  # eval.generation_configs=(): nothing to compare
    return
  name = "greedy" if "greedy" in after else next(iter(after))
  metric, value = eval_tasks.primary_metric(after[name])
  logging.info(
      "summary: %s %.3f -> %.3f (%s) in %.1fs; %s/summary.json",
      metric,
      before[name][metric],
      value,
      name,
      summary["wall_time_sec"],
      workdir,
  )
