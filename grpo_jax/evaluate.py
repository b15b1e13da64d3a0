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
from grpo_jax import sharding
from grpo_jax.data import pipeline
from grpo_jax.rewards import eval_flags


def evaluate(engine, params, data: pipeline.PromptData, *, generation_configs, batch_size: int,
             rng, decode, rows=None) -> dict[str, dict[str, float]]:
  """-> {generation config: {"accuracy", "partial_accuracy", "format_accuracy", "num_examples"}}.

  `engine` is a rollout engine with num_generations=1 (rollout/engine.py);
  `decode(token_ids, mask) -> str`. `batch_size` is the global batch (a multiple of the
  data-parallel size: `global_batch_size`); each process takes its `rows` of every batch
  (`multihost.process_rows`; None: all, one process).
  """
  results = {}
  for gi, name in enumerate(generation_configs):
    t0 = time.time()
    counts = np.zeros(4, np.float64)  # correct, partial, formatted, examples
    for bi, (indices, valid) in enumerate(pipeline.eval_batches(len(data), batch_size,
                                                                rows=rows)):
      batch = data.batch(indices)
      rollout = engine.generate(params, batch, jax.random.fold_in(rng, gi * 100_003 + bi), name)
      tokens, mask = multihost.local_rows((rollout.tokens, rollout.mask))
      for row, ok in enumerate(valid):
        if not ok:
          continue
        text = decode(tokens[row], mask[row])
        flags = eval_flags(text, batch["rows"][row]["ground_truth"])
        counts += (*flags, 1)
    counts = multihost.sum_over_processes(counts)
    n = max(counts[3], 1)
    results[name] = {"accuracy": float(counts[0] / n), "partial_accuracy": float(counts[1] / n),
                     "format_accuracy": float(counts[2] / n), "num_examples": int(counts[3])}
    logging.info("eval %-8s accuracy=%.3f partial=%.3f format=%.3f (%d examples, %.1fs)", name,
                 *(results[name][k] for k in ("accuracy", "partial_accuracy",
                                              "format_accuracy")), int(counts[3]),
                 time.time() - t0)
  return results


def global_batch_size(total: int, mesh) -> int:
  """`total` prompts per eval batch, rounded up to fill the data-parallel devices."""
  dp = sharding.data_parallel_size(mesh)
  return -(-max(total, 1) // dp) * dp


class Evaluator:
  """Held-out evaluation of a run: `evaluator(params, step, rng)` evaluates `data` with each
  of config.eval.generation_configs, writes eval/* scalars at `step` and returns the results.
  `evaluator.accuracy(params, data, rng)`: greedy accuracy on other rows (SFT early stopping).
  """

  def __init__(self, config, engine, data: pipeline.PromptData, mesh, *, decode, writer):
    self.engine = engine
    self.data = data
    self.generation_configs = tuple(config.eval.generation_configs)
    self.batch_size = global_batch_size(config.eval.batch_size, mesh)
    self.rows = multihost.process_rows(mesh, self.batch_size)
    self.decode = decode
    self.writer = writer

  def __call__(self, params, step: int, rng) -> dict:
    results = evaluate(self.engine, params, self.data,
                       generation_configs=self.generation_configs,
                       batch_size=self.batch_size, rng=rng, decode=self.decode, rows=self.rows)
    self.writer.write_scalars(step, as_scalars(results))
    return results

  def accuracy(self, params, data: pipeline.PromptData, rng) -> float:
    results = evaluate(self.engine, params, data, generation_configs=("greedy",),
                       batch_size=self.batch_size, rng=rng, decode=self.decode, rows=self.rows)
    return results["greedy"]["accuracy"]


def log_results(what: str, results: dict):
  for name, r in results.items():
    logging.info("eval %s [%s]: accuracy=%.3f partial=%.3f format=%.3f", what, name,
                 r["accuracy"], r["partial_accuracy"], r["format_accuracy"])


def as_scalars(results: dict) -> dict[str, float]:
  """{"eval/accuracy/greedy": ..., ...} for TensorBoard."""
  out = {}
  for name, r in results.items():
    for k in ("accuracy", "partial_accuracy", "format_accuracy"):
      out[f"eval/{k}/{name}"] = r[k]
  return out
