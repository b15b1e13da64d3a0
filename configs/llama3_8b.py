r"""GRPO on GSM8K with Llama-3.1-8B-Instruct (f32 master weights, bf16 compute), prompts in the
model's own chat format.

    python -m grpo_jax.main --config=configs/llama3_8b.py --workdir=/tmp/llama3_8b \
        --config.model.hf_path=/path/to/Llama-3.1-8B-Instruct --config.data.train_path=... \
        --config.data.eval_path=...

    model         Llama-3.1-8B-Instruct (model.hf_path); f32 weights + AdamW moments, bf16
                  compute, remat full, scanned layers
    data          GSM8K (jsonl), the folder's chat template with the reasoning system prompt;
                  4 GSM8K rewards
    batch x G     8 prompts x 2 completions; micro-batch 8
    lengths       prompt 256, completion 1024 tokens; temperature 0.9, top-k 50
    lr            3e-6, 10% warmup then cosine to 0; AdamW (0.9, 0.99), wd 0.1, grad-norm clip 0.1
    beta          0.08 (k3 KL), clip eps 0.2, one iteration per batch
    steps         200; eval every 50 on 512 examples; checkpoints every 500, 4 kept
    mesh / chips  FSDP over all chips of one host (data=1, fsdp=-1): TPU v5p-8 or 8xH100

Everything but the model and the prompt format is configs/qwen3_8b.py's.
data.template="tokenizer" renders prompts with the chat template Llama-3.1-8B-Instruct ships in
its tokenizer_config.json, as transformers' apply_chat_template does: <|begin_of_text|>, the
system header (its knowledge-date lines, then the reasoning system prompt), the user turn and
the assistant header; completions end at <|eot_id|> (a stop id).
"""

from configs import common
from configs import qwen3_8b


def get_config():
  c = qwen3_8b.get_config()
  c.model = common.model("llama3.1-8b")  # the shape model.hf_path's config.json is checked against
  c.model.dtype = "bfloat16"  # bf16 compute; the preset's f32 param_dtype keeps f32 masters
  c.model.remat_policy = "full"  # an 8B step, as in configs/qwen3_8b.py
  c.model.scan_layers = True  # one compiled layer body for all 32: a shorter compile
  c.data.template = "tokenizer"  # Llama's own chat format, not chatml
  return c
