"""The training loop end to end on a tiny model: entry point outputs, exact resume, preemption,
no reference model at beta = 0, mesh-independence, and the non-finite update guard."""

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from grpo_jax.parallel import sharding
from grpo_jax import train
from grpo_jax.models import policy as policy_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  """configs/tiny.py shrunk to seconds: no warm start, a few small GRPO steps, a small eval."""
  spec = importlib.util.spec_from_file_location(
      "cfg_tiny", os.path.join(ROOT, "configs", "tiny.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.sft_steps = 0
  c.num_steps = 3
  c.batch_size = 8
  c.num_generations = 4
  c.data.arithmetic.num_train = 64
  c.data.arithmetic.num_test = 16
  c.eval.batch_size = 16
  c.log_interval_steps = 1
  c.save_interval_steps = 100
  c.optimizer.learning_rate = 3e-3  # big enough that every step visibly moves the params
  # A random-init model scores 0 on the exact-answer reward (zero advantages, zero gradients);
  # this plug-in reward varies within every group, so each step has a real update.
  c.reward.custom_file = os.path.join(ROOT, "tests", "data", "digit_count_reward.py")
  c.report_at_end = False  # test_report.py covers it
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    setattr(node, leaf, value)
  c.lock()
  return c


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def grpo_rows(workdir):
  """Per-step GRPO metric rows (the ones carrying a loss), last write of each step wins."""
  rows = {}
  for r in read_metrics(workdir):
    if "loss/policy_loss" in r:
      rows[r["step"]] = r
  return [rows[k] for k in sorted(rows)]


def checkpoint_state(workdir, step=None):
  d = os.path.join(workdir, "checkpoints")
  step = step if step is not None else max(int(s) for s in os.listdir(d) if s.isdigit())
  return step, ocp.PyTreeCheckpointer().restore(os.path.join(d, str(step), "state"))


def flat(tree):
  return {
      jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
  }


# ---------------------------------------------------------------------------- entry point


def test_entry_point_writes_events_checkpoint_and_summary(tmp_path):
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny.py",
          f"--workdir={workdir}",
          "--config.sft_steps=0",
          "--config.num_steps=2",
          "--config.batch_size=8",
          "--config.num_generations=4",
          "--config.data.arithmetic.num_train=64",
          "--config.data.arithmetic.num_test=16",
          "--config.eval.batch_size=16",
          "--config.eval.generation_configs=('greedy','standard')",
          "--config.log_interval_steps=1",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[grpo] step 2/2" in r.stderr  # the console progress line
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir))
  assert os.listdir(workdir / "checkpoints") == ["2"]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["final_step"] == 2 and summary["wall_time_sec"] > 0
  for when in ("eval_before", "eval_after"):
    assert set(summary[when]) == {"greedy", "standard"}
    for res in summary[when].values():
      for k in ("accuracy", "partial_accuracy", "format_accuracy"):
        assert 0.0 <= res[k] <= 1.0
      assert res["num_examples"] == 16
  rows = grpo_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2]
  for name in (
      "reward/total",
      "reward/answer_match",
      "reward/answer_format",
      "reward/std_within_group",
      "loss/policy_loss",
      "loss/kl_divergence",
      "loss/clip_fraction",
      "completions/mean_length",
      "completions/truncated_fraction",
      "perf/rollout_tokens_per_sec",
      "perf/step_time_sec",
  ):
    assert name in rows[-1], name
  for r in rows:  # the phases' own clocks: disjoint regions inside the step (profiling.Span)
    inside = r["perf/rollout_sec"] + r["perf/reward_sec"] + r["perf/update_sec"]
    assert min(r["perf/rollout_sec"], r["perf/update_sec"]) > 0
    assert inside <= r["perf/step_time_sec"], r
  evals = [r for r in read_metrics(workdir) if "eval/accuracy/greedy" in r]
  assert [r["step"] for r in evals] == [0, 2]


# ------------------------------------------------------------------- resume and preemption


