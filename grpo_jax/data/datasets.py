"""Dataset readers -> lists of row dicts, with file:line errors for bad rows.

Every reader returns rows of the same shape:
  prompt        str | list[dict]   the user message, or chat messages [{"role", "content"}]
                (templating happens in the pipeline; `check_prompt` says what is accepted)
  ground_truth  str   what rewards compare against
  data_source   str   selects the scorer (gsm8k, summarization, qa, ...; "" when a file has none)
  extra_info    dict  every other field of the row, passed to rewards
  demonstration str   (optional) a target completion, for the SFT warm start
"""

import json

from grpo_jax.run import paths
from grpo_jax.rewards import parsing


class DataError(ValueError):
  pass


def _read_records(path: str):
  """(line number, dict) for each row of a .jsonl file, or of a .json list."""
  if not paths.exists(path):
    raise FileNotFoundError(f"data file {path!r} does not exist")
  if path.endswith(".json"):
    try:
      data = json.loads(paths.read_bytes(path).decode("utf-8-sig"))  # -sig: a BOM, if any
    except UnicodeDecodeError as e:
      raise DataError(
          f"{path}: not UTF-8 (byte offset {e.start}). Fix: re-encode the file as " "UTF-8"
      ) from None
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(data, list):
      raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    for i, rec in enumerate(data):
      if not isinstance(rec, dict):
        raise DataError(f"{path}: item {i}: expected an object, got {type(rec).__name__}")
      yield f"item {i}", rec
    return
  with paths.path(path).open("rb") as f:
    for lineno, raw in enumerate(f, 1):
      try:
        line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # Windows tools add a BOM
      except UnicodeDecodeError as e:
        raise DataError(
            f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column "
            f"{e.start + 1}). Fix: re-encode the file as UTF-8"
        ) from None
      if not line.strip():
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(rec, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
      yield lineno, rec


def check_prompt(value, where: str, column: str = "prompt"):
  """A prompt as rows hold it: a non-empty string, or a non-empty list of chat messages
  {"role": str, "content": str} (other keys kept, null ones dropped) with some content.
  `where` ("file:line", "file: row i") and `column` name the place in the error."""
  if isinstance(value, str):
    if not value.strip():
      raise DataError(f"{where}: column '{column}' is an empty prompt. Fix: fill or drop the row")
    return value
  if isinstance(value, (list, tuple)) and value:
    out = []
    for j, m in enumerate(value):
      if not (type(m) is dict and type(m.get("role")) is str and type(m.get("content")) is str):
        raise DataError(
            f"{where}: column '{column}' message {j} should be "
            f"{{'role': str, 'content': str}}, got {str(m)[:60]!r}. Fix: give each "
            "turn a role and a string content"
        )
      out.append(m if len(m) == 2 else {k: v for k, v in m.items() if v is not None})
    if not any(m["content"].strip() for m in out):
      raise DataError(
          f"{where}: column '{column}' is an empty prompt (every message's content "
          "is empty). Fix: fill or drop the row"
      )
    return out
  got = "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"
  raise DataError(
      f"{where}: column '{column}' should be a string or a list of chat messages "
      f"[{{'role': ..., 'content': ...}}], got {got}"
  )


def _field(path, where, rec, name, types=(str,), what="a string"):
  if name not in rec:
    raise DataError(
        f"{path}:{where}: missing field '{name}' (expected {what}); the row has "
        f"fields {sorted(rec)}"
    )
  v = rec[name]
  if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
    raise DataError(
        f"{path}:{where}: field '{name}' should be {what}, got "
        f"{type(v).__name__} {str(v)[:40]!r}"
    )
  return v


def read_prompt_file(path: str, default_data_source: str = "") -> list[dict]:
  """Generic JSON/JSONL prompt files: `prompt` (str, or chat messages), `ground_truth` (str,
  number, or list of acceptable answers), optional `data_source` (str; absent: the default, ""
  as for a table without the column), optional `demonstration` (str); every other field goes to
  extra_info."""
  rows = []
  for where, rec in _read_records(path):
    prompt = check_prompt(
        _field(path, where, rec, "prompt", (str, list), "a string or a list of chat messages"),
        f"{path}:{where}",
    )
    truth = _field(
        path,
        where,
        rec,
        "ground_truth",
        (str, int, float, list),
        "a string, a number or a list of strings",
    )
    if "data_source" in rec:
      source = _field(path, where, rec, "data_source")
    else:
      source = default_data_source
    row = dict(
        prompt=prompt,
        ground_truth=truth if isinstance(truth, list) else str(truth),
        data_source=source,
        extra_info={
            k: v
            for k, v in rec.items()
            if k not in ("prompt", "ground_truth", "data_source", "demonstration")
        },
    )
    if "demonstration" in rec:
      row["demonstration"] = _field(path, where, rec, "demonstration")
    rows.append(row)
  if not rows:
    raise DataError(f"{path}: no rows")
  return rows


def gsm8k_demonstration(answer: str) -> str:
  """GSM8K's worked answer in the <reasoning>/<answer> format ("<<48/2=24>>" calculator
  annotations removed)."""
  import re

  body, _, _ = answer.rpartition("####")
  body = re.sub(r"<<[^>]*>>", "", body).strip()
  return f"<reasoning>{body}</reasoning><answer>{parsing.gsm8k_ground_truth(answer)}</answer>"


def read_gsm8k(path: str) -> list[dict]:
  """GSM8K jsonl: `question`, `answer` (worked solution ending in '#### N')."""
  rows = []
  for where, rec in _read_records(path):
    q = _field(path, where, rec, "question")
    a = _field(path, where, rec, "answer")
    try:
      truth = parsing.gsm8k_ground_truth(a)
    except ValueError as e:
      raise DataError(f"{path}:{where}: field 'answer': {e}") from None
    rows.append(
        dict(
            prompt=q,
            ground_truth=truth,
            data_source="gsm8k",
            extra_info={k: v for k, v in rec.items() if k not in ("question",)},
            demonstration=gsm8k_demonstration(a),
        )
    )
  if not rows:
    raise DataError(f"{path}: no rows")
  return rows


SUMMARIZE_INSTRUCTION = "Summarize the following article in one sentence.\n\n"


def read_xsum(path: str) -> list[dict]:
  """XSum-style jsonl: `document`, `summary` (optional `id`) -> data_source summarization."""
  rows = []
  for where, rec in _read_records(path):
    doc = _field(path, where, rec, "document")
    summ = _field(path, where, rec, "summary")
    rows.append(
        dict(
            prompt=SUMMARIZE_INSTRUCTION + doc,
            ground_truth=summ,
            data_source="summarization",
            extra_info={k: v for k, v in rec.items() if k not in ("document",)},
            demonstration=summ,
        )
    )
  if not rows:
    raise DataError(f"{path}: no rows")
  return rows


READERS = {"gsm8k": read_gsm8k, "jsonl": read_prompt_file, "xsum": read_xsum}
