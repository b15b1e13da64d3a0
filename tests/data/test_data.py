"""Data: readers with file:line errors, the checkpointable grain iterator, templates,
tokenizers (vs transformers' Qwen2Tokenizer), truncation, and the arithmetic task."""

import json
import os

import numpy as np
import pytest

from grpo_jax import data
from grpo_jax.data import arithmetic
from grpo_jax.data import datasets
from grpo_jax.data import templates
from grpo_jax.rewards import gsm8k
from tests.conftest import SHARED_DATA

QWEN_TOK = os.path.join(SHARED_DATA, "qwen_tokenizer")
GSM8K_TRAIN = os.path.join(SHARED_DATA, "gsm8k", "train.jsonl")
XSUM = os.path.join(SHARED_DATA, "summarization", "xsum", "test_1000.jsonl")


def need(path):
  if not os.path.exists(path):
    pytest.skip(f"{path} not present (../shared/data)")


# ------------------------------------------------------------------------------ readers


GOOD = {"prompt": "2+2?", "ground_truth": "4", "data_source": "math"}


@pytest.mark.parametrize(
    "bad_line,words",
    [
        ('{"prompt": "x", "ground_truth": "1", "data_source": "math"', ["invalid JSON"]),
        ('{"ground_truth": "1", "data_source": "math"}', ["missing field 'prompt'", "a string"]),
        ('{"prompt": "x", "data_source": "math"}', ["missing field 'ground_truth'"]),
        (
            '{"prompt": 7, "ground_truth": "1", "data_source": "math"}',
            ["field 'prompt' should be a string or a list of chat messages, got int"],
        ),
        (
            '{"prompt": "x", "ground_truth": {"a": 1}, "data_source": "math"}',
            ["field 'ground_truth' should be a string, a number or a list", "got dict"],
        ),
        ('["not", "an", "object"]', ["expected a JSON object, got list"]),
    ],
)
def test_malformed_jsonl_rows_name_file_and_line(tmp_path, bad_line, words):
  f = tmp_path / "prompts.jsonl"
  f.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD) + "\n" + bad_line + "\n")
  with pytest.raises(data.DataError) as e:
    data.read_prompt_file(str(f))
  msg = str(e.value)
  assert msg.startswith(f"{f}:4: "), msg  # line 4 (the blank line 2 counts)
  for w in words:
    assert w in msg, msg


def test_a_byte_order_mark_is_read_past(tmp_path):
  """Windows tools (Notepad, Excel's "UTF-8 CSV/JSON") start a file with a UTF-8 BOM: the first
  row reads as without it, in .jsonl and .json; a BOM anywhere else is still a bad line."""
  want = data.read_prompt_file(str(_write(tmp_path / "plain.jsonl", json.dumps(GOOD))))
  f = _write(tmp_path / "bom.jsonl", "\ufeff" + json.dumps(GOOD) + "\n" + json.dumps(GOOD))
  assert data.read_prompt_file(str(f)) == want * 2
  j = _write(tmp_path / "bom.json", "\ufeff" + json.dumps([GOOD]))
  assert data.read_prompt_file(str(j)) == want
  f = _write(tmp_path / "bom2.jsonl", json.dumps(GOOD) + "\n\ufeff" + json.dumps(GOOD))
  with pytest.raises(data.DataError, match=":2: invalid JSON"):
    data.read_prompt_file(str(f))


def _write(path, text):
  path.write_text(text, encoding="utf-8")
  return path


def test_prompt_file_rows_and_extra_info(tmp_path):
  f = tmp_path / "p.jsonl"
  rows_in = [
      dict(GOOD, difficulty=3),
      {
          "prompt": "cap of France?",
          "ground_truth": ["Paris"],
          "data_source": "qa",
          "demonstration": "Paris",
      },
  ]
  f.write_text("\n".join(json.dumps(r) for r in rows_in))
  rows = data.read_prompt_file(str(f))
  assert rows[0] == dict(
      prompt="2+2?", ground_truth="4", data_source="math", extra_info={"difficulty": 3}
  )
  assert rows[1]["ground_truth"] == ["Paris"] and rows[1]["demonstration"] == "Paris"
  j = tmp_path / "p.json"
  j.write_text(json.dumps(rows_in))
  assert data.read_prompt_file(str(j)) == rows
  j.write_text(json.dumps([GOOD, {"prompt": "x"}]))
  with pytest.raises(data.DataError, match=r"p.json:item 1: missing field 'ground_truth'"):
    data.read_prompt_file(str(j))


