r"""GRPO on GSM8K with Qwen3-8B, the recipe's reference values; f32 master weights, bf16 compute.

    python -m grpo_jax.main --config=configs/qwen3_8b.py --workdir=/tmp/qwen3_8b \
        --config.model.hf_path=/path/to/Qwen3-8B --config.data.train_path=/path/gsm8k/train.jsonl \
        --config.data.eval_path=/path/gsm8k/test.jsonl

Values from the Qwen3/Gemma GSM8K GRPO recipe: G=2, beta=0.08, eps=0.2, one iteration,
lr 3e-6 (10% warmup, cosine), grad-norm clip 0.1, temperature 0.9, top-k 50, 1024 generated
tokens, 200 steps, checkpoints every 500 steps keeping 4. Same file with the MaxText layers:
--config.model.impl=maxtext. Runs on a TPU v5p-8 / 8xH100 host (FSDP over all devices).
Weights and AdamW moments are f32 (a bf16 weight cannot absorb an lr-3e-6 step: configuration
.warnings says so), the layers compute in bf16, the frozen reference is stored in bf16.
HBM (python -m grpo_jax.memory_plan --config=configs/qwen3_8b.py --topology=v5p-8|v6e-8):
fits a v5p-8 with remat full at micro-batch 8; on a v6e-8 use --config.micro_batch_size=16
(+6.4 GiB per chip; figures in benchmarks/README.md).
"""
from configs import common


def get_config():
  c = common.base()
  c.model = common.model("qwen3-8b")
  c.model.param_dtype = "float32"  # f32 master weights + AdamW moments; bf16 compute
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "full"
  c.model.scan_layers = True

  c.num_generations = 2
  c.beta = 0.08
  c.num_iterations = 1
  c.num_steps = 200
  c.batch_size = 8
  c.micro_batch_size = 8  # One sequence per chip on an 8-chip host (fsdp=-1); a multiple of data*fsdp.
  c.max_prompt_length = 256
  c.max_completion_length = 1024

  c.loss.clip_eps = 0.2
  c.optimizer.learning_rate = 3e-6
  c.optimizer.warmup_ratio = 0.1
  c.optimizer.max_grad_norm = 0.1
  c.rollout.temperature = 0.9
  c.rollout.top_k = 50
  c.rollout.top_p = 1.0

  c.save_interval_steps = 500
  c.checkpoint.max_to_keep = 4
  c.eval_interval_steps = 50
  c.eval.num_examples = 512

  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1

  # LoRA, the recipe's next step, is one flag: --config.lora.rank=8 trains rank-8 adapters
  # (alpha 16) on every attention and MLP projection of the frozen base (native impl only); the
  # reference for beta > 0 is that base with the adapters off (no second copy of the weights).
  # Adapters want a larger learning rate than full training, e.g. --config.optimizer.
  # learning_rate=1e-5 (verl's LoRA GRPO examples use 3e-6 to 1e-5). Add
  # --config.lora.quantize_base=int8 for a QLoRA-style int8 base (sft_steps must be 0 then).
  c.lora.rank = 0
  c.lora.alpha = 16.0
  return c
