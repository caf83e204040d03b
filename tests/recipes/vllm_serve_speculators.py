"""Run in vLLM's Python: ``LLM(model=DRAFTER_DIR)`` as a vLLM user does with an EAGLE-3 export in the
``speculators`` format (the verifier and the speculative settings come from its ``config.json``), greedy
on token prompts, and print one line ``RESULT <json>``: the method vLLM picked, its verifier, the tokens
and the drafts.

    python tests/recipes/vllm_serve_speculators.py DRAFTER_DIR PROMPTS_JSON MAX_NEW_TOKENS
"""

from __future__ import annotations

import json
import sys


def main(drafter: str, prompts: list[list[int]], max_new_tokens: int) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=drafter,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        disable_log_stats=False,
    )
    spec = llm.llm_engine.vllm_config.speculative_config
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    drafts = sum(
        m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts" and hasattr(m, "value")
    )
    return {
        "method": spec.method if spec is not None else None,
        "verifier": llm.llm_engine.vllm_config.model_config.model,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "drafts": drafts,
    }


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is needed
    print("RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))), flush=True)
