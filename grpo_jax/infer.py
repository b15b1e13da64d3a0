r"""Sample from a trained policy: the latest checkpoint in a workdir, or model.hf_path.

    python -m grpo_jax.infer --workdir=runs/demo "12+30="       # the run's own config.json
    python -m grpo_jax.infer --workdir=runs/demo                # held-out rows
    python -m grpo_jax.infer --workdir=runs/demo --export_hf=/tmp/hf
    python -m grpo_jax.infer --config=configs/qwen3_8b.py --config.model.hf_path=/ckpt/Qwen3-8B \
        --generation=standard --num_samples=4 "What is 12 + 30?"

The config: a run's WORKDIR/config.json (written by the training run) when there is one, so no
training override is repeated; `--config.a.b=v` on the command line wins over it. A
`--config=FILE` with such a workdir is the base, but the run's values still win for every field
not overridden on the command line. Without a workdir (or a config.json), `--config` is needed.
Settings that fix the checkpoint's shapes (model.*, lora.*) must match the run's: a mismatch is
one line naming the fields.

Prompts are rendered with the config's template and system prompt, exactly as in training.
Pass prompts as arguments, or `-` to read one prompt per line from stdin. With no prompts, a
few held-out rows of the config's eval split (`--num_examples`) are sampled and shown with
their ground truth, the config's reward (per function) and the eval task's verdict (e.g.
correct / ROUGE). `--export_hf` writes the policy as a Hugging Face folder (config.json +
model.safetensors; `policy.save_hf`: a T5ForConditionalGeneration folder for model.family=t5)
and the run's tokenizer (`tokenizers.save_hf_folder`: `AutoTokenizer.from_pretrained` encodes
as the run did) instead of sampling; `--export_peft` writes LoRA adapters and the tokenizer.

The console gets the answers and at most a few lines of our own; library INFO lines and, on an
error, the traceback show with `--verbose` (an error is otherwise one line: what, and the fix).
"""

import json
import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from grpo_jax.run import saved_config

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "The run's config: a configs/*.py file, or a run's config.json. Default: WORKDIR/config.json. "
    "With a --workdir holding config.json, the run's values win over this file's; --config.a.b=v "
    "overrides win over both.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Run directory whose latest checkpoint (and config.json) to use. "
    "Without it: model.hf_path (or a random init, with a warning).",
)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_GENERATION = flags.DEFINE_string("generation", "greedy", "greedy | standard | liberal")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Completions per prompt.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 0, "0: config.max_completion_length.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_NUM_EXAMPLES = flags.DEFINE_integer(
    "num_examples", 4, "Held-out rows to show when no prompts " "are given."
)
_EXPORT_HF = flags.DEFINE_string(
    "export_hf",
    None,
    "Write the policy as an HF folder and exit " "(LoRA: the adapters merged into the base).",
)
_EXPORT_PEFT = flags.DEFINE_string(
    "export_peft",
    None,
    "LoRA runs: write the adapters in PEFT's "
    "format (adapter_model.safetensors + adapter_config.json) and the tokenizer.",
)
_VERBOSE = flags.DEFINE_bool(
    "verbose",
    False,
    "Show the libraries' log lines (Orbax, JAX), and on an error the traceback (default: one "
    "line saying what went wrong and the fix).",
)

# ============================================================================ the config


class _ConfigParser(flags.ArgumentParser):
  """--config=FILE.py[:ARG] as ml_collections reads it, or a run's config.json (`saved_config.load`);
  `--config.a.b=v` overrides apply to either."""

  def __init__(self, file_parser):
    self._file_parser = file_parser

  def parse(self, argument):
    if argument.split(":", 1)[0].endswith(".json"):
      return saved_config.load(argument)
    return self._file_parser.parse(argument)

  def flag_type(self):
    return self._file_parser.flag_type()


flags.FLAGS["config"].parser = _ConfigParser(flags.FLAGS["config"].parser)


# ============================================================================ the policy