def test_resume_continues_exactly(tmp_path):
  """6 steps in one go == 3 steps, exit, 3 more steps from the checkpoint (params and
  per-step metrics), because data order, RNG and optimizer state are all restored."""
  straight = str(tmp_path / "straight")
  train.run(tiny_config(num_steps=6), straight)
  split = str(tmp_path / "split")
  with pytest.raises(SystemExit) as e:
    train.run(tiny_config(num_steps=6, max_steps_per_run=3), split)
  assert e.value.code == 0
  assert sorted(os.listdir(os.path.join(split, "checkpoints"))) == ["3"]
  summary = train.run(tiny_config(num_steps=6, max_steps_per_run=3), split)
  assert summary["final_step"] == 6

  a, b = grpo_rows(straight), grpo_rows(split)
  assert [r["step"] for r in b] == list(range(1, 7))
  assert all(r["loss/grad_norm"] > 0 for r in a)  # every step really updated the params
  for ra, rb in zip(a, b):
    for k in ("reward/total", "loss/policy_loss", "completions/mean_length", "loss/grad_norm"):
      assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
  _, sa = checkpoint_state(straight, 6)
  _, sb = checkpoint_state(split, 6)
  fa, fb = flat(sa["train"]), flat(sb["train"])
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)
  # The resumed run reports the first run's "before" eval, not a new one.
  assert (
      json.load(open(os.path.join(split, "summary.json")))["eval_before"]
      == json.load(open(os.path.join(straight, "summary.json")))["eval_before"]
  )


def test_stop_on_a_save_step_exits_0_and_resumes(tmp_path):
  """The step budget runs out on a save step: the interval save and the stop's save are the
  same checkpoint, written once (Orbax refuses a second write of a step)."""
  workdir = str(tmp_path / "run")
  config = tiny_config(num_steps=6, max_steps_per_run=3, save_interval_steps=3)
  with pytest.raises(SystemExit) as e:
    train.run(config, workdir)
  assert e.value.code == 0
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
  assert train.run(config, workdir)["final_step"] == 6


def test_the_schedule_of_periodic_work():
  """7b's decisions, 10 GRPO steps: logs every 3 and at the end; evaluations every 4 but never at
  the last step (the evaluation after training is that one); checkpoints every 4 and at the end;
  a process started at step 2 with a budget of 5 steps stops after step 7 (logged there too)."""
  when = train.Schedule(
      num_steps=10, first_step=2, log_every=3, eval_every=4, save_every=4, max_steps_per_run=5
  )
  steps = range(3, 11)
  assert [s for s in steps if when.log(s)][:3] == [3, 6, 7]  # 7: the budget's stop
  unlimited = dataclasses.replace(when, max_steps_per_run=0)
  assert [s for s in steps if unlimited.log(s)] == [3, 6, 9, 10]
  assert [s for s in steps if when.budget_spent(s)] == [7, 8, 9]  # the loop stops at the first
  assert [s for s in steps if when.save(s)] == [4, 8, 10]
  assert [s for s in range(1, 13) if dataclasses.replace(when, eval_every=5).evaluate(s)] == [5]
  assert not any(dataclasses.replace(when, eval_every=0).evaluate(s) for s in steps)
  # No budget: a run to the end; a budget reaching the end: no early stop at the last step.
  assert not any(unlimited.budget_spent(s) for s in steps)
  assert not dataclasses.replace(when, max_steps_per_run=8).budget_spent(10)


def test_sigterm_saves_a_restorable_checkpoint_and_exits_0(tmp_path):
  """Every step is a save step here, so the SIGTERM stop lands on a step the interval save has
  just written (issue 16's crash): written once, exit 0."""
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny.py",
          f"--workdir={workdir}",
          "--config.sft_steps=0",
          "--config.num_steps=100000",
          "--config.batch_size=8",
          "--config.num_generations=4",
          "--config.data.arithmetic.num_test=16",
          "--config.log_interval_steps=1",
          "--config.save_interval_steps=1",
      ],
      cwd=ROOT,
      env=env,
      stderr=subprocess.PIPE,
      text=True,
  )
  deadline = time.time() + 240
  for line in proc.stderr:  # wait until GRPO steps are running
    if "[grpo] step 2/" in line or time.time() > deadline:
      break
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  assert "preempted: checkpoint" in err
  step, state = checkpoint_state(str(workdir))
  assert 2 <= step < 100000
  meta = json.load(open(workdir / "checkpoints" / str(step) / "meta" / "metadata"))
  assert meta["grpo_step"] == step and meta["phase"] == "grpo"
  assert int(state["train"]["nonfinite_total"]) == 0
  assert not (workdir / "summary.json").exists()


