#!/usr/bin/env bash
# Run the test suite on the CPU in both environments: bash scripts/test.sh [pytest args for the .venv lanes]
#   .venv         the whole suite (NeMo 2.7.3, megatron-core 0.16.1, transformers 4.57)
#   .venv-bridge  the Megatron-Bridge tests and our trainer / pack / export-hf / probe / eval tests on
#                 megatron-core 0.19.2 + transformers 5 (BRIDGE_TESTS below)
# NEMO_ANCHOR_SKIP_BRIDGE=1 skips the .venv-bridge lane for quick local runs; CI (CI=true) always runs it.
# Seven pytest lanes go side by side on the two cores, three of them mostly waiting on Slurm (docs/testing.md says
# why and what each costs); the first prints live, the others' outputs follow it. Each ends with its 15 slowest tests.
# The exit status is non-zero when any lane fails; the last line adds them up.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"

BRIDGE_TESTS=(
  tests/bridge
  tests/test_training.py tests/test_data_pack.py tests/test_data_tokenizer.py tests/test_export_hf.py
  tests/test_probe.py tests/test_eval_run.py
  # Megatron's own THD RoPE on megatron-core 0.19; context parallelism itself runs through Bridge's pretrain()
  # there (a2a: tests/bridge/test_bridge.py, all_gather: tests/bridge/test_bridge_parallel.py)
  tests/test_context_parallel.py::test_every_rank_gets_its_tokens_positions_from_megatron_thd_rope
  tests/test_rope_params.py tests/test_backend_signatures.py tests/test_attention_backend_log.py
  tests/test_anchor_key_triton.py  # Triton's interpreter: triton is in .venv-bridge only
  # the stop on SIGTERM on megatron-core 0.19: tests/bridge/test_bridge_signals.py
  --deselect tests/test_training.py::test_kill_and_sigterm_leave_a_loadable_checkpoint
)
# NeMo's own CLI in new processes (each starts NeMo: 20 s of imports)
NEMO_RUN_TESTS=(tests/test_nemo_run.py)
# several-rank launches, signals to torchrun, the GPU suite's CPU smoke, the GPU-expected doors' new processes: the
# other half of .venv's CPU seconds (docs/testing.md)
LAUNCH_TESTS=(
  tests/test_parallel_training.py tests/test_context_parallel.py tests/test_cluster.py tests/test_stop_save.py
  tests/test_gpu_suite.py tests/test_gpu_expected.py
)
# Each front door's Slurm script on a real Slurm cluster on this machine (scripts/slurm/local_cluster.sh): mostly
# waiting on the scheduler, so lanes of their own, started first, each with a cluster of its own (with_cluster below),
# side by side: train.sbatch, NeMo-Run's SlurmExecutor (.venv), bridge.sbatch (.venv-bridge)
# The two .venv ones also take tests that would make the launch lane the last to end: the hung-rank tests (mostly
# waiting too: timeouts, heartbeats) and the million-token window (one long process)
SLURM_TESTS=(tests/test_slurm_cluster.py tests/test_million_token_window.py)
SLURM_NEMO_TESTS=(tests/test_slurm_nemo.py tests/test_hung_rank.py)
SLURM_BRIDGE_TESTS=(tests/bridge/test_bridge_slurm.py)
# One thread per process: four lanes (and their launches) already share the two cores, and torch's OpenMP threads
# spin while they wait for a core: four 2-thread processes took 8x the CPU of four 1-thread ones (docs/testing.md).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
LOGS="$(mktemp -d)"
background=()
# Debian packages some tests need, installed here when root and missing; without them (or root) those tests skip,
# saying why: slurm-wlm and munge for the local Slurm cluster of tests/test_slurm_*.py
# (scripts/slurm/local_cluster.sh), strace for the publish order of tests/test_checkpoint_durability.py
if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null && \
    ! { command -v slurmctld && command -v munged && command -v strace; } > /dev/null; then
  echo "[test] installing slurm-wlm, munge and strace"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge strace > "$LOGS/apt.log" 2>&1 \
    || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge strace) >> "$LOGS/apt.log" 2>&1 \
    || { echo "[test] apt-get could not install slurm-wlm munge strace: their tests skip"; tail -3 "$LOGS/apt.log"; }
