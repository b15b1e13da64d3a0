"""Checks around the rollout engine's weights that need no vLLM: the sampler/trainer log-prob
gap stop in StepLog (rollout.max_logprob_gap), the vLLM sync settings' validation, and the
probe/tolerance helpers of rollout/vllm_engine.py (tests/rollout/test_vllm.py runs the real sync).
"""

import logging

import numpy as np
import pytest

from configs import common
from grpo_jax import configuration
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.rollout import vllm_engine

GAP = "rollout/logprob_abs_diff_mean"


class _Writer:

  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars, global_step=None):
    self.rows.append((step, dict(scalars)))

  def flush(self):
    pass


def _log(max_logprob_gap, patience=3):
  writer = _Writer()
  log = metrics_lib.StepLog(
      writer,
      metrics_lib.Progress(100),
      num_rows=1,
      max_consecutive_nonfinite=5,
      max_logprob_gap=max_logprob_gap,
      gap_patience=patience,
  )
  return log, writer


def _step(log, step, gap):
  log.add(
      step,
      means={},
      totals={},
      host={},
      device={GAP: np.float32(gap), "nonfinite_streak": np.int32(0)},
  )


def test_gap_over_the_threshold_warns_then_stops_after_patience(caplog):
  log, writer = _log(0.1, patience=3)
  caplog.set_level(logging.WARNING)
  for step, gap in enumerate([0.05, 0.2, 0.3], 1):  # one under, two over: two warnings
    _step(log, step, gap)
    log.flush()
  warnings = [r.getMessage() for r in caplog.records if "max_logprob_gap" in r.getMessage()]
  assert len(warnings) == 2 and "0.3 > rollout.max_logprob_gap=0.1" in warnings[-1]
  assert "loss.tis_cap" in warnings[-1] and "(2/3 in a row" in warnings[-1]
  _step(log, 4, 0.25)
  with pytest.raises(RuntimeError, match="on 3 log intervals in a row") as e:
    log.flush()
  assert "\n" not in str(e.value) and "Fix:" in str(e.value) and "loss.tis_cap" in str(e.value)
  assert [s for s, _ in writer.rows] == [1, 2, 3, 4]  # the step is written before the stop


def test_gap_streak_resets_and_counts_flushes_not_steps():
  log, _ = _log(0.1, patience=2)
  _step(log, 1, 0.5)
  log.flush()
  _step(log, 2, 0.01)  # back under: the streak starts over
  log.flush()
  assert log.gap_streak == 0
  for step in (3, 4, 5):  # three steps over, one log interval
    _step(log, step, 0.5)
  log.flush()
  assert log.gap_streak == 1
  _step(log, 6, 0.15)
  _step(log, 7, 0.0)  # one step over, but the interval's mean (0.075) is not
  log.flush()
  assert log.gap_streak == 0


def test_gap_check_off_by_default_and_without_the_metric():
  log, _ = _log(0.0)
  for step in range(1, 6):
    _step(log, step, 10.0)
    log.flush()
  log, _ = _log(0.1, patience=1)  # a sampler that is the trainer logs no gap
  log.add(1, means={}, totals={}, host={}, device={"nonfinite_streak": np.int32(0)})
  log.flush()
  assert log.gap_streak == 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("rollout.max_logprob_gap", -0.1),
        ("rollout.vllm.sync_tolerance", -1e-3),
        ("rollout.vllm.sync_timeout_sec", -1.0),
    ],
)
def test_sync_settings_are_validated(field, value):
  config = common.base()
  node = config
  *parents, leaf = field.split(".")
  for part in parents:
    node = node[part]
  node[leaf] = value
  errors = [
      e
      for e in configuration.validate(config, num_devices=1, num_processes=1)
      if e.startswith(f"{field}=")
  ]
  assert len(errors) == 1 and "must be >= 0" in errors[0] and "Fix:" in errors[0]


def test_defaults_and_helpers():
  c = common.base()
  assert c.rollout.vllm.verify_sync is True
  assert (c.rollout.vllm.sync_tolerance, c.rollout.vllm.sync_timeout_sec) == (0.0, 600.0)
  assert c.rollout.max_logprob_gap == 0.0
  assert vllm_engine.resolve_sync_tolerance(0.0, "float32") == 1e-3
  assert vllm_engine.resolve_sync_tolerance(0.0, "bfloat16") == 5e-2
  assert vllm_engine.resolve_sync_tolerance(0.2, "float32") == 0.2
  # 16-bit: 3x the start-up difference, within [5e-2, 1]; float32 ignores it; a setting wins.
  assert vllm_engine.resolve_sync_tolerance(0.0, "bfloat16", 0.2) == pytest.approx(0.6)
  assert vllm_engine.resolve_sync_tolerance(0.0, "float16", 1e-3) == 5e-2
  assert vllm_engine.resolve_sync_tolerance(0.0, "bfloat16", 5.0) == 1.0
  assert vllm_engine.resolve_sync_tolerance(0.0, "float32", 0.2) == 1e-3
  assert vllm_engine.resolve_sync_tolerance(0.3, "bfloat16", 0.2) == 0.3
  probe = vllm_engine.make_probe(16, 32, avoid=(0, 1, 2), seed=1)
  assert probe.shape == (32,) and probe.min() >= 3 and probe.max() < 16
  np.testing.assert_array_equal(probe, vllm_engine.make_probe(16, 32, avoid=(0, 1, 2), seed=1))
