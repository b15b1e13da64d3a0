"""Tables as verl and TRL users hold them: parquet files and Hugging Face `datasets`.

    data.train_source=parquet     verl's layout, as its preprocessing scripts write it
                                  (examples/data_preprocess/gsm8k.py): `data_source`, `prompt`
                                  (a list of chat messages), `ability`, `reward_model` {style,
                                  ground_truth}, `extra_info` {...}; one file, a folder of
                                  *.parquet (recursively) or a glob in the last path part;
                                  local or gs://.
    data.train_source=hf_dataset  a folder written by `Dataset.save_to_disk` (a DatasetDict:
                                  the split named like ours, train / test or validation), or
                                  parquet / arrow / json / jsonl / csv files read by datasets'
                                  own loaders (TRL's layout: a `prompt` string or message list,
                                  any other columns).

`data.columns` maps our fields to the table's columns; a dotted name reaches into a struct
column ("reward_model.ground_truth"):
    prompt        "prompt"          a non-empty string, or a list of {"role", "content"} turns
    ground_truth  ""                "" = reward_model.ground_truth when the table has it (verl),
                                    else ground_truth; a string, a number or a list of strings
    data_source   "data_source"     absent column: "" (the built-in verl scorer then refuses)
    extra_info    "extra_info"      verl's per-row dict; absent: a dict of the other columns
    demonstration ""                optional target completion for the SFT warm start (train
                                    rows; an eval table without the column is fine)
Every column except the prompt also reaches the reward functions as a keyword argument, the
way TRL passes dataset columns (`rows[i]["columns"]`, see rewards/computer.py).

Rows are converted one record batch at a time (pyarrow batches; datasets' memory-mapped Arrow
files), so start-up holds the Python rows, not the file's table beside them. Every bad row is
refused here, at start-up, naming the file, the row (0-based, as `ds[i]` / pandas count) and
the column, with the fix.
"""

import fnmatch
import os

from grpo_jax.run import paths
from grpo_jax.data.datasets import DataError
from grpo_jax.data.datasets import check_prompt

FIELDS = ("prompt", "ground_truth", "data_source", "extra_info", "demonstration")
VERL_GROUND_TRUTH = "reward_model.ground_truth"
_BATCH_ROWS = 4096
_HF_FORMATS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
}


def column_map(columns=None) -> dict:
  """data.columns (a ConfigDict or dict; missing fields take their defaults) as a dict."""
  out = dict(
      prompt="prompt",
      ground_truth="",
      data_source="data_source",
      extra_info="extra_info",
      demonstration="",
  )
  for k, v in dict(columns or {}).items():
    if k not in out:
      raise ValueError(f"data.columns.{k}: unknown field; known: {', '.join(FIELDS)}")
    out[k] = v
  return out


def _need(module: str, source: str):
  try:
    return __import__(module, fromlist=["_"])
  except ImportError:
    raise DataError(
        f"data source {source!r} needs the {module.split('.')[0]} package. Fix: "
        "pip install -e '.[data]'"
    ) from None


# ----------------------------------------------------------------------------- files


def expand(path: str, suffixes=(".parquet",)) -> list[str]:
  """The files `path` names: itself, the files under a folder (recursively, with one of
  `suffixes`, sorted), or the matches of a glob in its last part (sorted)."""
  if any(ch in os.path.basename(path) for ch in "*?["):
    folder, pattern = os.path.split(path)
    if not paths.isdir(folder):
      raise DataError(f"{path}: the folder {folder} does not exist")
    found = sorted(
        os.fspath(p)
        for p in paths.path(folder).iterdir()
        if fnmatch.fnmatch(p.name, pattern) and not p.is_dir()
    )
    if not found:
      raise DataError(f"{path}: no file matches. Fix: check the pattern and the folder")
    return found
  if not paths.exists(path):
    raise DataError(f"data file {path!r} does not exist")
  if paths.isdir(path):
    found = sorted(f for f in _walk(paths.path(path)) if f.endswith(suffixes))
    if not found:
      raise DataError(f"{path}: the folder holds no {' / '.join(suffixes)} files")
    return found
  return [path]


def _walk(folder):
  """Every file under `folder` (epath has no recursive glob on cloud storage)."""
  for p in folder.iterdir():
    if p.is_dir():
      yield from _walk(p)
    else:
      yield os.fspath(p)


