"""`grpo_jax.models.load_hf` / `save_hf` pick the family by config.json / the module: the
decoders and T5 through one entry point, an unknown architecture refused in one line."""

import json

from flax import nnx
import numpy as np
import pytest

from grpo_jax import models
from grpo_jax.models import families
from grpo_jax.models.decoder.presets import PRESETS
from grpo_jax.models.t5.model import T5
from grpo_jax.models.t5.model import build_t5
from grpo_jax.models.t5.config import T5Config
from grpo_jax.models.t5.hf import load_t5_hf
from grpo_jax.models.decoder.transformer import Transformer


def test_load_hf_reads_a_t5_folder_as_t5(tmp_path):
  t5 = build_t5(T5Config(), seed=3)
  models.save_hf(t5, str(tmp_path))  # the family writes its own folder
  assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "t5"
  got = models.load_hf(str(tmp_path))
  assert isinstance(got, T5)
  ref = load_t5_hf(str(tmp_path))
  rng = np.random.default_rng(0)
  ids = rng.integers(2, 256, (2, 7)).astype(np.int32)
  dec = rng.integers(2, 256, (2, 5)).astype(np.int32)
  mask, dmask = np.ones_like(ids), np.ones_like(dec)
  np.testing.assert_array_equal(
      np.asarray(got(ids, mask, dec, dmask)), np.asarray(ref(ids, mask, dec, dmask))
  )
  np.testing.assert_allclose(
      np.asarray(got(ids, mask, dec, dmask)), np.asarray(t5(ids, mask, dec, dmask)), atol=1e-6
  )


def test_load_hf_reads_a_decoder_folder_as_the_decoder(tmp_path):
  model = Transformer(PRESETS["tiny-qwen3"], rngs=nnx.Rngs(0))
  models.save_hf(model, str(tmp_path))
  got = models.load_hf(str(tmp_path), scan_layers=False)
  assert isinstance(got, Transformer)
  ids = np.arange(12, dtype=np.int32).reshape(2, 6) % PRESETS["tiny-qwen3"].vocab_size
  np.testing.assert_allclose(np.asarray(got(ids)), np.asarray(model(ids)), atol=1e-6)


def test_an_unknown_architecture_names_the_supported_ones(tmp_path):
  (tmp_path / "config.json").write_text(
      json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
  )
  with pytest.raises(
      ValueError,
      match=r"config.json: unsupported architecture \(model_type="
      r"'gpt2', architectures=\['GPT2LMHeadModel'\]\)\. Supported: decoder .*"
      r"model_type qwen3, llama, gemma2, gemma3_text, gemma3, qwen3_moe; t5 .*model_type t5",
  ):
    models.load_hf(str(tmp_path))
  # architectures alone pick the family when model_type is missing
  assert families.family_of({"architectures": ["T5ForConditionalGeneration"]}).name.startswith("t5")
