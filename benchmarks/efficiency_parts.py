"""The three measurements of ``bench efficiency``: sampler, distill and qat (plots in :mod:`.efficiency`).

* ``sampler``: the same learner trained on the same token budget with batches drawn uniformly,
  by importance (a small proxy's loss, the proxy trained online on the chosen batches) and by
  RHO-LOSS (the online proxy's loss, or the learner's with ``--rho-learner``, minus the loss of a
  proxy trained on a held-out split). Every variant stops at the first step that reaches the
  budget of real (unpadded) training tokens; scoring and proxy training are not counted as
  training tokens but are in the wall time.
* ``distill``: a larger model briefly trained on the task is the teacher; the same student
  (same initialisation, same batches, same steps) learns with label CE only, CE + logits-only KD,
  and CE + KD + hidden-state losses at mapped layers (MSE on standardized states, raw MSE, cosine).
* ``qat``: a student distilled in fp32 for ``--steps``; then ``--qat-steps`` more steps either in
  fp32 (then: the unquantized model, and its post-training INT4 quantization) or under INT4 fake
  quantization (then converted to INT4): equal training for all three. ``--scratch`` adds the
  same three with one schedule over ``steps + qat-steps``, the QAT student under fake
  quantization from its first step (the source's "trained in INT4 from the start").
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import torch

from benchmarks.efficiency_data import (
    SFTData,
    collate,
    evaluate,
    lm_loss,
    make_model,
    optimizer_step,
    token_count,
    train_loop,
    uniform_batches,
)
from tlt_lightning.efficiency.distill import DistillConfig, HierarchicalDistillation, distill_step
from tlt_lightning.efficiency.sampler import (
    ImportanceSampler,
    ImportanceSamplerConfig,
    LossScorer,
    RhoLossScorer,
)
from tlt_lightning.efficiency.training import proxy_step

__all__ = ["DISTILL_VARIANTS", "QAT_VARIANTS", "run_distill", "run_qat", "run_sampler", "train_teacher"]

DISTILL_VARIANTS = ("ce", "logits-kd", "hierarchical-mse", "hierarchical-mse-raw", "hierarchical-cosine")
QAT_VARIANTS = ("fp32", "ptq", "qat", "scratch-fp32", "scratch-ptq", "scratch-qat")


def _params_m(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> dict[str, float]:
    return {"wall_s": time.perf_counter() - start[0], "cpu_s": time.process_time() - start[1]}


def _train_uniform(
    model: torch.nn.Module,
    data: list[dict[str, torch.Tensor]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[float]:
    batches = uniform_batches(data, batch_size, seed)
    return train_loop(
        model.parameters(), steps, lr, lambda _: lm_loss(model, collate([data[i] for i in next(batches)]))
    )


# ----------------------------------------------------------------------------------------- sampler
def _sampler_variant(
    name: str, args: argparse.Namespace, data: SFTData, holdout: torch.nn.Module, budget: int, seed: int
) -> dict[str, Any]:
    vocab = data.tokenizer.vocab_size
    learner = make_model(vocab, args.hidden, args.layers, seed)
    proxy = make_model(vocab, args.proxy_hidden, args.proxy_layers, seed + 1) if name != "uniform" else None
    if name == "importance":
        scorer: Any = LossScorer(proxy, data.train, collate)
    elif name == "rho":
        scorer = RhoLossScorer(learner if args.rho_learner else proxy, holdout, data.train, collate)
    else:
        scorer = None
    factor = 1 if scorer is None else args.candidate_factor
    config = ImportanceSamplerConfig(
        batch_size=args.batch_size,
        candidate_factor=factor,
        temperature=args.temperature,
        num_batches=10**9,
        seed=seed,
    )
    sampler = ImportanceSampler(len(data.train), scorer or (lambda idx: torch.zeros(len(idx))), config)
    batches = iter(sampler)
    opt = torch.optim.AdamW(learner.parameters(), lr=args.lr, weight_decay=0.0)
    proxy_opt = (
        torch.optim.AdamW(proxy.parameters(), lr=args.lr, weight_decay=0.0) if proxy is not None else None
    )
    milestones = [budget * (k + 1) / args.evals for k in range(args.evals)]
    tokens = steps = 0
    select_s = proxy_s = 0.0
    ops = torch.tensor([data.tokenizer.ids.get(c, -1) for c in "+-*/"])
    curve, selected_len, selected_ops = [], [], []
    start = _clock()
    while tokens < budget:
        t0 = time.perf_counter()
        indices = next(batches)
        select_s += time.perf_counter() - t0
        batch = collate([data.train[i] for i in indices])
        tokens += token_count(batch)
        steps += 1
        selected_len.append(float(batch["attention_mask"].sum(-1).float().mean()))
        prompt = batch["input_ids"].masked_fill(batch["labels"] != -100, -2)  # operators in the question
        selected_ops.append(float(torch.isin(prompt, ops).sum(-1).float().mean()))
        optimizer_step(opt, lm_loss(learner, batch), args.lr, min(tokens / budget, 1.0))
        if proxy is not None and proxy_opt is not None:
            t0 = time.perf_counter()
            proxy_step(proxy, proxy_opt, batch)
            proxy_s += time.perf_counter() - t0
        while milestones and tokens >= milestones[0]:
            milestones.pop(0)
            curve.append({"tokens": tokens, "steps": steps, **evaluate(learner, data.eval)})
    timing = _since(start)
    final = curve[-1]
    print(
        f"[bench efficiency] sampler {name:10s} seed {seed}: {steps} steps, {tokens} tokens, eval loss "
        f"{final['loss']:.4f}, accuracy {final['accuracy']:.3f}, {timing['wall_s']:.0f} s",
        flush=True,
    )
    return {
        "variant": name,
        "seed": seed,
        "steps": steps,
        "tokens": tokens,
        "final": final,
        "curve": curve,
        "mean_selected_tokens_per_example": statistics.fmean(selected_len),
        "mean_selected_operators": statistics.fmean(
            selected_ops
        ),  # terms - 1: how hard the chosen problems are
        "selection_seconds": select_s,
        "proxy_train_seconds": proxy_s,
        **timing,
    }


def run_sampler(args: argparse.Namespace, data: SFTData) -> dict[str, Any]:
    vocab = data.tokenizer.vocab_size
    mean_tokens = statistics.fmean(len(e["input_ids"]) for e in data.train)
    budget = int(args.steps * args.batch_size * mean_tokens)
    start = _clock()
    holdout = make_model(vocab, args.proxy_hidden, args.proxy_layers, args.seed + 100)
    holdout_losses = _train_uniform(
        holdout, data.holdout, args.holdout_steps, args.batch_size, args.lr, args.seed + 100
    )
    holdout_info = {
        "steps": args.holdout_steps,
        "final_train_loss": holdout_losses[-1],
        "eval": evaluate(holdout, data.eval),
        **_since(start),
    }
    print(f"[bench efficiency] holdout proxy: eval {holdout_info['eval']}", flush=True)
    runs = [
        _sampler_variant(name, args, data, holdout, budget, args.seed + s)
        for s in range(args.seeds)
        for name in ("uniform", "importance", "rho")
    ]
    summary = {}
    for name in ("uniform", "importance", "rho"):
        finals = [r["final"] for r in runs if r["variant"] == name]
        summary[name] = {k: statistics.fmean(f[k] for f in finals) for k in ("loss", "accuracy")}
        summary[name]["wall_s"] = statistics.fmean(r["wall_s"] for r in runs if r["variant"] == name)
    base = summary["uniform"]
    for s in summary.values():
        s["loss_vs_uniform"] = s["loss"] / base["loss"]
        s["accuracy_minus_uniform"] = s["accuracy"] - base["accuracy"]
    return {
        "token_budget": budget,
        "mean_tokens_per_example": mean_tokens,
        "models": {
            "learner_params_m": _params_m(make_model(vocab, args.hidden, args.layers, 0)),
            "proxy_params_m": _params_m(holdout),
        },
        "holdout_proxy": holdout_info,
        "runs": runs,
        "summary": summary,
    }


# ----------------------------------------------------------------------------------------- distill
def train_teacher(args: argparse.Namespace, data: SFTData) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The larger model, trained on the task with label CE for ``--teacher-steps``."""
    teacher = make_model(data.tokenizer.vocab_size, args.teacher_hidden, args.teacher_layers, args.seed + 7)
    start = _clock()
    losses = _train_uniform(teacher, data.train, args.teacher_steps, args.batch_size, args.lr, args.seed + 7)
    teacher.eval().requires_grad_(False)
    info = {
        "params_m": _params_m(teacher),
        "hidden": args.teacher_hidden,
        "layers": args.teacher_layers,
        "steps": args.teacher_steps,
        "final_train_loss": losses[-1],
        "eval": evaluate(teacher, data.eval),
        **_since(start),
    }
    print(
        f"[bench efficiency] teacher ({info['params_m']:.2f}M): eval {info['eval']}, {info['wall_s']:.0f} s",
        flush=True,
    )
    return teacher, info


