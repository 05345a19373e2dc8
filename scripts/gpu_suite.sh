#!/usr/bin/env bash
# The GPU suite, one command:  bash scripts/gpu_suite.sh [--cpu-smoke] [OUTPUT_DIR]   (default gpu_suite_out)
#
# Issue 35's measurements at our users' shapes, within 8 minutes on one H100: each part in its own process
# under its own time limit, all of them inside one budget of $GPU_SUITE_SECONDS (default 470 s), so a crash, a
# hang or a missing package in one is a FAIL row and the others still run. In this order:
#   preflight    every package the parts import (nemo_anchor.gpu_check.SUITE_PACKAGES): a missing one is a
#                FAILURE naming it and where the lent machine gets it; the parts still run
#   conformance  every attention backend that runs here against the fp32 reference, forward and backward; then
#                issue 45's paths, a PASS/FAIL row each: the anchor merge that runs (FAIL: the torch fallback on
#                CUDA), a deterministic backward on auto (bitwise-equal gradients twice), Megatron's plain
#                PackedSeqParams through AnchorCoreAttention against the fp32 reference, no host sync in an
#                anchor forward on a prebuilt layout (the last needs CUDA, as does judging the first: SKIP on the CPU)
#   smollm2      SmolLM2-135M's shape at 8K: anchor, full, intra_doc (each on auto's best; on the anchor's
#                kernel family too where auto chose another), and the anchor on the previous K/V-copy path
#                (NEMO_ANCHOR_ANCHOR_PATH=kv_copy): tokens/s, MFU, HFU, peak memory
#   previous     anchor, full and intra_doc at 8K on the older source tree in $PREVIOUS_TREE (default .previous)
#   speed        attention kernels, fwd and fwd+bwd TFLOP/s, at 32K, 64K and 128K
#   llama8b_32k  Llama-3-8B's layer shape with as many layers as the memory planner fits this GPU, the planner's
#   llama8b_64k  recompute, at 32K and 64K: the same runs as smollm2
#   cp2          a context-parallel-2 anchor run when two GPUs are visible (up to 60 s more)
# then scripts/gpu_suite.py merges them into OUTPUT_DIR/gpu_suite.json, gpu_suite.md and results.md, with
# issue 35's targets as PASS/FAIL rows (results.md: the GPU's name and date, ready to paste into docs/results.md
# and the README's GPU table). Exit 1 when a part failed. Training: Megatron's GPT through the trainer's engine
# (scripts/bench_train.py), bf16. Without CUDA it says so in one line and exits 0. PYTHON picks the interpreter.
#
# --cpu-smoke runs every part end to end on the CPU at toy sizes (the tiny model at 256-512 tokens, planned for
# an 80 GB GPU; 256-token kernels): the plumbing (imports, JSON, merge, targets, the previous tree), no numbers.
# The parts that run smollm2's code again on another tree or shape run fewer types there: the previous tree and
# llama8b_32k the anchor, llama8b_64k the anchor and full (the targets only that shape is judged on).
#
# On the lent GPU machine (device tool `run`, from the repo root), after, on the CPU machine:
#   bash ../shared/gpu/fetch_wheels.sh /tmp/gpu-wheels .      # .whl (megatron-core, omegaconf, ...), .whl_a, .whl_b
#   cp ../shared/gpu/fa4_stage1.sh .whl_a/ && cp ../shared/gpu/fa4_stage2.sh .whl_b/
#   rm -rf .previous && mkdir .previous && git archive ebc4ccd nemo_anchor | tar -x -C .previous \
#       && echo ebc4ccd > .previous/COMMIT                      # the tree to compare with (git-ignored)
# call 1: carry [".whl_a"], timeout_s 120:
#   bash .whl_a/fa4_stage1.sh
# call 2, at once (the machine keeps stage 1's half for 30 s): carry [".whl", ".whl_b", ".previous"], timeout_s 600:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl;
#   export PYTHONPATH=/tmp/site; . .whl_b/fa4_stage2.sh; bash scripts/gpu_suite.sh /tmp/suite > /tmp/suite.log 2>&1; rc=$?;
#   cp /tmp/suite/gpu_suite.md /tmp/suite/results.md /tmp/suite/gpu_suite.json $OUT/; tar -czf $OUT/suite.tgz
#   -C /tmp suite suite.log; tail -c 9000 /tmp/suite/gpu_suite.md; exit $rc
# (without FlashAttention-4, one call: carry [".whl", ".previous"] and begin with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   && export PYTHONPATH=/tmp/site; ...)
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SMOKE=0
OUT=
for arg in "$@"; do  # a mistyped option would otherwise be taken for OUTPUT_DIR and run nothing it was asked to
    case $arg in
        --cpu-smoke) SMOKE=1 ;;
        -*) echo "gpu_suite: error: unknown option $arg (usage: bash scripts/gpu_suite.sh [--cpu-smoke] [OUTPUT_DIR])" >&2
            exit 2 ;;
        *) [ -n "$OUT" ] && { echo "gpu_suite: error: a second OUTPUT_DIR $arg (the first: $OUT)" >&2; exit 2; }
           OUT=$arg ;;
    esac
