"""Off-policy rollouts (rollout.max_staleness) and the sampler's placement (rollout.placement):
the loop's RolloutSource, on the tiny config."""

import os

import jax
import numpy as np
import pytest

from grpo_jax import train
from tests.test_train import checkpoint_state
from tests.test_train import flat
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

KEYS = (
    "reward/total",
    "loss/policy_loss",
    "completions/mean_length",
    "loss/grad_norm",
    "rollout/staleness",
)


def test_one_step_off_resumes_exactly_with_its_rollout_in_flight(tmp_path):
  """max_staleness=1: step s trains on the rollout sampled from the weights after s - 1
  updates (staleness 1 from the second step on), and a run stopped after 3 steps, with step
  4's rollout in flight (saved with the checkpoint), resumes == a run never stopped."""
  straight = str(tmp_path / "straight")
  train.run(tiny_config(num_steps=6, **{"rollout.max_staleness": 1}), straight)
  split = str(tmp_path / "split")
  with pytest.raises(SystemExit):
    train.run(tiny_config(num_steps=6, max_steps_per_run=3, **{"rollout.max_staleness": 1}), split)
  _, saved = checkpoint_state(split, 3)
  assert len(saved["pending"]) == 1  # the rollout of step 4 travelled with checkpoint 3
  train.run(tiny_config(num_steps=6, max_steps_per_run=3, **{"rollout.max_staleness": 1}), split)
  a, b = grpo_rows(straight), grpo_rows(split)
  assert [r["rollout/staleness"] for r in a] == [0, 1, 1, 1, 1, 1]
  for ra, rb in zip(a, b, strict=True):
    for k in KEYS:
      assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
  fa, fb = flat(checkpoint_state(straight, 6)[1]["train"]), flat(
      checkpoint_state(split, 6)[1]["train"]
  )
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)

  # Step 1 is on-policy in both; from step 2 on the one-step-off run trains on older samples.
  on = str(tmp_path / "on")
  train.run(tiny_config(num_steps=2), on)
  c = grpo_rows(on)
  # (old log-probs: the trainer's there, the sampler's here: the same within float noise)
  assert c[0]["loss/policy_loss"] == pytest.approx(a[0]["loss/policy_loss"], abs=1e-5)
  assert c[0]["reward/total"] == a[0]["reward/total"]
  assert c[1]["completions/mean_length"] != a[1]["completions/mean_length"] or (
      c[1]["reward/total"] != a[1]["reward/total"]
  )


def test_disaggregated_on_policy_equals_colocated(tmp_path):
  """placement=disaggregated with max_staleness=0 (sampler on 4 of the 8 devices, trainer on
  the other 4, weights moved after each update) gives colocated's per-step figures (same
  seed), and max_staleness=1 runs there too, its rollout in flight through a resume."""
  col = str(tmp_path / "col")
  train.run(tiny_config(num_steps=3), col)
  dis = str(tmp_path / "dis")
  train.run(tiny_config(num_steps=3, **{"rollout.placement": "disaggregated"}), dis)
  a, b = grpo_rows(col), grpo_rows(dis)
  for ra, rb in zip(a, b, strict=True):
    for k in KEYS:
      assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k, ra[k], rb[k])
  assert all(r["perf/weight_sync_gb"] > 0 and r["perf/weight_sync_gb_per_sec"] > 0 for r in b)


PAIR_ARGS = [
    "--config=configs/tiny.py",
    "--config.sft_steps=0",
    "--config.sft.stop_at_accuracy=0",
    "--config.save_interval_steps=2",
    "--config.num_steps=4",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=64",
    "--config.eval.num_examples=16",
    "--config.eval.batch_size=16",
    "--config.log_interval_steps=1",
    "--config.optimizer.learning_rate=3e-3",
    "--config.reward.custom_file=tests/data/digit_count_reward.py",
    "--config.report_at_end=False",
    "--config.beta=0.02",
    "--config.loss.dynamic_sampling=True",
    "--config.loss.max_resample_rounds=1",
    "--config.rollout.placement=disaggregated",
    "--config.rollout.max_staleness=1",
]


def test_disaggregated_two_processes_equal_one_through_a_resume(tmp_path):
  """2 processes x 4 devices (the trainer on process 0's, the sampler on process 1's: each
  process holds one role only), one step off, stopped after 2 steps and relaunched == 1
  process x 8 devices run straight: the weights and batches cross processes only by the
  collectives of parallel/transfer.py."""
  from tests.parallel import test_multihost as mh

  single, pair = tmp_path / "single", tmp_path / "pair"
  mh._launch_single(str(single), base=PAIR_ARGS)
  for _ in range(2):
    out = mh._launch_pair(str(pair), "--config.max_steps_per_run=2", base=PAIR_ARGS)
    assert all(rc == 0 for rc, _ in out), out[0][1][-3000:] + out[1][1][-3000:]
  a, b = mh._logged(single), mh._logged(pair)
  grpo = sorted(k for k in a if k[0] == "grpo")
  assert [k[1] for k in grpo] == [1, 2, 3, 4] and grpo == sorted(k for k in b if k[0] == "grpo")
  assert [a[k]["rollout/staleness"] for k in grpo] == [0, 1, 1, 1]
  for k in grpo:
    for name, v in a[k].items():
      assert b[k][name] == pytest.approx(v, rel=1e-4, abs=1e-5), (k, name)
  _, pa = mh._final_params(single)
  _, pb = mh._final_params(pair)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
    np.testing.assert_allclose(x, y, atol=mh.PARAM_TOL)


