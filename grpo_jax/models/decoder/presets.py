"""The model presets: `PRESETS[name]` is a ModelConfig with a published model's shapes
(model.preset; the numbers are those models' config.json on the Hugging Face hub, cited per
family), and the tiny ones the tests and CPU demos build. An HF folder's config.json is read by
`ModelConfig.from_hf` instead (models/decoder/config.py).
"""

from grpo_jax.models.decoder.config import ModelConfig


def _gemma2(**kw):
  kw = dict(
      dict(
          vocab_size=256000,
          head_dim=256,
          rope_theta=10000.0,
          rms_norm_eps=1e-6,
          qk_norm=False,
          tie_embeddings=True,
          max_position_embeddings=8192,
          query_pre_attn_scalar=256.0,
          attn_logit_softcap=50.0,
          final_logit_softcap=30.0,
          sliding_window=4096,
          sliding_window_pattern=2,
      ),
      **kw,
  )
  return ModelConfig(arch="gemma2", **kw)


def _gemma3(**kw):
  kw = dict(
      dict(
          vocab_size=262208,
          head_dim=256,
          rope_theta=1e6,
          rope_local_theta=10000.0,
          rms_norm_eps=1e-6,
          qk_norm=True,
          tie_embeddings=True,
          max_position_embeddings=131072,
          query_pre_attn_scalar=256.0,
          sliding_window=1024,
          sliding_window_pattern=6,
      ),
      **kw,
  )
  return ModelConfig(arch="gemma3", **kw)


def _qwen3(**kw):
  kw = dict(
      dict(
          vocab_size=151936,
          num_kv_heads=8,
          head_dim=128,
          rope_theta=1e6,
          rms_norm_eps=1e-6,
          qk_norm=True,
          max_position_embeddings=40960,
      ),
      **kw,
  )
  return ModelConfig(arch="qwen3", **kw)


PRESETS: dict[str, ModelConfig] = {
    # huggingface.co/Qwen/Qwen3-{0.6B,1.7B,4B,8B}/blob/main/config.json
    "qwen3-0.6b": _qwen3(
        hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16, tie_embeddings=True
    ),
    "qwen3-1.7b": _qwen3(
        hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, tie_embeddings=True
    ),
    "qwen3-4b": _qwen3(
        hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32, tie_embeddings=True
    ),
    "qwen3-8b": _qwen3(
        hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, tie_embeddings=False
    ),
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama3.1-8b": ModelConfig(
        arch="llama3",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position=8192,
        rms_norm_eps=1e-5,
        tie_embeddings=False,
        qk_norm=False,
        max_position_embeddings=131072,
    ),
    # huggingface.co/Qwen/Qwen3-30B-A3B, Qwen3-235B-A22B/blob/main/config.json (intermediate_size:
    # the dense MLP width config.json names; every layer is routed, no mlp_only_layers)
    "qwen3-30b-a3b": _qwen3(
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        tie_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    "qwen3-235b-a22b": _qwen3(
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        tie_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        norm_topk_prob=True,
    ),
    # Test shapes.
    "tiny-qwen3": ModelConfig(
        arch="qwen3",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        rope_theta=10000.0,
        tie_embeddings=False,
        max_position_embeddings=256,
    ),
    "tiny-llama3": ModelConfig(
        arch="llama3",
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        rope_original_max_position=32,
        rms_norm_eps=1e-5,
        tie_embeddings=True,
        qk_norm=False,
        max_position_embeddings=256,
    ),
    # huggingface.co/google/gemma-2-{2b,9b}/blob/main/config.json
    "gemma2-2b": _gemma2(
        hidden_size=2304, intermediate_size=9216, num_layers=26, num_heads=8, num_kv_heads=4
    ),
    "gemma2-9b": _gemma2(
        hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16, num_kv_heads=8
    ),
    # huggingface.co/google/gemma-3-1b-it (Gemma3ForCausalLM) and the text towers of
    # gemma-3-{4b,12b,27b}-it (Gemma3ForConditionalGeneration's text_config)
    "gemma3-1b": _gemma3(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        sliding_window=512,
        max_position_embeddings=32768,
    ),
    "gemma3-4b": _gemma3(
        hidden_size=2560,
        intermediate_size=10240,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        rope_linear_factor=8.0,
    ),
    "gemma3-12b": _gemma3(
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        rope_linear_factor=8.0,
    ),
    "gemma3-27b": _gemma3(
        hidden_size=5376,
        intermediate_size=21504,
        num_layers=62,
        num_heads=32,
        num_kv_heads=16,
        head_dim=128,
        query_pre_attn_scalar=168.0,
        rope_linear_factor=8.0,
    ),
    # Test shapes with every Gemma feature active at short lengths.
    "tiny-gemma2": _gemma2(
        vocab_size=103,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        sliding_window=5,
        query_pre_attn_scalar=12.0,
        attn_logit_softcap=5.0,
        final_logit_softcap=3.0,
        max_position_embeddings=256,
    ),
    "tiny-gemma3": _gemma3(
        vocab_size=107,
        hidden_size=64,
        intermediate_size=96,
        num_layers=4,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        sliding_window=4,
        sliding_window_pattern=3,
        query_pre_attn_scalar=16.0,
        rope_theta=1e6,
        rope_linear_factor=2.0,
        max_position_embeddings=256,
    ),
}
# The MoE test shape: tiny-qwen3 with 8 experts (top-2) in every layer.
PRESETS["tiny-qwen3-moe"] = PRESETS["tiny-qwen3"].replace(
    head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
)