def _distill(
    student: torch.nn.Module, teacher: torch.nn.Module, config: DistillConfig, seed: int
) -> HierarchicalDistillation:
    """The loss with its projections initialised from ``seed`` (torch's global seed is random per process)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 11)
        return HierarchicalDistillation.from_models(student, teacher, config)


def _distill_config(name: str, args: argparse.Namespace) -> DistillConfig | None:
    if name == "ce":
        return None
    if name == "logits-kd":
        return DistillConfig.logits_only(temperature=args.kd_temperature)
    kind = "cosine" if name.endswith("cosine") else "mse"
    return DistillConfig(
        hidden_loss=kind,
        temperature=args.kd_temperature,
        hidden_weight=args.hidden_weight,
        normalize_hidden=not name.endswith("-raw"),
    )


def _student_run(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    config: DistillConfig | None,
    distill: HierarchicalDistillation | None,
    args: argparse.Namespace,
    data: SFTData,
    steps: int,
    lr: float,
    seed: int,
    evals: int = 0,
) -> dict[str, Any]:
    """Train ``student`` for ``steps`` (CE only when ``config`` is None, else CE + distillation)."""
    batches = uniform_batches(data.train, args.batch_size, seed)
    params = [*student.parameters(), *(distill.parameters() if distill is not None else [])]
    curve: list[dict[str, Any]] = []
    parts: list[tuple[float, float, float]] = []
    every = max(steps // evals, 1) if evals else 0

    def step(i: int) -> torch.Tensor:
        if every and i and i % every == 0:
            curve.append({"steps": i, **evaluate(student, data.eval, teacher=teacher)})
        batch = collate([data.train[j] for j in next(batches)])
        if distill is None:
            return lm_loss(student, batch)
        out = distill_step(student, teacher, distill, batch, ce_weight=args.ce_weight)
        parts.append((float(out.ce.detach()), float(out.kl.detach()), float(out.hidden.detach())))
        return out.total

    start = _clock()
    losses = train_loop(params, steps, lr, step)
    final = evaluate(student, data.eval, teacher=teacher)
    curve.append({"steps": steps, **final})
    tail = parts[-20:]  # the loss terms over the last 20 steps: which one dominates
    terms = (
        {k: statistics.fmean(p[i] for p in tail) for i, k in enumerate(("ce", "kl", "hidden"))}
        if tail
        else {}
    )
    return {
        "final": final,
        "curve": curve,
        "final_train_loss": losses[-1],
        "train_terms": terms,
        **_since(start),
    }


def run_distill(args: argparse.Namespace, data: SFTData) -> dict[str, Any]:
    teacher, teacher_info = train_teacher(args, data)
    vocab = data.tokenizer.vocab_size
    variants = {}
    for name in DISTILL_VARIANTS:
        student = make_model(vocab, args.hidden, args.layers, args.seed)
        config = _distill_config(name, args)
        distill = _distill(student, teacher, config, args.seed) if config is not None else None
        result = _student_run(
            student, teacher, config, distill, args, data, args.steps, args.lr, args.seed, args.evals
        )
        result["layer_map"] = list(distill.layer_map) if distill is not None else []
        variants[name] = result
        f = result["final"]
        print(
            f"[bench efficiency] distill {name:20s}: eval loss {f['loss']:.4f}, "
            f"accuracy {f['accuracy']:.3f}, "
            f"KL to teacher {f['kl_to_teacher']:.4f}, {result['wall_s']:.0f} s",
            flush=True,
        )
    base = variants["logits-kd"]["final"]
    for v in variants.values():
        v["loss_vs_logits_kd"] = v["final"]["loss"] / base["loss"]
    return {
        "teacher": teacher_info,
        "student_params_m": _params_m(make_model(vocab, args.hidden, args.layers, 0)),
        "variants": variants,
    }


# --------------------------------------------------------------------------------------------- qat
def run_qat(args: argparse.Namespace, data: SFTData) -> dict[str, Any]:
    from tlt_lightning.efficiency.qat import (
        Int4QATConfig,
        convert_qat,
        prepare_qat,
        quantize_ptq,
        quantized_modules,
    )

    qconfig = Int4QATConfig(group_size=args.group_size or None)  # 0: per output channel
    teacher, teacher_info = train_teacher(args, data)
    vocab = data.tokenizer.vocab_size
    config = _distill_config("hierarchical-mse", args)
    student = make_model(vocab, args.hidden, args.layers, args.seed)
    distill = _distill(student, teacher, config, args.seed)
    phase1 = _student_run(student, teacher, config, distill, args, data, args.steps, args.lr, args.seed)
    print(
        f"[bench efficiency] qat: fp32 student after {args.steps} steps: eval {phase1['final']}", flush=True
    )
    results: dict[str, Any] = {"fp32-phase1": phase1}

    fp32, fp32_distill = copy.deepcopy(student), copy.deepcopy(distill)
    results["fp32"] = _student_run(
        fp32, teacher, config, fp32_distill, args, data, args.qat_steps, args.qat_lr, args.seed + 1
    )
    ptq = quantize_ptq(copy.deepcopy(fp32), qconfig)
    results["ptq"] = {
        "final": evaluate(ptq, data.eval, teacher=teacher),
        "quantized_modules": len(quantized_modules(ptq)),
    }

    qat = prepare_qat(copy.deepcopy(student), qconfig)
    results["qat"] = _student_run(
        qat, teacher, config, copy.deepcopy(distill), args, data, args.qat_steps, args.qat_lr, args.seed + 1
    )
    results["qat"]["fake_quant_eval"] = results["qat"].pop("final")
    convert_qat(qat, qconfig)
    results["qat"]["final"] = evaluate(qat, data.eval, teacher=teacher)
    results["qat"]["quantized_modules"] = len(quantized_modules(qat))
    if args.scratch:  # one schedule over steps + qat-steps: fp32, its PTQ, and QAT from the first step
        total = args.steps + args.qat_steps
        for name, quantize in (("scratch-fp32", False), ("scratch-qat", True)):
            model = make_model(vocab, args.hidden, args.layers, args.seed)
            if quantize:
                prepare_qat(model, qconfig)
            d = _distill(model, teacher, config, args.seed)
            results[name] = _student_run(model, teacher, config, d, args, data, total, args.lr, args.seed)
            if quantize:
                results[name]["fake_quant_eval"] = results[name]["final"]
                convert_qat(model, qconfig)
                results[name]["final"] = evaluate(model, data.eval, teacher=teacher)
            else:
                ptq_long = quantize_ptq(copy.deepcopy(model), qconfig)
                results["scratch-ptq"] = {"final": evaluate(ptq_long, data.eval, teacher=teacher)}
    for name in QAT_VARIANTS:
        if name in results:
            f = results[name]["final"]
            print(
                f"[bench efficiency] qat {name:12s}: eval loss {f['loss']:.4f}, "
                f"accuracy {f['accuracy']:.3f}, "
                f"KL to teacher {f['kl_to_teacher']:.4f}",
                flush=True,
            )
    return {
        "teacher": teacher_info,
        "student_params_m": _params_m(student),
        "int4": {
            "group_size": args.group_size or "per-channel",
            "activations": qconfig.activations,
            "skip": list(qconfig.skip),
        },
        "layer_map": list(distill.layer_map),
        "variants": results,
    }
