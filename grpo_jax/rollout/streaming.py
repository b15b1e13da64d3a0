"""Streaming rollouts: several steps' rows in flight in the slot engine, the loop's view.

    stream = engine.stream()                     # NativeEngine with rollout.slots > 0
    stream.reset(generation, rows_per_step=B * G)
    stream.set_weights(params, version=3)        # after each update: lands between chunks
    stream.enqueue(step, prompt, key)            # prompt: global {"ids", "mask"} [B, P]
    rollout, versions = stream.wait(step)        # advances until `step`'s rows are done
    rollout, versions, groups = stream.wait_first(step, due=step - k)  # partial rollouts
    stream.in_flight()                           # steps enqueued, not taken

rollout/source.py drives it when rollout.slots > 0 and rollout.max_staleness = k >= 1: the
prompts of up to k steps ahead are queued, so a step's free slots take the next steps' groups
while its last rows finish, and a row may straddle weight versions. Each token keeps the
log-prob under the weights that drew it and that version (versions [N, C] int32, 0 where
masked): the loss's old log-probs are the sampler's (the behaviour policy's).

Partial rollouts (rollout.partial_rollout, `wait_first`): a step's batch is the first B whole
groups to finish among all groups in flight, whichever step queued them (`first_finished`);
a group still running keeps its slots and trains in a later step, at the latest in step
u + k for a group queued for step u (that step waits for it).
"""

import numpy as np

from grpo_jax.parallel import multihost

from grpo_jax.rollout.slots import SlotEngine
from grpo_jax.rollout.types import Rollout


class Stream:
  """The slot engine (rollout/slots.py) behind the loop's streaming calls; `to_sampler` maps
  the policy's trained params to the sampler's weights (NativeEngine's mapping)."""

  def __init__(self, slots: SlotEngine, to_sampler):
    self.slots, self.to_sampler = slots, to_sampler
    self._steps = []  # enqueued, not taken, oldest first

  def reset(self, generation, *, rows_per_step: int):
    """Empties the engine (rows in flight are dropped) for a generation config and a step's
    row count B * G."""
    self.slots.reset(generation, rows_per_step=rows_per_step)
    self._steps = []

  def set_weights(self, params, version: int):
    """The trained params after `version` updates: every decode chunk from now on draws from
    them (rows in flight continue under them, their keys/values recomputed)."""
    self.slots.set_weights(self.to_sampler(params), version)

  def enqueue(self, step: int, prompt: dict, key, caps=None):
    """Queues the B prompts of `step` (global {"ids", "mask"} [B, P]), G rows each, row r
    drawn with fold_in(key, r); caps: optional per-row completion budgets [B*G] (tests)."""
    self.slots.enqueue(step, prompt["ids"], prompt["mask"], key, caps=caps)
    self._steps.append(step)

  def wait(self, step: int) -> tuple[Rollout, object]:
    """Runs decode chunks (admitting queued groups into free slots) until every row of `step`
    has stopped -> (its Rollout [N, C], versions int32 [N, C]: the weight version that drew
    each token, 0 where masked)."""
    while not self.slots.finished(step):
      self.slots.advance(tag=step)
    self._steps.remove(step)
    return self.slots.take(step)

  def wait_first(self, step: int, *, due: int) -> tuple[Rollout, object, np.ndarray]:
    """Partial rollouts: runs decode chunks until the batch of `step` can be made: B whole
    groups finished, among them every untaken group of a step <= `due` (the staleness
    bound: the loop passes step - k) -> (their Rollout [N, C], versions [N, C], groups int
    [B, 2]: each group's (step it was queued for, index in that step's prompts), oldest
    first). The choice is the engine's first process's, on every process (one whose devices
    are not the engine's schedules nothing)."""
    b = self.slots._rows_per_tag // self.slots.g
    chosen = np.zeros((b, 2), np.int64)
    if self.slots.local:
      while True:
        picked = first_finished(
            self.slots.finished_groups(), self.slots.untaken(), batch_groups=b, due=due
        )
        if picked is not None:
          break
        if not self.slots.running():
          raise RuntimeError(f"step {step}: fewer than {b} groups in flight (a scheduling bug)")
        # (admission inside the decode: the chunk runs until a group's rows could complete it)
        missing = b - len(self.slots.finished_groups())
        self.slots.advance(rows=self.slots.g * max(1, missing))
      chosen = np.array(picked, np.int64)
    chosen = multihost.from_mesh_to_all(chosen, self.slots.mesh)
    rollout, versions = self.slots.take_groups([(int(t), int(i)) for t, i in chosen])
    self._steps = [t for t in self._steps if t in self.slots.untaken()]
    return rollout, versions, chosen

  def in_flight(self) -> list[int]:
    """The steps enqueued and not yet taken, oldest first."""
    return list(self._steps)

  def stats(self) -> dict[str, float]:
    """rollout/slots_busy: live slots / slots over the decode steps since `reset`, on every
    process (sent from the sampler's: a collective, every process calls it)."""
    stats = self.slots.stats()  # {} on a process without the sampler's devices
    steps, live = multihost.from_mesh_to_all(
        np.array([stats.get("steps", 0), stats.get("live_steps", 0)], np.int32), self.slots.mesh
    )
    return {"rollout/slots_busy": float(live) / max(1, int(steps) * self.slots.num_slots)}


def first_finished(finished, untaken: dict, *, batch_groups: int, due: int):
  """Partial rollouts' scheduling rule. finished: the finished, untaken groups (tag, index)
  in the order they finished (SlotEngine.finished_groups: by decode chunk, then oldest
  enqueued); untaken: tag -> its untaken groups' indices, finished or not; due: every untaken
  group of a tag <= due must be in this batch. -> `batch_groups` groups: those that must,
  then the first to finish, sorted oldest enqueued first; None while that cannot be made (a
  group that must train is running, or fewer than `batch_groups` have finished)."""
  must = {(t, i) for t, groups in untaken.items() if t <= due for i in groups}
  if len(must) > batch_groups:
    raise RuntimeError(f"{len(must)} groups are due in a batch of {batch_groups} (a bug)")
  if len(finished) < batch_groups or not must <= set(finished):
    return None
  rest = [grp for grp in finished if grp not in must]
  return sorted([*must, *rest[: batch_groups - len(must)]])


def steps_in_flight(config) -> int:
  """The steps whose rows the slot engine holds at once (its output rows): k + 1 streaming
  (this step's and the k queued), 2k + 1 with partial rollouts (also the k before, whose late
  groups may still run)."""
  k = config.rollout.max_staleness
  return 2 * k + 1 if config.rollout.partial_rollout else k + 1
