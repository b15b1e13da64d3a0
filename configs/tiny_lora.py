r"""The CPU demo (configs/tiny.py) with GRPO through LoRA after the same full-parameter SFT warm
start: rank-8 adapters (alpha 16) on every attention and MLP projection, the SFT'd model frozen
as the base (and, with beta > 0, as the reference: no copy).

    python -m grpo_jax.main --config=configs/tiny_lora.py --workdir=/tmp/tiny_lora

Same task, reward and schedule as tiny.py; the adapters take a 4x larger learning rate than the
full-parameter run (a low-rank update moves the weights less per step). Measured figures are in
benchmarks/README.md ("LoRA").
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.lora.rank = 8
  c.lora.alpha = 16.0
  c.optimizer.learning_rate = 2e-3
  return c
