"""Gemma 2 and Gemma 3 (text) on the native decoder: logits == transformers with soft-caps and
sliding windows active, greedy == transformers' generate, the sampler's log-probs == the
trainer's, HF folders read and written (Gemma 3's multimodal text tower too)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import PRESETS
from grpo_jax.models import build_model
from grpo_jax.models import load_hf
from grpo_jax.models import save_hf
from grpo_jax.models.decoder.config import ModelConfig
from grpo_jax.rollout import sample
from tests.rollout.test_sampler import prompts
from tests.rollout.test_sampler import trainer_logprobs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Windows shorter than the rows, both soft-caps on (Gemma 2), local and global layers with two
# RoPE bases and linear scaling (Gemma 3), q scales != head_dim, GQA and MQA.
GEMMA2 = [
    dict(
        sliding_window=5,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        num_hidden_layers=4,
    ),
    dict(
        sliding_window=3,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        num_hidden_layers=3,
        num_key_value_heads=1,
    ),
]
GEMMA3 = [
    dict(
        sliding_window=4,
        query_pre_attn_scalar=20,
        num_hidden_layers=4,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    ),
    dict(
        sliding_window=6,
        query_pre_attn_scalar=16,
        num_hidden_layers=3,
        num_key_value_heads=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
]
CASES = [("gemma2", k) for k in GEMMA2] + [("gemma3", k) for k in GEMMA3]


def hf_model(kind, kw, seed=0):
  torch.manual_seed(seed)
  common = dict(
      hidden_size=64,
      intermediate_size=96,
      max_position_embeddings=256,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=16,
      vocab_size=103,
      attn_implementation="eager",
  )
  if kind == "gemma2":
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**common, **kw}))
  else:
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**common, **kw}))
  with torch.no_grad():  # non-zero (1 + w) norm scales, so their mapping is tested
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.3 * torch.randn_like(p))
  return model.eval()


def hf_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(ids))).logits.float().numpy()


@pytest.mark.parametrize("kind,kw", CASES)
def test_logits_equal_transformers_with_windows_and_softcaps(kind, kw, tmp_path):
  model = hf_model(kind, kw)
  model.save_pretrained(tmp_path, safe_serialization=True)
  ids = np.random.default_rng(1).integers(0, 103, (3, 14))  # 14 > every window
  theirs = hf_logits(model, ids)
  ours = load_hf(str(tmp_path))
  assert ours.cfg.arch == kind and ours.cfg.sliding_window == kw["sliding_window"]
  for variant in (
      dict(),
      dict(scan_layers=True),
      dict(attention_impl="fused"),
      dict(attention_impl="fused", scan_layers=True),
  ):
    got = np.asarray(load_hf(str(tmp_path), **variant)(jnp.asarray(ids)))
    assert np.abs(got - theirs).max() <= 1e-5, (variant, np.abs(got - theirs).max())
  # The windows and caps are live here: without them the logits differ.
  off = load_hf(str(tmp_path), sliding_window=0)
  assert np.abs(np.asarray(off(jnp.asarray(ids))) - theirs).max() > 1e-3


@pytest.mark.parametrize("kind,kw", CASES[::2])
def test_greedy_equals_transformers_generate(kind, kw, tmp_path):
  model = hf_model(kind, kw, seed=2)
  model.save_pretrained(tmp_path, safe_serialization=True)
  ours = load_hf(str(tmp_path))
  ids = np.random.default_rng(3).integers(1, 103, (2, 5))
  with torch.no_grad():
    want = model.generate(
        torch.tensor(ids), max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0
    ).numpy()[:, 5:]
  r = sample(
      ours,
      jnp.asarray(ids, jnp.int32),
      jnp.ones((2, 5), jnp.int32),
      num_generations=1,
      max_new_tokens=12,
      rng=jax.random.key(0),
      generation="greedy",
      eos_ids=(),
  )
  np.testing.assert_array_equal(np.asarray(r.tokens), want)  # 17 tokens > every window


@pytest.mark.parametrize(
    "preset,scan",
    [  # suite time: -m slow runs Gemma 2's
        pytest.param("tiny-gemma2", False, marks=pytest.mark.slow),
        ("tiny-gemma3", True),
    ],
)
def test_sampler_logprobs_equal_the_trainers(preset, scan):
  """Left-padded prompts, G samples sharing the prompt's keys, completions past the window."""
  cfg = PRESETS[preset].replace(scan_layers=scan)
  model = build_model(cfg, seed=4)
  ids, mask = prompts(cfg.vocab_size, seed=5)
  r = sample(
      model,
      ids,
      mask,
      num_generations=3,
      max_new_tokens=10,
      rng=jax.random.key(2),
      generation="standard",
      eos_ids=(5,),
  )
  m = np.asarray(r.mask) > 0
  assert m.sum(1).max() > cfg.sliding_window
  train = np.asarray(trainer_logprobs(model, ids, mask, r, 3))
  assert np.abs(train - np.asarray(r.raw_logprobs))[m].max() <= 1e-5


