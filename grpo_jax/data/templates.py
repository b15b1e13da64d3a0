"""Prompt templates (Qwen ChatML, plain, the tokenizer's own) and the system prompts that ask
for a format.

`data.template` picks one, explicitly: there is no "auto". The default stays chatml (what the
Qwen recipes were tuned with); "tokenizer" uses the chat template the tokenizer folder ships
(chat_template.jinja or tokenizer_config.json's), rendered as transformers' apply_chat_template
with add_generation_prompt=True (data/chat_template.py), so prompts match the model card's
format token for token, including the defaults a template adds (Qwen2.5's default system
message, Llama 3.1's knowledge-date header). Switching on what a folder happens to contain would
change the prompts of existing configs silently.
"""

from grpo_jax.data import chat_template

REASONING_SYSTEM_PROMPT = (
    "You are given a problem. Think about the problem and provide your working out. Place it "
    "between <reasoning> and </reasoning>. Then, provide your final answer between <answer> "
    "and </answer>."
)
THINK_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think>\n...\n</think>\n<answer>\n...\n</answer>\n tags."
)
SYSTEM_PROMPTS = {"reasoning": REASONING_SYSTEM_PROMPT, "think": THINK_SYSTEM_PROMPT, "none": ""}
TEMPLATES = ("chatml", "plain", "tokenizer")


def messages_of(prompt, system_prompt: str = "") -> list[dict]:
  """A row's prompt as chat turns: a string is one user turn; the config's system prompt goes
  first unless the row's messages bring their own system turn (the row's wins)."""
  messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
  if system_prompt and not any(m["role"] == "system" for m in messages):
    messages.insert(0, {"role": "system", "content": system_prompt})
  return messages


def render_prompt(prompt, template: str = "chatml", system_prompt: str = "", tokenizer=None) -> str:
  """The text the model continues from. `prompt`: the user's text, or chat messages
  [{"role", "content"}, ...] (a string is the same as [{"role": "user", "content": it}]).

  chatml: <|im_start|>{role}\\n{content}<|im_end|>\\n per turn, then <|im_start|>assistant\\n
          (a system turn first when a system prompt is given and the messages have none)
  plain:  {system}\\n\\n{user}\\n  (or just {user} without a system prompt); only a system and
          one user turn: other messages are refused (use chatml or tokenizer)
  tokenizer: `tokenizer.chat_template` over the messages plus the generation prompt; the text
          may start with bos (the template decides), so encode it without adding special tokens
          (as every Tokenizer here does).
  """
  messages = messages_of(prompt, system_prompt)
  if template == "tokenizer":
    return _render_with_tokenizer(messages, tokenizer)
  if template == "chatml":
    return (
        "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        + "<|im_start|>assistant\n"
    )
  if template == "plain":
    roles = [m["role"] for m in messages]
    if roles not in (["user"], ["system", "user"]):
      raise ValueError(
          f"data.template='plain' renders a system turn and one user turn; this "
          f"prompt has the turns {roles}. Fix: data.template=chatml, or tokenizer "
          "(the tokenizer folder's chat template)"
      )
    system, user = (messages[0]["content"] if len(messages) == 2 else ""), messages[-1]["content"]
    return f"{system}\n\n{user}\n" if system else user
  raise ValueError(f"unknown template {template!r}; known: {', '.join(TEMPLATES)}")


def _render_with_tokenizer(messages: list[dict], tokenizer) -> str:
  if tokenizer is None or tokenizer.chat_template is None:
    why, fix = missing_template(tokenizer.path if tokenizer else "")
    raise ValueError(f"data.template='tokenizer': {why}. Fix: {fix}")
  import jinja2

  try:
    return chat_template.render(tokenizer.chat_template, messages, tokenizer.special_tokens)
  except jinja2.TemplateError as e:
    raise ValueError(
        f"the chat template of {tokenizer.path} raised {type(e).__name__}: {e}. "
        "Fix: a template that refuses a system turn needs data.system_prompt=none; "
        "else use data.template=chatml or plain"
    ) from None


def missing_template(folder: str) -> tuple[str, str]:
  """(why, fix) when data.template=tokenizer meets a tokenizer without a chat template."""
  if not folder:
    return "the char tokenizer has no chat template", "use data.template=plain or chatml"
  return (
      f"the tokenizer folder {folder} has no chat template (no chat_template.jinja, no "
      "chat_template in tokenizer_config.json)",
      "copy the model's chat_template.jinja into " "it, or use data.template=chatml or plain",
  )


def system_prompt(name: str) -> str:
  if name not in SYSTEM_PROMPTS:
    raise ValueError(f"unknown system prompt {name!r}; known: {', '.join(SYSTEM_PROMPTS)}")
  return SYSTEM_PROMPTS[name]
