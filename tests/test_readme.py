"""The README's commands, run the way a newcomer copies them (issue 47).

Every command in README.md is parsed from the file itself: the indented code blocks, and the
inline `python -m grpo_jax...`, `bash scripts/...`, `launch/...` spans of the prose. Each must
match exactly one rule of RULES below, which says how the test runs it:

  run           as written, in a shell that first ran the README's interpreter line
                (`source .venv/bin/activate`), from the repository root and, for the
                `python -m grpo_jax...` commands, from another folder too; training commands get
                CPU-sizing overrides appended (TINY) so a run takes seconds, not minutes;
  print_config  as written plus `--print_config`: the config file resolves and every
                `--config.*` field exists (commands that need weights, a TPU or a GPU);
  dry_run       a launcher with `--dry_run` before its `--`: its commands print, nothing runs;
  skip          not runnable here (network installs, a TPU venv, a GPU, the test suite itself,
                half-hour runs), with the reason.

A README command that matches no rule fails (so a new command gets a rule, and a run), and so
does a rule that matches no command (so a renamed command does not silently drop out).
Placeholders (DIR, /path/to/..., `[optional]`, a trailing `...`) become the test's own values.
"""

import dataclasses
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
VENV = os.path.dirname(os.path.dirname(sys.executable))  # the suite's own virtualenv
SHARED_DATA = os.environ.get("GRPO_SHARED_DATA", os.path.join(ROOT, "..", "shared", "data"))

# CPU-sizing overrides for the tiny configs' training commands: seconds instead of minutes.
TINY = (
    "--config.sft_steps=4 --config.sft.num_validation=16 --config.num_steps=2 "
    "--config.batch_size=8 --config.num_generations=4 --config.data.arithmetic.num_train=64 "
    "--config.data.arithmetic.num_test=16 --config.eval.batch_size=16 "
    "--config.log_interval_steps=1 --config.save_interval_steps=2"
)

# ------------------------------------------------------------------------------ parsing

_INLINE_START = (
    "python -m grpo_jax",
    "python benchmarks/",
    "bash scripts/",
    "launch/",
    ".venv",
    "tensorboard ",
    "pip install",
)
_NOT_COMMANDS = ("grpo_jax/", "models/", "configs/")  # "The code": a folder listing


@dataclasses.dataclass(frozen=True)
class Command:
  text: str  # one logical command: continuations joined, the trailing comment dropped
  line: int  # README.md line it starts on (1-based)

  def __str__(self):
    return f"README.md:{self.line}: {self.text}"


def _strip_comment(line: str) -> str:
  """`line` without a trailing shell comment (a `#` outside quotes after whitespace)."""
  quote = None
  for i, ch in enumerate(line):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch == "#" and (i == 0 or line[i - 1].isspace()):
      return line[:i].rstrip()
  return line.rstrip()


def readme_commands(text: str | None = None) -> list[Command]:
  """Every command of the README: code-block lines (indented 4, after a blank line) and the
  inline spans of the prose that start like a command."""
  if text is None:
    with open(README) as f:
      text = f.read()
  lines = text.split("\n")
  commands, pending, start, in_block = [], "", 0, False
  for i, line in enumerate(lines):
    blank_before = i == 0 or not lines[i - 1].strip()
    if line.startswith("    ") and (in_block or blank_before) and not line.lstrip().startswith("|"):
      in_block = True
      body = _strip_comment(line[4:])
      if not body.strip():
        continue
      if not pending:
        start = i + 1
      if body.endswith("\\"):
        pending += body[:-1].strip() + " "
        continue
      full = (pending + body.strip()).strip()
      pending = ""
      if not full.startswith(_NOT_COMMANDS):
        commands.append(Command(full, start))
    elif line.strip():
      in_block = False
  # Inline spans (may wrap over a line break in the prose).
  for m in re.finditer(r"`([^`]+)`", text):
    span = " ".join(m.group(1).split())
    if span.startswith(_INLINE_START) and " " in span:
      commands.append(Command(span, text.count("\n", 0, m.start()) + 1))
  return commands


# -------------------------------------------------------------------------------- rules


@dataclasses.dataclass(frozen=True)
class Rule:
  pattern: str  # re.fullmatch against Command.text
  action: str  # run | print_config | dry_run | skip
  why: str = ""  # skip: the reason; others: what the run shows