@pytest.mark.parametrize(
    "preset", [pytest.param("tiny-gemma2", marks=pytest.mark.slow), "tiny-gemma3"]
)
def test_padding_does_not_move_the_window(preset):
  """A row's logits are the same left-padded, right-padded or alone: windows count real
  tokens, not slots."""
  model = build_model(PRESETS[preset], seed=6)
  ids = jnp.asarray(np.random.default_rng(7).integers(1, 100, (1, 11)))
  alone = np.asarray(model(ids))[0]
  pad = jnp.zeros((1, 4), ids.dtype)
  left = model(
      jnp.concatenate([pad, ids], 1),
      jnp.concatenate([jnp.zeros((1, 4)), jnp.ones((1, 11))], 1).astype(jnp.int32),
  )
  right = model(
      jnp.concatenate([ids, pad], 1),
      jnp.concatenate([jnp.ones((1, 11)), jnp.zeros((1, 4))], 1).astype(jnp.int32),
  )
  np.testing.assert_allclose(np.asarray(left)[0, 4:], alone, atol=1e-5)
  np.testing.assert_allclose(np.asarray(right)[0, :11], alone, atol=1e-5)


def test_local_layers_never_take_the_linear_rope_scaling():
  """Gemma 3's local layers use their own RoPE base unscaled, also when rope_local_theta=0
  means "the global base" (saved as rope_local_base_freq = rope_theta, which HF reads so): the
  model equals the one with that base spelled out; the global layers do take the scaling."""
  cfg = PRESETS["tiny-gemma3"].replace(rope_local_theta=PRESETS["tiny-gemma3"].rope_theta)
  ids = jnp.asarray(np.random.default_rng(3).integers(1, 100, (2, 12)))
  spelled = np.asarray(build_model(cfg, seed=4)(ids))
  implied = np.asarray(build_model(cfg.replace(rope_local_theta=0.0), seed=4)(ids))
  np.testing.assert_array_equal(implied, spelled)
  unscaled = np.asarray(build_model(cfg.replace(rope_linear_factor=1.0), seed=4)(ids))
  assert np.abs(unscaled - spelled).max() > 1e-3