# ------------------------------------------------------------------------------ rows


_MISSING = object()


def _getter(name: str):
  """rec -> rec[name] (dots reach into struct columns), or _MISSING when absent."""
  parts = tuple(name.split("."))
  if len(parts) == 1:
    return lambda rec: rec.get(name, _MISSING)

  def get(rec):
    node = rec
    for part in parts:
      if not isinstance(node, dict) or part not in node:
        return _MISSING
      node = node[part]
    return node

  return get


def _has(rec: dict, name: str) -> bool:
  return _getter(name)(rec) is not _MISSING


class _Converter:
  """Records of one file -> rows, with the column map resolved once against its columns."""

  def __init__(self, where: str, first: dict, cols: dict, split: str):
    self.where, self.cols = where, dict(cols)
    names = sorted(first)
    if not self.cols["ground_truth"]:
      self.cols["ground_truth"] = (
          VERL_GROUND_TRUTH if _has(first, VERL_GROUND_TRUTH) else "ground_truth"
      )
    for field in ("prompt", "ground_truth"):
      if not _has(first, self.cols[field]):
        raise DataError(
            f"{where}: no column '{self.cols[field]}' for the {field} (columns: {names}). "
            f"Fix: --config.data.columns.{field}=<one of them>"
            + ("" if field == "prompt" else " (or a nested one, e.g. reward_model.ground_truth)")
        )
    if self.cols["demonstration"] and not _has(first, self.cols["demonstration"]):
      if split != "train":  # demonstrations serve the SFT warm start, on train rows only
        self.cols["demonstration"] = ""
      else:
        raise DataError(
            f"{where}: no column '{self.cols['demonstration']}' for "
            f"data.columns.demonstration (columns: {names})"
        )
    self.get = {f: _getter(n) for f, n in self.cols.items() if n}
    if not _has(first, self.cols["data_source"]):
      self.get["data_source"] = lambda rec: ""
    self.has_extra = _has(first, self.cols["extra_info"])
    self.kw_columns = [c for c in names if c != self.cols["prompt"].split(".")[0]]

  def row(self, rec: dict, i: int) -> dict:
    c, get = self.cols, self.get
    at = f"{self.where}: row {i}"  # (cheap next to the checks; only read on an error)
    prompt = get["prompt"](rec)
    prompt = check_prompt(None if prompt is _MISSING else prompt, at, c["prompt"])
    truth = get["ground_truth"](rec)
    truth = _ground_truth(None if truth is _MISSING else truth, at, c["ground_truth"])
    data_source = get["data_source"](rec)
    if type(data_source) is not str:
      raise DataError(
          f"{at}: column '{c['data_source']}' should be a string, got "
          f"{type(data_source).__name__} {str(data_source)[:40]!r}"
      )
    columns = {k: rec[k] for k in self.kw_columns}
    if self.has_extra:
      extra = get["extra_info"](rec)
      if extra is not None and not isinstance(extra, dict):
        raise DataError(
            f"{at}: column '{c['extra_info']}' should be a struct/dict, got "
            f"{type(extra).__name__}. Fix: --config.data.columns.extra_info=<a "
            "dict column>, or one that does not exist (the other columns then)"
        )
      extra = extra or {}
    else:
      extra = columns
    out = dict(
        prompt=prompt,
        ground_truth=truth,
        data_source=data_source,
        extra_info=extra,
        columns=columns,
    )
    if c["demonstration"]:
      demo = get["demonstration"](rec)
      if not isinstance(demo, str):
        raise DataError(
            f"{at}: column '{c['demonstration']}' should be a string, got " f"{type(demo).__name__}"
        )
      out["demonstration"] = demo
    return out


def _ground_truth(v, at: str, column: str):
  if type(v) is str:
    return v
  if v is None:
    raise DataError(f"{at}: column '{column}' is empty (null). Fix: fill it or drop the row")
  if isinstance(v, bool) or not isinstance(v, (str, int, float, list, tuple)):
    raise DataError(
        f"{at}: column '{column}' should be a string, a number or a list of "
        f"strings, got {type(v).__name__} {str(v)[:40]!r}"
    )
  if isinstance(v, (list, tuple)):
    if not v or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in v):
      raise DataError(
          f"{at}: column '{column}' should be a non-empty list of strings or "
          f"numbers, got {str(v)[:60]!r}"
      )
    return [str(a) for a in v]
  if isinstance(v, float) and v.is_integer():
    v = int(v)
  return str(v)


