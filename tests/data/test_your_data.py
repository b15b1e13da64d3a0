"""A user's own rows on configs/tiny_your_data.py: the byte tokenizer it ships, a chat-message
JSONL and a verl parquet trained with nothing but the data overrides, prompts longer than
max_prompt_length refused in one line (and cut when the config allows it), ground truths that
no scorer can match refused in one line while correct columns pass."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from grpo_jax import configuration
from grpo_jax import data as data_lib
from grpo_jax.data import byte_tokenizer
from grpo_jax.data import checks
from grpo_jax.data import prompts
from grpo_jax.data import templates
from tests.data import tables_fixtures as fx

ROOT = fx.ROOT
CONFIG = os.path.join(ROOT, "configs", "tiny_your_data.py")
DIGIT_REWARD = os.path.join(ROOT, "tests", "data", "digit_count_reward.py")
# Test-only sizes (the config's own lengths and steps: the slow test): short prompts, two steps.
FAST = {
    "num_steps": 2,
    "max_prompt_length": 320,
    "max_completion_length": 16,
    "data.heldout_rows": 8,
    "eval.batch_size": 8,
}


def your_data_config(**overrides):
  spec = importlib.util.spec_from_file_location("cfg_tiny_your_data", CONFIG)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  for key, value in overrides.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    setattr(node, leaf, value)
  c.lock()
  return c


def final_answer(gsm8k_answer: str) -> str:
  return gsm8k_answer.split("####")[-1].strip().replace(",", "")


def short_gsm8k(n: int, split: str = "train", limit: int = 250) -> list[dict]:
  """n GSM8K rows whose chatml prompt fits `limit` bytes, some with curly quotes or accents."""
  rows = [
      r
      for r in fx.gsm8k_source(split, 2000)
      if len(templates.render_prompt(r["question"], "chatml").encode()) <= limit
  ]
  odd = [r for r in rows if not r["question"].isascii()]
  rest = [r for r in rows if r["question"].isascii()]
  return (odd[:4] + rest)[:n]


def write_jsonl(path, records) -> str:
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return str(path)


def chat_jsonl(path, n: int = 24) -> str:
  """GSM8K as a user keeps it: chat messages with their own system turn, the final answer."""
  return write_jsonl(
      path,
      [
          {
              "prompt": [
                  {"role": "system", "content": "Answer with <answer>N</answer>."},
                  {"role": "user", "content": r["question"]},
              ],
              "ground_truth": final_answer(r["answer"]),
          }
          for r in short_gsm8k(n)
      ],
  )


def full_answer_jsonl(path, n: int = 40) -> str:
  """The mistake: GSM8K's worked `answer` ("... #### 72") as the ground truth."""
  return write_jsonl(
      path, [{"prompt": r["question"], "ground_truth": r["answer"]} for r in fx.gsm8k_source(n=n)]
  )


def run_metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------ tokenizer


def test_the_byte_tokenizer_is_one_id_per_utf8_byte_and_needs_no_download(tmp_path):
  tok = data_lib.build_tokenizer("hf", byte_tokenizer.PATH)
  assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.stop_ids) == (257, 256, 256, (256,))
  texts = [r["question"] for r in fx.gsm8k_source(n=64)]
  texts += ["Zoë’s €5 “café” — 寿司\n\t{x|y}~^\\", "<|im_start|>user\n12+30=<|im_end|>\n"]
  for text in texts:
    assert tok.encode(text) == list(text.encode("utf-8")), text
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode("7<|endoftext|>") == [55, 256]  # eos stays one id
  assert tok.decode([55, 256, 300]) == "7"  # eos skipped, ids past the vocabulary ignored
  # The folder is what byte_tokenizer.write() makes.
  byte_tokenizer.write(str(tmp_path))
  again = data_lib.build_tokenizer("hf", str(tmp_path))
  assert all(again.encode(t) == tok.encode(t) for t in texts)
  assert again.vocab_size == tok.vocab_size and again.eos_id == tok.eos_id


def test_transformers_reads_the_byte_tokenizer_folder():
  transformers = pytest.importorskip("transformers")
  hf = transformers.AutoTokenizer.from_pretrained(byte_tokenizer.PATH)
  text = "Zoë’s €5 <answer>42</answer>"
  assert hf.encode(text, add_special_tokens=False) == list(text.encode("utf-8"))
  assert hf.eos_token_id == 256 and hf.pad_token_id == 256


