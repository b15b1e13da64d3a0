"""The GRPO training loop: one function, read top to bottom.

    run(config, workdir)

  setup       session (checkpoints, metrics, preemption, one teardown), mesh, data, policy,
              rollout engine, evaluator, rewards, the jitted update functions
  sft         the optional supervised warm start (config.sft_steps; sft.py owns that stage)
  grpo        start (or restore) the update state and the frozen reference, evaluate, then
              per step: prompts -> rollout (G per prompt) -> rewards -> advantages ->
              old/ref log-probs -> num_iterations updates -> log / eval / checkpoint
  finish      evaluation after training, DIR/summary.json

Shapes: B prompts per step, G samples per prompt, N = B*G rows, P prompt length, C completion
length. Multi-host: every process runs this same function on its own rows of each batch
(prompts, decoding, rewards); arrays that meet on the device are global, sharded over the
mesh. Only process 0 writes logs and summary.json (Orbax coordinates checkpoint writes).

Host traffic is on purpose only: prompts and rewards go to the device, completions come back
for scoring, and every other figure waits on the device until the log interval (metrics.py).
`config.debug.transfer_guard="disallow"` enforces that on every step after the first.
"""
import functools
import time

from absl import logging
import jax
import numpy as np

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import compile_ahead
from grpo_jax import data as data_lib
from grpo_jax import dynamic_sampling as dyn_lib
from grpo_jax import eval_tasks
from grpo_jax import evaluate as eval_lib
from grpo_jax import metrics as metrics_lib
from grpo_jax import multihost
from grpo_jax import profiling
from grpo_jax import prompts as prompts_lib
from grpo_jax import report as report_lib
from grpo_jax import rewards as rewards_lib
from grpo_jax import rollout as rollout_lib
from grpo_jax import session as session_lib
from grpo_jax import sft as sft_lib
from grpo_jax import sharding
from grpo_jax.metrics import NonFiniteError  # noqa: F401  (raised by StepLog.flush)
from grpo_jax.models import build
from grpo_jax.models import lora as lora_lib
from grpo_jax.models import policy as policy_lib
from grpo_jax.rewards import judge as judge_lib
from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rl import step as step_lib


def run(config, workdir: str) -> dict:
  """Trains per `config`, writing everything under `workdir`; returns the summary dict.

  A checkpoint whose arrays fail to restore is moved aside (session.py) and the run starts
  over from the previous one."""
  while True:
    try:
      return _run(config, workdir)
    except ckpt_lib.DamagedCheckpoint as e:
      logging.warning("%s; resuming from the checkpoint before it", e)