def load_params(config, workdir, step, mesh):
  """(policy, step or None): the policy with parameters from a checkpoint when there is one.
  A checkpoint whose policy has other shapes than `config`'s: a one-line ValueError."""
  from grpo_jax.run import checkpoint as ckpt_lib
  from grpo_jax.models import build

  from grpo_jax.run import paths

  ckpt_dir = paths.path(workdir) / "checkpoints" if workdir else None
  have = ckpt_dir is not None and ckpt_dir.is_dir()
  ckpt = ckpt_lib.Checkpointer(ckpt_dir, max_to_keep=None, async_save=False) if have else None
  step = step if step is not None else (ckpt.latest_step() if ckpt else None)
  if workdir and step is None:
    fix = (
        "drop --workdir to sample from model.hf_path"
        if config.model.hf_path
        else f"train there first (python -m grpo_jax.main --config=... --workdir={workdir}), or "
        "point --workdir at a run's folder (the demo's: runs/tiny-<date>-<time>)"
    )
    raise FileNotFoundError(f"no checkpoint under {ckpt_dir}. Fix: {fix}")
  if step is not None:
    if step not in ckpt.all_steps():
      raise FileNotFoundError(f"--step={step}: not in {ckpt_dir} (have {ckpt.all_steps()})")
    check_shapes(ckpt, step, config, workdir)
  policy = build.make_policy(config, mesh, abstract=step is not None)
  if step is not None:
    try:
      if config.lora.rank:  # the adapters, and the base the checkpoint names
        from grpo_jax.models.lora import policy as lora_policy

        policy.params = lora_policy.restore_params(config, ckpt, step, policy, mesh)
      else:
        policy.params = ckpt.restore_params(step, policy.params)
    except Exception as e:  # shapes the recorded fields do not cover (or an older checkpoint)
      why = " ".join(str(e).split())[:300] or type(e).__name__
      raise ValueError(
          f"checkpoint {ckpt_dir}/{step} does not restore into this config's policy ({why}). "
          f"Fix: sample with the run's own config: --workdir={workdir} alone reads its "
          f"{saved_config.FILE}; drop --config.model.* / --config.lora.* overrides"
      ) from e
    logging.info("restored the policy from %s/%d", ckpt_dir, step)
  elif not config.model.hf_path:
    logging.warning("no --workdir and no model.hf_path: sampling from a RANDOM-INIT model")
  return policy, step


def check_shapes(ckpt, step: int, config, workdir: str):
  """A one-line ValueError when `config` differs from the run that wrote checkpoint `step` in a
  field its policy's arrays depend on (the model.* and lora.* fields a checkpoint records:
  run/session.py's resume_fields), naming the fields and the run's values."""
  from grpo_jax.run import session as session_lib

  try:
    saved = ckpt.restore_meta(step).get("config") or {}
  except Exception:  # no readable meta: the restore itself says what is wrong
    return
  now = session_lib.resume_fields(config)
  changed = [
      k for k in now if k.startswith(("model.", "lora.")) and k in saved and saved[k] != now[k]
  ]
  if not changed:
    return
  diff = ", ".join(f"{k}: run {saved[k]!r}, here {now[k]!r}" for k in changed)
  runs = " ".join(f"--config.{k}={saved[k]}" for k in changed)
  raise ValueError(
      f"checkpoint {ckpt.directory}/{step} holds a policy of other shapes ({diff}). Fix: drop "
      f"those --config overrides (--workdir={workdir} alone reads the run's {saved_config.FILE}), or "
      f"pass the run's values: {runs}"
  )


def generate(
    config, policy, prompts, mesh, *, generation="greedy", num_samples=1, max_new_tokens=0, seed=0
) -> list[list[str]]:
  """For each prompt, `num_samples` completions (decoded text)."""
  rows = [dict(prompt=p, ground_truth="") for p in prompts]
  return generate_rows(
      config,
      policy,
      rows,
      mesh,
      generation=generation,
      num_samples=num_samples,
      max_new_tokens=max_new_tokens,
      seed=seed,
  )