RULES = (
    # The two newcomer commands and the interpreter line.
    Rule(r"bash scripts/demo\.sh", "run", "the demo, CPU-sized (test_the_demo_chain)"),
    Rule(r"bash scripts/test\.sh", "skip", "the test suite itself (.ci/run runs it)"),
    Rule(r"source \.venv/bin/activate", "run", "every command here runs after it"),
    # The demo chain: train into runs/demo, sample, export.
    Rule(r"bash scripts/demo\.sh --workdir=runs/demo", "run", "test_the_demo_chain"),
    Rule(r"bash scripts/demo\.sh --config\.rollout\.max_staleness=1", "run", "one step off"),
    Rule(r"python -m grpo_jax\.infer .*--workdir=runs/demo .*", "run", "test_the_demo_chain"),
    Rule(r"python -m grpo_jax\.report --workdir=DIR(\[,DIR2\])?", "run", "test_the_demo_chain"),
    Rule(r"tensorboard --logdir[= ]\S+", "run", "after the README's install line for it"),
    Rule(r"pip install tensorboard .*", "run", "resolved with pip's --dry-run"),
    # LoRA: train, then PEFT export.
    Rule(r"python -m grpo_jax\.main --config=configs/tiny_lora\.py( --workdir=\S+)?", "run", ""),
    Rule(r"python -m grpo_jax\.infer --workdir=DIR --export_peft=OUT", "run", ""),
    Rule(
        r"python -m grpo_jax\.main --config=configs/tiny_moe\.py", "run", "test_the_moe_demo_runs"
    ),
    Rule(r"python -m grpo_jax\.main --config=configs/tiny_your_data\.py .*", "run", "GSM8K rows"),
    Rule(r"python -m grpo_jax\.examples\.mnist --data_dir=DIR --seed=S", "run", "1 epoch"),
    # Configs that need weights or data the README's user brings: they resolve and parse.
    Rule(r"python -m grpo_jax\.main --config=configs/qwen3_8b\.py .*", "print_config", ""),
    Rule(r"python -m grpo_jax\.main --config=configs/xsum_(rouge|t5)\.py", "print_config", ""),
    Rule(r"python -m grpo_jax\.main --config=configs/qwen3_8b_tools\.py .*", "print_config", ""),
    Rule(
        r"python -m grpo_jax\.main --config=configs/tiny_tools\.py( --config\.rollout\.tools\.names=)?",
        "run",
        "test_the_tool_demo_runs_with_and_without_the_tool (slow)",
    ),
    Rule(r"python -m grpo_jax\.main --distributed ARGS", "skip", "prose: ARGS stands for a run"),
    Rule(
        r"for i in 0 1; do LOCAL_DEVICES=1 launch/multihost\.sh .* & done; wait",
        "run",
        "2 processes, CPU-sized (slow)",
    ),
    # Launchers: their commands, printed.
    Rule(r"launch/tpu_pod\.sh .*", "dry_run", ""),
    Rule(r"launch/xpk\.sh .*", "dry_run", ""),
    # Installs, other venvs, accelerators, long runs.
    Rule(r"pip install (?!tensorboard ).*", "skip", "network install"),
    Rule(r"bash scripts/install\.sh (vllm-tpu|test)", "skip", "network install"),
    Rule(r"python3\.12 -m venv \.venv-tpu .*", "skip", "network install (TPU pins)"),
    Rule(r"\.venv-tpu/bin/python .*", "skip", "the TPU venv (scripts/install.sh vllm-tpu)"),
    Rule(
        r"\.venv-aot/bin/python -m grpo_jax\.memory_plan .*",
        "skip",
        "compiles Qwen3-0.6B for an H100 (~minutes): tests/plan/ runs the planner in .venv-aot",
    ),
    Rule(r"bash scripts/test_aot\.sh", "skip", ".ci/run runs it"),
    Rule(r"bash scripts/test_tpu_pins\.sh", "skip", ".ci/run runs its --ci subset"),
    Rule(r"bash scripts/format\.sh", "skip", "formats the tree in place (.ci/run: --check)"),
    Rule(
        r"python benchmarks/\w+\.py( .*)?",
        "skip",
        "benchmarks: minutes each (tests/test_benchmarks)",
    ),
)


def _rule_of(cmd: Command) -> list[Rule]:
  return [r for r in RULES if re.fullmatch(r.pattern, cmd.text)]