def _run(config, workdir: str) -> dict:
  mesh = build.make_mesh(config)
  with session_lib.open_session(config, workdir, mesh) as session:
    # ------------------------------------------------------------------------------ setup
    logging.info("mesh %s over %d devices, %d process(es)", dict(mesh.shape), mesh.size,
                 jax.process_count())
    tokenizer = data_lib.build_tokenizer(config.tokenizer.kind,
                                         config.tokenizer.path or config.model.hf_path)
    train_data, eval_data = prompts_lib.prompt_data(config, tokenizer)
    config = _run_length(config, len(train_data))
    decode = _decoder(tokenizer)
    policy = build.make_policy(config, mesh, abstract=session.resume_step is not None)
    logging.info("policy: %s (%s), %.2fM parameters", config.model.impl, config.model.preset,
                 sum(x.size for x in jax.tree.leaves(policy.params)) / 1e6)
    profiling.log_memory("loading the policy")
    engine = session.closing(rollout_lib.make_engine(config, policy, tokenizer, mesh))
    eval_engine = session.closing(_eval_engine(config, policy, tokenizer, mesh, 1))
    sample_engine = (session.closing(_eval_engine(config, policy, tokenizer, mesh,
                                                  config.eval.num_samples))
                     if config.eval.num_samples > 1 else None)
    evaluator = eval_lib.Evaluator(config, eval_engine, eval_data, mesh, decode=decode,
                                   writer=session.writer, sample_engine=sample_engine)
    r = config.reward
    reward_fn = session.closing(rewards_lib.build_reward_computer(
        r.functions, r.weights, custom_file=r.custom_file, custom_weight=r.custom_weight,
        on_error=r.on_error, num_workers=r.num_workers, timeout_sec=r.timeout_sec))
    reward_fn.check(train_data.rows[0])  # a broken plug-in fails now, not after SFT
    judge = session.closing(judge_lib.build_judge(config, mesh))  # None: reward.judge.path ""
    fns = step_lib.build(config, policy, mesh)

    # --------------------------------------------------------- SFT warm start (sft.py)
    params = sft_lib.run(config, session, policy, mesh, train_data, evaluator)
    if config.lora.rank and session.resume_phase != "grpo":  # the base GRPO's adapters go on
      params = lora_lib.after_sft(config, session, policy, params, mesh, workdir)

    # ---------------------------------------------------------- GRPO: start or resume
    # Global batches of row indices (each process takes its rows in _rollout_round).
    train_iter = data_lib.make_prompt_iterator(len(train_data), batch_size=config.batch_size,
                                               seed=config.seed)
    state, ref_params = _start_grpo(config, session, fns, policy, mesh, params, train_iter)
    meta, rng, G = session.meta, session.rng, config.num_generations
    steps_per_epoch = data_lib.batches_per_epoch(len(train_data), config.batch_size)
    profiler = session.closing(profiling.StepProfiler(
        workdir, config.profile.start_step, config.profile.num_steps,
        python_tracer=config.profile.get("python_tracer", False)))
    memory_profile = profiling.MemoryProfile(workdir, config.profile.memory_profile)
    log = metrics_lib.StepLog(session.writer, metrics_lib.Progress(
        config.num_steps, meta["grpo_step"], "grpo"), num_rows=config.batch_size * G,
        max_consecutive_nonfinite=config.max_consecutive_nonfinite,
        max_logprob_gap=config.rollout.max_logprob_gap, step_offset=config.sft_steps)
    stats_fn = jax.jit(functools.partial(metrics_lib.rollout_stats, group_size=G,
                                         advantage_clip=config.loss.advantage_clip),
                       out_shardings=sharding.replicated(mesh))
    train_gen = rollout_lib.GenerationConfig(config.rollout.temperature, config.rollout.top_k,
                                             config.rollout.top_p)
    # Old-policy log-probs: for the PPO ratio over several passes, for TIS, and whenever the
    # sampler is another program than the trainer (its log-probs are then only close).
    needs_old_logp = (config.num_iterations > 1 or config.loss.tis_cap > 0 or
                      config.kl_in_reward or not engine.matches_trainer)
    dynamic = config.loss.dynamic_sampling and config.loss.max_resample_rounds > 0

    prompts = prompts_lib.NextPrompts(config, train_data, train_iter, mesh)
    # The first batch's sampler and step programs compile in the background from here on,
    # during the evaluation and the first rollout (compile_ahead.py); later widths when
    # prefetched.
    ahead = session.closing(compile_ahead.CompileAhead(
        config, fns, stats_fn, policy, mesh, needs_old_logp=needs_old_logp,
        matches_trainer=engine.matches_trainer, engine=engine, generation=train_gen,
        key=_step_key(rng, 0, mesh))) if config.compile_ahead else None
    if ahead and meta["grpo_step"] < config.num_steps:
      prompts.prefetch()
      ahead.submit(prompts.peek(), state, ref_params)
    if meta["eval_before"] is None:
      meta["eval_before"] = evaluator(state["params"], config.sft_steps,
                                      jax.random.fold_in(rng, 2 << 20))
      eval_lib.log_results("before GRPO", meta["eval_before"])

    def look_ahead():  # the next batch's width compiles while the device runs this step
      if meta["grpo_step"] + 1 < config.num_steps:
        prompts.prefetch()
        ahead.submit(prompts.peek(), state, ref_params)

    def draw(key):  # steps 1-3 on a fresh batch of prompts
      return _rollout_round(config, engine, prompts, state["params"], key, train_gen,
                            reward_fn, judge, decode, timing, ahead,
                            look_ahead if ahead else None)
    take_groups = jax.jit(functools.partial(dyn_lib.take, group_size=G),
                          out_shardings=sharding.batch_sharding(mesh, 1))
    first_step, ckpt_base = meta["grpo_step"], config.sft_steps

    def saved_state():  # LoRA: the adapters and their moments; the base is named in meta
      train = dict(state, params=policy.split(state["params"])[0]) if policy.split else state
      return {"train": train, **({"ref": ref_params} if ref_params is not None else {})}

    # ------------------------------------------------------------------ GRPO: steps
    while meta["grpo_step"] < config.num_steps:
      step = meta["grpo_step"]
      profiler.step_begin(step)
      t_step = time.time()
      phase = profiling.phase
      with jax.transfer_guard(config.debug.transfer_guard if step > first_step else "allow"), \
          profiling.step_span(step):
        # 1-3. Prompts (this process's rows of the batch), rollout (G completions per prompt
        # from the current policy), rewards on the host (+ DAPO's overlong penalty); with DAPO
        # dynamic sampling, more rounds on fresh prompts until the groups carry signal.
        timing = {"rollout": 0.0, "rewards": 0.0}
        key = _step_key(rng, step, mesh)
        prompt, rollout, host = draw(key)
        dyn_stats = {}
        if dynamic:
          prompt, rollout, host, dyn_stats = _dynamic_sampling(
              config, (prompt, rollout, host), draw, key, mesh, take_groups)
        prompt_ids_bp, prompt_mask_bp = prompt["ids"], prompt["mask"]
        host_rewards_n, lengths_n = host["rewards"], host["mask"].sum(-1)
        rewards_n = multihost.to_global(host_rewards_n, mesh)
        rollout_sec, reward_sec = timing["rollout"], timing["rewards"]

        # 4. Advantages per group, and the [prompt; completion] rows to train on.
        t0 = time.time()
        with phase("advantages"):
          if ahead:  # the first step of a prompt width: its programs compiled meanwhile
            ahead.wait(prompt_ids_bp.shape[1])
          upd = fns.assemble(prompt_ids_bp, prompt_mask_bp, rollout, rewards_n)

        # 5. Log-probs: old policy (when needed) and frozen reference (beta > 0).
        if needs_old_logp:
          with phase("old_logprobs"):
            upd["old_logp"] = fns.logprobs(state["params"], upd["input_ids"],
                                           upd["attention_mask"])
        if config.beta > 0:  # LoRA: the base of this very state, run without the adapters
          with phase("ref_logprobs"):
            ref = (policy.reference(state["params"]) if policy.reference else
                   _on_device(config, ref_params))
            upd["ref_logp"] = fns.logprobs(ref, upd["input_ids"], upd["attention_mask"])
        kl_rewards_n = None
        if config.kl_in_reward:  # rewards - beta * sum_t KL_t, then the advantages again
          with phase("kl_in_reward"):
            upd, kl_rewards_n = fns.fold_kl(upd, rewards_n)

        # 6. num_iterations optimizer updates over the whole rollout batch; while the device
        # runs them, the host prepares the next step's prompts (prompts_lib.NextPrompts).
        with phase("update"):
          for _ in range(config.num_iterations):
            state, upd_metrics = fns.update(state, upd)
        t_prefetch = time.time()
        if step + 1 < config.num_steps:
          with phase("prompts"):
            prompts.prefetch()  # (done already when compiling ahead: look_ahead)
        t_prefetch = time.time() - t_prefetch
        with phase("update"):
          jax.block_until_ready(state)  # a wait, not a read: timing only
        meta["grpo_step"] = step = step + 1

        # 6b. Reference refresh (reference.refresh_every_steps): a copy or an EMA of the policy.
        if ref_params is not None and config.reference.refresh_every_steps and (
            step % config.reference.refresh_every_steps == 0):
          with phase("ref_refresh"):
            ref_params = fns.refresh(_on_device(config, ref_params), state["params"])
            if config.reference.offload_to_host:
              ref_params = _to_memory_kind(ref_params, "pinned_host")

        # 7a. This step's figures stay where they are until the log interval (metrics.py).
        with phase("log"):
          mismatch = {} if engine.matches_trainer else dict(
              sampler_logp_nc=rollout.logprobs, trainer_logp_nc=upd["old_logp"])
          if kl_rewards_n is not None:
            mismatch["kl_rewards_n"] = kl_rewards_n
          log.add(step, means={"reward/total": host_rewards_n.sum(),
                               **{f"reward/{k}": v.sum() for k, v in host["per_function"].items()},
                               "completions/mean_length": lengths_n.sum(),
                               "completions/truncated_fraction": host["truncated"].sum()},
                  totals={"reward/errors": host["errors"], "completions/tokens": lengths_n.sum()},
                  host={"perf/rollout_sec": rollout_sec, "perf/reward_sec": reward_sec,
                        "perf/update_sec": time.time() - t0 - t_prefetch,
                        "perf/step_time_sec": time.time() - t_step,
                        "data/epoch": _epoch(train_iter, steps_per_epoch), **dyn_stats,
                        **engine.stats()},
                  device={**stats_fn(rewards_n, upd["advantages"], rollout.mask, **mismatch),
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
            state["params"], ckpt_base + step, jax.random.fold_in(rng, step - 1))})
      if step % config.save_interval_steps == 0 or step == config.num_steps:
        log.flush()  # the checkpoint records how many metric rows precede it
        session.save(ckpt_base + step, saved_state(), train_iter)
      if session.stop_requested(budget_spent=budget_spent):
        log.flush()
        session.stop(ckpt_base + step, saved_state(), train_iter)

    # ------------------------------------------------------------------------- finish
    eval_after = evaluator(state["params"], ckpt_base + config.num_steps,
                           jax.random.fold_in(rng, 3 << 20))
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


