"""The path layer (grpo_jax/run/paths.py) on a local folder and on gs:// (an offline GCS emulator):
every reader and writer of user paths goes through it, so each is tried on both."""

import json
import os
import sys

from etils import epath
import numpy as np
import pytest

from grpo_jax import configuration
from grpo_jax.run import paths
from grpo_jax.data import datasets
from grpo_jax.data import tokenizers
from grpo_jax.models import safetensors_io
from grpo_jax.rewards import scoring
from tests.test_bad_inputs import MINI_TOKENIZER


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
  if request.param == "local":
    return str(tmp_path)
  return request.getfixturevalue("gcs") + "/t"


def test_local_paths_are_absolute_and_cloud_paths_untouched(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert os.fspath(paths.path("run")) == str(tmp_path / "run")
  assert os.fspath(paths.path("gs://b/run")) == "gs://b/run"
  assert paths.is_remote("gs://b/x") and not paths.is_remote("gs:/b") and not paths.is_remote("x")


def test_atomic_write_append_log_and_listing(root):
  paths.write_atomic(f"{root}/a/summary.json", json.dumps({"x": 1}))
  assert json.loads(paths.read_text(f"{root}/a/summary.json")) == {"x": 1}
  assert paths.listdir(f"{root}/a") == ["summary.json"]  # no temp file left behind
  log = paths.AppendLog(f"{root}/a/metrics.jsonl")
  log.write("1\n")
  log.flush()
  log.write("2\n")
  log.close()
  again = paths.AppendLog(f"{root}/a/metrics.jsonl")  # a resumed run keeps what was there
  again.write("3\n")
  again.close()
  assert paths.read_text(f"{root}/a/metrics.jsonl") == "1\n2\n3\n"


def test_safetensors_round_trip_with_ranged_reads(root):
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  b = np.arange(5, dtype=np.int32)
  fn = f"{root}/ckpt/model.safetensors"
  paths.makedirs(f"{root}/ckpt")
  safetensors_io.write(fn, [("a", a.shape, a.dtype, lambda: a), ("b", b.shape, b.dtype, lambda: b)])
  f = safetensors_io.SafetensorsFile(fn)
  np.testing.assert_array_equal(f.get("a"), a)
  np.testing.assert_array_equal(f.get("b"), b)


def test_data_tokenizer_and_reward_file_from_any_path(root):
  rows = [{"question": "1+1?", "answer": "#### 2"}]
  paths.write_atomic(f"{root}/d/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
  assert [r for _, r in datasets._read_records(f"{root}/d/train.jsonl")] == rows
  for name, text in MINI_TOKENIZER.items():
    paths.write_atomic(f"{root}/tok/{name}", text)
  tok = tokenizers.build_tokenizer("hf", f"{root}/tok")
  assert tok.encode("hi") == [2] and tok.decode([2, 0]) == "hih" and tok.eos_id == 3
  paths.write_atomic(
      f"{root}/r/my_reward.py",
      "def compute_score(data_source, solution_str, ground_truth, "
      "extra_info=None):\n  return float(solution_str == ground_truth)\n",
  )
  fn = scoring.load_custom_file(f"{root}/r/my_reward.py")
  assert fn("x", "2", "2") == 1.0


def test_validation_checks_existence_through_the_layer(gcs):
  from configs import tiny

  cfg = tiny.get_config()
  paths.write_atomic(f"{gcs}/data/train.jsonl", "{}\n")
  cfg.data.train_source, cfg.data.train_path = "gsm8k", f"{gcs}/data/train.jsonl"
  cfg.model.maxtext_checkpoint = f"{gcs}/mt/0/items"  # seed-style path, missing
  errors = configuration.validate(cfg)
  assert not any("data.train_path" in e for e in errors), errors
  assert any(
      e.startswith(
          "model.maxtext_checkpoint='gs://bucket/mt/0/items': the MaxText "
          "checkpoint does not exist"
      )
      for e in errors
  ), errors


def test_cloud_scheme_without_its_package_is_one_clear_line(monkeypatch):
  monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
  why, fix = paths.check_scheme("gs://bucket/run")
  assert why == "gs:// paths need the gcsfs package" and fix == "pip install -e '.[gcs]'"
  assert paths.check_scheme("/tmp/run") is None
  from configs import tiny

  cfg = tiny.get_config()
  cfg.tokenizer.path = "gs://bucket/tok"
  assert (
      "tokenizer.path='gs://bucket/tok': gs:// paths need the gcsfs package. Fix: pip "
      "install -e '.[gcs]'."
  ) in configuration.validate(cfg)


def test_epath_is_what_orbax_gets(gcs):
  from grpo_jax.run import checkpoint

  ckpt = checkpoint.Checkpointer(f"{gcs}/run/checkpoints", max_to_keep=1, async_save=False)
  assert ckpt.directory == f"{gcs}/run/checkpoints"
  ckpt.close()
  assert isinstance(paths.path(gcs), epath.Path)
