r"""Summarization GRPO with an encoder-decoder policy: configs/xsum_rouge.py's task on a T5.

    python -m grpo_jax.main --config=configs/xsum_t5.py --workdir=/tmp/xsum_t5

    model         a T5 v1.1 from scratch: 2 encoder + 2 decoder layers, d_model 128, 4 heads of
                  32, MLP 384 (gated GELU), tied head; f32
    data          1000 XSum rows (jsonl: document, summary), the last 100 held out; the Qwen2 BPE
                  tokenizer; reward 0.7 x ROUGE + 0.3 x length similarity
    batch x G     8 prompts x 4 completions; all at once
    lengths       prompt 160 (the encoder's input), completion 40 tokens
    lr            2e-4, no warmup, cosine to 0; no weight decay, grad-norm clip 1.0; SFT 2e-3
    beta          0 (no reference model)
    steps         300 SFT steps (batch 16), then 40 GRPO steps
    mesh / chips  data parallel over the CPU's devices (the default mesh)

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
  c.model.family = "t5"  # the encoder-decoder policy: the point of this config
  c.pack_sequences = False  # packed rows are decoder-only (rl/packing.py)
  c.model.preset = "t5-small-scratch"
  # The T5's shape in the decoder fields that a T5 reads (configs/common.py, model.family);
  # the same values as xsum_rouge.py's decoder, stated here for what they mean to a T5.
  c.model.vocab_size = 151680  # the Qwen2 BPE vocabulary (151643 + specials), padded
  c.model.hidden_size = 128  # d_model
  c.model.num_layers = 2  # encoder layers
  c.model.num_heads = 4
  c.model.t5.d_kv = 32  # head dim: d_model / num_heads
  c.model.t5.d_ff = 384
  c.model.t5.num_decoder_layers = 2
  # The Qwen2 tokenizer's <|endoftext|> (its pad) starts every summary, as T5 starts with pad;
  # <|im_end|> is its eos. Only the exported config.json reads pad/eos (sampling uses the
  # tokenizer's).
  c.model.t5.decoder_start_token_id = 151643
  c.model.t5.pad_token_id = 151643
  c.model.t5.eos_token_id = 151645
  return c