def _rollout_round(config, engine, prompts, params, key, generation, reward_fn, judge, decode,
                   timing: dict, ahead=None, after_dispatch=None):
  """GRPO steps 1-3 on the next batch of prompts. -> (prompt, rollout, host): the global
  prompt arrays {"ids", "mask"} [B, P] (P: data.prompt_width), the global Rollout, and this process's host rows:
  tokens, mask, truncated, rewards (f32, + DAPO's overlong penalty), per_function, errors."""
  G, phase = config.num_generations, profiling.phase
  with phase("prompts"):
    batch, prompt = prompts.take()
  t0 = time.time()
  with phase("rollout"):
    if ahead:  # a width's first rollout: its sampler compiled meanwhile (compile_ahead.py)
      ahead.wait(prompt["ids"].shape[1], only="sampler")
    rollout = engine.generate(params, batch, key, generation)
    if after_dispatch:  # host work while the device samples
      after_dispatch()
    # This process's rows, on the host (one transfer).
    tokens_nc, mask_nc, truncated_n = multihost.local_rows(
        (rollout.tokens, rollout.mask, rollout.truncated))
  timing["rollout"] += time.time() - t0
  t0 = time.time()
  with phase("rewards"):
    prompts_n = [p for p in batch["prompts"] for _ in range(G)]
    completions_n = decode.rows(tokens_nc, mask_nc)
    scored = reward_fn(prompts_n, completions_n, [row for row in batch["rows"] for _ in range(G)])
    per_function = dict(scored.per_function)
    total = scored.total
    if judge is not None:  # collective: every process, its own rows
      per_function["judge"] = judge(prompts_n, completions_n)
      total = total + config.reward.judge.weight * per_function["judge"]
    rewards_n = total + adv_lib.overlong_penalty(
        mask_nc.sum(-1), config.max_completion_length, config.loss.overlong_buffer,
        config.loss.overlong_factor)
  timing["rewards"] += time.time() - t0
  return prompt, rollout, dict(tokens=tokens_nc, mask=mask_nc, truncated=truncated_n,
                               rewards=rewards_n.astype(np.float32),
                               per_function=per_function, errors=scored.errors)