def generate_rows(
    config, policy, rows, mesh, *, generation="greedy", num_samples=1, max_new_tokens=0, seed=0
) -> list[list[str]]:
  """Like `generate` for data rows (dicts with "prompt"), rendered as in training."""
  import jax
  import numpy as np

  from grpo_jax import data as data_lib
  from grpo_jax.parallel import multihost
  from grpo_jax import rollout
  from grpo_jax.rollout import turns as turns_lib
  from grpo_jax.parallel import sharding

  tok = data_lib.build_tokenizer(
      config.tokenizer.kind, config.tokenizer.path or config.model.hf_path
  )
  pd = data_lib.PromptData(
      rows,
      tok,
      template=config.data.template,
      system_prompt=turns_lib.system_prompt(
          config, data_lib.system_prompt(config.data.system_prompt)
      ),
      max_prompt_length=config.max_prompt_length,
  )
  dp = sharding.data_parallel_size(mesh)
  b = -(-len(rows) // dp) * dp  # pad the batch to fill the data-parallel devices
  engine = rollout.make_engine(
      config,
      policy,
      tok,
      mesh,
      kind="native",
      num_generations=num_samples,
      max_new_tokens=max_new_tokens or config.max_completion_length,
  )
  out = engine.generate(
      policy.params, pd.batch(np.resize(np.arange(len(rows)), b)), jax.random.key(seed), generation
  )
  tokens, mask = multihost.local_rows((out.tokens, out.mask))
  texts = [tok.decode([int(t) for t, m in zip(tr, mr) if m]) for tr, mr in zip(tokens, mask)]
  return [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(rows))]


def show_heldout(
    config,
    policy,
    mesh,
    *,
    num_examples=4,
    generation="greedy",
    num_samples=1,
    max_new_tokens=0,
    seed=0,
) -> list[dict]:
  """Samples `num_examples` rows of the eval split and prints prompt, completion, ground
  truth, reward and the task's verdict side by side; returns them as dicts."""
  from grpo_jax import data as data_lib
  from grpo_jax.eval import tasks as eval_tasks
  from grpo_jax import rewards as rewards_lib

  _, eval_rows = data_lib.load_rows(config)
  rows = eval_rows[: max(num_examples, 1)]
  completions = generate_rows(
      config,
      policy,
      rows,
      mesh,
      generation=generation,
      num_samples=num_samples,
      max_new_tokens=max_new_tokens,
      seed=seed,
  )
  reward_fn = rewards_lib.from_config(config.reward, on_error="zero", num_workers=0)
  shown = []
  try:
    for i, (row, texts) in enumerate(zip(rows, completions)):
      scored = reward_fn([row["prompt"]] * len(texts), texts, [row] * len(texts))
      task = eval_tasks.task_of(row.get("data_source"))
      verdicts = task.score(texts, [row] * len(texts))
      print(f"[{i + 1}/{len(rows)}] prompt: {_short(row['prompt'])}")
      print(f"      ground truth: {_short(row['ground_truth'])}")
      for j, text in enumerate(texts):
        parts = " ".join(f"{k}={v[j]:.2f}" for k, v in scored.per_function.items())
        verdict = (
            ("correct" if verdicts[task.correct][j] else "wrong")
            if task.correct
            else " ".join(f"{m}={verdicts[m][j]:.3f}" for m in task.metrics)
        )
        print(f"      completion: {_short(text)}")
        print(f"      reward {scored.total[j]:.2f} ({parts})  {task.name}: {verdict}")
        shown.append(
            dict(
                prompt=row["prompt"],
                completion=text,
                reward=float(scored.total[j]),
                **{m: float(verdicts[m][j]) for m in verdicts},
            )
        )
  finally:
    reward_fn.close()
  return shown


def _short(text, limit=300) -> str:
  text = str(text).replace("\n", "\\n")
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# ============================================================================ the command


def main(argv):
  from grpo_jax.run import console

  console.quiet_libraries(verbose=_VERBOSE.value)
  try:
    _run(argv[1:])
  except app.UsageError as e:  # a command that cannot run as given: no traceback to offer
    _fail(str(e), code=2)
  except Exception as e:  # one line on the console; the traceback with --verbose
    if _VERBOSE.value:
      raise
    _fail(f"{console.one_line(e)} (--verbose prints the traceback)")


