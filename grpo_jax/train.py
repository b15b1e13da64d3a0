"""The GRPO training loop: one function, read top to bottom.

    run(config, workdir)

  setup       mesh, tokenizer, data, policy (+ frozen reference when beta > 0), optimizer,
              jitted functions, checkpoint manager; resume from the latest checkpoint
  eval        before training (and after an SFT warm start)
  sft         optional supervised warm start on demonstrations (config.sft_steps; sft.py)
  grpo step   prompts -> rollout (G per prompt) -> rewards -> advantages -> old/ref log-probs
              -> num_iterations updates (micro-batched, gradient accumulation) -> log / eval /
              checkpoint
  finish      eval after training, DIR/summary.json

Multi-host: every process runs this same function. Each loads its own shard of prompts, builds
global arrays from them, decodes and scores its own rows of each rollout on its host, and only
process 0 writes logs and summary.json (Orbax coordinates checkpoint writes).
"""
import json
import os
import signal
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import data as data_lib
from grpo_jax import evaluate as eval_lib
from grpo_jax import metrics as metrics_lib
from grpo_jax import multihost
from grpo_jax import profiling
from grpo_jax import rewards as rewards_lib
from grpo_jax import sharding
from grpo_jax import sft as sft_lib
from grpo_jax.models import policy as policy_lib
from grpo_jax.rl import advantages as adv_lib
from grpo_jax.rl import step as step_lib
from grpo_jax.rollout import GenerationConfig
from grpo_jax.rollout import Sampler

_PROCESS_START = time.time()


class NonFiniteError(RuntimeError):
  pass


# ============================================================================ setup helpers


def load_rows(config) -> tuple[list[dict], list[dict]]:
  """Train and eval rows from config.data (every reader gives the same row shape)."""
  d = config.data

  def read(source, path, split):
    if source == "arithmetic":
      a = d.arithmetic
      n = a.num_train if split == "train" else a.num_test
      return data_lib.arithmetic_rows(n, split=split, seed=config.seed, digits=a.digits,
                                      num_ops=a.num_ops, ops=a.ops, style=a.demonstration)
    return data_lib.READERS[source](path)

  return read(d.train_source, d.train_path, "train"), read(d.eval_source, d.eval_path, "test")


def make_policy(config, mesh, *, abstract=False):
  if config.model.impl == "maxtext":
    from grpo_jax.models import maxtext_adapter  # optional dependency
    return maxtext_adapter.maxtext_policy(config, mesh, abstract=abstract)
  return policy_lib.native_policy(config, mesh, abstract=abstract)


class _Preemption:
  """SIGTERM sets a flag; the loop saves a checkpoint at the next step boundary and exits 0."""

  def __init__(self):
    self.requested = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    logging.warning("SIGTERM: saving a checkpoint at the end of this step, then exiting")
    self.requested = True

  def restore(self):
    signal.signal(signal.SIGTERM, self._previous)


def _decode_fn(tokenizer):
  def decode(tokens, mask):
    return tokenizer.decode([int(t) for t, m in zip(tokens, mask) if m], skip_special=True)
  return decode


def _write_json(path, obj):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


# ===================================================================================== run


