r"""Multi-turn rollouts: the slot engine's live cache vs prefilling each row's whole history
again after every tool response (what engines that resend the conversation each turn do,
without a prefix cache).

    python benchmarks/tool_turns.py            # ~1-2 min on 2 CPU cores
    python benchmarks/tool_turns.py --quick    # < 60 s (the test)
    python benchmarks/tool_turns.py --json=out.json

The task: 4 model turns per row. A random model over a small vocabulary (16 tokens) draws a
designated "call" token about once per 16 tokens (the only stop token); a row's turn ends there,
a scripted tool answers at once with R tokens, and the row goes on, until its 4th turn ends
(or its budget).
Both engines draw the same tokens with the same log-probs (tests/rollout/test_turns.py); what
differs is what each append costs: the live cache prefills the row's last token and the
response (R + 1 tokens), the baseline every slot's whole history (prompt + all turns so far).

Printed: rollout seconds per batch of each (after a warm-up run that compiles every program),
the ratio, prefill tokens per append of each, and turns per row.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from flax import nnx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpo_jax.models import PRESETS  # noqa: E402
from grpo_jax.models import build_model  # noqa: E402
from grpo_jax.rollout import GenerationConfig  # noqa: E402
from grpo_jax.rollout.slots import SlotEngine  # noqa: E402

WORKLOADS = {
    "cpu": dict(layers=4, width=256, prompt=32, completion=256, response=32, rows=32, batches=3),
    "quick": dict(layers=2, width=128, prompt=16, completion=128, response=16, rows=16, batches=2),
}
VOCAB, CALL, TURNS = 16, 3, 4


class FixedTool:
  """Every turn ending at CALL is answered at once with `response` tokens, up to TURNS turns."""

  def __init__(self, response: int):
    self.response = response
    self.reset()

  def reset(self):
    self.turns, self.waiting, self.calls, self.rows = {}, {}, 0, 0

  def stopped(self, row, turn_tokens):
    t = self.turns.get(row, 0)
    if int(turn_tokens[-1]) != CALL or t + 1 >= TURNS:
      return False
    self.turns[row] = t + 1
    self.calls += 1
    self.waiting[row] = [4 + (row + t + j) % 8 for j in range(self.response)]
    return True

  def ready(self, block=False):
    out, self.waiting = self.waiting, {}
    return out

  def finish(self, row):
    self.rows += 1
    self.turns.pop(row, None)


def run(w, reprefill: bool, seed: int):
  cfg = PRESETS["tiny-qwen3"].replace(
      vocab_size=VOCAB,
      hidden_size=w["width"],
      intermediate_size=3 * w["width"],
      num_layers=w["layers"],
      num_heads=4,
      num_kv_heads=2,
      head_dim=w["width"] // 4,
      max_position_embeddings=w["prompt"] + w["completion"] + 8,
  )
  model = build_model(cfg, seed=0)
  graphdef, state = nnx.split(model)
  tool = FixedTool(w["response"])
  e = SlotEngine(
      graphdef,
      slots=w["rows"],
      chunk=16,
      max_prompt_length=w["prompt"],
      max_new_tokens=w["completion"],
      num_generations=1,
      eos_ids=(CALL,),  # a turn ends at a call; the 4th turn's call ends the row
      turns=tool,
      max_append=w["response"],
      reprefill_turns=reprefill,
  )
  rng = np.random.default_rng(seed)
  gen = GenerationConfig(temperature=1.0)
  times, tokens, extended, calls = [], 0, 0, 0
  for b in range(w["batches"] + 1):  # the first: the warm-up (compiles)
    ids = jnp.asarray(rng.integers(4, VOCAB, (w["rows"], w["prompt"])), jnp.int32)
    mask = jnp.ones_like(ids)
    t0 = time.perf_counter()
    r = e(state, ids, mask, jax.random.key(seed * 100 + b), gen)
    jax.block_until_ready(r.tokens)
    if b:
      times.append(time.perf_counter() - t0)
      tokens += int(np.asarray(r.mask).sum())
      extended += int(e._state["extended"])
      tool_mask = np.asarray(r.tool_mask)  # appends: the tool runs of each row
      calls += int((np.diff(tool_mask, axis=1, prepend=0) == 1).sum())
  return dict(
      seconds_per_batch=float(np.mean(times)),
      prefill_tokens_per_append=extended / max(1, calls),
      turns_per_row=1 + calls / (w["batches"] * w["rows"]),  # answered calls + the last turn
      tokens=tokens,
  )


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--json", default="")
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  w = WORKLOADS["quick" if args.quick else "cpu"]
  live = run(w, reprefill=False, seed=args.seed)
  again = run(w, reprefill=True, seed=args.seed)
  assert live["tokens"] == again["tokens"], "the two engines drew different rows"
  ratio = again["seconds_per_batch"] / live["seconds_per_batch"]
  print(f"workload {w}")
  print(f"turns per row {live['turns_per_row']:.2f} (at most {TURNS}), response {w['response']}")
  for name, r in (("live cache", live), ("re-prefill", again)):
    print(
        f"{name:11s} {r['seconds_per_batch']:.3f} s/batch, "
        f"{r['prefill_tokens_per_append']:.1f} prefill tokens per append"
    )
  print(f"live cache speed-up: {ratio:.2f}x (re-prefill s / live s, one run)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(workload=w, live=live, reprefill=again, speedup=ratio), f, indent=1)


if __name__ == "__main__":
  main()