@pytest.mark.slow  # ~40 s
def test_lora_disaggregated_moves_only_the_adapters(tmp_path):
  """LoRA policy, disaggregated and on-policy == colocated; after the first sync (base +
  adapters) each weight move carries only the adapters."""
  lora = {"lora.rank": 4, "lora.alpha": 8.0}
  col, dis = str(tmp_path / "col"), str(tmp_path / "dis")
  train.run(tiny_config(num_steps=3, **lora), col)
  train.run(tiny_config(num_steps=3, **lora, **{"rollout.placement": "disaggregated"}), dis)
  a, b = grpo_rows(col), grpo_rows(dis)
  for ra, rb in zip(a, b, strict=True):
    for k in KEYS:
      assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k, ra[k], rb[k])
  # A LoRA checkpoint's params are the adapters: each move is their f32 bytes, no more.
  adapters = sum(x.size for x in jax.tree.leaves(checkpoint_state(col)[1]["train"]["params"]))
  assert [r["perf/weight_sync_gb"] for r in b] == pytest.approx([4 * adapters / 1e9] * 3)


@pytest.mark.slow  # ~2 min on 2 cores: three 2-process runs
def test_disaggregated_kill_9_of_the_sampler_process_then_relaunch_resumes_exactly(tmp_path):
  """Disaggregated, one step off, 2 processes (trainer | sampler): kill -9 of the sampler's
  process after GRPO step 2's checkpoint (a rollout in flight, weight moves under way), the
  trainer's process exits 75 with one line; relaunching both resumes == a run never killed,
  bit for bit. A short SFT warm start first (the trainer's devices; its checkpoints and logs
  written by process 0 for both)."""
  import re
  import signal
  from etils import epath
  from grpo_jax.parallel import peers
  from tests.parallel import test_multihost as mh
  from tests.parallel import test_peer_exit as pe

  args = [*PAIR_ARGS, "--config.num_steps=6", "--config.sft_steps=4"]
  ref, run = epath.Path(tmp_path / "ref"), epath.Path(tmp_path / "run")
  for rc, err in mh._launch_pair(ref, base=args):
    assert rc == 0, err[-3000:]
  committed = run / "checkpoints" / "6" / "commit_success.txt"  # SFT's 4 + GRPO's 2
  rc, took, stderr = pe._kill_one(str(run), signal.SIGKILL, args=args, ready=committed.exists)
  assert rc == peers.EXIT_PEER_GONE and took < pe.EXIT_WITHIN_SEC, stderr[-3000:]
  for rc, err in mh._launch_pair(run, base=args):
    assert rc == 0, err[-3000:]
    assert re.search(r"resuming from \S+/checkpoints/\d+", err), err[-3000:]
  want, got = mh._logged(ref), mh._logged(run)
  assert sorted(want) == sorted(got)
  for key in want:
    assert want[key] == got[key], key


@pytest.mark.slow  # ~3 min on 2 cores: two 2-process runs and a relaunch
def test_streaming_disaggregated_kill_9_then_relaunch_resumes_exactly(tmp_path):
  """Streaming (the slot engine, max_staleness=1, rows straddling weight versions) with the
  sampler on process 1: kill -9 of that process after GRPO step 2's checkpoint, while later
  steps' rows are in the engine; relaunching both resumes == a run never killed, bit for bit
  (the source queues no step past a checkpoint it foresees, so nothing in flight is lost)."""
  import re
  import signal
  from etils import epath
  from grpo_jax.parallel import peers
  from tests.parallel import test_multihost as mh
  from tests.parallel import test_peer_exit as pe

  lockstep_only = ("dynamic_sampling", "max_resample_rounds")  # not with streaming
  args = [a for a in PAIR_ARGS if not any(k in a for k in lockstep_only)] + [
      "--config.num_steps=6",
      "--config.rollout.slots=16",
      "--config.rollout.slot_chunk=4",
  ]
  ref, run = epath.Path(tmp_path / "ref"), epath.Path(tmp_path / "run")
  for rc, err in mh._launch_pair(ref, base=args):
    assert rc == 0, err[-3000:]
  committed = run / "checkpoints" / "2" / "commit_success.txt"
  rc, took, stderr = pe._kill_one(str(run), signal.SIGKILL, args=args, ready=committed.exists)
  assert rc == peers.EXIT_PEER_GONE and took < pe.EXIT_WITHIN_SEC, stderr[-3000:]
  for rc, err in mh._launch_pair(run, base=args):
    assert rc == 0, err[-3000:]
    assert re.search(r"resuming from \S+/checkpoints/\d+", err), err[-3000:]
  want, got = mh._logged(ref), mh._logged(run)
  assert sorted(want) == sorted(got)
  assert max(want[k]["rollout/staleness"] for k in want if k[0] == "grpo") >= 1
  for key in want:
    assert want[key] == got[key], key


def test_token_staleness_counts_the_masked_tokens_of_every_row():
  """rollout/staleness_token_mean/_max: step minus each masked token's weight version, over
  the batch's tokens (padding and tool tokens, mask 0, count nowhere); no tokens: no figures."""
  from grpo_jax.rollout import source

  versions = np.array([[4, 4, 3, 0], [2, 2, 2, 2], [5, 5, 5, 5]])
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
  got = source.token_staleness(5, versions, mask)
  ages = [1, 1, 2, 3, 3]
  assert got == {
      "rollout/staleness": 3,
      "rollout/staleness_token_mean": pytest.approx(np.mean(ages)),
      "rollout/staleness_token_max": 3,
  }
  assert source.token_staleness(5, versions, np.zeros_like(mask)) == {}
