"""Tool turns: what the slot engine asks when a row stops (rollout/slots.py's `turns`).

    turns = ToolTurns(toolset, formats.get("hermes"), tokenizer, max_turns=4,
                      max_response_tokens=256)
    engine = SlotEngine(..., turns=turns, max_append=256)

A row stops at a stop token. If the turn it just ended (its tokens since the last response)
holds tool calls in the format (`<tool_call>{json}</tool_call>`, the turn ending at
`fmt.turn_end`: `<|im_end|>` in Qwen's chatml, `</tool_call>` in the plain format), and the
row has turns left (`max_turns` counts the model's turns), the calls go to the ToolRunner
(threads; rollout/tools/runner.py: timeouts, errors and hostile arguments come back as error
text, never raise) and the row waits, paused in its slot. When its results are back,
`ready` renders them as the format's response turn (`fmt.response_text`), tokenizes that text
alone (the row's own tokens are never re-tokenized: tokens in, tokens out), cuts the results'
text until it fits `max_response_tokens`, and hands the ids to the engine, which appends them
at the row's position (tool_mask 1: context, not trained) and lets the row go on.

Several processes: the engine's first process runs the tools (`runs_tools`); the others parse
the same turns (the same decisions) and receive the responses from it (SlotEngine._agree).
"""

import collections
import time

import numpy as np

from grpo_jax.rollout.tools import formats
from grpo_jax.rollout.tools import loader
from grpo_jax.rollout.tools.runner import ToolRunner


def system_prompt(config, base: str) -> str:
  """The prompts' system turn with rollout.tools: the format's tool block after `base` (Qwen's
  text, as its chat template renders `tools`: tests/rollout/test_tools.py), so the policy is
  told its tools' schemas; without tools, or in the plain format (the demo learns its one tool
  from SFT traces), `base` as it is."""
  tools = config.rollout.tools
  toolset = loader.load_tools(tools.file, tools.names)
  fmt = formats.get(tools.format)
  if toolset is None or not fmt.system:
    return base
  return fmt.system_block(toolset.schemas(), base)


class ToolTurns:
  """The multi-turn policy of the slot engine: which stopped rows call tools, their responses."""

  def __init__(
      self,
      toolset,
      fmt,
      tokenizer,
      *,
      max_turns: int,
      max_response_tokens: int,
      timeout_sec: float = 10.0,
      workers: int = 8,
      runs_tools: bool = True,
  ):
    if max_turns < 1 or max_response_tokens < 1:
      raise ValueError("max_turns and max_response_tokens must be >= 1")
    self.toolset, self.fmt, self.tokenizer = toolset, fmt, tokenizer
    self.max_turns, self.max_response_tokens = int(max_turns), int(max_response_tokens)
    self.runner = (
        ToolRunner(toolset, timeout_sec=timeout_sec, max_workers=workers) if runs_tools else None
    )
    self._turns = collections.Counter()  # row -> responses appended so far
    self._handles = {}  # row -> the ToolHandle of its running calls
    self._figures = collections.Counter()
    self._ids = {}  # the tokens a turn's end and a call's start are, when one token each

  def reset(self):
    """A new generation: rows in flight are forgotten (their calls' results are dropped)."""
    self._turns.clear()
    self._handles.clear()

  def stopped(self, row: int, turn_tokens) -> bool:
    """Row `row` stopped after `turn_tokens` (its turn so far, the stop token last). True: its
    tool calls started and the row waits for them; False: the row is done."""
    text = self.tokenizer.decode(list(map(int, turn_tokens)), skip_special=False)
    if self.fmt.call_open not in text:
      return False
    calls = self.fmt.parse_calls(text)
    if not calls:
      return False
    if self._turns[row] + 1 >= self.max_turns:
      self._figures["turn_limit"] += 1  # a call the row has no turn left to read
      return False
    self._turns[row] += 1
    if self.runner is not None:
      self._handles[row] = self.runner.submit(row, calls)
    return True

  def ready(self, block: bool = False) -> dict:
    """{row: the response's token ids} for the calls that are done (at least one when
    `block`; the others' processes get theirs from the first process)."""
    if self.runner is None or not self._handles:
      return {}
    done = [r for r, h in self._handles.items() if h.ready()]
    while block and not done:
      time.sleep(0.002)
      done = [r for r, h in self._handles.items() if h.ready()]
    out = {}
    for row in done:
      handle = self._handles.pop(row)
      out[row] = self._encode([r.text for r in handle.results])
    return out

  def finish(self, row: int):
    """Row `row` is done: its stateful tools are released; its turn count is logged."""
    turns = self._turns.pop(row, 0)
    self._handles.pop(row, None)
    self._figures["rows"] += 1
    self._figures["turns"] += turns + 1
    self._figures["rows_calling"] += turns > 0
    if self.runner is not None:
      self.runner.finish(row)

  def stats(self, reduce=None) -> dict[str, float]:
    """Since the last call: the runner's per-tool counters (tool_call/<name>/calls, errors,
    timeouts, seconds), turns per row and the share of rows that called a tool. reduce: sums
    the counters over processes (multihost.sum_over_processes, a collective every process
    calls) when each runs its own rows' tools (the vLLM engine)."""
    f, self._figures = self._figures, collections.Counter()
    counts = {}
    if self.runner is not None:
      counts = self.runner.stats()
      self.runner.reset_stats()
    if reduce is not None:
      keys = ("rows", "turns", "rows_calling", "turn_limit")
      total = reduce(np.array([f[k] for k in keys] + list(counts.values()), np.float64))
      f = dict(zip(keys, total[: len(keys)]))
      counts = dict(zip(counts, (float(x) for x in total[len(keys) :])))
    rows = max(1, f["rows"])
    out = {
        "tool_call/turns_per_row": f["turns"] / rows,
        "tool_call/row_fraction": f["rows_calling"] / rows,
        "tool_call/turn_limit": float(f["turn_limit"]),
    }
    out.update(counts)
    return out

  def close(self):
    if self.runner is not None:
      self.runner.close()

  # ----------------------------------------------------------------------------- internals

  def _encode(self, results: list[str]) -> list[int]:
    """The response turn's token ids, its results' text cut (marked "...") until it fits."""
    budget = self.max_response_tokens
    ids = self._tokens(self.fmt.response_text(results))
    keep = max(len(r) for r in results) if results else 0
    while len(ids) > budget and keep > 0:
      keep //= 2
      cut = [r if len(r) <= keep else r[:keep] + "..." for r in results]
      ids = self._tokens(self.fmt.response_text(cut))
    return ids[:budget]

  def _tokens(self, text: str) -> list[int]:
    """Token ids of `text`; characters a char-level vocabulary lacks become "?"."""
    try:
      return list(self.tokenizer.encode(text))
    except ValueError:
      known = getattr(self.tokenizer, "stoi", None)
      if known is None:
        raise
      return list(self.tokenizer.encode("".join(c if c in known else "?" for c in text)))
