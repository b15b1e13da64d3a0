"""Packed rows: the update and the log-prob passes on real tokens, not on padding.

    packer = Packer(config, fns, mesh)            # what GrpoStep holds (config.pack_sequences)
    upd = packer.rows(padded_upd)                 # the plan on the host, the gather on the device
    logp_rl = packer.logprobs(params, upd)        # old / reference log-probs, packed
    adv_n, old_nc = packer.per_sequence(upd)      # back in the rollout's [N], [N, C] layout

A rollout batch is N [prompt (left-padded to P); completion (right-padded to C)] rows, most of
them padding when lengths are long-tailed. Packing moves each sequence's real tokens, in order,
into rows of S = P + C slots, several sequences per row (first-fit decreasing: `plan_rows`,
host-side numpy, deterministic, no sequence split), then gathers every array on the device
(`pack`): input_ids, segment_ids (0 = padding, else the sequence's index within its
micro-batch + 1, unique in its row), positions restarting at 0 in each sequence (the padded
layout's `cumsum(mask) - 1`, so RoPE and sliding windows see the same numbers), and every
per-token field (completion mask, old / reference / sampler log-probs, the advantage of its
sequence, routing replay's recorded experts: rl/replay.py) moved with its token. The decoder
attends within a segment only (models/decoder/layers.py: `Block.forward`), and the losses sum
per sequence by segment (rl/losses.py: `Segments`), so every aggregation mode, GSPO's sequence
ratio, KL, TIS and the advantage clip give the padded layout's loss and gradients.

Micro-batches: the sequences of micro-batch k are those the padded layout gives it (rows k,
k + n, k + 2n, ...; rl/step.py: accumulate_gradients), packed among themselves into the same
number of rows per micro-batch, laid out so that packed row r * n + k belongs to micro-batch k:
the strided split of rl/step.py then hands every micro-batch its own sequences, and per-sequence
normalizers stay global (`micro_batch_weight`).

The LM head: a packed row's slots are mostly prompt tokens and padding, and the head's
[D, V] product is the biggest single matmul of a small model, so it runs only on the
completion tokens' slots (`head_slots`, gathered before the head: models/logprobs.py:
packed_logprobs), in whole rows of S slots per micro-batch (`head_rows`).

Static shapes: the packed row count per micro-batch, and the head's, is rounded up to one of at
most `NUM_BUCKETS` sizes (the padded count x 2^(-k/4), in whole data-parallel shares: at most
~19% over the rows needed at any fill; even eighths of the padded count, tried first, issued
1.4x the rows needed at GSM8K's fill, benchmarks/README.md "Packed update"), so a prompt width
compiles at most NUM_BUCKETS^2 update, log-prob and gather programs (in practice a few: a
batch's token count varies little, and the two counts move together); the Packer logs each new
one. Small batches
on many devices gain little: with one row per device per micro-batch (a share is the padded
count) nothing can be removed.
"""

import dataclasses

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import sharding
from grpo_jax.rl import losses

NUM_BUCKETS = 16  # packed row counts per micro-batch: the padded count x 2^(-k/4), k < 16

# ------------------------------------------------------------------------ the plan (host)


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


