"""The GRPO training loop: one function, read top to bottom.

    run(config, workdir)

  setup       session (checkpoints, metrics, preemption, one teardown), the trainer's and
              the sampler's mesh (one mesh unless rollout.placement=disaggregated), data,
              policy, rollout engine, evaluator, rewards, the jitted update functions
  sft         the optional supervised warm start (config.sft_steps; sft.py owns that stage)
  grpo        start (or restore) the update state, the reference (rl/reference.py) and the
              rollout source (rollout/source.py), evaluate, then per step: the source's scored
              batch (prompts -> rollout -> rewards; on-policy or rollout.max_staleness steps
              ahead) -> advantages -> old/ref log-probs -> num_iterations updates -> the
              sampler's weights and the reference follow -> log / eval / checkpoint
  finish      evaluation after training, DIR/summary.json

Shapes: B prompts per step, G samples per prompt, N = B*G rows, P prompt length, C completion
length. Multi-host: every process runs this same function on its own rows of each batch
(prompts, decoding, rewards); arrays that meet on the device are global, sharded over the
mesh. Only process 0 writes logs and summary.json (Orbax coordinates checkpoint writes).

Host traffic is on purpose only: prompts and rewards go to the device, completions come back
for scoring, and every other figure waits on the device until the log interval (run/metrics.py).
`config.debug.transfer_guard="disallow"` enforces that on every step after the first.
"""
import functools
import time

from absl import logging
import jax

