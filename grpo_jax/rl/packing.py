"""Packed rows: the update and the log-prob passes on real tokens, not on padding.

    packer = Packer(config, fns, mesh)            # what GrpoStep holds (config.pack_sequences)
    upd = packer.rows(padded_upd)                 # the plan on the host, the gather on the device
    logp_rl = packer.logprobs(params, upd)        # old / reference log-probs, packed
    adv_n, old_nc = packer.per_sequence(upd)      # back in the rollout's [N], [N, C] layout

A rollout batch is N [prompt (left-padded to P); completion (right-padded to C)] rows, most of
them padding when lengths are long-tailed. Packing moves each sequence's real tokens, in order,
into rows of S = P + C slots, several sequences per row, then gathers every array on the
device (`pack`): input_ids, segment_ids (0 = padding, else the sequence's index in the batch +
1: unique in the batch), positions restarting at 0 in each sequence (the padded layout's
`cumsum(mask) - 1`, so RoPE and sliding windows see the same numbers), and every per-token
field (completion mask, old / reference / sampler log-probs, the advantage of its sequence,
routing replay's recorded experts: rl/replay.py) moved with its token. The decoder attends
within a segment only (models/decoder/layers.py: `Block.forward`), and the losses sum per
sequence by segment (rl/losses.py: `Segments`, N sequences in every micro-batch), so every
aggregation mode, GSPO's sequence ratio, KL, TIS and the advantage clip give the padded
layout's loss and gradients.

Per data-parallel shard: the padded rows shard over the mesh's batch axes (D = `batch_shards`
shards, shard d holding rows [d N/D, (d+1) N/D)), and each shard packs the sequences it holds
(rl/row_plan.py `plan_rows`: first-fit decreasing over the shard's own sequences, then a bounded
search for fewer rows; host-side, deterministic, no sequence split) into the same number of rows
R_local, laid out shard-major (packed row d R_local + j is shard d's row j), so the packed batch
shards over the same axes as the padded one. The gather, the LM head's gather of completion
slots (models/logprobs.py: _packed_head) and `unpack` run per shard (a vmap over an explicit
leading [D] axis, which XLA partitions along it): packing moves no sequence and no hidden state
between devices (tests/rl/test_packing.py reads the compiled HLO). On 2+ processes every process
reads the N lengths (a replicated array), makes the same plan and provides its own shards of it.

Micro-batches (rl/row_plan.py `MicroBatching`): micro-batch i is the packed rows i, i + n, i +
2n, ... (the strided split of rl/step.py: accumulate_gradients), so each shard's local rows j =
i mod n; any sequences may share a micro-batch, as every per-sequence normalizer counts the
batch's N sequences (`PackedLayout`). By rows (config.micro_batch_size) the count n is fixed and
each micro-batch gets the rows it needs; by tokens (config.micro_batch_tokens) a micro-batch
holds at most `micro_batch_tokens // S` rows over all devices and n is what the packed rows
need.

The LM head: a packed row's slots are mostly prompt tokens and padding, and the head's
[D, V] product is the biggest single matmul of a small model, so it runs only on the
completion tokens' slots (`head_slots`, gathered before the head: models/logprobs.py:
packed_logprobs), in whole rows of S slots per micro-batch and shard.

Static shapes: a shard's packed row count per micro-batch, the head's, and the micro-batch count
by tokens are each rounded up to one of at most `NUM_BUCKETS` sizes (row_plan.py `bucket`: the
padded count x 2^(-k/4): at most ~19% over the rows needed at any fill; figures:
benchmarks/README.md "Packed update"), so a prompt width compiles a few update, log-prob and
gather programs (a batch's token count varies little, and the counts move together); the Packer
logs each new shape, how many it has met and whether it was compiled ahead: with
config.compile_ahead on a GPU or TPU, every step sends the shapes of its batch with completions
15% shorter and longer (`Packer.likely_shapes`) to run/compile_ahead.py's worker, so a later
step whose lengths drift onto one finds its programs compiled (the run's first shape compiles at
its first use). Small batches on many devices gain little: with one row per shard per
micro-batch nothing can be removed.
"""

import dataclasses
import functools

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding
from grpo_jax.rl import losses
from grpo_jax.rl import row_plan


def packs(config) -> bool:
  """Whether the update trains on packed rows: config.pack_sequences (on by default) for a
  decoder-only policy; T5's encoder-decoder rows stay padded (logged once by GrpoStep)."""
  return bool(config.pack_sequences) and config.model.family == "decoder"


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class MicroBatches:
  """A packed batch's micro-batch count, as static pytree data: it rides in the batch (no
  leaves), so each count is its own compiled update program."""

  count: int


