"""Start-up checks of the rows against the run's config: one line each, naming the file, a row
and the fix, before any model is built.

    checks.prompt_lengths(config, prompt_data, split)   # raises DataError
    checks.ground_truths(config, rows, split)           # -> (line, fatal) or None

Prompt lengths: a prompt longer than max_prompt_length would lose its start (the left cut keeps
the question and the assistant header). With data.overlong_prompts=error (the default) that
stops the run, naming the longest prompt's row, its token count and the value to set;
`truncate` and `drop` allow the cut (pipeline.py counts and logs it).

Ground truths: a column that holds something other than the final answer (GSM8K's worked
`answer` ending in "#### 72", say) scores 0 on every row, and nothing in the run's metrics says
why. Up to SAMPLE_ROWS rows spread over the split are read: train rows when reward.functions
compares answers (rewards/registry.py ANSWER_REWARDS), eval rows always; rows scored by overlap
or by tests (summarization, code: eval/tasks.py routes by data_source) are not checked. A row's
ground truth cannot match when
  - it is not one number, and the row's scorer compares one number: its data_source routes to
    the math scorer (gsm8k, math, arithmetic, "openai/gsm8k", ...; eval/tasks.py), or every
    answer reward in reward.functions compares numbers only (rewards/registry.py
    NUMBER_REWARDS);
  - or it holds several different numbers (a worked solution or a derivation, not its final
    answer), which neither a number nor an exact-text comparison matches.
When more than half of the checked rows cannot match: a train split whose answer rewards are all
built in stops the run (every GRPO step would be spent on a reward stuck at its floor); with a
reward.custom_file or a judge, which may still score such rows, it is a warning, and so it is
for the eval split (the training is unaffected, and a custom reward may handle answers the
built-in scorer cannot, LaTeX say; the eval's accuracy then reads 0 on those rows).
"""

import numpy as np

from grpo_jax.data import tables
from grpo_jax.data.datasets import DataError
from grpo_jax.eval import tasks as eval_tasks
from grpo_jax.rewards import parsing
from grpo_jax.rewards import registry as reward_registry

SAMPLE_ROWS = 256
# Tasks whose ground truth is a reference text or tests, not one answer.
_NOT_ANSWERS = ("summarization", "code")


def rows_name(config, split: str, num_rows: int) -> str:
  """Where a split's rows come from, for messages: the file, or the generated task."""
  d = config.data
  if split == "eval" and d.heldout_rows:
    return f"{d.train_path} (its last {d.heldout_rows} rows)"
  source, path = (
      (d.train_source, d.train_path) if split == "train" else (d.eval_source, d.eval_path)
  )
  return path or f"data.{split}_source={source} ({num_rows} rows)"


def first_row(config, split: str, num_train_rows: int) -> int:
  """The file's row index of a split's row 0 (the held-out split is the train file's tail)."""
  return num_train_rows if split == "eval" and config.data.heldout_rows else 0


# -------------------------------------------------------------------------- prompt lengths


def prompt_lengths(config, prompts, split: str, *, row_offset: int = 0):
  """Stops the run when a prompt of `prompts` (a PromptData) is longer than max_prompt_length
  and data.overlong_prompts=error: the longest one's row and token count, and the fix."""
  if config.data.overlong_prompts != "error" or not prompts.num_truncated:
    return
  longest = int(np.argmax(prompts.token_counts))
  need = int(prompts.token_counts[longest])
  fix = f"--config.max_prompt_length={need}"
  total = need + config.max_completion_length
  if total > config.model.max_position_embeddings:
    fix += f" --config.model.max_position_embeddings={total}"
  raise DataError(
      f"max_prompt_length={config.max_prompt_length}: {prompts.num_truncated} of "
      f"{len(prompts)} {split} prompts of {rows_name(config, split, len(prompts))} are "
      f"longer and would lose their start; the longest, row {row_offset + longest}, is {need} "
      f"tokens (data.template={config.data.template}). Fix: {fix}, or allow the cut with "
      "--config.data.overlong_prompts=truncate (each keeps its end; drop: train rows left out)"
  )


# --------------------------------------------------------------------------- ground truths


