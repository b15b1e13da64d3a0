"""From rows to batches: pre-tokenized prompts, a checkpointable grain iterator, eval and SFT batches.

    data = PromptData(rows, tokenizer, template="chatml", system_prompt="...", max_prompt_length=256)
    # template="tokenizer": the tokenizer folder's chat template (data/templates.py)
    it = make_prompt_iterator(len(data), batch_size=8, seed=0)   # grain; yields row indices
    batch = data.batch(next(it))     # prompt_ids/prompt_mask int32 [b, P] left-padded + rows

The iterator yields row indices of global batches (each JAX process keeps the rows its devices
hold, so the data a step sees does not depend on the process count); its state is a few integers: `it.get_state()` / `it.set_state(s)` continue with exactly the
next batch, and Orbax saves it with grain's handler (grpo_jax/run/checkpoint.py). Each epoch is
reshuffled (grain's epoch-aware shuffle).

Prompts longer than P are LEFT-truncated (the end of a chat prompt holds the question and the
assistant header, which must survive); `num_truncated` counts them, `token_counts` keeps every
prompt's full length, and the loop logs the cut (or refuses it at start-up: data/checks.py).
"""

from absl import logging
import grain
import numpy as np

from grpo_jax.data import tool_traces
from grpo_jax.data.templates import render_prompt

# What happens to prompts longer than max_prompt_length (config data.overlong_prompts): "error"
# stops the run at start-up (data/checks.py), "truncate" cuts them, "drop" leaves such train
# rows out (eval prompts are cut).
OVERLONG_PROMPTS = ("truncate", "drop", "error")
# How wide a train step's prompt columns are (config data.prompt_width): "bucket" = the global
# batch's longest prompt rounded up to a power of two (>= MIN_BUCKET, <= max_prompt_length);
# "max" = always max_prompt_length.
PROMPT_WIDTHS = ("bucket", "max")
MIN_BUCKET = 8


def bucket_width(longest: int, max_prompt_length: int) -> int:
  """The power of two >= `longest` (at least MIN_BUCKET), capped at max_prompt_length."""
  return min(max_prompt_length, max(MIN_BUCKET, 1 << max(int(longest) - 1, 0).bit_length()))


def left_pad(seqs: list[list[int]], length: int, pad_id: int):
  """(ids, mask) int32 [N, length], each sequence right-aligned; longer ones keep their end."""
  ids = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), np.int32)
  for i, s in enumerate(seqs):
    s = s[-length:] if length else []
    if s:
      ids[i, length - len(s) :] = s
      mask[i, length - len(s) :] = 1
  return ids, mask


class PromptData:
  """Rows with their prompts rendered, tokenized and left-padded once, up front."""

  def __init__(
      self,
      rows: list[dict],
      tokenizer,
      *,
      template: str,
      system_prompt: str,
      max_prompt_length: int,
      log_truncated: bool = True,
  ):
    """`log_truncated=False`: the caller reports prompts longer than max_prompt_length (the
    loop's start-up check refuses them unless data.overlong_prompts allows the cut)."""
    if not rows:
      raise ValueError("no rows to build prompts from")
    self.rows = rows
    self.tokenizer = tokenizer
    self.texts = []
    for i, r in enumerate(rows):
      try:
        self.texts.append(render_prompt(r["prompt"], template, system_prompt, tokenizer))
      except ValueError as e:  # a row the template cannot render: refused at start-up
        raise ValueError(f"prompt row {i} ({_short(r['prompt'])}): {e}") from None
    encoded = [tokenizer.encode(t) for t in self.texts]
    empty = [i for i, e in enumerate(encoded) if not e]
    if empty:
      raise ValueError(f"row {empty[0]} renders to an empty prompt; every prompt needs a token")
    self.token_counts = np.array([len(e) for e in encoded], np.int64)
    self.truncated = self.token_counts > max_prompt_length
    self.num_truncated = int(self.truncated.sum())
    if self.num_truncated and log_truncated:
      logging.warning(
          "%d of %d prompts are longer than max_prompt_length=%d tokens and were "
          "left-truncated (longest: %d tokens)",
          self.num_truncated,
          len(rows),
          max_prompt_length,
          self.token_counts.max(),
      )
    self.ids, self.mask = left_pad(encoded, max_prompt_length, tokenizer.pad_id)
    self.lengths = self.mask.sum(1)

  def __len__(self):
    return len(self.rows)

  def select(self, indices) -> "PromptData":
    """The rows at `indices` as their own PromptData (already tokenized: no re-encoding)."""
    indices = np.asarray(indices, np.int64)
    out = object.__new__(PromptData)
    out.rows = [self.rows[i] for i in indices]
    out.tokenizer = self.tokenizer
    out.texts = [self.texts[i] for i in indices]
    out.ids, out.mask = self.ids[indices], self.mask[indices]
    out.lengths = self.lengths[indices]
    out.token_counts = self.token_counts[indices]
    out.truncated = self.truncated[indices]
    out.num_truncated = int(out.truncated.sum())
    return out

  def width(self, indices, mode: str = "bucket") -> int:
    """Prompt columns for a batch of `indices` (pass the GLOBAL batch, so every process picks
    the same width): `mode` as in PROMPT_WIDTHS. Left padding only, so trimming drops columns
    that no row of the batch uses: positions come from the mask, and results are unchanged.
    Each width compiles the sampler and the update once; powers of two bound that count."""
    full = self.ids.shape[1]
    if mode == "max":
      return full
    if mode != "bucket":
      raise ValueError(f"prompt width mode {mode!r}: expected one of {PROMPT_WIDTHS}")
    return bucket_width(self.lengths[np.asarray(indices, np.int64)].max(), full)

  def batch(self, indices, width: int | None = None) -> dict:
    """prompt_ids, prompt_mask int32 [b, P] (P = `width` last columns, default all); rows and
    prompt texts (lists of length b)."""
    indices = np.asarray(indices, np.int64)
    cols = slice(self.ids.shape[1] - (width or self.ids.shape[1]), None)
    return dict(
        prompt_ids=self.ids[indices, cols],
        prompt_mask=self.mask[indices, cols],
        rows=[self.rows[i] for i in indices],
        prompts=[self.texts[i] for i in indices],
        indices=indices,
    )