def test_missing_file_and_empty_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    data.read_prompt_file(str(tmp_path / "nope.jsonl"))
  (tmp_path / "e.jsonl").write_text("\n")
  with pytest.raises(data.DataError, match="no rows"):
    data.read_prompt_file(str(tmp_path / "e.jsonl"))


def test_gsm8k_reader_on_real_rows():
  need(GSM8K_TRAIN)
  rows = data.read_gsm8k(GSM8K_TRAIN)
  assert len(rows) == 7473
  r = rows[0]
  assert r["data_source"] == "gsm8k" and r["ground_truth"] == "72"
  assert r["prompt"].startswith("Natalia sold clips")
  assert "<<" not in r["demonstration"]
  # Every demonstration earns the full structured-format rewards.
  demos = [x["demonstration"] for x in rows[:500]]
  truths = [x["ground_truth"] for x in rows[:500]]
  assert set(gsm8k.match_format_exactly(None, demos)) == {3.0}
  assert set(gsm8k.check_answer(None, demos, truths)) == {3.0}


def test_gsm8k_bad_answer_line(tmp_path):
  f = tmp_path / "g.jsonl"
  f.write_text(json.dumps({"question": "q", "answer": "no marker here"}) + "\n")
  with pytest.raises(data.DataError, match=r"g.jsonl:1: field 'answer': .*'#### N'"):
    data.read_gsm8k(str(f))


def test_xsum_reader_on_real_rows():
  need(XSUM)
  rows = data.read_xsum(XSUM)
  assert len(rows) == 1000
  assert all(r["data_source"] == "summarization" and r["ground_truth"] for r in rows)
  assert rows[0]["prompt"].startswith(datasets.SUMMARIZE_INSTRUCTION)


# ------------------------------------------------------------------------ grain iterator


def test_iterator_restored_from_state_continues_with_the_next_batch():
  it = data.make_prompt_iterator(50, batch_size=8, seed=3)
  for _ in range(9):  # past the first epoch boundary (50 // 8 = 6 batches per epoch)
    next(it)
  state = it.get_state()
  expected = [next(it).tolist() for _ in range(5)]
  fresh = data.make_prompt_iterator(50, batch_size=8, seed=3)
  fresh.set_state(state)
  assert [next(fresh).tolist() for _ in range(5)] == expected


def test_iterator_shuffles_per_epoch_and_covers_rows():
  it = data.make_prompt_iterator(48, batch_size=8, seed=0)
  epoch1 = np.concatenate([next(it) for _ in range(6)])
  epoch2 = np.concatenate([next(it) for _ in range(6)])
  assert sorted(epoch1) == sorted(epoch2) == list(range(48))
  assert not np.array_equal(epoch1, epoch2)
  other_seed = data.make_prompt_iterator(48, batch_size=8, seed=1)
  assert not np.array_equal(next(other_seed), epoch1[:8])


def test_process_parts_of_a_global_batch_reassemble_the_single_process_batch():
  # What two processes see (rows [0, 4) and [4, 8) of each global batch of 8), concatenated,
  # is what one process sees: the data of a step does not depend on the process count.
  whole = data.make_prompt_iterator(50, batch_size=8, seed=3)
  parts = [
      data.make_prompt_iterator(50, batch_size=8, seed=3, rows=np.arange(p * 4, p * 4 + 4))
      for p in range(2)
  ]
  for _ in range(10):  # across an epoch boundary
    assert np.concatenate([next(it) for it in parts]).tolist() == next(whole).tolist()
  states = [it.get_state() for it in parts]
  assert states[0] == states[1]  # the same few integers on every process
  evals = [list(data.eval_batches(10, 4, rows=r)) for r in ([0, 1], [2, 3])]
  for (i0, v0), (i1, v1), (i, v) in zip(*evals, data.eval_batches(10, 4)):
    assert np.concatenate([i0, i1]).tolist() == i.tolist()
    assert np.concatenate([v0, v1]).tolist() == v.tolist()


