#!/usr/bin/env bash
# One-command GPU check of the compiled decode path (HFTarget(decode="compiled"): torch.compile,
# "reduce-overhead" = CUDA graphs per batch bucket). Needs a CUDA GPU and the package's dependencies
# in the active Python (a CUDA torch; the package itself is read from src/).
# 1. fp32 greedy, compiled vs transformers' path: plain decode, chain and tree verification, weights
#    changed in place after compiling; on a tiny model, then on SmolLM2-135M. Exits non-zero on a mismatch.
# 2. bf16 greedy decode tokens/s at batches 1, 8 and 32, transformers' path and the compiled one
#    alternately (medians of 3) -> $OUT_DIR/speed.json.
# MODEL=DIR RANDOM_WEIGHTS=1: SmolLM2's shapes from DIR/config.json with random weights, where its
# weights cannot be fetched (same kernels, same speed). Extra arguments go to both runs, e.g. --mode default.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
MODEL=${MODEL:-smollm2-135m}
OUT_DIR=${OUT_DIR:-runs/gpu_check_compiled}
RANDOM_ARGS=()
[ -n "${RANDOM_WEIGHTS:-}" ] && RANDOM_ARGS=(--random-weights)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
"$PYTHON" -m benchmarks.compiled_check --device cuda --model tiny-qwen2 "$@"
# One batch bucket for the check (3 graphs), one per timed batch for the speed table (3 more).
"$PYTHON" -m benchmarks.compiled_check --device cuda --model "$MODEL" "${RANDOM_ARGS[@]}" --batch-buckets 8 \
  --speed 1 8 32 --json "$OUT_DIR/speed.json" "$@"
