#!/usr/bin/env bash
# Starts process PROCESS_ID of an N-process grpo_jax job with an explicit coordinator: for GPU
# boxes without a cluster manager JAX knows, or to try multi-host on one machine.
#
#   # on each of N hosts (or N times on one host, with a different PROCESS_ID):
#   launch/multihost.sh COORDINATOR_HOST:PORT N PROCESS_ID -- --config=configs/qwen3_8b.py \
#       --workdir=/shared/run1
#
# Under SLURM, Open MPI or on a TPU pod use `--distributed` instead (auto-detection).
# LOCAL_DEVICES=k fakes k CPU devices per process (CPU testing of a multi-host mesh).
# --dry_run right after PROCESS_ID prints the command (shell-quoted) instead of running it
# (anywhere else it is refused before anything runs).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_quote.sh"  # q: shell-quoting
usage="usage: launch/multihost.sh HOST:PORT NUM_PROCESSES PROCESS_ID [--dry_run] -- ARGS (--dry_run right after PROCESS_ID; after --, ARGS for grpo_jax.main)"
die() { echo "launch/multihost.sh: $*" >&2; exit 2; }
[ $# -ge 3 ] || die "$usage"
COORD="$1"; NPROC="$2"; PID="$3"; shift 3
DRY=0
if [ "${1:-}" = "--dry_run" ]; then DRY=1; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
for a in "$COORD" "$NPROC" "$PID" "$@"; do  # a --dry_run elsewhere would not act
  if [ "${a%%=*}" = --dry_run ]; then
    die "--dry_run here would go to grpo_jax (and the job would start for real): put it right after PROCESS_ID, before --. $usage"
  fi
done
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
if [ -n "${LOCAL_DEVICES:-}" ]; then
  export JAX_PLATFORMS=cpu
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$LOCAL_DEVICES"
fi
cd "$REPO"
CMD=("$PY" -m grpo_jax.main --coordinator_address="$COORD" --num_processes="$NPROC"
     --process_id="$PID" "$@")
if [ "$DRY" = 1 ]; then
  ENV=()
  if [ -n "${LOCAL_DEVICES:-}" ]; then ENV=("JAX_PLATFORMS=cpu" "XLA_FLAGS=$(q "$XLA_FLAGS")"); fi
  echo "cd $(q "$REPO")"
  echo "${ENV[*]+${ENV[*]} }$(q "${CMD[@]}")"
  exit 0
fi
exec "${CMD[@]}"
