"""Parquet (verl's layout) and Hugging Face datasets (TRL's) as data sources: the rows they
give, chat-message prompts through every template, the column map, extra columns as reward
keywords, and bad rows refused at start-up naming the file, row and column."""

import os

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

from grpo_jax.data import datasets as data_readers  # noqa: E402
from grpo_jax.data import pipeline  # noqa: E402
from grpo_jax.data import tables  # noqa: E402
from grpo_jax.data import templates  # noqa: E402
from grpo_jax.data import tokenizers  # noqa: E402
from grpo_jax.data.arithmetic import arithmetic_rows  # noqa: E402
from grpo_jax.rewards import computer  # noqa: E402
from grpo_jax.rewards import parsing  # noqa: E402
from grpo_jax.rewards import scoring  # noqa: E402
from tests.data import tables_fixtures as fx  # noqa: E402

DataError = data_readers.DataError


def test_verl_gsm8k_parquet_reads_as_verl_wrote_it(tmp_path):
  records = fx.verl_gsm8k_records("train", 40)
  path = fx.write_parquet(records, str(tmp_path / "train.parquet"), row_group_size=16)
  rows = tables.read_parquet(path)
  source = fx.gsm8k_source("train", 40)
  assert len(rows) == 40
  for r, s, rec in zip(rows, source, records):
    assert r["prompt"] == rec["prompt"]  # the chat messages, as written
    assert r["ground_truth"] == parsing.gsm8k_ground_truth(s["answer"])
    assert r["data_source"] == "openai/gsm8k"
    assert r["extra_info"] == rec["extra_info"]  # verl's own dict, nested values kept
    assert r["columns"]["reward_model"] == rec["reward_model"]
    assert r["columns"]["ability"] == "math" and "prompt" not in r["columns"]
  # verl's data_source name reaches the built-in scorer (math by the last part of the name).
  assert (
      scoring.default_compute_score(
          "openai/gsm8k", f"so #### {rows[0]['ground_truth']}", rows[0]["ground_truth"]
      )
      == 1.0
  )


def test_parquet_folder_and_glob_read_every_file_in_order(tmp_path):
  records = fx.verl_records_from_rows(arithmetic_rows(30, split="train", seed=0))
  for i, part in enumerate((records[:10], records[10:25], records[25:])):
    fx.write_parquet(part, str(tmp_path / "d" / f"part-{i}.parquet"))
  (tmp_path / "d" / "notes.txt").write_text("not data")
  whole = tables.read_parquet(str(tmp_path / "d"))
  globbed = tables.read_parquet(str(tmp_path / "d" / "part-*.parquet"))
  assert [r["prompt"][0]["content"] for r in whole] == [r["prompt"][0]["content"] for r in records]
  assert whole == globbed
  with pytest.raises(DataError, match=r"part-\[7-9\]\.parquet: no file matches"):
    tables.read_parquet(str(tmp_path / "d" / "part-[7-9].parquet"))


@pytest.mark.parametrize("layout", ["save_to_disk", "dataset_dict", "parquet", "jsonl", "csv"])
def test_hf_dataset_layouts_with_a_column_map(tmp_path, layout):
  rows = arithmetic_rows(24, split="train", seed=1)
  records = fx.trl_records_from_rows(rows)
  cols = {"ground_truth": "solution", "data_source": "task"}
  if layout == "save_to_disk":
    path = fx.save_dataset(records, str(tmp_path / "ds"))
  elif layout == "dataset_dict":
    test = fx.trl_records_from_rows(arithmetic_rows(8, split="test", seed=1))
    path = fx.save_dataset(records, str(tmp_path / "dd"), test_records=test)
    got = tables.read_hf_dataset(path, cols, split="test")
    assert [r["prompt"] for r in got] == [t["prompt"] for t in test]
  else:
    import datasets

    ds = datasets.Dataset.from_list(records)
    if layout == "csv":  # csv holds flat columns: a string prompt
      ds = datasets.Dataset.from_list([dict(r, prompt=r["prompt"][0]["content"]) for r in records])
    path = str(tmp_path / f"rows.{layout}")
    {"parquet": ds.to_parquet, "jsonl": ds.to_json, "csv": ds.to_csv}[layout](path)
  got = tables.read_hf_dataset(path, cols)
  assert len(got) == 24
  for g, r in zip(got, rows):
    content = g["prompt"] if isinstance(g["prompt"], str) else g["prompt"][0]["content"]
    assert content == r["prompt"]
    assert g["ground_truth"] == r["ground_truth"] and g["data_source"] == "arithmetic"
    assert str(g["columns"]["solution"]) == r["ground_truth"]  # a keyword, raw (csv: int)
    assert set(g["columns"]) == {"solution", "task", "target"}
    assert g["extra_info"] == g["columns"]  # no extra_info column: the other columns


