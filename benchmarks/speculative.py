"""``python -m benchmarks rollout --speculative``: plain engine vs lossless speculative decoding.

Same prompts, same sampling (temperature 1 by default, as RL rollouts), runs alternated
(plain, SD, plain, SD, ...) so machine noise hits both alike; medians reported. ``--arms`` compares
several strategies side by side (plain, arm 1, arm 2, ... on every prompt group), each against the
same plain runs; several ``--drafter`` directories compare drafters the same way (every arm of each).

* fixed batches (1, 8, 32, 128): speculation on at every step, throughput and mean accept length;
* the long-tail rollout (``--long-tail-requests`` prompts, up to ``--long-tail-max-new`` tokens):
  speculation switches on below ``--threshold`` active requests; total rollout time of both;
* several ``--temperature`` values: the fixed batches at each (the speedup rises as sampling
  sharpens: the drafter's distribution matches a peaked target's more often);
* batch 1 peers, HF ``generate`` at the (first) temperature: plain, assisted generation
  (``assistant_model=``) with the target's own first ``--assistant-layers`` decoder layers as the
  assistant (no smaller model shares SmolLM2's vocabulary; a layer-skip draft is the closest
  assistant there is), and prompt-lookup decoding (HF's assistant-free speculative method).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    compile_report,
    machine_info,
    median,
    prompt_groups,
    task_prompts,
    timed,
    write_json,
)
from benchmarks.speculative_plot import plot
from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, RolloutResult
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec, parse_arm

__all__ = ["run"]


def full_batch_step_time(stats: Any, size: int, speculative: bool) -> float:
    """Median seconds of the steps of ``stats`` that decoded all ``size`` requests, speculatively
    or not as ``speculative`` says (``nan`` if there is none): a plain and a speculative run's
    figures compare like with like even after some requests have finished."""
    steps = zip(stats.step_times, stats.step_batch_sizes, stats.step_speculative)
    return median([t for t, n, spec in steps if n == size and spec == speculative])


def _compare(
    plain: RolloutEngine,
    specs: dict[str, SpeculativeRolloutLoop],
    prompts,
    size: int,
    repeats: int,
    seed: int,
    warm_up: bool = False,
) -> list[dict[str, Any]]:
    """Alternate plain rollouts of ``size`` prompts with those of each speculative loop (by strategy name).

    Repeat ``r`` takes the ``r``-th group of ``size`` prompts (wrapping around), so small batches
    average over several prompts instead of timing one prompt again and again; every loop runs on
    it right after the plain run, with the same seed. Returns one summary per loop (medians), each
    against the same plain runs, with its last result under ``"_last"``. ``warm_up``: every run is
    made once untimed first, so compiled graphs (``--decode compiled``) compile outside the timed runs.
    """
    keys = (
        "sd_tps",
        "sd_decode_tps",
        "sd_s",
        "sd_cpu_s",
        "accept",
        "draft_depth",
        "sd_step_fraction",
        "sd_step_cost",
    )
    base: dict[str, list[float]] = {"plain_tps": [], "plain_decode_tps": [], "plain_s": [], "plain_cpu_s": []}
    rows: list[dict[str, list[float]]] = [{k: [] for k in keys} for _ in specs]
    last: list[RolloutResult | None] = [None] * len(specs)
    groups = prompt_groups(prompts, size, repeats)
    for r, group in enumerate(groups if warm_up else []):
        for loop in (plain, *specs.values()):
            loop.generate(group, generator=torch.Generator().manual_seed(seed + r))
    for r, group in enumerate(groups):
        a, ta, ca = _timed_generate(plain, group, seed + r)
        base["plain_cpu_s"].append(ca / a.stats.generated_tokens)  # CPU seconds per token
        base["plain_tps"].append(a.stats.generated_tokens / ta)
        base["plain_decode_tps"].append(a.stats.decode_tokens_per_s)
        base["plain_s"].append(ta)
        for i, spec in enumerate(specs.values()):
            last[i], tb, cb = _timed_generate(spec, group, seed + r)
            _record_speculative(rows[i], last[i].stats, tb, cb, a.stats, size)
    return [_summary(name, size, base, row, result) for name, row, result in zip(specs, rows, last)]


def _timed_generate(loop: Any, group: list[list[int]], seed: int) -> tuple[RolloutResult, float, float]:
    """``loop``'s rollouts of ``group`` sampled from ``seed``: ``(result, wall s, CPU s)``."""
    return timed(lambda: loop.generate(group, generator=torch.Generator().manual_seed(seed)))


def _record_speculative(
    row: dict[str, list[float]], stats: Any, wall: float, cpu: float, plain_stats: Any, size: int
) -> None:
    """Append one speculative run's figures to ``row`` (``plain_stats``: the plain run before it)."""
    row["sd_cpu_s"].append(cpu / stats.generated_tokens)
    row["sd_tps"].append(stats.generated_tokens / wall)
    row["sd_decode_tps"].append(stats.decode_tokens_per_s)
    row["sd_s"].append(wall)
    row["accept"].append(stats.mean_accept_length)
    depths = [d for d in stats.step_draft_depths if d]
    row["draft_depth"].append(sum(depths) / max(1, len(depths)))
    row["sd_step_fraction"].append(sum(stats.step_speculative) / max(1, stats.num_steps))
    row["sd_step_cost"].append(
        full_batch_step_time(stats, size, True) / full_batch_step_time(plain_stats, size, False)
    )


