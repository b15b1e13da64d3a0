#!/usr/bin/env bash
# The core tests and the MaxText policy on vLLM-TPU's pins: a Python 3.12 virtualenv
# (./.venv-tpupins unless VENV is set) with the exact versions tpu-inference 0.32.0 pins
# (requirements/tpu-pins.txt: jax/jaxlib 0.11.2, libtpu 0.0.48, flax 0.12.10, qwix 0.1.2),
# everything else at the tested versions of requirements/constraints.txt (maxtext 0.2.5 too), on
# CPU (8 fake devices, as the main suite).
#   scripts/test_tpu_pins.sh           the pins + grpo_jax[test,maxtext]; test_rl_*, test_model,
#                                      test_sampler, test_step, test_train, test_tpu_inference,
#                                      test_maxtext, test_maxtext_mapping
#   scripts/test_tpu_pins.sh --ci      the pins + grpo_jax[test-core,maxtext] (pytest, maxtext
#                                      and its import deps: no torch or vllm); test_rl_*,
#                                      test_model, test_sampler, test_step, test_tpu_inference
#                                      (its push from a MaxText policy's mapped weights too),
#                                      test_maxtext_mapping, the MaxText tests below (mapping
#                                      against MaxText's own model, logits parity with the
#                                      native model, two loop steps with model.impl=maxtext)
#                                      and three loop tests of test_train; .ci/run calls it
#                                      after the main suite
#   scripts/test_tpu_pins.sh --full    the seed's pairing itself: grpo_jax[test,tpu-maxtext]
#                                      (vllm-tpu, tpu-inference, maxtext; torch, ray, ...: 11 GB,
#                                      7-20 min, mostly download), so test_tpu_inference.py also
#                                      checks the mapping against tpu-inference's own model
#                                      classes and loaders
# Tests whose packages a mode does not install skip with the reason. Extra arguments go to
# pytest (e.g. -k kl). Exit code: pytest's (5, nothing collected, fails).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODE=default
if [ "${1:-}" = "--full" ] || [ "${1:-}" = "--ci" ]; then
  MODE="${1#--}"
  shift
fi
VENV="${VENV:-$ROOT/.venv-tpupins}"
source "$ROOT/scripts/_env.sh"
make_venv
PINS="$ROOT/requirements/tpu-pins.txt"
if [ "$MODE" = full ]; then
  echo "[grpo_jax] installing grpo_jax[test,tpu-maxtext] on tpu-inference's pins into $VENV"
  CONSTRAINTS="$PINS" pip_install -e "$ROOT[test,tpu-maxtext]"
else
  extra=test,maxtext
  if [ "$MODE" = ci ]; then extra=test-core,maxtext; fi
  echo "[grpo_jax] installing grpo_jax[$extra] on tpu-inference's pins into $VENV"
  cons="$(mktemp)"
  trap 'rm -f "$cons"' EXIT
  # The tested versions, except the ones tpu-inference pins otherwise.
  grep -viE '^(jax|jaxlib|libtpu|flax|qwix)==' "$ROOT/requirements/constraints.txt" > "$cons"
  cat "$PINS" >> "$cons"
  CONSTRAINTS="$cons" pip_install -r "$PINS" -e "$ROOT[$extra]"
fi
check_pins "$PINS" "tpu-inference's pins"
cd "$ROOT"
TESTS=(tests/rl/test_rl_*.py tests/models/test_model.py tests/rollout/test_sampler.py tests/rl/test_step.py
       tests/rollout/test_tpu_inference.py tests/models/test_maxtext_mapping.py)
if [ "$MODE" = ci ]; then
  # The loop on the pins: main end to end (eval, checkpoint, summary), and the steady-state
  # step with every optional path under the transfer guard (JAX-internal hooks).
  TESTS+=(tests/test_train.py::test_entry_point_writes_events_checkpoint_and_summary
          tests/test_train.py::test_emulated_guard_catches_an_implicit_read
          "tests/test_train.py::test_steady_state_steps_touch_the_host_only_on_purpose[overrides1]")
  # MaxText 0.2.5 on qwix 0.1.2 (models/maxtext/adapter.py's placeholders): its model code
  # imports, its parameters are exactly the mapped ones, its logits equal the native decoder's,
  # and the loop runs with it as the policy.
  TESTS+=(tests/models/test_maxtext.py::test_qwix_sparsity_modules_are_real_or_placeholders_that_say_why
          tests/models/test_maxtext.py::test_weight_mapping_round_trips_exactly
          tests/models/test_maxtext.py::test_same_weights_same_logits_as_native
          tests/models/test_maxtext.py::test_two_loop_steps_with_the_maxtext_policy)
else
  TESTS+=(tests/test_train.py tests/models/test_maxtext.py)
fi
set +e
# shellcheck disable=SC2046  # worker_args: "-n N --dist load" or nothing (scripts/_env.sh)
JAX_PLATFORMS=cpu "$VENV/bin/python" -m pytest -q -rs $(worker_args) "${TESTS[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests: the suite is missing or every test was deselected." >&2
fi
exit "$rc"
