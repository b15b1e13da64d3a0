"""Logit parity with `transformers` (the ground truth) and Hugging Face checkpoint round trips."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.parallel import sharding
from grpo_jax.models.decoder import hf as hf_lib
from grpo_jax.models import load_hf
from grpo_jax.models import save_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

QWEN3 = [
    # tied, heads, kv heads, head_dim (!= hidden/heads), theta, vocab (odd)
    dict(
        tie_word_embeddings=False,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rope_theta=10000.0,
        vocab_size=97,
    ),
    dict(
        tie_word_embeddings=True,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=1e6,
        vocab_size=131,
    ),
    dict(
        tie_word_embeddings=False,
        num_attention_heads=6,
        num_key_value_heads=6,
        head_dim=8,
        rope_theta=333.0,
        vocab_size=64,
        attention_bias=True,
    ),
]
LLAMA = [
    dict(
        tie_word_embeddings=True,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=101,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    dict(
        tie_word_embeddings=False,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=77,
        rope_theta=10000.0,
    ),
]


def hf_model(kind, kw, seed=0):
  torch.manual_seed(seed)
  common = dict(
      hidden_size=64,
      intermediate_size=96,
      num_hidden_layers=2,
      max_position_embeddings=256,
      attn_implementation="eager",
  )
  if kind == "qwen3":
    cfg = transformers.Qwen3Config(**common, **kw)
    model = transformers.Qwen3ForCausalLM(cfg)
  else:
    cfg = transformers.LlamaConfig(**common, **kw)
    model = transformers.LlamaForCausalLM(cfg)
  with torch.no_grad():  # non-trivial norm scales and biases, so their mapping is tested
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith("bias"):
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def left_padded_batch(vocab, seed=0, b=4, t=13):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, (b, t))
  lens = [t, t - 5, 1, t - 2][:b]
  mask = (np.arange(t)[None] >= (t - np.array(lens))[:, None]).astype(np.int64)
  return ids, mask


def hf_logits(model, ids, mask):
  pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
  with torch.no_grad():
    return (
        model(torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos))
        .logits.float()
        .numpy()
    )


def assert_parity(ours, theirs, mask, tol=1e-5):
  diff = np.abs(np.asarray(ours) - theirs)[mask > 0]
  assert diff.max() <= tol, diff.max()


@pytest.mark.parametrize("kind,kw", [("qwen3", k) for k in QWEN3] + [("llama", k) for k in LLAMA])
def test_logit_parity_left_padded(kind, kw, tmp_path):
  model = hf_model(kind, kw)
  model.save_pretrained(tmp_path, safe_serialization=True)
  ours = load_hf(str(tmp_path))
  ids, mask = left_padded_batch(kw["vocab_size"])
  assert_parity(ours(jnp.asarray(ids), jnp.asarray(mask)), hf_logits(model, ids, mask), mask)
  # No mask at all = every token real.
  full = np.ones_like(mask)
  assert_parity(ours(jnp.asarray(ids)), hf_logits(model, ids, full), full)


def test_sharded_checkpoint_and_scanned_layers(tmp_path):
  model = hf_model("qwen3", QWEN3[0])
  model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  ids, mask = left_padded_batch(97, seed=1)
  want = hf_logits(model, ids, mask)
  for scan in (False, True):
    ours = load_hf(str(tmp_path), scan_layers=scan)
    assert_parity(ours(jnp.asarray(ids), jnp.asarray(mask)), want, mask)


@pytest.mark.parametrize("kind,kw", [("qwen3", QWEN3[0]), ("qwen3", QWEN3[2]), ("llama", LLAMA[0])])
def test_save_hf_round_trip(kind, kw, tmp_path):
  model = hf_model(kind, kw, seed=3)
  model.save_pretrained(tmp_path / "src", safe_serialization=True)
  ours = load_hf(str(tmp_path / "src"))
  save_hf(ours, str(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "out"), attn_implementation="eager"
  )
  ids, mask = left_padded_batch(kw["vocab_size"], seed=2)
  np.testing.assert_array_equal(hf_logits(back, ids, mask), hf_logits(model, ids, mask))
  # And our own loader reads what we wrote, sharded too.
  save_hf(ours, str(tmp_path / "sharded"), max_shard_bytes=30_000)
  assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
  again = load_hf(str(tmp_path / "sharded"))
  np.testing.assert_array_equal(
      np.asarray(again(jnp.asarray(ids), jnp.asarray(mask))),
      np.asarray(ours(jnp.asarray(ids), jnp.asarray(mask))),
  )


def test_bf16_load_and_save(tmp_path):
  model = hf_model("qwen3", QWEN3[1]).to(torch.bfloat16)
  model.save_pretrained(tmp_path / "src", safe_serialization=True)
  ours = load_hf(str(tmp_path / "src"), dtype=jnp.bfloat16)
  leaves = jax.tree.leaves(jax.tree.map(lambda x: x.dtype, ours.embed[...]))
  assert leaves == [jnp.bfloat16]
  save_hf(ours, str(tmp_path / "out"))
  back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
  for (n1, p1), (n2, p2) in zip(model.named_parameters(), back.named_parameters()):
    assert n1 == n2 and p2.dtype == torch.bfloat16
    assert torch.equal(p1, p2), n1


def test_load_directly_into_mesh_shardings(tmp_path):
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  model = hf_model("qwen3", QWEN3[1])
  model.save_pretrained(tmp_path, safe_serialization=True)
  mesh = sharding.make_mesh(2, 2, 2)
  ours = load_hf(str(tmp_path), mesh=mesh)
  q = ours.layers[0].attn.q[...]  # [D, H, K]: embed over fsdp, heads over tensor
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  ids, mask = left_padded_batch(131)
  assert_parity(ours(jnp.asarray(ids), jnp.asarray(mask)), hf_logits(model, ids, mask), mask)


# ------------------------------------------------------------------------------- errors


def test_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json: missing"):
    load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(hf_model("qwen3", QWEN3[0]).config.to_dict()))
  with pytest.raises(FileNotFoundError, match="no model.safetensors"):
    load_hf(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="not a directory"):
    load_hf(str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path):
  cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
  transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path, safe_serialization=True)
  with pytest.raises(ValueError, match="unsupported architecture.*gpt2"):
    load_hf(str(tmp_path))


def test_logit_softcapping_is_refused_not_ignored():
  """No supported family soft-caps logits; a config that asks for it is refused by name."""
  from grpo_jax.models.decoder.config import ModelConfig

  cfg = hf_model("qwen3", QWEN3[0]).config.to_dict()
  cfg["final_logit_softcapping"] = 30.0
  with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
    ModelConfig.from_hf_config(cfg)


@pytest.mark.parametrize("kind,act", [("qwen3", "gelu"), ("llama", "relu")])
def test_an_mlp_activation_other_than_silu_is_refused_not_ignored(kind, act):
  """The native Qwen3/Llama MLP is SwiGLU: a folder whose hidden_act is another function would
  load and compute other logits without a word; it is refused by name ("swish" is SiLU)."""
  from grpo_jax.models.decoder.config import ModelConfig

  cfg = hf_model(kind, (QWEN3 if kind == "qwen3" else LLAMA)[0]).config.to_dict()
  ModelConfig.from_hf_config(dict(cfg, hidden_act="swish"))
  with pytest.raises(ValueError, match=f"hidden_act='{act}'"):
    ModelConfig.from_hf_config(dict(cfg, hidden_act=act))


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
  model = hf_model("qwen3", QWEN3[0])
  model.save_pretrained(tmp_path, safe_serialization=True)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["intermediate_size"] = 80  # the file holds 96
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(
      ValueError, match=r"mlp.gate_proj.weight: checkpoint has \(96, 64\).*" r"implies \(80, 64\)"
  ):
    load_hf(str(tmp_path))


def test_mapping_covers_every_parameter_once():
  for kind, kw in [("qwen3", QWEN3[2]), ("llama", LLAMA[1])]:
    model = hf_model(kind, kw)
    ours_cfg = hf_lib.ModelConfig.from_hf_config(model.config.to_dict())
    names = []
    for e in hf_lib.param_mapping(ours_cfg):
      names += [n for _, _, n in hf_lib._native_paths(ours_cfg, e)]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
