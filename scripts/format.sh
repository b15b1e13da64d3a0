#!/usr/bin/env bash
# The formatter (pyink: Google's fork of black; settings in pyproject.toml: 2-space indent, 100
# columns) over every tracked Python file.
#   bash scripts/format.sh           format in place
#   bash scripts/format.sh --check   list the files that need formatting and exit 1 if any
#                                    (what .ci/run does; it fails before the tests run)
# Uses the test virtualenv (scripts/install.sh test installs pyink); PYINK=path overrides.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
PYINK="${PYINK:-$VENV/bin/pyink}"
if [ ! -x "$PYINK" ]; then
  echo "error: $PYINK not found. Fix: bash scripts/install.sh test (installs pyink), or set PYINK" >&2
  exit 2
fi
mapfile -t files < <(git ls-files '*.py')
if [ "${1:-}" = "--check" ]; then
  rc=0
  out="$("$PYINK" --check "${files[@]}" 2>&1)" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "$out" | grep -v "^Oh no\|^All done" >&2
    echo "error: the files above are not formatted. Fix: bash scripts/format.sh" >&2
    exit 1
  fi
  echo "[grpo_jax] format check: ${#files[@]} files formatted"
else
  "$PYINK" --quiet "${files[@]}"
fi