fi
LOCAL_CLUSTER="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/slurm/local_cluster.sh"
# the background lanes have sessions of their own: stopped with all their processes if this script stops first;
# the Slurm clusters are brought down even if their lanes could not
trap 'for pid in "${background[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
      for cluster in "$LOGS"/slurm-*; do [ ! -d "$cluster" ] || bash "$LOCAL_CLUSTER" down "$cluster"; done
      rm -rf "$LOGS"' EXIT

pytest_args=(-q -p no:cacheprovider --durations=15)
in_background() {  # in_background NAME PYTHON ARGS...: pytest in its own session, output in $LOGS/NAME.log
  local name="$1" python="$2"
  shift 2
  setsid "$python" -m pytest "${pytest_args[@]}" "$@" > "$LOGS/$name.log" 2>&1 < /dev/null &
  background+=("$!")
  echo "[test] $name: running in the background; its output follows"
}
with_cluster() {  # with_cluster N COMMAND...: COMMAND with local Slurm cluster N of its own (tests/conftest.py's
  local n="$1"    # slurm_cluster starts it in NEMO_ANCHOR_SLURM_DIR: its tag, /24 and port differ from the others')
  shift
  LOCAL_CLUSTER_TAG="c$n" LOCAL_CLUSTER_NET="10.77.$n" LOCAL_CLUSTER_PORT="$((16817 + 10 * n))" \
    NEMO_ANCHOR_SLURM_DIR="$LOGS/slurm-$n" "$@"
}

with_cluster 0 in_background venv-slurm python "${SLURM_TESTS[@]}" "$@"
with_cluster 1 in_background venv-slurm-nemo python "${SLURM_NEMO_TESTS[@]}" "$@"
if [ "${NEMO_ANCHOR_SKIP_BRIDGE:-0}" = 1 ] && [ "${CI:-false}" != true ]; then
  echo "[test] NEMO_ANCHOR_SKIP_BRIDGE=1: .venv-bridge not run"
else
  setup_bridge_env
  with_cluster 2 in_background venv-slurm-bridge .venv-bridge/bin/python "${SLURM_BRIDGE_TESTS[@]}"
  in_background venv-bridge .venv-bridge/bin/python "${BRIDGE_TESTS[@]}" "${SLURM_BRIDGE_TESTS[@]/#/--ignore=}"
fi
echo "[test] environments ready after ${SECONDS}s"
in_background venv-nemo-run python "${NEMO_RUN_TESTS[@]}" "$@"
in_background venv-launch python "${LAUNCH_TESTS[@]}" "$@"
# -k may leave one of these .venv lanes with no test: exit 5 is fine
venv_lanes=("${background[0]}" "${background[1]}" "${background[@]: -2}")
set +e
status=0
python -m pytest "${pytest_args[@]}" tests "${NEMO_RUN_TESTS[@]/#/--ignore=}" "${LAUNCH_TESTS[@]/#/--ignore=}" \
  "${SLURM_TESTS[@]/#/--ignore=}" "${SLURM_NEMO_TESTS[@]/#/--ignore=}" "${SLURM_BRIDGE_TESTS[@]/#/--ignore=}" "$@" \
  2>&1 | tee "$LOGS/venv.log"
code="${PIPESTATUS[0]}"
[ "$code" = 0 ] || { [ "$code" = 5 ] && [ $# -gt 0 ]; } || status=1
for pid in "${background[@]}"; do
  wait "$pid"
  code=$?
  [ "$code" = 0 ] || { [ "$code" = 5 ] && [[ " ${venv_lanes[*]} " == *" $pid "* ]]; } || status=1
done
background=()
for log in "$LOGS"/venv-*.log; do
  echo "[test] $(basename "$log" .log):"
  cat "$log"
done
set -e
python - "$LOGS" "$SECONDS" <<'PY'
import pathlib, re, sys

totals = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
for log in sorted(pathlib.Path(sys.argv[1]).glob("*.log")):
    lines = [line for line in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|error|deselected)", line)]
    summary = lines[-1].strip("= ") if lines else "no pytest summary (the run did not finish)"
    print(f"[test] .{log.stem}: {summary}")
    for key in totals:
        totals[key] += sum(int(n) for n in re.findall(rf"(\d+) {key}", lines[-1])) if lines else 0
print(f"[test] {sys.argv[2]}s in all, the environments included")
print(f"total: {totals['passed']} passed, {totals['failed'] + totals['error']} failed, {totals['skipped']} skipped")
PY
exit "$status"
