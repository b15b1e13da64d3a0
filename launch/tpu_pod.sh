#!/usr/bin/env bash
# Runs one grpo_jax job on every host of a Cloud TPU VM slice (v4/v5e/v5p/v6e pods).
# JAX's multi-controller runtime does the rest: every host runs the same command, and
# `--distributed` lets jax.distributed.initialize() discover the slice by itself.
#
#   launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] [--dry_run] [--run_name NAME] [--python PY] \
#       -- --config=configs/qwen3_8b.py --workdir=gs://bucket/run1
#
# This script's flags go before `--`; everything after it reaches grpo_jax.main (one of this
# script's flags there, e.g. a late --dry_run, is refused before anything runs).
#
# Steps (each printed, one shell-quoted command a line, by --dry_run instead of being run;
# the local tarball is still built then, under $TMPDIR, and kept so it can be inspected):
#   1. tar the git-tracked files of this repo AS THEY ARE IN THE WORKING TREE (uncommitted edits
#      included, untracked files not: `git add` new files; .venv, runs/ and other ignored or
#      untracked paths never ship);
#   2. scp the tarball to every worker;
#   3. on every worker, extract it into ~/grpo_jax.new and swap that in for ~/grpo_jax (so files
#      deleted here disappear there too), create the venv ~/grpo_jax_venv (outside the code dir,
#      so it survives the swap) with PY (default python3.12) if it is missing, and
#      `pip install -e '.[tpu,gcs]'` with requirements/constraints.txt, every time (new
#      dependencies land; a no-op when nothing changed);
#   4. run `python -m grpo_jax.main --distributed ARGS` on all workers at once, each teeing its
#      output to ~/grpo_jax_logs/NAME/worker-$(hostname).log (NAME: --run_name, default the UTC
#      start time);
#   5. copy those logs back, worker by worker, into ./logs/TPU_NAME/NAME/ (also when the run
#      failed; the script exits with the run's status).
# Re-running is safe: the code dir is replaced, the venv reused.
#
# Hyperparameters belong in the config file and --config.* overrides, never in this script:
# everything after `--` reaches grpo_jax.main verbatim (quoting preserved).
# Needs gcloud (not for --dry_run); with several workers, gcloud wants your key in ssh-agent
# (`ssh-add ~/.ssh/google_compute_engine`).
set -euo pipefail
usage="usage: launch/tpu_pod.sh TPU_NAME ZONE [PROJECT] [--dry_run] [--run_name NAME] [--python PY] -- ARGS (this script's flags before --; after it, ARGS for grpo_jax.main)"
die() { echo "launch/tpu_pod.sh: $*" >&2; exit 2; }

source "$(dirname "${BASH_SOURCE[0]}")/_quote.sh"  # q: shell-quoting

POS=(); DRY=0; RUN_NAME=""; REMOTE_PY=python3.12
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    --dry_run) DRY=1 ;;
    --run_name) RUN_NAME="${2:?--run_name needs a value}"; shift ;;
    --run_name=*) RUN_NAME="${1#*=}" ;;
    --python) REMOTE_PY="${2:?--python needs a value}"; shift ;;
    --python=*) REMOTE_PY="${1#*=}" ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) die "unknown option '$1' (grpo_jax arguments go after --). $usage" ;;
    *) POS+=("$1") ;;
  esac
  shift
done
if [ "${1:-}" = "--" ]; then shift; fi
for a in "$@"; do  # everything after -- goes to grpo_jax: a flag of ours there would not act
  case "$a" in
    --dry_run|--dry_run=*|--run_name|--run_name=*|--python|--python=*)
      die "$a is this script's flag, but it comes after --, which passes it on to grpo_jax (and the launch would run for real): put it before --. $usage" ;;
  esac