def _summary(
    name: str, size: int, base: dict[str, list[float]], row: dict[str, list[float]], result: Any
) -> dict[str, Any]:
    """One loop's medians against the plain runs ``base``, its last result under ``"_last"``."""
    return {
        "requests": size,
        "strategy": name,
        "plain_tokens_per_s": median(base["plain_tps"]),
        "sd_tokens_per_s": median(row["sd_tps"]),
        "speedup_tokens_per_s": median(row["sd_tps"]) / median(base["plain_tps"]),
        "speedup_cpu_time_per_token": median(base["plain_cpu_s"]) / median(row["sd_cpu_s"]),
        # Decode steps only: the prefill, the same work in both, left out.
        "speedup_decode": median(row["sd_decode_tps"]) / median(base["plain_decode_tps"]),
        "plain_seconds": median(base["plain_s"]),
        "sd_seconds": median(row["sd_s"]),
        "mean_accept_length": median(row["accept"]),
        # Drafts per speculative step: below the depth when a min_confidence chain stops early.
        "mean_draft_depth": median(row["draft_depth"]),
        "sd_step_fraction": median(row["sd_step_fraction"]),
        # A speculative step's time in plain steps (all requests active): speedup ~ accept / cost.
        "sd_step_cost": median(row["sd_step_cost"]),
        "runs": base | row,
        "_last": result,
    }


def layer_skip_assistant(model: Any, layers: int) -> Any:
    """A copy of the causal LM ``model`` with only its first ``layers`` decoder layers (and its
    embeddings, final norm and LM head): an assistant for HF assisted generation."""
    import copy

    if not 1 <= layers < model.config.num_hidden_layers:
        raise ValueError(
            f"--assistant-layers must be in [1, {model.config.num_hidden_layers - 1}], got {layers}"
        )
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    assistant = type(model)(config).to(model.dtype).eval()
    missing, _ = assistant.load_state_dict(
        model.state_dict(), strict=False
    )  # the deeper layers are unexpected
    if missing:
        raise RuntimeError(f"layer-skip assistant: weights missing from the target: {missing[:3]}")
    return assistant


def _hf_peer(model, prompt: list[int], max_new: int, seed: int, temperature: float, **kwargs: Any) -> float:
    """HF ``generate`` at batch 1 (``kwargs``: its speculative options); tokens/s."""
    torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    # HF refuses temperature 0: greedy is do_sample=False there.
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0}
        if temperature > 0
        else {"do_sample": False}
    )
    out, t, _ = timed(
        lambda: model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, **sampling, **kwargs
        )
    )
    return (out.shape[1] - len(prompt)) / t


def _arms_and_names(args: argparse.Namespace) -> tuple[list[DraftSpec], list[str]]:
    """The arms to compare and the drafters' labels (their directories' names), checked."""
    if not args.drafter:
        raise ValueError("--speculative needs --drafter DIR (train one with `tlt-lightning drafter warmup`)")
    arms = (
        [parse_arm(name) for name in args.arms]
        if args.arms
        else [DraftSpec(args.depth, args.topk, args.draft_tokens, sampled=args.sampled)]
    )
    if None in arms:
        raise ValueError("--arms: every arm is compared with plain decoding already; leave 'off' out")
    if len({str(a) for a in arms}) < len(arms):
        raise ValueError(f"--arms names an arm twice: {args.arms}")
    names = [Path(d).name for d in args.drafter]
    if len(set(names)) < len(names):
        raise ValueError(
            f"--drafter: directories need distinct names to label the results, got {args.drafter}"
        )
    return arms, names


def _hf_batch1(
    args: argparse.Namespace, model: Any, prompts: list[list[int]], temperature: float
) -> dict[str, list[float]]:
    """HF ``generate`` at batch 1, plain, prompt lookup and (``--assistant-layers``) assisted: tokens/s
    of each run, the peers alternated."""
    peers = {"plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": 4}}
    if args.assistant_layers:
        peers["assisted"] = {"assistant_model": layer_skip_assistant(model, args.assistant_layers)}
    hf: dict[str, list[float]] = {}
    for r in range(args.repeats):  # alternated, as the pairs above
        for name, kwargs in peers.items():
            prompt = prompts[r % len(prompts)]
            hf.setdefault(name, []).append(
                _hf_peer(model, prompt, args.max_new_tokens, args.seed + r, temperature, **kwargs)
            )
    return hf


