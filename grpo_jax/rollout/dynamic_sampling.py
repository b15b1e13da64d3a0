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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.parallel import multihost


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
  return {
      "prompt": jax.tree.map(lambda x: x[groups], cat["prompt"]),
      "rows": jax.tree.map(lambda x: x[rows], cat["rows"]),
  }


def _left_pad_to_widest(xs):
  """One leaf of every round; [B, P_r] prompt columns left-padded with zeros (masked) to the
  widest P_r."""
  if xs[0].ndim < 2:
    return xs
  width = max(x.shape[1] for x in xs)
  return [jnp.pad(x, [(0, 0), (width - x.shape[1], 0)] + [(0, 0)] * (x.ndim - 2)) for x in xs]


def choose(config, first, draw, key, mesh, take_groups):
  """The loop's dynamic sampling: rounds of `draw(key)` until they hold
  batch_size groups with signal (at most loss.max_resample_rounds more), the same choice on
  every process. `first`: the step's first round; `take_groups`: `take` jitted with row-sharded
  outputs. -> (prompt, rollout, host) of the chosen groups, and the figures to log."""
  G, B = config.num_generations, config.batch_size
  rounds = [first]
  flags = [global_flags(first[2]["rewards"], G, mesh, B)]
  while len(rounds) <= config.loss.max_resample_rounds and sum(map(np.sum, flags)) < B:
    rounds.append(draw(jax.random.fold_in(key, multihost.replicated(np.uint32(len(rounds)), mesh))))
    flags.append(global_flags(rounds[-1][2]["rewards"], G, mesh, B))
  stats = {
      "dynamic_sampling/rounds": len(rounds),
      "dynamic_sampling/groups_sampled": B * len(rounds),
      "dynamic_sampling/signal_groups_sampled": int(sum(map(np.sum, flags))),
  }
  chosen = picks(flags, B)
  if len(rounds) == 1 and np.array_equal(chosen, np.arange(B)):
    return (*first, stats)
  put = functools.partial(multihost.to_global, mesh=mesh, global_rows=B * G)
  names = list(first[2]["per_function"])
  out = take_groups(
      [
          {
              "prompt": prompt,
              "rows": {
                  "rollout": rollout,
                  "rewards": put(host["rewards"]),
                  **{k: put(np.asarray(host["per_function"][k], np.float32)) for k in names},
              },
          }
          for prompt, rollout, host in rounds
      ],
      multihost.replicated(chosen.astype(np.int32), mesh),
  )
  rollout, rows = out["rows"]["rollout"], out["rows"]
  tokens, mask, truncated, rewards, per_function = multihost.local_rows(
      (
          rollout.tokens,
          rollout.mask,
          rollout.truncated,
          rows["rewards"],
          {k: rows[k] for k in names},
      )
  )
  host = dict(
      tokens=tokens,
      mask=mask,
      truncated=truncated,
      rewards=rewards,
      per_function=per_function,
      errors=sum(h["errors"] for _, _, h in rounds),
  )
  return out["prompt"], rollout, host, stats
