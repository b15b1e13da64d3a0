"""run/compile_ahead.py: the sampler and step programs of every prompt width compile ahead (the
worker thread, or `wait` before the rollout / step 4), so the loop's own calls find them
compiled, for the loop's variants (reference or not, old log-probs + KL fold + TIS, LoRA,
widths that change between steps); turned off, the main thread compiles them (the probe can
see a miss)."""

import contextlib
import os
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.run import compile_ahead
from grpo_jax.parallel import multihost
from grpo_jax.parallel import sharding
from grpo_jax import train
from grpo_jax.rollout.engine import NativeEngine
from grpo_jax.rollout.source import Scored
from grpo_jax.rollout import Rollout
from tests.rl.test_packing import grpo_step
from tests.test_train import grpo_rows
from tests.test_train import tiny_config

# Compiles watched here (XLA's compile events / the profiler's trace): no cache loads.
pytestmark = pytest.mark.usefixtures("no_compilation_cache")


MODULE = os.path.join("grpo_jax", "run/compile_ahead.py")  # (not this test file)
# Padded rows: packed shapes (pack_sequences, the default) follow each step's lengths and compile
# at their first use (run/compile_ahead.py), so these tests compile the padded update ahead.
PADDED = {"pack_sequences": False}
STEP_PROGRAMS = {
    "update",
    "logprobs",
    "routed_logprobs",
    "assemble",
    "fold_kl",
    "rollout_stats",
    "_generate",
}


@contextlib.contextmanager
def compiles():
  """-> a list that fills with (where, function name) of each XLA compile: where is "ahead"
  when run/compile_ahead.py asked for it (its worker thread, or `wait` taking what the worker had
  not started), else the thread's name."""
  seen = []

  def on(event, secs, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      name = kw.get("fun_name", "")  # "jit(update)"
      ahead = any(f.filename.endswith(MODULE) for f in traceback.extract_stack())
      seen.append(
          (
              "ahead" if ahead else threading.current_thread().name,
              name[4:-1] if name[:4] == "jit(" else name,
          )
      )

  jax.monitoring.register_event_duration_secs_listener(on)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(on)


def _alternate_widths(monkeypatch) -> set:
  """Batches 8 or 16 prompt columns wide by their first index (the same answer for the
  prefetch and the take of a batch): a second width appears after the first step, so it is
  compiled ahead at prefetch time. -> the set of widths used."""
  used = set()

  def width(self, indices, mode):
    used.add(8 if int(indices[0]) % 2 else 16)
    return 8 if int(indices[0]) % 2 else 16

  monkeypatch.setattr(train.data_lib.PromptData, "width", width)
  return used


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"beta": 0.08}, marks=pytest.mark.slow),  # reference (also in the 3rd)
        {"num_steps": 4, "widths": "alternate"},  # beta 0 (tiny.py); 2 widths
        {"kl_in_reward": True, "beta": 0.08, "num_iterations": 2, "loss.tis_cap": 2.0},  # fold_kl
        {"lora.rank": 4, "lora.alpha": 8.0, "beta": 0.08},  # reference = the LoRA base
        pytest.param(  # MoE, routing replay: the routed passes, the rows' routes
            {
                "model.num_experts": 4,
                "model.num_experts_per_tok": 2,
                "model.moe_intermediate_size": 32,
                "rollout.routing_replay": "rollout",
                "beta": 0.08,
            },
            marks=pytest.mark.slow,
            id="moe-replay",
        ),
        pytest.param(  # micro-batches by tokens: 2 per step at width 8 + 7, 4 at 16 + 7
            {
                "num_steps": 4,
                "widths": "alternate",
                "micro_batch_size": 0,
                "micro_batch_tokens": 240,
            },
            marks=pytest.mark.slow,
        ),
    ],
)
def test_step_programs_compile_in_the_background(tmp_path, monkeypatch, overrides):
  overrides = dict(overrides)
  widths = _alternate_widths(monkeypatch) if overrides.pop("widths", None) else {8}
  with compiles() as seen:
    train.run(tiny_config(**{"eval.generation_configs": (), **PADDED, **overrides}), str(tmp_path))
  assert len(grpo_rows(str(tmp_path))) == overrides.get("num_steps", 3)
  step = [(thread, name) for thread, name in seen if name in STEP_PROGRAMS]
  on_main = [name for where, name in step if where != "ahead"]
  assert not on_main, f"compiled at first call, not ahead: {on_main} (all: {step})"
  names = {name for _, name in step}
  assert {"update", "assemble", "rollout_stats"} <= names
  if overrides.get("rollout.routing_replay") == "rollout":
    assert "routed_logprobs" in names and "logprobs" not in names
  elif overrides.get("beta", 0.0) > 0 or overrides.get("kl_in_reward"):
    assert "logprobs" in names
  if overrides.get("kl_in_reward"):
    assert "fold_kl" in names
  assert len(widths) == (2 if overrides.get("num_steps") == 4 else 1)
  assert sum(name == "update" for _, name in step) == len(widths)  # once per width, ahead
  assert sum(name == "_generate" for _, name in step) == len(widths)  # the sampler too


