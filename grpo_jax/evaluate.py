"""Held-out evaluation with named generation configs (greedy / standard / liberal).

For every prompt of the eval split, one completion per generation config; each is scored by
`rewards.eval_flags` into accuracy (the answer equals the ground truth), partial_accuracy
(within 10%) and format_accuracy. Each process scores its own rows; sums are combined over
processes, so the fractions are over the whole split.
"""
import time

from absl import logging
import jax
import numpy as np

from grpo_jax import multihost
from grpo_jax.data import pipeline
from grpo_jax.rewards import eval_flags


def evaluate(sampler, params, data: pipeline.PromptData, mesh, *, generation_configs,
             batch_size: int, rng, decode) -> dict[str, dict[str, float]]:
  """-> {generation config: {"accuracy", "partial_accuracy", "format_accuracy", "num_examples"}}.

  `sampler` is a rollout.Sampler with num_generations=1; `decode(token_ids, mask) -> str`.
  `batch_size` is per process and must divide over the data-parallel devices.
  """
  results = {}
  for gi, name in enumerate(generation_configs):
    t0 = time.time()
    counts = np.zeros(4, np.float64)  # correct, partial, formatted, examples
    for bi, (indices, valid) in enumerate(pipeline.eval_batches(len(data), batch_size)):
      batch = data.batch(indices)
      rollout = sampler(params, multihost.to_global(batch["prompt_ids"], mesh),
                        multihost.to_global(batch["prompt_mask"], mesh),
                        jax.random.fold_in(rng, gi * 100_003 + bi), name)
      tokens = multihost.local_rows(rollout.tokens)
      mask = multihost.local_rows(rollout.mask)
      for row, ok in enumerate(valid):
        if not ok:
          continue
        text = decode(tokens[row], mask[row])
        flags = eval_flags(text, batch["rows"][row]["ground_truth"])
        counts += (*flags, 1)
    counts = multihost.sum_over_processes(counts)
    n = max(counts[3], 1)
    results[name] = {"accuracy": counts[0] / n, "partial_accuracy": counts[1] / n,
                     "format_accuracy": counts[2] / n, "num_examples": int(counts[3])}
    logging.info("eval %-8s accuracy=%.3f partial=%.3f format=%.3f (%d examples, %.1fs)", name,
                 *(results[name][k] for k in ("accuracy", "partial_accuracy",
                                              "format_accuracy")), int(counts[3]),
                 time.time() - t0)
  return results


def as_scalars(results: dict) -> dict[str, float]:
  """{"eval/accuracy/greedy": ..., ...} for TensorBoard."""
  out = {}
  for name, r in results.items():
    for k in ("accuracy", "partial_accuracy", "format_accuracy"):
      out[f"eval/{k}/{name}"] = r[k]
  return out
