r"""GRPO on GSM8K with Qwen3-0.6B: the 8B recipe on one accelerator (or a patient CPU).

    python -m grpo_jax.main --config=configs/qwen3_0p6b.py --workdir=/tmp/qwen3_0p6b \
        --config.model.hf_path=/path/to/Qwen3-0.6B --config.data.train_path=... \
        --config.data.eval_path=...
"""
from configs import qwen3_8b
from configs import common


def get_config():
  c = qwen3_8b.get_config()
  c.model = common.model("qwen3-0.6b")
  c.model.param_dtype = "float32"  # f32 master weights + AdamW moments; bf16 compute
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "save_dots"
  c.model.scan_layers = True
  c.num_generations = 4
  c.batch_size = 16
  c.micro_batch_size = 16
  c.optimizer.learning_rate = 1e-6
  c.mesh.data = -1
  c.mesh.fsdp = 1
  return c