# ------------------------------------------------------------------------------- running


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _placeholders(text: str, tmp) -> str:
  """The README's placeholders as this test's values."""
  text = re.sub(r" ?\[[^\]]*\]", "", text)  # optional: [my-project], DIR[,DIR2]
  text = re.sub(r" \.\.\.$", "", text)
  swap = {"runs/demo": f"{tmp}/demo", "/tmp/": f"{tmp}/", "/path/to/": f"{tmp}/path/to/"}
  return re.sub("|".join(map(re.escape, swap)), lambda m: swap[m.group(0)], text)


def shell(cmd: str, *, cwd=ROOT, timeout=600, env=None) -> subprocess.CompletedProcess:
  """`cmd` as a user runs it: bash, after the README's `source .venv/bin/activate`, with no
  fake devices and no platform pinned (this suite's own settings are not a user's)."""
  e = dict(os.environ, **(env or {}))
  for k in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "VIRTUAL_ENV"):
    e.pop(k, None)
  script = f"source {shlex.quote(VENV)}/bin/activate && cd {shlex.quote(str(cwd))} && {cmd}"
  return subprocess.run(
      ["bash", "-c", script], env=e, capture_output=True, text=True, timeout=timeout
  )


def _ok(r: subprocess.CompletedProcess, what: str) -> str:
  out = r.stdout + r.stderr
  assert r.returncode == 0, f"{what}\nexit {r.returncode}:\n{out[-4000:]}"
  return out


def _commands(pattern: str) -> list[Command]:
  found = [c for c in readme_commands() if re.fullmatch(pattern, c.text)]
  assert found, f"no README command matches {pattern!r}"
  return found


# --------------------------------------------------------------------------------- tests


def test_the_parser_reads_blocks_continuations_comments_and_inline_spans():
  text = (
      "Intro `python -m grpo_jax.report\n--workdir=DIR` here.\n\n"
      "    bash scripts/demo.sh   # the demo\n"
      "    python -m grpo_jax.main --config=configs/tiny.py \\\n"
      '        --config.seed=1 "a # b"\n\n'
      "    grpo_jax/   the package\n"
  )
  got = [(c.text, c.line) for c in readme_commands(text)]
  assert got == [
      ("bash scripts/demo.sh", 4),
      ('python -m grpo_jax.main --config=configs/tiny.py --config.seed=1 "a # b"', 5),
      ("python -m grpo_jax.report --workdir=DIR", 1),
  ]


def test_every_readme_command_has_exactly_one_rule_and_every_rule_a_command():
  commands = readme_commands()
  assert len(commands) >= 20, [str(c) for c in commands]
  problems = []
  used = set()
  for c in commands:
    rules = _rule_of(c)
    if len(rules) != 1:
      problems.append(f"{c}: matches {len(rules)} rules of tests/test_readme.py (want 1)")
    used.update(rules)
  problems += [f"rule {r.pattern!r} matches no README command" for r in RULES if r not in used]
  assert not problems, "\n".join(problems)


def test_the_print_config_commands_resolve_from_here_and_from_another_folder(tmp_path):
  for pattern in (
      r"python -m grpo_jax\.main --config=configs/qwen3_8b\.py .*",
      r"python -m grpo_jax\.main --config=configs/xsum_(rouge|t5)\.py",
      r"python -m grpo_jax\.main --config=configs/qwen3_8b_tools\.py .*",
  ):
    for c in _commands(pattern):
      cmd = _placeholders(c.text, tmp_path) + " --print_config"
      for cwd in (ROOT, tmp_path):
        out = _ok(shell(cmd, cwd=cwd, timeout=180), f"{c} (from {cwd})")
        assert re.search(r"^batch_size: \d+", out, re.M), f"{c}: no config printed\n{out[:2000]}"


def test_the_launchers_print_their_commands(tmp_path):
  for c in _commands(r"launch/(tpu_pod|xpk)\.sh .*"):
    args = shlex.split(_placeholders(c.text, tmp_path))
    cut = args.index("--")
    cmd = shlex.join(args[:cut] + ["--dry_run"] + args[cut:])
    out = _ok(shell(cmd, timeout=120), str(c))
    assert "grpo_jax.main" in out or "grpo_jax" in out, out[:2000]
    assert "--config=configs/qwen3_8b.py" in out, out[:2000]


