r"""The CPU demo (configs/tiny.py) with a Gemma 3-shaped policy: (1 + w) norms before and after
attention and the MLP, GeGLU, scaled embeddings, q/k norms, and sliding-window layers (window 4,
shorter than the 6 + 7 token rows) interleaved with a global one, each kind with its own RoPE
base. Same task, reward, sizes and schedule as tiny.py; it learns as much in about the same
time (seeds 0-2: +57.4 points vs tiny.py's +56.0, 1.07x its wall time; benchmarks/README.md).

    python -m grpo_jax.main --config=configs/tiny_gemma3.py --workdir=/tmp/tiny_gemma3

    model         tiny.py's 2-layer width-128 decoder in Gemma 3's architecture, f32
    data          generated 2-digit additions, plain prompts, the char tokenizer
    batch x G     32 prompts x 8 completions; micro-batch 32
    lengths       prompt 6, completion 7 tokens
    lr            5e-4, no warmup, cosine to 0; SFT 1e-3
    beta          0 (no reference model)
    steps         up to 1500 SFT steps (until 25% held-out accuracy), then 1200 GRPO steps
    mesh / chips  data parallel over the CPU's devices (the default mesh)
"""

from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.arch = "gemma3"  # the Gemma 3 block, at tiny.py's sizes
  c.model.sliding_window = 4  # shorter than a row, so the local layers do mask
  c.model.sliding_window_pattern = 2  # layer 0 local, layer 1 global
  c.model.rope_local_theta = 10000.0  # Gemma 3's two RoPE bases: 1e4 local, 1e6 global
  c.model.rope_theta = 1e6
  c.model.query_pre_attn_scalar = 32.0  # = head_dim
  return c
