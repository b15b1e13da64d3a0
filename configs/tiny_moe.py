r"""The CPU demo (configs/tiny.py) with a mixture-of-experts policy: the same task, reward and
schedule on a tiny Qwen3-MoE-shaped decoder (8 experts per layer, top-2, renormalized gates).

    python -m grpo_jax.main --config=configs/tiny_moe.py --workdir=/tmp/tiny_moe

    model         tiny.py's decoder (2 layers, width 128, 4 heads, f32) with each MLP replaced by
                  8 SwiGLU experts of width 96, top-2 routed with norm_topk_prob (Qwen3-30B-A3B's
                  router); 0.70M parameters, 0.26M active per token
    data          generated 2-digit additions, plain prompts, the char tokenizer
    batch x G     32 prompts x 8 completions; micro-batch 32
    lengths       prompt 6, completion 7 tokens
    lr            5e-4, no warmup, cosine to 0; SFT 1e-3
    beta          0 (no reference model)
    steps         up to 1500 SFT steps (until 25% held-out accuracy), then 1200 GRPO steps
    mesh / chips  data parallel over the CPU's devices (the default mesh)

What it shows: the MoE layers (models/decoder/moe.py) through every part of the loop on a CPU,
SFT, sampling, the update, evaluation and checkpoints.
"""

from configs import tiny


def get_config():
  c = tiny.get_config()
  c.model.preset = "tiny-moe"
  # Every layer routed (decoder_sparse_step 1, no mlp_only_layers, as Qwen3-30B-A3B): 8 experts
  # of a quarter of tiny.py's MLP width, two per token, the gates renormalized to sum to 1.
  c.model.num_experts = 8
  c.model.num_experts_per_tok = 2
  c.model.moe_intermediate_size = 96
  c.model.norm_topk_prob = True
  return c
