"""One validation pass over the config at start-up: every bad value becomes one clear line.

Each line reads `field=value: why. Fix: what to do`. `validate` returns all lines at once so a
user fixes a config in one round trip; main.py prints them and exits with status 2.

Every set of accepted names is imported from the module that implements it (and read when
`validate` runs), so registering a remat policy, generation config, reader, loss or reward
makes it a valid config value without touching this file.
"""

import os

import jax

from grpo_jax.run import paths
from grpo_jax.parallel import sharding
from grpo_jax.data import arithmetic
from grpo_jax.data import pipeline
from grpo_jax.data import sources
from grpo_jax.data import tables
from grpo_jax.data import templates
from grpo_jax.data import tokenizers
from grpo_jax.models import build as model_build
from grpo_jax.models.decoder import config as model_config
from grpo_jax.models.decoder import decode_attention
from grpo_jax.models.lora import adapters as lora
from grpo_jax.models import remat
from grpo_jax.models.t5 import config as t5_config
from grpo_jax.rewards import computer as reward_computer
from grpo_jax.rewards import judge
from grpo_jax.rewards import registry as reward_registry
from grpo_jax.rl import advantages
from grpo_jax.rl import registry as rl_registry
from grpo_jax.rl import replay as routing_replay
from grpo_jax.rollout import engine as rollout_engine
from grpo_jax.rollout import types as rollout_types
from grpo_jax.rollout import vllm_engine as vllm_sync

# jax.transfer_guard levels that config.debug.transfer_guard may name (passed to jax as is).
TRANSFER_GUARDS = ("allow", "log", "disallow")
PLACEMENTS = ("colocated", "disaggregated")
SLOT_ADMISSIONS = ("auto", "decode", "host")


class _Checker:
  """Collects `field=value: why. Fix: fix` lines."""

  def __init__(self, config):
    self.config = config
    self.errors: list[str] = []

  def value(self, field: str):
    node = self.config
    for part in field.split("."):
      node = node[part]
    return node

  def fail(self, field: str, why: str, fix: str):
    line = f"{field}={self.value(field)!r}: {why}. Fix: {fix}."
    if line not in self.errors:  # e.g. a dtype checked here and by ModelConfig.problems()
      self.errors.append(line)

  def require(self, ok: bool, field: str, why: str, fix: str):
    if not ok:
      self.fail(field, why, fix)

  def one_of(self, field: str, names, what: str):
    v = self.value(field)
    if v not in names:
      self.fail(field, f"unknown {what}", f"use one of {', '.join(map(str, names))}")

  def path_exists_glob(self, field: str):
    p = self.value(field)
    folder = os.path.dirname(p)
    problem = paths.check_scheme(p)
    if problem:
      self.fail(field, *problem)
    elif not paths.isdir(folder):
      self.fail(
          field, f"the folder {folder} of the pattern does not exist", "give an existing folder"
      )

  def path_exists(self, field: str, what: str):
    p = self.value(field)
    if not p:
      return
    problem = paths.check_scheme(p)
    if problem:
      self.fail(field, *problem)
    elif not paths.exists(p):
      self.fail(field, f"{what} does not exist", "give an existing path")


def _check_training(c: _Checker, cfg):
  c.require(cfg.num_steps >= 0, "num_steps", "must be >= 0", "set a step count")
  c.require(cfg.num_epochs >= 0, "num_epochs", "must be >= 0", "0 uses num_steps")
  if cfg.num_epochs > 0 and cfg.num_steps > 0:
    c.fail(
        "num_epochs",
        f"both num_epochs and num_steps={cfg.num_steps} are set; the run "
        "length is one or the other",
        "add --config.num_steps=0 (or set num_epochs=0)",
    )
  c.require(cfg.sft_steps >= 0, "sft_steps", "must be >= 0", "0 disables the warm start")
  c.require(cfg.num_generations >= 1, "num_generations", "must be >= 1", "use G >= 2")
  if cfg.loss.estimator in ("grpo", "dr_grpo", "rloo") and cfg.num_generations < 2:
    c.fail(
        "num_generations",
        f"the '{cfg.loss.estimator}' advantage compares samples within a "
        "group, so every advantage would be 0 with fewer than 2",
        "set num_generations >= 2 (GRPO practice: 4-16)",
    )
  c.require(
      cfg.beta >= 0, "beta", "the KL weight must be >= 0", "use 0 (no reference) or e.g. 0.04"
  )
  c.require(cfg.num_iterations >= 1, "num_iterations", "must be >= 1", "use 1 (on-policy)")
  c.require(cfg.batch_size >= 1, "batch_size", "must be >= 1", "set prompts per step")
  c.require(
      cfg.micro_batch_size >= 0,
      "micro_batch_size",
      "must be >= 0",
      "0 trains on all batch_size * num_generations sequences at once",
  )
  c.require(
      cfg.micro_batch_tokens >= 0,
      "micro_batch_tokens",
      "must be >= 0",
      "0 splits micro-batches by micro_batch_size",
  )
  c.require(cfg.max_prompt_length >= 1, "max_prompt_length", "must be >= 1", "set it")
  c.require(cfg.max_completion_length >= 1, "max_completion_length", "must be >= 1", "set it")
  for f in ("save_interval_steps", "log_interval_steps"):
    c.require(c.value(f) >= 1, f, "must be >= 1", "use a positive interval")
  c.require(
      cfg.eval_interval_steps >= 0,
      "eval_interval_steps",
      "must be >= 0",
      "0 evaluates only before and after training",
  )
  c.require(cfg.max_steps_per_run >= 0, "max_steps_per_run", "must be >= 0", "0 = no limit")
  c.require(
      cfg.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite", "must be >= 1", "e.g. 5"
  )