def _convert(batches, where: str, cols: dict, split: str, rows: list) -> int:
  """Appends the rows of `batches` (iterables of record dicts) of one file to `rows`."""
  conv, i = None, 0
  for records in batches:
    for rec in records:
      if conv is None:
        conv = _Converter(where, rec, cols, split)
      rows.append(conv.row(rec, i))
      i += 1
  return i


# ----------------------------------------------------------------------------- readers


def read_parquet(path: str, columns=None, split: str = "train") -> list[dict]:
  """verl's parquet layout (or any parquet with data.columns) -> rows. One file, folder or glob
  per split, as verl's train_files / val_files."""
  pq = _need("pyarrow.parquet", "parquet")
  cols = column_map(columns)
  rows = []
  for f in expand(path):
    try:
      pf = pq.ParquetFile(f if not paths.is_remote(f) else paths.path(f).open("rb"))
      batches = (b.to_pylist() for b in pf.iter_batches(batch_size=_BATCH_ROWS))
      n = _convert(batches, f, cols, split, rows)
    except DataError:
      raise
    except Exception as e:  # noqa: BLE001  pyarrow's many error types: not a parquet file
      raise DataError(
          f"{f}: not a readable parquet file ({type(e).__name__}: "
          f"{str(e)[:200]}). Fix: point data.*_path at parquet files (verl's "
          "preprocessing writes them with Dataset.to_parquet)"
      ) from None
    if n == 0:
      raise DataError(f"{f}: no rows")
  _need("pyarrow", "parquet").default_memory_pool().release_unused()  # the batches' buffers
  return rows


def _saved_dataset(path: str) -> bool:
  p = paths.path(path)
  return paths.isdir(path) and any(
      (p / n).exists() for n in ("dataset_dict.json", "state.json", "dataset_info.json")
  )


def _split_of(ds, path: str, split: str):
  """One split of a DatasetDict: ours by name (train; test, else validation, for eval)."""
  names = list(ds)
  want = ["train"] if split == "train" else ["test", "validation", "eval"]
  for n in want:
    if n in names:
      return ds[n], n
  if len(names) == 1:
    return ds[names[0]], names[0]
  raise DataError(
      f"{path}: a DatasetDict with splits {names} and none named "
      f"{' / '.join(want)}. Fix: point data.{'train' if split == 'train' else 'eval'}"
      f"_path at {path}/<split>"
  )


def read_hf_dataset(path: str, columns=None, split: str = "train") -> list[dict]:
  """A `save_to_disk` folder, or files through datasets' loaders -> rows."""
  datasets = _need("datasets", "hf_dataset")
  datasets.disable_progress_bars()  # start-up prints our own lines
  cols = column_map(columns)
  if _saved_dataset(path):
    try:
      ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001
      raise DataError(
          f"{path}: datasets.load_from_disk failed ({type(e).__name__}: " f"{str(e)[:200]})"
      ) from None
    where = path
    if isinstance(ds, datasets.DatasetDict):
      ds, name = _split_of(ds, path, split)
      where = f"{path} (split {name})"
  else:
    files = expand(path, tuple(_HF_FORMATS))
    kinds = {_HF_FORMATS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
      raise DataError(
          f"{path}: expected a save_to_disk folder, or files of one format "
          f"({', '.join(_HF_FORMATS)}); got {[os.path.basename(f) for f in files][:5]}"
      )
    try:
      ds = datasets.load_dataset(kinds.pop(), data_files=files, split="train")
    except Exception as e:  # noqa: BLE001  datasets' loaders raise many kinds
      raise DataError(
          f"{path}: datasets could not read it ({type(e).__name__}: " f"{str(e)[:200]})"
      ) from None
    where = path
  rows = []

  def batches():
    for b in ds.iter(batch_size=_BATCH_ROWS):
      names = list(b)
      yield (dict(zip(names, vals)) for vals in zip(*(b[n] for n in names)))

  if _convert(batches(), where, cols, split, rows) == 0:
    raise DataError(f"{where}: no rows")
  return rows


READERS = {"parquet": read_parquet, "hf_dataset": read_hf_dataset}