def test_the_readme_says_how_to_install_tensorboard_before_running_it():
  """The viewer is not in the install (tensorboardX writes the events): the README's first
  `tensorboard --logdir` comes with its install line, and that line resolves."""
  (install,) = _commands(r"pip install tensorboard .*")
  runs = _commands(r"tensorboard --logdir[= ]\S+")
  first = min(c.line for c in runs)  # the install line is in the same sentence, or before
  assert install.line <= first + 2, (str(install), [str(c) for c in runs])
  r = shell(f"{install.text} --dry-run --quiet --report -", timeout=300)
  out = r.stdout + r.stderr
  if r.returncode and ("NewConnectionError" in out or "No matching distribution" in out):
    pytest.skip(f"no package index reachable here: {out[-300:]}")
  _ok(r, str(install))
  assert '"name": "tensorboard"' in out or "already satisfied" in out, out[-2000:]


def test_the_demo_chain(tmp_path):
  """bash scripts/demo.sh --workdir=runs/demo, then the README's infer / export / report
  commands on that run, as written (runs/demo -> a temp folder), from the root and elsewhere."""
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (demo,) = _commands(r"bash scripts/demo\.sh --workdir=runs/demo")
  out = _ok(shell(f"{_placeholders(demo.text, tmp_path)} {TINY}", timeout=600), str(demo))
  assert os.path.exists(tmp_path / "demo" / "summary.json"), out[-3000:]
  assert any("] workdir: " in line for line in out.splitlines()[:3]), out[:2000]  # its own first
  for c in _commands(r"python -m grpo_jax\.infer .*--workdir=runs/demo .*"):
    for cwd in (ROOT, elsewhere):
      cmd = _placeholders(c.text, tmp_path)
      out = _ok(shell(cmd, cwd=cwd, timeout=300), f"{c} (from {cwd})")
      if "--export_hf=" in cmd:
        export = re.search(r"--export_hf=(\S+)", cmd).group(1)
        assert os.path.exists(os.path.join(export, "config.json")), out[-2000:]
      else:
        prompts = re.findall(r'"([^"]+)"', c.text)
        lines = out.splitlines()
        answers = [line for line in lines if line.startswith(tuple(prompts))]
        assert len(answers) == len(prompts), f"{c}: want one answer per prompt\n{out[-2000:]}"
        assert len(lines) - len(answers) <= 3, f"{c}: more than 3 other lines\n{out[-2000:]}"
  for report in _commands(r"python -m grpo_jax\.report --workdir=DIR(\[,DIR2\])?"):
    cmd = _placeholders(report.text, tmp_path).replace("DIR", str(tmp_path / "demo"))
    _ok(shell(cmd, cwd=elsewhere, timeout=300), str(report))
  assert os.path.exists(tmp_path / "demo" / "report" / "report.md")


def test_the_one_step_off_demo_runs(tmp_path):
  (c,) = _commands(r"bash scripts/demo\.sh --config\.rollout\.max_staleness=1")
  cmd = f"{c.text} --workdir={tmp_path}/run {TINY}"
  _ok(shell(cmd, timeout=600), str(c))
  assert os.path.exists(tmp_path / "run" / "summary.json")


@pytest.mark.slow
def test_the_tool_demo_runs_with_and_without_the_tool(tmp_path):
  """The README's two tool-demo commands, CPU-sized: each writes its summary; the first
  called the calculator (tool_call figures logged), the second had no tool."""
  found = _commands(r"python -m grpo_jax\.main --config=configs/tiny_tools\.py.*")
  runs = list({c.text: c for c in found}.values())  # (the Results table repeats them)
  assert len(runs) == 2
  for i, c in enumerate(runs):
    workdir = tmp_path / f"run{i}"
    _ok(shell(f"{c.text} --workdir={workdir} {TINY}", timeout=600), str(c))
    assert os.path.exists(workdir / "summary.json")
    logged = (workdir / "metrics.jsonl").read_text()
    assert ("tool_call/calls" in logged) == (not c.text.endswith("names=")), c.text


@pytest.mark.slow
def test_the_moe_demo_runs(tmp_path):
  """The Results table's MoE demo command, CPU-sized: it trains and writes its summary."""
  (c,) = {c.text: c for c in _commands(r".*configs/tiny_moe\.py")}.values()
  _ok(shell(f"{c.text} --workdir={tmp_path}/run {TINY}", timeout=600), str(c))
  assert os.path.exists(tmp_path / "run" / "summary.json")


