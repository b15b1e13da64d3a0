"""The loop on parquet (verl's layout) and Hugging Face datasets (TRL's): the same rows as the
arithmetic task give the same run, through epochs and a stop + resume; a verl GSM8K parquet
trains with the real tokenizer and no flag beyond its path; a bad row stops at start-up."""

import os

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

from grpo_jax import data as data_lib  # noqa: E402
from grpo_jax import train  # noqa: E402
from tests.data import tables_fixtures as fx  # noqa: E402
from tests.test_train import checkpoint_state  # noqa: E402
from tests.test_train import flat  # noqa: E402
from tests.test_train import grpo_rows  # noqa: E402
from tests.test_train import tiny_config  # noqa: E402

ROOT = fx.ROOT
# 16 rows, batches of 8: 2 steps per epoch, so 5 steps cross two epoch boundaries.
SMALL = {"data.arithmetic.num_train": 16, "num_steps": 5}


def table_overrides(tmp_path, kind: str) -> dict:
  """The arithmetic config's train and eval rows, written as `kind` files: overrides that
  read them instead of generating them."""
  train_rows, eval_rows = data_lib.load_rows(tiny_config(**SMALL))
  if kind == "parquet":  # verl: messages, reward_model.ground_truth, demonstration in extra_info
    tr = fx.write_parquet(
        fx.verl_records_from_rows(train_rows), str(tmp_path / "v" / "train.parquet")
    )
    ev = fx.write_parquet(
        fx.verl_records_from_rows(eval_rows, "test"), str(tmp_path / "v" / "test.parquet")
    )
    return {
        "data.train_source": "parquet",
        "data.train_path": tr,
        "data.eval_source": "parquet",
        "data.eval_path": ev,
        "data.columns.demonstration": "extra_info.demonstration",
    }
  # TRL: a save_to_disk DatasetDict, the answer in `solution`, the task name in `task`
  path = fx.save_dataset(
      fx.trl_records_from_rows(train_rows),
      str(tmp_path / "trl"),
      test_records=fx.trl_records_from_rows(eval_rows),
  )
  return {
      "data.train_source": "hf_dataset",
      "data.train_path": path,
      "data.eval_source": "hf_dataset",
      "data.eval_path": path,
      "data.columns.ground_truth": "solution",
      "data.columns.data_source": "task",
      "data.columns.demonstration": "target",
  }


@pytest.fixture(scope="module")
def arithmetic_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("arith") / "run")
  train.run(tiny_config(**SMALL), workdir)
  return workdir


# The same values as tests/data/digit_count_reward.py, as a TRL-style batch function that fails
# from the third batch on while FLAKY_REWARD is set (a scorer dying mid-run).
FLAKY = """import os
calls = []
def digits(prompts, completions, solution, task, **kwargs):
  if len(completions) > 1:
    calls.append(1)
  if len(calls) >= 3 and os.environ.get("FLAKY_REWARD"):
    raise RuntimeError("the scorer service went away")
  return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]
"""


