r"""Summarization GRPO with an encoder-decoder policy: configs/xsum_rouge.py's task on a T5.

    python -m grpo_jax.main --config=configs/xsum_t5.py --workdir=/tmp/xsum_t5

The document is the encoder's input and the summary the decoder's output (model.family="t5",
grpo_jax/models/t5/model.py); everything else is xsum_rouge.py's pipeline: the Qwen2 BPE tokenizer,
the 1000 XSum rows from ../shared/data (the last 100 held out), a supervised warm start on the
reference summaries, then GRPO with ROUGE (mean of ROUGE-1/2/L F1) plus a length-similarity
reward, evaluated with ROUGE-1/2/L on the held-out rows before SFT, before GRPO and after
(summary.json: eval_initial, eval_before, eval_after; report/report.md).

The model is a small T5 v1.1 from scratch (2 encoder + 2 decoder layers, d_model 128, gated
GELU, tied head): the figures are in README.md's Results (a from-scratch model on 900 rows
shows the pipeline and a measured ROUGE change, not a summarizer). For a real flan-t5 run:

    --config.model.hf_path=/path/to/flan-t5-base --config.tokenizer.path=/path/to/flan-t5-base
        --config.sft.learning_rate=1e-4 --config.optimizer.learning_rate=1e-5

(the folder's config.json then fixes the shape, and its tokenizer.json the vocabulary; the
decoder start token comes from config.json; use the full XSum train split for a real run).
"""
from configs import xsum_rouge


def get_config():
  c = xsum_rouge.get_config()
  c.model.family = "t5"
  c.model.preset = "t5-small-scratch"
  c.model.vocab_size = 151680  # the Qwen2 BPE vocabulary (151643 + specials), padded
  c.model.hidden_size = 128  # d_model
  c.model.num_layers = 2  # encoder layers
  c.model.num_heads = 4
  c.model.rms_norm_eps = 1e-6
  c.model.tie_embeddings = True
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"
  c.model.remat_policy = "none"
  c.model.t5.d_kv = 32
  c.model.t5.d_ff = 384
  c.model.t5.num_decoder_layers = 2
  c.model.t5.relative_attention_num_buckets = 32
  c.model.t5.relative_attention_max_distance = 128
  c.model.t5.feed_forward_proj = "gated-gelu"
  c.model.t5.scale_decoder_outputs = None  # = tie_embeddings: unit-scale initial logits
  # The Qwen2 tokenizer's <|endoftext|> (its pad) starts every summary, as T5 starts with pad;
  # <|im_end|> is its eos. Only the exported config.json reads pad/eos (sampling uses the
  # tokenizer's).
  c.model.t5.decoder_start_token_id = 151643
  c.model.t5.pad_token_id = 151643
  c.model.t5.eos_token_id = 151645
  return c
