"""f32 master weights: bf16 storage cannot absorb small AdamW steps; the shipped real-model
configs keep f32 weights with bf16 compute, validation warns about the bad combination, and
the frozen reference is stored in the compute dtype (same forward pass, half the bytes)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import configuration
from grpo_jax.models import build
from grpo_jax.models import policy as policy_lib
from grpo_jax.rl import step as step_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(name, **overrides):
  spec = importlib.util.spec_from_file_location(
      f"cfg_{name}", os.path.join(ROOT, "configs", f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    setattr(node, leaf, value)
  return c


def _fraction_changed(param_dtype, lr, steps=5):
  """Fraction of all weight elements that differ after `steps` AdamW updates at `lr`."""
  c = _config(
      "tiny",
      **{
          "model.param_dtype": param_dtype,
          "model.dtype": "bfloat16",
          "optimizer.learning_rate": lr,
          "optimizer.warmup_ratio": 0.0,
          "optimizer.weight_decay": 0.0,
          "num_steps": 1000,
          "batch_size": 4,
          "num_generations": 2,
          "micro_batch_size": 0,
          "beta": 0.0,
          "pack_sequences": False,  # fns.update on the assembled (padded) rows
      },
  )
  mesh = build.make_mesh(c)
  policy = build.make_policy(c, mesh)
  fns = step_lib.build(c, policy, mesh)
  state = fns.init(policy.params)
  before = jax.tree.map(np.asarray, state["params"])
  n, p, comp = 8, c.max_prompt_length, c.max_completion_length
  rng = np.random.default_rng(0)
  ids = rng.integers(3, c.model.vocab_size, (n, p + comp)).astype(np.int32)
  batch = dict(
      input_ids=ids,
      attention_mask=np.ones_like(ids),
      completion_mask=np.ones((n, comp), np.int32),
      advantages=rng.choice([-1.0, 1.0], n).astype(np.float32),
  )
  for _ in range(steps):
    state, _ = fns.update(state, jax.tree.map(jnp.asarray, batch))
  after = jax.tree.map(np.asarray, state["params"])
  changed = sum(
      int((a != b).sum()) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))
  )
  return changed / sum(x.size for x in jax.tree.leaves(before))


def test_bf16_weights_cannot_absorb_small_steps_f32_masters_can():
  bf16 = _fraction_changed("bfloat16", 3e-6)
  f32 = _fraction_changed("float32", 3e-6)
  assert bf16 < 0.10, bf16
  assert f32 > 0.99, f32


@pytest.mark.parametrize("name", ["qwen3_8b", "llama3_8b", "qwen3_0p6b"])
def test_real_model_configs_keep_f32_master_weights(name):
  c = _config(name)
  assert c.model.param_dtype == "float32" and c.model.dtype == "bfloat16"
  assert configuration.warnings(c) == []


def test_bf16_params_with_a_small_learning_rate_warn_with_the_fix():
  c = _config("qwen3_8b", **{"model.param_dtype": "bfloat16"})
  (line,) = configuration.warnings(c)
  assert line.startswith("optimizer.learning_rate=3e-06 with model.param_dtype='bfloat16'")
  assert "Fix: --config.model.param_dtype=float32" in line
  c.optimizer.learning_rate = 1e-3  # resolvable in bf16: no warning
  assert configuration.warnings(c) == []
  c.sft_steps, c.sft.learning_rate = 10, 1e-5
  assert [w.split("=")[0] for w in configuration.warnings(c)] == ["sft.learning_rate"]


def test_reference_is_stored_in_the_compute_dtype_with_the_same_forward():
  c = _config("tiny", **{"model.param_dtype": "float32", "model.dtype": "bfloat16"})
  mesh = build.make_mesh(c)
  policy = build.make_policy(c, mesh)
  ref = policy_lib.as_reference(policy.params, c.model.dtype)
  assert {x.dtype for x in jax.tree.leaves(ref)} == {jnp.dtype(jnp.bfloat16)}
  ids = np.random.default_rng(1).integers(3, c.model.vocab_size, (2, 24)).astype(np.int32)
  mask = np.ones_like(ids)
  ours = policy.logprobs(policy.params, ids, mask, 8)
  theirs = policy.logprobs(ref, ids, mask, 8)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  # Restore targets (abstract values) get the same dtypes, shardings kept.
  abstract = policy_lib.as_reference(
      jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), policy.params
      ),
      c.model.dtype,
  )
  for a, r in zip(jax.tree.leaves(abstract), jax.tree.leaves(ref)):
    assert (a.shape, a.dtype) == (r.shape, r.dtype) and a.sharding == r.sharding
