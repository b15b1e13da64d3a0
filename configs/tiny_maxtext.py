r"""The CPU demo's task with a 2-layer MaxText Qwen3 as the policy (model.impl = "maxtext").

    python -m grpo_jax.main --config=configs/tiny_maxtext.py --workdir=/tmp/tiny_maxtext

    model         tiny.py's 2-layer width-128 Qwen3 in MaxText's layers (scanned, MaxText remat
                  "full", dot-product attention: configs/common.py's), f32
    data          generated 2-digit additions, plain prompts, the char tokenizer
    batch x G     16 prompts x 4 completions; micro-batch 32
    lengths       prompt 6, completion 7 tokens
    lr            5e-4, no warmup, cosine to 0; SFT 1e-3
    beta          0.04 (a frozen MaxText reference)
    steps         up to 50 SFT steps, then 20 GRPO steps; eval on 64 held-out problems
    mesh / chips  data parallel over the CPU's devices (the default mesh)

MaxText's scanned layers, remat and attention run inside our GRPO loop; the native sampler
draws the rollouts from the same weights mapped into the native layout every step
(grpo_jax/models/maxtext/adapter.py). A smoke-sized run: a short SFT warm start, then a few
GRPO steps with a KL-regularized reference; under a minute on 2 CPU cores after compilation.
"""

from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.impl = "maxtext"  # the point of this config
  c.model.scan_layers = True  # exercise MaxText's scanned layers (tiny.py: unrolled)
  # A smoke-sized run: a short warm start (no accuracy stop), a few GRPO steps, a small eval.
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
