"""Multi-turn completions (a tool's responses inside) in the forms reward functions read.

    turns = conversation.build(tokenizer, prompts_n, rows_n, tokens_nc, mask_nc, tool_nc)
    result = reward_computer.score_turns(turns, rows_n)     # rewards/computer.py

A completion row of a rollout with tools holds model runs (tool_nc 0) and tool runs (tool_nc 1:
the response tokens the engine appended). Each kind of reward function reads it its own way:

  TRL-style functions (reward.custom_function), as TRL's GRPOTrainer passes them: a row whose
    prompt is a list of chat messages gets that list as its prompt and the completion as
    messages, one per run, `[{"role": "assistant", "content": <model run 1>}, {"role": "tool",
    "content": <response 1>}, {"role": "assistant", ...}, ...]` (so `completion[0]["content"]`
    is the first assistant turn, as `trl.rewards.think_format_reward` reads it); a string
    prompt gets the rendered prompt and the completion's whole text (model and tool tokens).
  verl's compute_score (reward.custom_file, and the builtin verl_default): the final answer,
    the text of the last model run, as `solution_str`.
  the other built-in functions: the rendered prompt and the whole text, as without tools.

Model runs decode as completions always have (`skip_special=True`); tool runs decode with
their markup and `tool_contents` takes each response's content out of its wrapper (the plain
format's `<tool_response>..</tool_response>`, Qwen's Hermes turn around them), one tool message
per response.
"""

import dataclasses
import re

import numpy as np

_RESPONSE = re.compile(r"<tool_response>\n?(.*?)\n?</tool_response>", re.DOTALL)
# A response cut before its closing marker: what comes before its content.
_OPENING = re.compile(r"^.*?<tool_response>\n?", re.DOTALL)


def tool_contents(text: str) -> list[str]:
  """The responses in a tool run's text (markup kept), without their wrappers: one string per
  `<tool_response>`; text without that marker is one response, stripped of whitespace.

  The one place that knows the formats' wrappers: plain `<tool_response>R</tool_response>`, and
  Qwen's `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\nR\\n</tool_response><|im_end|>\\n
  <|im_start|>assistant\\n` (several responses in one user turn, joined by `\\n`)."""
  found = _RESPONSE.findall(text)
  if found:
    return found
  return [_OPENING.sub("", text, count=1).strip()]


@dataclasses.dataclass
class Turns:
  """One batch's completions, as each kind of reward function reads them (lists of N)."""

  prompts: list  # the rendered prompt texts
  texts: list[str]  # each completion's whole text: model and tool tokens
  answers: list[str]  # the last model run's text: compute_score's solution_str
  trl_prompts: list  # chat messages where the row's prompt is a conversation, else the text
  trl_completions: list  # message lists where the row's prompt is a conversation, else text


def runs(tool_c, keep_c) -> list[tuple[bool, np.ndarray]]:
  """(is_tool, positions) of the row's kept tokens (keep_c > 0), split where tool_c changes."""
  pos = np.flatnonzero(np.asarray(keep_c) > 0)
  if not pos.size:
    return []
  flag = np.asarray(tool_c)[pos] > 0
  # A new run where the flag changes (a gap in positions does not start one).
  cut = np.flatnonzero(flag[1:] != flag[:-1]) + 1
  return [(bool(f[0]), p) for f, p in zip(np.split(flag, cut), np.split(pos, cut))]


def messages(tokenizer, tokens_c, row_runs) -> list[dict]:
  """The completion as TRL's message list: assistant runs and tool responses in order."""
  out = []
  for is_tool, pos in row_runs:
    ids = np.asarray(tokens_c)[pos].tolist()
    if is_tool:
      for content in tool_contents(tokenizer.decode(ids, skip_special=False)):
        out.append({"role": "tool", "content": content})
    else:
      out.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special=True)})
  return out


def build(tokenizer, prompts, rows, tokens_nc, mask_nc, tool_nc) -> Turns:
  """Turns of N completions: tokens_nc int [N, C]; mask_nc [N, C] the completion mask; tool_nc
  [N, C] 1 on tool-response tokens (a row's tokens are those of mask or tool, so the mask may
  count the tool tokens or not); prompts: the N rendered prompts; rows: the N dataset rows."""
  tokens_nc, tool_nc = np.asarray(tokens_nc), np.asarray(tool_nc)
  keep_nc = (np.asarray(mask_nc) > 0) | (tool_nc > 0)
  texts, answers, trl_prompts, trl_completions = [], [], [], []
  for i, row in enumerate(rows):
    row_runs = runs(tool_nc[i], keep_nc[i])
    text = tokenizer.decode(tokens_nc[i][keep_nc[i]].tolist(), skip_special=True)
    model = [p for is_tool, p in row_runs if not is_tool]
    answer = tokenizer.decode(tokens_nc[i][model[-1]].tolist(), skip_special=True) if model else ""
    conversational = isinstance(row.get("prompt"), list)
    texts.append(text)
    answers.append(answer)
    trl_prompts.append(row["prompt"] if conversational else prompts[i])
    trl_completions.append(messages(tokenizer, tokens_nc[i], row_runs) if conversational else text)
  return Turns(list(prompts), texts, answers, trl_prompts, trl_completions)
