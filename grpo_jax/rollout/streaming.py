"""Streaming rollouts: several steps' rows in flight in the slot engine, the loop's view.

    stream = engine.stream()                     # NativeEngine with rollout.slots > 0
    stream.reset(generation, rows_per_step=B * G)
    stream.set_weights(params, version=3)        # after each update: lands between chunks
    stream.enqueue(step, prompt, key)            # prompt: global {"ids", "mask"} [B, P]
    rollout, versions = stream.wait(step)        # advances until `step`'s rows are done
    stream.in_flight()                           # steps enqueued, not taken

rollout/source.py drives it when rollout.slots > 0 and rollout.max_staleness = k >= 1: the
prompts of up to k steps ahead are queued, so a step's free slots take the next steps' groups
while its last rows finish, and a row may straddle weight versions. Each token keeps the
log-prob under the weights that drew it and that version (versions [N, C] int32, 0 where
masked): the loss's old log-probs are the sampler's (the behaviour policy's).
"""

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

  def enqueue(self, step: int, prompt: dict, key):
    """Queues the B prompts of `step` (global {"ids", "mask"} [B, P]), G rows each, row r
    drawn with fold_in(key, r)."""
    self.slots.enqueue(step, prompt["ids"], prompt["mask"], key)
    self._steps.append(step)

  def wait(self, step: int) -> tuple[Rollout, object]:
    """Runs decode chunks (admitting queued groups into free slots) until every row of `step`
    has stopped -> (its Rollout [N, C], versions int32 [N, C]: the weight version that drew
    each token, 0 where masked)."""
    while not self.slots.finished(step):
      self.slots.advance()
    self._steps.remove(step)
    return self.slots.take(step)

  def in_flight(self) -> list[int]:
    """The steps enqueued and not yet taken, oldest first."""
    return list(self._steps)

  def stats(self) -> dict[str, float]:
    """rollout/slots_busy: live slots / slots over the decode steps since `reset`."""
    stats = self.slots.stats()  # {} on a process without the sampler's devices
    return {"rollout/slots_busy": stats["busy"]} if stats else {}
