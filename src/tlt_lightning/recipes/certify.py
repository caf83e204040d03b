"""``tlt-lightning certify``: certify that our engine's rollouts (plain or speculative) are lossless.

Loads a registry model, a drafter checkpoint (or a random drafter: exactness does not depend on the
drafter's quality, only how much of the speculative path is exercised) and a task's prompts, runs
:func:`~tlt_lightning.certify.certify` once per arm and writes ``ARM/certificate.json`` and
``ARM/certificate.png`` under ``--out``. Exit status 1 when an arm is not lossless.

``--backend vllm`` draws the samples through :class:`~tlt_lightning.vllm.VLLMRolloutBackend` instead
(plain, or EAGLE speculation with a chain arm's length as ``num_speculative_tokens``), from vLLM's own
environment on a CPU (``.venv-vllm/bin/python -m tlt_lightning.cli certify --backend vllm ...``); the
exact laws still come from the target in this process. vLLM's first token of a site comes from its
prefill: use ``--depth >= 2`` so that its decode steps are tested.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from tlt_lightning.certify import CertifyConfig, certify, write_certificate
from tlt_lightning.drafter import Drafter, DrafterConfig, load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rl import TaskConfig, TaskDataset
from tlt_lightning.rollout import RolloutConfig
from tlt_lightning.speculative import DraftSpec, arm_key, parse_arm

__all__ = ["run"]


def prompts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """The task's first ``--num-prompts`` prompts (a tiny random model, which has no tokenizer: fixed ids)."""
    if tokenizer is None:
        return [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(args.num_prompts)]
    tasks = TaskDataset(TaskConfig(name=args.task, size=args.num_prompts, seed=args.seed), tokenizer)
    return [list(tasks[i].input_ids) for i in range(len(tasks))]


def vllm_backend(args: argparse.Namespace, model: Any, drafter: Any, arm: DraftSpec | None, out: Path) -> Any:
    """A vLLM engine serving ``model`` (and ``drafter`` for a chain ``arm``), sampling ``--depth`` tokens."""
    from tlt_lightning.vllm import VLLMRolloutBackend

    if arm is not None and (arm.topk > 1 or arm.sampled or arm.min_confidence > 0):
        raise ValueError(f"--backend vllm drafts plain chains (EAGLE): arm {arm_key(arm)} is not one")
    rollout = RolloutConfig(
        max_new_tokens=args.depth, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    return VLLMRolloutBackend.from_policy(
        model,
        out / "vllm",
        drafter=drafter if arm is not None else None,
        rollout=rollout,
        num_speculative_tokens=arm.num_steps if arm is not None else 1,
        dtype="float32",
        seed=args.seed,
        enforce_eager=True,
        gpu_memory_utilization=0.2,  # on a CPU: of the NUMA node's memory, for the KV cache
        max_model_len=1024,
        cpu_sampled_speculation=True,  # the point is to measure it
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = CertifyConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        rows=args.rows,
        depth=args.depth,
        positions=tuple(args.positions),
        alpha=args.alpha,
        power=args.power,
        max_bins=args.max_bins,
        chunk=args.chunk,
        seed=args.seed,
    )
    arms = [parse_arm(a) for a in args.arm]
    loaded = load_model(args.model)
    target = HFTarget(loaded.model)
    drafter = None
    if any(a is not None for a in arms):
        if args.drafter in (None, "random"):
            torch.manual_seed(args.seed)
            drafter = Drafter(DrafterConfig.from_target(target), target).eval()
        else:
            drafter = load_drafter(args.drafter, target).eval()
    batch = prompts(args, loaded.tokenizer)
    decode = (lambda ids: loaded.tokenizer.decode(ids)) if loaded.tokenizer is not None else None
    results, out = {}, Path(args.out)
    for arm in arms:
        if args.backend == "vllm":
            backend = vllm_backend(args, loaded.model, drafter, arm, out / arm_key(arm).replace("/", "-"))
            cert = certify(target, batch, config, backend=backend)
            cert.info.update(backend="vllm", arm=arm_key(arm))
        else:
            cert = certify(target, batch, config, drafter=drafter, arm=arm)
        cert.info.update(
            model=args.model, drafter=args.drafter if arm is not None else None, command=args.argv
        )
        path = write_certificate(cert, out / arm_key(arm).replace("/", "-"))
        print(f"[{arm_key(arm)}] {cert.summary(decode)}\n  -> {path}")
        results[arm_key(arm)] = cert.to_dict()
    if not all(r["lossless"] for r in results.values()):
        sys.exit(1)
    return results
