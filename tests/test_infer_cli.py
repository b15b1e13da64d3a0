"""`python -m grpo_jax.infer` as a user runs it after training (issue 47): the run's config.json
is the config (no --config needed, command-line overrides still win, a --config=FILE does not
undo the run's values), a config that does not fit the checkpoint is one line, the console holds
the answers and at most 3 other lines, and --export_hf writes a tokenizer that transformers
encodes with as the run did."""

import json
import os
import subprocess
import sys

import pytest

from grpo_jax.data import tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.environ.get("GRPO_SHARED_DATA", os.path.join(ROOT, "..", "shared", "data"))

# The demo's config at seconds' size. model.num_layers=1 differs from configs/tiny.py's 2, so
# every infer below that loads this checkpoint has taken the layer count from config.json.
TRAIN = (
    "--config=configs/tiny.py",
    "--config.model.num_layers=1",
    "--config.sft_steps=2",
    "--config.sft.num_validation=16",
    "--config.num_steps=2",
    "--config.batch_size=8",
    "--config.num_generations=4",
    "--config.data.arithmetic.num_train=64",
    "--config.data.arithmetic.num_test=16",
    "--config.eval.batch_size=16",
    "--config.report_at_end=False",
)


def _python(*args, cwd=ROOT, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # one CPU device, as a user's machine has (not conftest's 8)
  return subprocess.run(
      [sys.executable, "-m", *args],
      cwd=cwd,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def _lines(r) -> list[str]:
  return (r.stdout + r.stderr).strip().splitlines()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("infer_cli") / "run"
  r = _python("grpo_jax.main", *TRAIN, f"--workdir={workdir}", timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  saved = json.loads((workdir / "config.json").read_text())
  assert saved["model"]["num_layers"] == 1
  return str(workdir)


def test_the_workdir_alone_samples_with_the_runs_config(run, tmp_path):
  """No --config: config.json is the config (a 1-layer model, as trained); from another folder
  too. The console: one answer per prompt, and at most 3 other lines."""
  prompts = ["12+30=", "5+7="]
  r = _python("grpo_jax.infer", f"--workdir={run}", *prompts, cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  answers = r.stdout.strip().splitlines()
  assert len(answers) == 2 and [a[: len(p)] for a, p in zip(answers, prompts)] == prompts
  assert len(_lines(r)) <= len(prompts) + 3, "\n".join(_lines(r))
  # A --config=FILE (2 layers) with the workdir: the run's values win where not overridden.
  r2 = _python("grpo_jax.infer", "--config=configs/tiny.py", f"--workdir={run}", *prompts)
  assert r2.returncode == 0, r2.stderr[-3000:]
  assert r2.stdout == r.stdout  # greedy: the same policy gives the same answers


def test_a_command_line_override_wins_over_config_json(run):
  """The run evaluated on 16 held-out rows; --config.data.arithmetic.num_test=2 leaves 2 of
  the 4 rows --num_examples asks for."""
  base = ("grpo_jax.infer", f"--workdir={run}", "--num_examples=4")
  r = _python(*base)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[4/4] prompt:" in r.stdout, r.stdout
  r = _python(*base, "--config.data.arithmetic.num_test=2")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "[2/2] prompt:" in r.stdout and "[3/" not in r.stdout, r.stdout


@pytest.mark.parametrize("config_file", [False, True])
def test_a_config_that_does_not_fit_the_checkpoint_is_one_line(run, config_file):
  """Overrides that change the policy's shapes: one line naming each field with the run's value
  and the fix, exit status 1; no traceback (orbax's was 188 lines)."""
  args = ["--config=configs/tiny.py"] if config_file else []
  args += [f"--workdir={run}", "--config.model.num_layers=3", "--config.model.hidden_size=64"]
  r = _python("grpo_jax.infer", *args, "12+30=")
  assert r.returncode == 1
  assert r.stdout == ""
  (line,) = [l for l in r.stderr.splitlines() if l.strip()]
  assert line.startswith("error: checkpoint ") and "Traceback" not in r.stderr
  assert "model.num_layers: run 1, here 3" in line and "model.hidden_size: run 128, here 64" in line
  fix = line.split("Fix: ", 1)[1]
  assert "--config.model.num_layers=1" in fix and "--config.model.hidden_size=128" in fix


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "no config. Fix: --workdir=DIR"),
        (["--workdir={tmp}"], "holds no config.json"),
        (["--workdir={run}", "--config.model.nope=1"], "--config.model.nope: no such config field"),
        (["--workdir={run}", "é"], "character 'é' at offset 0"),
    ],
)
def test_every_infer_error_is_one_line(run, tmp_path, args, says):
  args = [a.format(run=run, tmp=tmp_path) for a in args]
  r = _python("grpo_jax.infer", *args, "1+1=")
  assert r.returncode != 0
  errors = [l for l in r.stderr.splitlines() if not l.startswith(("I", "W"))]  # absl log lines
  assert len(errors) == 1 and errors[0].startswith("error: ") and says in errors[0], r.stderr


def test_the_export_carries_the_runs_tokenizer(run, tmp_path):
  """transformers' AutoTokenizer on the export encodes as the run's char tokenizer (it returned
  an empty tokenizer before: "12+30=" -> []), with its eos and pad; the model loads."""
  transformers = pytest.importorskip("transformers")
  out = tmp_path / "hf"
  r = _python("grpo_jax.infer", f"--workdir={run}", f"--export_hf={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip() == f"wrote {out} (step 4)" and len(_lines(r)) <= 4, _lines(r)
  ours = tokenizers.CharTokenizer()
  theirs = transformers.AutoTokenizer.from_pretrained(str(out))
  for text in ["12+30=", "<answer>42</answer><eos>", "What is 7 * 6?\n"]:
    ids = ours.encode(text)
    assert ids and theirs(text).input_ids == ids, text
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
  assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_id, ours.pad_id)
  assert tokenizers.HFTokenizer(str(out)).encode("12+30=") == ours.encode("12+30=")
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
  assert model.config.num_hidden_layers == 1 and model.config.vocab_size == ours.vocab_size
  assert model.generation_config.eos_token_id == ours.eos_id


def test_an_hf_tokenizer_folder_exports_with_its_added_tokens(tmp_path):
  """Qwen's folder (vocab.json + merges.txt, Qwen2's 3 special tokens): the export encodes as
  HFTokenizer does, Qwen3's <think> tokens it adds included (transformers would split them)."""
  transformers = pytest.importorskip("transformers")
  folder = os.path.join(SHARED_DATA, "qwen_tokenizer")
  if not os.path.isdir(folder):
    pytest.skip(f"no Qwen tokenizer at {folder} (GRPO_SHARED_DATA)")
  ours = tokenizers.HFTokenizer(folder)
  tokenizers.save_hf_folder(ours, str(tmp_path))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  text = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<think>ok</think> 42 café"
  ids = ours.encode(text)
  assert 151667 in ids and theirs(text, add_special_tokens=False).input_ids == ids
  assert (theirs.eos_token_id, theirs.pad_token_id) == (ours.eos_id, ours.pad_id)
  assert theirs.chat_template == ours.chat_template


def test_report_reads_the_same_run_quietly(run, tmp_path):
  """report on the same workdir: its config section comes from config.json (the run's 1 layer);
  the console gets the path of report.md and nothing else."""
  out = tmp_path / "report"
  r = _python("grpo_jax.report", f"--workdir={run}", f"--out={out}")
  assert r.returncode == 0, r.stderr[-3000:]
  assert _lines(r) == [str(out / "report.md")], _lines(r)
  assert "`model.num_layers`=1" in (out / "report.md").read_text()
