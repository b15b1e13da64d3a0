#!/usr/bin/env bash
# Runs one grpo_jax job as a GKE workload on a TPU cluster made with xpk (pip install xpk;
# https://github.com/AI-Hypercomputer/xpk): every TPU host of every slice runs the same
# `python -m grpo_jax.main --distributed ARGS`, and jax.distributed.initialize() finds its peers.
#
#   launch/xpk.sh --cluster C --tpu-type v5p-8|v5litepod-16|v6e-16|... [--num-slices N] \
#       [--project P] [--zone Z] [--docker-image IMG | --base-docker-image IMG] \
#       [--workload NAME] [--dry_run] [other `xpk workload create` flags] \
#       -- --config=configs/qwen3_8b.py --workdir=gs://bucket/run1
#
# The code: by default (--base-docker-image, default python:3.12) the git-tracked files of this
# repo as they are in the working tree (uncommitted edits included, untracked files not) are
# copied into a fresh staging dir, which xpk bakes into a new image as its `--script-dir`
# (xpk puts it at /app, the working dir); each host then runs
#   cd /app && pip install -e ".[tpu,gcs]" -c requirements/constraints.txt && python -m grpo_jax.main --distributed ARGS
# (quick when the base image already has the dependencies). xpk needs docker, or crane, for
# this. With --docker-image IMG the image is used as is and the command is just
# `python -m grpo_jax.main --distributed ARGS`: its working dir must hold this repo with
# grpo_jax[tpu,gcs] installed.
#
# Multi-slice (--num-slices N > 1): data parallelism across slices is a config setting, so add
# --config.mesh.dcn_data=N to the ARGS yourself (this script only reminds you).
# Hyperparameters belong in the config file and --config.* overrides, never in this script:
# everything after `--` reaches grpo_jax.main verbatim (quoting preserved). Options this script
# does not know (--spot, --priority high, --max-restarts 3, ...) go to xpk as they are.
# --dry_run prints the commands (one shell-quoted command a line) instead of running them; the
# local staging dir is still made then, under $TMPDIR, and kept for inspection. This script's
# flags go before `--` (one of them after it, e.g. a late --dry_run, is refused before anything
# runs).
set -euo pipefail
usage="usage: launch/xpk.sh --cluster C --tpu-type T [--num-slices N] [--project P] [--zone Z] [--docker-image IMG | --base-docker-image IMG] [--workload NAME] [--dry_run] [xpk flags] -- ARGS (this script's and xpk's flags before --; after it, ARGS for grpo_jax.main)"
die() { echo "launch/xpk.sh: $*" >&2; exit 2; }

source "$(dirname "${BASH_SOURCE[0]}")/_quote.sh"  # q: shell-quoting

CLUSTER=""; TPU_TYPE=""; SLICES=1; WORKLOAD=""; IMAGE=""; BASE_IMAGE=""; DRY=0
OPT=(); EXTRA=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    --dry_run) DRY=1 ;;
    --cluster|--tpu-type|--num-slices|--project|--zone|--docker-image|--base-docker-image|--workload)
      [ $# -ge 2 ] || die "$1 needs a value"
      set -- "$1=$2" "${@:3}"; continue ;;
    --cluster=*) CLUSTER="${1#*=}" ;;
    --tpu-type=*) TPU_TYPE="${1#*=}" ;;
    --num-slices=*) SLICES="${1#*=}" ;;
    --project=*) OPT+=(--project "${1#*=}") ;;
    --zone=*) OPT+=(--zone "${1#*=}") ;;
    --docker-image=*) IMAGE="${1#*=}" ;;
    --base-docker-image=*) BASE_IMAGE="${1#*=}" ;;
    --workload=*) WORKLOAD="${1#*=}" ;;
    --script-dir|--script-dir=*|--command|--command=*) die "$1 is set by this script" ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) EXTRA+=("$1") ;;
  esac
  shift
done
if [ "${1:-}" = "--" ]; then shift; fi
for a in "$@"; do  # everything after -- goes to grpo_jax: a flag of ours there would not act
  case "${a%%=*}" in
    --dry_run|--cluster|--tpu-type|--num-slices|--project|--zone|--docker-image|--base-docker-image|--workload)
      die "$a is this script's flag, but it comes after --, which passes it on to grpo_jax (and the workload would be submitted for real): put it before --. $usage" ;;
  esac
done
[ -n "$CLUSTER" ] && [ -n "$TPU_TYPE" ] || die "$usage"
[[ $SLICES =~ ^[1-9][0-9]*$ ]] || die "--num-slices must be a positive integer"
[ -z "$IMAGE" ] || [ -z "$BASE_IMAGE" ] || die "--docker-image and --base-docker-image exclude each other"
WORKLOAD="${WORKLOAD:-grpo-$(date -u +%Y%m%d-%H%M%S)}"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
XPK=(xpk workload create --cluster "$CLUSTER" --workload "$WORKLOAD" --tpu-type "$TPU_TYPE"
     --num-slices "$SLICES" ${OPT[@]+"${OPT[@]}"})
MAIN="python -m grpo_jax.main --distributed${*:+ $(q "$@")}"
CMDS=()
if [ -n "$IMAGE" ]; then
  XPK+=(--docker-image "$IMAGE" --command "$MAIN")
else
  STAGE="$(mktemp -d "${TMPDIR:-/tmp}/grpo_jax_xpk.XXXXXX")"
  [ "$DRY" = 1 ] || trap 'rm -rf "$STAGE"' EXIT
  APP="$STAGE/app"
  # The git-tracked files, as they are in the working tree (deleted ones skipped).
  TRACKED='git ls-files -z | while IFS= read -r -d "" f; do if [ -e "$f" ] || [ -L "$f" ]; then printf "./%s\0" "$f"; fi; done'
  CMDS+=("mkdir -p $(q "$APP")"
         "(cd $(q "$REPO") && $TRACKED | tar --null -T - -cf -) | tar -xf - -C $(q "$APP")")
  XPK+=(--base-docker-image "${BASE_IMAGE:-python:3.12}" --script-dir "$APP" --command
        "cd /app && python -m pip install -q -e \".[tpu,gcs]\" -c requirements/constraints.txt && $MAIN")
  UNTRACKED="$(git -C "$REPO" ls-files --others --exclude-standard | wc -l | tr -d ' ')"
  if [ "$UNTRACKED" != 0 ]; then
    echo "# note: $UNTRACKED untracked file(s) not shipped (git add them to ship them)" >&2
  fi
fi
XPK+=(${EXTRA[@]+"${EXTRA[@]}"})
if [ "$SLICES" -gt 1 ] && [[ " $* " != *" --config.mesh.dcn_data="* ]]; then
  echo "# hint: --num-slices $SLICES: add --config.mesh.dcn_data=$SLICES to the grpo_jax args" \
       "to spread data parallelism over the slices" >&2
fi

for c in ${CMDS[@]+"${CMDS[@]}"}; do eval "$c"; done  # local staging: run in dry runs too
if [ "$DRY" = 1 ]; then
  printf '%s\n' ${CMDS[@]+"${CMDS[@]}"} "$(q "${XPK[@]}")"
  echo "# dry run: nothing submitted${STAGE:+; the staged code is kept at $STAGE/app}" >&2
  exit 0
fi
command -v xpk >/dev/null || die "xpk not found: pip install xpk (or use --dry_run)"
"${XPK[@]}"
echo "# submitted $WORKLOAD: xpk workload list --cluster $(q "$CLUSTER" ${OPT[@]+"${OPT[@]}"})" >&2