def _short(prompt, n: int = 60) -> str:
  text = (
      prompt
      if isinstance(prompt, str)
      else " | ".join(f"{m['role']}: {m['content']}" for m in prompt)
  )
  return repr(text[:n] + ("..." if len(text) > n else ""))


def make_prompt_iterator(
    num_rows: int,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    rows=None,
):
  """A grain iterator of row-index batches: this process's part of each GLOBAL batch.

  Every process walks the same stream of global batches of `batch_size` row indices and keeps
  the positions `rows` of each (from `multihost.process_rows`: the rows of the global batch its
  devices hold; None: all). So the global batch is the same for any number of processes, and
  the iterator state (a few integers) is the same on every process.

  Epochs are exact: epoch e is `num_rows // batch_size` batches cut from its own permutation of
  the rows (shuffled with `seed`, a new permutation each epoch; the rows left over by the last
  partial batch sit out that epoch only), repeated `num_epochs` times (None: forever). Batch j
  belongs to epoch j // batches_per_epoch, whatever the iterator was restored from. Fewer rows
  than one batch (num_epochs=None only): batches run on across the epochs' permutations.
  """
  per_epoch = num_rows // batch_size
  if per_epoch == 0 and num_epochs is not None:
    raise ValueError(f"{num_rows} rows cannot fill one batch of {batch_size}")
  order = grain.MapDataset.source(np.arange(num_rows, dtype=np.int64))
  if shuffle:
    order = order.shuffle(seed=seed)  # epoch-aware: index e * num_rows + i is epoch e's i-th
  order = order.repeat()
  take = None if rows is None else np.asarray(rows, np.int64)

  def batch(j, _):
    start = (
        (j // per_epoch) * num_rows + (j % per_epoch) * batch_size if per_epoch else j * batch_size
    )
    out = np.fromiter((order[start + r] for r in range(batch_size)), np.int64, batch_size)
    return out if take is None else out[take]

  ds = grain.MapDataset.range(max(per_epoch, 1)).repeat(num_epochs).map_with_index(batch)
  # No prefetch threads: a batch of indices is cheap to compute, the loop prepares the next one
  # itself while the device runs the update (prompts.NextPrompts), and it peeks by
  # get_state/set_state, which with grain's default 16 threads restarts them (the costs:
  # benchmarks/README.md, "Figures behind design choices").
  return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


def batches_per_epoch(num_rows: int, batch_size: int) -> int:
  """Global batches in one epoch of make_prompt_iterator."""
  return num_rows // batch_size


def eval_batches(num_rows: int, batch_size: int, *, rows=None):
  """Deterministic one pass over all rows in global batches of `batch_size`; yields this
  process's positions `rows` of each (None: all) as (indices, valid) bool arrays.

  The last batch is filled up by repeating row indices with valid=False, so every batch has
  the same static shape (no recompilation) and the filler rows are excluded from metrics.
  """
  idx = np.arange(num_rows)
  rows = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
  for start in range(0, num_rows, batch_size):
    chunk = idx[start : start + batch_size]
    valid = np.ones(batch_size, bool)
    if len(chunk) < batch_size:
      valid[len(chunk) :] = False
      chunk = np.concatenate([chunk, np.resize(chunk, batch_size - len(chunk))])
    yield chunk[rows], valid[rows]


def sft_batch(data: PromptData, indices, completion_length: int) -> dict:
  """Teacher-forcing batch: [prompt (left-padded); demonstration + eos (right-padded)].

  tokens, attention_mask int32 [b, P + C]; loss_mask [b, C] marks the demonstration tokens
  (eos included) whose log-probs the SFT loss maximizes: not the tool responses a demonstration
  holds (context the model reads but did not write: data/tool_traces.py). Longer
  demonstrations are cut at C.
  """
  tok = data.tokenizer
  b = data.batch(indices)
  comps, contexts = [], []
  for r in b["rows"]:
    if "demonstration" not in r:
      raise ValueError(
          "sft_steps > 0 needs rows with a 'demonstration' field (the dataset "
          f"{r.get('data_source')!r} has none)"
      )
    ids, context = tool_traces.encode_with_context(tok, r["demonstration"])
    comps.append((ids + [tok.eos_id])[:completion_length])
    contexts.append((context + [0])[:completion_length])
  comp_ids = np.full((len(comps), completion_length), tok.pad_id, np.int32)
  comp_mask = np.zeros((len(comps), completion_length), np.int32)
  loss_mask = np.zeros((len(comps), completion_length), np.int32)
  for i, (c, context) in enumerate(zip(comps, contexts)):
    comp_ids[i, : len(c)] = c
    comp_mask[i, : len(c)] = 1
    loss_mask[i, : len(c)] = 1 - np.asarray(context, np.int32)
  return dict(
      tokens=np.concatenate([b["prompt_ids"], comp_ids], 1),
      attention_mask=np.concatenate([b["prompt_mask"], comp_mask], 1),
      loss_mask=loss_mask,
  )
