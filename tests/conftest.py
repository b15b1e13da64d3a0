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