done
if [ ${#POS[@]} -lt 2 ] || [ ${#POS[@]} -gt 3 ]; then die "$usage"; fi
TPU="${POS[0]}"; ZONE="${POS[1]}"
GC=(--zone "$ZONE")
if [ ${#POS[@]} -eq 3 ]; then GC+=(--project "${POS[2]}"); fi
RUN_NAME="${RUN_NAME:-$(date -u +%Y%m%d-%H%M%S)}"
[[ $RUN_NAME =~ ^[A-Za-z0-9_.-]+$ ]] || die "--run_name: use letters, digits, _ . - only"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAGE="$(mktemp -d "${TMPDIR:-/tmp}/grpo_jax_tpu_pod.XXXXXX")"
TGZ="$STAGE/grpo_jax.tgz"
LOCAL_LOGS="$(pwd)/logs/$TPU"
if [ "$DRY" = 0 ]; then
  trap 'rm -rf "$STAGE"' EXIT
  command -v gcloud >/dev/null || die "gcloud not found: install the Google Cloud CLI (or use --dry_run)"
fi

# 1. The git-tracked files, as they are in the working tree (deleted ones skipped).
TRACKED='git ls-files -z | while IFS= read -r -d "" f; do if [ -e "$f" ] || [ -L "$f" ]; then printf "./%s\0" "$f"; fi; done'
PACK="(cd $(q "$REPO") && $TRACKED | tar --null -T - -czf $(q "$TGZ"))"
# 2. To every worker.
SYNC=(gcloud compute tpus tpu-vm scp "$TGZ" "$TPU:grpo_jax.tgz" --worker=all "${GC[@]}")
# 3. Replace the code dir, make the venv if missing, install (every time).
R='"$HOME"'
SETUP="rm -rf $R/grpo_jax.new && mkdir -p $R/grpo_jax.new && tar -xzf $R/grpo_jax.tgz -C $R/grpo_jax.new"
SETUP+=" && rm -rf $R/grpo_jax && mv $R/grpo_jax.new $R/grpo_jax && rm -f $R/grpo_jax.tgz"
SETUP+=" && if [ ! -x $R/grpo_jax_venv/bin/python ]; then command -v $(q "$REMOTE_PY") >/dev/null"
SETUP+=" || { echo \"\$(hostname): $(q "$REMOTE_PY") not found: install Python 3.12 (e.g. python3.12-venv"
SETUP+=" from the deadsnakes PPA) or pass --python\" >&2; exit 1; }; $(q "$REMOTE_PY") -m venv $R/grpo_jax_venv; fi"
SETUP+=" && cd $R/grpo_jax && $R/grpo_jax_venv/bin/python -m pip install -q -e \".[tpu,gcs]\""
SETUP+=" -c requirements/constraints.txt"
INSTALL=(gcloud compute tpus tpu-vm ssh "$TPU" --worker=all "${GC[@]}" --command "$SETUP")
# 4. The same command on every worker, each with its own log.
LOG="$R/grpo_jax_logs/$RUN_NAME"
MAIN="set -o pipefail; mkdir -p $LOG && cd $R/grpo_jax && $R/grpo_jax_venv/bin/python -m grpo_jax.main"
MAIN+=" --distributed${*:+ $(q "$@")} 2>&1 | tee $LOG/worker-\$(hostname).log"
RUN=(gcloud compute tpus tpu-vm ssh "$TPU" --worker=all "${GC[@]}" --command "$MAIN")
# 5. The logs back (gcloud scp copies from one worker at a time).
NWORKERS="gcloud compute tpus tpu-vm describe $(q "$TPU" "${GC[@]}") --format='value(networkEndpoints.len())'"
COLLECT="for w in \$(seq 0 \$((\$($NWORKERS) - 1))); do gcloud compute tpus tpu-vm scp --recurse"
COLLECT+=" $(q "$TPU:grpo_jax_logs/$RUN_NAME" "$LOCAL_LOGS") --worker=\"\$w\" $(q "${GC[@]}"); done"

UNTRACKED="$(git -C "$REPO" ls-files --others --exclude-standard | wc -l | tr -d ' ')"
if [ "$UNTRACKED" != 0 ]; then
  echo "# note: $UNTRACKED untracked file(s) not shipped (git add them to ship them)" >&2
fi
eval "$PACK"  # local and side-effect free: built in dry runs too
if [ "$DRY" = 1 ]; then
  printf '%s\n' "$PACK" "$(q "${SYNC[@]}")" "$(q "${INSTALL[@]}")" "$(q "${RUN[@]}")" \
    "mkdir -p $(q "$LOCAL_LOGS")" "$COLLECT"
  echo "# dry run: nothing sent; the tarball is kept at $TGZ" >&2
  exit 0
fi
"${SYNC[@]}"
"${INSTALL[@]}"
rc=0
"${RUN[@]}" || rc=$?
mkdir -p "$LOCAL_LOGS"
eval "$COLLECT" || echo "# warning: could not copy every worker's log" >&2
echo "# logs: $LOCAL_LOGS/$RUN_NAME/ (run exit status $rc)" >&2
exit "$rc"
