r"""The CPU demo's task with a 2-layer MaxText Qwen3 as the policy (model.impl = "maxtext").

    python -m grpo_jax.main --config=configs/tiny_maxtext.py --workdir=/tmp/tiny_maxtext

MaxText's scanned layers, remat and attention run inside our GRPO loop; the native sampler
draws the rollouts from the same weights mapped into the native layout every step
(grpo_jax/models/maxtext/adapter.py). A smoke-sized run: a short SFT warm start, then a few
GRPO steps with a KL-regularized reference; under a minute on 2 CPU cores after compilation.
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.impl = "maxtext"
  c.model.scan_layers = True
  c.model.maxtext.remat_policy = "full"
  c.model.maxtext.attention = "dot_product"
  c.sft_steps = 50
  c.sft.stop_at_accuracy = 1.0
  c.num_steps = 20
  c.batch_size = 16
  c.num_generations = 4
  c.beta = 0.04  # exercises the frozen reference copy of the MaxText policy
  c.eval.num_examples = 64
  c.log_interval_steps = 5
  c.save_interval_steps = 10
  return c
