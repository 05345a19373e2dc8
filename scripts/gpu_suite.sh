#!/usr/bin/env bash
# The GPU suite, one command:  bash scripts/gpu_suite.sh [OUTPUT_DIR]   (default gpu_suite_out)
#
# On one H100 within 8 minutes, each part in its own process under its own time limit, so a crash, a
# hang or a missing package in one is recorded in the JSON and the others still run:
#   conformance  every attention backend that can run here, forward and backward, against the fp32
#                reference on real kernels (scripts/gpu_check.py --sections conformance --quick)
#   speed        attention TFLOP/s at 8K-128K: anchor per backend, intra_doc and full through the
#                backend auto picks, against dense full-causal SDPA in the same run
#   smollm2      SmolLM2-135M's shape on one GPU, anchor against full: tokens/s, MFU, HFU
#   cp2          a context-parallel-2 anchor run when two GPUs are visible
# then OUTPUT_DIR/gpu_suite.json and OUTPUT_DIR/gpu_suite.md (scripts/gpu_suite.py merges the parts).
# It installs nothing: packages the machine lacks (megatron-core for the training parts, FlashAttention-3/4,
# Transformer Engine) are reported as skipped. Without CUDA it says so in one line and exits 0.
# PYTHON picks the interpreter (default python3).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-gpu_suite_out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! reason=$("$PY" -c 'import sys, torch
from nemo_anchor.gpu_check import cuda_unavailable_reason
r = cuda_unavailable_reason()
print(r or "")
sys.exit(1 if r else 0)' 2>/dev/null); then
    echo "gpu_suite: skipped: ${reason:-torch does not import with $PY}"
    exit 0
fi

mkdir -p "$OUT"
started=$(date +%s)
run_part() {  # name, seconds, gpu_check arguments...
    local name=$1 limit=$2
    shift 2
    local begin=$(date +%s)
    timeout --kill-after=10 "$limit" "$PY" scripts/gpu_check.py --output "$OUT/$name" --sections "$@" \
        > "$OUT/$name.log" 2>&1
    echo "$? $(( $(date +%s) - begin )) $limit" > "$OUT/$name.rc"
    echo "gpu_suite: $name: exit $(cut -d' ' -f1 "$OUT/$name.rc") after $(( $(date +%s) - begin )) s"
}
run_part conformance 100 conformance --quick
run_part speed 200 speed --lengths 8192 32768 131072
run_part smollm2 110 smollm2
run_part cp2 60 cp2 --quick
"$PY" scripts/gpu_suite.py "$OUT" --started "$started"
