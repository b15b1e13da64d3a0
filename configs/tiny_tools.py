r"""The CPU tool demo: a tiny model learns to call a calculator for 3-digit x 2-digit products.

    python -m grpo_jax.main --config=configs/tiny_tools.py                           # with the tool
    python -m grpo_jax.main --config=configs/tiny_tools.py --config.rollout.tools.names=  # without

    model         configs/tiny.py's 0.4M-parameter Qwen3-shaped decoder (2 layers, width 128), f32,
                  over the char_tools vocabulary (the char tokenizer + the 4 tool markers and {})
    data          generated products "123*45=", plain prompts; exact-answer reward + 0.1 x format
    tools         calculator in the plain format: the model writes
                  <tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>,
                  the row pauses in its slot, <tool_response>5535</tool_response> is appended
                  (context: no loss on it), and the row continues to <answer>5535</answer>
    SFT           traces that call the tool (data.arithmetic.demonstration="tool"); with
                  rollout.tools.names="" the same config's traces answer directly
                  (<answer>5535</answer>): the same model and budget without the tool
    GRPO          the slot engine (a row per slot), at most 2 model turns per row

A 2-layer model cannot multiply 3 digits by 2 in its head, but it can learn to copy the operands
into a call and the tool's result into its answer: README.md's "Tools" table has the held-out
accuracies with and without the tool (3 seeds), and the report the tool-call and error rates.
"""

from configs import tiny


def get_config():
  c = tiny.get_config()
  c.tokenizer.kind = "char_tools"
  c.model.vocab_size = 102  # char_tools: the char vocabulary + <tool_call> ... </tool_response>, {}
  c.model.max_position_embeddings = 96  # rows are 7 + 80 tokens

  c.data.arithmetic.digits = 3
  c.data.arithmetic.digits2 = 2
  c.data.arithmetic.ops = "*"
  c.data.arithmetic.num_ops = 1
  c.data.arithmetic.demonstration = "tool"  # "answer" when rollout.tools.names is ""
  c.max_prompt_length = 7  # "123*45="
  # The call (~62 tokens), the response (<= 8), the answer (<= 9) and <eos>.
  c.max_completion_length = 80

  c.rollout.tools.names = "calculator"
  c.rollout.tools.format = "plain"
  c.rollout.max_turns = 2  # one call, then the answer
  c.rollout.max_tool_response_tokens = 8
  c.rollout.slots = c.batch_size * c.num_generations  # a row per slot: paused rows keep theirs

  c.sft_steps = 300
  c.sft.stop_at_accuracy = 0.0  # the same SFT budget with and without the tool
  c.num_steps = 60
  c.log_interval_steps = 10
  c.save_interval_steps = 30
  c.eval.generation_configs = ("greedy",)
  return c