done
OUT=${OUT:-gpu_suite_out}
PREVIOUS=${PREVIOUS_TREE:-.previous}
SCALE=1  # of every time limit: the toy sizes of --cpu-smoke take longer on a small CPU than the real ones on a GPU
[ $SMOKE = 1 ] && SCALE=10
BUDGET=${GPU_SUITE_SECONDS:-$((470 * SCALE))}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PY OUT

if [ $SMOKE = 0 ] && ! reason=$("$PY" -c 'import sys, torch
from nemo_anchor.gpu_check import cuda_unavailable_reason
r = cuda_unavailable_reason()
print(r or "")
sys.exit(1 if r else 0)' 2>/dev/null); then
    echo "gpu_suite: skipped: ${reason:-torch does not import with $PY}"
    exit 0
fi

mkdir -p "$OUT"
started=$(date +%s)
PARTS_AFTER=8  # parts still to run after the current one; each keeps 10 s of the budget
run_part() {  # name, seconds, command...: the part's limit is its own or what the budget leaves, the smaller
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    PARTS_AFTER=$((PARTS_AFTER - 1))
    local begin=$(date +%s)
    local left=$((BUDGET - (begin - started) - 10 * PARTS_AFTER))
    [ $left -lt $limit ] && limit=$left
    [ $limit -lt 5 ] && limit=5
    DEADLINE=$((limit - 8)) timeout --kill-after=10 "$limit" bash -c '"$@"' part "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    echo "$code $(( $(date +%s) - begin )) $limit" > "$OUT/$name.rc"
    echo "gpu_suite: $name: exit $code after $(( $(date +%s) - begin )) s (limit $limit s)"
    [ $code = 0 ] || grep -h "FAILED\|FAIL:" "$OUT/$name.log" | head -5  # say it here, not only in the log
}
check() {  # part name, then scripts/gpu_check.py arguments
    local name=$1
    shift
    "$PY" scripts/gpu_check.py --output "$OUT/$name" "$@"
}
model() {  # part name, then scripts/bench_train.py arguments; stops starting runs before the part's limit
    local name=$1
    shift
    "$PY" scripts/bench_train.py --json "$OUT/$name.json" --deadline "$DEADLINE" "$@"
}
export -f check model
GRID=(--kinds anchor intra_doc full)
CURRENT=(--anchor-paths merge kv_copy --same-family)
PREVIOUS_GRID=("${GRID[@]}")
GRID32K=("${GRID[@]}" "${CURRENT[@]}"); GRID64K=("${GRID[@]}" "${CURRENT[@]}")
if [ $SMOKE = 1 ]; then
    echo "gpu_suite: --cpu-smoke: every part on the CPU at toy sizes; the numbers mean nothing"
    SMOKE_MODEL=(--model tiny --mean-doc 64 --gpu-memory 80 --precision bf16 --steps 1 --warmup 0)
    KERNELS=(--cpu-smoke --lengths 256 --repeats 1 --mean-doc 64)
    SMOLLM2=("${SMOKE_MODEL[@]}" --lengths 256)
    LLAMA8B=("${SMOKE_MODEL[@]}" --layers auto)
    L32K=(--lengths 256); L64K=(--lengths 512)
    STEPS32K=(); STEPS64K=()
    CONFORMANCE=(--cpu-smoke)
    CP2=(--cpu-smoke)
    PREVIOUS_GRID=(--kinds anchor)
    GRID32K=(--kinds anchor); GRID64K=(--kinds anchor full)
else
    SMOLLM2=(--model smollm2 --lengths 8192 --mean-doc 4096 --steps 5 --warmup 2)
    KERNELS=(--quick --lengths 32768 65536 131072 --repeats 5)
    LLAMA8B=(--model llama3-8b-layers --layers auto --mean-doc 4096)
    L32K=(--lengths 32768); L64K=(--lengths 65536)
    STEPS32K=(--steps 2 --warmup 1); STEPS64K=(--steps 1 --warmup 1)
    CONFORMANCE=(--quick)
    CP2=(--quick)
fi
run_part preflight 30 "$PY" scripts/gpu_suite.py --preflight "$OUT"
run_part conformance 90 check conformance --sections conformance paths "${CONFORMANCE[@]}"
run_part smollm2 80 model smollm2 "${SMOLLM2[@]}" "${GRID[@]}" "${CURRENT[@]}"
run_part previous 60 model previous "${SMOLLM2[@]}" "${PREVIOUS_GRID[@]}" --tree "$PREVIOUS"
run_part speed 75 check speed --sections speed "${KERNELS[@]}"
run_part llama8b_32k 110 model llama8b_32k "${LLAMA8B[@]}" "${L32K[@]}" "${STEPS32K[@]}" "${GRID32K[@]}"
run_part llama8b_64k 130 model llama8b_64k "${LLAMA8B[@]}" "${L64K[@]}" "${STEPS64K[@]}" "${GRID64K[@]}"
run_part cp2 60 check cp2 --sections cp2 "${CP2[@]}"
"$PY" scripts/gpu_suite.py "$OUT" --started "$started"
