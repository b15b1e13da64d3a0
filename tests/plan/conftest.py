"""The planner's tests compile for other targets (XLA:GPU deviceless, libtpu topologies) and read
each executable's memory analysis: the suite's persistent compilation cache stays off here."""

import pytest


@pytest.fixture(autouse=True)
def _no_compilation_cache(no_compilation_cache):
  yield