def test_the_next_width_is_submitted_while_the_device_samples(tmp_path, monkeypatch):
  """The next batch's width goes to the worker right after a step's rollout is dispatched (so it
  compiles during that step's sampling, rewards and update), not at the end of the step."""
  widths = _alternate_widths(monkeypatch)
  events = []
  generate, submit, local_rows = (
      NativeEngine.generate,
      compile_ahead.CompileAhead.submit,
      multihost.local_rows,
  )

  def on_generate(self, params, batch, rng, generation):
    events.append("generate")
    return generate(self, params, batch, rng, generation)

  def on_submit(self, prompt, state):
    started = submit(self, prompt, state)
    if started:
      events.append(f"submit {prompt['ids'].shape[1]}")
    return started

  def on_rows(tree):
    events.append("rows")  # the rollout's results read: the step goes on to the rewards
    return local_rows(tree)

  monkeypatch.setattr(NativeEngine, "generate", on_generate)
  monkeypatch.setattr(compile_ahead.CompileAhead, "submit", on_submit)
  monkeypatch.setattr(multihost, "local_rows", on_rows)
  train.run(tiny_config(**{"eval.generation_configs": (), "num_steps": 4, **PADDED}), str(tmp_path))
  assert len(widths) == 2
  submits = [i for i, e in enumerate(events) if e.startswith("submit")]
  assert len(submits) == 2 and submits[0] == 0, events  # the first before the loop
  i = submits[1]
  assert events[i - 1 : i + 2] == ["generate", events[i], "rows"], events


def test_turned_off_the_loop_compiles_at_first_call(tmp_path):
  with compiles() as seen:
    train.run(
        tiny_config(
            **{
                "eval.generation_configs": (),
                "compile_ahead": False,
                "beta": 0.08,
                "num_steps": 1,
                **PADDED,
            }
        ),
        str(tmp_path),
    )
  main = {name for thread, name in seen if thread == "MainThread"}
  assert {"update", "logprobs", "assemble", "rollout_stats", "_generate"} <= main
  assert not any(where == "ahead" for where, _ in seen)


def test_a_failed_compile_is_logged_and_the_run_goes_on(tmp_path, monkeypatch):
  def broken(self, *args):
    raise RuntimeError("boom")

  monkeypatch.setattr(compile_ahead.CompileAhead, "_programs", broken)
  warnings = []
  monkeypatch.setattr(compile_ahead.logging, "warning", lambda msg, *a: warnings.append(msg % a))
  train.run(tiny_config(**{"eval.generation_configs": (), "num_steps": 2, **PADDED}), str(tmp_path))
  assert len(grpo_rows(str(tmp_path))) == 2
  assert len(warnings) == 1 and "prompt width 6 failed" in warnings[0] and "boom" in warnings[0]


@pytest.mark.slow  # suite time (-m slow runs it): a MaxText policy's programs, compiled ahead
def test_maxtext_policy_programs_compile_ahead(tmp_path, monkeypatch):
  pytest.importorskip("maxtext")
  from configs import tiny_maxtext

  widths = _alternate_widths(monkeypatch)
  config = tiny_maxtext.get_config()
  config.num_steps, config.sft_steps, config.beta = 4, 0, 0.08
  config.eval.generation_configs = ()
  config.pack_sequences = False  # (PADDED)
  with compiles() as seen:
    train.run(config, str(tmp_path))
  step = [(where, name) for where, name in seen if name in STEP_PROGRAMS]
  assert {"update", "logprobs", "assemble"} <= {name for _, name in step}
  assert len(widths) == 2
  # The sampler's weights are mapped from MaxText's: their shardings are known from the first
  # rollout on, so the first width's sampler compiles at its call, the second's ahead.
  assert [where == "ahead" for where, name in step if name == "_generate"] == [False, True]
  assert all(where == "ahead" for where, name in step if name != "_generate"), step


