#!/usr/bin/env bash
# The compiled-program tests: what XLA builds for the accelerators this machine does not have.
# A Python 3.12 virtualenv (./.venv-aot unless VENV is set) with requirements/aot.txt (jax/jaxlib
# 0.12.0.1 + the CUDA 13 plugin and cuDNN's library for XLA:GPU's deviceless H100 compile +
# libtpu for the TPU compiler; 3.2 GB), grpo_jax's core and pytest only; then, on CPU
# (JAX_PLATFORMS=cpu):
#   tests/plan/test_compiled_programs.py   the sampler / log-prob / update programs compiled for one
#                                     H100 and for v5p-8, read as optimized HLO
#                                     (grpo_jax/plan/hlo_inspect.py)
#   tests/plan/test_moe_programs.py        an MoE update compiled for one H100 and for v5p-8
#                                     with expert parallelism: grouped GEMMs, all-to-alls
#   tests/plan/test_memory_plan.py         the planner, with its TPU and H100 compiles
# scripts/test.sh runs it after the main suite. Extra arguments go to pytest (e.g. -k h100).
# Exit code: pytest's (5, nothing collected, fails).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-aot}"
source "$ROOT/scripts/_env.sh"
make_venv
PINS="$ROOT/requirements/aot.txt"
echo "[grpo_jax] installing grpo_jax[test-core] + the CUDA plugin and libtpu into $VENV"
CONSTRAINTS="$ROOT/requirements/constraints.txt" pip_install -r "$PINS" -e "$ROOT[test-core]"
check_pins "$PINS" "requirements/aot.txt's pins"
cd "$ROOT"
set +e
JAX_PLATFORMS=cpu "$VENV/bin/python" -m pytest -q -rsx tests/plan/test_compiled_programs.py \
  tests/plan/test_moe_programs.py tests/plan/test_memory_plan.py "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests: the suite is missing or every test was deselected." >&2
fi
exit "$rc"
