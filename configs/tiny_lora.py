r"""The CPU demo (configs/tiny.py) with GRPO through LoRA after the same full-parameter SFT warm
start: rank-8 adapters (alpha 16) on every attention and MLP projection, the SFT'd model frozen
as the base (and, with beta > 0, as the reference: no copy).

    python -m grpo_jax.main --config=configs/tiny_lora.py --workdir=/tmp/tiny_lora

    model         tiny.py's 0.4M-parameter decoder, f32; GRPO trains rank-8 LoRA adapters
                  (alpha 16, configs/common.py's) on every attention and MLP projection
    data          generated 2-digit additions, plain prompts, the char tokenizer
    batch x G     32 prompts x 8 completions; micro-batch 32
    lengths       prompt 6, completion 7 tokens
    lr            2e-3 (the adapters), no warmup, cosine to 0; SFT 1e-3 (full parameters)
    beta          0 (no reference model)
    steps         up to 1500 SFT steps (until 25% held-out accuracy), then 1200 GRPO steps
    mesh / chips  data parallel over the CPU's devices (the default mesh)

Same task, reward and schedule as tiny.py; the adapters take a 4x larger learning rate than the
full-parameter run (a low-rank update moves the weights less per step). Measured figures are in
benchmarks/README.md ("LoRA").
"""

from configs import tiny


def get_config():
  c = tiny.get_config()
  c.lora.rank = 8  # GRPO through rank-8 adapters on the frozen SFT'd model
  c.optimizer.learning_rate = 2e-3  # 4x tiny.py's: a low-rank update moves the weights less
  return c