def test_the_lora_run_and_its_peft_export(tmp_path):
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  train = [c for c in _commands(r"python -m grpo_jax\.main --config=configs/tiny_lora\.py.*")]
  workdir = tmp_path / "lora"
  for i, c in enumerate(train):
    cmd = re.sub(r" --workdir=\S+", "", c.text) + f" --workdir={workdir}-{i} {TINY}"
    _ok(shell(cmd, cwd=elsewhere if i else ROOT, timeout=600), str(c))
  (export,) = _commands(r"python -m grpo_jax\.infer --workdir=DIR --export_peft=OUT")
  cmd = export.text.replace("DIR", f"{workdir}-0").replace("OUT", str(tmp_path / "peft"))
  _ok(shell(cmd, cwd=elsewhere, timeout=300), str(export))
  assert os.path.exists(tmp_path / "peft" / "adapter_config.json")


def test_the_mnist_example(tmp_path):
  data = os.path.join(SHARED_DATA, "mnist")
  if not os.path.isdir(data):
    pytest.skip(f"no MNIST data at {data} (GRPO_SHARED_DATA)")
  (c,) = _commands(r"python -m grpo_jax\.examples\.mnist --data_dir=DIR --seed=S")
  cmd = c.text.replace("DIR", data).replace("=S", "=0") + f" --workdir={tmp_path} --epochs=1"
  _ok(shell(cmd, cwd=tmp_path, timeout=300), str(c))
  assert os.path.exists(tmp_path / "summary.json")


@pytest.mark.slow
def test_the_two_process_demo(tmp_path):
  (c,) = _commands(r"for i in 0 1; do LOCAL_DEVICES=1 launch/multihost\.sh .* & done; wait")
  cmd = _placeholders(c.text, tmp_path)
  cmd = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{_free_port()}", cmd)
  cmd = cmd.replace(" & done", f" {TINY} & done")
  out = _ok(shell(cmd, timeout=900), str(c))
  assert os.path.exists(tmp_path / "demo_dis" / "summary.json"), out[-3000:]


def test_the_results_table_is_written_from_the_measured_record():
  """README's Results table == benchmarks/readme_results.py's rendering of its record (figures
  are measured by the script, never typed), and the demo's row has its three seeds."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  try:
    import readme_results
  finally:
    sys.path.pop(0)
  record = readme_results.load_record()
  with open(README) as f:
    readme = f.read()
  assert readme_results.readme_with_table(readme, record) == readme, (
      "README.md's results table is not the record's. Fix: python benchmarks/readme_results.py "
      "--write (or re-measure: --rows=...)"
  )
  assert [r["seed"] for r in record["demo"]["runs"]] == [0, 1, 2]
  for row in ("demo", "one_step_off", "lora", "mnist"):
    assert "note" not in record[row], f"{row}: measured by the script, not carried over"


def test_your_data_commands_run_on_gsm8k_rows_as_a_user_keeps_them(tmp_path):
  """README "Your data": the starting config with nothing but the data named, on a chat-message
  JSONL and on verl's parquet (GSM8K rows, tests/data's fixtures), CPU-sized."""
  from tests.data import tables_fixtures as fx
  from tests.data import test_your_data as yd

  if not os.path.isdir(fx.GSM8K):
    pytest.skip(f"no GSM8K at {fx.GSM8K} (GRPO_SHARED_DATA)")
  (tmp_path / "path" / "to").mkdir(parents=True)
  yd.chat_jsonl(tmp_path / "path" / "to" / "rows.jsonl", n=16)
  fx.write_parquet(fx.verl_gsm8k_records("train", 16), str(tmp_path / "path/to/train.parquet"))
  sizing = (
      "--config.num_steps=1 --config.max_completion_length=16 --config.data.heldout_rows=8 "
      "--config.eval.batch_size=8"
  )
  for i, c in enumerate(
      _commands(r"python -m grpo_jax\.main --config=configs/tiny_your_data\.py .*")
  ):
    cmd = f"{_placeholders(c.text, tmp_path)} --workdir={tmp_path}/run{i} {sizing}"
    _ok(shell(cmd, cwd=tmp_path, timeout=600), str(c))
    assert os.path.exists(tmp_path / f"run{i}" / "summary.json")