# Both slow (suite time, ~35 s each): the default suite trains on parquet in the GSM8K test
# below and reads hf_dataset folders in tests/data/test_data_tables.py.
@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("parquet", marks=pytest.mark.slow),
        pytest.param("hf_dataset", marks=pytest.mark.slow),
    ],
)
def test_table_sources_train_exactly_like_the_same_rows_through_a_resume(
    tmp_path, kind, arithmetic_run, monkeypatch
):
  """5 steps over 16 rows in batches of 8 (two epoch boundaries) == the arithmetic task's run.
  parquet: a clean stop after step 3 (mid-epoch), then the resume. hf_dataset: a TRL-style
  reward fails at step 3, after step 2's checkpoint (written asynchronously): the run stops
  with the error, the checkpoint is complete, and the relaunch resumes from it."""
  over = dict(SMALL, **table_overrides(tmp_path, kind))
  rows_a, rows_b = (data_lib.load_rows(tiny_config(**o)) for o in (SMALL, over))
  assert [r["ground_truth"] for r in rows_a[0]] == [r["ground_truth"] for r in rows_b[0]]
  assert [r["demonstration"] for r in rows_a[0]] == [r["demonstration"] for r in rows_b[0]]

  split = str(tmp_path / "split")
  if kind == "parquet":
    with pytest.raises(SystemExit) as e:
      train.run(tiny_config(max_steps_per_run=3, **over), split)
    assert e.value.code == 0
  else:
    plugin = tmp_path / "flaky.py"
    plugin.write_text(FLAKY)
    over.update(
        {
            "reward.custom_file": str(plugin),
            "reward.custom_function": "digits",
            "save_interval_steps": 2,
        }
    )
    monkeypatch.setenv("FLAKY_REWARD", "1")
    with pytest.raises(Exception, match="the scorer service went away"):
      train.run(tiny_config(**over), split)
    monkeypatch.delenv("FLAKY_REWARD")
    assert checkpoint_state(split)[0] == 2  # reads back: complete
  assert train.run(tiny_config(**over), split)["final_step"] == 5

  a, b = grpo_rows(arithmetic_run), grpo_rows(split)
  assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
  for ra, rb in zip(a, b):
    for k in ("reward/total", "loss/policy_loss", "completions/mean_length", "loss/grad_norm"):
      assert ra[k] == rb[k], (kind, ra["step"], k, ra[k], rb[k])
  fa, fb = flat(checkpoint_state(arithmetic_run, 5)[1]["train"]), flat(
      checkpoint_state(split, 5)[1]["train"]
  )
  for k in fa:
    np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_verl_gsm8k_parquet_trains_the_demo_model_with_only_its_path(tmp_path):
  """verl's GSM8K parquet (text made ASCII for the char tokenizer) on the CPU demo's config:
  nothing but the source and the path set for the data; GSM8K's rewards score its answers."""
  tr = fx.write_parquet(
      fx.verl_gsm8k_records("train", 32, ascii_only=True), str(tmp_path / "train.parquet")
  )
  ev = fx.write_parquet(
      fx.verl_gsm8k_records("test", 8, ascii_only=True), str(tmp_path / "test.parquet")
  )
  config = tiny_config(
      **{
          "data.train_source": "parquet",
          "data.train_path": tr,
          "data.eval_source": "parquet",
          "data.eval_path": ev,
          "num_steps": 2,
          "eval.num_examples": 8,
          "eval.batch_size": 8,
          "reward.functions": ("answer_format", "check_answer"),
          "reward.weights": (1.0, 1.0),
          "data.overlong_prompts": "truncate",  # the demo's 6-token prompts cut GSM8K's
      }
  )
  assert train.run(config, str(tmp_path / "run"))["final_step"] == 2
  rows = grpo_rows(str(tmp_path / "run"))
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["loss/total"]) and r["loss/grad_norm"] > 0 for r in rows)
  assert "reward/check_answer" in rows[-1]


@pytest.mark.slow  # ~1 min: a 152k-token vocabulary on the demo-sized model
def test_verl_gsm8k_parquet_trains_with_the_qwen_tokenizer(tmp_path):
  """The same file as it is (curly quotes and all) with the Qwen tokenizer, chatml and the
  reasoning system prompt: the recipes' data defaults."""
  tr = fx.write_parquet(fx.verl_gsm8k_records("train", 32), str(tmp_path / "train.parquet"))
  ev = fx.write_parquet(fx.verl_gsm8k_records("test", 8), str(tmp_path / "test.parquet"))
  tok = fx.QWEN_TOKENIZER
  if not os.path.exists(os.path.join(tok, "vocab.json")):
    pytest.skip(f"{tok} not present (../shared/data)")
  config = tiny_config(
      **{
          "data.train_source": "parquet",
          "data.train_path": tr,
          "data.eval_source": "parquet",
          "data.eval_path": ev,
          "tokenizer.kind": "hf",
          "tokenizer.path": tok,
          "model.vocab_size": 151936,
          "data.template": "chatml",
          "data.system_prompt": "reasoning",
          "max_prompt_length": 48,
          "data.overlong_prompts": "truncate",  # 48 tokens cut GSM8K's questions on purpose
          "max_completion_length": 8,
          "model.max_position_embeddings": 64,
          "num_steps": 2,
          "eval.num_examples": 8,
          "eval.batch_size": 8,
          "reward.functions": ("match_format_approximately", "check_answer"),
          "reward.weights": (1.0, 1.0),
          "reward.custom_file": "",
      }
  )
  assert train.run(config, str(tmp_path / "run"))["final_step"] == 2
  rows = grpo_rows(str(tmp_path / "run"))
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["loss/total"]) for r in rows)
