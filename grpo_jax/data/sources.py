"""Where rows come from: the names `config.data.{train,eval}_source` accepts, and the loader.

A file source is a reader of `datasets.READERS` (JSON lines: gsm8k, jsonl, xsum) or of
`tables.READERS` (parquet, hf_dataset: these also take `config.data.columns` and the split) and
needs `config.data.{split}_path`; "arithmetic" generates its rows from `config.data.arithmetic`
and the seed. A reader added to either READERS is a valid source here and in the config
validator.
"""

from grpo_jax.data import arithmetic
from grpo_jax.data import datasets
from grpo_jax.data import tables

ARITHMETIC = "arithmetic"
TABLE_SOURCES = tuple(tables.READERS)
FILE_SOURCES = (*datasets.READERS, *TABLE_SOURCES)  # need data.{split}_path
SOURCES = (*FILE_SOURCES, ARITHMETIC)


def _style(config) -> str:
  """The arithmetic demonstration: "tool" traces call the calculator only when the run has
  tools (rollout.tools.names); without, the same config's traces answer directly ("answer"),
  so one config trains the with-tool and the no-tool policy (configs/tiny_tools.py)."""
  style = config.data.arithmetic.demonstration
  if style == "tool" and not config.rollout.tools.names.strip():
    return "answer"
  return style


def _read(config, source: str, path: str, split: str) -> list[dict]:
  if source == ARITHMETIC:
    a = config.data.arithmetic
    n = a.num_train if split == "train" else a.num_test
    return arithmetic.arithmetic_rows(
        n,
        split=split,
        seed=config.seed,
        digits=a.digits,
        num_ops=a.num_ops,
        ops=a.ops,
        style=_style(config),
        max_ops=a.max_ops,
        digits2=a.digits2,
    )
  if source in tables.READERS:
    return tables.READERS[source](path, config.data.columns, split)
  if source not in datasets.READERS:
    raise ValueError(f"unknown data source {source!r}; known: {', '.join(SOURCES)}")
  return datasets.READERS[source](path)


def load_rows(config) -> tuple[list[dict], list[dict]]:
  """Train and eval rows from config.data (every reader gives the same row shape)."""
  d = config.data
  train = _read(config, d.train_source, d.train_path, "train")
  if d.heldout_rows:  # the eval split is the train file's tail
    if d.heldout_rows >= len(train):
      raise ValueError(
          f"data.heldout_rows={d.heldout_rows} leaves no train rows: "
          f"{d.train_path or d.train_source} has {len(train)}. Fix: use fewer "
          "held-out rows"
      )
    return train[: -d.heldout_rows], train[-d.heldout_rows :]
  return train, _read(config, d.eval_source, d.eval_path, "test")