def run(config, workdir: str) -> dict:
  """Trains per `config`, writing everything under `workdir`; returns the summary dict."""
  # ------------------------------------------------------------------------------- setup
  is_main = jax.process_index() == 0
  if is_main:
    os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  dp = mesh.shape[sharding.DATA] * mesh.shape[sharding.FSDP]
  nproc = jax.process_count()
  G, P, L = config.num_generations, config.max_prompt_length, config.max_completion_length
  logging.info("mesh %s over %d devices, %d process(es)", dict(mesh.shape), mesh.size, nproc)

  tokenizer = data_lib.build_tokenizer(config.tokenizer.kind,
                                       config.tokenizer.path or config.model.hf_path)
  if tokenizer.vocab_size > config.model.vocab_size and not config.model.hf_path:
    raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size="
                     f"{config.model.vocab_size}: set --config.model.vocab_size >= "
                     f"{tokenizer.vocab_size}")
  decode = _decode_fn(tokenizer)
  train_rows, eval_rows = load_rows(config)
  if config.eval.num_examples:
    eval_rows = eval_rows[:config.eval.num_examples]
  prompt_kw = dict(template=config.data.template,
                   system_prompt=data_lib.system_prompt(config.data.system_prompt),
                   max_prompt_length=P)
  train_data = data_lib.PromptData(train_rows, tokenizer, **prompt_kw)
  eval_data = data_lib.PromptData(eval_rows, tokenizer, **prompt_kw)
  local_batch = config.batch_size // nproc
  train_iter = data_lib.make_prompt_iterator(len(train_data), batch_size=local_batch,
                                             seed=config.seed)
  reward_fn = rewards_lib.build_reward_computer(
      config.reward.functions, config.reward.weights, custom_file=config.reward.custom_file,
      custom_weight=config.reward.custom_weight, on_error=config.reward.on_error,
      num_workers=config.reward.num_workers, timeout_sec=config.reward.timeout_sec)

  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                               max_to_keep=config.checkpoint.max_to_keep,
                               async_save=config.checkpoint.async_save)
  resume_step = ckpt.latest_step()
  policy = make_policy(config, mesh, abstract=resume_step is not None)
  mesh = policy.mesh or mesh  # MaxText: its own axes added (size 1) over the same devices
  param_shardings = policy.param_shardings(mesh)
  logging.info("policy: %s (%s), %.2fM parameters", config.model.impl, config.model.preset,
               sum(x.size for x in jax.tree.leaves(policy.params)) / 1e6)

  # The rollout engine: the jitted native sampler (or vLLM, fed the same native weights).
  train_gen = GenerationConfig(config.rollout.temperature, config.rollout.top_k,
                               config.rollout.top_p)
  eos = tokenizer.stop_ids
  sampler = Sampler(policy.sampler_graphdef, max_prompt_length=P, max_new_tokens=L,
                    num_generations=G, eos_ids=eos, pad_id=tokenizer.pad_id, mesh=mesh)
  eval_sampler = Sampler(policy.sampler_graphdef, max_prompt_length=P,
                         max_new_tokens=config.eval.max_new_tokens or L, num_generations=1,
                         eos_ids=eos, pad_id=tokenizer.pad_id, mesh=mesh)
  if config.rollout.engine == "vllm":
    from grpo_jax.rollout import vllm_engine  # optional dependency
    sampler = vllm_engine.VLLMEngine.from_config(config, policy, tokenizer, mesh)
  to_rollout = jax.jit(policy.rollout_params)

  # Optimizer and the jitted update (state donated, shardings explicit).
  total_updates = config.num_steps * config.num_iterations
  optimizer = step_lib.make_optimizer(
      learning_rate=config.optimizer.learning_rate, total_steps=total_updates,
      warmup_ratio=config.optimizer.warmup_ratio, end_lr_ratio=config.optimizer.end_lr_ratio,
      b1=config.optimizer.b1, b2=config.optimizer.b2,
      weight_decay=config.optimizer.weight_decay, max_grad_norm=config.optimizer.max_grad_norm)
  settings = step_lib.LossSettings.from_config(config)
  num_micro = (G * config.batch_size) // (config.micro_batch_size or G * config.batch_size)
  temperature = float(config.rollout.temperature)

  def lp_fn(params, ids, mask):
    return policy.logprobs(params, ids, mask, L, temperature)

  grpo_update = step_lib.make_grpo_update(lp_fn, optimizer, settings, num_micro)

  def init_train_state(params):
    return step_lib.init_state(params, optimizer)

  abstract_state = jax.eval_shape(init_train_state, policy.params)
  state_shardings = dict(
      params=param_shardings,
      opt_state=sharding.opt_state_shardings(optimizer, abstract_state["opt_state"], param_shardings,
                                    mesh),
      nonfinite_streak=sharding.replicated(mesh), nonfinite_total=sharding.replicated(mesh))
  rows2 = sharding.batch_sharding(mesh, 2)
  rows1 = sharding.batch_sharding(mesh, 1)
  update_fn = jax.jit(grpo_update, donate_argnums=0,
                      out_shardings=(state_shardings, sharding.replicated(mesh)))
  logprob_fn = jax.jit(lp_fn, out_shardings=rows2)
  init_state_fn = jax.jit(init_train_state, out_shardings=state_shardings)
  use_ref = config.beta > 0
  score_kw = dict(estimator=config.loss.estimator, eps=config.loss.adv_eps,
                  std_kind=config.loss.std_kind)
  advantages_fn = jax.jit(lambda r: adv_lib.group_advantages(r, G, **score_kw),
                          out_shardings=rows1)

  # ------------------------------------------------------------------- restore or start
  meta = dict(phase="sft" if config.sft_steps > 0 else "grpo", sft_step=0, grpo_step=0,
              eval_initial=None, eval_before=None, wall_time_sec=0.0, history=[])
  rng = jax.random.key(config.seed)
  ref_params = None
  sft = None
  if resume_step is not None:
    logging.info("resuming from %s/%d", ckpt.directory, resume_step)
    phase = ckpt.restore_meta(resume_step)["phase"]
    if phase == "sft":
      sft = sft_lib.SFTStage(config, policy, mesh, param_shardings)
      target = sft.abstract_state()
      iterator = sft.iterator(train_data)
    else:
      target = {"train": sharding.abstract_with(abstract_state, state_shardings)}
      if use_ref:
        target["ref"] = sharding.abstract_with(policy.params, param_shardings)
      iterator = train_iter
    target["rng"] = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
    restored, meta = ckpt.restore(resume_step, target, iterator)
    rng = jax.random.wrap_key_data(restored["rng"])
    if phase == "sft":
      sft.state = restored["sft"]
      sft.data_iter = iterator
      policy.params = sft.state["params"]
      train_state = None
    else:
      train_state = restored["train"]
      ref_params = restored.get("ref")
  else:
    train_state = None

  writer = metrics_lib.MetricWriter(workdir)
  preempt = _Preemption()
  wall_offset = meta["wall_time_sec"]  # time spent by earlier (preempted) runs

  def wall_time():
    return wall_offset + (time.time() - _PROCESS_START)

  def run_eval(params, tag_step, key):
    results = eval_lib.evaluate(eval_sampler, to_rollout(params), eval_data, mesh,
                                generation_configs=config.eval.generation_configs,
                                batch_size=_eval_batch(config, dp, nproc), rng=key,
                                decode=decode)
    writer.write_scalars(tag_step, eval_lib.as_scalars(results))
    return results

  def save(step, state_tree, iterator, *, force=False):
    meta["wall_time_sec"] = wall_time()
    state_tree = dict(state_tree, rng=jax.random.key_data(rng))
    ckpt.save(step, state_tree, iterator, dict(meta), force=force)

  def exit_if_preempted(step, state_tree, iterator, *, budget_spent=False):
    if multihost.any_process(preempt.requested) or budget_spent:
      save(step, state_tree, iterator, force=True)
      ckpt.close()
      writer.close()
      preempt.restore()
      why = "preempted" if preempt.requested else (
          f"max_steps_per_run={config.max_steps_per_run} reached")
      logging.warning("%s: checkpoint %d written, exiting with status 0; run the same command "
                      "again to resume", why, step)
      raise SystemExit(0)

  # ------------------------------------------------------------------------ SFT warm start
  if meta["phase"] == "sft":
    if meta["eval_initial"] is None:
      meta["eval_initial"] = run_eval(policy.params, 0, jax.random.fold_in(rng, 1 << 20))
    if sft is None:
      sft = sft_lib.SFTStage(config, policy, mesh, param_shardings)
      sft.start(policy.params, train_data)
    val_data = sft.validation_data(train_rows, tokenizer, prompt_kw)
    progress = metrics_lib.Progress(config.sft_steps, meta["sft_step"], "sft")
    while meta["sft_step"] < config.sft_steps:
      step = meta["sft_step"]
      loss = sft.step(train_data)
      meta["sft_step"] = step + 1
      if (step + 1) % config.log_interval_steps == 0 or step + 1 == config.sft_steps:
        scalars = {"sft/loss": float(loss)}
        writer.write_scalars(step + 1, scalars)
        progress.log(step + 1, scalars, ("sft/loss",))
      if val_data is not None and (step + 1) % config.sft.eval_interval_steps == 0:
        acc = eval_lib.evaluate(
            eval_sampler, to_rollout(sft.state["params"]), val_data, mesh,
            generation_configs=("greedy",), batch_size=_eval_batch(config, dp, nproc),
            rng=rng, decode=decode)["greedy"]["accuracy"]
        writer.write_scalars(step + 1, {"sft/validation_accuracy": acc})
        if acc >= config.sft.stop_at_accuracy:
          logging.info("SFT: validation accuracy %.3f >= sft.stop_at_accuracy=%.3f after %d "
                       "steps; starting GRPO", acc, config.sft.stop_at_accuracy, step + 1)
          break
      if (step + 1) % config.save_interval_steps == 0 and step + 1 < config.sft_steps:
        save(step + 1, {"sft": sft.state}, sft.data_iter)
      exit_if_preempted(step + 1, {"sft": sft.state}, sft.data_iter)
    policy.params = sft.state["params"]
    meta["phase"] = "grpo"
    sft = None

  # ---------------------------------------------------------------------- GRPO: start
  if train_state is None:
    train_state = init_state_fn(policy.params)
    if use_ref:  # the reference is the policy GRPO starts from (after any warm start)
      ref_params = jax.tree.map(jnp.copy, train_state["params"])
  if use_ref and config.reference.offload_to_host:
    ref_params = _to_memory_kind(ref_params, "pinned_host")
  if not use_ref:
    ref_params = None  # beta = 0: no reference model, no memory, no compute

  if meta["eval_before"] is None:
    meta["eval_before"] = run_eval(train_state["params"], config.sft_steps,
                                   jax.random.fold_in(rng, 2 << 20))
    _log_eval("before GRPO", meta["eval_before"])

  profiler = profiling.StepProfiler(workdir, config.profile.start_step, config.profile.num_steps)
  progress = metrics_lib.Progress(config.num_steps, meta["grpo_step"], "grpo")
  pending = []  # device metrics of steps not yet logged (one device_get per log interval)
  ckpt_base = config.sft_steps
  first_step_this_run = meta["grpo_step"]

  def state_tree():
    tree = {"train": train_state}
    if use_ref:
      tree["ref"] = ref_params
    return tree

  # ----------------------------------------------------------------------- GRPO: steps
  while meta["grpo_step"] < config.num_steps:
    step = meta["grpo_step"]
    profiler.step_begin(step)
    t_step = time.time()
    step_rng = jax.random.fold_in(rng, step)

    # 1. Prompts: this process's rows -> global [B, P] arrays.
    batch = train_data.batch(next(train_iter))
    prompt_ids = multihost.to_global(batch["prompt_ids"], mesh)
    prompt_mask = multihost.to_global(batch["prompt_mask"], mesh)

    # 2. Rollout: G completions per prompt from the current policy.
    t0 = time.time()
    if config.rollout.engine == "vllm":  # weights synced into vLLM in place, then sampled
      rollout = sampler.generate(to_rollout(train_state["params"]), batch, step_rng, train_gen)
    else:
      rollout = sampler(to_rollout(train_state["params"]), prompt_ids, prompt_mask, step_rng,
                        train_gen)
    tokens = multihost.local_rows(rollout.tokens)  # [b*G, L] on this host
    cmask = multihost.local_rows(rollout.mask)
    rollout_sec = time.time() - t0

    # 3. Rewards on the host, for this process's rows.
    t0 = time.time()
    completions = [decode(t, m) for t, m in zip(tokens, cmask)]
    rows = [r for r in batch["rows"] for _ in range(G)]
    prompts = [p for p in batch["prompts"] for _ in range(G)]
    scored = reward_fn(prompts, completions, rows)
    reward_local = scored.total
    lengths = cmask.sum(-1)
    if config.loss.overlong_buffer > 0:
      reward_local = reward_local + np.asarray(adv_lib.overlong_penalty(
          lengths, L, config.loss.overlong_buffer, config.loss.overlong_factor))
    rewards = multihost.to_global(reward_local.astype(np.float32), mesh)
    reward_sec = time.time() - t0
    t0 = time.time()

    # 4. Advantages (+ DAPO dynamic sampling: zero-variance groups leave the loss).
    advantages = advantages_fn(rewards)
    completion_mask = rollout.mask
    if config.loss.dynamic_sampling:
      keep = adv_lib.dynamic_sampling_mask(rewards, G)
      completion_mask = completion_mask * keep[:, None].astype(completion_mask.dtype)

    # 5. The update batch: [prompt; completion] rows, old/ref log-probs where needed.
    input_ids = jnp.concatenate([jnp.repeat(prompt_ids, G, 0), rollout.tokens], 1)
    attention_mask = jnp.concatenate([jnp.repeat(prompt_mask, G, 0), rollout.mask], 1)
    upd = dict(input_ids=input_ids, attention_mask=attention_mask,
               completion_mask=completion_mask, advantages=advantages)
    # The sampler is a different program from the trainer with vLLM, and with a MaxText policy
    # (native sampler on mapped weights): measure the mismatch there.
    mismatch = config.rollout.engine == "vllm" or config.model.impl == "maxtext"
    if config.num_iterations > 1 or config.loss.tis_cap > 0 or mismatch:
      upd["old_logp"] = logprob_fn(train_state["params"], input_ids, attention_mask)
    if config.loss.tis_cap > 0:
      upd["sampler_logp"] = rollout.logprobs
    if use_ref:
      upd["ref_logp"] = logprob_fn(_to_memory_kind(ref_params, "device") if
                                   config.reference.offload_to_host else ref_params,
                                   input_ids, attention_mask)

    # 6. num_iterations optimizer updates over the whole rollout batch.
    nonfinite_before = int(train_state["nonfinite_total"])
    for _ in range(config.num_iterations):
      train_state, upd_metrics = update_fn(train_state, upd)
    meta["grpo_step"] = step + 1
    streak = int(train_state["nonfinite_streak"])  # waits for the update to finish
    update_sec = time.time() - t0

    # 7. Bookkeeping: metrics, non-finite guard, eval, checkpoint, profile, preemption.
    host = {
        "reward/total": float(multihost.sum_over_processes(reward_local.sum())) /
                        (config.batch_size * G),
        "reward/errors": float(multihost.sum_over_processes(scored.errors)),
        "completions/mean_length": float(multihost.sum_over_processes(lengths.sum())) /
                                   (config.batch_size * G),
        "completions/truncated_fraction": float(multihost.sum_over_processes(
            multihost.local_rows(rollout.truncated).sum())) / (config.batch_size * G),
        "perf/rollout_tokens_per_sec": float(multihost.sum_over_processes(lengths.sum())) /
                                       max(rollout_sec, 1e-9),
        "perf/rollout_sec": rollout_sec,
        "perf/reward_sec": reward_sec,
        "perf/update_sec": update_sec,
    }
    if config.rollout.engine == "vllm":
      host["perf/weight_sync_sec"] = sampler.last_sync_sec
    if mismatch:  # sampler/trainer log-prob mismatch on the sampled tokens
      diff = jnp.abs(rollout.logprobs - upd["old_logp"]) * rollout.mask
      host["rollout/logprob_abs_diff_mean"] = float(diff.sum() / jnp.maximum(rollout.mask.sum(),
                                                                               1))
      host["rollout/logprob_abs_diff_max"] = float(diff.max())
    for name, vals in scored.per_function.items():
      host[f"reward/{name}"] = float(multihost.sum_over_processes(vals.sum())) / (
          config.batch_size * G)
    pending.append((step + 1, host, upd_metrics, rewards, advantages))
    if int(train_state["nonfinite_total"]) > nonfinite_before:
      logging.warning("step %d: non-finite loss or gradients; update skipped (%d in a row)",
                      step + 1, streak)
    if streak >= config.max_consecutive_nonfinite:
      raise NonFiniteError(
          f"{streak} consecutive GRPO updates had a non-finite loss or gradients (last at step "
          f"{step + 1}); stopping. Check rewards (reward/errors), the learning rate, and "
          "param/compute dtypes; lower optimizer.learning_rate or raise "
          "max_consecutive_nonfinite to keep going.")
    host_step_sec = time.time() - t_step
    profiler.step_end(step, block_on=train_state["params"])

    if (step + 1) % config.log_interval_steps == 0 or step + 1 == config.num_steps:
      scalars = _flush_metrics(pending, writer, G, host_step_sec)
      pending = []
      progress.log(step + 1, scalars, ("reward/total", "loss/kl_divergence", "loss/policy_loss",
                                       "completions/mean_length", "perf/step_time_sec"))
    if config.eval_interval_steps and (step + 1) % config.eval_interval_steps == 0 and (
        step + 1 < config.num_steps):
      res = run_eval(train_state["params"], ckpt_base + step + 1, jax.random.fold_in(rng, step))
      meta["history"].append({"step": step + 1, "eval": res})
    if (step + 1) % config.save_interval_steps == 0 or step + 1 == config.num_steps:
      save(ckpt_base + step + 1, state_tree(), train_iter)
    budget_spent = bool(config.max_steps_per_run) and step + 1 < config.num_steps and (
        step + 1 - first_step_this_run >= config.max_steps_per_run)
    if budget_spent and pending:
      _flush_metrics(pending, writer, G, host_step_sec)
      pending = []
    exit_if_preempted(ckpt_base + step + 1, state_tree(), train_iter, budget_spent=budget_spent)

  # ------------------------------------------------------------------------------ finish
  profiler.close()
  eval_after = run_eval(train_state["params"], ckpt_base + config.num_steps,
                        jax.random.fold_in(rng, 3 << 20))
  _log_eval("after GRPO", eval_after)
  ckpt.wait()
  summary = {
      "final_step": meta["grpo_step"],
      "wall_time_sec": round(wall_time(), 2),
      "sft_steps": meta["sft_step"],
      "eval_initial": meta["eval_initial"],
      "eval_before": meta["eval_before"],
      "eval_after": eval_after,
      "eval_history": meta["history"],
  }
  if is_main:
    _write_json(os.path.join(workdir, "summary.json"), summary)
    before = meta["eval_before"].get("greedy", next(iter(meta["eval_before"].values())))
    after = eval_after.get("greedy", next(iter(eval_after.values())))
    logging.info("summary: accuracy %.3f -> %.3f (%s) in %.1fs; %s",
                 before["accuracy"], after["accuracy"],
                 "greedy" if "greedy" in eval_after else next(iter(eval_after)),
                 summary["wall_time_sec"], os.path.join(workdir, "summary.json"))
  ckpt.close()
  writer.close()
  preempt.restore()
  return summary