# --------------------------------------------------------------------- reference model


def test_beta_zero_builds_no_reference(tmp_path, monkeypatch):
  calls = []
  real = policy_lib.native_policy

  def counting_policy(*a, **kw):  # the padded and the packed (the default) forwards
    p = real(*a, **kw)

    def counted(inner):
      def logprobs(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

      return logprobs

    return dataclasses.replace(
        p, logprobs=counted(p.logprobs), packed_logprobs=counted(p.packed_logprobs)
    )

  monkeypatch.setattr(policy_lib, "native_policy", counting_policy)
  # (compile_ahead off: it traces the packed passes of the shapes a later step may need too)
  train.run(tiny_config(num_steps=1, beta=0.0, compile_ahead=False), str(tmp_path / "b0"))
  traced_b0 = len(calls)
  _, state = checkpoint_state(str(tmp_path / "b0"))
  assert set(state) == {"train", "rng"}  # nothing saved for a reference

  calls.clear()
  train.run(tiny_config(num_steps=1, beta=0.05, compile_ahead=False), str(tmp_path / "b1"))
  _, state = checkpoint_state(str(tmp_path / "b1"))
  assert set(state) == {"train", "ref", "rng"}
  # beta > 0 traces one more forward (the reference log-probs) than beta = 0.
  assert len(calls) == traced_b0 + 1
  kl = [r["loss/kl_divergence"] for r in grpo_rows(str(tmp_path / "b1"))]
  # The reference equals the policy before the first update, so the KL is zero up to rounding:
  # the update's forward (inside value_and_grad) and the reference pass are two compiled
  # programs whose log-probs may differ in the last bit (jax 0.11.2 on CPU: ~1e-13 of k3).
  assert len(kl) == 1 and 0.0 <= kl[0] < 1e-9


@pytest.mark.parametrize("lora", [False, True])
def test_grpo_start_keeps_one_copy_of_the_weights(lora):
  """A fresh GRPO state takes the starting weights' buffers (donated, XLA aliases them) and the
  policy keeps their shapes only: the loop holds no second copy of the weights (on an H200,
  Qwen3-8B with LoRA peaked at 79.3 GiB with the copy, 48.7 GiB without: memory_plan's 48.6)."""
  from types import SimpleNamespace

  from grpo_jax.models import build
  from grpo_jax.rl import step as step_lib
  from grpo_jax.rl.reference import Reference

  config = tiny_config(**({"lora.rank": 4} if lora else {}))
  mesh = build.make_mesh(config)
  policy = build.make_policy(config, mesh)
  # (the same init again: a numpy view of the policy's own CPU buffers would pin them)
  fresh = jax.tree.map(np.asarray, build.make_policy(config, mesh).params)
  start = jax.tree.leaves(policy.params)
  fns = step_lib.build(config, policy, mesh)
  reference = Reference(config, policy, fns, mesh)
  session = SimpleNamespace(resume_phase=None)
  state = train._start_grpo(
      config, session, fns, policy, mesh, policy.params, None, reference, None
  )
  assert all(x.is_deleted() for x in start)  # the state holds those buffers, not a copy
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(policy.params))
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state["params"]), fresh)
  # the policy's shapes still serve what reads them after the start (restore targets)
  assert jax.tree.map(lambda x: x.shape, reference.target()) == (
      {"ref": jax.tree.map(lambda x: x.shape, fresh)} if reference.own_copy else {}
  )


# ------------------------------------------------------------------------ mesh equivalence