def bucket(rows_needed: int, rows_padded: int, row_multiple: int) -> int:
  """The packed row count for `rows_needed`: the smallest of the bucket sizes that holds it.
  Sizes, in whole data-parallel shares of `row_multiple` rows: the padded count times
  2^(-k/4), k < NUM_BUCKETS, rounded up (each at most 19% over the one below it, so the rows
  issued are at most ~1.19x the rows needed, whatever the fill)."""
  shares = -(-rows_padded // row_multiple)
  need = -(-max(rows_needed, 1) // row_multiple)
  sizes = sorted({-(-shares * 2 ** (-k / 4) // 1) for k in range(NUM_BUCKETS)})
  return int(next((s for s in sizes if s >= need), shares)) * row_multiple


@dataclasses.dataclass(frozen=True)
class Plan:
  """Where each of N sequences goes: row_of [N] (its packed row), offset_of [N] (its first
  slot there), rows (R, all micro-batches), rows_per_micro; fill = real tokens / R * S."""

  row_of: np.ndarray
  offset_of: np.ndarray
  rows: int
  rows_per_micro: int
  fill: float


def plan_rows(lengths_n, budget: int, *, num_micro: int = 1, row_multiple: int = 1) -> Plan:
  """First-fit decreasing per micro-batch (sequences k, k + n, ... for micro-batch k of n), the
  same bucketed row count for each, micro-batch k's row r at packed row r * n + k."""
  lengths_n = np.asarray(lengths_n, np.int64)
  n_seq = lengths_n.size
  if n_seq % num_micro:
    raise ValueError(f"{num_micro} micro-batches do not divide {n_seq} sequences")
  parts = [first_fit_decreasing(lengths_n[k::num_micro], budget) for k in range(num_micro)]
  per_micro = bucket(max(p[2] for p in parts), n_seq // num_micro, row_multiple)
  row_of, offset_of = np.zeros(n_seq, np.int32), np.zeros(n_seq, np.int32)
  for k, (row, offset, _) in enumerate(parts):
    row_of[k::num_micro] = row * num_micro + k
    offset_of[k::num_micro] = offset
  rows = per_micro * num_micro
  return Plan(row_of, offset_of, rows, per_micro, float(lengths_n.sum()) / (rows * budget))


def head_rows(completion_n, budget: int, *, num_micro: int = 1, row_multiple: int = 1) -> int:
  """Rows of `budget` slots the LM head runs on (all micro-batches): each micro-batch's real
  completion tokens (of `completion_n` [N], sequences k, k + n, ... for micro-batch k), in
  whole rows, bucketed as the packed rows are (so at most those)."""
  completion_n = np.asarray(completion_n, np.int64)
  most = max(completion_n[k::num_micro].sum() for k in range(num_micro))
  needed = -(-int(most) // budget)
  return bucket(needed, completion_n.size // num_micro, row_multiple) * num_micro


# ----------------------------------------------------------------------- the gather (device)


def pack(
    upd: dict, row_of_n, offset_of_n, *, rows: int, num_micro: int, head_rows: int | None = None
) -> dict:
  """The padded update batch (rl/step.py: assemble, [N, S] and [N, C] arrays, advantages [N],
  optional old_logp / ref_logp / sampler_logp [N, C], optional routes [N, S, L_moe, k]) as
  R = `rows` packed rows of S slots.

  -> input_ids, segment_ids, positions, completion_mask, advantages (each token its
  sequence's) and the given log-prob fields, all [R, S]; routes [R, S, L_moe, k] when given
  (routing replay: each token's recorded experts, -1 on padding slots); head_slots [H, S]
  (`head_slots`: where the LM head runs; H = `head_rows`, default R: room for every slot); and
  "sequences": what the per-sequence views need (`per_sequence`, `unpack`): advantages [N],
  slot [N, C] (the flat packed slot of each completion token; R * S where it has none)."""
  ids_ns, real_ns = upd["input_ids"], upd["attention_mask"] != 0
  n, s = ids_ns.shape
  c = upd["completion_mask"].shape[1]
  size = rows * s
  pos_ns = jnp.maximum(jnp.cumsum(real_ns, -1) - 1, 0).astype(jnp.int32)
  start_n = row_of_n.astype(jnp.int32) * s + offset_of_n.astype(jnp.int32)
  dest_ns = jnp.where(real_ns, start_n[:, None] + pos_ns, size)  # flat packed slot
  src = (
      jnp.full((size,), n * s, jnp.int32)
      .at[dest_ns.reshape(-1)]
      .set(jnp.arange(n * s, dtype=jnp.int32), mode="drop", unique_indices=True)
  )
  valid = src < n * s
  src = jnp.minimum(src, n * s - 1)
  seq, col = src // s, src % s
  in_completion = valid & (col >= s - c)
  ccol = jnp.clip(col - (s - c), 0, c - 1)

  def take(x_ns):
    return jnp.where(valid, x_ns.reshape(-1)[src], 0).reshape(rows, s)

  def take_completion(x_nc):
    return jnp.where(in_completion, x_nc[seq, ccol], 0).reshape(rows, s).astype(x_nc.dtype)

  out = dict(
      input_ids=take(ids_ns),
      segment_ids=jnp.where(valid, seq // num_micro + 1, 0).reshape(rows, s).astype(jnp.int32),
      positions=take(pos_ns),
      completion_mask=take_completion(upd["completion_mask"]),
      advantages=jnp.where(valid, upd["advantages"][seq], 0.0).reshape(rows, s),
  )
  for key in ("old_logp", "ref_logp", "sampler_logp"):
    if key in upd:
      out[key] = take_completion(upd[key])
  if "routes" in upd:  # routing replay (rl/replay.py): each token's recorded experts with it
    routes = upd["routes"]  # [N, S, L_moe, k]
    flat = routes.reshape(n * s, *routes.shape[2:])
    out["routes"] = jnp.where(valid[:, None, None], flat[src], -1).astype(routes.dtype)
    out["routes"] = out["routes"].reshape(rows, s, *routes.shape[2:])
  # The completion tokens' slots within their micro-batch's rows (packed row r * n + k is row r
  # of micro-batch k), each micro-batch's sorted and padded with its rows' slot count.
  local_n = (row_of_n.astype(jnp.int32) // num_micro) * s + offset_of_n.astype(jnp.int32)
  size_micro = rows // num_micro * s
  local_nc = jnp.where(real_ns[:, s - c :], local_n[:, None] + pos_ns[:, s - c :], size_micro)
  per_micro = (head_rows or rows) // num_micro * s
  slots = []
  for k in range(num_micro):
    mine = jnp.sort(local_nc[k::num_micro].reshape(-1))[:per_micro]
    slots.append(jnp.pad(mine, (0, per_micro - mine.size), constant_values=size_micro))
  out["head_slots"] = jnp.stack(slots).reshape(num_micro, -1, s).swapaxes(0, 1).reshape(-1, s)
  # kl_mask (assemble's): the policy's tokens, which the KL penalty sums (not tool responses)
  kl_mask = upd.get("kl_mask", real_ns[:, s - c :].astype(jnp.int32))
  out["sequences"] = dict(advantages=upd["advantages"], slot=dest_ns[:, s - c :], kl_mask=kl_mask)
  return out


def unpack(x_rl: jax.Array, slot_nc: jax.Array) -> jax.Array:
  """A packed per-token array [R, L] back in the rollout's completion layout [N, C] (0 where
  a completion slot holds no token)."""
  size = x_rl.size
  return jnp.where(slot_nc < size, x_rl.reshape(-1)[jnp.minimum(slot_nc, size - 1)], 0)


def global_slots(head_slots_hs: jax.Array, *, rows: int, num_micro: int) -> jax.Array:
  """`pack`'s head_slots (flat slots within their micro-batch's rows; head row h * n + k is
  micro-batch k's) as flat slots of all R rows (R * S where there is none): what a pass over
  the whole batch takes."""
  s = head_slots_hs.shape[1]
  size_micro = rows // num_micro * s
  k_h = jnp.arange(head_slots_hs.shape[0], dtype=jnp.int32)[:, None] % num_micro
  glob = ((head_slots_hs // s) * num_micro + k_h) * s + head_slots_hs % s
  return jnp.where(head_slots_hs < size_micro, glob, rows * s)


def sequence_index(segment_ids_rl: jax.Array, num_micro: int) -> jax.Array:
  """[R, L]: each token's sequence in the whole batch (row i of the padded layout): segment j
  of a row of micro-batch k (packed row r * n + k) is sequence j * n + k; padding gets 0."""
  k_r = jnp.arange(segment_ids_rl.shape[0], dtype=jnp.int32) % num_micro
  return jnp.maximum(segment_ids_rl - 1, 0) * num_micro + k_r[:, None]


# ------------------------------------------------------------------ the loss's two layouts


class PaddedLayout:
  """One sequence per row of [prompt; completion]: `logprob_fn(params, input_ids,
  attention_mask) -> [b, C]`, sequences = rows."""

  def logprobs(self, logprob_fn, params, batch: dict) -> jax.Array:
    return logprob_fn(params, batch["input_ids"], batch["attention_mask"])

  def seqs(self, batch: dict):
    del batch
    return losses.ROWS

  def num_sequences(self, batch: dict) -> int:
    return batch["completion_mask"].shape[0]


PADDED = PaddedLayout()


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Packed rows (`pack`): `logprob_fn(params, input_ids, segment_ids, positions, head_slots)
  -> [r, L]` (the log-probs at head_slots, the micro-batch's own: `pack`), sequences by
  segment. seqs_per_micro: the sequences of one micro-batch (all N when the batch is one),
  whose segment ids are 1..seqs_per_micro."""

  seqs_per_micro: int
  num_micro: int = 1

  def logprobs(self, logprob_fn, params, batch: dict) -> jax.Array:
    return logprob_fn(
        params, batch["input_ids"], batch["segment_ids"], batch["positions"], batch["head_slots"]
    )

  def seqs(self, batch: dict) -> losses.Segments:
    return losses.Segments(jnp.maximum(batch["segment_ids"] - 1, 0), self.seqs_per_micro)

  def num_sequences(self, batch: dict) -> int:
    del batch
    return self.seqs_per_micro * self.num_micro


# ------------------------------------------------------------------------ the loop's object


def batch_shards(mesh) -> int:
  """Devices the rows shard over (sharding.batch_sharding): packed row counts are multiples."""
  return int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES if a in mesh.shape]))


class Padded:
  """The rows as the rollout made them (pack_sequences=False): what GrpoStep asks of a layout."""

  def __init__(self, fns):
    self.fns = fns

  def rows(self, upd: dict) -> dict:
    return upd

  def logprobs(self, params, upd: dict) -> jax.Array:
    return self.fns.logprobs(params, upd["input_ids"], upd["attention_mask"])

  def fold_kl(self, upd: dict, rewards_n):
    return self.fns.fold_kl(upd, rewards_n)

  def per_sequence(self, upd: dict):
    """(advantages [N], old log-probs [N, C] or None) in the rollout's layout."""
    return upd["advantages"], upd.get("old_logp")


class Packer(Padded):
  """Packed rows (pack_sequences=True): the plan on the host from the N sequences' lengths (one
  explicit [N] read), the gather and the log-prob passes on the device. fns: rl/step.py's
  TrainFunctions (pack, packed_logprobs, fold_kl of packed rows)."""

  def __init__(self, config, fns, mesh):
    super().__init__(fns)
    rows = config.batch_size * config.num_generations
    self.num_micro = fns.num_micro
    self.rows_padded = rows
    self.row_multiple = batch_shards(mesh)
    self.mesh = mesh
    c = config.max_completion_length
    # [2, N]: each sequence's real tokens and its completion's
    self._lengths = jax.jit(lambda m: jnp.stack([(m != 0).sum(-1), (m[:, -c:] != 0).sum(-1)]))
    self.shapes = set()  # (rows, head rows, width) of the batches met: one program set each
    self.last_fill = 0.0

  def rows(self, upd: dict) -> dict:
    mask = upd["attention_mask"]
    lengths_n, completion_n = np.asarray(jax.device_get(self._lengths(mask)))  # one read
    width = mask.shape[1]
    plan = plan_rows(lengths_n, width, num_micro=self.num_micro, row_multiple=self.row_multiple)
    heads = self.head_rows(completion_n, width, plan)
    if (plan.rows, heads, width) not in self.shapes:
      self.shapes.add((plan.rows, heads, width))
      logging.info(
          "packed rows: %d x %d, LM head on %d rows (padded %d; fill %.2f); packed shapes so "
          "far: %d",
          plan.rows,
          width,
          heads,
          self.rows_padded,
          plan.fill,
          len(self.shapes),
      )
    self.last_fill = plan.fill
    where = jax.device_put((plan.row_of, plan.offset_of), sharding.replicated(self.mesh))
    return self.fns.pack(upd, *where, plan.rows, heads)

  def head_rows(self, completion_n, width: int, plan: Plan) -> int:
    """Rows of slots the LM head runs on: the completion tokens' (`head_rows`)."""
    del plan  # (benchmarks/packed_update.py compares the head on all of the plan's rows)
    return head_rows(completion_n, width, num_micro=self.num_micro, row_multiple=self.row_multiple)

  def logprobs(self, params, upd: dict) -> jax.Array:
    return self.fns.packed_logprobs(
        params, upd["input_ids"], upd["segment_ids"], upd["positions"], upd["head_slots"]
    )

  def fold_kl(self, upd: dict, rewards_n):
    return self.fns.packed_fold_kl(upd, rewards_n)

  def per_sequence(self, upd: dict):
    seqs = upd["sequences"]
    old = upd.get("old_logp")
    return seqs["advantages"], None if old is None else self.fns.unpack(old, seqs["slot"])
