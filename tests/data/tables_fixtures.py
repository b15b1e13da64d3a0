"""Data files as verl and TRL users bring them, made from rows we already have.

verl_records: the columns verl's examples/data_preprocess/gsm8k.py writes (data_source,
prompt as chat messages, ability, reward_model {style, ground_truth}, extra_info {split, index,
answer, question}); trl_dataset: a `datasets.Dataset` with a conversational `prompt` and the
answer in a `solution` column, plus one extra column (TRL passes it to reward functions)."""

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED = os.environ.get("GRPO_SHARED_DATA", os.path.join(ROOT, "..", "shared", "data"))
# The full GSM8K where ../shared/data has it; else the first 64 train / 16 test rows kept in the
# repository (tests/data/gsm8k_sample, MIT licence as GSM8K's), enough for every test here.
GSM8K = os.path.join(SHARED, "gsm8k")
if not os.path.exists(os.path.join(GSM8K, "train.jsonl")):
  GSM8K = os.path.join(ROOT, "tests", "data", "gsm8k_sample")
QWEN_TOKENIZER = os.path.join(SHARED, "qwen_tokenizer")
VERL_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_source(split: str = "train", n: int = 64) -> list[dict]:
  with open(os.path.join(GSM8K, f"{split}.jsonl")) as f:
    return [json.loads(line) for _, line in zip(range(n), f)]


def _ascii(text: str) -> str:
  """GSM8K's few non-ASCII characters (curly quotes, accents) for the char tokenizer's alphabet."""
  import unicodedata

  text = text.translate({0x2019: "'", 0x2018: "'", 0x201C: '"', 0x201D: '"', 0x2013: "-"})
  return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()


def verl_gsm8k_records(split: str = "train", n: int = 64, ascii_only: bool = False) -> list[dict]:
  """GSM8K rows in verl's parquet layout, as its preprocessing script makes them (ascii_only:
  the text made ASCII, for the CPU demo's char tokenizer)."""
  out = []
  for i, r in enumerate(gsm8k_source(split, n)):
    if ascii_only:
      r = {k: _ascii(v) for k, v in r.items()}
    solution = re.search(r"#### (\-?[0-9\.\,]+)", r["answer"]).group(1).replace(",", "")
    out.append(
        dict(
            data_source="openai/gsm8k",
            prompt=[{"role": "user", "content": r["question"] + " " + VERL_INSTRUCTION}],
            ability="math",
            reward_model={"style": "rule", "ground_truth": solution},
            extra_info={
                "split": split,
                "index": i,
                "answer": r["answer"],
                "question": r["question"],
            },
        )
    )
  return out


def verl_records_from_rows(rows: list[dict], split: str = "train") -> list[dict]:
  """Our rows (e.g. the arithmetic task's) in verl's layout, demonstration in extra_info."""
  return [
      dict(
          data_source=r["data_source"],
          prompt=[{"role": "user", "content": r["prompt"]}],
          ability="math",
          reward_model={"style": "rule", "ground_truth": r["ground_truth"]},
          extra_info={"split": split, "index": i, "demonstration": r.get("demonstration", "")},
      )
      for i, r in enumerate(rows)
  ]


def trl_records_from_rows(rows: list[dict]) -> list[dict]:
  """Our rows in TRL's conversational layout: prompt messages, the answer as `solution`."""
  return [
      dict(
          prompt=[{"role": "user", "content": r["prompt"]}],
          solution=r["ground_truth"],
          task=r["data_source"],
          target=r.get("demonstration", ""),
      )
      for r in rows
  ]


def write_parquet(records: list[dict], path: str, row_group_size: int | None = None) -> str:
  import pyarrow as pa
  import pyarrow.parquet as pq

  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
  return path


def save_dataset(records: list[dict], path: str, test_records=None) -> str:
  """datasets.save_to_disk of a Dataset, or of a DatasetDict(train, test) with test_records."""
  import datasets

  ds = datasets.Dataset.from_list(records)
  if test_records is not None:
    ds = datasets.DatasetDict(train=ds, test=datasets.Dataset.from_list(test_records))
  ds.save_to_disk(path)
  return path