@pytest.mark.parametrize("preset", ["tiny-gemma2", "tiny-gemma3"])
def test_save_hf_loads_in_transformers_with_our_logits(preset, tmp_path):
  model = build_model(PRESETS[preset], seed=8)
  save_hf(model, str(tmp_path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager")
  ids = np.random.default_rng(9).integers(0, model.cfg.vocab_size, (2, 12))
  ours = np.asarray(model(jnp.asarray(ids)))
  assert np.abs(ours - hf_logits(hf.eval(), ids)).max() <= 1e-5
  back = load_hf(str(tmp_path))
  assert back.cfg.replace(param_dtype="float32") == model.cfg


def test_config_json_forms():
  """Gemma 3 folders as they are published: the 1B's flat form (rope_local_base_freq,
  sliding_window_pattern), a multimodal folder's text_config, and layer types that are no
  N-th-layer pattern refused in one line."""
  flat = dict(
      model_type="gemma3_text",
      architectures=["Gemma3ForCausalLM"],
      vocab_size=262144,
      hidden_size=1152,
      intermediate_size=6912,
      num_hidden_layers=26,
      num_attention_heads=4,
      num_key_value_heads=1,
      head_dim=256,
      rope_theta=1e6,
      rope_local_base_freq=10000.0,
      rope_scaling=None,
      sliding_window=512,
      sliding_window_pattern=6,
      query_pre_attn_scalar=256,
      rms_norm_eps=1e-6,
      max_position_embeddings=32768,
      hidden_activation="gelu_pytorch_tanh",
      final_logit_softcapping=None,
      attn_logit_softcapping=None,
  )
  assert ModelConfig.from_hf_config(flat) == PRESETS["gemma3-1b"]
  text = {k: v for k, v in flat.items() if k not in ("architectures", "model_type")}
  text.update(
      vocab_size=262208,
      hidden_size=2560,
      intermediate_size=10240,
      num_hidden_layers=34,
      num_attention_heads=8,
      num_key_value_heads=4,
      sliding_window=1024,
      max_position_embeddings=131072,
      rope_scaling={"rope_type": "linear", "factor": 8.0},
  )
  mm = dict(
      model_type="gemma3",
      architectures=["Gemma3ForConditionalGeneration"],
      text_config=text,
      vision_config={},
  )
  assert ModelConfig.from_hf_config(mm) == PRESETS["gemma3-4b"]
  odd = dict(
      flat,
      num_hidden_layers=3,
      layer_types=["full_attention", "sliding_attention", "sliding_attention"],
  )
  with pytest.raises(ValueError, match="not a pattern"):
    ModelConfig.from_hf_config(odd)
  assert json.loads(json.dumps(PRESETS["gemma2-2b"].to_hf_config()))["layer_types"][:2] == [
      "sliding_attention",
      "full_attention",
  ]


@pytest.mark.parametrize(
    "overrides",
    [
        {"model.scan_layers": True, "beta": 0.08},  # the reference's log-probs too
        pytest.param(
            {"lora.rank": 4, "lora.alpha": 8.0},  # adapters on Gemma's projections
            marks=pytest.mark.slow,
        ),
    ],
)
def test_loop_steps_with_a_gemma3_policy(tmp_path, overrides):
  """configs/tiny_gemma3.py's policy in the loop: the windows (3 < the 13-token rows) and both
  RoPE bases live; the first step's ratio is 1 (sampler == trainer) and the params move."""
  from grpo_jax import train
  from tests.test_train import grpo_rows
  from tests.test_train import tiny_config

  cfg = tiny_config(
      **{
          "model.arch": "gemma3",
          "model.sliding_window": 3,
          "model.sliding_window_pattern": 2,
          "model.rope_local_theta": 1e4,
          "model.query_pre_attn_scalar": 32.0,
          **overrides,
      }
  )
  train.run(cfg, str(tmp_path))
  rows = grpo_rows(str(tmp_path))
  assert len(rows) == 3 and all(np.isfinite(r["loss/total"]) for r in rows)
  assert abs(rows[0]["loss/ppo_kl"]) < 1e-6  # on-policy: the trainer re-scores the sample
  assert max(abs(r["loss/policy_loss"]) for r in rows) > 0


def test_local_layers_decode_over_a_window_sized_ring():
  """The sampler keeps W completion slots for a local layer (a ring), all of them for a global
  one; over 14 new tokens (the ring wraps three times), in 1 or 3 decode phases (the cache
  grown between them), the tokens are the same and the log-probs are the trainer's."""
  from flax import nnx
  from grpo_jax.models.decoder.cache import ring_sizes
  from grpo_jax.models.decoder.cache import share_prompt
  from grpo_jax.rollout import GenerationConfig
  from grpo_jax.rollout import Sampler

  cfg = PRESETS["tiny-gemma3"]  # window 4; layers 0, 1, 3 local, 2 global
  model = build_model(cfg, seed=11)
  cache = share_prompt(model.init_cache(4, 7), 3, 14, 1, ring_sizes(cfg))
  assert [k.shape[2] for k in cache["k"]] == [4, 4, 14, 4]
  ids, mask = prompts(cfg.vocab_size, seed=12)
  graphdef, state = nnx.split(model)
  out = {}
  for phases in (1, 3):
    s = Sampler(
        graphdef,
        max_prompt_length=7,
        max_new_tokens=14,
        num_generations=3,
        eos_ids=(),
        decode_phases=phases,
    )
    out[phases] = s(state, ids, mask, jax.random.key(13), GenerationConfig(temperature=1.0))
  np.testing.assert_array_equal(out[1].tokens, out[3].tokens)
  train = np.asarray(trainer_logprobs(model, ids, mask, out[3], 3))
  assert np.abs(train - np.asarray(out[3].raw_logprobs)).max() <= 1e-5


def test_the_hbm_plan_counts_window_sized_rings():
  """memory_plan's KV-cache bytes for Gemma 3 1B at 8k tokens per row (bf16, one device): 4
  global layers x 8192 slots + 22 local ones x 512, 1 KV head x 256 x (k, v) x 2 bytes each:
  43 MiB, not the 208 MiB of every slot in every layer."""
  from grpo_jax import memory_plan
  from grpo_jax.parallel import sharding

  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  cfg = PRESETS["gemma3-1b"].replace(dtype="bfloat16")
  valid = 8192 * 4  # the row's slot-validity int32s
  assert memory_plan.kv_cache_bytes(cfg, 1, 8192, mesh) == (4 * 8192 + 22 * 512) * 1024 + valid
  assert memory_plan.kv_cache_bytes(cfg.replace(sliding_window=0), 1, 8192, mesh) == (
      26 * 8192 * 1024 + valid
  )
