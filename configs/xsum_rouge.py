r"""Summarization GRPO with a ROUGE reward: XSum documents -> one-sentence summaries.

    python -m grpo_jax.main --config=configs/xsum_rouge.py --workdir=/tmp/xsum \
        --config.data.train_path=/path/xsum.jsonl --config.tokenizer.path=/path/qwen_tokenizer

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

_SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                       "shared", "data")


def _shared(*parts):
  p = os.path.normpath(os.path.join(_SHARED, *parts))
  return p if os.path.exists(p) else ""


def get_config():
  c = common.base()
  c.seed = 0
  c.model = common.model("qwen3-0.6b")
  c.model.preset = "tiny"
  c.model.vocab_size = 151680  # the Qwen2 BPE vocabulary (151643 + specials), padded
  c.model.hidden_size = 128
  c.model.intermediate_size = 384
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 32
  c.model.tie_embeddings = True
  c.model.max_position_embeddings = 256
  c.model.rope_theta = 10000.0
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"
  c.model.remat_policy = "none"
  c.model.scan_layers = False

  c.tokenizer.kind = "hf"
  c.tokenizer.path = _shared("qwen_tokenizer")
  c.data.train_source = "xsum"
  c.data.train_path = _shared("summarization", "xsum", "test_1000.jsonl")
  c.data.heldout_rows = 100
  c.data.template = "plain"
  c.data.system_prompt = "none"
  c.max_prompt_length = 160  # long documents keep their end (data.overlong_prompts)
  c.max_completion_length = 40  # XSum summaries: ~20-25 words

  c.sft_steps = 300
  c.sft.learning_rate = 2e-3
  c.sft.batch_size = 16
  c.sft.stop_at_accuracy = 0.0

  c.num_steps = 40
  c.batch_size = 8
  c.num_generations = 4
  c.beta = 0.0
  c.rollout.temperature = 1.0
  c.rollout.top_k = 0
  c.rollout.top_p = 1.0
  c.optimizer.learning_rate = 2e-4
  c.optimizer.warmup_ratio = 0.0
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0
  c.reward.functions = ("rouge", "length_similarity")
  c.reward.weights = (0.7, 0.3)

  c.eval.generation_configs = ("greedy",)
  c.eval.batch_size = 100
  c.log_interval_steps = 10
  c.save_interval_steps = 20
  c.checkpoint.max_to_keep = 2
  c.report_at_end = True  # WORKDIR/report/report.md with plots
  return c