def _scored_with(config, policy, mesh, clen, seed=0):
  """A made-up scored batch (tests/rl/test_packing.py's shape) with completion lengths `clen`."""
  rng = np.random.default_rng(seed)
  b, g, p, c = config.batch_size, config.num_generations, 6, config.max_completion_length
  plen = rng.integers(2, p + 1, b)
  pmask = (np.arange(p)[None] >= (p - plen)[:, None]).astype(np.int32)
  cmask = (np.arange(c)[None] < np.asarray(clen)[:, None]).astype(np.int32)
  vocab = policy.model_config.vocab_size
  logprobs = jnp.asarray(cmask * rng.normal(-2.5, 0.5, (b * g, c)), jnp.float32)
  rollout = Rollout(
      tokens=jnp.asarray(rng.integers(1, vocab, (b * g, c)) * cmask, jnp.int32),
      mask=jnp.asarray(cmask),
      logprobs=logprobs,
      raw_logprobs=logprobs,
      lengths=jnp.asarray(clen, jnp.int32),
      truncated=jnp.asarray(np.asarray(clen) == c),
      tool_mask=jnp.zeros_like(jnp.asarray(cmask)),
  )
  rows = sharding.batch_sharding(mesh, 2)
  prompt = dict(
      ids=jax.device_put(jnp.asarray(rng.integers(1, vocab, (b, p)) * pmask, jnp.int32), rows),
      mask=jax.device_put(jnp.asarray(pmask), rows),
  )
  rewards = jax.device_put(  # as the loop's rewards (rewards/computer.py)
      jnp.asarray(rng.uniform(0, 1, b * g), jnp.float32), sharding.batch_sharding(mesh, 1)
  )
  return Scored(prompt=prompt, rollout=rollout, rewards=rewards, host={}, figures={})


@pytest.mark.parametrize(
    "overrides",
    [
        {"beta": 0.1, "loss.tis_cap": 2.0},  # old and reference passes, the unpack
        pytest.param({"beta": 0.1, "kl_in_reward": True}, marks=pytest.mark.slow),  # fold_kl
    ],
)
def test_packed_shapes_compile_ahead(overrides):
  """Packed rows (the default): every step submits the shapes of its batch with every completion 15% longer and shorter (Packer.likely_shapes) to the worker; a
  later step whose lengths drift onto one of them finds all its programs (gather, old and
  reference passes, update, unpack) compiled: none compiles on the main thread (a shape or
  sharding that differs from the loop's arrays would compile again there)."""
  config = tiny_config(max_completion_length=24, **overrides)
  mesh, policy, fns, grpo = grpo_step(config)
  ahead = compile_ahead.CompileAhead(config, grpo)
  grpo.rows.ahead = ahead
  state = fns.init(policy.params)
  n, c = config.batch_size * config.num_generations, config.max_completion_length
  clen = np.random.default_rng(1).integers(2, 10, n)
  longer = np.minimum(np.round(clen * 1.15).astype(np.int64), c)
  first, later = (_scored_with(config, policy, mesh, x) for x in (clen, longer))
  assert ahead.submit(first.prompt, state)
  ahead.wait(first.prompt["ids"].shape[1])

  def step(state, batch):
    upd, kl_rewards = grpo.inputs(state, batch)
    figures = grpo.figures(batch, upd, kl_rewards)
    state, _ = grpo.update(state, upd)
    jax.block_until_ready((state, figures))
    return state

  state = step(state, first)
  shapes = sorted(grpo.rows.shapes)
  assert len(shapes) == 1
  with compiles() as seen:
    state = step(state, later)
  ahead.close()
  assert len(grpo.rows.shapes) == 2, "the later batch should need another packed shape"
  programs = {"update", "pack", "packed_logprobs_all", "packed_fold_kl", "unpack"}
  main = [name for where, name in seen if where != "ahead" and name in programs]
  assert not main, f"compiled on the main thread: {main} (all: {seen})"
