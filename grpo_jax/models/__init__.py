"""Native Flax NNX decoders (Qwen3, Llama 3) and T5, Hugging Face checkpoint interop by family
(`load_hf` / `save_hf` pick the family from config.json / the module: families.py), log-probs."""

from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.models.decoder.presets import PRESETS
from grpo_jax.models.decoder.transformer import Transformer
from grpo_jax.models.decoder.transformer import build_model
from grpo_jax.models.decoder.transformer import positions_from_mask
from grpo_jax.models.decoder.hf import hf_tensors
from grpo_jax.models.families import load_hf
from grpo_jax.models.families import save_hf
from grpo_jax.models.decoder.hf import param_mapping
from grpo_jax.models.logprobs import chunked_token_logprobs
from grpo_jax.models.logprobs import completion_logprobs
from grpo_jax.models.logprobs import token_logprobs
