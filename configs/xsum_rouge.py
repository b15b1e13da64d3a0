r"""Summarization GRPO with a ROUGE reward: XSum documents -> one-sentence summaries.

    python -m grpo_jax.main --config=configs/xsum_rouge.py --workdir=/tmp/xsum \
        --config.data.train_path=/path/xsum.jsonl --config.tokenizer.path=/path/qwen_tokenizer

    model         a 2-layer width-128 Qwen3-shaped decoder from scratch, f32
    data          1000 XSum rows (jsonl: document, summary), the last 100 held out; the Qwen2 BPE
                  tokenizer; plain prompts; reward 0.7 x ROUGE + 0.3 x length similarity
    batch x G     8 prompts x 4 completions; all at once
    lengths       prompt 160 (documents keep their end), completion 40 tokens
    lr            2e-4, no warmup, cosine to 0; no weight decay, grad-norm clip 1.0; SFT 2e-3
    beta          0 (no reference model)
    steps         300 SFT steps (batch 16), then 40 GRPO steps
    mesh / chips  data parallel over the CPU's devices (the default mesh)

The pipeline of the summarization recipes on a CPU budget: a small decoder from scratch with
the Qwen2 BPE tokenizer (vocab.json + merges.txt), a supervised warm start on the reference
summaries, then GRPO with ROUGE (mean of ROUGE-1/2/L F1) plus a length-similarity reward
(weights below), evaluated with ROUGE-1/2/L on held-out rows before and after each stage
(summary.json, eval/rouge*/greedy). Rows: an XSum-style jsonl (document, summary); the last
`data.heldout_rows` rows are the eval split. The defaults read the 1000 XSum rows and the
tokenizer from ../shared/data next to the repository when those exist.

A 2-layer model trained from scratch on 900 rows does not write good summaries: what this
shows is the pipeline and a measured ROUGE change (see README.md's Results). For a real run,
set model.hf_path to a pretrained checkpoint (and its preset/dtypes) and the full XSum train
split.
"""

import os

from configs import common

_SHARED = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data"
)


def _shared(*parts):
  p = os.path.normpath(os.path.join(_SHARED, *parts))
  return p if os.path.exists(p) else ""


def get_config():
  c = common.base()
  # A from-scratch decoder small enough for a CPU budget (qwen3-0.6b's architecture: q/k
  # norms, GQA, tied embeddings), f32 throughout.
  c.model.preset = "tiny"
  c.model.vocab_size = 151680  # the Qwen2 BPE vocabulary (151643 + specials), padded
  c.model.hidden_size = 128
  c.model.intermediate_size = 384
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 32
  c.model.max_position_embeddings = 256  # 160 + 40 tokens per row
  c.model.rope_theta = 10000.0  # Qwen3's 1e6 is for long contexts

  c.tokenizer.path = _shared("qwen_tokenizer")  # vocab.json + merges.txt
  c.data.train_source = "xsum"
  c.data.train_path = _shared("summarization", "xsum", "test_1000.jsonl")
  c.data.heldout_rows = 100  # one file of rows: its last 100 are the eval split
  c.data.template = "plain"  # a from-scratch model knows no chat markup
  c.data.system_prompt = "none"
  c.max_prompt_length = 160
  c.data.overlong_prompts = "truncate"  # long documents are cut, keeping their end
  c.max_completion_length = 40  # XSum summaries: ~20-25 words

  # Supervised warm start on the reference summaries (no accuracy to stop at: ROUGE is the
  # metric).
  c.sft_steps = 300
  c.sft.learning_rate = 2e-3
  c.sft.batch_size = 16

  c.num_steps = 40
  c.num_generations = 4
  c.beta = 0.0  # no KL term, so no reference model to build and run on the CPU
  # Sample the policy's own distribution: no temperature, no top-k truncation.
  c.rollout.temperature = 1.0
  c.rollout.top_k = 0
  # A from-scratch model takes large steps: no warmup, no weight decay, gradients clipped at
  # norm 1.
  c.optimizer.learning_rate = 2e-4
  c.optimizer.warmup_ratio = 0.0
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0
  c.reward.functions = ("rouge", "length_similarity")
  c.reward.weights = (0.7, 0.3)

  c.eval.generation_configs = ("greedy",)  # a deterministic ROUGE to compare runs by
  c.eval.batch_size = 100  # the 100 held-out rows in one batch
  c.log_interval_steps = 10
  c.save_interval_steps = 20
  c.checkpoint.max_to_keep = 2  # a demo's workdir stays small
  c.report_at_end = True  # WORKDIR/report/report.md with plots
  return c
