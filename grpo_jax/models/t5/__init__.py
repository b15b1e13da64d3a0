"""The encoder-decoder family (T5 v1.1, flan-t5): config, model, HF I/O."""