def test_eval_batches_pad_the_last_batch_with_invalid_rows():
  batches = list(data.eval_batches(10, 4))
  assert [b[0].shape for b in batches] == [(4,)] * 3
  assert np.concatenate([i[v] for i, v in batches]).tolist() == list(range(10))
  assert batches[-1][1].tolist() == [True, True, False, False]


# ------------------------------------------------------------------- templates, tokenizers


def test_chatml_template():
  text = templates.render_prompt("What is 2+2?", "chatml", "Be brief.")
  assert text == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
      "<|im_end|>\n<|im_start|>assistant\n"
  )
  assert templates.render_prompt("hi", "plain") == "hi"
  with pytest.raises(ValueError, match="unknown template 'llama'"):
    templates.render_prompt("hi", "llama")
  assert "<reasoning>" in templates.system_prompt("reasoning")


TEXTS = [
    "Natalia sold clips to 48 of her friends in April.",
    "  leading spaces\tand\ttabs\n\n",
    "unicode: café naïve 日本語 🙂 ½",
    "numbers 1234567 3.14159 -42 $1,000",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nhmm\n</think>\n<answer>\n4\n</answer>",
    "",
]


def test_hf_tokenizer_matches_transformers_qwen2():
  need(QWEN_TOK)
  transformers = pytest.importorskip("transformers")
  ours = data.HFTokenizer(QWEN_TOK)
  theirs = transformers.Qwen2Tokenizer(
      os.path.join(QWEN_TOK, "vocab.json"), os.path.join(QWEN_TOK, "merges.txt")
  )
  theirs.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  for text in TEXTS:
    ids = ours.encode(text)
    if "<think>" not in text:  # Qwen2's files do not define <think>; we add Qwen3's ids
      assert ids == theirs.encode(text, add_special_tokens=False), text
    assert ours.decode(ids, skip_special=False) == text
  assert ours.encode("<|im_end|>") == [151645]
  assert ours.encode("<think>") == [151667]  # Qwen3's added token
  assert ours.eos_id == 151645 or ours.eos_id == 151643
  assert set(ours.stop_ids) >= {151645, 151643}
  assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_char_tokenizer_round_trip_and_atomic_specials():
  tok = data.CharTokenizer()
  ids = tok.encode("<answer>42</answer>")
  assert len(ids) == 4
  assert tok.decode(ids) == "<answer>42</answer>"
  assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "<answer>42</answer>"
  with pytest.raises(ValueError, match="'é' at offset 1"):
    tok.encode("cé")


