"""The loop's prompts: the train/eval prompt sets, a step's batch, the next batch ahead.

train_data, eval_data = prompt_data(config, tokenizer)
prompts = NextPrompts(config, train_data, train_iter, mesh)
batch, prompt = prompts.take()   # this process's rows (host) + global {"ids", "mask"}
prompts.prefetch()               # while the device runs the update
"""

from absl import logging
import numpy as np

from grpo_jax import data as data_lib
from grpo_jax.data import checks
from grpo_jax.parallel import multihost


def prompt_data(config, tokenizer, system_prompt: str | None = None):
  """Train and eval prompts, rendered, tokenized and left-padded once, after the start-up
  checks of data/checks.py: ground truths the scorers can match, prompts that fit.
  system_prompt: the system turn's text (default: data.system_prompt's; with tools, the
  loop's adds their schemas: rollout/turns.py)."""
  if tokenizer.vocab_size > config.model.vocab_size and not config.model.hf_path:
    raise ValueError(
        f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size="
        f"{config.model.vocab_size}: set --config.model.vocab_size >= "
        f"{tokenizer.vocab_size}"
    )
  train_rows, eval_rows = data_lib.load_rows(config)
  if config.eval.num_examples:
    eval_rows = eval_rows[: config.eval.num_examples]
  offsets = {split: checks.first_row(config, split, len(train_rows)) for split in ("train", "eval")}
  for split, rows in (("train", train_rows), ("eval", eval_rows)):
    problem = checks.ground_truths(config, rows, split, row_offset=offsets[split])
    if problem and problem[1]:
      raise data_lib.DataError(problem[0])
    if problem:
      logging.warning("%s", problem[0])
  kw = dict(
      template=config.data.template,
      max_prompt_length=config.max_prompt_length,
      system_prompt=(
          data_lib.system_prompt(config.data.system_prompt)
          if system_prompt is None
          else system_prompt
      ),
      log_truncated=config.data.overlong_prompts != "error",
  )
  train_data = data_lib.PromptData(train_rows, tokenizer, **kw)
  checks.prompt_lengths(config, train_data, "train", row_offset=offsets["train"])
  eval_data = data_lib.PromptData(eval_rows, tokenizer, **kw)
  checks.prompt_lengths(config, eval_data, "eval", row_offset=offsets["eval"])
  if config.data.overlong_prompts == "drop" and train_data.num_truncated:
    keep = np.flatnonzero(~train_data.truncated)
    if not len(keep):
      raise ValueError(
          f"every train prompt is longer than max_prompt_length="
          f"{config.max_prompt_length} tokens. Fix: raise max_prompt_length, or "
          "set data.overlong_prompts=truncate"
      )
    logging.warning(
        "data.overlong_prompts=drop: %d of %d train prompts dropped",
        train_data.num_truncated,
        len(train_data),
    )
    train_data = train_data.select(keep)
  return train_data, eval_data


def prompt_batch(config, train_data, indices_b, mesh) -> dict:
  """This process's rows of the global batch `indices_b` [B], as PromptData.batch gives them,
  at the width data.prompt_width picks from the whole global batch (the same on every
  process)."""
  return dict(
      train_data.batch(
          indices_b[multihost.process_rows(mesh, config.batch_size)],
          train_data.width(indices_b, config.data.prompt_width),
      ),
      global_rows=config.batch_size,
  )


class NextPrompts:
  """The prompt batches of the loop (GRPO step 1), the next one prepared ahead.

  `take()` gives the next batch: this process's rows (`prompt_batch`) and the global prompt
  arrays. `prefetch()` prepares the batch the next `take()` will give, to be called while the
  device runs the update, so the host work (the row gather, the padding, the transfers) does
  not leave the device idle at the start of the next step. It peeks: the data iterator is put
  back where it was, and only `take()` moves it on, so a checkpoint written in between records
  the iterator exactly as without the prefetch (resume stays exact)."""

  def __init__(self, config, train_data, train_iter, mesh):
    self.config, self.data, self.it, self.mesh = config, train_data, train_iter, mesh
    self._ahead = None  # (iterator state before, state after, prepared batch)

  def of(self, indices_b):
    """The batch of the train rows `indices_b` [B] (global, the same on every process), as
    `take()` gives one; the iterator is not touched (partial rollouts' batches of groups
    queued in several steps)."""
    return self._prepare(np.asarray(indices_b))

  def _prepare(self, indices_b):
    batch = prompt_batch(self.config, self.data, indices_b, self.mesh)
    batch["indices"] = np.asarray(indices_b)  # each prompt's train row (global)
    rows = self.config.batch_size
    return batch, {
        "ids": multihost.to_global(batch["prompt_ids"], self.mesh, rows),
        "mask": multihost.to_global(batch["prompt_mask"], self.mesh, rows),
    }

  def prefetch(self):
    """Prepares the batch the next `take()` gives (once: again is a no-op until it is taken)."""
    before = self.it.get_state()
    if self._ahead is not None and self._ahead[0] == before:
      return
    indices_b = next(self.it)
    after = self.it.get_state()
    self.it.set_state(before)
    self._ahead = (before, after, self._prepare(indices_b))

  def peek(self) -> dict | None:
    """The prefetched batch's global prompt arrays {"ids", "mask"}, if any."""
    return None if self._ahead is None else self._ahead[2][1]

  def take(self):
    ahead, self._ahead = self._ahead, None
    if ahead is not None and ahead[0] == self.it.get_state():
      self.it.set_state(ahead[1])
      return ahead[2]
    return self._prepare(next(self.it))
