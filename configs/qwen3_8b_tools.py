r"""GRPO on GSM8K with Qwen3-8B calling a python tool in Qwen's (Hermes) format: configs/qwen3_8b.py
plus multi-turn rollouts.

    python -m grpo_jax.main --config=configs/qwen3_8b_tools.py --workdir=/tmp/qwen3_8b_tools \
        --config.model.hf_path=/path/to/Qwen3-8B --config.data.train_path=/path/gsm8k/train.jsonl \
        --config.data.eval_path=/path/gsm8k/test.jsonl

    as qwen3_8b.py, except:
    tools         python (rollout.tools.names): the model writes <tool_call>{"name": "python",
                  "arguments": {"code": ...}}</tool_call><|im_end|>; the row pauses, the code's
                  output comes back as Qwen's tool turn (<|im_start|>user <tool_response> ...
                  </tool_response><|im_end|> <|im_start|>assistant), at most 256 tokens of it,
                  and the row continues; at most 4 model turns per completion
    lengths       completion 1536 tokens (1024 + 512 for the tool turns: calls and responses
                  count against the completion's budget); tool-response tokens are context
                  (mask 0: no loss on them)
    rollout       the slot engine (rollout.slots = 16 = batch 8 x G 2 rows): a row that calls a
                  tool pauses and resumes in its own slot, which the lockstep sampler cannot do
    rewards       the 4 GSM8K rewards score the completion's whole text; a TRL-style function
                  (reward.custom_function) gets [assistant, tool, assistant, ...] messages for
                  chat-message prompts (rewards/conversation.py)
"""

from configs import qwen3_8b


def get_config():
  c = qwen3_8b.get_config()

  c.rollout.tools.names = "python"  # rollout/tools: the sandboxed python builtin
  c.rollout.max_turns = 4  # model turns per completion: up to 3 tool calls and an answer
  # A long traceback or print loop is cut here, so one response cannot use up the completion.
  c.rollout.max_tool_response_tokens = 256
  # The model's own tokens as before, plus room for the calls and their (cut) responses.
  c.max_completion_length = 1024 + 512
  # Tools need the slot engine: one slot per row of a step (batch_size x num_generations).
  c.rollout.slots = c.batch_size * c.num_generations
  return c
