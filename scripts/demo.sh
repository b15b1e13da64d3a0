#!/usr/bin/env bash
# Installs grpo_jax into a Python 3.12 virtualenv (./.venv) and runs the default job: the CPU
# demo (configs/tiny.py). Extra arguments go to grpo_jax.main, e.g. --workdir=/tmp/demo or
# --config.seed=3.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash "$ROOT/scripts/install.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m grpo_jax.main --config=configs/tiny.py "$@"
