r"""GRPO on GSM8K with Qwen3-30B-A3B (mixture of experts), the qwen3_8b.py recipe's values; f32
master weights, bf16 compute.

    python -m grpo_jax.main --config=configs/qwen3_30b_a3b.py --workdir=/tmp/qwen3_30b_a3b \
        --config.model.hf_path=/path/to/Qwen3-30B-A3B \
        --config.data.train_path=/path/gsm8k/train.jsonl \
        --config.data.eval_path=/path/gsm8k/test.jsonl

    model         Qwen3-30B-A3B (model.hf_path, a Qwen3MoeForCausalLM folder): 48 layers, width
                  2048, 32 q / 4 kv heads of 128, every layer 128 experts of width 768, top-8 with
                  renormalized gates; 30.5B parameters, 3.3B active per token. f32 weights + AdamW
                  moments, bf16 compute, remat full, scanned layers
    data          GSM8K (jsonl), chatml prompts with the reasoning system prompt; 4 GSM8K rewards
    batch x G     8 prompts x 2 completions; micro-batch 8
    lengths       prompt 256, completion 1024 tokens; temperature 0.9, top-k 50
    lr            3e-6, 10% warmup then cosine to 0; AdamW (0.9, 0.99), wd 0.1, grad-norm clip 0.1
    beta          0.08 (k3 KL), clip eps 0.2, one iteration per batch
    steps         200; eval every 50 on 512 examples; checkpoints every 500, 4 kept
    mesh / chips  FSDP over every chip (data=1, fsdp=-1) up to 8 chips: f32 weights + AdamW
                  moments are ~366 GB and the bf16 reference ~61 GB. The smallest planned fits
                  (memory_plan, benchmarks/README.md "Qwen3-30B-A3B"): v5p-16 with
                  --config.micro_batch_size=16, v6e-32 (full fine-tuning; 8 H100s do not fit)

Beyond 8 chips the B=8 prompts cannot split over fsdp alone: add tensor parallelism,
--config.mesh.fsdp=8 --config.mesh.tensor=<chips / 8>. Check a topology before a run:
python -m grpo_jax.memory_plan --config=configs/qwen3_30b_a3b.py --topology=v5p-16 (a TPU slice,
or h100-8 / h200-8).

LoRA is one flag, as in qwen3_8b.py: --config.lora.rank=8 trains rank-8 adapters on the
attention and on every expert's gate/up/down (per expert; the router stays frozen) over the
frozen base, which is also the reference; it fits a v5p-8 or a v6e-8 (planned, same section).
Routing replay (--config.rollout.routing_replay=rollout) works with it. PEFT export of expert
adapters is refused: export the merged model (infer --export_hf).

configs/common.py's defaults are the recipe's values (qwen3_8b.py: G=2, beta=0.08, eps=0.2, one
iteration, lr 3e-6, grad-norm clip 0.1, temperature 0.9, top-k 50, 1024 generated tokens, 200
steps); this file sets the model, the schedule of evals and the mesh. The native decoder only
(models/decoder/moe.py): MaxText's and vLLM's MoE paths are not wired to this policy.
"""

from configs import common


def get_config():
  c = common.base()
  # The shape model.hf_path's config.json is checked against: huggingface.co/Qwen/Qwen3-30B-A3B.
  c.model = common.model("qwen3-30b-a3b")
  c.model.dtype = "bfloat16"  # bf16 compute; the preset's f32 param_dtype keeps f32 masters
  c.model.remat_policy = "full"
  # Every layer is routed (no mlp_only_layers), so the 48 layers stack into one scanned body.
  c.model.scan_layers = True

  c.micro_batch_size = 8
  c.data.overlong_prompts = "truncate"  # GSM8K's longest question: qwen3_8b.py's reason

  c.eval_interval_steps = 50
  c.eval.num_examples = 512

  # FSDP over every chip: the f32 weights, AdamW moments and the bf16 reference (~427 GB) are
  # spread over all of them.
  c.mesh.data = 1
  c.mesh.fsdp = -1
  return c
