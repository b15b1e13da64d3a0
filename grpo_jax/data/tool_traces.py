"""Tool-call traces in demonstrations: which characters are context the model did not write.

    spans = context_spans(text)            # [(start, end), ...] char ranges, sorted, disjoint
    ids, context = encode_with_context(tokenizer, text)   # context[i] = 1: token i is context

A demonstration of a multi-turn rollout holds the tool's responses, which the engine appends
at rollout time (tool_mask = 1): SFT must not train on them, as GRPO does not. Two formats:

  plain   `<tool_call>{...}</tool_call><tool_response>5535</tool_response><answer>...`:
          the span is `<tool_response>` .. `</tool_response>` inclusive.
  hermes  (Qwen's chat template) the assistant turn that calls a tool ends at `<|im_end|>`; the
          tool turn that follows, `\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>`
          (more responses joined by `\\n`) `<|im_end|>\\n<|im_start|>assistant\\n`, is one
          span: from after the assistant's `<|im_end|>` through the next assistant header.

Spans separated by whitespace only are one span (whitespace between two responses is the
template's, not the model's).

`encode_with_context` tokenizes the text piecewise at the span boundaries. Each boundary sits
next to a special token (`<tool_response>`, `</tool_response>`, `<|im_end|>`), or, at the end
of a Hermes span, after `assistant\\n`, which BPE splits from text that starts with a letter,
digit, punctuation or a special token; so the ids equal those of the whole text
(tests/data/test_tool_data.py checks it with Qwen's tokenizer). The rollout engine appends the
response tokens as their own piece too, so the pieces are also what GRPO's rows hold.
"""

import re

RESPONSE_START = "<tool_response>"
RESPONSE_END = "</tool_response>"

# One tool response, with the Hermes turn around it when there is one.
_RESPONSE = re.compile(
    r"(?:\n?<\|im_start\|>user\n)?"
    + re.escape(RESPONSE_START)
    + r".*?"
    + re.escape(RESPONSE_END)
    + r"(?:<\|im_end\|>\n?(?:<\|im_start\|>assistant\n)?)?",
    re.DOTALL,
)


def context_spans(text: str) -> list[tuple[int, int]]:
  """Char ranges [start, end) of `text` that tools wrote (see the module docstring)."""
  spans = []
  for m in _RESPONSE.finditer(text):
    start, end = m.span()
    if spans and not text[spans[-1][1] : start].strip():
      spans[-1] = (spans[-1][0], end)
    else:
      spans.append((start, end))
  return spans


def encode_with_context(tokenizer, text: str) -> tuple[list[int], list[int]]:
  """(ids, context): the text's token ids and, per token, 1 when it lies in a context span."""
  ids, context, at = [], [], 0
  for start, end in context_spans(text):
    for piece, flag in ((text[at:start], 0), (text[start:end], 1)):
      if piece:
        piece_ids = tokenizer.encode(piece)
        ids += piece_ids
        context += [flag] * len(piece_ids)
    at = end
  if at < len(text):
    tail = tokenizer.encode(text[at:])
    ids += tail
    context += [0] * len(tail)
  return ids, context
