r"""GRPO on GSM8K with Llama-3.1-8B-Instruct (f32 master weights, bf16 compute), `plain` format.

    python -m grpo_jax.main --config=configs/llama3_8b.py --workdir=/tmp/llama3_8b \
        --config.model.hf_path=/path/to/Llama-3.1-8B-Instruct --config.data.train_path=... \
        --config.data.eval_path=...
"""
from configs import common
from configs import qwen3_8b


def get_config():
  c = qwen3_8b.get_config()
  c.model = common.model("llama3.1-8b")
  c.model.param_dtype = "float32"  # f32 master weights + AdamW moments; bf16 compute
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "full"
  c.model.scan_layers = True
  c.data.template = "plain"
  return c
