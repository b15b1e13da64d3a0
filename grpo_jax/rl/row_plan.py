"""The packing plan, on the host (numpy): where each sequence of a step goes among packed rows
of S slots, per data-parallel shard, in bucketed row counts; the same plan on every process.
rl/packing.py gathers the arrays on the device by it (its module docstring: the layout, the
micro-batches, the LM head's rows and the buckets).

    plan = row_plan.plan_rows(lengths_n, S, MicroBatching(shards=4, count=2), completion_n)
    plan.row_of, plan.offset_of   # [N]: each sequence's packed row (in its shard), first slot
"""

import dataclasses

import numpy as np

NUM_BUCKETS = 16  # packed row counts per micro-batch: the padded count x 2^(-k/4), k < 16
HEAD_WIDTH = 128  # slots per row of the LM head's gathered positions (`head_width`)


def head_width(s: int) -> int:
  """The width W of the LM head's rows (head_slots [H, W]) for packed rows of S slots: the
  completion tokens are gathered in whole rows of W = min(S, HEAD_WIDTH) positions, so the head
  issues at most W - 1 positions more than a micro-batch's completion tokens (rows of S would
  issue up to S - 1: 0.85 of Qwen3-0.6B's head FLOPs real at the recipe's 1280 slots)."""
  return min(s, HEAD_WIDTH)