def test_long_prompts_are_left_truncated_and_counted():
  tok = data.CharTokenizer()
  rows = [dict(prompt="1+2=", ground_truth="3"), dict(prompt="12345+67890=", ground_truth="x")]
  pd = data.PromptData(rows, tok, template="plain", system_prompt="", max_prompt_length=6)
  assert pd.num_truncated == 1
  b = pd.batch([0, 1])
  assert tok.decode(b["prompt_ids"][1]) == "67890="  # the end survives
  assert b["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]  # left-padded
  assert tok.decode(b["prompt_ids"][0][2:]) == "1+2="


def test_bucket_width_is_the_next_power_of_two_within_bounds():
  assert [data.pipeline.bucket_width(n, 100) for n in (1, 8, 9, 16, 17, 64, 65, 100)] == [
      8,
      8,
      16,
      16,
      32,
      64,
      100,
      100,
  ]
  assert data.pipeline.bucket_width(5, 6) == 6  # never wider than max_prompt_length


def test_prompt_batches_drop_only_all_padding_columns():
  tok = data.CharTokenizer()
  rows = [dict(prompt=p, ground_truth="") for p in ("1+2=", "1234567890+1=", "5+5=")]
  pd = data.PromptData(rows, tok, template="plain", system_prompt="", max_prompt_length=40)
  assert pd.lengths.tolist() == [4, 13, 4]
  assert pd.width([0, 2]) == 8 and pd.width([0, 1]) == 16 and pd.width([0], "max") == 40
  full, cut = pd.batch([0, 2]), pd.batch([0, 2], pd.width([0, 2]))
  assert cut["prompt_ids"].shape == (2, 8)
  np.testing.assert_array_equal(cut["prompt_ids"], full["prompt_ids"][:, -8:])
  np.testing.assert_array_equal(cut["prompt_mask"], full["prompt_mask"][:, -8:])
  assert full["prompt_mask"][:, :-8].sum() == 0  # what was cut held no token
  with pytest.raises(ValueError, match="prompt width mode 'pow3'"):
    pd.width([0], "pow3")


# ---------------------------------------------------------------------- arithmetic task


def test_arithmetic_split_is_fixed_and_disjoint():
  train = data.arithmetic_rows(2000, split="train", seed=5)
  test = data.arithmetic_rows(200, split="test", seed=5)
  assert len(train) == 2000 and len(test) == 200
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
  assert data.arithmetic_rows(200, split="test", seed=5) == test  # deterministic
  # A bigger train set never takes a test problem.
  big = data.arithmetic_rows(5000, split="train", seed=5)
  assert not {r["prompt"] for r in big} & {r["prompt"] for r in test}


@pytest.mark.parametrize("digits,num_ops,ops", [(2, 1, "+"), (3, 2, "+-*"), (1, 3, "-")])
def test_arithmetic_answers_are_correct_and_checkable(digits, num_ops, ops):
  rows = data.arithmetic_rows(
      100, split="train", seed=0, digits=digits, num_ops=num_ops, ops=ops, style="reasoning"
  )
  for r in rows:
    expr = r["prompt"].rstrip("=")
    assert int(r["ground_truth"]) == eval(expr)  # noqa: S307 - generated digits and + - *
    assert sum(c in "+-*" for c in expr.lstrip("-")) == num_ops
  demos = [r["demonstration"] for r in rows]
  assert gsm8k.answer_match(None, demos, [r["ground_truth"] for r in rows]) == [1.0] * len(rows)
  assert set(gsm8k.check_answer(None, demos, [r["ground_truth"] for r in rows])) == {3.0}


def test_arithmetic_small_space_returns_all_problems():
  rows = arithmetic.arithmetic_rows(10_000, split="train", seed=0, digits=1)
  assert 80 <= len(rows) <= 100
  with pytest.raises(ValueError, match="ops must be"):
    arithmetic.arithmetic_rows(1, split="train", ops="/")


# ------------------------------------------------------------------------- data sources


def _data_config(**data_fields):
  import ml_collections

  arith = dict(
      digits=2,
      digits2=0,
      num_ops=1,
      max_ops=0,
      ops="+",
      num_train=50,
      num_test=20,
      demonstration="reasoning",
  )
  d = dict(
      train_source="arithmetic",
      train_path="",
      eval_source="arithmetic",
      eval_path="",
      arithmetic=arith,
      heldout_rows=0,
  )
  return ml_collections.ConfigDict(dict(seed=3, data={**d, **data_fields}))


def test_load_rows_arithmetic_gives_the_seeded_disjoint_splits():
  train, test = data.load_rows(_data_config())
  assert train == data.arithmetic_rows(50, split="train", seed=3, style="reasoning")
  assert test == data.arithmetic_rows(20, split="test", seed=3, style="reasoning")
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_load_rows_reads_a_jsonl_file_for_one_split(tmp_path):
  f = tmp_path / "rows.jsonl"
  f.write_text("\n".join(json.dumps(dict(GOOD, prompt=f"{i}+{i}?")) for i in range(3)))
  config = _data_config()
  config.data.eval_source, config.data.eval_path = "jsonl", str(f)
  train, test = data.load_rows(config)
  assert len(train) == 50 and train[0]["data_source"] == "arithmetic"
  assert test == data.read_prompt_file(str(f)) and [r["prompt"] for r in test] == [
      "0+0?",
      "1+1?",
      "2+2?",
  ]


def test_heldout_rows_split_the_train_file():
  train, test = data.load_rows(_data_config(heldout_rows=8))
  every = data.arithmetic_rows(50, split="train", seed=3, style="reasoning")
  assert train == every[:42] and test == every[42:]
  with pytest.raises(ValueError, match="heldout_rows=50 leaves no train rows"):
    data.load_rows(_data_config(heldout_rows=50))


def test_sources_are_the_readers_plus_arithmetic():
  from grpo_jax.data import sources
  from grpo_jax.data import tables

  assert set(sources.FILE_SOURCES) == set(datasets.READERS) | set(tables.READERS)
  assert set(data.SOURCES) == set(sources.FILE_SOURCES) | {"arithmetic"}
  assert set(tables.READERS) == {"parquet", "hf_dataset"}
  with pytest.raises(ValueError, match="unknown data source 'csv'.*arithmetic"):
    data.load_rows(_data_config(train_source="csv"))


def test_overlong_train_prompts_are_truncated_or_dropped_per_config():
  from grpo_jax.data import prompts
  from tests.test_train import tiny_config

  tok = data.build_tokenizer("char")
  kept, _ = prompts.prompt_data(
      tiny_config(max_prompt_length=5, **{"data.overlong_prompts": "truncate"}), tok
  )
  dropped, _ = prompts.prompt_data(
      tiny_config(max_prompt_length=5, **{"data.overlong_prompts": "drop"}), tok
  )
  assert kept.num_truncated > 0 and len(kept) == 64  # "12+34=" is 6 characters
  assert len(dropped) == len(kept) - kept.num_truncated and dropped.num_truncated == 0
  assert all(len(tok.encode(t)) <= 5 for t in dropped.texts)


def test_next_prompts_prefetch_gives_the_same_batches_and_leaves_the_iterator_alone():
  """prompts.NextPrompts prepares the next batch while the update runs: the batches taken are
  those without a prefetch, and between a prefetch and the take (where the loop checkpoints)
  the data iterator's state is what it would be without one. A prefetch that no longer fits
  the iterator (restored from a checkpoint meanwhile) is dropped."""
  from grpo_jax.parallel import sharding
  from grpo_jax.data import prompts
  from tests.test_train import tiny_config

  config = tiny_config()
  tok = data.build_tokenizer("char")
  prompt_data, _ = prompts.prompt_data(config, tok)
  mesh = sharding.make_mesh(-1, 1, 1)
  plain_it, ahead_it = (
      data.make_prompt_iterator(len(prompt_data), batch_size=8, seed=3) for _ in range(2)
  )
  plain = prompts.NextPrompts(config, prompt_data, plain_it, mesh)
  ahead = prompts.NextPrompts(config, prompt_data, ahead_it, mesh)
  for step in range(12):  # past the end of epoch 1 (8 batches of 8 of the 64 rows)
    if step % 3:
      ahead.prefetch()
      assert ahead_it.get_state() == plain_it.get_state()
    if step == 7:  # a restore to an earlier state in between: the prefetched batch is stale
      state = plain_it.get_state()
      state = dict(state, next_index=state["next_index"] - 2)
      plain_it.set_state(state)
      ahead_it.set_state(state)
    (want, want_g), (got, got_g) = plain.take(), ahead.take()
    np.testing.assert_array_equal(got["prompt_ids"], want["prompt_ids"])
    np.testing.assert_array_equal(np.asarray(got_g["mask"]), np.asarray(want_g["mask"]))
    assert got["prompts"] == want["prompts"]
    assert ahead_it.get_state() == plain_it.get_state()


def test_arithmetic_long_tailed_working():
  """max_ops: operation counts geometric from num_ops (about half the problems), up to max_ops;
  "working": each partial result, left to right, whose last value is the ground truth."""
  from grpo_jax.data.arithmetic import arithmetic_rows

  rows = arithmetic_rows(2000, split="train", num_ops=1, max_ops=6, ops="+-", style="working")
  counts = np.array([sum(r["prompt"].count(o) for o in "+-") for r in rows])
  assert counts.min() == 1 and counts.max() == 6
  assert 0.4 < np.mean(counts == 1) < 0.6 and 0.15 < np.mean(counts == 2) < 0.35
  for r in rows[:200]:
    steps = r["demonstration"].split("<reasoning>")[1].split("</reasoning>")[0].split()
    assert len(steps) == r["prompt"].count("+") + r["prompt"].count("-")
    assert steps[-1].split("=")[-1] == r["ground_truth"]
    assert r["demonstration"].endswith(f"<answer>{r['ground_truth']}</answer>")
  assert len({len(r["demonstration"]) for r in rows}) > 30  # lengths spread out
  with pytest.raises(ValueError, match="left to right"):
    arithmetic_rows(4, split="train", ops="+*", style="working")
  with pytest.raises(ValueError, match="max_ops"):
    arithmetic_rows(4, split="train", num_ops=3, max_ops=2)
