#!/usr/bin/env bash
# Run the test suite on the CPU in both environments: bash scripts/test.sh [pytest args for the .venv run]
#   .venv         the whole suite (NeMo 2.7.3, megatron-core 0.16.1, transformers 4.57)
#   .venv-bridge  the Megatron-Bridge tests and our trainer / pack / export-hf / probe / eval tests on
#                 megatron-core 0.19.2 + transformers 5 (BRIDGE_TESTS below)
# NEMO_ANCHOR_SKIP_BRIDGE=1 skips the .venv-bridge run for quick local runs; CI (CI=true) always runs it.
# The exit status is non-zero when either run fails; the last line adds up both runs.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"

BRIDGE_TESTS=(
  tests/bridge
  tests/test_training.py tests/test_data_pack.py tests/test_data_tokenizer.py tests/test_export_hf.py
  tests/test_probe.py tests/test_eval_run.py tests/test_context_parallel.py
)
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT

run_pytest() {  # run_pytest NAME PYTHON ARGS...: the status of pytest, its output also in $LOGS/NAME.log
  local name="$1" python="$2"
  shift 2
  set +e
  "$python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$LOGS/$name.log"
  local status="${PIPESTATUS[0]}"
  set -e
  return "$status"
}

status=0
run_pytest venv python tests "$@" || status=1
if [ "${NEMO_ANCHOR_SKIP_BRIDGE:-0}" = 1 ] && [ "${CI:-false}" != true ]; then
  echo "[test] NEMO_ANCHOR_SKIP_BRIDGE=1: .venv-bridge not run"
else
  setup_bridge_env
  run_pytest venv-bridge .venv-bridge/bin/python "${BRIDGE_TESTS[@]}" || status=1
fi
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
