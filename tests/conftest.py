"""Test-suite setup: 8 fake CPU devices (before jax is imported anywhere) and the repo on path."""
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

SHARED_DATA = os.environ.get("GRPO_SHARED_DATA", os.path.join(ROOT, "..", "shared", "data"))


import pytest  # noqa: E402


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