def test_demonstration_column_feeds_the_sft_batch(tmp_path):
  rows = arithmetic_rows(8, split="train", seed=0)
  path = fx.write_parquet(fx.verl_records_from_rows(rows), str(tmp_path / "t.parquet"))
  got = tables.read_parquet(path, {"demonstration": "extra_info.demonstration"})
  assert [g["demonstration"] for g in got] == [r["demonstration"] for r in rows]


# ------------------------------------------------------------------ chat-message prompts


def test_messages_render_like_strings_and_keep_their_own_system_turn():
  tok = tokenizers.build_tokenizer("char")
  user = [{"role": "user", "content": "12+3="}]
  for template in ("chatml", "plain"):
    for system in ("", "Answer briefly."):
      assert templates.render_prompt(user, template, system) == templates.render_prompt(
          "12+3=", template, system
      )
  own = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
  assert templates.render_prompt(own, "chatml", "config system") == (
      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
  )
  assert templates.render_prompt(own, "plain", "config system") == "S\n\nU\n"
  turns = own + [{"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
  assert templates.render_prompt(turns, "chatml").count("<|im_start|>") == 5
  with pytest.raises(
      ValueError,
      match=r"prompt row 1 .*'plain' renders a system turn and one "
      r"user turn; this prompt has the turns \['system', 'user', 'assistant', "
      r"'user'\]\. Fix: data.template=chatml",
  ):
    pipeline.PromptData(
        [{"prompt": "1+1="}, {"prompt": turns}],
        tok,
        template="plain",
        system_prompt="",
        max_prompt_length=32,
    )
  with pytest.raises(
      ValueError, match="data.template='tokenizer': the char tokenizer has no " "chat template"
  ):
    templates.render_prompt(user, "tokenizer", "", tok)


def test_messages_through_the_tokenizer_folder_chat_template():
  folder = os.path.join(fx.ROOT, "tests", "data", "chat_tokenizer")

  class Tok:  # the folder's template with the char tokenizer's specials
    chat_template = open(os.path.join(folder, "chat_template.jinja")).read()
    special_tokens = {"eos_token": "<eos>"}
    path = folder

  turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
  text = templates.render_prompt(turns, "tokenizer", "", Tok())
  assert "S" in text and "U" in text
  assert text == templates.render_prompt("U", "tokenizer", "S", Tok())


def test_jsonl_prompt_files_accept_messages(tmp_path):
  p = tmp_path / "rows.jsonl"
  p.write_text(
      '{"prompt": [{"role": "user", "content": "2+2="}], "ground_truth": 4, '
      '"data_source": "arithmetic"}\n'
  )
  (row,) = data_readers.read_prompt_file(str(p))
  assert row["prompt"] == [{"role": "user", "content": "2+2="}] and row["ground_truth"] == "4"


# ------------------------------------------------------------------ rewards see the columns


def test_extra_columns_reach_reward_functions_as_keywords(tmp_path):
  rows = arithmetic_rows(4, split="train", seed=0)
  path = fx.save_dataset(fx.trl_records_from_rows(rows), str(tmp_path / "ds"))
  got = tables.read_hf_dataset(path, {"ground_truth": "solution"})
  plugin = tmp_path / "trl_rewards.py"
  plugin.write_text(
      "seen = []\n"
      "def accuracy(prompts, completions, solution, task, **kwargs):\n"
      "  assert set(kwargs) >= {'ground_truth', 'data_source', 'extra_info', 'target'}\n"
      "  return [float(c.strip() == s) for c, s in zip(completions, solution)]\n"
  )
  rc = computer.build_reward_computer((), (), custom_file=str(plugin), custom_function="accuracy")
  out = rc([r["prompt"] for r in rows], [rows[0]["ground_truth"], "x", "y", "z"], got)
  assert out.total.tolist() == [1.0, 0.0, 0.0, 0.0]
  assert rc.check(got[0]) == {"custom": 1.0}
  with pytest.raises(
      AttributeError,
      match=r"defines no function 'acc' \(reward.custom_function" r"\); it defines \['accuracy'\]",
  ):
    computer.build_reward_computer((), (), custom_file=str(plugin), custom_function="acc")
  # verl's compute_score sees the same rows: extra_info is the dict of the other columns.
  verl = tmp_path / "verl_reward.py"
  verl.write_text(
      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
      "  return float(extra_info['solution'] == ground_truth)\n"
  )
  rc = computer.build_reward_computer((), (), custom_file=str(verl))
  assert rc(["p"] * 4, ["c"] * 4, got).total.tolist() == [1.0] * 4


# ------------------------------------------------------------------------- bad rows


def _verl(tmp_path, change, name="bad.parquet", at=2):
  records = fx.verl_records_from_rows(arithmetic_rows(4, split="train", seed=0))
  change(records[at])
  return fx.write_parquet(records, str(tmp_path / name))


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda r: r.update(prompt=7),
            r"bad.parquet: row 2: column 'prompt' should be a string or "
            r"a list of chat messages",
        ),
        (
            lambda r: r.update(prompt=[{"role": "user", "content": "  "}]),
            r"bad.parquet: row 2: column 'prompt' is an empty prompt .*Fix: fill or drop the row",
        ),
        (
            lambda r: r["reward_model"].update(ground_truth=None),
            r"bad.parquet: row 2: column 'reward_model.ground_truth' is empty \(null\)\. Fix:",
        ),
    ],
)
def test_bad_parquet_rows_name_file_row_and_column(tmp_path, change, message):
  import pyarrow as pa

  try:
    path = _verl(tmp_path, change)
  except (pa.ArrowInvalid, pa.ArrowTypeError):  # a type pyarrow cannot mix in one column:
    records = fx.verl_records_from_rows(arithmetic_rows(4, split="train", seed=0))
    change(records[2])  # write the bad row as its own file, as a second part of a folder
    fx.write_parquet(records[:2], str(tmp_path / "d" / "a.parquet"))
    path = fx.write_parquet(records[2:3], str(tmp_path / "d" / "bad.parquet"))
    message = message.replace("row 2", "row 0")
    path = str(tmp_path / "d")
  with pytest.raises(DataError, match=message):
    tables.read_parquet(path)