def first_fit_decreasing(lengths_n: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Bins of `budget` slots for sequences of `lengths_n` tokens: longest first, each into the
  first row with room (ties by index: deterministic). -> (row [n], offset [n], rows used)."""
  lengths_n = np.asarray(lengths_n, np.int64)
  if lengths_n.size and lengths_n.max() > budget:
    raise ValueError(f"a sequence of {lengths_n.max()} tokens does not fit a row of {budget}")
  n = lengths_n.size
  free = np.full(max(n, 1), budget, np.int64)
  row, offset = np.zeros(n, np.int32), np.zeros(n, np.int32)
  used = 0
  for i in np.argsort(-lengths_n, kind="stable"):
    r = int(np.argmax(free[: used + 1] >= lengths_n[i]))  # row `used` is empty: always fits
    row[i], offset[i] = r, budget - free[r]
    free[r] -= lengths_n[i]
    used = max(used, r + 1)
  return row, offset, used


# Row visits the fewest-rows search (`fewest_rows`) may make per row count (a placement visits
# every row): under 0.1 s of host time for thousands of sequences, then the rows found so far
# stand (deterministic: a count, not a clock).
SEARCH_WORK = 100_000


def fewest_rows(
    lengths_n: np.ndarray, budget: int, max_work: int = SEARCH_WORK
) -> tuple[np.ndarray, np.ndarray, int]:
  """`first_fit_decreasing`, then, when it used more rows than the lower bound (the tokens over
  `budget`, rounded up, and the sequences longer than half a row), a depth-first search for a
  packing into fewer: longest first, each into a row with room, rows of equal room tried once,
  a branch cut when the room left in rows that can still take a sequence is less than the
  tokens left; one row fewer at a time while found, within `max_work` row visits each.
  Same result for the same lengths (every process plans alike). -> (row [n], offset [n] (the
  row's sequences in placement order), rows used). First-fit decreasing alone leaves a row
  more than the fewest on 13 of 100 batches of the recipe's GSM8K lengths (one chip's fill over
  400 batches: 0.863 -> 0.889, benchmarks/README.md "Packed update")."""
  row, offset, used = first_fit_decreasing(lengths_n, budget)
  lengths_n = np.asarray(lengths_n, np.int64)
  n = lengths_n.size
  if n == 0:
    return row, offset, used
  bound = max(-(-int(lengths_n.sum()) // budget), int((2 * lengths_n > budget).sum()))
  order = np.argsort(-lengths_n, kind="stable")
  items = [int(x) for x in lengths_n[order]]
  for k in range(used - 1, bound - 1, -1):
    bins = _search(items, budget, k, max_work)
    if bins is None:
      break
    row, offset, used = np.zeros(n, np.int32), np.zeros(n, np.int32), k
    fill = [0] * k
    for i, b in zip(order, bins):
      row[i], offset[i] = b, fill[b]
      fill[b] += int(lengths_n[i])
  return row, offset, used


def _search(items: list, budget: int, k: int, max_work: int) -> list | None:
  """The bins (of `k`, `budget` slots each) of `items` (descending), or None when none was
  found within `max_work` row visits (k per placement tried). Iterative: choice[i] is item i's
  bin, -1 unplaced."""
  n, smallest = len(items), items[-1]
  left = np.cumsum(items[::-1])[::-1].tolist() + [0]  # left[i]: tokens of items i..n-1
  free, choice = [budget] * k, [-1] * n
  i = work = 0
  while 0 <= i < n:
    b = choice[i]
    if b >= 0:
      free[b] += items[i]  # undo, then the next row with another room than those tried
    tried = set(free[: b + 1])
    c = next((c for c in range(b + 1, k) if free[c] >= items[i] and free[c] not in tried), -1)
    work += k
    if c < 0 or work > max_work:
      choice[i] = -1
      i = -1 if work > max_work else i - 1
      continue
    choice[i] = c
    free[c] -= items[i]
    if sum(f for f in free if f >= smallest) >= left[i + 1]:
      i += 1  # else: stay on item i, its next row
  return choice if i == n else None


def bucket(rows_needed: int, rows_padded: int, row_multiple: int = 1) -> int:
  """The packed row count for `rows_needed`: the smallest of the bucket sizes that holds it.
  Sizes, in whole shares of `row_multiple` rows: the padded count times 2^(-k/4),
  k < NUM_BUCKETS, rounded up (each at most 19% over the one below it, so the rows issued are
  at most ~1.19x the rows needed, whatever the fill)."""
  shares = -(-rows_padded // row_multiple)
  need = -(-max(rows_needed, 1) // row_multiple)
  sizes = sorted({-(-shares * 2 ** (-k / 4) // 1) for k in range(NUM_BUCKETS)})
  return int(next((s for s in sizes if s >= need), shares)) * row_multiple


@dataclasses.dataclass(frozen=True)
class MicroBatching:
  """How a step's rows split into micro-batches over D = `shards` data-parallel shards: by rows
  (config.micro_batch_size: `count` micro-batches every step) or by tokens
  (config.micro_batch_tokens = `tokens`: slots, padding included, per micro-batch over all
  devices; a micro-batch of rows of S slots holds tokens // S rows rounded down to a multiple
  of D, at least D)."""

  shards: int = 1
  count: int = 1
  tokens: int = 0

  def shard_rows(self, width: int) -> int:
    """By tokens: the rows of `width` slots a shard holds in one micro-batch."""
    return max(1, self.tokens // width // self.shards)

  def padded_count(self, rows: int, width: int) -> int:
    """The micro-batches of `rows` padded rows of `width` slots: `count`; by tokens, the fewest
    of at most `shard_rows` rows per shard that split each shard's rows evenly."""
    if not self.tokens:
      return self.count
    local = rows // self.shards
    n = -(-local // self.shard_rows(width))
    while local % n:
      n += 1
    return n

  def packed(self, used: int, local: int, width: int) -> tuple[int, int]:
    """(micro-batches n, packed rows per micro-batch per shard) for `used` packed rows on the
    fullest shard, of `local` padded rows per shard. By rows: n = `count`, the rows bucketed
    under the padded count; by tokens: n bucketed under the count the padded rows would
    need, the rows bucketed under `shard_rows`."""
    if self.tokens:
      cap = min(self.shard_rows(width), local)
      n = bucket(-(-used // cap), -(-local // cap))
    else:
      n, cap = self.count, local // self.count
    return n, bucket(-(-used // n), cap)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each of N sequences goes: row_of [N] (its packed row among its shard's
  rows_per_shard), offset_of [N] (its first slot there); rows = shards x rows_per_shard (R, all
  micro-batches), num_micro micro-batches, head_rows (H: the LM head's rows, all shards and
  micro-batches); fill = real tokens / R * S."""

  row_of: np.ndarray
  offset_of: np.ndarray
  shards: int
  rows: int
  num_micro: int
  head_rows: int
  fill: float

  @property
  def rows_per_shard(self) -> int:
    return self.rows // self.shards


def plan_rows(
    lengths_n, budget: int, micro: MicroBatching = MicroBatching(), completion_n=None
) -> Plan:
  """The fewest rows per shard (`fewest_rows`, over the sequences [d N/D, (d+1) N/D) of shard d of
  `micro.shards`), the same bucketed row count R_local = n x rows per micro-batch for every
  shard (`MicroBatching.packed`). The LM head's rows of W = `head_width(budget)` positions
  (`completion_n` [N]: each sequence's completion tokens): each micro-batch's completion tokens
  on its fullest shard, in whole rows of W, bucketed under the rows of W that hold all its
  slots; None: those (every slot)."""
  lengths_n = np.asarray(lengths_n, np.int64)
  shards, n_seq = micro.shards, lengths_n.size
  if n_seq % shards:
    raise ValueError(f"{shards} shards do not divide {n_seq} sequences")
  local = n_seq // shards
  parts = [fewest_rows(lengths_n[d * local : (d + 1) * local], budget) for d in range(shards)]
  row_of = np.concatenate([p[0] for p in parts]).astype(np.int32)
  offset_of = np.concatenate([p[1] for p in parts]).astype(np.int32)
  num_micro, per_micro = micro.packed(max(p[2] for p in parts), local, budget)
  rows = shards * num_micro * per_micro
  w = head_width(budget)
  cap = -(-per_micro * budget // w)  # head rows of W holding every slot of a micro-batch
  heads = shards * num_micro * cap
  if completion_n is not None:  # completion tokens of each (shard, micro-batch)
    tokens = np.zeros((shards, num_micro), np.int64)
    np.add.at(tokens, (np.arange(n_seq) // local, row_of % num_micro), completion_n)
    heads = shards * num_micro * bucket(-(-int(tokens.max()) // w), cap)
  fill = float(lengths_n.sum()) / (rows * budget)
  return Plan(row_of, offset_of, shards, rows, num_micro, heads, fill)
