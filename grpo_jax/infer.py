r"""Sample from a trained policy: the latest checkpoint in a workdir, or model.hf_path.

    python -m grpo_jax.infer --config=configs/tiny.py --workdir=/tmp/run1 "12+30="
    python -m grpo_jax.infer --config=configs/tiny.py --workdir=/tmp/run1   # held-out rows
    python -m grpo_jax.infer --config=configs/qwen3_8b.py --config.model.hf_path=/ckpt/Qwen3-8B \
        --generation=standard --num_samples=4 "What is 12 + 30?"
    python -m grpo_jax.infer --config=configs/tiny.py --workdir=/tmp/run1 --export_hf=/tmp/hf

Prompts are rendered with the config's template and system prompt, exactly as in training.
Pass prompts as arguments, or `-` to read one prompt per line from stdin. With no prompts, a
few held-out rows of the config's eval split (`--num_examples`) are sampled and shown with
their ground truth, the config's reward (per function) and the eval task's verdict (e.g.
correct / ROUGE). `--export_hf` writes the policy as a Hugging Face folder (config.json +
model.safetensors; `policy.save_hf`: a T5ForConditionalGeneration folder for model.family=t5)
instead of sampling.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "The run's config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Run directory whose latest checkpoint to use. "
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
    "format (adapter_model.safetensors + adapter_config.json).",
)


def load_params(config, workdir, step, mesh):
  """(policy, step or None): the policy with parameters from a checkpoint when there is one."""
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
  policy = build.make_policy(config, mesh, abstract=step is not None)
  if step is not None:
    if step not in ckpt.all_steps():
      raise FileNotFoundError(f"--step={step}: not in {ckpt_dir} (have {ckpt.all_steps()})")
    if config.lora.rank:  # the adapters, and the base the checkpoint names
      from grpo_jax.models.lora import policy as lora_policy

      policy.params = lora_policy.restore_params(config, ckpt, step, policy, mesh)
    else:
      policy.params = ckpt.restore_params(step, policy.params)
    logging.info("restored the policy from %s/%d", ckpt_dir, step)
  elif not config.model.hf_path:
    logging.warning("no --workdir and no model.hf_path: sampling from a RANDOM-INIT model")
  return policy, step


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
  from grpo_jax.parallel import sharding

  tok = data_lib.build_tokenizer(
      config.tokenizer.kind, config.tokenizer.path or config.model.hf_path
  )
  pd = data_lib.PromptData(
      rows,
      tok,
      template=config.data.template,
      system_prompt=data_lib.system_prompt(config.data.system_prompt),
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


def main(argv):
  from grpo_jax.models import build

  prompts = argv[1:]
  if prompts == ["-"]:
    prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
  if _CONFIG.value is None:
    raise app.UsageError("--config is required (the config the run was trained with)")
  config = _CONFIG.value
  mesh = build.make_mesh(config)
  policy, step = load_params(config, _WORKDIR.value, _STEP.value, mesh)
  if _EXPORT_HF.value:  # the policy's own format: Qwen3/Llama, or T5ForConditionalGeneration
    policy.save_hf(policy.params, _EXPORT_HF.value)
    print(f"wrote {_EXPORT_HF.value} (step {step})")
  if _EXPORT_PEFT.value:
    if not config.lora.rank:
      raise ValueError("--export_peft needs a LoRA run (config.lora.rank > 0)")
    from grpo_jax.run import paths
    from grpo_jax.models.lora import peft as peft_export

    base = config.model.hf_path
    if peft_export.needs_own_base(config):  # the SFT'd / initial / dequantized base beside it
      base = str(paths.path(_EXPORT_PEFT.value) / "base")
      peft_export.save_base(policy, policy.params, base)
    peft_export.save_peft(policy.params, config, _EXPORT_PEFT.value, base_model_name_or_path=base)
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


if __name__ == "__main__":
  from grpo_jax.run import paths

  app.run(main, flags_parser=lambda argv: flags.FLAGS(paths.config_file_args(argv)))
