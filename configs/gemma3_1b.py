r"""GRPO on GSM8K with Gemma 3 1B: the 8B recipe's values scaled to one accelerator.

    python -m grpo_jax.main --config=configs/gemma3_1b.py --workdir=/tmp/gemma3_1b \
        --config.model.hf_path=/path/to/gemma-3-1b-it --config.data.train_path=... \
        --config.data.eval_path=...

    model         Gemma 3 1B (model.hf_path); f32 weights + AdamW moments, bf16 compute, remat
                  save_dots, scanned layers
    data          GSM8K (jsonl), the folder's chat template with the reasoning system prompt;
                  4 GSM8K rewards
    batch x G     16 prompts x 4 completions; micro-batch 16
    lengths       prompt 256, completion 1024 tokens; temperature 0.9, top-k 50
    lr            1e-6, 10% warmup then cosine to 0; AdamW (0.9, 0.99), wd 0.1, grad-norm clip 0.1
    beta          0.08 (k3 KL), clip eps 0.2, one iteration per batch
    steps         200; eval every 50 on 512 examples; checkpoints every 500, 4 kept
    mesh / chips  FSDP over all chips (data=1, fsdp=-1): TPU v5e-8 or v6e-8

Gemma 3's text decoder on the native NNX model (models/decoder/config.py "gemma3-1b": 26 layers, 5
sliding-window (512) layers per global one, MQA, head_dim 256, a 262k vocabulary); prompts in the
folder's own chat template (Gemma has no system turn: the template folds it into the first user
turn). Everything else is configs/qwen3_8b.py's.
HBM: python -m grpo_jax.memory_plan --config=configs/gemma3_1b.py --topology=v5e-8|v6e-8
fits both (v5e-8: peak 10.4 GiB of 15.75 per chip; figures in benchmarks/README.md,
"Gemma 3 1B").
"""

from configs import common
from configs import qwen3_8b


def get_config():
  c = qwen3_8b.get_config()
  c.model = common.model("gemma3-1b")  # the shape model.hf_path's config.json is checked against
  c.model.dtype = "bfloat16"  # bf16 compute; the preset's f32 param_dtype keeps f32 masters
  c.model.remat_policy = "save_dots"  # less recompute than full; fits (memory_plan, above)
  c.model.scan_layers = True  # one compiled layer body for all 26: a shorter compile
  c.data.template = "tokenizer"  # the folder's chat_template (Gemma's <start_of_turn> turns)
  # The small-model scaling of configs/qwen3_0p6b.py: 16 prompts x 4, updated 16 sequences at
  # a time, at a third of the 8B learning rate.
  c.num_generations = 4
  c.batch_size = 16
  c.micro_batch_size = 16
  c.optimizer.learning_rate = 1e-6
  # FSDP over every chip: the f32 masters + moments (11.2 GiB replicated) would not fit a v5e's
  # 16 GiB beside the 262k-vocabulary logits; sharded 8 ways the step peaks at 10.4 GiB.
  c.mesh.data = 1
  c.mesh.fsdp = -1
  return c
