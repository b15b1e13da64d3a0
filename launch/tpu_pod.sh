#!/usr/bin/env bash
# Runs one grpo_jax job on every host of a Cloud TPU VM slice (v4/v5e/v5p/v6e pods).
# JAX's multi-controller runtime does the rest: every host runs the same command, and
# `--distributed` lets jax.distributed.initialize() discover the slice by itself.
#
#   launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] -- --config=configs/qwen3_8b.py --workdir=gs://b/run1
#
# Hyperparameters belong in the config file and --config.* overrides, never in this script.
# The repo must be at the same path on every host (this script copies it with scp first).
set -euo pipefail
TPU="${1:?usage: launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] -- ARGS}"; ZONE="${2:?zone}"; shift 2
PROJECT_FLAG=()
if [ "${1:-}" != "--" ] && [ -n "${1:-}" ]; then PROJECT_FLAG=(--project "$1"); shift; fi
[ "${1:-}" = "--" ] && shift
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="~/grpo_jax"

gcloud compute tpus tpu-vm scp --recurse "$REPO" "$TPU:$DEST" --zone "$ZONE" --worker=all \
  "${PROJECT_FLAG[@]}"
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all "${PROJECT_FLAG[@]}" --command "
  cd $DEST && (test -x .venv/bin/python || bash scripts/install.sh) &&
  .venv/bin/pip install -q 'jax[tpu]' &&
  .venv/bin/python -m grpo_jax.main --distributed $(printf '%q ' "$@")"
