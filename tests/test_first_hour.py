"""The first commands a newcomer runs: scripts/demo.sh installs once (later runs use the .venv
it made as it is, offline too, until setup.py or the pins change: the stamp scripts/install.sh
writes, scripts/_env.sh::installed), and `--config=configs/...` names the shipped file from any
folder, or fails in one line."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.dirname(os.path.dirname(sys.executable))  # the suite's own virtualenv


def _installed(venv, modes="core test"):
  """scripts/_env.sh's `installed MODES` for `venv`: True when the demo would skip installing."""
  script = f"source scripts/_env.sh; if installed {modes}; then echo yes; else echo no; fi"
  r = subprocess.run(
      ["bash", "-c", script],
      cwd=ROOT,
      env=dict(os.environ, VENV=str(venv)),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert r.returncode == 0, r.stderr
  return r.stdout.strip() == "yes"


def _stamp(mode):
  r = subprocess.run(
      ["bash", "-c", f"source scripts/_env.sh; install_stamp {mode}"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert r.returncode == 0, r.stderr
  return r.stdout.strip()


def test_a_stamp_of_this_tree_skips_the_install_and_a_stale_one_does_not(tmp_path):
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  python = venv / "bin" / "python"  # this suite's interpreter, as a venv's python would be
  python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
  python.chmod(0o755)
  assert not _installed(venv)  # no stamp: a venv made some other way
  (venv / ".grpo_jax_install").write_text(_stamp("core") + "\n")
  assert _installed(venv)
  assert not _installed(venv, modes="test")  # a core install does not stand for the test extras
  (venv / ".grpo_jax_install").write_text("core 0123456789abcdef\n")  # setup.py or pins changed
  assert not _installed(venv)
  os.remove(venv / "bin" / "python")  # a broken venv installs again
  (venv / ".grpo_jax_install").write_text(_stamp("core") + "\n")
  assert not _installed(venv)


def test_the_demo_runs_offline_with_the_venv_it_made():
  if not os.path.exists(os.path.join(VENV, ".grpo_jax_install")):
    pytest.skip(f"{VENV} was not made by scripts/install.sh (no .grpo_jax_install stamp)")
  if not _installed(VENV):
    pytest.skip(f"{VENV} was installed from another setup.py or pins: the demo would reinstall")
  # No package index reachable: an install attempt would fail the run.
  env = dict(os.environ, VENV=VENV, PIP_NO_INDEX="1", PIP_INDEX_URL="http://127.0.0.1:9/simple")
  r = subprocess.run(
      ["bash", "scripts/demo.sh", "--print_config"],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  out = r.stdout + r.stderr
  assert r.returncode == 0, out[-3000:]
  assert "installing" not in out and "Editable" not in out, out[:2000]
  assert out.splitlines()[0].startswith("batch_size:"), out[:500]  # the demo's own first line


@pytest.mark.parametrize("command", ["grpo_jax.main", "grpo_jax.infer"])
def test_the_shipped_config_is_found_from_another_folder(command, tmp_path):
  """`--config=configs/tiny.py` run outside the repository root: the package's own configs/."""
  args = ["--print_config"] if command == "grpo_jax.main" else ["--num_examples=1"]
  r = subprocess.run(
      [sys.executable, "-m", command, "--config=configs/tiny.py", *args],
      cwd=tmp_path,
      env=dict(os.environ, PYTHONPATH=ROOT),
      capture_output=True,
      text=True,
      timeout=300,
  )
  if command == "grpo_jax.main":
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines()[0] == "batch_size: 32", r.stdout[:300]
  else:  # the config loaded: infer samples a held-out row from a random init
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RANDOM-INIT" in r.stderr and "ground truth" in r.stdout.lower(), r.stdout[-2000:]


def test_a_config_file_found_nowhere_is_one_line(tmp_path):
  r = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", "--config=configs/nope.py"],
      cwd=tmp_path,
      env=dict(os.environ, PYTHONPATH=ROOT),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert r.returncode == 2
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: --config=configs/nope.py: no such file")
  assert os.path.join(ROOT, "configs") in lines[0]
  # From the checkout itself the two places are one: named once.
  r = subprocess.run(
      [sys.executable, "-m", "grpo_jax.main", "--config=configs/nope.py"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  root = os.path.realpath(ROOT)
  assert r.returncode == 2 and f"no such file in {root}. Fix:" in r.stderr, r.stderr