def _run(prompts: list[str]):
  from grpo_jax.models import build

  if prompts == ["-"]:
    prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
  workdir = _WORKDIR.value
  if _CONFIG.value is None:
    from grpo_jax.run import paths

    raise app.UsageError(
        f"--workdir={workdir}: no such folder. Fix: name a training run's folder (the demo's: "
        "runs/tiny-<date>-<time>)"
        if workdir and not paths.isdir(workdir)
        else f"--workdir={workdir} holds no {saved_config.FILE} (the config a training run writes). "
        "Fix: pass the config the run was trained with, --config=FILE"
        if workdir
        else "no config. Fix: --workdir=DIR (a training run's folder: its config.json is "
        "used), or --config=FILE (e.g. --config=configs/tiny.py)"
    )
  overridden = config_flags.get_override_values(flags.FLAGS["config"])
  config = saved_config.under_run(_CONFIG.value, workdir, overridden)
  mesh = build.make_mesh(config)
  policy, step = load_params(config, workdir, _STEP.value, mesh)
  if _EXPORT_HF.value:  # the policy's own format: Qwen3/Llama, or T5ForConditionalGeneration
    policy.save_hf(policy.params, _EXPORT_HF.value)
    save_tokenizer(config, _EXPORT_HF.value)
    print(f"wrote {_EXPORT_HF.value} (step {step})")
  if _EXPORT_PEFT.value:
    if not config.lora.rank:
      raise app.UsageError(
          "--export_peft needs a LoRA run (config.lora.rank > 0). Fix: --export_hf writes "
          "this policy"
      )
    from grpo_jax.run import paths
    from grpo_jax.models.lora import peft as peft_export

    base = config.model.hf_path
    if peft_export.needs_own_base(config):  # the SFT'd / initial / dequantized base beside it
      base = str(paths.path(_EXPORT_PEFT.value) / "base")
      peft_export.save_base(policy, policy.params, base)
      save_tokenizer(config, base)
    peft_export.save_peft(policy.params, config, _EXPORT_PEFT.value, base_model_name_or_path=base)
    save_tokenizer(config, _EXPORT_PEFT.value, generation_config=False)
    print(f"wrote {_EXPORT_PEFT.value} (step {step}; base: {base})")
  if _EXPORT_HF.value or _EXPORT_PEFT.value:
    return
  if not prompts:
    show_heldout(
        config,
        policy,
        mesh,
        num_examples=_NUM_EXAMPLES.value,
        generation=_GENERATION.value,
        num_samples=_NUM_SAMPLES.value,
        max_new_tokens=_MAX_NEW_TOKENS.value,
        seed=_SEED.value,
    )
    return
  results = generate(
      config,
      policy,
      prompts,
      mesh,
      generation=_GENERATION.value,
      num_samples=_NUM_SAMPLES.value,
      max_new_tokens=_MAX_NEW_TOKENS.value,
      seed=_SEED.value,
  )
  for prompt, completions in zip(prompts, results):
    for c in completions:
      print(f"{prompt}{c}" if config.data.template == "plain" else f"{prompt}\n--> {c}")


def save_tokenizer(config, path: str, *, generation_config: bool = True):
  """The run's tokenizer beside exported weights (`tokenizers.save_hf_folder`); for a model
  folder also a generation_config.json with its stop and pad ids when the folder has none, so
  transformers' `generate` stops where the run's sampler did."""
  import jax

  from grpo_jax import data as data_lib
  from grpo_jax.data import tokenizers
  from grpo_jax.run import paths

  if jax.process_index() != 0:
    return
  tok = data_lib.build_tokenizer(
      config.tokenizer.kind, config.tokenizer.path or config.model.hf_path
  )
  tokenizers.save_hf_folder(tok, path)
  generation = paths.path(path) / "generation_config.json"
  if generation_config and not paths.exists(generation):
    stops = list(tok.stop_ids)
    paths.write_atomic(
        generation,
        json.dumps(
            {"eos_token_id": stops[0] if len(stops) == 1 else stops, "pad_token_id": tok.pad_id},
            indent=2,
        ),
    )


def _fail(line: str, code: int = 1):
  """`error: line` as the console's last line, and exit `code`."""
  sys.stdout.flush()
  sys.stderr.write(f"error: {line}\n")
  sys.stderr.flush()
  # Library threads (Orbax) may still print while the interpreter exits: not to the console.
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, with the config file found from any folder (paths.config_file_args), the
  workdir's config.json as the default --config, and a bad flag as one line."""
  from grpo_jax.run import paths

  argv = saved_config.with_config_arg(paths.config_file_args(argv))
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(" ".join(str(e).split()), code=2)
  except (AttributeError, KeyError) as e:  # ml_collections: a field the config does not have
    name = str(e).strip("'\"")
    overrides = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
    arg = next((a for a in overrides if a.split(".")[-1] == name), None)
    _fail(
        f"{arg or ' '.join(overrides)}: no such config field ({name}). Fix: check the name "
        "against the config (python -m grpo_jax.main --config=FILE --print_config prints every "
        "field)",
        code=2,
    )


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
