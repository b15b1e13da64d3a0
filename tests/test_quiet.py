"""A newcomer's console (issue 47): the demo's own lines come first, third-party lines about the
libraries are dropped unless --verbose (grpo_jax/run/console.py), TensorBoard gets tags it
accepts while metrics.jsonl keeps the stable names, and what would surprise says so in one line
(a quantized LoRA base without qwix, checkpoint steps counted after the SFT steps)."""

import json
import logging
import os
import re
import struct
import subprocess
import sys

import pytest

from grpo_jax.run import console

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.dirname(os.path.dirname(os.path.abspath(logging.__file__)))  # outside grpo_jax
PROBE = "Unable to initialize backend"


def _main(*args, tmp_path, prelude="pass"):
  """grpo_jax.main as a user runs it: JAX_PLATFORMS unset, so JAX probes every platform it knows
  (the 8 fake CPU devices of conftest's XLA_FLAGS stay). -> (exit status, stdout + stderr lines
  in the order printed)."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  code = f"import sys; {prelude}; from grpo_jax import main; sys.argv[0] = 'main'; main.run()"
  r = subprocess.run(
      [sys.executable, "-c", code, *args],
      cwd=tmp_path,
      env=dict(env, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      timeout=600,
  )
  return r.returncode, r.stdout.splitlines()


def _tensorboard_tags(workdir) -> set[str]:
  from tensorboardX.proto import event_pb2

  tags = set()
  for name in (f for f in os.listdir(workdir) if f.startswith("events.out.tfevents")):
    data, pos = open(os.path.join(workdir, name), "rb").read(), 0
    while pos < len(data):  # TFRecord: length (8), its crc (4), the event, its crc (4)
      (n,) = struct.unpack("<Q", data[pos : pos + 8])
      tags |= {
          v.tag for v in event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n]).summary.value
      }
      pos += 12 + n + 4
  return tags


def test_the_demo_prints_its_own_lines_first_and_no_library_noise(tmp_path):
  """configs/tiny.py, CPU-sized: a 2-step SFT warm start, 2 GRPO steps, pass@k evaluations."""
  workdir = tmp_path / "run"
  rc, lines = _main(
      "--config=configs/tiny.py",
      f"--workdir={workdir}",
      "--config.sft_steps=2",
      "--config.sft.num_validation=8",
      "--config.num_steps=2",
      "--config.batch_size=8",
      "--config.num_generations=4",
      "--config.data.arithmetic.num_train=64",
      "--config.data.arithmetic.num_test=8",
      "--config.eval.batch_size=8",
      "--config.eval.num_samples=2",
      "--config.eval.generation_configs=('greedy','standard')",
      "--config.save_interval_steps=1",
      tmp_path=tmp_path,
  )
  text = "\n".join(lines)
  assert rc == 0, text[-3000:]
  own = next(i for i, line in enumerate(lines) if "] workdir: " in line)  # main's first line
  assert own < 3, text[:2000]
  for noise in (PROBE, "is illegal", "checkpoint_manager.py", "Config param"):
    assert noise not in text, noise
  # The step offset is said once, and is what checkpoints/ shows: GRPO steps 1-2 at 3-4.
  said = [
      line for line in lines if "step numbers: checkpoints/ and TensorBoard count the 2 SFT" in line
  ]
  assert len(said) == 1 and "(3-4)" in said[0], text
  assert {"3", "4"} <= set(os.listdir(workdir / "checkpoints"))
  # TensorBoard: tags it accepts; metrics.jsonl: the stable names, '@' kept.
  tags = _tensorboard_tags(workdir)
  assert "eval/pass_at_1/standard" in tags and "eval/pass_at_2/standard" in tags, sorted(tags)
  assert not [t for t in tags if "@" in t]
  names = set()
  for row in open(workdir / "metrics.jsonl"):
    names |= set(json.loads(row))
  assert {"eval/pass@1/standard", "eval/pass@2/standard"} <= names
  assert not [n for n in names if "_at_" in n]


def test_jax_backend_probes_show_only_with_verbose(tmp_path):
  """A bad config value: JAX has probed its backends by then; the console gets the error alone,
  and with --verbose the probe lines too."""
  args = ("--config=configs/tiny.py", "--config.batch_size=-1")
  rc, lines = _main(*args, tmp_path=tmp_path)
  assert rc == 2 and lines[0].startswith("error: ") and len(lines) > 1, lines
  assert all(line.startswith("  ") for line in lines[1:]), lines  # the bad values, no more
  rc, lines = _main(*args, "--verbose", tmp_path=tmp_path)
  assert rc == 2 and [line for line in lines if PROBE in line], lines


@pytest.fixture
def quiet():
  console.quiet_libraries()
  yield console._FILTER
  console.quiet_libraries()


def _record(path: str, level: int, msg: str, name: str = "absl") -> logging.LogRecord:
  return logging.LogRecord(name, level, path, 1, msg, None, None)


def test_the_filter_drops_library_lines_and_keeps_ours_and_warnings(quiet):
  own = os.path.join(ROOT, "grpo_jax", "models", "maxtext", "adapter.py")
  for path in ("orbax/checkpoint/checkpoint_manager.py", "grain/_src/x.py", "maxtext/pyconfig.py"):
    assert not quiet.filter(_record(os.path.join(LIB, path), logging.INFO, "saving"))
    assert quiet.filter(_record(os.path.join(LIB, path), logging.WARNING, "disk full"))
  assert quiet.filter(_record(own, logging.INFO, "MaxText checkpoint loaded"))
  probe = f"{PROBE} 'tpu': libtpu.so not found"
  bridge = os.path.join(LIB, "jax/_src/xla_bridge.py")
  for level in (logging.INFO, logging.WARNING):  # INFO on jax 0.12; WARNING on some versions
    assert not quiet.filter(_record(bridge, level, probe, name="jax._src.xla_bridge"))
  assert quiet.filter(_record(bridge, logging.WARNING, "An NVIDIA GPU may be present", "jax"))
  absl_handler = console.absl_logging.get_absl_handler()
  assert quiet in absl_handler.filters and not console.verbose()
  console.quiet_libraries(verbose=True)
  assert quiet not in absl_handler.filters and console.verbose()


def test_maxtext_config_dump_only_with_verbose(quiet, caplog):
  from tests.conftest import maxtext_unusable

  why = maxtext_unusable()
  if why:
    pytest.skip(why)
  import jax
  from configs import tiny
  from grpo_jax.models.maxtext import adapter
  from grpo_jax.parallel import sharding

  config = tiny.get_config()
  config.model.impl = "maxtext"
  mesh = adapter.make_mesh(config, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
  caplog.set_level(logging.INFO, logger="maxtext.configs.pyconfig")
  for verbose in (False, True):
    console.quiet_libraries(verbose=verbose)
    caplog.clear()
    mt = adapter.maxtext_config(config, adapter._native_cfg(config), mesh)
    dumped = [r for r in caplog.records if r.getMessage().startswith("Config param")]
    assert mt.log_config is verbose and (len(dumped) > 100) is verbose, len(dumped)


def test_tensorboard_tags():
  from grpo_jax.run.metrics import tensorboard_tag

  assert tensorboard_tag("eval/pass@16/liberal") == "eval/pass_at_16/liberal"
  assert tensorboard_tag("reward/total") == "reward/total"  # the usual names unchanged
  assert tensorboard_tag("perf/tokens per s (x)") == "perf/tokens_per_s__x_"
  assert re.fullmatch(r"[-/\w.]+", tensorboard_tag("a@b#c:d"))


def test_quantized_lora_base_without_qwix_is_one_line(tmp_path):
  hide_qwix = "sys.modules['qwix'] = None"  # as if not installed: import fails, find_spec None
  rc, lines = _main(
      "--config=configs/tiny.py",
      "--config.sft_steps=0",
      "--config.lora.rank=4",
      "--config.lora.quantize_base=int8",
      tmp_path=tmp_path,
      prelude=hide_qwix,
  )
  assert rc == 2, lines
  assert len(lines) == 2 and lines[1].strip().startswith("lora.quantize_base='int8' needs qwix")
  assert "pip install qwix -c requirements/constraints.txt" in lines[1]


def test_quantizing_without_qwix_names_the_fix(monkeypatch):
  from grpo_jax.models.lora import adapters

  for name in [n for n in sys.modules if n == "qwix" or n.startswith("qwix.")] + ["qwix"]:
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(ModuleNotFoundError, match=r"needs qwix.*Fix: pip install qwix"):
    adapters._qarray()
