"""The console's quiet: third-party log lines about the libraries, not the run, dropped unless
--verbose. The commands (main, infer, report) call it once at start-up:

    from grpo_jax.run import console
    console.quiet_libraries(verbose=FLAGS.verbose)

Dropped by default (each matched by the library that logs it, never by level alone, so a
library's warnings and every line of grpo_jax's own still show):
  - Orbax, grain and MaxText INFO lines (a dozen per checkpoint save or restore, one per data
    iterator, MaxText's "Skipping jax distributed system" per model config). They log through
    absl's logger, so the source file tells them from ours.
  - JAX's backend probes, "Unable to initialize backend 'tpu': ..." and 'proxy' (jax._src.
    xla_bridge, INFO on jax 0.11-0.12): JAX tries every platform it knows and logs each one this
    machine lacks. A platform named in JAX_PLATFORMS that fails still raises, with its reason.
  - MaxText's config dump (576 "Config param k: v" lines per model config, three configs per
    run): not a filter, the adapter passes `log_config=console.verbose()` to MaxText's pyconfig;
    and transformers' warnings about the configs of models MaxText's import builds (DeepSeek),
    silenced during that import (models/maxtext/adapter.py).

`verbose=True` keeps everything (main: --verbose, or absl's --verbosity=1 and up).
"""

import logging
import os

from absl import logging as absl_logging

# Source folders whose INFO lines are dropped (they log through absl's logger, named "absl");
# never grpo_jax's own files (grpo_jax/models/maxtext/ is ours).
QUIET_INFO_FROM = ("/orbax/", "/grain/", "/maxtext/")
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"
# JAX's line for a platform it probed and did not find (jax._src.xla_bridge.backends).
BACKEND_PROBE = "Unable to initialize backend"

_verbose = False


class _QuietLibraries(logging.Filter):
  """The filter on the console's handlers: False for a line the module docstring lists."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name.startswith("jax") and record.getMessage().startswith(BACKEND_PROBE):
      return False
    if record.levelno >= logging.WARNING:
      return True
    path = os.path.abspath(record.pathname).replace("\\", "/")
    return path.startswith(_OWN) or not any(folder in path for folder in QUIET_INFO_FROM)


_FILTER = _QuietLibraries()


def quiet_libraries(verbose: bool = False) -> None:
  """Drops the library lines of the module docstring from the console (absl's handler, which
  app.run puts on the root logger, and any other handler already there); `verbose`: shows them
  all again. Safe to call more than once; the last call wins."""
  global _verbose
  _verbose = verbose
  handlers = {id(h): h for h in [absl_logging.get_absl_handler(), *logging.getLogger().handlers]}
  for handler in handlers.values():
    handler.removeFilter(_FILTER)
    if not verbose:
      handler.addFilter(_FILTER)


def one_line(e: BaseException, limit: int = 600) -> str:
  """An exception as one console line: our own messages (and the builtin errors they raise)
  already say what, where and the fix; for anything else the type name leads."""
  text = " ".join(str(e).split()) or "(no message)"
  ours = type(e).__module__.startswith("grpo_jax") or isinstance(
      e, (FileNotFoundError, ValueError, KeyError, RuntimeError)
  )
  line = text if ours else f"{type(e).__name__}: {text}"
  return line if len(line) <= limit else line[:limit] + " ..."


def verbose() -> bool:
  """The last quiet_libraries call's `verbose` (False before any): for libraries that print
  through a switch of their own rather than a logger (MaxText's log_config)."""
  return _verbose
