r"""Entry point: flags -> (jax.distributed) -> config validation -> train.run(config, workdir).

    python -m grpo_jax.main --config=configs/qwen3_8b.py --config.beta=0.08 --workdir=/tmp/run1
    python -m grpo_jax.main --config=configs/tiny.py            # the CPU demo

Multi-host (one process per host, same command everywhere): add `--distributed` on TPU pods,
SLURM or other clusters JAX auto-detects, or pass --coordinator_address/--num_processes/
--process_id explicitly (launch/ has scripts).
"""

import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Run directory: TensorBoard events, checkpoints/, summary.json. A run resumes from the "
    "latest checkpoint found here. Default: runs/<config name>-<time> (a fresh run).",
)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() with cluster auto-detection."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for jax.distributed.initialize."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "JAX processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in the job.")
_PEER_TIMEOUT = flags.DEFINE_float(
    "peer_timeout_seconds",
    10.0,
    "Multi-process: when another process has sent no heartbeat "
    "for this long (killed, crashed), this one stops too, with one error line and exit status "
    "75; relaunching every process resumes from the last checkpoint (grpo_jax/parallel/peers.py). 0: "
    "leave it to JAX (an abort after its 100 s heartbeat timeout).",
)
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config (file + --config.* overrides) and exit."
)
_VERBOSE = flags.DEFINE_bool(
    "verbose",
    False,
    "Show third-party libraries' INFO lines (Orbax, grain, JAX's backend probes, MaxText's "
    "config dump: grpo_jax/run/console.py; absl's --verbosity=1 shows them too), and on an "
    "error the full traceback here too (it always goes to WORKDIR/error.log; the console gets "
    "one line).",
)


def _parse_flags(argv):
  """absl's parser, with a mistyped --config.<field> turned into one clear line, and the config
  file found from any folder (paths.config_file_args)."""
  from grpo_jax.run import paths

  argv = paths.config_file_args(argv)
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
    sys.exit(2)
  except (AttributeError, KeyError) as e:
    # ml_collections raises these for fields that do not exist in the (locked) config.
    arg = _unknown_override(argv) or next(
        (a for a in argv[1:] if a.startswith("--config.")), "--config.?"
    )
    msg = str(e).strip("'\"").replace("\\n", " ").replace("\n", " ").replace("\\'", "'")
    print(
        f"error: {arg.split('=')[0]}: no such config field ({msg}). Fix: check the name "
        "against the config file (python -m grpo_jax.main --config=FILE --print_config "
        "prints every field).",
        file=sys.stderr,
    )
    sys.exit(2)


def _unknown_override(argv) -> str | None:
  """The first --config.<a.b.c> argument whose field the config file does not define."""
  path = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), None)
  if path is None:
    return None
  try:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_grpo_config_probe", path.split(":")[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
  except Exception:  # the file itself is reported by absl's own parser
    return None
  for arg in argv[1:]:
    if not arg.startswith("--config."):
      continue
    node = config
    for part in arg[len("--config.") :].split("=", 1)[0].split("."):
      try:
        node = node[part]
      except (KeyError, TypeError, AttributeError):
        return arg
  return None


def _init_distributed():
  if _COORDINATOR.value or _NUM_PROCESSES.value or _PROCESS_ID.value is not None:
    import jax

    jax.distributed.initialize(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
    )
  elif _DISTRIBUTED.value:
    import jax

    jax.distributed.initialize()


def _default_workdir(config_path: str) -> str:
  name = os.path.splitext(os.path.basename(config_path or "run"))[0]
  return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/tiny.py")
  from grpo_jax.run import console

  console.quiet_libraries(verbose=_VERBOSE.value or flags.FLAGS.verbosity >= 1)
  _init_distributed()
  from grpo_jax.parallel import peers

  watchdog = peers.start(_PEER_TIMEOUT.value)

  from grpo_jax import configuration

  config = _CONFIG.value
  configuration.split_comma_lists(config)  # --config.reward.functions=a,b
  if _PRINT_CONFIG.value:
    print(config)
    return
  errors = configuration.validate(config)
  if errors:
    print(
        f"error: {len(errors)} bad config value(s) in {flags.FLAGS['config'].config_filename}:",
        file=sys.stderr,
    )
    for line in errors:
      print(f"  {line}", file=sys.stderr)
    sys.exit(2)
  for line in configuration.warnings(config):
    logging.warning("config: %s", line)

  workdir = _WORKDIR.value or _default_workdir(flags.FLAGS["config"].config_filename)
  from grpo_jax.run import paths

  problem = paths.check_scheme(workdir)
  if problem:
    print(f"error: --workdir={workdir}: {problem[0]}. Fix: {problem[1]}.", file=sys.stderr)
    sys.exit(2)
  logging.info("workdir: %s", paths.path(workdir))
  if config.compilation_cache_dir:
    import jax

    jax.config.update(
        "jax_compilation_cache_dir", os.fspath(paths.path(config.compilation_cache_dir))
    )
  from grpo_jax import train

  watchdog.workdir = workdir
  try:
    train.run(config, workdir)
  except (SystemExit, KeyboardInterrupt) as e:
    watchdog.stop(clean=isinstance(e, SystemExit) and e.code in (0, None))
    raise
  except Exception as e:  # one line on the console, the traceback in WORKDIR/error.log
    watchdog.stop(clean=False)  # the other processes stop too (no hang in a collective)
    if _VERBOSE.value:
      raise
    where = _write_traceback(workdir)
    fd = _quiet_shutdown(where)  # library threads may still print: not to the console
    # A library thread may have been cut off mid-line by the redirect: start on a fresh line.
    if peers.lost_peer(e):  # a collective found a peer process dead
      os.write(
          fd,
          f"\nerror: a peer JAX process is gone ({peers.lost_peer(e)}); this "
          f"process stops too. {peers.relaunch_hint(workdir)} (traceback: {where})\n".encode(),
      )
      os._exit(peers.EXIT_PEER_GONE)  # jax's shutdown at exit would wait for the dead peer
    os.write(
        fd,
        f"\nerror: {console.one_line(e)} (traceback: {where}; --verbose prints it "
        "here)\n".encode(),
    )
    sys.exit(1)
  watchdog.stop()


def _quiet_shutdown(log_path: str) -> int:
  """Library threads (Orbax, asyncio) may still print while the interpreter exits after an
  error; from here on that goes to the error log (local) or nowhere, so the console's last line
  is the error. -> a descriptor of the console's stderr."""
  sys.stderr.flush()
  console = os.dup(2)
  try:
    target = open(log_path, "a") if os.path.exists(log_path) else open(os.devnull, "w")
    os.dup2(target.fileno(), 2)
  except OSError:
    pass
  return console


def _write_traceback(workdir: str) -> str:
  import traceback
  import jax
  from grpo_jax.run import paths

  text = traceback.format_exc()
  from grpo_jax.parallel import peers

  try:
    target = paths.path(workdir) / peers.error_log_name(jax.process_index())
    paths.write_atomic(target, text)
    return os.fspath(target)
  except Exception:  # the workdir itself may be the problem
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix="grpo_jax_error_", suffix=".log")
    with os.fdopen(fd, "w") as f:
      f.write(text)
    return tmp


def run():
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