def test_sharded_mesh_matches_single_device(tmp_path, monkeypatch):
  """data=2, fsdp=2, tensor=2 on 8 devices gives the single-device loss curve (3 steps)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  sharded = str(tmp_path / "mesh222")
  train.run(tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}), sharded)

  real = sharding.make_mesh
  monkeypatch.setattr(
      sharding, "make_mesh", lambda *a, **kw: real(1, 1, 1, devices=jax.devices()[:1])
  )
  single = str(tmp_path / "single")
  train.run(tiny_config(**{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1}), single)

  a, b = grpo_rows(sharded), grpo_rows(single)
  assert len(a) == len(b) == 3
  assert all(r["loss/grad_norm"] > 0 for r in a)
  for ra, rb in zip(a, b):
    assert ra["reward/total"] == rb["reward/total"]
    for k in ("loss/total", "loss/policy_loss", "loss/grad_norm"):
      assert abs(ra[k] - rb[k]) <= 1e-5, (ra["step"], k, ra[k], rb[k])


def test_trimmed_prompt_columns_train_like_full_width(tmp_path, monkeypatch):
  """data.prompt_width=bucket drops all-padding prompt columns (arithmetic prompts are <= 6
  tokens, so 24 -> 8 columns): the sampler and the update see 8 columns and the run matches
  one at the full width."""
  widths = []
  real_batch = train.data_lib.PromptData.batch

  def spy(self, indices, width=None):
    out = real_batch(self, indices, width)
    widths.append(out["prompt_ids"].shape[1])
    return out

  monkeypatch.setattr(train.data_lib.PromptData, "batch", spy)
  runs = {}
  for mode in ("bucket", "max"):
    widths.clear()
    train.run(
        tiny_config(
            **{"max_prompt_length": 24, "data.prompt_width": mode, "eval.generation_configs": ()}
        ),
        str(tmp_path / mode),
    )
    runs[mode] = (grpo_rows(str(tmp_path / mode)), set(widths))
  assert runs["bucket"][1] == {8} and runs["max"][1] == {24}
  a, b = runs["bucket"][0], runs["max"][0]
  assert len(a) == len(b) == 3 and all(r["loss/grad_norm"] > 0 for r in a)
  for ra, rb in zip(a, b):
    assert ra["reward/total"] == rb["reward/total"]
    for k in ("loss/total", "loss/policy_loss", "loss/grad_norm"):
      assert abs(ra[k] - rb[k]) <= 1e-5, (ra["step"], k, ra[k], rb[k])


# ------------------------------------------------------------------- non-finite updates


def _nan_rewards_on(steps, monkeypatch):
  """Makes the rewards of the given (1-based) GRPO steps NaN after the reward computer's own
  finiteness checks, as a bad custom transform or an overflow would."""
  real = train.rewards_lib.from_config
  seen = {"n": 0}

  def build(*a, **kw):
    computer = real(*a, **kw)

    def score(prompts, completions, rows):
      out = computer(prompts, completions, rows)
      seen["n"] += 1
      if seen["n"] in steps:
        out.total = np.full_like(out.total, np.nan)
      return out

    score.check = computer.check
    return score

  monkeypatch.setattr(train.rewards_lib, "from_config", build)


def test_nonfinite_update_is_skipped_and_counted(tmp_path, monkeypatch):
  _nan_rewards_on({2}, monkeypatch)
  workdir = str(tmp_path / "run")
  train.run(
      tiny_config(num_steps=3, save_interval_steps=1, **{"checkpoint.max_to_keep": 5}), workdir
  )
  rows = grpo_rows(workdir)
  assert [r["loss/skipped_updates"] for r in rows] == [0.0, 1.0, 0.0]
  # The skipped step left params and optimizer state untouched.
  _, s1 = checkpoint_state(workdir, 1)
  _, s2 = checkpoint_state(workdir, 2)
  for k, v in flat(s1["train"]["params"]).items():
    np.testing.assert_array_equal(v, flat(s2["train"]["params"])[k], err_msg=k)
  _, s3 = checkpoint_state(workdir, 3)
  assert int(s3["train"]["nonfinite_total"]) == 1 and int(s3["train"]["nonfinite_streak"]) == 0
  f2, f3 = flat(s2["train"]["params"]), flat(s3["train"]["params"])
  assert all(not np.array_equal(f2[k], f3[k]) for k in f2 if "embed" in k or "mlp" in k)


def test_consecutive_nonfinite_updates_stop_with_a_clear_error(tmp_path, monkeypatch):
  _nan_rewards_on(set(range(1, 100)), monkeypatch)
  with pytest.raises(train.NonFiniteError, match="2 consecutive GRPO updates"):
    train.run(tiny_config(num_steps=5, max_consecutive_nonfinite=2), str(tmp_path / "run"))


# -------------------------------------------------------------------------------- infer


def test_infer_samples_and_exports_the_trained_policy(tmp_path, capsys):
  from grpo_jax import infer
  from grpo_jax.models.decoder import hf

  workdir = str(tmp_path / "run")
  config = tiny_config(num_steps=2, **{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1})
  train.run(tiny_config(num_steps=2), workdir)
  mesh = sharding.make_mesh(-1, 1, 1)
  policy, step = infer.load_params(config, workdir, None, mesh)
  assert step == 2
  _, state = checkpoint_state(workdir, 2)
  # Orbax stores nnx.State as nested dicts ("['layers']['0']['attn']['k']['value']"); the live
  # State spells the same leaf "['layers'][0]['attn']['k'].value": compare on a normalized key.
  norm = lambda key: key.replace(".value", "['value']").replace("'", "").replace("[", "/")
  saved = {norm(k): v for k, v in flat(state["train"]["params"]).items()}
  live = {norm(k): v for k, v in flat(policy.params).items()}
  assert saved.keys() == live.keys() and len(live) > 5
  for k, v in saved.items():
    np.testing.assert_array_equal(live[k], v, err_msg=k)
  out = infer.generate(
      config, policy, ["12+30=", "5+7=", "1+1="], mesh, num_samples=2, generation="standard", seed=1
  )
  assert [len(o) for o in out] == [2, 2, 2] and all(isinstance(s, str) for o in out for s in o)
  # Greedy through infer == greedy through the eval sampler the loop used (same weights).
  g1 = infer.generate(config, policy, ["12+30="], mesh)
  g2 = infer.generate(config, policy, ["12+30=", "3+4="], mesh)
  assert g1[0] == g2[0]
  # No prompts: held-out rows side by side with ground truth, reward and verdict.
  from grpo_jax.rewards import eval_flags

  capsys.readouterr()
  shown = infer.show_heldout(config, policy, mesh, num_examples=3)
  printed = capsys.readouterr().out
  assert len(shown) == 3 and printed.count("ground truth:") == 3 and "[3/3] prompt:" in printed
  for s in shown:
    assert s["accuracy"] == eval_flags(s["completion"], _truth_of(config, s["prompt"]))[0]
    assert ("correct" if s["accuracy"] else "wrong") in printed and "reward" in printed

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  hf_dir = tmp_path / "hf"
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.infer",
          "--config=configs/tiny.py",
          f"--workdir={workdir}",
          f"--export_hf={hf_dir}",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  model = hf.load_hf(str(hf_dir))
  ids = np.array([[5, 9, 12, 30, 7, 2]], np.int32)
  from flax import nnx

  mine = nnx.merge(policy.graphdef, policy.params)
  np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(mine(ids)), atol=1e-6)


def _truth_of(config, prompt):
  from grpo_jax import data as data_lib

  return next(r["ground_truth"] for r in data_lib.load_rows(config)[1] if r["prompt"] == prompt)


# ------------------------------------------------------------- host traffic and teardown


@pytest.fixture
def device_reads_guarded(monkeypatch):
  """On CPU a device array already lives in host memory, so jax.transfer_guard never sees a
  read of one. Make reads obey the device-to-host guard as they do on an accelerator: an
  implicit read (np.asarray, float(), int(), bool(), .tolist()) of a value not yet on the host
  raises under "disallow"; jax.device_get (an explicit transfer) stays allowed."""
  from jax._src import array as array_lib
  from jax._src import config as jax_config
  from jax._src.lib import guard_lib

  real = array_lib.ArrayImpl._value
  reads = []

  def guarded(self):
    level = jax_config.transfer_guard_device_to_host.value
    explicit = guard_lib.thread_local_state().explicit_device_get
    if self._npy_value is None and level == "disallow" and not explicit:
      reads.append(self.shape)
      raise RuntimeError(
          f"implicit device-to-host read of an array {self.shape} "
          f"{self.dtype} inside a guarded step"
      )
    return real.fget(self)

  monkeypatch.setattr(array_lib.ArrayImpl, "_value", property(guarded))
  return reads


def test_emulated_guard_catches_an_implicit_read(device_reads_guarded):
  x = jax.numpy.arange(3.0) + 1
  with jax.transfer_guard("disallow"):
    with pytest.raises(RuntimeError, match="implicit device-to-host read"):
      float(x.sum())
    assert jax.device_get(x.sum()) == 6.0  # explicit: allowed


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        # Every optional path of the step: reference, old log-probs (2 passes), TIS, DAPO.
        {
            "beta": 0.04,
            "num_iterations": 2,
            "loss.tis_cap": 2.0,
            "loss.dynamic_sampling": True,
            "loss.overlong_buffer": 2,
            "micro_batch_size": 8,
            "log_interval_steps": 2,
        },
    ],
)
def test_steady_state_steps_touch_the_host_only_on_purpose(
    tmp_path, device_reads_guarded, overrides
):
  """Steps after the first run under jax.transfer_guard("disallow") (host-to-device as JAX
  enforces it, device-to-host as an accelerator would): the only transfers are the loop's
  own (prompts, completions, rewards, the log-interval read)."""
  workdir = str(tmp_path / "run")
  summary = train.run(
      tiny_config(num_steps=4, **{"debug.transfer_guard": "disallow"}, **overrides), workdir
  )
  assert summary["final_step"] == 4 and device_reads_guarded == []
  rows = grpo_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert all(np.isfinite(r["loss/total"]) and r["loss/grad_norm"] > 0 for r in rows)


def test_error_path_tears_everything_down(tmp_path, monkeypatch):
  """A forced non-finite stop leaves no SIGTERM handler of ours installed, the reward worker
  pool closed, the metric writer closed and the checkpointer finished."""
  from grpo_jax.run import checkpoint as ckpt_lib
  from grpo_jax.run import metrics as metrics_lib
  from grpo_jax.rewards import computer

  live = []  # strong references: a close() from __del__ must not count
  real_call = computer.RewardComputer.__call__

  def nan_call(self, prompts, completions, rows):
    live.append(self)
    out = real_call(self, prompts, completions, rows)
    out.total = np.full_like(out.total, np.nan)
    return out

  monkeypatch.setattr(computer.RewardComputer, "__call__", nan_call)
  closed = []
  for cls in (computer.RewardComputer, metrics_lib.MetricWriter, ckpt_lib.Checkpointer):
    monkeypatch.setattr(
        cls, "close", lambda self, _c=cls.close, _n=cls.__name__: (closed.append(_n), _c(self))[1]
    )
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(train.NonFiniteError):
    train.run(
        tiny_config(num_steps=5, max_consecutive_nonfinite=2, **{"reward.num_workers": 1}),
        str(tmp_path / "run"),
    )
  assert signal.getsignal(signal.SIGTERM) is before
  assert sorted(set(closed)) == ["Checkpointer", "MetricWriter", "RewardComputer"]
  assert live and live[0]._pool is None  # the spawned worker pool is gone


def test_memory_lines_and_profile_at_the_peak_step(tmp_path, monkeypatch):
  from grpo_jax.run import profiling
  import types
  # Reads: 3 load stages, step 1 (+ the first-step line), step 2, step 3.
  peaks = iter([g << 30 for g in (1, 1, 1, 2, 2, 3, 3)])
  lines, saved = [], []

  def fake_memory():  # an accelerator's statistics: the peak grows at the second step
    return {"in_use": 1 << 30, "peak": next(peaks), "limit": 16 << 30}

  monkeypatch.setattr(profiling, "device_memory", fake_memory)
  monkeypatch.setattr(
      profiling, "logging", types.SimpleNamespace(info=lambda msg, *a: lines.append(msg % a))
  )
  real_write = profiling.paths.write_atomic
  monkeypatch.setattr(
      profiling.paths,
      "write_atomic",
      lambda p, data: (
          saved.append(data) if str(p).endswith(".pprof") else None,
          real_write(p, data),
      ),
  )
  workdir = tmp_path / "mem"
  train.run(tiny_config(num_steps=3, beta=0.05, **{"profile.memory_profile": True}), str(workdir))
  stages = [l.split(":")[0] for l in lines if l.startswith("memory after")]
  assert stages == [
      "memory after loading the policy",
      "memory after the optimizer state",
      "memory after the reference",
      "memory after the first step (sampler cache, update)",
  ]
  profiled = [l for l in lines if l.startswith("memory profile of step")]
  # Steps 1..3 see peaks 2, 3, 3 GiB: saved at 1 and 2 only.
  assert [l.split()[4] for l in profiled] == ["1", "2"], profiled
  data = (workdir / "memory_profile.pprof").read_bytes()
  assert len(saved) == 2 and data == saved[-1] and data[:2] == b"\x1f\x8b"  # gzipped pprof