def _dynamic_sampling(config, first, draw, key, mesh, take_groups):
  """DAPO dynamic sampling (dynamic_sampling.py): rounds of `draw(key)` until they hold
  batch_size groups with signal (at most loss.max_resample_rounds more), the same choice on
  every process. -> (prompt, rollout, host) of the chosen groups, and the figures to log."""
  G, B = config.num_generations, config.batch_size
  rounds = [first]
  flags = [dyn_lib.global_flags(first[2]["rewards"], G, mesh, B)]
  while len(rounds) <= config.loss.max_resample_rounds and sum(map(np.sum, flags)) < B:
    rounds.append(draw(jax.random.fold_in(key, multihost.replicated(
        np.uint32(len(rounds)), mesh))))
    flags.append(dyn_lib.global_flags(rounds[-1][2]["rewards"], G, mesh, B))
  stats = {"dynamic_sampling/rounds": len(rounds),
           "dynamic_sampling/groups_sampled": B * len(rounds),
           "dynamic_sampling/signal_groups_sampled": int(sum(map(np.sum, flags)))}
  chosen = dyn_lib.picks(flags, B)
  if len(rounds) == 1 and np.array_equal(chosen, np.arange(B)):
    return (*first, stats)
  put = functools.partial(multihost.to_global, mesh=mesh)
  names = list(first[2]["per_function"])
  out = take_groups(
      [{"prompt": prompt, "rows": {"rollout": rollout, "rewards": put(host["rewards"]),
                                   **{k: put(np.asarray(host["per_function"][k], np.float32))
                                      for k in names}}}
       for prompt, rollout, host in rounds],
      multihost.replicated(chosen.astype(np.int32), mesh))
  rollout, rows = out["rows"]["rollout"], out["rows"]
  tokens, mask, truncated, rewards, per_function = multihost.local_rows(
      (rollout.tokens, rollout.mask, rollout.truncated, rows["rewards"],
       {k: rows[k] for k in names}))
  host = dict(tokens=tokens, mask=mask, truncated=truncated, rewards=rewards,
              per_function=per_function, errors=sum(h["errors"] for _, _, h in rounds))
  return out["prompt"], rollout, host, stats


