r"""The CPU demo: GRPO teaches a tiny random-init Qwen3-architecture model 2-digit addition.

    python -m grpo_jax.main --config=configs/tiny.py

    model         a 0.4M-parameter Qwen3-shaped decoder from scratch (2 layers, width 128), f32
    data          generated 2-digit additions ("99+99="), plain prompts, the char tokenizer;
                  exact-answer reward + 0.1 x format reward
    batch x G     32 prompts x 8 completions; micro-batch 32
    lengths       prompt 6, completion 7 tokens; temperature 1.0, no top-k
    lr            5e-4, no warmup, cosine to 0; no weight decay, grad-norm clip 1.0; SFT 1e-3
    beta          0 (no reference model)
    steps         up to 1500 SFT steps (until 25% held-out accuracy), then 1200 GRPO steps
    mesh / chips  data parallel over the CPU's devices (the default mesh)

A 0.4M-parameter decoder with the character tokenizer gets a short supervised warm start on a
small fraction of demonstrations (to ~20-40% held-out accuracy), then GRPO with an exact-answer
reward lifts greedy accuracy on the held-out split (see summary.json; the measured accuracies
and wall times per seed: README.md, "Results").
"""

from configs import common


def get_config():
  c = common.base()
  # A random-init model small enough to train on a CPU in minutes, with the qwen3-0.6b
  # preset's architecture (q/k norms, GQA, tied embeddings); f32 throughout.
  c.model.preset = "tiny"
  c.model.vocab_size = 96  # the char tokenizer's vocabulary
  c.model.hidden_size = 128
  c.model.intermediate_size = 384
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 32
  c.model.max_position_embeddings = 64  # rows are 13 tokens
  c.model.rope_theta = 10000.0  # Qwen3's 1e6 is for long contexts

  # The synthetic task: no files to download, a character vocabulary, prompts without chat
  # markup or a system prompt.
  c.tokenizer.kind = "char"
  c.data.train_source = "arithmetic"
  c.data.eval_source = "arithmetic"
  c.data.template = "plain"
  c.data.system_prompt = "none"
  c.max_prompt_length = 6  # "99+99="
  c.max_completion_length = 7  # "<answer>198</answer><eos>" is 6 tokens

  # Supervised warm start until ~25% held-out accuracy: enough signal for GRPO's groups.
  c.sft_steps = 1500
  c.sft.learning_rate = 1e-3
  c.sft.stop_at_accuracy = 0.25

  c.num_steps = 1200
  c.batch_size = 32
  c.num_generations = 8  # at ~25% accuracy a group of 8 is all wrong 10% of the time (2: 56%)
  c.beta = 0.0  # no KL term, so no reference model to build and run on the CPU
  # The update accumulates over micro-batches of 32 rows (~400 tokens): exactly the same
  # gradients, ~10% faster on CPU than all 256 rows at once (benchmarks/grpo_step.py).
  c.micro_batch_size = 32
  # Sample the policy's own distribution: no temperature, no top-k truncation.
  c.rollout.temperature = 1.0
  c.rollout.top_k = 0
  # A from-scratch model takes large steps: learning rate 5e-4 without warmup, no weight decay,
  # gradients clipped at norm 1.
  c.optimizer.learning_rate = 5e-4
  c.optimizer.warmup_ratio = 0.0
  c.optimizer.weight_decay = 0.0
  c.optimizer.max_grad_norm = 1.0
  # Exact answer, plus a small bonus for a well-formed, terminated `<answer>N</answer>`.
  c.reward.functions = ("answer_match", "answer_format")
  c.reward.weights = (1.0, 0.1)

  c.eval.generation_configs = ("greedy",)  # a deterministic accuracy to compare runs by
  c.eval.batch_size = 256  # the whole 256-problem test split in one batch
  c.log_interval_steps = 50  # 1200 fast steps: a log line every 50
  c.save_interval_steps = 200
  c.checkpoint.max_to_keep = 2  # a demo's workdir stays small
  c.report_at_end = True  # WORKDIR/report/report.md with plots
  return c
