r"""GRPO on GSM8K with Qwen3-0.6B: the 8B recipe on one accelerator (or a patient CPU).

    python -m grpo_jax.main --config=configs/qwen3_0p6b.py --workdir=/tmp/qwen3_0p6b \
        --config.model.hf_path=/path/to/Qwen3-0.6B --config.data.train_path=... \
        --config.data.eval_path=...

    model         Qwen3-0.6B (model.hf_path); f32 weights + AdamW moments, bf16 compute, remat
                  save_dots, scanned layers
    data          GSM8K (jsonl), chatml prompts with the reasoning system prompt; 4 GSM8K rewards
    batch x G     16 prompts x 4 completions; micro-batch 16
    lengths       prompt 256, completion 1024 tokens; temperature 0.9, top-k 50
    lr            1e-6, 10% warmup then cosine to 0; AdamW (0.9, 0.99), wd 0.1, grad-norm clip 0.1
    beta          0.08 (k3 KL), clip eps 0.2, one iteration per batch
    steps         200; eval every 50 on 512 examples; checkpoints every 500, 4 kept
    mesh / chips  data parallel over every chip (data=-1, fsdp=1): one GPU / TPU chip or more

Everything else is configs/qwen3_8b.py's.
"""

from configs import qwen3_8b
from configs import common


def get_config():
  c = qwen3_8b.get_config()
  c.model = common.model("qwen3-0.6b")  # the shape model.hf_path's config.json is checked against
  c.model.dtype = "bfloat16"  # bf16 compute; the preset's f32 param_dtype keeps f32 masters
  c.model.remat_policy = "save_dots"  # less recompute than full; a 0.6B step has the memory
  c.model.scan_layers = True  # one compiled layer body for all 28: a shorter compile
  # One accelerator holds a 0.6B step of 16 prompts x 4 (the 8B recipe: 8 x 2 over 8 chips),
  # updated 16 sequences at a time, at a third of the 8B learning rate.
  c.num_generations = 4
  c.batch_size = 16
  c.micro_batch_size = 16
  c.optimizer.learning_rate = 1e-6
  # The 8B recipe's FSDP undone: the 0.6B f32 params, moments and reference (8.3 GB,
  # benchmarks/README.md) fit every chip, so each chip holds a replica.
  c.mesh.data = -1
  c.mesh.fsdp = 1
  return c
