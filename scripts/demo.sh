#!/usr/bin/env bash
# Installs grpo_jax into a Python 3.12 virtualenv (./.venv) and runs the default job: the CPU
# demo (configs/tiny.py). Extra arguments go to grpo_jax.main, e.g. --workdir=/tmp/demo or
# --config.seed=3.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# Installs once: later runs use the .venv as it is (offline too) until setup.py or the pins
# change (scripts/_env.sh::installed); a test venv (scripts/install.sh test) serves as well.
if ! installed core test; then
  bash "$ROOT/scripts/install.sh"
fi
cd "$ROOT"
exec "$VENV/bin/python" -m grpo_jax.main --config=configs/tiny.py "$@"