# --------------------------------------------------------------------------------- config


def test_the_config_needs_only_the_data_path():
  assert configuration.validate(your_data_config(), num_devices=8, num_processes=1) == [
      "data.train_path='': data.train_source='jsonl' reads a file. Fix: set "
      "--config.data.train_path=/path/to/file.jsonl."
  ]
  for source in ("jsonl", "parquet", "hf_dataset"):
    config = your_data_config(**{"data.train_source": source, "data.train_path": CONFIG})
    assert configuration.validate(config, num_devices=8, num_processes=1) == []
    assert configuration.warnings(config) == []


def test_a_chat_message_jsonl_trains_with_only_its_path(tmp_path):
  """Messages with a system turn, curly quotes and accents, no data_source field: the path is
  the only data override (FAST shrinks lengths and steps; the custom reward varies on a random
  model's bytes, so the two steps are real updates)."""
  path = chat_jsonl(tmp_path / "mine.jsonl")
  from grpo_jax import train

  config = your_data_config(**FAST, **{"data.train_path": path, "reward.custom_file": DIGIT_REWARD})
  summary = train.run(config, str(tmp_path / "run"))
  assert summary["final_step"] == 2
  steps = [r for r in run_metrics(tmp_path / "run") if "loss/policy_loss" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert all(np.isfinite(r["loss/total"]) and r["loss/grad_norm"] > 0 for r in steps)
  # Your ground truths reach the answer rewards (a random model scores nothing with them).
  assert {"reward/check_answer", "reward/check_numbers", "reward/custom"} <= set(steps[-1])
  # The eval before and after: the file's last 8 rows, scored by their (empty) data_source.
  assert summary["eval_after"]["greedy"]["num_examples"] == 8


@pytest.mark.slow  # ~30 s; verl's parquet in the default suite: test_data_sources_loop.py
def test_a_verl_parquet_trains_with_its_source_and_path(tmp_path):
  tr = fx.write_parquet(fx.verl_gsm8k_records("train", 24), str(tmp_path / "train.parquet"))
  from grpo_jax import train

  config = your_data_config(
      **{
          **FAST,
          "data.train_source": "parquet",
          "data.train_path": tr,
          "max_prompt_length": 640,  # with verl's instruction: the first 24 rows fit
      }
  )
  assert train.run(config, str(tmp_path / "run"))["final_step"] == 2
  steps = [r for r in run_metrics(tmp_path / "run") if "loss/policy_loss" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert all(np.isfinite(r["loss/total"]) for r in steps)


@pytest.mark.slow  # ~1-2 min on 2 cores: the config's own lengths (evals 1536 bytes wide)
def test_gsm8k_as_a_users_jsonl_trains_on_the_config_as_shipped(tmp_path):
  path = write_jsonl(
      tmp_path / "gsm8k.jsonl",
      [
          {"prompt": r["question"], "ground_truth": final_answer(r["answer"])}
          for r in fx.gsm8k_source("train", 200)
      ],
  )
  from grpo_jax import train

  config = your_data_config(**{"data.train_path": path, "num_steps": 2})
  assert train.run(config, str(tmp_path / "run"))["final_step"] == 2


# --------------------------------------------------------------------------- prompt lengths


def test_a_prompt_longer_than_max_prompt_length_stops_naming_its_row_and_the_value(tmp_path):
  # chatml adds 50 bytes to each prompt: "<|im_start|>user\n", "<|im_end|>\n", the assistant's.
  rows = [{"prompt": "q" * n, "ground_truth": "1"} for n in range(1, 9)]
  rows[5]["prompt"] = "x" * 300  # the longest train prompt: 350 tokens
  path = write_jsonl(tmp_path / "rows.jsonl", rows)
  tok = data_lib.build_tokenizer("hf", byte_tokenizer.PATH)

  def config(max_prompt_length, **kw):
    return your_data_config(
        **{
            "data.train_path": path,
            "data.heldout_rows": 2,
            "max_prompt_length": max_prompt_length,
            **kw,
        }
    )

  with pytest.raises(data_lib.DataError) as e:
    prompts.prompt_data(config(64), tok)
  line = str(e.value)
  assert "\n" not in line
  assert line.startswith(f"max_prompt_length=64: 1 of 6 train prompts of {path} are longer")
  assert "the longest, row 5, is 350 tokens" in line
  assert "Fix: --config.max_prompt_length=350, or allow the cut" in line
  assert "--config.data.overlong_prompts=truncate" in line
  # The held-out tail is checked too, its rows counted from the file's start.
  rows[5]["prompt"], rows[7]["prompt"] = "q", "y" * 100
  write_jsonl(path, rows)
  with pytest.raises(
      data_lib.DataError,
      match=r"1 of 2 eval prompts of .*rows.jsonl \(its last 2 rows\).* row 7, is 150 tokens",
  ):
    prompts.prompt_data(config(64), tok)
  # The value it names is enough; the flag allows the cut instead (each prompt keeps its end).
  train_data, eval_data = prompts.prompt_data(config(150), tok)
  assert train_data.num_truncated == eval_data.num_truncated == 0
  train_data, eval_data = prompts.prompt_data(
      config(64, **{"data.overlong_prompts": "truncate"}), tok
  )
  assert eval_data.num_truncated == 1 and eval_data.token_counts.tolist() == [57, 150]
  kept = tok.decode(eval_data.batch([1])["prompt_ids"][0])
  assert len(kept.encode()) == 64 and kept.endswith("y<|im_end|>\n<|im_start|>assistant\n")


def test_a_too_long_prompt_is_one_console_line_from_main(tmp_path):
  rows = [{"prompt": "x" * n, "ground_truth": str(n)} for n in range(40, 80)]  # 32 held out
  path = write_jsonl(tmp_path / "rows.jsonl", rows)
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny_your_data.py",
          f"--config.data.train_path={path}",
          "--config.max_prompt_length=90",
          f"--workdir={tmp_path / 'run'}",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 1, r.stderr[-3000:]
  errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1, r.stderr[-3000:]
  assert "7 of 8 train prompts" in errors[0]
  assert "the longest, row 7, is 97 tokens" in errors[0]  # 47 bytes + chatml's 50
  assert "Fix: --config.max_prompt_length=97, or allow the cut" in errors[0]


# ---------------------------------------------------------------------------- ground truths


def _gt_config(**overrides):
  return your_data_config(**{"data.train_path": CONFIG, **overrides})


def test_gsm8k_worked_answers_as_ground_truth_stop_in_one_line(tmp_path):
  """The issue's case in each layout: the worked `answer` where the final answer belongs."""
  tok = data_lib.build_tokenizer("hf", byte_tokenizer.PATH)
  # A JSONL whose ground_truth field holds the worked answer.
  path = full_answer_jsonl(tmp_path / "full.jsonl")
  with pytest.raises(data_lib.DataError) as e:
    prompts.prompt_data(your_data_config(**{"data.train_path": path}), tok)
  line = str(e.value)
  assert "\n" not in line
  assert line.startswith(
      f"the ground_truth field: 8 of 8 sampled train rows of {path} cannot be matched: each "
      "holds several different numbers: a worked solution, not its final answer (row 0: "
  )
  assert "#### 72'). Fix: give each line's ground_truth only the final answer" in line
  assert "GSM8K's is the number after '####'" in line
  # TRL's layout: GSM8K's own columns mapped by name.
  pytest.importorskip("datasets")
  trl = {
      "data.train_source": "hf_dataset",
      "data.train_path": write_jsonl(tmp_path / "gsm8k.jsonl", fx.gsm8k_source(n=64)),
      "data.heldout_rows": 8,
      "data.columns.prompt": "question",
      "data.columns.ground_truth": "answer",
  }
  rows, _ = data_lib.load_rows(_gt_config(**trl))
  line, fatal = checks.ground_truths(_gt_config(**trl), rows, "train")
  assert fatal and line.startswith("data.columns.ground_truth='answer': 56 of 56 sampled")
  assert "Fix: point data.columns.ground_truth at a column that holds only the final" in line
  # verl's layout: data_source routes to the math scorer; extra_info.answer is the worked one.
  pq = fx.write_parquet(fx.verl_gsm8k_records("train", 40), str(tmp_path / "v.parquet"))
  verl = {"data.train_source": "parquet", "data.train_path": pq, "data.heldout_rows": 8}
  wrong = _gt_config(**verl, **{"data.columns.ground_truth": "extra_info.answer"})
  line, fatal = checks.ground_truths(wrong, data_lib.load_rows(wrong)[0], "train")
  assert fatal and line.startswith("data.columns.ground_truth='extra_info.answer': 32 of 32")
  assert "data_source 'openai/gsm8k' routes to the math scorer, which compares one number" in line
  assert "verl's files hold it in reward_model.ground_truth, read when the field is ''" in line
  # The right columns pass: verl's default and the final answers.
  right = _gt_config(**verl)
  assert checks.ground_truths(right, data_lib.load_rows(right)[0], "train") is None
  rows = [dict(r, ground_truth=final_answer(r["ground_truth"])) for r in rows]
  assert checks.ground_truths(_gt_config(**trl), rows, "train") is None


def test_ground_truths_that_scorers_can_match_pass_in_every_task():
  config = _gt_config()
  math = [{"data_source": "gsm8k", "ground_truth": g} for g in ("72", "1,000", "$5", "-3.5")]
  labels = [{"data_source": "", "ground_truth": g} for g in ("positive", "Paris", ["no", "No."])]
  summaries = [
      {"data_source": "summarization", "ground_truth": "Sales rose 5% to 3.2bn in 2019 from 2.1bn."}
  ] * 4
  code = [{"data_source": "code", "ground_truth": "assert f(1) == 2\nassert f(3) == 4"}] * 4
  for rows in (math, labels, summaries, code, math + labels + summaries + code):
    assert checks.ground_truths(config, rows, "train") is None, rows
    assert checks.ground_truths(config, rows, "eval") is None, rows
  # Rewards that compare no answers leave the train rows alone (ROUGE on worked text, say).
  rouge = _gt_config(**{"reward.functions": ("rouge",), "reward.weights": (1.0,)})
  worked = [{"data_source": "", "ground_truth": "2 + 3 = 5, 5 * 4 = 20"}] * 4
  assert checks.ground_truths(rouge, worked, "train") is None


def test_number_only_rewards_refuse_text_answers_and_a_minority_passes():
  tiny_rewards = {
      "reward.functions": ("answer_match", "answer_format"),
      "reward.weights": (1.0, 1.0),
  }
  labels = [{"data_source": "", "ground_truth": g} for g in ("positive", "negative") * 3]
  line, fatal = checks.ground_truths(_gt_config(**tiny_rewards), labels, "train")
  assert fatal and "reward.functions answer_match compare one number" in line
  assert "or name rewards that compare text (reward.functions, reward.custom_file)" in line
  # GSM8K's default rewards also compare exact text: labels are answers they can match.
  assert checks.ground_truths(_gt_config(), labels, "train") is None
  # A minority of bad rows is data, not a wrong column.
  mixed = [{"data_source": "math", "ground_truth": g} for g in ("1", "2", "3", "\\frac{1}{2}")]
  assert checks.ground_truths(_gt_config(), mixed, "train") is None


def test_a_custom_reward_or_the_eval_split_only_warns():
  worked = [{"data_source": "math", "ground_truth": "4 * 3 = 12 #### 12"}] * 6
  line, fatal = checks.ground_truths(_gt_config(), worked, "train")
  assert fatal
  custom = _gt_config(**{"reward.custom_file": DIGIT_REWARD})
  line, fatal = checks.ground_truths(custom, worked, "train")
  assert not fatal and line.endswith(
      "(A warning: reward.custom_file or reward.judge may still " "score them)"
  )
  line, fatal = checks.ground_truths(_gt_config(), worked, "eval")
  assert not fatal and "eval rows of" in line and line.endswith("cannot count these rows)")


def test_the_worked_answer_is_one_console_line_from_main(tmp_path):
  path = full_answer_jsonl(tmp_path / "full.jsonl")
  r = subprocess.run(
      [
          sys.executable,
          "-m",
          "grpo_jax.main",
          "--config=configs/tiny_your_data.py",
          f"--config.data.train_path={path}",
          f"--workdir={tmp_path / 'run'}",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 1, r.stderr[-3000:]
  errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "the ground_truth field: 8 of 8 sampled train rows" in errors[0]
  saved = os.listdir(tmp_path / "run" / "checkpoints")
  assert not [s for s in saved if s.isdigit()]  # stopped at start-up: no step saved