from grpo_jax.run import checkpoint as ckpt_lib
from grpo_jax.run import compile_ahead
from grpo_jax import data as data_lib
from grpo_jax.eval import tasks as eval_tasks
from grpo_jax.eval import evaluate as eval_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import profiling
from grpo_jax.data import prompts as prompts_lib
from grpo_jax.rollout import source as source_lib
from grpo_jax import report as report_lib
from grpo_jax import rewards as rewards_lib
from grpo_jax import rollout as rollout_lib
from grpo_jax.run import session as session_lib
from grpo_jax import sft as sft_lib
from grpo_jax.parallel import sharding
from grpo_jax.run.metrics import NonFiniteError  # noqa: F401  (raised by StepLog.flush)
from grpo_jax.rl.reference import Reference
from grpo_jax.models import build
from grpo_jax.models.lora import policy as lora_lib
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
    logging.info("mesh %s over %d devices, %d process(es)%s", dict(mesh.shape), mesh.size,
                 jax.process_count(), "" if sampler_mesh is mesh else
                 f"; the sampler's {dict(sampler_mesh.shape)} over {sampler_mesh.size} more")
    tokenizer = data_lib.build_tokenizer(config.tokenizer.kind,
                                         config.tokenizer.path or config.model.hf_path)
    train_data, eval_data = prompts_lib.prompt_data(config, tokenizer)
    config = _run_length(config, len(train_data))
    decode = source_lib.decoder(tokenizer)
    policy = build.make_policy(config, mesh, abstract=session.resume_step is not None)
    logging.info("policy: %s (%s), %.2fM parameters", config.model.impl, config.model.preset,
                 sum(x.size for x in jax.tree.leaves(policy.params)) / 1e6)
    profiling.log_memory("loading the policy")
    engine = session.closing(rollout_lib.make_engine(config, policy, tokenizer, sampler_mesh))
    evaluator = _evaluator(config, session, policy, tokenizer, mesh, eval_data, decode)
    reward_fn = session.closing(rewards_lib.from_config(config.reward))
    reward_fn.check(train_data.rows[0])  # a broken plug-in fails now, not after SFT
    judge = session.closing(judge_lib.build_judge(config, mesh))  # None: reward.judge.path ""
    fns = step_lib.build(config, policy, mesh)

    # --------------------------------------------------------- SFT warm start (sft.py)
    params = sft_lib.run(config, session, policy, mesh, train_data, evaluator)
    if config.lora.rank and session.resume_phase != "grpo":  # the base GRPO's adapters go on
      params = lora_lib.after_sft(config, session, policy, params, mesh, workdir)

    # ---------------------------------------------------------- GRPO: start or resume
    # Global batches of row indices (each process takes its rows: prompts.NextPrompts).
    train_iter = data_lib.make_prompt_iterator(len(train_data), batch_size=config.batch_size,
                                               seed=config.seed)
    meta, rng, G = session.meta, session.rng, config.num_generations
    prompts = prompts_lib.NextPrompts(config, train_data, train_iter, sampler_mesh)
    # Old-policy log-probs: for the PPO ratio over several passes, for TIS, and whenever the
    # sampler is another program than the trainer (its log-probs are then only close).
    # Off-policy (rollout.max_staleness > 0) they are the sampler's: the behaviour policy's.
    off_policy = config.rollout.max_staleness > 0
    needs_old_logp = not off_policy and (
        config.num_iterations > 1 or config.loss.tis_cap > 0 or config.kl_in_reward or
        not engine.matches_trainer)
    stats_fn = jax.jit(functools.partial(metrics_lib.rollout_stats, group_size=G,
                                         advantage_clip=config.loss.advantage_clip),
                       out_shardings=sharding.replicated(mesh))
    # The first batch's sampler and step programs compile in the background from here on,
    # during the evaluation and the first rollout (run/compile_ahead.py); later widths when
    # prefetched.
    ahead = session.closing(compile_ahead.CompileAhead(
        config, fns, stats_fn, policy, mesh, needs_old_logp=needs_old_logp,
        matches_trainer=engine.matches_trainer, engine=engine if sampler_mesh is mesh else None,
        generation=source_lib.generation(config), key=source_lib.step_key(rng, 0, mesh),
        off_policy=off_policy)) if config.compile_ahead else None

    def look_ahead():  # the next batch's width compiles while the device runs this step
      if meta["grpo_step"] + 1 < config.num_steps:
        prompts.prefetch()
        ahead.submit(source.as_trainer(prompts.peek()), state, reference.params)
    source = source_lib.RolloutSource(
        config, engine=engine, prompts=prompts, reward_fn=reward_fn, judge=judge, decode=decode,
        mesh=mesh, rng=rng, sampler_mesh=sampler_mesh, policy=policy, ahead=ahead,
        look_ahead=look_ahead if ahead else None)
    reference = Reference(config, policy, fns, mesh)
    state = _start_grpo(config, session, fns, policy, mesh, params, train_iter, reference,
                        source)
    if ahead and meta["grpo_step"] < config.num_steps:
      prompts.prefetch()
      ahead.submit(source.as_trainer(prompts.peek()), state, reference.params)
    if meta["eval_before"] is None:
      meta["eval_before"] = evaluator(state["params"], config.sft_steps,
                                      source_lib.step_key(rng, 2 << 20, mesh))
      eval_lib.log_results("before GRPO", meta["eval_before"])
    profiler = session.closing(profiling.StepProfiler(
        workdir, config.profile.start_step, config.profile.num_steps,
        python_tracer=config.profile.get("python_tracer", False)))
    memory_profile = profiling.MemoryProfile(workdir, config.profile.memory_profile)
    log = metrics_lib.StepLog(session.writer, metrics_lib.Progress(
        config.num_steps, meta["grpo_step"], "grpo"), num_rows=config.batch_size * G,
        max_consecutive_nonfinite=config.max_consecutive_nonfinite,
        max_logprob_gap=config.rollout.max_logprob_gap, step_offset=config.sft_steps, mesh=mesh)
    steps_per_epoch = data_lib.batches_per_epoch(len(train_data), config.batch_size)
    first_step, ckpt_base = meta["grpo_step"], config.sft_steps

    def saved_state():  # LoRA: the adapters and their moments; the base is named in meta
      meta["rollout_pending"] = source.pending_meta()  # off-policy: the rollouts in flight
      train = dict(state, params=policy.split(state["params"])[0]) if policy.split else state
      return {"train": train, **reference.saved(), **source.saved()}

    # ------------------------------------------------------------------ GRPO: steps
    while meta["grpo_step"] < config.num_steps:
      step = meta["grpo_step"]
      profiler.step_begin(step)
      t_step = time.time()
      phase = profiling.phase
      with jax.transfer_guard(config.debug.transfer_guard if step > first_step else "allow"), \
          profiling.step_span(step):
        # 1-3. Prompts, rollout (G completions per prompt; on-policy or max_staleness steps
        # behind), rewards on the host (+ DAPO's overlong penalty; dynamic sampling's rounds).
        batch = source.next(state["params"], step)
        rollout = batch.rollout

        # 4. Advantages per group, and the [prompt; completion] rows to train on.
        t0 = time.time()
        with phase("advantages"):
          if ahead:  # the first step of a prompt width: its programs compiled meanwhile
            ahead.wait(batch.prompt["ids"].shape[1])
          upd = fns.assemble(batch.prompt["ids"], batch.prompt["mask"], rollout, batch.rewards)

        # 5. Log-probs: old policy (the sampler's when off-policy) and reference (beta > 0).
        if off_policy:
          upd["old_logp"] = batch.behaviour_logp
        elif needs_old_logp:
          with phase("old_logprobs"):
            upd["old_logp"] = fns.logprobs(state["params"], upd["input_ids"],
                                           upd["attention_mask"])
        if reference.enabled:
          with phase("ref_logprobs"):
            upd["ref_logp"] = reference.logprobs(state["params"], upd["input_ids"],
                                                 upd["attention_mask"])
        kl_rewards_n = None
        if config.kl_in_reward:  # rewards - beta * sum_t KL_t, then the advantages again
          with phase("kl_in_reward"):
            upd, kl_rewards_n = fns.fold_kl(upd, batch.rewards)

        # 6. num_iterations optimizer updates over the whole rollout batch; meanwhile the host
        # prepares the next step's prompts. Then the sampler's weights and the reference follow.
        with phase("update"):
          for _ in range(config.num_iterations):
            state, upd_metrics = fns.update(state, upd)
        t_prefetch = time.time()
        source.while_updating(step)
        t_prefetch = time.time() - t_prefetch
        with phase("update"):
          jax.block_until_ready(state)  # a wait, not a read: timing only
        meta["grpo_step"] = step = step + 1
        source.after_update(state["params"])
        with phase("ref_refresh"):
          reference.after_update(step, state["params"])

        # 7a. This step's figures stay where they are until the log interval (run/metrics.py).
        with phase("log"):
          host, lengths_n = batch.host, batch.host["mask"].sum(-1)
          mismatch = {} if engine.matches_trainer else dict(
              sampler_logp_nc=rollout.logprobs, trainer_logp_nc=upd["old_logp"])
          if kl_rewards_n is not None:
            mismatch["kl_rewards_n"] = kl_rewards_n
          log.add(step, means={"reward/total": host["rewards"].sum(),
                               **{f"reward/{k}": v.sum() for k, v in host["per_function"].items()},
                               "completions/mean_length": lengths_n.sum(),
                               "completions/truncated_fraction": host["truncated"].sum()},
                  totals={"reward/errors": host["errors"], "completions/tokens": lengths_n.sum()},
                  host={"perf/update_sec": time.time() - t0 - t_prefetch,
                        "perf/step_time_sec": time.time() - t_step,
                        "data/epoch": _epoch(train_iter, steps_per_epoch), **batch.figures},
                  device={**stats_fn(batch.rewards, upd["advantages"], rollout.mask, **mismatch),
                          **upd_metrics})
      profiler.step_end(step - 1, block_on=state["params"])
      memory_profile.step_end(step)
      if step == first_step + 1:
        profiling.log_memory("the first step (sampler cache, update)")

      # 7b. Every N steps: log, evaluate, checkpoint; stop on SIGTERM or the step budget.
      budget_spent = bool(config.max_steps_per_run) and step < config.num_steps and (
          step - first_step >= config.max_steps_per_run)
      if step % config.log_interval_steps == 0 or step == config.num_steps or budget_spent:
        log.flush()
      if config.eval_interval_steps and step % config.eval_interval_steps == 0 and (
          step < config.num_steps):
        meta["history"].append({"step": step, "eval": evaluator(
            state["params"], ckpt_base + step, source_lib.step_key(rng, step - 1, mesh))})
      if step % config.save_interval_steps == 0 or step == config.num_steps:
        log.flush()  # the checkpoint records how many metric rows precede it
        session.save(ckpt_base + step, saved_state(), train_iter)
      if session.stop_requested(budget_spent=budget_spent):
        log.flush()
        session.stop(ckpt_base + step, saved_state(), train_iter)

    # ------------------------------------------------------------------------- finish
    eval_after = evaluator(state["params"], ckpt_base + config.num_steps,
                           source_lib.step_key(rng, 3 << 20, mesh))
    eval_lib.log_results("after GRPO", eval_after)
    session.ckpt.wait()
    summary = {"final_step": meta["grpo_step"], "wall_time_sec": round(session.wall_time(), 2),
               "sft_steps": meta["sft_step"], "eval_initial": meta["eval_initial"],
               "eval_before": meta["eval_before"], "eval_after": eval_after,
               "eval_history": meta["history"]}
    session.write_summary(summary)
    _log_summary(summary, workdir)
    if config.report_at_end and session.is_main:
      _write_report(session, workdir)
    return summary


