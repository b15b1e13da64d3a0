"""A synthetic verifiable task for the CPU demo: arithmetic problems like "12+30=".

Difficulty: `digits` per operand (`digits2` > 0: the operands after the first have that many,
e.g. 3-digit x 2-digit) and `num_ops` operations (from `ops`, e.g. "+-*"). Problems
are drawn deterministically from a seed. The held-out test split is fixed by the seed and
disjoint from train: a problem's split is decided by a hash of its text, so no test problem
ever appears in the train rows, whatever the sizes asked for.

Rows follow the dataset row shape (datasets.py): prompt "12+30=", ground_truth "42",
data_source "arithmetic", and a demonstration in the chosen style:
  "answer"    -> "<answer>42</answer>"
  "reasoning" -> "<reasoning>12+30=42</reasoning><answer>42</answer>"
  "working"   -> "<reasoning>12+30=42 42+7=49</reasoning><answer>49</answer>": one partial
                 result per operation, left to right (ops "+" and "-" only, where left to right
                 is the value)
  "tool"      -> '<tool_call>{"name": "calculator", "arguments": {"expression": "12+30"}}'
                 '</tool_call><tool_response>42</tool_response><answer>42</answer>': the
                 calculator called in the "plain" tool format (json.dumps of the call); the
                 response span is context, which SFT does not train on (data/tool_traces.py).
                 Needs the char_tools tokenizer (configs/tiny_tools.py).
Answers are integers, checkable by the GSM8K-style rewards (answer_match, check_answer).

Long-tailed lengths (`max_ops` > num_ops): each problem's operation count is num_ops + k with
k geometric (P(k) = 2^-(k+1), cut at max_ops): half the problems have num_ops operations, one in
2^(max_ops - num_ops) the most. With the "working" demonstration a policy's completion grows
with the count, so a batch's completions are long-tailed like real reasoning traces (the slot
engine's loop benchmark, benchmarks/streaming_loop.py).
"""

import hashlib
import json

import numpy as np

_TEST_PERCENT = 10  # share of the problem space reserved for the test split (by hash)


def _evaluate(operands, ops) -> int:
  value = operands[0]
  text = str(operands[0])
  for o, x in zip(ops, operands[1:]):
    text += f"{o}{x}"
  # Python's own precedence (* before + and -), integers only.
  value = eval(text, {"__builtins__": {}})  # noqa: S307 - digits and + - * only
  return int(value), text


def _is_test(text: str, seed: int) -> bool:
  h = hashlib.sha256(f"{seed}:{text}".encode()).digest()
  return h[0] * 100 // 256 < _TEST_PERCENT


def make_problem(rng: np.random.Generator, digits: int, num_ops: int, ops: str, digits2: int = 0):
  """digits2 > 0: the operands after the first have digits2 digits (same draws as digits2=0)."""
  highs = [10**digits] + [10 ** (digits2 or digits)] * num_ops
  operands = [int(rng.integers(0, hi)) for hi in highs]
  chosen = [ops[int(rng.integers(0, len(ops)))] for _ in range(num_ops)]
  return _evaluate(operands, chosen)


def _working(text: str, answer: int) -> str:
  tokens = text.replace("-", " - ").replace("+", " + ").split()
  steps, value = [], int(tokens[0])
  for op, x in zip(tokens[1::2], tokens[2::2]):
    new = value + int(x) if op == "+" else value - int(x)
    steps.append(f"{value}{op}{x}={new}")
    value = new
  return f"<reasoning>{' '.join(steps)}</reasoning><answer>{answer}</answer>"


def _tool(text: str, answer: int) -> str:
  call = json.dumps({"name": "calculator", "arguments": {"expression": text}})
  return (
      f"<tool_call>{call}</tool_call><tool_response>{answer}</tool_response>"
      f"<answer>{answer}</answer>"
  )


# config.data.arithmetic.demonstration -> the SFT target for (expression, answer).
DEMONSTRATION_STYLES = {
    "answer": lambda text, answer: f"<answer>{answer}</answer>",
    "reasoning": lambda text, answer: (
        f"<reasoning>{text}={answer}</reasoning>" f"<answer>{answer}</answer>"
    ),
    "working": _working,
    "tool": _tool,
}


def demonstration(text: str, answer: int, style: str) -> str:
  if style not in DEMONSTRATION_STYLES:
    raise ValueError(
        f"unknown demonstration style {style!r}; known: " f"{', '.join(DEMONSTRATION_STYLES)}"
    )
  return DEMONSTRATION_STYLES[style](text, answer)


def arithmetic_rows(
    n: int,
    *,
    split: str,
    seed: int = 0,
    digits: int = 2,
    num_ops: int = 1,
    ops: str = "+",
    style: str = "answer",
    max_ops: int = 0,
    digits2: int = 0,
) -> list[dict]:
  """`n` distinct problems of the `split` ("train" or "test"); deterministic for the seed.

  When the problem space is too small for n distinct problems of the split, all of them are
  returned (e.g. 1-digit addition has only 100 problems).
  """
  if split not in ("train", "test"):
    raise ValueError(f"split must be 'train' or 'test', got {split!r}")
  if not ops or any(o not in "+-*" for o in ops):
    raise ValueError(f"ops must be a non-empty string of + - *, got {ops!r}")
  if style == "working" and "*" in ops:
    raise ValueError(
        f"demonstration 'working' goes left to right: ops '+' and '-' only, got {ops!r}"
    )
  if max_ops and max_ops < num_ops:
    raise ValueError(f"max_ops={max_ops} < num_ops={num_ops}: use 0 (fixed) or >= num_ops")
  want_test = split == "test"
  rng = np.random.default_rng([seed, 0 if want_test else 1])
  seen, rows = set(), []
  misses = 0  # consecutive draws that gave nothing new: many means the space is exhausted
  while len(rows) < n and misses < 2000:
    count = num_ops
    if max_ops > num_ops:
      count = min(max_ops, num_ops + int(rng.geometric(0.5)) - 1)
    answer, text = make_problem(rng, digits, count, ops, digits2)
    if text in seen or _is_test(text, seed) != want_test:
      misses += 1
      continue
    misses = 0
    seen.add(text)
    rows.append(
        dict(
            prompt=f"{text}=",
            ground_truth=str(answer),
            data_source="arithmetic",
            extra_info={"expression": text},
            demonstration=demonstration(text, answer, style),
        )
    )
  return rows
