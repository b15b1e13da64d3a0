r"""Your own rows on a CPU in minutes: a tiny from-scratch model, a byte tokenizer that needs no
download, CPU-sized lengths and batches. Only the data is yours to name:

    python -m grpo_jax.main --config=configs/tiny_your_data.py --config.data.train_path=my.jsonl
    python -m grpo_jax.main --config=configs/tiny_your_data.py \
        --config.data.train_source=parquet --config.data.train_path=~/data/train.parquet
    python -m grpo_jax.main --config=configs/tiny_your_data.py \
        --config.data.train_source=hf_dataset --config.data.train_path=/data/my_saved_dataset

    model         tiny.py's 0.4M-parameter Qwen3-shaped decoder from scratch, f32, its vocabulary
                  the byte tokenizer's 257 ids
    data          data.train_source=jsonl (prompt, ground_truth, optional data_source per line;
                  parquet / hf_dataset with data.columns as README "Your data"), the train file's
                  last 32 rows held out for eval; prompts strings or chat messages, chatml, no
                  system prompt; the byte tokenizer (grpo_jax/data/byte_tokenizer: 1 byte = 1
                  token); rewards as common.py (GSM8K's: format + answer)
    batch x G     8 prompts x 4 completions; all at once
    lengths       prompt up to 1536 bytes (longer: an error naming the row; data.overlong_prompts
                  allows the cut), completion 128 bytes
    lr            5e-4, no warmup, cosine to 0; no weight decay, grad-norm clip 1.0
    beta          0 (no reference model)
    steps         10 GRPO steps, no SFT; greedy eval of the 32 held-out rows before and after
    mesh / chips  data parallel over the CPU's devices (the default mesh)

What it shows is your data flowing through the whole loop: rows read and checked (a bad row,
a prompt longer than max_prompt_length, a ground truth the scorer cannot match: one line at
start-up), prompts rendered, rollouts, rewards on your ground truths, updates, checkpoints and
the held-out eval. A from-scratch model writes bytes, not answers, so its rewards stay at their
floor (a group's completions score alike: zero advantages, `policy_loss=0` in the log): for
learning, set model.hf_path to a pretrained checkpoint folder (and
tokenizer.path to its tokenizer; model.preset, lengths and batch sizes as a recipe such as
configs/qwen3_0p6b.py). A separate eval file: --config.data.heldout_rows=0
--config.data.eval_source=jsonl --config.data.eval_path=test.jsonl. Prompts are counted in bytes
here: a real tokenizer needs about 4x fewer tokens for English text.

The tokenizer: a fresh machine has no tokenizer folder, and the char tokenizer (configs/tiny.py)
refuses any character outside its 88-character alphabet (369 of GSM8K's 8,792 questions have a
curly quote, an accent or a euro sign). A byte-level folder ships with the package instead: it
encodes any UTF-8 text, keeps the model's embedding and head at 257 rows (a 152k-token BPE
vocabulary would put 98% of this model's weights in its embedding), and is an ordinary Hugging
Face tokenizer folder (transformers' AutoTokenizer reads it, and so does the HF export).
"""

from configs import common
from configs import tiny
from grpo_jax.data import byte_tokenizer


def get_config():
  c = common.base()
  # tiny.py's decoder (qwen3-0.6b's architecture: q/k norms, GQA, tied embeddings), f32, its
  # vocabulary the byte tokenizer's.
  c.model = tiny.get_config().model
  c.model.vocab_size = byte_tokenizer.VOCAB_SIZE  # 256 bytes + <|endoftext|>
  # RoPE holds no table per position: this only bounds prompt + completion, so a larger
  # max_prompt_length needs no second override.
  c.model.max_position_embeddings = 4096

  # No file to download: the byte-level folder inside the package.
  c.tokenizer.kind = "hf"
  c.tokenizer.path = byte_tokenizer.PATH
  c.data.train_source = "jsonl"  # prompt, ground_truth (+ data_source) per line
  c.data.heldout_rows = 32  # one file: its last 32 rows are the eval split
  c.data.system_prompt = "none"  # a from-scratch model reads no instructions; bytes cost time
  # In bytes: GSM8K's longest question is 1041 in chatml. A longer prompt stops the run at
  # start-up naming the row and the value to set (data.overlong_prompts allows the cut). Train
  # steps pay for their batch's longest prompt (data.prompt_width=bucket), the eval for this.
  c.max_prompt_length = 1536
  c.max_completion_length = 128

  c.num_steps = 10
  c.batch_size = 8
  c.num_generations = 4
  c.beta = 0.0  # no KL term, so no reference model to build and run on the CPU
  # A from-scratch model takes large steps: learning rate 5e-4 without warmup, no weight decay,
  # gradients clipped at norm 1 (tiny.py's).
  c.optimizer.learning_rate = 5e-4
  c.optimizer.warmup_ratio = 0.0
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0

  c.eval.generation_configs = ("greedy",)  # one deterministic figure per eval
  c.eval.batch_size = 32  # the 32 held-out rows in one batch
  c.log_interval_steps = 5
  c.save_interval_steps = 10
  c.checkpoint.max_to_keep = 2  # a trial run's workdir stays small
  return c
