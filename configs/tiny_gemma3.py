r"""The CPU demo (configs/tiny.py) with a Gemma 3-shaped policy: (1 + w) norms before and after
attention and the MLP, GeGLU, scaled embeddings, q/k norms, and sliding-window layers (window 4,
shorter than the 6 + 7 token rows) interleaved with a global one, each kind with its own RoPE
base. Same task, reward, sizes and schedule as tiny.py; it learns as much in about the same
time (seeds 0-2: +57.4 points vs tiny.py's +56.0, 1.07x its wall time; benchmarks/README.md).

    python -m grpo_jax.main --config=configs/tiny_gemma3.py --workdir=/tmp/tiny_gemma3
"""
from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.arch = "gemma3"
  c.model.sliding_window = 4
  c.model.sliding_window_pattern = 2  # layer 0 local, layer 1 global
  c.model.rope_local_theta = 10000.0
  c.model.rope_theta = 1e6
  c.model.query_pre_attn_scalar = 32.0  # = head_dim
  return c
