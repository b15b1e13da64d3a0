r"""GRPO on GSM8K with Gemma 3 1B: the 8B recipe's values scaled to one accelerator.

    python -m grpo_jax.main --config=configs/gemma3_1b.py --workdir=/tmp/gemma3_1b \
        --config.model.hf_path=/path/to/gemma-3-1b-it --config.data.train_path=... \
        --config.data.eval_path=...

Gemma 3's text decoder on the native NNX model (models/decoder/config.py "gemma3-1b": 26 layers, 5
sliding-window (512) layers per global one, MQA, head_dim 256, a 262k vocabulary); prompts in the
folder's own chat template (Gemma has no system turn: the template folds it into the first user
turn). f32 master weights and AdamW moments, bf16 compute, remat save_dots, layers scanned.
HBM: python -m grpo_jax.memory_plan --config=configs/gemma3_1b.py --topology=v5e-8|v6e-8
fits both (v5e-8: peak 10.4 GiB of 15.75 per chip; figures in benchmarks/README.md,
"Gemma 3 1B").
"""
from configs import common
from configs import qwen3_8b


def get_config():
  c = qwen3_8b.get_config()
  c.model = common.model("gemma3-1b")
  c.model.param_dtype = "float32"  # f32 master weights + AdamW moments; bf16 compute
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "save_dots"
  c.model.scan_layers = True
  c.data.template = "tokenizer"  # the folder's chat_template (Gemma's <start_of_turn> turns)
  c.num_generations = 4
  c.batch_size = 16
  c.micro_batch_size = 16
  c.optimizer.learning_rate = 1e-6
  # FSDP over every chip: the f32 masters + moments (11.2 GiB replicated) would not fit a v5e's
  # 16 GiB beside the 262k-vocabulary logits; sharded 8 ways the step peaks at 10.4 GiB.
  c.mesh.data = 1
  c.mesh.fsdp = -1
  return c
