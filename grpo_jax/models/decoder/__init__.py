"""The decoder-only family (Qwen3, Llama 3, Gemma 2, Gemma 3): config, layers, model, HF I/O,
the sampler's decode-attention kernel."""