# ======================================================================== loop helpers


def _eval_batch(config, dp, nproc) -> int:
  """Per-process eval batch: config.eval.batch_size rounded to fill the data-parallel devices."""
  per_proc_devices = max(dp // nproc, 1)
  b = max(config.eval.batch_size // nproc, 1)
  return -(-b // per_proc_devices) * per_proc_devices


def _to_memory_kind(tree, kind):
  try:
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)
  except (ValueError, NotImplementedError) as e:  # backends without host memory spaces
    logging.log_first_n(logging.WARNING, "reference offload to %s unavailable here: %s", 1, kind,
                        e)
    return tree


def _log_eval(what, results):
  for name, r in results.items():
    logging.info("eval %s [%s]: accuracy=%.3f partial=%.3f format=%.3f", what, name,
                 r["accuracy"], r["partial_accuracy"], r["format_accuracy"])


def _flush_metrics(pending, writer, G, step_sec) -> dict:
  """One device_get for all steps since the last log; writes every step's scalars."""
  fetched = jax.device_get([(m, r, a) for _, _, m, r, a in pending])
  last = {}
  for (step, host, _, _, _), (m, r, a) in zip(pending, fetched):
    r_bg = np.asarray(r).reshape(-1, G)
    scalars = dict(host)
    scalars.update({
        "loss/total": m["loss"], "loss/policy_loss": m["pg_loss"],
        "loss/kl_divergence": m["kl"], "loss/clip_fraction": m["clip_frac"],
        "loss/clip_fraction_low": m["clip_frac_low"],
        "loss/clip_fraction_high": m["clip_frac_high"], "loss/ppo_kl": m["ppo_kl"],
        "loss/ratio_mean": m["ratio_mean"], "loss/grad_norm": m["grad_norm"],
        "loss/skipped_updates": m["skipped"],
        "reward/std_within_group": r_bg.std(-1).mean(),
        "reward/zero_std_group_fraction": (r_bg.std(-1) == 0).mean(),
        "advantages/mean": np.mean(a), "advantages/std": np.std(a),
        "perf/step_time_sec": step_sec,
    })
    scalars.update(metrics_lib.device_memory_gib())
    writer.write_scalars(step, scalars)
    last = scalars
  writer.flush()
  return last