def _long_tail(
    args: argparse.Namespace,
    target: HFTarget,
    first: tuple[str, Any, DraftSpec],
    prompts: list[list[int]],
    temperature: float,
    compiled: bool,
) -> tuple[dict[str, Any], RolloutResult]:
    """The long-tail rollout, plain vs the ``first`` (label, drafter, arm) below ``--threshold``:
    its summary and the last speculative result."""
    n = args.long_tail_requests
    lt_cfg = RolloutConfig(max_new_tokens=args.long_tail_max_new, temperature=temperature)
    print(
        f"[bench speculative] long tail: {n} requests, up to {args.long_tail_max_new} tokens, "
        f"SD below {args.threshold} active ...",
        flush=True,
    )
    label, drafter, arm = first
    spec = SpeculativeRolloutLoop(target, drafter, lt_cfg, arm, threshold=args.threshold)
    [out] = _compare(
        RolloutEngine(target, lt_cfg), {label: spec}, prompts[:n], n, args.repeats, args.seed, compiled
    )
    long_tail = out.pop("_last")
    out["speedup_rollout_time"] = out["plain_seconds"] / out["sd_seconds"]
    out["threshold"] = args.threshold
    out["accept_length_histogram"] = torch.bincount(long_tail.stats.accept_lengths).tolist()
    print(
        f"  plain {out['plain_seconds']:.1f} s, SD {out['sd_seconds']:.1f} s, "
        f"x{out['speedup_rollout_time']:.2f}, accept {out['mean_accept_length']:.2f}",
        flush=True,
    )
    return out, long_tail


def _batch_line(out: dict[str, Any]) -> str:
    """One fixed batch's printed line for one strategy."""
    return (
        f"  {out['strategy']}: plain {out['plain_tokens_per_s']:.1f} tok/s, "
        f"SD {out['sd_tokens_per_s']:.1f} tok/s, x{out['speedup_tokens_per_s']:.2f} "
        f"(CPU time x{out['speedup_cpu_time_per_token']:.2f}, "
        f"decode steps x{out['speedup_decode']:.2f}), "
        f"accept {out['mean_accept_length']:.2f} of {out['mean_draft_depth']:.2f} drafts, "
        f"step cost {out['sd_step_cost']:.2f}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms, names = _arms_and_names(args)
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise ValueError(f"--model {args.model!r} has no tokenizer: the benchmark needs real task prompts")
    target = HFTarget(loaded.model, decode=getattr(args, "decode", "hf"))
    target.set_weight_layout(args.weight_layout)
    drafters = {name: load_drafter(path, target).eval() for name, path in zip(names, args.drafter)}
    compiled = target.decode == "compiled"
    for drafter in drafters.values() if compiled else ():
        drafter.use_compiled_steps()  # the drafter's step through the same mechanism as the target's
    # One drafter: results are labelled by arm, as before; several: DIRNAME/ARM.
    runs = [
        (f"{name}/{arm}" if len(drafters) > 1 else str(arm), drafter, arm)
        for name, drafter in drafters.items()
        for arm in arms
    ]
    count = max([bs * args.repeats for bs in args.batch_sizes] + [args.long_tail_requests, 1])
    prompts = task_prompts(loaded.tokenizer, args.task, count, seed=args.seed)
    temperatures = list(args.temperature)
    payload: dict[str, Any] = {
        "benchmark": "rollout-speculative",
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "model": args.model,
        "dtype": args.dtype,
        "weight_layout": target.weight_layout,
        "task": args.task,
        "drafter": args.drafter[0],
        "drafters": args.drafter,
        "strategy": str(arms[0]),
        "strategies": [label for label, _, _ in runs],
        # The first temperature is the HF peers' and the long tail's.
        "temperature": temperatures[0],
        "temperatures": temperatures,
        "machine": machine_info(),
        "batches": [],
    }
    for temperature, bs in itertools.product(temperatures, args.batch_sizes):
        print(
            f"[bench speculative] batch {bs}, T={temperature}, {args.max_new_tokens} new tokens ...",
            flush=True,
        )
        cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=temperature)
        specs = {
            label: SpeculativeRolloutLoop(target, drafter, cfg, arm, threshold=bs + 1)
            for label, drafter, arm in runs
        }
        for out in _compare(
            RolloutEngine(target, cfg), specs, prompts, bs, args.repeats, args.seed, compiled
        ):
            out.pop("_last")
            payload["batches"].append({"temperature": temperature, **out})
            print(_batch_line(out), flush=True)
        if bs == 1 and temperature == temperatures[0]:
            hf = _hf_batch1(args, loaded.model, prompts, temperature)
            payload["hf_batch1_tokens_per_s"] = {name: median(v) for name, v in hf.items()}
            payload["hf_batch1_assistant_layers"] = args.assistant_layers
            print(
                "  HF generate (batch 1): " + ", ".join(f"{k} {median(v):.1f} tok/s" for k, v in hf.items()),
                flush=True,
            )

    long_tail = None
    if args.long_tail_requests:
        payload["long_tail"], long_tail = _long_tail(
            args, target, runs[0], prompts, temperatures[0], compiled
        )

    payload.update(compile_report(target))  # --decode compiled: in untimed warm-up runs
    payload["drafter_compile_seconds"] = sum(d.compile_seconds for d in drafters.values())
    json_path = write_json(args.json, payload)
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    payload["plot"] = str(plot(payload, long_tail, plot_path))
    write_json(json_path, payload)
    print(f"[bench speculative] wrote {json_path}", flush=True)
    return payload