def _check_model(c: _Checker, cfg):
  m = cfg.model
  c.one_of("model.impl", model_build.IMPLS, "model implementation")
  c.one_of("model.family", model_build.FAMILIES, "model family")
  c.path_exists("model.hf_path", "the Hugging Face checkpoint folder")
  c.path_exists("model.maxtext_checkpoint", "the MaxText checkpoint")
  c.one_of("model.param_dtype", model_config.DTYPES, "dtype")
  c.one_of("model.dtype", model_config.DTYPES, "dtype")
  c.one_of("model.remat_policy", remat.POLICIES, "remat policy")
  c.one_of("model.attention_impl", model_config.ATTENTION_IMPLS, "attention implementation")
  if m.impl == "maxtext":
    from grpo_jax.models.maxtext import adapter as maxtext_adapter  # imports maxtext lazily itself

    c.one_of(
        "model.maxtext.attention", maxtext_adapter.ATTENTION_KERNELS, "MaxText attention kernel"
    )
    c.require(
        not m.maxtext_checkpoint or not m.hf_path,
        "model.maxtext_checkpoint",
        "both model.hf_path and model.maxtext_checkpoint are set",
        "give one source of weights",
    )
    try:
      import maxtext  # noqa: F401
    except ImportError:
      c.fail(
          "model.impl",
          "maxtext is not installed",
          "pip install -e '.[maxtext]' (Python " ">= 3.12), or use --config.model.impl=native",
      )
  if m.family == "t5":
    c.require(
        m.impl == "native",
        "model.impl",
        "model.family='t5' runs on the native T5 " "(models/t5/model.py) only",
        "use --config.model.impl=native",
    )
    c.require(
        cfg.rollout.engine == "native",
        "rollout.engine",
        "model.family='t5': the vLLM " "engine serves decoder-only policies",
        "use --config.rollout.engine=native",
    )
    if not m.hf_path:
      for field, why, fix in t5_config.T5Config.from_model_block(m).problems():
        c.fail(t5_config.config_field(field), why, fix)
    return  # relative positions: no context limit to check
  if not m.hf_path:
    fields = {
        k: v
        for k, v in m.items()
        if k not in ("preset", "impl", "hf_path", "maxtext_checkpoint", "maxtext", "family", "t5")
    }
    shape = model_config.ModelConfig(**fields)
    for field, why, fix in shape.problems():
      c.fail(f"model.{field}", why, fix)
    if m.impl == "maxtext" and not shape.problems():  # hf_path: checked when the folder loads
      from grpo_jax.models.maxtext import mapping as maxtext_mapping  # no maxtext import

      try:
        maxtext_mapping.check_supported(shape)
      except ValueError as e:
        why, _, fix = str(e).removeprefix("model.impl=maxtext: ").partition("; ")
        c.fail("model.arch", f"model.impl=maxtext: {why}", fix or "use --config.model.impl=native")
  total = cfg.max_prompt_length + cfg.max_completion_length
  if total > m.max_position_embeddings:
    c.fail(
        "max_completion_length",
        f"max_prompt_length + max_completion_length = {total} exceeds the model's context "
        f"model.max_position_embeddings = {m.max_position_embeddings}",
        "shorten prompts or completions",
    )


def _check_loss(c: _Checker, cfg):
  c.one_of("loss.estimator", rl_registry.ADVANTAGE_ESTIMATORS.names(), "advantage estimator")
  c.one_of("loss.std_kind", advantages.STD_KINDS, "std kind")
  c.one_of("loss.policy_loss", rl_registry.POLICY_LOSSES.names(), "policy loss")
  c.one_of("loss.kl_kind", rl_registry.KL_ESTIMATORS.names(), "KL estimator")
  c.one_of("loss.loss_agg_mode", rl_registry.LOSS_AGG_MODES.names(), "loss aggregation mode")
  l = cfg.loss
  c.require(
      0 < l.clip_eps < 1, "loss.clip_eps", "the PPO clip range must lie in (0, 1)", "use e.g. 0.2"
  )
  if l.clip_eps_high is not None:
    c.require(
        0 < l.clip_eps_high < 1,
        "loss.clip_eps_high",
        "must lie in (0, 1)",
        "use e.g. 0.28 (DAPO clip-higher) or None",
    )
  if l.clip_ratio_c is not None:
    c.require(
        l.clip_ratio_c > 1,
        "loss.clip_ratio_c",
        "the dual-clip bound must be > 1",
        "use e.g. 3.0 or None",
    )
  if l.kl_clamp is not None:
    c.require(l.kl_clamp > 0, "loss.kl_clamp", "must be > 0", "use e.g. 10.0 or None")
  c.require(l.adv_eps > 0, "loss.adv_eps", "must be > 0", "use e.g. 1e-6")
  c.require(l.tis_cap >= 0, "loss.tis_cap", "must be >= 0", "0 disables TIS; e.g. 2.0")
  _check_correction(c, l)
  c.require(
      0 <= l.overlong_buffer < cfg.max_completion_length,
      "loss.overlong_buffer",
      "must lie in [0, max_completion_length)",
      "0 disables the overlong penalty",
  )
  c.require(l.advantage_clip >= 0, "loss.advantage_clip", "must be >= 0", "0 disables it; e.g. 3.0")
  c.require(
      l.max_resample_rounds >= 0,
      "loss.max_resample_rounds",
      "must be >= 0",
      "0 only masks zero-variance groups; e.g. 4",
  )
  if cfg.kl_in_reward:
    c.require(
        cfg.beta > 0,
        "kl_in_reward",
        "the KL-in-reward coefficient is beta, which is 0",
        "set beta > 0 (e.g. --config.beta=0.001) or kl_in_reward=False",
    )
  r = cfg.reference
  c.require(
      r.refresh_every_steps >= 0,
      "reference.refresh_every_steps",
      "must be >= 0",
      "0 keeps the reference frozen",
  )
  c.require(
      0 < r.refresh_mix <= 1,
      "reference.refresh_mix",
      "must lie in (0, 1]",
      "1.0 copies the policy; e.g. 0.05 for an EMA",
  )
  if r.refresh_every_steps and cfg.beta == 0:
    c.fail(
        "reference.refresh_every_steps",
        "beta=0 builds no reference to refresh",
        "set beta > 0 or refresh_every_steps=0",
    )


