"""T5 (model.family="t5") as the policy of the unchanged loop: SFT + GRPO + exact resume, the
[prompt; completion] log-prob interface, the engine's log-probs == the trainer's, HF export."""

import importlib.util
import os

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import configuration
from grpo_jax import data as data_lib
from grpo_jax.parallel import multihost
from grpo_jax import rollout
from grpo_jax import train
from grpo_jax.models import build
from grpo_jax.models.t5.model import t5_logprobs
from grpo_jax.rl import step as step_lib
from grpo_jax.rollout.seq2seq_sampler import Seq2SeqSampler
from grpo_jax.rollout.types import GenerationConfig
from tests.test_train import checkpoint_state
from tests.test_train import flat
from tests.test_train import grpo_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def t5_config(**overrides):
  """configs/tiny.py's addition task on a tiny T5 (1 encoder, 2 decoder layers): a short SFT,
  2 GRPO steps (the 2nd under jax.transfer_guard("disallow")), a small eval."""
  spec = importlib.util.spec_from_file_location(
      "cfg_tiny", os.path.join(ROOT, "configs", "tiny.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  m = c.model
  m.family, m.preset = "t5", "t5-test"
  m.hidden_size, m.num_layers, m.num_heads = 32, 1, 4
  m.t5.d_kv, m.t5.d_ff, m.t5.num_decoder_layers = 8, 64, 2
  m.t5.relative_attention_num_buckets, m.t5.relative_attention_max_distance = 8, 6
  m.t5.pad_token_id, m.t5.eos_token_id = 0, 1  # the char tokenizer's <pad>, <eos>
  c.sft_steps = 2
  c.sft.batch_size = 16
  c.sft.stop_at_accuracy = 0.0
  c.num_steps = 2
  c.batch_size = 8
  c.num_generations = 4
  c.data.arithmetic.num_train = 64
  c.data.arithmetic.num_test = 16
  c.eval.batch_size = 16
  c.log_interval_steps = 1
  c.save_interval_steps = 100
  c.optimizer.learning_rate = 3e-3
  c.reward.custom_file = os.path.join(ROOT, "tests", "data", "digit_count_reward.py")
  c.report_at_end = False
  c.debug.transfer_guard = "disallow"  # GRPO steps after the first: no unplanned transfers
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    setattr(node, leaf, value)
  c.lock()
  return c


def test_validation_lines():
  assert configuration.validate(t5_config()) == []
  errors = configuration.validate(
      t5_config(
          **{
              "model.impl": "maxtext",
              "rollout.engine": "vllm",
              "model.t5.feed_forward_proj": "gated-swish",
              "model.t5.d_kv": 0,
          }
      )
  )
  text = "\n".join(errors)
  assert "model.impl='maxtext': model.family='t5' runs on the native T5" in text
  assert "rollout.engine='vllm': model.family='t5'" in text
  assert "model.t5.feed_forward_proj='gated-swish': unknown activation" in text
  assert "model.t5.d_kv=0: must be >= 1" in text
  assert any(
      e.startswith("model.family='t6'")
      for e in configuration.validate(t5_config(**{"model.family": "t6"}))
  )


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
  """The loop runs here compile the same programs: a persistent compilation cache (what
  main.py turns on from config.compilation_cache_dir) lets the resumed ones load them."""
  from jax.experimental.compilation_cache import compilation_cache

  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
  old = {k: getattr(jax.config, k) for k in names}
  jax.config.update(names[0], str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update(names[1], 0)
  compilation_cache.reset_cache()
  yield
  for k, v in old.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """SFT (2 steps) then 2 GRPO steps in one go: (workdir, summary)."""
  workdir = str(tmp_path_factory.mktemp("t5_straight"))
  return workdir, train.run(t5_config(), workdir)


def test_sft_grpo_and_resume_are_exact(straight, tmp_path):
  """1 GRPO step, exit, resume for the 2nd == both in one run: per-step metrics and the final
  params and optimizer state bit for bit (SFT's result restored, not recomputed)."""
  workdir, summary = straight
  assert summary["final_step"] == 2
  for when in ("eval_initial", "eval_before", "eval_after"):
    assert summary[when]["greedy"]["num_examples"] == 16, when
  split = str(tmp_path / "split")
  with pytest.raises(SystemExit) as e:
    train.run(t5_config(max_steps_per_run=1), split)
  assert e.value.code == 0
  assert train.run(t5_config(max_steps_per_run=1), split)["final_step"] == 2
  a, b = grpo_rows(workdir), grpo_rows(split)
  assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
  assert all(r["loss/grad_norm"] > 0 for r in a)  # every GRPO step really moved the params
  for ra, rb in zip(a, b):
    for k in ("reward/total", "loss/policy_loss", "completions/mean_length", "loss/grad_norm"):
      assert ra[k] == rb[k], (ra["step"], k)
  fa, fb = flat(checkpoint_state(workdir, 4)[1]["train"]), flat(
      checkpoint_state(split, 4)[1]["train"]
  )
  assert fa.keys() == fb.keys() and any("rel_bias" in k for k in fa)
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


@pytest.fixture(scope="module")
def parts():
  config = t5_config(**{"rollout.temperature": 0.7, "rollout.top_k": 0})
  mesh = build.make_mesh(config)
  policy = build.make_policy(config, mesh)
  return config, mesh, policy


def test_logprobs_of_prompt_completion_rows_equal_t5_logprobs(parts):
  """The loop's [left-padded prompt; right-padded completion] rows, split at S - C, give the
  direct encoder-input / decoder-target log-probs (and 0 on completion padding)."""
  config, _, policy = parts
  rng = np.random.default_rng(0)
  n, p, c = 8, config.max_prompt_length, config.max_completion_length
  pmask = (np.arange(p)[None] >= rng.integers(0, p - 1, (n, 1))).astype(np.int32)
  cmask = (np.arange(c)[None] < rng.integers(1, c + 1, (n, 1))).astype(np.int32)
  prompt, comp = rng.integers(2, 96, (n, p)) * pmask, rng.integers(2, 96, (n, c)) * cmask
  ids, mask = (
      jnp.asarray(np.concatenate(x, 1), jnp.int32) for x in ((prompt, comp), (pmask, cmask))
  )
  got = jax.jit(policy.logprobs, static_argnums=(3, 4))(policy.params, ids, mask, c, 0.7)
  model = nnx.merge(policy.graphdef, policy.params)
  want = jax.jit(t5_logprobs, static_argnums=5)(
      model, *(jnp.asarray(x, jnp.int32) for x in (prompt, pmask, comp, cmask)), 0.7
  )
  assert got.shape == (n, c)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)
  assert np.all(np.asarray(got)[cmask == 0] == 0) and np.all(np.asarray(got)[cmask > 0] < 0)


def test_engine_logprobs_equal_the_trainers(parts):
  """The native engine samples a T5 policy with the seq2seq sampler; the loop's assemble +
  log-prob pass on its rows reproduce the sampled log-probs (matches_trainer holds)."""
  config, mesh, policy = parts
  tok = data_lib.build_tokenizer("char")
  rows = data_lib.arithmetic_rows(8, split="test", seed=0)
  data = data_lib.PromptData(
      rows, tok, template="plain", system_prompt="", max_prompt_length=config.max_prompt_length
  )
  batch = data.batch(np.arange(8))
  engine = rollout.make_engine(config, policy, tok, mesh)
  assert isinstance(engine.sampler, Seq2SeqSampler) and engine.matches_trainer
  assert engine.sampler.decoder_start_id == config.model.t5.decoder_start_token_id
  gen = GenerationConfig(temperature=0.7, top_k=0, top_p=1.0)
  r = engine.generate(policy.params, batch, jax.random.key(3), gen)
  assert r.tokens.shape == (8 * config.num_generations, config.max_completion_length)
  fns = step_lib.build(config, policy, mesh)
  prompt_ids, prompt_mask = (
      multihost.to_global(batch[k], mesh) for k in ("prompt_ids", "prompt_mask")
  )
  assembled = fns.assemble(prompt_ids, prompt_mask, r, jnp.zeros((r.tokens.shape[0],)))
  logp = np.asarray(
      fns.logprobs(policy.params, assembled["input_ids"], assembled["attention_mask"])
  )
  m = np.asarray(r.mask) > 0
  assert m.sum() > r.tokens.shape[0]
  assert np.abs(logp - np.asarray(r.logprobs))[m].max() <= 1e-5
  with pytest.raises(ValueError, match="decoder-only policies"):
    rollout.make_engine(config, policy, tok, mesh, kind="vllm")


def test_export_of_the_trained_checkpoint_loads_in_transformers(straight, tmp_path):
  """infer's path: the checkpoint restored into the abstract T5 policy, written by
  policy.save_hf (what --export_hf calls), equals it in transformers' T5."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from grpo_jax import infer
  from tests.models.test_t5 import batch
  from tests.models.test_t5 import hf_logits
  from tests.models.test_t5 import max_diff

  workdir, _ = straight
  config = t5_config()
  mesh = build.make_mesh(config)
  policy, step = infer.load_params(config, workdir, None, mesh)
  assert step == 4
  policy.save_hf(policy.params, str(tmp_path / "hf"))
  hf = transformers.T5ForConditionalGeneration.from_pretrained(
      str(tmp_path / "hf"), attn_implementation="eager"
  ).eval()
  assert hf.config.decoder_start_token_id == config.model.t5.decoder_start_token_id
  ids, mask, dec, dec_mask = batch(96, seed=1)
  ours = nnx.merge(policy.graphdef, policy.params)(*map(jnp.asarray, (ids, mask, dec, dec_mask)))
  assert max_diff(ours, hf_logits(hf, ids, mask, dec, dec_mask), dec_mask) <= 1e-5
  del torch
