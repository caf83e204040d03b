"""Run in vLLM's Python: serve an ``export-drafter --from-fit`` folder as it is, greedy, with and without
its drafter, and print one line ``RESULT <json>`` (vLLM prints its own lines too): per run the method,
token counts, drafts and whether the tokens agree.

    python tests/recipes/vllm_serve_export.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> dict:
    from transformers import AutoTokenizer

    from tlt_lightning.rollout import RolloutConfig
    from tlt_lightning.vllm.backend import VLLMBackendConfig, VLLMRolloutBackend

    tokenizer = AutoTokenizer.from_pretrained(out / "target")  # the export's own tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in ("What is 17 + 25?", "Name three primary colors.")
    ]
    tokens, result = {}, {}
    for name, drafter in (("speculative", str(out / "drafter")), ("plain", None)):
        config = VLLMBackendConfig(
            model=str(out / "target"),
            drafter=drafter,
            num_speculative_tokens=3,
            dtype="float32",
            gpu_memory_utilization=0.2,
            max_model_len=512,
            enforce_eager=True,
        )
        backend = VLLMRolloutBackend(config, RolloutConfig(max_new_tokens=16, temperature=0.0))
        rollouts = backend.generate(prompts)
        tokens[name] = [r.token_ids.tolist() for r in rollouts.rollouts]
        result[name] = {
            "method": backend.method,
            "lengths": [len(t) for t in tokens[name]],
            "drafts": rollouts.stats.spec.drafts if drafter else 0,
        }
        del backend
    result["equal"] = tokens["speculative"] == tokens["plain"]
    return result


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: the guard is needed
    print("RESULT " + json.dumps(main(Path(sys.argv[1]))), flush=True)