def _check_correction(c: _Checker, l):
  """loss.offpolicy_correction and the fields it reads (rl/corrections.py)."""
  c.one_of(
      "loss.offpolicy_correction",
      rl_registry.OFFPOLICY_CORRECTIONS.names(),
      "off-policy correction",
  )
  kind = l.offpolicy_correction
  if kind == "sequence_is" and l.tis_cap == 0:
    c.fail(
        "loss.tis_cap",
        "offpolicy_correction='sequence_is' truncates each sequence's weight at tis_cap, and 0 "
        "would zero every weight",
        "set a cap, e.g. --config.loss.tis_cap=5.0 (verl suggests 2-10 for sequences)",
    )
  if kind in ("icepop", "geometric_mask"):
    band = "the band [correction_low, correction_high] must hold ratio 1 (tokens on-policy)"
    c.require(
        0 <= l.correction_low <= 1,
        "loss.correction_low",
        f"must lie in [0, 1]: {band}",
        "use e.g. 0.5 (icepop) or 0.999 (geometric_mask)",
    )
    c.require(
        l.correction_high >= 1,
        "loss.correction_high",
        f"must be >= 1: {band}",
        "use e.g. 5.0 (icepop) or 1.001 (geometric_mask)",
    )


def _check_optimizer(c: _Checker, cfg):
  o = cfg.optimizer
  c.require(o.learning_rate > 0, "optimizer.learning_rate", "must be > 0", "use e.g. 3e-6")
  c.require(0 <= o.warmup_ratio < 1, "optimizer.warmup_ratio", "must lie in [0, 1)", "use 0.1")
  c.require(0 <= o.end_lr_ratio <= 1, "optimizer.end_lr_ratio", "must lie in [0, 1]", "use 0")
  c.require(0 <= o.b1 < 1, "optimizer.b1", "must lie in [0, 1)", "use 0.9")
  c.require(0 <= o.b2 < 1, "optimizer.b2", "must lie in [0, 1)", "use 0.99")
  c.require(o.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0", "use 0.1")
  c.require(o.max_grad_norm >= 0, "optimizer.max_grad_norm", "must be >= 0", "0 disables it")
  c.require(cfg.sft.learning_rate > 0, "sft.learning_rate", "must be > 0", "use e.g. 1e-4")
  c.require(cfg.sft.batch_size >= 1, "sft.batch_size", "must be >= 1", "use e.g. 32")


def _check_rollout(c: _Checker, cfg):
  r, m = cfg.rollout, cfg.model
  c.one_of("rollout.engine", rollout_engine.ENGINES, "rollout engine")
  c.require(
      r.temperature > 0,
      "rollout.temperature",
      "must be > 0",
      "use e.g. 0.9 (greedy evaluation has its own generation config)",
  )
  c.require(r.top_k >= 0, "rollout.top_k", "must be >= 0", "0 disables top-k")
  c.require(
      r.decode_phases >= 0,
      "rollout.decode_phases",
      "must be >= 0",
      "0 = auto (rollout/sampler.py phase_ends)",
  )
  c.require(
      r.decode_block >= 0,
      "rollout.decode_block",
      "must be >= 0",
      "0 = auto (rollout/sampler.py block_size)",
  )
  c.one_of("rollout.decode_attention", decode_attention.IMPLS, "decode attention")
  c.require(0 < r.top_p <= 1, "rollout.top_p", "must lie in (0, 1]", "1.0 disables top-p")
  c.one_of("rollout.placement", PLACEMENTS, "sampler placement")
  if r.placement == "disaggregated":
    c.require(
        r.engine == "native",
        "rollout.placement",
        "disaggregated places the native " "sampler; vLLM has its own devices",
        "rollout.vllm.num_devices for vLLM on TPU, " "or --config.rollout.placement=colocated",
    )
    c.require(
        not cfg.reward.judge.path,
        "rollout.placement",
        "disaggregated: the reward judge "
        "(reward.judge.path) runs on the trainer's mesh and is not supported yet",
        "--config.rollout.placement=colocated",
    )
  c.require(r.slots >= 0, "rollout.slots", "must be >= 0", "0 = the lockstep sampler; e.g. 64")
  c.require(r.slot_chunk >= 1, "rollout.slot_chunk", "must be >= 1", "e.g. 64")
  c.one_of("rollout.slot_admission", SLOT_ADMISSIONS, "slot admission")
  c.require(
      r.slot_compile_threads >= 0,
      "rollout.slot_compile_threads",
      "must be >= 0",
      "0 = one per core, 1 = one after the other",
  )
  if r.slots:
    c.require(
        r.engine == "native" and m.impl == "native" and m.family == "decoder",
        "rollout.slots",
        f"the slot engine runs the native decoder (engine={r.engine!r}, "
        f"model.impl={m.impl!r}, model.family={m.family!r})",
        "--config.rollout.slots=0 (the lockstep sampler)",
    )
    c.require(
        r.slots >= cfg.num_generations,
        "rollout.slots",
        f"{r.slots} slots hold less than one group of num_generations={cfg.num_generations}",
        f"--config.rollout.slots={cfg.batch_size * cfg.num_generations} (one step's rows)",
    )
  c.require(
      r.max_staleness >= 0,
      "rollout.max_staleness",
      "must be >= 0",
      "0 = on-policy; 1 = the next step's rollout overlaps this step's update",
  )
  c.require(
      not r.partial_rollout or (r.slots > 0 and r.max_staleness > 0),
      "rollout.partial_rollout",
      f"True carries groups still running into a later step, which needs streaming (slots > 0 "
      f"and max_staleness >= 1; here slots={r.slots}, max_staleness={r.max_staleness})",
      f"--config.rollout.slots={cfg.batch_size * cfg.num_generations} "
      "--config.rollout.max_staleness=1, or --config.rollout.partial_rollout=False",
  )
  if r.tools.names.strip():
    _validate_tools(c, cfg)
  _check_routing_replay(c, cfg)
  _check_moe_paths(c, cfg)
  if r.slots and r.max_staleness:  # streaming (rollout/source.py, rollout/streaming.py)
    c.require(
        not (cfg.loss.dynamic_sampling and cfg.loss.max_resample_rounds > 0),
        "loss.dynamic_sampling",
        "extra rounds are not built for streaming rollouts (rollout.slots > 0 with "
        "rollout.max_staleness > 0)",
        "--config.loss.dynamic_sampling=False, or --config.rollout.slots=0",
    )
  if r.slots:
    c.require(
        cfg.debug.transfer_guard != "disallow",
        "debug.transfer_guard",
        "'disallow' stops the slot engine, whose scheduler reads the slots' status on the "
        "host between decode chunks",
        "--config.debug.transfer_guard=log, or --config.rollout.slots=0",
    )
  c.require(
      0 <= r.num_devices,
      "rollout.num_devices",
      "must be >= 0",
      "a device count, a fraction in (0, 1) of all devices, or 0 = half",
  )
  c.require(
      r.max_logprob_gap >= 0,
      "rollout.max_logprob_gap",
      "must be >= 0",
      "0 disables the stop; e.g. 0.05",
  )
  c.require(
      r.vllm.sync_tolerance >= 0,
      "rollout.vllm.sync_tolerance",
      "must be >= 0",
      "0 = automatic by model.dtype (1e-3 for float32)",
  )
  c.require(
      r.vllm.sync_timeout_sec >= 0,
      "rollout.vllm.sync_timeout_sec",
      "must be >= 0",
      "0 = no limit; e.g. 600",
  )
  c.require(
      r.vllm.num_devices >= 0,
      "rollout.vllm.num_devices",
      "must be >= 0",
      "0 = vLLM shares the trainer's chips; N = vLLM's own chips on each host",
  )
  c.one_of("rollout.vllm.lora_sync", vllm_sync.LORA_SYNCS, "LoRA weight sync")
  known = rollout_types.GENERATION_CONFIGS
  for name in cfg.eval.generation_configs:
    if name not in known:
      c.fail(
          "eval.generation_configs",
          f"unknown generation config '{name}'",
          f"use names from {', '.join(known)}",
      )
  c.require(cfg.eval.num_examples >= 0, "eval.num_examples", "must be >= 0", "0 = all")
  c.require(cfg.eval.batch_size >= 1, "eval.batch_size", "must be >= 1", "e.g. 64")
  c.require(
      cfg.eval.num_samples >= 1,
      "eval.num_samples",
      "must be >= 1",
      "1 = one completion per prompt; n > 1 adds pass@k for the sampling configs",
  )
  bad_k = [k for k in cfg.eval.pass_k if not 1 <= k <= max(cfg.eval.num_samples, 1)]
  c.require(
      not bad_k,
      "eval.pass_k",
      f"pass@k needs 1 <= k <= eval.num_samples=" f"{cfg.eval.num_samples} (got {bad_k})",
      "raise eval.num_samples or drop those k; () picks 1, 2, 4, ... num_samples",
  )
  c.require(
      cfg.eval.max_new_tokens >= 0,
      "eval.max_new_tokens",
      "must be >= 0",
      "0 = max_completion_length",
  )


def _check_data_and_rewards(c: _Checker, cfg):
  d = cfg.data
  c.require(
      d.heldout_rows >= 0,
      "data.heldout_rows",
      "must be >= 0",
      "0 = the eval split comes from data.eval_source",
  )
  for split in ("train", "eval") if not d.heldout_rows else ("train",):
    c.one_of(f"data.{split}_source", sources.SOURCES, "data source")
    if d[f"{split}_source"] in sources.TABLE_SOURCES and any(
        ch in os.path.basename(d[f"{split}_path"]) for ch in "*?["
    ):
      c.path_exists_glob(f"data.{split}_path")
    else:
      c.path_exists(f"data.{split}_path", "the data file")
    if d[f"{split}_source"] in sources.FILE_SOURCES and not d[f"{split}_path"]:
      c.fail(
          f"data.{split}_path",
          f"data.{split}_source={d[f'{split}_source']!r} reads a file",
          f"set --config.data.{split}_path="
          + {
              "parquet": "/path/to/train.parquet (a file, folder or glob)",
              "hf_dataset": "/path/to/saved_dataset (or its data files)",
          }.get(d[f"{split}_source"], "/path/to/file.jsonl"),
      )
  for field, name in d.columns.items():
    c.require(
        field in tables.FIELDS,
        f"data.columns.{field}",
        "unknown field",
        f"the fields are {', '.join(tables.FIELDS)}",
    )
    c.require(
        isinstance(name, str) and (bool(name) or field in ("ground_truth", "demonstration")),
        f"data.columns.{field}",
        "must name a column",
        'e.g. "prompt"',
    )
  c.one_of("data.template", templates.TEMPLATES, "prompt template")
  c.one_of("data.overlong_prompts", pipeline.OVERLONG_PROMPTS, "overlong-prompt policy")
  c.one_of("data.prompt_width", pipeline.PROMPT_WIDTHS, "prompt width")
  c.one_of("data.system_prompt", templates.SYSTEM_PROMPTS, "system prompt")
  c.one_of("data.arithmetic.demonstration", arithmetic.DEMONSTRATION_STYLES, "demonstration style")
  c.one_of("tokenizer.kind", tokenizers.KINDS, "tokenizer kind")
  if cfg.tokenizer.kind == "hf" and not (cfg.tokenizer.path or cfg.model.hf_path):
    c.fail(
        "tokenizer.path",
        "the hf tokenizer needs a folder (tokenizer.json or vocab.json + " "merges.txt)",
        "set --config.tokenizer.path or --config.model.hf_path",
    )
  c.path_exists("tokenizer.path", "the tokenizer folder")
  if d.template == "tokenizer":  # the folder's chat template must exist (checked up front)
    folder = cfg.tokenizer.path or cfg.model.hf_path
    if cfg.tokenizer.kind != "hf":
      c.fail("data.template", *templates.missing_template(""))
    elif folder and paths.exists(folder) and tokenizers.folder_chat_template(folder) is None:
      c.fail("data.template", *templates.missing_template(folder))

  rw = cfg.reward
  known = reward_registry.names()
  for name in rw.functions:
    if name not in known:
      c.fail(
          "reward.functions",
          f"unknown reward function '{name}'",
          f"use names from {', '.join(known)}, or a file via reward.custom_file",
      )
  if len(rw.weights) != len(rw.functions):
    c.fail(
        "reward.weights",
        f"has {len(rw.weights)} weights for {len(rw.functions)} functions",
        "give one weight per name in reward.functions",
    )
  if not rw.functions and not rw.custom_file:
    c.fail("reward.functions", "no reward at all", "name functions or set reward.custom_file")
  c.path_exists("reward.custom_file", "the reward file")
  if rw.custom_function and not rw.custom_file:
    c.fail(
        "reward.custom_function",
        "names a function of reward.custom_file, which is unset",
        "set --config.reward.custom_file=/path/to/rewards.py",
    )
  c.one_of("reward.on_error", reward_computer.ON_ERROR, "reward error policy")
  c.require(rw.num_workers >= 0, "reward.num_workers", "must be >= 0", "0 scores in-process")
  c.require(rw.timeout_sec >= 0, "reward.timeout_sec", "must be >= 0", "0 = no timeout")


def _num_heads(cfg) -> int | None:
  """The policy's attention heads: config.model, or the HF config.json under model.hf_path."""
  if not cfg.model.hf_path:
    return cfg.model.num_heads
  try:
    import json

    return int(
        json.loads(paths.read_text(paths.path(cfg.model.hf_path) / "config.json"))[
            "num_attention_heads"
        ]
    )
  except (OSError, KeyError, TypeError, ValueError):
    return None  # a missing folder is reported by _check_model


def _check_mesh(c: _Checker, cfg, num_devices: int, num_processes: int):
  sizes = (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  for name, size in zip(("mesh.data", "mesh.fsdp", "mesh.tensor"), sizes):
    c.require(size == -1 or size >= 1, name, "must be -1 (fill) or >= 1", "use -1 or a size")
  dcn = cfg.mesh.dcn_data
  count, unit = sharding.num_granules(num_processes) if dcn != 1 else (1, "slice")
  bad = sharding.dcn_problem(dcn, None, count, unit)
  if bad:
    c.fail("mesh.dcn_data", *bad)
  if any(s != -1 and s < 1 for s in sizes) or bad or not _expert_ok(c, cfg, num_devices):
    return
  expert = cfg.mesh.expert
  num_devices //= expert  # data * fsdp * tensor span what the expert axis leaves
  try:
    ici = sharding.resolve_ici_shape(sizes, num_devices, dcn)
  except ValueError as e:
    if dcn == 1:
      fix = (
          f"make data * fsdp * tensor equal the {num_devices} available devices, with at "
          "most one axis -1 (filled to fit)"
      )
    else:
      fix = (
          f"make data * fsdp * tensor equal the {num_devices // dcn} devices per DCN slice "
          f"({num_devices} devices / mesh.dcn_data={dcn}), with at most one axis -1 (filled "
          "to fit)"
      )
    c.fail("mesh.data", str(e), fix)
    return
  if dcn > 1:
    bad = sharding.dcn_problem(dcn, ici[0], count, unit)
    if bad:
      c.fail("mesh.dcn_data", *bad)
      return
  shape = (dcn * ici[0], *ici[1:], expert)
  dp = sharding.data_parallel_size(shape)
  dp_name = "data * fsdp" if dcn == 1 else f"data * fsdp (data includes mesh.dcn_data={dcn})"
  if expert > 1:
    dp_name = dp_name.replace("data * fsdp", "data * fsdp * expert", 1)
  if cfg.batch_size % dp:  # the prompts of a step (and so their G samples) shard over it
    c.fail(
        "batch_size",
        f"the prompts of a step do not divide over the data-parallel mesh "
        f"size {dp_name} = {dp}",
        f"use a multiple of {dp}",
    )
  if cfg.sft_steps > 0 and cfg.sft.batch_size % dp:
    c.fail(
        "sft.batch_size",
        f"does not divide over the data-parallel mesh size {dp_name} = " f"{dp}",
        f"use a multiple of {dp}",
    )
  if cfg.batch_size % num_processes:
    c.fail(
        "batch_size",
        f"must divide over the {num_processes} JAX processes (each loads its " "own prompts)",
        f"use a multiple of {num_processes}",
    )
  if cfg.rollout.slots and cfg.rollout.placement == "colocated" and cfg.rollout.slots % dp:
    c.fail(
        "rollout.slots",
        f"the decode slots do not divide over the data-parallel mesh size {dp_name} = {dp}",
        f"use a multiple of {dp}, e.g. {-(-cfg.rollout.slots // dp) * dp}",
    )
  _check_micro_batch(c, cfg, dp)
  heads, tensor = _num_heads(cfg), ici[2]
  if heads and heads % tensor:
    c.fail(
        "mesh.tensor",
        f"does not divide the model's {heads} attention heads, so attention "
        "cannot shard over tensor",
        f"use a divisor of {heads}",
    )


def _expert_ok(c: _Checker, cfg, num_devices: int) -> bool:
  """mesh.expert: a divisor of the devices and of the model's experts; single-slice, native.
  False when the rest of the mesh cannot be sized."""
  expert, m = cfg.mesh.expert, cfg.model
  if not isinstance(expert, int) or expert < 1 or num_devices % expert:
    c.fail(
        "mesh.expert",
        f"must be an integer >= 1 dividing the {num_devices} devices",
        "use 1 (no expert parallelism) or a divisor of the devices",
    )
    return False
  if expert == 1:
    return True
  ok = True
  if cfg.mesh.dcn_data != 1:
    c.fail("mesh.expert", "with mesh.dcn_data > 1: not supported yet", "use 1 on multi-slice")
    ok = False
  if m.impl != "native" or m.family != "decoder":
    c.fail("mesh.expert", "expert parallelism is the native decoder's", "use 1")
    ok = False
  experts = m.num_experts if not m.hf_path else _hf_num_experts(m.hf_path)
  if experts == 0:
    c.fail("mesh.expert", "the model is dense: no experts to split", "use 1 (or mesh.data)")
  elif experts is not None and experts % expert:
    c.fail(
        "mesh.expert",
        f"does not divide the model's {experts} experts per layer",
        f"use a divisor of {experts}",
    )
  return ok


def _hf_num_experts(path: str) -> int | None:
  """The experts per layer of an HF folder's config.json (0: dense; transformers 5 writes
  num_local_experts); None when it cannot be read (a missing folder: _check_model says so)."""
  try:
    import json

    hf = json.loads(paths.read_text(paths.path(path) / "config.json"))
    return int(hf.get("num_experts", hf.get("num_local_experts")) or 0)
  except (OSError, KeyError, TypeError, ValueError):
    return None


def _check_micro_batch(c: _Checker, cfg, dp: int):
  """micro_batch_size >= the step's B * G rows means all rows at once (so a smaller batch needs
  no second flag); below that it must split the rows evenly, in whole data-parallel shares. Not
  checked while batch_size or num_generations is itself wrong: that line names the fix."""
  if any(e.startswith(("batch_size=", "num_generations=")) for e in c.errors):
    return
  if cfg.micro_batch_tokens > 0:
    _check_micro_batch_tokens(c, cfg, dp)
    return
  seqs, mb = cfg.batch_size * cfg.num_generations, cfg.micro_batch_size
  if not 0 < mb < seqs:
    return
  if seqs % mb:
    c.fail(
        "micro_batch_size",
        f"must divide batch_size * num_generations = {seqs}",
        f"use a divisor of {seqs} (or 0 for all rows at once)",
    )
  elif mb % dp:
    c.fail(
        "micro_batch_size",
        f"not divisible by the data-parallel mesh size {dp}",
        f"use a multiple of {dp}",
    )


def _check_micro_batch_tokens(c: _Checker, cfg, dp: int):
  """micro_batch_tokens (rl/packing.py: MicroBatching): rows of S = prompt width + C slots, at
  least one row per data-parallel device at the widest S; not beside micro_batch_size."""
  if cfg.micro_batch_size > 0:
    c.fail(
        "micro_batch_tokens",
        f"micro-batches are by tokens or by rows, and micro_batch_size={cfg.micro_batch_size} "
        "is set too",
        "set one of them to 0",
    )
  width = cfg.max_prompt_length + cfg.max_completion_length
  if cfg.micro_batch_tokens < dp * width:
    c.fail(
        "micro_batch_tokens",
        f"gives each of the {dp} data-parallel devices {cfg.micro_batch_tokens // dp} token "
        f"slots, less than one row of max_prompt_length + max_completion_length = {width}",
        f"use at least {dp * width} (or 0 for micro-batches by micro_batch_size)",
    )


def _check_routing_replay(c: _Checker, cfg):
  """rollout.routing_replay (rl/replay.py): "rollout" where its routes are recorded and replayed
  so far: an MoE native decoder (full fine-tuning or LoRA), the lockstep sampler; padded or
  packed rows (rl/packing.py gathers the routes with their tokens)."""
  r, m = cfg.rollout, cfg.model
  c.one_of("rollout.routing_replay", routing_replay.MODES, "routing replay mode")
  if r.routing_replay != "rollout":
    return
  field = "rollout.routing_replay"
  if m.impl != "native" or m.family != "decoder" or r.engine != "native":
    c.fail(
        field,
        "routes are recorded by the native sampler and replayed by the native decoder "
        f"(model.impl={m.impl!r}, model.family={m.family!r}, rollout.engine={r.engine!r})",
        "model.impl=native, model.family=decoder, rollout.engine=native; or routing_replay=none",
    )
    return
  experts = m.num_experts if not m.hf_path else _hf_num_experts(m.hf_path)
  if experts == 0:
    c.fail(field, "the model is dense: no routes to replay", "routing_replay=none")
  if r.slots:
    c.fail(
        field,
        "routing replay records routes in the lockstep sampler",
        "set rollout.slots=0",
    )


def _check_moe_paths(c: _Checker, cfg):
  """An MoE model (model.num_experts > 0, or an HF folder's) where only the native decoder and
  sampler have its layers so far: no vLLM / tpu-inference weight sync, no MaxText policy. (LoRA
  works: per-expert adapters, models/lora/adapters.py.)"""
  m = cfg.model
  if m.family != "decoder":
    return
  experts = m.num_experts if not m.hf_path else _hf_num_experts(m.hf_path)
  if not experts:
    return
  moe = f"an MoE model ({experts} experts per layer)"
  if cfg.rollout.engine == "vllm":
    c.fail(
        "rollout.engine",
        f"the vLLM / tpu-inference weight sync has no mapping for {moe}",
        "rollout.engine=native",
    )
  if m.impl == "maxtext":
    c.fail(
        "model.impl", f"the MaxText policy's mapping for {moe} is not built", "model.impl=native"
    )


def _check_packing(c: _Checker, cfg, num_processes: int):
  """pack_sequences (rl/packing.py, on by default): decoder-only policies, native (LoRA and
  MoE included) or MaxText (its attention takes the segment ids, as its pre-training packs), on
  any number of processes (T5 trains on padded rows: rl/packing.py `packs`); on GPU, the native
  fused kernel's limits."""
  del num_processes  # every process makes the same plan and packs its own shards
  if not cfg.pack_sequences:
    return
  if cfg.model.impl == "native" and cfg.model.family == "decoder":  # (T5: padded rows, logged)
    platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else jax.default_backend()
    # GPU's segment kernel (attention.triton_attention) has no window or soft-cap: such
    # layers run the masked attention, [S, S] scores the padded rows' cuDNN kernel avoids.
    # attention_impl=auto takes that (the best there is); fused (the kernel asked for) is refused.
    unbuilt = [
        what
        for what, on in (
            ("sliding windows", cfg.model.sliding_window > 0),
            ("soft-capped scores", cfg.model.attn_logit_softcap > 0),
        )
        if on
    ]
    if cfg.model.attention_impl == "fused" and platform == "gpu" and unbuilt:
      c.fail(
          "model.attention_impl",
          f"pack_sequences on gpu: the fused segment kernel (Pallas Triton) has no "
          f"{' or '.join(unbuilt)}",
          "--config.model.attention_impl=xla (or --config.pack_sequences=False)",
      )


def _validate_tools(c: _Checker, cfg):
  """rollout.tools (rollout/turns.py): the slot engine or vLLM, a known format, sane bounds, and the
  tools themselves loaded (one line naming the file, the tool and the fix)."""
  from grpo_jax.rollout.tools import formats as tool_formats
  from grpo_jax.rollout.tools import loader as tool_loader

  r = cfg.rollout
  c.require(
      r.engine == "vllm" or r.slots > 0,
      "rollout.tools.names",
      "tools need the slot engine (a row pauses in its slot while its tool runs) or vLLM",
      f"--config.rollout.slots={cfg.batch_size * cfg.num_generations} (one step's rows), "
      "or --config.rollout.engine=vllm",
  )
  c.one_of("rollout.tools.format", tuple(tool_formats.FORMATS), "tool format")
  c.require(
      r.slot_admission != "decode",
      "rollout.slot_admission",
      "'decode' admits into free slots inside the decode, but a row paused on a tool call "
      "keeps its slot, which only the host knows",
      "--config.rollout.slot_admission=auto (host admission with tools)",
  )
  c.require(r.max_turns >= 1, "rollout.max_turns", "must be >= 1", "e.g. 4 (model turns)")
  c.require(
      0 < r.max_tool_response_tokens < cfg.max_completion_length,
      "rollout.max_tool_response_tokens",
      f"must be in [1, max_completion_length={cfg.max_completion_length})",
      "e.g. 256",
  )
  c.require(r.tools.timeout_sec > 0, "rollout.tools.timeout_sec", "must be > 0", "e.g. 10")
  c.require(r.tools.workers >= 1, "rollout.tools.workers", "must be >= 1", "e.g. 8")
  c.path_exists("rollout.tools.file", "the tools file")
  if r.tools.file and not paths.exists(r.tools.file):
    return
  try:
    tool_loader.load_tools(r.tools.file, r.tools.names)
  except ValueError as e:  # ToolConfigError: the file, the tool and the fix, in one line
    c.fail("rollout.tools.names", str(e), "see above")


def _check_debug(c: _Checker, cfg):
  c.one_of("debug.transfer_guard", TRANSFER_GUARDS, "transfer guard level")


def split_comma_lists(config, prefix: str = "") -> list[str]:
  """Tuple fields given as `--config.reward.functions=answer_match,answer_format`: ml_collections
  reads a bare list of names as ONE string, ('answer_match,answer_format',) (numbers it splits
  itself); no name of a function, generation config or key holds a comma, so such an element is
  split here, in place. -> the fields changed. ('a','b') and "a" keep working as before."""
  changed = []
  for key, value in config.items():
    field = prefix + key
    if hasattr(value, "items"):
      changed += split_comma_lists(value, field + ".")
    elif isinstance(value, tuple) and any(isinstance(v, str) and "," in v for v in value):
      parts = []
      for v in value:
        parts += [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else [v]
      config[key] = tuple(parts)
      changed.append(field)
  return changed


def validate(
    config, *, num_devices: int | None = None, num_processes: int | None = None
) -> list[str]:
  """Returns one message per bad value (empty when the config is good)."""
  c = _Checker(config)
  _check_training(c, config)
  _check_model(c, config)
  _check_loss(c, config)
  _check_optimizer(c, config)
  _check_rollout(c, config)
  _check_data_and_rewards(c, config)
  _check_debug(c, config)
  _check_packing(c, config, num_processes or jax.process_count())
  num_devices = num_devices or jax.device_count()
  vllm_own = config.rollout.vllm.num_devices if config.rollout.engine == "vllm" else 0
  if vllm_own > 0:  # the trainer's mesh leaves each host's last N chips to vLLM
    num_devices -= vllm_own * (num_processes or jax.process_count())
    c.require(
        num_devices >= 1,
        "rollout.vllm.num_devices",
        f"leaves the trainer no device of {num_devices + vllm_own} per host",
        "use fewer chips for vLLM, or 0 to share them",
    )
  if config.rollout.placement == "disaggregated":
    n = model_build.sampler_count(config.rollout.num_devices, num_devices)
    even = num_devices >= 2 and n == num_devices - n
    c.require(
        even,
        "rollout.num_devices",
        f"gives the sampler {n} of {num_devices} devices; each sampler device pairs with "
        "a trainer device (grpo_jax/parallel/transfer.py), so the split must be even",
        f"--config.rollout.num_devices={num_devices // 2} (or 0 = half)"
        if num_devices >= 2
        else "--config.rollout.placement=colocated (one device)",
    )
    num_devices = num_devices - n if even else 0  # the trainer's mesh (none: no mesh checks)
  if num_devices >= 1:
    _check_mesh(c, config, num_devices, num_processes or jax.process_count())
  return (
      c.errors
      + lora.problems(config)
      + judge.validate(config, num_processes=num_processes or jax.process_count())
  )


# bf16 keeps 8 significant bits: a weight w moves only when its update exceeds half an ulp,
# about |w| * 2^-9. AdamW's step is ~lr per weight, so at lr 3e-6 only weights below ~1.5e-3
# ever change (tests/models/test_master_weights.py shows it; the figure: benchmarks/README.md,
# "Figures behind design choices"). Below this learning rate
# most weights of typical magnitude (~0.02) stay frozen in bf16 storage.
BF16_MIN_LEARNING_RATE = 1e-4


def warnings(config) -> list[str]:
  """Settings that run but probably do not do what the user wants: one line each, with the fix."""
  out = []
  m = config.model
  for field, lr, steps in (
      ("optimizer.learning_rate", config.optimizer.learning_rate, config.num_steps),
      ("sft.learning_rate", config.sft.learning_rate, config.sft_steps),
  ):
    if m.param_dtype == "bfloat16" and steps and 0 < lr < BF16_MIN_LEARNING_RATE:
      out.append(
          f"{field}={lr:g} with model.param_dtype='bfloat16': an AdamW step of ~{lr:g} is below "
          f"half a bf16 ulp for every weight above ~{lr * 2**9:.1e} in magnitude, so most "
          "weights would never change. Fix: --config.model.param_dtype=float32 (f32 master "
          "weights and optimizer state; model.dtype=bfloat16 keeps bf16 compute)"
      )
  return out