def _is_number(truth: str) -> bool:
  return parsing.parse_number(truth) is not None


def _is_worked(truth: str) -> bool:
  """Several different numbers: a solution or a derivation, not one answer."""
  return not _is_number(truth) and len(set(parsing.NUMBER_RE.findall(truth))) >= 2


def _column(config, split: str, row: dict) -> str:
  d = config.data
  source = d.train_source if split == "train" or d.heldout_rows else d.eval_source
  if source == "jsonl":
    return "the ground_truth field"
  if source not in tables.READERS:
    return f"the ground truths of data.{split}_source={source}"
  name = d.columns.ground_truth
  if not name:  # the reader's default: verl's nested column when the table has it
    name = (
        "reward_model.ground_truth" if "reward_model" in row.get("columns", {}) else "ground_truth"
    )
  return f"data.columns.ground_truth={name!r}"


def _snippet(truth, n: int = 80) -> str:
  text = str(truth)
  return repr(text if len(text) <= n else text[: n // 2] + " ... " + text[-n // 2 :])


def ground_truths(config, rows: list[dict], split: str, *, row_offset: int = 0):
  """(one line, fatal) when most sampled rows hold a ground truth their scorer cannot match,
  else None. Train rows are scored by the answer rewards of reward.functions (none: nothing to
  check), eval rows by the eval's scorer of their data_source (a warning at most: the training
  is unaffected, and a reward.custom_file may handle answers the built-in scorer cannot)."""
  answer_rewards = [f for f in config.reward.functions if f in reward_registry.ANSWER_REWARDS]
  if split == "train" and not answer_rewards:
    return None
  numbers_only = split == "train" and all(
      f in reward_registry.NUMBER_REWARDS for f in answer_rewards
  )
  checked, bad = 0, []
  for i in np.unique(np.linspace(0, len(rows) - 1, min(len(rows), SAMPLE_ROWS)).astype(int)):
    task = eval_tasks.task_of(rows[i]["data_source"]).name
    if task in _NOT_ANSWERS:
      continue
    checked += 1
    needs_number = task == "math" or numbers_only
    truth = rows[i]["ground_truth"]
    truths = truth if isinstance(truth, list) else [truth]
    if all(not _is_number(t) if needs_number else _is_worked(t) for t in truths):
      bad.append(int(i))
  if not checked or len(bad) * 2 <= checked:
    return None
  row = rows[bad[0]]
  math_row = eval_tasks.task_of(row["data_source"]).name == "math"
  if math_row:
    why = (
        f"data_source {row['data_source']!r} routes to the math scorer, which compares one "
        "number, and these hold none or several"
    )
  elif numbers_only:
    why = (
        f"reward.functions {', '.join(answer_rewards)} compare one number, and these hold "
        "none or several"
    )
  else:
    why = "each holds several different numbers: a worked solution, not its final answer"
  column = _column(config, split, row)
  fix = (
      "give each line's ground_truth only the final answer (or read the file with "
      "data.train_source=hf_dataset and point data.columns.ground_truth at a column holding it)"
      if column == "the ground_truth field"
      else "point data.columns.ground_truth at a column that holds only the final answer"
  )
  if "reward_model" in row.get("columns", {}) and "reward_model.ground_truth" not in column:
    fix += " (verl's files hold it in reward_model.ground_truth, read when the field is '')"
  elif "####" in str(row["ground_truth"]):
    fix += " (GSM8K's is the number after '####'; data.train_source=gsm8k reads its files)"
  if numbers_only and not math_row:
    fix += ", or name rewards that compare text (reward.functions, reward.custom_file)"
  line = (
      f"{column}: {len(bad)} of {checked} sampled {split} rows of "
      f"{rows_name(config, split, len(rows))} cannot be matched: {why} (row "
      f"{row_offset + bad[0]}: {_snippet(row['ground_truth'])}). Fix: {fix}"
  )
  if split == "eval":
    return line + ". (A warning: the eval's accuracy cannot count these rows)", False
  if config.reward.custom_file or config.reward.judge.path:
    return line + ". (A warning: reward.custom_file or reward.judge may still score them)", False
  return line, True