# ----------------------------------------------------------------------- the gather (device)


def _per_shard(x: jax.Array, shards: int) -> jax.Array:
  """[D * n, ...] rows -> [D, n, ...], the leading axis over the mesh's batch axes."""
  x = x.reshape(shards, x.shape[0] // shards, *x.shape[1:])
  return sharding.constrain(x, "batch", *[None] * (x.ndim - 1))


def _whole(x: jax.Array) -> jax.Array:
  """[D, n, ...] -> [D * n, ...] rows, sharded over the batch axes."""
  return sharding.constrain(x.reshape(-1, *x.shape[2:]), "batch", *[None] * (x.ndim - 2))


# The padded batch's arrays that `pack` moves (each present one, [N, ...])
_FIELDS = (
    "input_ids",
    "attention_mask",
    "completion_mask",
    "advantages",
    "old_logp",
    "ref_logp",
    "sampler_logp",
    "routes",
)


def pack(
    upd: dict,
    row_of_n,
    offset_of_n,
    *,
    shards: int = 1,
    rows: int,
    num_micro: int = 1,
    head_rows: int | None = None,
) -> dict:
  """The padded update batch (rl/step.py: assemble, [N, S] and [N, C] arrays, advantages [N],
  optional old_logp / ref_logp / sampler_logp [N, C], optional routes [N, S, L_moe, k]) as
  R = `rows` packed rows of S slots, each of `shards` shards packing its own rows
  (`row_plan.plan_rows`: row_of_n is a sequence's row among its shard's R / shards).

  -> input_ids, segment_ids, positions, completion_mask, advantages (each token its
  sequence's) and the given log-prob fields, all [R, S]; routes [R, S, L_moe, k] when given
  (routing replay: each token's recorded experts, -1 on padding slots); head_slots [H, W]
  (`_head_slots`: where the LM head runs, W = `row_plan.head_width(S)`; H = `head_rows`,
  default room for every slot);
  and "sequences": what the per-sequence views need (`per_sequence`, `unpack`): advantages
  [N], slot [N, C] (the flat slot of each completion token among its shard's packed rows;
  R / shards * S where it has none), kl_mask [N, C]."""
  n, c = upd["completion_mask"].shape
  s = upd["input_ids"].shape[1]
  fields = {k: upd[k] for k in _FIELDS if k in upd}
  every = num_micro * -(-(rows // num_micro) * s // row_plan.head_width(s))  # rows of W: every slot
  shard = functools.partial(
      _pack_shard,
      rows=rows // shards,
      num_micro=num_micro,
      head_rows=(head_rows or every * shards) // shards,
  )
  per = lambda x: _per_shard(x, shards)  # noqa: E731
  seq_n = jnp.arange(n, dtype=jnp.int32)
  out = jax.vmap(shard)(jax.tree.map(per, fields), per(seq_n), per(row_of_n), per(offset_of_n))
  out = jax.tree.map(_whole, out)
  # kl_mask (assemble's): the policy's tokens, which the KL penalty sums (not tool responses)
  kl_mask = upd.get("kl_mask", upd["attention_mask"][:, -c:])
  out["sequences"] = dict(advantages=upd["advantages"], slot=out.pop("slot"), kl_mask=kl_mask)
  return out


def _pack_shard(upd, seq_n, row_of_n, offset_of_n, *, rows, num_micro, head_rows) -> dict:
  """`pack` of one shard's n rows into its `rows` packed rows (segment ids: seq_n + 1, the
  sequences' indices in the batch); "slot" [n, C]: each completion token's flat packed slot."""
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
      segment_ids=jnp.where(valid, seq_n[seq] + 1, 0).reshape(rows, s).astype(jnp.int32),
      positions=take(pos_ns),
      completion_mask=take_completion(upd["completion_mask"]),
      advantages=jnp.where(valid, upd["advantages"][seq], 0.0).reshape(rows, s),
      head_slots=_head_slots(in_completion.reshape(rows, s), num_micro, head_rows),
      slot=dest_ns[:, s - c :],
  )
  for key in ("old_logp", "ref_logp", "sampler_logp"):
    if key in upd:
      out[key] = take_completion(upd[key])
  if "routes" in upd:  # routing replay (rl/replay.py): each token's recorded experts with it
    routes = upd["routes"]  # [n, S, L_moe, k]
    flat = routes.reshape(n * s, *routes.shape[2:])
    out["routes"] = jnp.where(valid[:, None, None], flat[src], -1).astype(routes.dtype)
    out["routes"] = out["routes"].reshape(rows, s, *routes.shape[2:])
  return out


def _head_slots(completion_rs, num_micro: int, head_rows: int) -> jax.Array:
  """The slots of a shard's completion tokens (`completion_rs` [rows, S]) per micro-batch, flat
  within the micro-batch's rows (its row r is the shard's row r n + k), in order, padded with
  the micro-batch's slot count; head row h n + k is micro-batch k's row h.
  -> [head_rows, W], W = row_plan.head_width(S)."""
  rows, s = completion_rs.shape
  w = row_plan.head_width(s)
  mine = completion_rs.reshape(rows // num_micro, num_micro, s).swapaxes(0, 1)
  mine = mine.reshape(num_micro, -1)  # [n, rows / n * S]: micro-batch k's slots
  per_micro = head_rows // num_micro * w
  slots = jax.vmap(lambda m: jnp.nonzero(m, size=per_micro, fill_value=m.size)[0])(mine)
  slots = slots.astype(jnp.int32).reshape(num_micro, head_rows // num_micro, w)
  return slots.swapaxes(0, 1).reshape(head_rows, w)


def unpack(x_rl: jax.Array, slot_nc: jax.Array, shards: int = 1) -> jax.Array:
  """A packed per-token array [R, L] back in the rollout's completion layout [N, C] (0 where
  a completion slot holds no token); slot_nc: `pack`'s, flat in each shard's rows."""
  size = x_rl.size // shards
  x = _per_shard(x_rl, shards).reshape(shards, size)
  slot = _per_shard(slot_nc, shards).reshape(shards, -1)
  got = jax.vmap(lambda a, i: a[jnp.minimum(i, size - 1)])(x, slot).reshape(slot_nc.shape)
  return jnp.where(slot_nc < size, got, 0)


def spread(values_n: jax.Array, segment_ids_rl: jax.Array, shards: int = 1) -> jax.Array:
  """[R, L]: each token its sequence's value of `values_n` [N] (0 on padding), taken within
  the shard (a shard's rows hold only its own sequences)."""
  local = values_n.shape[0] // shards
  seg = _per_shard(segment_ids_rl, shards)
  got = jax.vmap(lambda v, i: v[(i - 1) % local])(_per_shard(values_n, shards), seg)
  return _whole(jnp.where(seg > 0, got, 0))


def global_slots(
    head_slots_hs: jax.Array, *, rows: int, num_micro: int, shards: int = 1, width: int
):
  """`pack`'s head_slots (flat slots within their micro-batch's rows of their shard; head row
  h * n + k of a shard is micro-batch k's) as flat slots of all the shard's rows (R / shards *
  S where there is none): what a pass over the whole batch takes. rows: R, all shards'; width:
  S, the packed rows' slots."""
  s = width
  rows_local = rows // shards
  size_micro = rows_local // num_micro * s
  k_h = jnp.arange(head_slots_hs.shape[0], dtype=jnp.int32)[:, None] % num_micro
  glob = ((head_slots_hs // s) * num_micro + k_h) * s + head_slots_hs % s
  return jnp.where(head_slots_hs < size_micro, glob, rows_local * s)


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

  def num_micro(self, batch: dict, micro: row_plan.MicroBatching) -> int:
    return micro.padded_count(*batch["input_ids"].shape)


PADDED = PaddedLayout()


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Packed rows (`pack`): `logprob_fn(params, input_ids, segment_ids, positions, head_slots)
  -> [r, L]` (the log-probs at head_slots, the micro-batch's own: `pack`), sequences by
  segment: the batch's N = `num_seqs` in every micro-batch (those of other micro-batches have
  no token there), so a sequence-level denominator is N whatever a micro-batch holds
  (rl/losses.py: micro_batch_weight gives each micro-batch weight 1 in the seq-mean modes)."""

  num_seqs: int

  def logprobs(self, logprob_fn, params, batch: dict) -> jax.Array:
    return logprob_fn(
        params, batch["input_ids"], batch["segment_ids"], batch["positions"], batch["head_slots"]
    )

  def seqs(self, batch: dict) -> losses.Segments:
    return losses.Segments(jnp.maximum(batch["segment_ids"] - 1, 0), self.num_seqs)

  def num_sequences(self, batch: dict) -> int:
    del batch
    return self.num_seqs

  def num_micro(self, batch: dict, micro: row_plan.MicroBatching) -> int:
    del micro
    return batch["micro_batches"].count


# ------------------------------------------------------------------------ the loop's object


def batch_shards(mesh) -> int:
  """Devices the rows shard over (sharding.batch_sharding): the shards that pack their own."""
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
  explicit read of a replicated [2, N], on every process), the gather and the log-prob passes on
  the device, per shard. fns: rl/step.py's TrainFunctions (pack, packed_logprobs, fold_kl of
  packed rows, micro)."""

  def __init__(self, config, fns, mesh):
    super().__init__(fns)
    self.micro = fns.micro
    self.rows_padded = config.batch_size * config.num_generations
    self.mesh = mesh
    c = config.max_completion_length

    def lengths(m):  # [2, N]: each sequence's real tokens and its completion's
      return jnp.stack([(m != 0).sum(-1), (m[:, -c:] != 0).sum(-1)])

    # on every device; named: a trace's modules name the step's programs (jit_lengths)
    self._lengths = jax.jit(lengths, out_shardings=sharding.replicated(mesh))
    self.shapes = set()  # (rows, head rows, micro-batches, width) met: one program set each
    self.last_fill = 0.0
    self.c = c
    # run/compile_ahead.py's CompileAhead (config.compile_ahead; set by the loop): each
    # step's likely next shapes (`likely_shapes`) compile in its worker thread
    self.ahead = None

  def plan(self, lengths_n, completion_n, width: int) -> row_plan.Plan:
    return row_plan.plan_rows(lengths_n, width, self.micro, completion_n)

  def rows(self, upd: dict) -> dict:
    mask = upd["attention_mask"]
    lengths_n, completion_n = np.asarray(multihost.read(self._lengths(mask), self.mesh))
    width = mask.shape[1]
    plan = self.plan(lengths_n, completion_n, width)
    shape = (plan.rows, plan.head_rows, plan.num_micro, width)
    new = shape not in self.shapes
    if new:
      ahead = self.ahead is not None and self.ahead.wait_packed(width - self.c, shape[:3])
      self.shapes.add(shape)
      logging.info(
          "packed rows: %d x %d in %d micro-batch(es) over %d shard(s), LM head on %d rows "
          "(padded %d; fill %.2f); packed shapes so far: %d (this one %s)",
          plan.rows,
          width,
          plan.num_micro,
          plan.shards,
          plan.head_rows,
          self.rows_padded,
          plan.fill,
          len(self.shapes),
          "compiled ahead" if ahead else "compiles at its first use",
      )
    self.last_fill = plan.fill
    where = [multihost.sharded_rows(x, self.mesh) for x in (plan.row_of, plan.offset_of)]
    out = self.fns.pack(upd, *where, plan.rows, plan.head_rows, plan.num_micro)
    out["micro_batches"] = MicroBatches(plan.num_micro)
    if self.ahead is not None:  # every step: the lengths drift from any shape
      met = {s[:3] for s in self.shapes if s[3] == width}
      likely = [s for s in self.likely_shapes(lengths_n, completion_n, width) if s not in met]
      if likely:
        self.ahead.packed(width - self.c, likely, upd, where, out)  # by prompt width
    return out

  def likely_shapes(self, lengths_n, completion_n, width: int) -> list[tuple[int, int, int]]:
    """The (rows, head rows, micro-batches) the plan gives this batch with every completion
    15% shorter and 15% longer (at most C): the shapes a later step's lengths are likely to
    need (a bucket is ~19% over the one below it), sent to the compile-ahead worker every step
    (those not sent before). Each at most NUM_BUCKETS^2 per micro-batch count and width over a
    run."""
    lengths_n, completion_n = np.asarray(lengths_n), np.asarray(completion_n)
    out = []
    for f in (1.15, 0.85):
      comp = np.minimum(np.round(completion_n * f).astype(np.int64), self.c)
      plan = self.plan(lengths_n - completion_n + comp, comp, width)
      shape = (plan.rows, plan.head_rows, plan.num_micro)
      if shape not in out:
        out.append(shape)
    return out

  def logprobs(self, params, upd: dict) -> jax.Array:
    return self.fns.packed_logprobs(
        params,
        upd["input_ids"],
        upd["segment_ids"],
        upd["positions"],
        upd["head_slots"],
        upd["micro_batches"],
    )

  def fold_kl(self, upd: dict, rewards_n):
    return self.fns.packed_fold_kl(upd, rewards_n)

  def per_sequence(self, upd: dict):
    seqs = upd["sequences"]
    old = upd.get("old_logp")
    return seqs["advantages"], None if old is None else self.fns.unpack(old, seqs["slot"])