def _eval_engine(config, policy, tokenizer, mesh, samples_per_prompt: int):
  return rollout_lib.make_engine(
      config, policy, tokenizer, mesh, kind="native", num_generations=samples_per_prompt,
      max_new_tokens=config.eval.max_new_tokens or config.max_completion_length)


def _decoder(tokenizer):
  """decode(tokens [C], mask [C]) -> the completion's text; decode.rows(tokens [N, C], mask)
  -> N texts, the host lists built once for the batch (host time between device programs)."""
  def text(ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special=True)

  def decode(tokens, mask):
    return text(np.asarray(tokens).tolist(), np.asarray(mask).tolist())

  decode.rows = lambda tokens, mask: list(map(text, np.asarray(tokens).tolist(),
                                               np.asarray(mask).tolist()))
  return decode


def _start_grpo(config, session, fns, policy, mesh, params, train_iter):
  """(update state, reference params or None): restored when GRPO was interrupted, else
  fresh from `params` (the reference is the policy GRPO starts from, stored in the compute
  dtype: policy.as_reference; beta = 0 or LoRA, whose reference is the policy's own base: none).
  LoRA checkpoints hold the adapters; the base is loaded from where meta["lora_base"] says."""
  use_ref = config.beta > 0 and policy.reference is None
  if session.resume_phase == "grpo":
    abstract = fns.abstract_state
    if policy.split:
      abstract = dict(abstract, params=policy.split(abstract["params"])[0])
    target = {"train": abstract}
    if use_ref:
      target["ref"] = policy_lib.as_reference(
          sharding.abstract_with(policy.params, policy.param_shardings(mesh)), _ref_dtype(config))
    restored = session.restore(target, train_iter)
    state, ref_params = restored["train"], restored.get("ref")
    if policy.split:
      base = lora_lib.load_base(config, policy, mesh, session.meta.get("lora_base", ""))
      state = dict(state, params=policy.combine(state["params"], base))
    profiling.log_memory("restoring the optimizer state")
  else:
    state = fns.init(params)
    profiling.log_memory("the optimizer state")
    ref_params = (policy_lib.as_reference(state["params"], _ref_dtype(config)) if use_ref
                  else None)
  if ref_params is not None and config.reference.offload_to_host:
    ref_params = _to_memory_kind(ref_params, "pinned_host")
  if ref_params is not None:
    profiling.log_memory("the reference")
  return state, ref_params


def _ref_dtype(config):
  """The reference's storage dtype: the compute dtype (policy.as_reference), except for an EMA
  refresh (refresh_mix < 1), whose small mixes a 16-bit copy would round away."""
  r = config.reference
  return (config.model.param_dtype if r.refresh_every_steps and r.refresh_mix < 1 else
          config.model.dtype)


def _step_key(rng, step: int, mesh):
  """fold_in(rng, step), the step put beside the (replicated) key explicitly."""
  return jax.random.fold_in(rng, multihost.replicated(np.uint32(step), mesh))


def _on_device(config, params):
  return _to_memory_kind(params, "device") if config.reference.offload_to_host else params


def _to_memory_kind(tree, kind):
  try:
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)
  except (ValueError, NotImplementedError) as e:  # backends without host memory spaces
    logging.log_first_n(logging.WARNING, "reference offload to %s unavailable here: %s", 1, kind,
                        e)
    return tree


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
