"""Prompt templates (Qwen ChatML, plain) and the system prompts that ask for a format."""

REASONING_SYSTEM_PROMPT = (
    "You are given a problem. Think about the problem and provide your working out. Place it "
    "between <reasoning> and </reasoning>. Then, provide your final answer between <answer> "
    "and </answer>.")
THINK_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think>\n...\n</think>\n<answer>\n...\n</answer>\n tags.")
SYSTEM_PROMPTS = {"reasoning": REASONING_SYSTEM_PROMPT, "think": THINK_SYSTEM_PROMPT, "none": ""}
TEMPLATES = ("chatml", "plain")


def render_prompt(user: str, template: str = "chatml", system_prompt: str = "") -> str:
  """The text the model continues from.

  chatml: <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n
          <|im_start|>assistant\\n   (the system turn only when a system prompt is given)
  plain:  {system}\\n\\n{user}\\n  (or just {user} without a system prompt)
  """
  if template == "chatml":
    text = f"<|im_start|>system\n{system_prompt}<|im_end|>\n" if system_prompt else ""
    return text + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
  if template == "plain":
    return f"{system_prompt}\n\n{user}\n" if system_prompt else user
  raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")


def system_prompt(name: str) -> str:
  if name not in SYSTEM_PROMPTS:
    raise ValueError(f"unknown system prompt {name!r}; known: {', '.join(SYSTEM_PROMPTS)}")
  return SYSTEM_PROMPTS[name]