# ======================================================================== loop helpers


def _run_length(config, num_train_prompts: int):
  """num_epochs > 0: a copy of `config` with num_steps = epochs x batches per epoch."""
  if not config.num_epochs:
    return config
  per_epoch = data_lib.batches_per_epoch(num_train_prompts, config.batch_size)
  if per_epoch == 0:
    raise ValueError(f"num_epochs={config.num_epochs}: {num_train_prompts} train prompts cannot "
                     f"fill one batch of batch_size={config.batch_size}. Fix: lower batch_size")
  config = config.copy_and_resolve_references()
  config.num_steps = config.num_epochs * per_epoch
  logging.info("num_epochs=%d: %d train prompts // batch_size %d = %d steps per epoch -> "
               "num_steps=%d", config.num_epochs, num_train_prompts, config.batch_size,
               per_epoch, config.num_steps)
  return config


def _epoch(train_iter, steps_per_epoch: int) -> float:
  """Epochs of prompts drawn so far (data/epoch), from the iterator's position."""
  return train_iter.get_state()["next_index"] / max(steps_per_epoch, 1)


def _evaluator(config, session, policy, tokenizer, mesh, eval_data, decode):
  """The evaluation (eval/evaluate.py) on its own native engines: greedy, and eval.num_samples."""
  def engine(samples_per_prompt):
    return session.closing(rollout_lib.make_engine(
        config, policy, tokenizer, mesh, kind="native", num_generations=samples_per_prompt,
        max_new_tokens=config.eval.max_new_tokens or config.max_completion_length))
  return eval_lib.Evaluator(config, engine(1), eval_data, mesh, decode=decode,
                            writer=session.writer, sample_engine=(
                                engine(config.eval.num_samples)
                                if config.eval.num_samples > 1 else None))


def _start_grpo(config, session, fns, policy, mesh, params, train_iter, reference, source):
  """The update state, restored when GRPO was interrupted (with the reference's copy and the
  in-flight rollouts), else fresh from `params` (the reference then starts from it too).
  LoRA checkpoints hold the adapters; the base is loaded from where meta["lora_base"] says."""
  if session.resume_phase == "grpo":
    abstract = fns.abstract_state
    if policy.split:
      abstract = dict(abstract, params=policy.split(abstract["params"])[0])
    restored = session.restore({"train": abstract, **reference.target(),
                                **source.target(session.meta)}, train_iter)
    state = restored["train"]
    if policy.split:
      base = lora_lib.load_base(config, policy, mesh, session.meta.get("lora_base", ""))
      state = dict(state, params=policy.combine(state["params"], base))
    profiling.log_memory("restoring the optimizer state")
    reference.restore(restored)
    source.restore(restored, session.meta)
  else:
    state = fns.init(params)
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
  logging.info("summary: %s %.3f -> %.3f (%s) in %.1fs; %s/summary.json", metric,
               before[name][metric], value, name, summary["wall_time_sec"], workdir)