def test_bad_tables_are_one_line_with_the_fix(tmp_path):
  records = fx.verl_records_from_rows(arithmetic_rows(4, split="train", seed=0))
  no_prompt = [{k: v for k, v in r.items() if k != "prompt"} for r in records]
  path = fx.write_parquet(no_prompt, str(tmp_path / "np.parquet"))
  with pytest.raises(
      DataError,
      match=r"np.parquet: no column 'prompt' for the prompt \(columns: "
      r"\['ability', 'data_source', 'extra_info', 'reward_model'\]\)\. Fix: "
      r"--config.data.columns.prompt=<one of them>",
  ):
    tables.read_parquet(path)
  garbage = tmp_path / "junk.parquet"
  garbage.write_bytes(b"this is not parquet at all")
  with pytest.raises(DataError, match=r"junk.parquet: not a readable parquet file .*Fix:"):
    tables.read_parquet(str(garbage))
  with pytest.raises(DataError, match=r"message 0 should be \{'role': str, 'content': str\}"):
    data_readers.check_prompt([{"role": "user"}], "f: row 0")
  import datasets

  trl = datasets.Dataset.from_list(
      fx.trl_records_from_rows(arithmetic_rows(4, split="train", seed=0))
  )
  datasets.DatasetDict(train=trl, holdout=trl).save_to_disk(str(tmp_path / "dd"))
  with pytest.raises(
      DataError,
      match=r"dd: a DatasetDict with splits \['train', 'holdout'\] and "
      r"none named test / validation / eval\. Fix: point data.eval_path at ",
  ):
    tables.read_hf_dataset(str(tmp_path / "dd"), {"ground_truth": "solution"}, split="test")
  path = fx.write_parquet(
      [dict(r, extra_info="text") for r in records], str(tmp_path / "ei.parquet")
  )
  with pytest.raises(
      DataError,
      match=r"ei.parquet: row 0: column 'extra_info' should be a " r"struct/dict, got str",
  ):
    tables.read_parquet(path)


def test_parquet_on_gs_as_a_file_a_folder_and_a_glob(tmp_path, gcs):
  """verl's files on cloud storage (the offline GCS emulator): read through the path layer."""
  from grpo_jax.run import paths

  records = fx.verl_records_from_rows(arithmetic_rows(12, split="train", seed=0))
  for i, part in enumerate((records[:5], records[5:])):
    local = fx.write_parquet(part, str(tmp_path / f"p{i}.parquet"))
    paths.write_atomic(f"{gcs}/verl/train-{i}.parquet", open(local, "rb").read())
  one = tables.read_parquet(f"{gcs}/verl/train-0.parquet")
  folder = tables.read_parquet(f"{gcs}/verl")
  globbed = tables.read_parquet(f"{gcs}/verl/train-*.parquet")
  assert len(one) == 5 and folder == globbed and len(folder) == 12
  assert [r["prompt"] for r in folder] == [r["prompt"] for r in records]
