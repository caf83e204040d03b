"""GPU check of the vLLM rollout backend: ``python -m tlt_lightning.rollout.vllm_check [--out summary.json]``.

Needs a CUDA GPU and the ``vllm`` extra (``scripts/gpu_check_vllm.sh`` runs it). In a few minutes:

1. loads the policy (default SmolLM2-135M) on the CPU, saves it with ``save_pretrained`` and exports
   an EAGLE-3 drafter for it (a fresh random one unless ``--drafter CKPT`` names a ``save_drafter``
   checkpoint: speculation stays lossless, only acceptance suffers);
2. greedy rollouts of a few prompts with our CPU :class:`~tlt_lightning.rollout.RolloutEngine`, the
   reference;
3. the vLLM backend without speculation, then with the drafter: greedy responses must equal the
   reference, except where they part at a near tie of the reference logits (GPU and CPU round
   differently); sampled rollouts must repeat for the same generator and carry finite
   log-probabilities; with the drafter, vLLM must actually draft, for greedy and for sampled
   requests (which ask for log-probabilities);
4. refreshes the speculative engine once with perturbed policy weights (and the drafter), checks it
   now follows the perturbed CPU reference, then swaps in another random drafter alone: greedy
   output must not change (speculation is lossless), the version must count up.

Prints (and writes with ``--out``) a JSON summary; exit code 0 when every check passed, 1 when one
failed, 2 when vLLM or a GPU is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.rollout.types import Rollout, RolloutConfig

__all__ = ["greedy_agreement", "main"]

QUESTIONS = (
    "What is 17 + 25? Answer briefly.",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "Count from one to ten in words.",
)


def greedy_agreement(
    reference: list[Rollout], other: list[Rollout], model: torch.nn.Module, tie_tolerance: float
) -> dict[str, Any]:
    """Compare two sets of greedy rollouts of the same prompts.

    A pair agrees when the tokens are equal, or when they part at a position where the reference
    model's logits of the two tokens differ by at most ``tie_tolerance`` (a near tie that another
    device's rounding may break the other way).

    Returns:
        ``{"ok", "exact", "prompts", "details": [{"prefix", "length", "gap"}]}``.
    """
    details, ok, exact = [], True, 0
    for ref, got in zip(reference, other, strict=True):
        r, g = ref.token_ids.tolist(), got.token_ids.tolist()
        k = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
        entry: dict[str, Any] = {"prefix": k, "length": len(r), "other_length": len(g), "gap": None}
        if r == g:
            exact += 1
        elif k < min(len(r), len(g)):
            ids = torch.cat([ref.prompt_ids, ref.token_ids[:k]])[None]
            with torch.no_grad():
                logits = model(input_ids=ids.to(next(model.parameters()).device)).logits[0, -1].float()
            entry["gap"] = float(logits[r[k]] - logits[g[k]])
            ok &= entry["gap"] <= tie_tolerance
        else:
            ok = False  # one stopped early without a differing token
        details.append(entry)
    return {"ok": bool(ok), "exact": exact, "prompts": len(details), "details": details}


def _prompts(loaded: Any, n: int) -> list[list[int]]:
    tok = loaded.tokenizer
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, loaded.model.config.vocab_size, (8 + 3 * i,), generator=g).tolist() for i in range(n)]
    out = []
    for q in (QUESTIONS * n)[:n]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def _perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.float().std().to(p.dtype))


def _tokens(result: Any) -> list[list[int]]:
    return [r.token_ids.tolist() for r in result.rollouts]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tlt_lightning.rollout.vllm_check", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name or HF directory of the policy")
    p.add_argument("--drafter", default=None, help="a save_drafter checkpoint (default: a fresh random drafter)")
    p.add_argument("--kind", default="eagle3", choices=("eagle1", "eagle3"), help="drafter kind when none is given")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="vLLM engine dtype")
    p.add_argument("--tie-tolerance", type=float, default=None, help="logit gap of a near tie (default by dtype)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    p.add_argument("--workdir", default=None, help="where the served copies go (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the JSON summary here too")
    return p


def _run(args: argparse.Namespace, summary: dict[str, Any], workdir: Path) -> None:
    from tlt_lightning.drafter import Drafter, DrafterConfig, export_drafter_model, load_drafter
    from tlt_lightning.models import HFTarget, load_model
    from tlt_lightning.rollout.engine import RolloutEngine
    from tlt_lightning.rollout.vllm_backend import VLLMBackendConfig, VLLMRolloutBackend

    phases = summary["phases"]
    tol = args.tie_tolerance if args.tie_tolerance is not None else (0.05 if args.dtype == "float32" else 0.5)
    summary["tie_tolerance"] = tol

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype="float32")
    policy = loaded.model
    target = HFTarget(policy)
    if args.drafter:
        drafter = load_drafter(args.drafter, target)
    else:
        torch.manual_seed(0)
        drafter = Drafter(DrafterConfig.from_target(target, kind=args.kind), target)
    prompts = _prompts(loaded, args.prompts)
    policy.save_pretrained(workdir / "target")
    export_drafter_model(drafter, workdir / "drafter", dtype="float32")
    greedy = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    sampled = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95)
    reference = RolloutEngine(target, greedy).generate(prompts)
    phases["setup"] = {"ok": True, "seconds": round(time.perf_counter() - t0, 2), "prompt_lengths": [len(p) for p in prompts]}

    def build(drafter_dir: Path | None) -> VLLMRolloutBackend:
        config = VLLMBackendConfig(
            model=str(workdir / "target"), drafter=str(drafter_dir) if drafter_dir else None,
            num_speculative_tokens=args.k, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=True, max_model_len=min(2048, target.info.max_positions),
        )
        return VLLMRolloutBackend(config, greedy)

    def rollouts(backend: VLLMRolloutBackend) -> dict[str, Any]:
        backend.config = greedy
        result = backend.generate(prompts)
        backend.config = sampled
        a = backend.generate(prompts, generator=torch.Generator().manual_seed(1))
        b = backend.generate(prompts, generator=torch.Generator().manual_seed(1))
        stats = result.stats
        return {
            "greedy_vs_cpu": greedy_agreement(reference.rollouts, result.rollouts, policy, tol),
            "sampled_repeats": _tokens(a) == _tokens(b),
            "logprobs_finite": bool(all(torch.isfinite(r.logprobs).all() and (r.logprobs <= 0).all() for r in a.rollouts)),
            "tokens_per_s": round(stats.tokens_per_s, 1),
            "weights_version": stats.weights_version,
            "spec": asdict(stats.spec) | {"mean_accept_length": round(stats.mean_accept_length, 3)},
            "sampled_spec": asdict(a.stats.spec),  # sampled requests ask for log-probabilities
            "_result": result,
        }

    t0 = time.perf_counter()
    plain = build(None)
    phase = rollouts(plain)
    plain_tokens = _tokens(phase.pop("_result"))
    phase["ok"] = phase["greedy_vs_cpu"]["ok"] and phase["sampled_repeats"] and phase["logprobs_finite"]
    phase["seconds"] = round(time.perf_counter() - t0, 2)
    phases["plain"] = phase
    del plain

    t0 = time.perf_counter()
    spec = build(workdir / "drafter")
    phase = rollouts(spec)
    spec_result = phase.pop("_result")
    phase["same_as_plain"] = _tokens(spec_result) == plain_tokens
    phase["drafted"] = phase["spec"]["drafts"] > 0 and phase["sampled_spec"]["drafts"] > 0
    phase["ok"] = (
        phase["greedy_vs_cpu"]["ok"] and phase["sampled_repeats"] and phase["logprobs_finite"] and phase["drafted"]
    )
    phase["seconds"] = round(time.perf_counter() - t0, 2)
    phases["speculative"] = phase

    t0 = time.perf_counter()
    _perturb(policy, seed=1)
    perturbed = RolloutEngine(target, greedy).generate(prompts)
    version = spec.refresh_weights(target=policy, drafter=drafter)
    spec.config = greedy
    after = spec.generate(prompts)
    phases["refresh"] = {
        "version": version,
        "result_version": after.stats.weights_version,
        "greedy_vs_perturbed_cpu": greedy_agreement(perturbed.rollouts, after.rollouts, policy, tol),
        "outputs_changed": _tokens(after) != _tokens(spec_result),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    phases["refresh"]["ok"] = (
        version == 1 and after.stats.weights_version == 1 and phases["refresh"]["greedy_vs_perturbed_cpu"]["ok"]
    )

    t0 = time.perf_counter()
    torch.manual_seed(1)
    other = Drafter(drafter.config, target)
    version = spec.refresh_weights(drafter=other)
    again = spec.generate(prompts)
    phases["drafter_refresh"] = {
        "version": version,
        "greedy_unchanged": _tokens(again) == _tokens(after),
        "greedy_vs_perturbed_cpu": greedy_agreement(perturbed.rollouts, again.rollouts, policy, tol),
        "spec": asdict(again.stats.spec),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    phases["drafter_refresh"]["ok"] = version == 2 and phases["drafter_refresh"]["greedy_vs_perturbed_cpu"]["ok"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    summary: dict[str, Any] = {"ok": False, "phases": {}, "args": vars(args)}
    code = 1
    try:
        from tlt_lightning.rollout.vllm_backend import require_vllm

        vllm = require_vllm()
        summary["vllm"] = getattr(vllm, "__version__", "unknown")
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: the vLLM backend check needs a GPU")
        summary["device"] = torch.cuda.get_device_name(0)
    except (ImportError, RuntimeError) as err:
        summary["error"] = str(err)
        code = 2
    else:
        with tempfile.TemporaryDirectory(prefix="tlt-vllm-check-") as tmp:
            workdir = Path(args.workdir or tmp)
            try:
                _run(args, summary, workdir)
                summary["ok"] = all(p.get("ok") for p in summary["phases"].values()) and len(summary["phases"]) == 5
                code = 0 if summary["ok"] else 1
            except Exception as err:  # noqa: BLE001 (report any failure in the summary, then fail)
                summary["error"] = f"{type(err).__name__}: {err}"
                summary["traceback"] = traceback.format_exc(limit=8)
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
