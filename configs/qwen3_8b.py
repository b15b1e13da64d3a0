r"""GRPO on GSM8K with Qwen3-8B, the recipe's reference values; f32 master weights, bf16 compute.

    python -m grpo_jax.main --config=configs/qwen3_8b.py --workdir=/tmp/qwen3_8b \
        --config.model.hf_path=/path/to/Qwen3-8B --config.data.train_path=/path/gsm8k/train.jsonl \
        --config.data.eval_path=/path/gsm8k/test.jsonl

    model         Qwen3-8B (model.hf_path); f32 weights + AdamW moments, bf16 compute, remat full,
                  scanned layers
    data          GSM8K (jsonl), chatml prompts with the reasoning system prompt; 4 GSM8K rewards
    batch x G     8 prompts x 2 completions; micro-batch 8
    lengths       prompt 256, completion 1024 tokens; temperature 0.9, top-k 50
    lr            3e-6, 10% warmup then cosine to 0; AdamW (0.9, 0.99), wd 0.1, grad-norm clip 0.1
    beta          0.08 (k3 KL), clip eps 0.2, one iteration per batch
    steps         200; eval every 50 on 512 examples; checkpoints every 500, 4 kept
    mesh / chips  FSDP over all chips of one host (data=1, fsdp=-1): TPU v5p-8 or 8xH100

configs/common.py's defaults are this recipe's values (the Qwen3/Gemma GSM8K GRPO recipe: G=2,
beta=0.08, eps=0.2, one iteration, lr 3e-6, grad-norm clip 0.1, temperature 0.9, top-k 50, 1024
generated tokens, 200 steps), so the file sets only the model, the schedule of evals and the
mesh. Same file with the MaxText layers: --config.model.impl=maxtext.
Weights and AdamW moments are f32 (a bf16 weight cannot absorb an lr-3e-6 step: configuration
.warnings says so), the layers compute in bf16, the frozen reference is stored in bf16.
HBM (python -m grpo_jax.memory_plan --config=configs/qwen3_8b.py --topology=v5p-8|v6e-8):
fits a v5p-8 with remat full at micro-batch 8; on a v6e-8 use --config.micro_batch_size=16
(+6.4 GiB per chip; figures in benchmarks/README.md).

LoRA, the recipe's next step, is one flag: --config.lora.rank=8 trains rank-8 adapters (alpha
16) on every attention and MLP projection of the frozen base (native impl only); the reference
for beta > 0 is that base with the adapters off (no second copy of the weights). Adapters want a
larger learning rate than full training, e.g. --config.optimizer.learning_rate=1e-5 (verl's LoRA
GRPO examples use 3e-6 to 1e-5). Add --config.lora.quantize_base=int8 for a QLoRA-style int8
base (sft_steps must be 0 then).
"""

from configs import common


def get_config():
  c = common.base()
  c.model = common.model("qwen3-8b")  # the shape model.hf_path's config.json is checked against
  c.model.dtype = "bfloat16"  # bf16 compute; the preset's f32 param_dtype keeps f32 masters
  c.model.remat_policy = "full"  # fits a v5p-8's HBM at micro-batch 8 (memory_plan, above)
  c.model.scan_layers = True  # one compiled layer body for all 36: a shorter compile

  # One sequence per chip on an 8-chip host (fsdp=-1); a multiple of data * fsdp.
  c.micro_batch_size = 8

  # GSM8K's longest train question renders to 267 Qwen tokens (row 3331, chatml + the reasoning
  # prompt), over max_prompt_length 256: cut such prompts at their start (the question's end
  # and the assistant header stay), counted in the log, rather than stop (data/checks.py).
  c.data.overlong_prompts = "truncate"

  c.eval_interval_steps = 50  # an accuracy curve during the 200 steps, not only at the ends
  c.eval.num_examples = 512  # of GSM8K's 1319 test problems: a cheaper eval every 50 steps

  # FSDP over every chip: f32 params, AdamW moments and the bf16 reference take 115 GB
  # (benchmarks/README.md), more than one chip holds.
  c.mesh.data = 1
  c.mesh.fsdp = -1
  return c
