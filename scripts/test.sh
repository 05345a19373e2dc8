#!/usr/bin/env bash
# Run the test suite on the CPU in both environments: bash scripts/test.sh [pytest args for the .venv run]
#   .venv         the whole suite (NeMo 2.7.3, megatron-core 0.16.1, transformers 4.57)
#   .venv-bridge  the Megatron-Bridge tests and our trainer / pack / export-hf / probe / eval tests on
#                 megatron-core 0.19.2 + transformers 5 (BRIDGE_TESTS below)
# NEMO_ANCHOR_SKIP_BRIDGE=1 skips the .venv-bridge run for quick local runs; CI (CI=true) always runs it.
# The two runs go side by side (see docs/testing.md for what that saves); the .venv-bridge run's output
# follows the .venv run's. Each run ends with its 15 slowest tests.
# The exit status is non-zero when either run fails; the last line adds up both runs.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"

BRIDGE_TESTS=(
  tests/bridge
  tests/test_training.py tests/test_data_pack.py tests/test_data_tokenizer.py tests/test_export_hf.py
  tests/test_probe.py tests/test_eval_run.py tests/test_context_parallel.py
)
LOGS="$(mktemp -d)"
bridge_pid=""
# the .venv-bridge run has a session of its own: stopped with all its processes if this script stops first
trap '[ -z "$bridge_pid" ] || kill -TERM -- "-$bridge_pid" 2>/dev/null; rm -rf "$LOGS"' EXIT

pytest_args=(-q -p no:cacheprovider --durations=15)
status=0
if [ "${NEMO_ANCHOR_SKIP_BRIDGE:-0}" = 1 ] && [ "${CI:-false}" != true ]; then
  echo "[test] NEMO_ANCHOR_SKIP_BRIDGE=1: .venv-bridge not run"
else
  setup_bridge_env
  setsid .venv-bridge/bin/python -m pytest "${pytest_args[@]}" "${BRIDGE_TESTS[@]}" > "$LOGS/venv-bridge.log" 2>&1 \
    < /dev/null &
  bridge_pid=$!
  echo "[test] .venv-bridge: running beside the .venv run; its output follows that run's"
fi
set +e
python -m pytest "${pytest_args[@]}" tests "$@" 2>&1 | tee "$LOGS/venv.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ -n "$bridge_pid" ]; then
  wait "$bridge_pid" || status=1
  bridge_pid=""
  echo "[test] .venv-bridge:"
  cat "$LOGS/venv-bridge.log"
fi
set -e
python - "$LOGS" <<'PY'
import pathlib, re, sys

totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
for log in sorted(pathlib.Path(sys.argv[1]).glob("*.log")):
    lines = [line for line in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    summary = lines[-1].strip("= ") if lines else "no pytest summary (the run did not finish)"
    print(f"[test] .{log.stem}: {summary}")
    for key in totals:
        totals[key] += sum(int(n) for n in re.findall(rf"(\d+) {key}", lines[-1])) if lines else 0
print(f"total: {totals['passed']} passed, {totals['failed'] + totals['error']} failed, {totals['skipped']} skipped")
PY
exit "$status"
