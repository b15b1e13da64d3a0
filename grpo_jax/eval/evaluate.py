"""Held-out evaluation with named generation configs (greedy / standard / liberal).

Every prompt of the eval split gets one greedy completion, and `eval.num_samples` (n) samples
under each sampling config; each completion is scored by its row's task (eval/tasks.py: math
accuracy/partial/format, ROUGE for summarization, code pass rate, exact match), and with n > 1
the sampling configs also report pass@k (unbiased, k in `eval.pass_k`). Each process scores
its own rows; sums are combined over processes, so the figures are over the whole split.
"""

import time

from absl import logging
import jax
import numpy as np

from grpo_jax.eval import tasks as eval_tasks
from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding
from grpo_jax.data import pipeline


def evaluate(
    engines,
    params,
    data: pipeline.PromptData,
    *,
    generation_configs,
    batch_size: int,
    rng,
    decode,
    rows=None,
    ks=(),
    mesh=None,
) -> dict[str, dict[str, float]]:
  """-> {generation config: {metric: value, ..., "num_examples"}} (metrics: eval/tasks.py).

  `engines(name) -> (rollout engine, samples per prompt)` for a generation config;
  `decode(token_ids, mask) -> str`. `batch_size` is the global batch of prompts (a multiple
  of the data-parallel size: `global_batch_size`); each process takes its `rows` of every
  batch (`multihost.process_rows`; None: all, one process). `ks`: pass@k for configs with
  more than one sample per prompt. `mesh`: the one `rng` is replicated over (batch keys are
  folded in there; needed on a process without devices in it).
  """
  results = {}
  for gi, name in enumerate(generation_configs):
    t0 = time.time()
    engine, n = engines(name)
    tally = eval_tasks.Tally(ks if n > 1 else ())
    for bi, (indices, valid) in enumerate(pipeline.eval_batches(len(data), batch_size, rows=rows)):
      batch = dict(data.batch(indices), global_rows=batch_size)
      n_key = gi * 100_003 + bi
      key = (
          jax.random.fold_in(rng, n_key)
          if mesh is None
          else jax.random.fold_in(rng, multihost.replicated(np.uint32(n_key), mesh))
      )
      rollout = engine.generate(params, batch, key, name)
      tokens, mask = multihost.local_rows((rollout.tokens, rollout.mask))
      real = [p for p, ok in enumerate(valid) if ok]  # this process's prompts, not padding
      tally.add(
          [decode(tokens[p * n + j], mask[p * n + j]) for p in real for j in range(n)],
          [batch["rows"][p] for p in real for _ in range(n)],
          n,
      )
    results[name] = tally.results(multihost.sum_over_processes(tally.sums))
    logging.info(
        "eval %-8s %s (%d examples x %d, %.1fs)",
        name,
        _line(results[name]),
        results[name]["num_examples"],
        n,
        time.time() - t0,
    )
  return results


def _line(result: dict) -> str:
  return " ".join(f"{k}={v:.3f}" for k, v in result.items() if k != "num_examples")


def global_batch_size(total: int, mesh) -> int:
  """`total` prompts per eval batch, rounded up to fill the data-parallel devices."""
  dp = sharding.data_parallel_size(mesh)
  return -(-max(total, 1) // dp) * dp


class Evaluator:
  """Held-out evaluation of a run: `evaluator(params, step, rng)` evaluates `data` with each
  of config.eval.generation_configs, writes eval/* scalars at `step` and returns the results.
  `evaluator.accuracy(params, data, rng)`: the greedy headline metric on other rows (SFT
  early stopping). `sample_engine` (num_generations = eval.num_samples) serves the sampling
  configs when eval.num_samples > 1.
  """

  def __init__(
      self, config, engine, data: pipeline.PromptData, mesh, *, decode, writer, sample_engine=None
  ):
    self.engine = engine
    self.num_samples = config.eval.num_samples if sample_engine is not None else 1
    self.sample_engine = sample_engine
    self.ks = tuple(config.eval.pass_k) or eval_tasks.default_ks(self.num_samples)
    self.data = data
    self.generation_configs = tuple(config.eval.generation_configs)
    self.batch_size = global_batch_size(config.eval.batch_size, mesh)
    self.rows = multihost.process_rows(mesh, self.batch_size)
    self.decode = decode
    self.writer = writer
    self.mesh = mesh

  def _engines(self, name):
    if name == "greedy" or self.sample_engine is None:
      return self.engine, 1
    return self.sample_engine, self.num_samples

  def __call__(self, params, step: int, rng) -> dict:
    results = evaluate(
        self._engines,
        params,
        self.data,
        generation_configs=self.generation_configs,
        batch_size=self.batch_size,
        rng=rng,
        decode=self.decode,
        rows=self.rows,
        ks=self.ks,
        mesh=self.mesh,
    )
    self.writer.write_scalars(step, as_scalars(results))
    return results

  def accuracy(self, params, data: pipeline.PromptData, rng) -> float:
    results = evaluate(
        lambda name: (self.engine, 1),
        params,
        data,
        generation_configs=("greedy",),
        batch_size=self.batch_size,
        rng=rng,
        decode=self.decode,
        rows=self.rows,
        mesh=self.mesh,
    )
    return eval_tasks.primary_metric(results["greedy"])[1]


def log_results(what: str, results: dict):
  for name, r in results.items():
    logging.info("eval %s [%s]: %s", what, name, _line(r))


def as_scalars(results: dict) -> dict[str, float]:
  """{"eval/accuracy/greedy": ..., ...} for TensorBoard, and for the greedy config also the
  plain names ("eval/accuracy", "eval/partial_accuracy", "eval/format_accuracy", ...)."""
  out = {}
  for name, r in results.items():
    for k, v in r.items():
      if k != "num_examples":
        out[f"eval/{k}/{name}"] = v
        if name == "greedy":
          out[f"eval/{k}"] = v
  return out
