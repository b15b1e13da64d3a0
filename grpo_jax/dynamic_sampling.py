"""DAPO dynamic sampling (Yu et al. 2025, sec. 3.2): every step trains on `batch_size` groups
that carry a learning signal.

A group whose G rewards are all equal has advantage 0 everywhere: it only shrinks the batch.
With `loss.dynamic_sampling`, the loop samples up to `loss.max_resample_rounds` more rounds of
prompts (each a full rollout + scoring of a fresh global batch from the train iterator) until
the rounds hold `batch_size` signal groups, then trains on the first `batch_size` of them in
sampling order (round by round, group by group). Groups still missing after the last round are
filled with zero-variance groups, which the update masks out of the loss (as without
resampling), so the batch shape never changes.

The choice is global: every process learns every group's flag (`global_flags`, one small
cross-process sum) and computes the same indices, and the chosen rows are gathered on the
device from the rounds' global arrays (`take`). So a step's batch is the same for any number of
processes, like every batch of the loop.
"""
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import multihost


def has_signal(rewards_n: np.ndarray, group_size: int) -> np.ndarray:
  """bool [b]: the groups whose rewards are not all equal (rewards group-major [b*G])."""
  r_bg = np.asarray(rewards_n).reshape(-1, group_size)
  return np.any(r_bg != r_bg[:, :1], axis=-1)


def global_flags(local_rewards_n: np.ndarray, group_size: int, mesh, batch_size: int):
  """has_signal for all B groups of a global batch, on every process, from each process's
  rewards of its own rows (at multihost.process_rows). bool [B]."""
  flags = np.zeros(batch_size, np.int32)
  flags[multihost.process_rows(mesh, batch_size)] = has_signal(local_rewards_n, group_size)
  return multihost.sum_over_processes(flags) > 0


def picks(flags: list[np.ndarray], quota: int) -> np.ndarray:
  """Indices into the rounds' groups laid end to end (round r, group g -> r * B + g): the first
  `quota` signal groups in sampling order, then zero-variance ones if the rounds ran out."""
  flat = np.concatenate(flags)
  signal = np.flatnonzero(flat)
  return np.concatenate([signal, np.flatnonzero(~flat)])[:quota]


def take(rounds: list, groups: jax.Array, group_size: int):
  """The chosen groups of the rounds' global arrays. `rounds`: one pytree per round whose
  leaves are [B, ...] (per prompt: key "prompt") or [B*G, ...] (per completion: key "rows");
  `groups` [quota] from `picks`. Rounds whose prompts are narrower (data.prompt_width) are
  left-padded with masked columns to the widest. Jit it with row-sharded outputs."""
  rows = (groups[:, None] * group_size + jnp.arange(group_size)[None]).reshape(-1)
  cat = jax.tree.map(lambda *xs: jnp.concatenate(_left_pad_to_widest(xs), 0), *rounds)
  return {"prompt": jax.tree.map(lambda x: x[groups], cat["prompt"]),
          "rows": jax.tree.map(lambda x: x[rows], cat["rows"])}


def _left_pad_to_widest(xs):
  """One leaf of every round; [B, P_r] prompt columns left-padded with zeros (masked) to the
  widest P_r."""
  if xs[0].ndim < 2:
    return xs
  width = max(x.shape[1] for x in xs)
  return [jnp.pad(x, [(0, 0), (width - x.shape[1], 0)] + [(0, 0)] * (x.ndim - 2)) for x in xs]
