r"""GRPO on GSM8K with Llama-3.1-8B-Instruct (f32 master weights, bf16 compute), prompts in the
model's own chat format.

    python -m grpo_jax.main --config=configs/llama3_8b.py --workdir=/tmp/llama3_8b \
        --config.model.hf_path=/path/to/Llama-3.1-8B-Instruct --config.data.train_path=... \
        --config.data.eval_path=...

data.template="tokenizer" renders prompts with the chat template Llama-3.1-8B-Instruct ships in
its tokenizer_config.json, as transformers' apply_chat_template does: <|begin_of_text|>, the
system header (its knowledge-date lines, then the reasoning system prompt), the user turn and
the assistant header; completions end at <|eot_id|> (a stop id).
"""
from configs import common
from configs import qwen3_8b


def get_config():
  c = qwen3_8b.get_config()
  c.model = common.model("llama3.1-8b")
  c.model.param_dtype = "float32"  # f32 master weights + AdamW moments; bf16 compute
  c.model.dtype = "bfloat16"
  c.model.remat_policy = "full"
  c.model.scan_layers = True
  c.data.template = "tokenizer"
  return c
