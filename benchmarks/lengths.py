"""``python -m benchmarks lengths``: does speculation change what a fit's rollouts look like?

Speculative sampling is lossless: each response is drawn from the target's own law, so its length, how
often it runs into the cap and its reward are distributed as under plain decoding, only the tokens differ
(another random stream). This benchmark checks that on a fit config's real rollouts: the config's policy,
rollout settings (dtype mirror, decode path, cap, temperature, speculation threshold) and prompts, each
prompt sampled ``group_size`` times as GRPO does, once per arm (plain decoding, fixed draft arms,
BEG-MAB, and ``crossover``: BEG-MAB given this machine's step costs, measured after the compile,
:mod:`tlt_lightning.rl.crossover`) through the fit's own rollout backend, its graphs compiled first.
Group ``g`` draws every arm with seed ``seed + g``; the arms' order rotates from group to group (each arm
runs in every position equally often: reversing it would keep the middle arm in the middle). Until an arm
first speculates (fewer than ``threshold`` requests active) it draws plain decoding's very tokens, so
only the responses still running then test the law (``lengths_changed`` counts those that came out
another length); ``--threshold`` above the group's size speculates from the first token, so that all do.

Per arm it reports the length distribution (mean, p50 / p90, share at the cap), reward and accuracy,
and against plain decoding a paired sign-flip test per prompt (under the null, each prompt's mean over
its ``group_size`` samples is exchangeable between the two arms) and the two-sample KS distance of the
pooled lengths; each arm's rollout seconds against plain decoding's, group by group; and per batch-size
bucket (BEG-MAB's below ``threshold``) its decode tokens/s against plain decoding's, wall and CPU time:
whether speculation pays in each bucket where it runs. The policy does
not train: this isolates the rollout from RL's own divergence.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import functools
import math
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from benchmarks.common import machine_info, median, new_figure, save_figure, timed, write_json
from benchmarks.e2e_config import absolute_drafter_paths, frozen_drafter

__all__ = [
    "add_step_buckets",
    "bucket_edges",
    "bucket_rates",
    "ks_distance",
    "ks_pvalue",
    "run",
    "sign_flip_pvalue",
    "summarise",
]


def sign_flip_pvalue(diffs: torch.Tensor, permutations: int, seed: int = 0) -> float:
    """Two-sided p-value of "``diffs`` are symmetric about zero" from random sign flips.

    Args:
        diffs: ``[P]`` per-prompt differences (arm minus plain) of a response statistic's mean.
        permutations: random sign patterns drawn (the observed one counts as one more).

    Example:
        >>> sign_flip_pvalue(torch.tensor([1.0, -1.0, 0.5, -0.5]), 999) > 0.5
        True
    """
    gen = torch.Generator().manual_seed(seed)
    d = diffs.double()
    signs = torch.randint(0, 2, (permutations, d.numel()), generator=gen).double() * 2 - 1  # [N, P]
    flipped = (signs @ d).abs()  # [N]
    observed = d.sum().abs()
    return float(((flipped >= observed - 1e-9).sum() + 1) / (permutations + 1))


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample Kolmogorov-Smirnov distance: the largest gap between the empirical CDFs of ``[N]``
    ``a`` and ``[M]`` ``b``.

    Example:
        >>> ks_distance(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]))
        1.0
    """
    grid = torch.cat([a, b]).unique()  # [U] sorted
    cdf_a = torch.searchsorted(a.sort().values, grid, right=True) / a.numel()
    cdf_b = torch.searchsorted(b.sort().values, grid, right=True) / b.numel()
    return float((cdf_a - cdf_b).abs().max())


def ks_pvalue(distance: float, n: int, m: int) -> float:
    """Asymptotic p-value of a two-sample KS distance (Kolmogorov's series, Stephens' correction);
    conservative for lengths with ties (the cap)."""
    en = math.sqrt(n * m / (n + m))
    lam = (en + 0.12 + 0.11 / en) * distance
    if lam < 0.2:
        return 1.0
    series = sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return max(0.0, min(1.0, 2 * series))


def _describe(rows: list[dict[str, Any]], cap: int) -> dict[str, Any]:
    lengths = torch.tensor([r["length"] for r in rows], dtype=torch.float64)
    q = torch.quantile(lengths, torch.tensor([0.5, 0.9], dtype=torch.float64)).tolist()
    at_cap = int((lengths >= cap).sum())
    return {
        "responses": len(rows),
        "mean_length": float(lengths.mean()),
        "p50": q[0],
        "p90": q[1],
        "max": int(lengths.max()),
        "at_cap": at_cap,
        "at_cap_share": at_cap / len(rows),
        "reward": sum(r["reward"] for r in rows) / len(rows),
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
    }


def _per_prompt(rows: list[dict[str, Any]], key: str, cap: int) -> torch.Tensor:
    """``[P]`` per-prompt means of ``key`` (``at_cap``: 1 for a response at the cap), prompts in order."""
    sums: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        value = float(r["length"] >= cap) if key == "at_cap" else float(r[key])
        sums.setdefault((r["group"], r["prompt"]), []).append(value)
    return torch.tensor([sum(v) / len(v) for _, v in sorted(sums.items())], dtype=torch.float64)


def summarise(
    rows: dict[str, list[dict[str, Any]]], cap: int, permutations: int, seed: int = 0
) -> dict[str, Any]:
    """Each arm's distribution and, against ``"off"`` (plain decoding), the tests of the module docstring.

    Args:
        rows: per arm, one dict per response: ``group``, ``prompt``, ``length``, ``reward``, ``correct``.
        cap: the rollout's ``max_new_tokens``.
    """
    arms = {arm: _describe(r, cap) for arm, r in rows.items()}
    plain = rows["off"]
    # With one seed per group, every arm draws what plain decoding draws until it first speculates:
    # responses that end before then are the same samples (only the others test the law).
    base = torch.tensor([r["length"] for r in plain], dtype=torch.float64)
    for arm, r in rows.items():
        if arm == "off":
            continue
        lengths = torch.tensor([x["length"] for x in r], dtype=torch.float64)
        distance = ks_distance(lengths, base)
        arms[arm]["vs_off"] = {
            "mean_length_ratio": arms[arm]["mean_length"] / arms["off"]["mean_length"],
            "lengths_changed": sum(x["length"] != y["length"] for x, y in zip(r, plain, strict=True)),
            "ks_distance": distance,
            "ks_p": ks_pvalue(distance, lengths.numel(), base.numel()),
            **{
                f"{key}_sign_flip_p": sign_flip_pvalue(
                    _per_prompt(r, key, cap) - _per_prompt(plain, key, cap), permutations, seed
                )
                for key in ("length", "at_cap", "reward")
            },
        }
    return arms


def _module(config: dict[str, Any]) -> Any:
    """The config's :class:`~tlt_lightning.rl.GRPOModule`, its models built (no trainer)."""
    from lightning.pytorch.cli import instantiate_class

    from tlt_lightning.rl import GRPOModule

    model = copy.deepcopy(config.get("model") or {})
    source = model.pop("prompt_source", None)
    if isinstance(source, dict):
        source = instantiate_class((), source)
    module = GRPOModule(**model, prompt_source=source)
    module.configure_model()
    return module


def _drafting(config: dict[str, Any], drafter: str | None) -> dict[str, Any]:
    """``config`` whose ``model.speculative`` names the drafter the arms draft with: ``--drafter``, else
    the one its ``SpotDrafterCallback`` starts from (:func:`frozen_drafter`), else its own."""
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    spot = any(str(c.get("class_path", "")).endswith("SpotDrafterCallback") for c in callbacks)
    out = frozen_drafter(config) if spot else copy.deepcopy(config)
    if drafter is not None:
        out.setdefault("model", {}).setdefault("speculative", {})["drafter_path"] = drafter
    return out


def _group_size_and_threshold(module: Any, args: argparse.Namespace) -> tuple[int, int]:
    """``--group-size`` and ``--threshold``, else the config's."""
    return (
        args.group_size or module.optim_config.group_size,
        args.threshold or module.speculative_config.threshold,
    )


def _strategies(arms: list[str], seed: int) -> dict[str, Any]:
    from tlt_lightning.scheduling import BEGMABStrategy, FixedStrategy
    from tlt_lightning.speculative import parse_arm

    if arms[:1] != ["off"] or len(set(arms)) != len(arms):
        raise ValueError(f"--arms must start with 'off' (the reference) and repeat none, got {arms}")
    # BEG-MAB keeps learning from group to group, as across a fit's steps.
    return {
        a: BEGMABStrategy(seed=seed) if a in ("begmab", "crossover") else FixedStrategy(parse_arm(a))
        for a in arms
    }


def _rollout_rows(module: Any, result: Any, indices: list[int], group: int) -> list[dict[str, Any]]:
    rows = []
    for index, rollout in zip(indices, result.rollouts, strict=True):
        reward = module.prompt_source.score(index, rollout.prompt_ids, rollout.token_ids)
        rows.append(
            {
                "group": group,
                "prompt": index,
                "length": rollout.length,
                "reward": float(reward.total),
                "correct": float(reward.correctness >= 1),
            }
        )
    return rows


def bucket_edges(threshold: int) -> list[int]:
    """Lower edges of the batch-size buckets a rollout's steps are counted in: ``1``, ``2-4``, ``5-7``,
    ``8-15``, ``16+`` below ``threshold``, cut at it, and ``threshold`` on (plain decoding in every arm).

    Example:
        >>> bucket_edges(8), bucket_edges(3), bucket_edges(32)
        ([1, 2, 5, 8], [1, 2, 3], [1, 2, 5, 8, 16, 32])
    """
    return sorted({e for e in (1, 2, 5, 8, 16) if e < threshold} | {threshold})


def _bucket_label(edges: list[int], i: int) -> str:
    low, high = edges[i], (edges[i + 1] - 1 if i + 1 < len(edges) else None)
    return f"{low}+" if high is None else (str(low) if high == low else f"{low}-{high}")


def add_step_buckets(totals: dict[str, list[float]], stats: Any, edges: list[int]) -> None:
    """Add a rollout's decode steps to ``totals`` (per bucket label: seconds, CPU seconds, tokens, steps)."""
    labels = [_bucket_label(edges, i) for i in range(len(edges))]
    for n, wall, cpu, tokens in zip(
        stats.step_batch_sizes, stats.step_times, stats.step_cpu_times, stats.step_tokens, strict=True
    ):
        entry = totals.setdefault(labels[bisect.bisect_right(edges, n) - 1], [0.0, 0.0, 0, 0])
        for k, value in enumerate((wall, cpu, tokens, 1)):
            entry[k] += value


def bucket_rates(totals: dict[str, list[float]], plain: dict[str, list[float]] | None) -> dict[str, Any]:
    """Per bucket: seconds, tokens, tokens/s (wall and CPU) and, against ``plain``'s totals, the ratios of
    both rates (a per-bucket "speculative >= plain")."""
    out = {}
    for label, (wall, cpu, tokens, steps) in totals.items():
        row = {"seconds": wall, "cpu_seconds": cpu, "tokens": tokens, "steps": steps}
        row |= {
            "tokens_per_s": tokens / wall if wall else None,
            "cpu_tokens_per_s": tokens / cpu if cpu else None,
        }
        if plain is not None and label in plain and row["tokens_per_s"] and row["cpu_tokens_per_s"]:
            p_wall, p_cpu, p_tokens, _ = plain[label]
            row["vs_off"] = row["tokens_per_s"] / (p_tokens / p_wall)
            row["cpu_vs_off"] = row["cpu_tokens_per_s"] / (p_tokens / p_cpu)
        out[label] = row
    return out


def measure(module: Any, drafter: Any, args: argparse.Namespace) -> tuple[dict[str, list], dict[str, Any]]:
    """Every arm's rollouts of every group: per-response rows and per-arm decode totals, with the seconds
    the graphs took to compile before (the rows so far written to ``args.json`` after each group)."""
    from tlt_lightning.rl.crossover import calibrate_crossover
    from tlt_lightning.rl.rollout_models import draft_arms, rollout_backend, warm_up_rollouts

    strategies = _strategies(list(args.arms), args.seed)
    group_size, threshold = _group_size_and_threshold(module, args)
    config = module.rollout_config()
    arms = dict.fromkeys(a for strategy in strategies.values() for a in draft_arms(strategy))
    sample = [module.prompt_source.prompt_ids(i) for i in range(min(2, len(module.prompt_source)))]
    compile_seconds = warm_up_rollouts(module.rollout_target, config, sample, drafter, list(arms))
    step_costs = None
    if "crossover" in strategies:  # as the fit does: measured (or read back) right after the compile
        module.draft_strategy = strategies["crossover"]
        step_costs = calibrate_crossover(module, draft_arms(module.draft_strategy), threshold)
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in strategies}
    decode = {
        arm: {"seconds": [], "tokens": 0, "accept": [], "buckets": {}, "other": 0.0} for arm in strategies
    }
    edges = bucket_edges(threshold)
    size = len(module.prompt_source)
    for g in tqdm(range(args.groups), desc="bench lengths: prompt groups", unit="group"):
        first = g * args.prompts
        prompt_ids = [(first + i) % size for i in range(args.prompts)]
        indices = [i for i in prompt_ids for _ in range(group_size)]
        prompts = [module.prompt_source.prompt_ids(i) for i in indices]
        names = list(strategies)
        order = names[g % len(names) :] + names[: g % len(names)]
        for arm in order:
            backend = rollout_backend(
                module.rollout_target, config, None if arm == "off" else drafter, strategies[arm], threshold
            )
            gen = torch.Generator().manual_seed(args.seed + g)
            result, seconds, _ = timed(functools.partial(backend.generate, prompts, generator=gen))
            rows[arm] += _rollout_rows(module, result, indices, g)
            decode[arm]["seconds"].append(seconds)
            decode[arm]["tokens"] += sum(r.length for r in result.rollouts)
            add_step_buckets(decode[arm]["buckets"], result.stats, edges)
            decode[arm]["other"] += result.stats.total_time - sum(result.stats.step_times)
            if result.stats.mean_accept_length > 0:  # 0: no speculative step in this group
                decode[arm]["accept"].append(result.stats.mean_accept_length)
        # A crash keeps the groups done: the final write replaces this one.
        write_json(args.json, {"benchmark": "lengths", "complete": False, "groups_done": g + 1, "rows": rows})
    plain = decode["off"]["seconds"]
    costs = None if step_costs is None else step_costs.to_dict() | {"machine": None}
    return rows, {"compile_seconds": compile_seconds, "step_costs": costs} | {
        arm: {
            "seconds": sum(d["seconds"]),
            "tokens": d["tokens"],
            "median_group_seconds": median(d["seconds"]),
            # Per group, plain decoding's seconds over this arm's (the same prompts and seed), median.
            "speedup_vs_off": median([p / s for p, s in zip(plain, d["seconds"], strict=True)]),
            "mean_accept_length": sum(d["accept"]) / len(d["accept"]) if d["accept"] else None,
            # Outside the decode steps: prefill, the engine's bookkeeping, the drafter's cache set-up.
            "other_seconds": d["other"],
            "buckets": bucket_rates(d["buckets"], None if arm == "off" else decode["off"]["buckets"]),
        }
        for arm, d in decode.items()
    }


def plot(payload: dict[str, Any], rows: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """Left: empirical CDFs of every arm's response lengths (log scale), the cap marked. Right: each
    arm's decode tokens/s (CPU) over plain decoding's, per batch-size bucket (where speculation pays)."""
    fig, (ax, bars) = new_figure(1, 2, figsize=(12, 4.2), width_ratios=(1.3, 1))
    for arm, r in rows.items():
        lengths = sorted(x["length"] for x in r)
        cdf = [(i + 1) / len(lengths) for i in range(len(lengths))]
        stats = payload["arms"][arm]
        p = "" if arm == "off" else f", sign-flip p {stats['vs_off']['length_sign_flip_p']:.2f}"
        ax.step(lengths, cdf, where="post", label=f"{arm}: mean {stats['mean_length']:.1f}{p}")
    ax.axvline(payload["max_new_tokens"], color="gray", ls=":", lw=1, label="cap")
    ax.set(
        xscale="log",
        xlabel="response length (tokens)",
        ylabel="share of responses at most that long",
        title=f"{payload['responses_per_arm']} responses per arm, same prompts, T={payload['temperature']:g}",
    )
    ax.legend(fontsize=8, loc="lower right")
    others = [arm for arm in rows if arm != "off"]
    buckets = payload["arms"]["off"]["decode"]["buckets"]  # plain decoding runs in every bucket
    labels = sorted(buckets, key=lambda label: int(label.split("-")[0].rstrip("+")))
    width = 0.8 / max(1, len(others))
    for k, arm in enumerate(others):
        buckets = payload["arms"][arm]["decode"]["buckets"]
        ratios = [buckets.get(label, {}).get("cpu_vs_off", math.nan) for label in labels]
        bars.bar([i + k * width for i in range(len(labels))], ratios, width, label=arm, color=f"C{k + 1}")
    bars.axhline(1.0, color="C0", lw=1, label="plain")
    bars.set_xticks([i + width * (len(others) - 1) / 2 for i in range(len(labels))], labels)
    bars.set(xlabel="active requests", ylabel="decode tokens/s (CPU) / plain", title="by batch bucket")
    bars.legend(fontsize=8, loc="lower right")
    return save_figure(fig, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    config_path = Path(args.config)
    if not config_path.is_file():
        raise ValueError(
            f"--config {config_path}: no such file (a fit config, e.g. configs/grpo_smollm2.yaml)"
        )
    config = absolute_drafter_paths(yaml.safe_load(config_path.read_text()), config_path.parent)
    for name in ("groups", "prompts", "permutations"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    _strategies(list(args.arms), args.seed)  # checks --arms before minutes of loading
    torch.manual_seed(args.seed)
    config = _drafting(config, args.drafter)
    module = _module(config)
    if module.drafter is None:
        raise ValueError(f"--config {config_path} names no drafter: pass --drafter DIR")
    path = module.speculative_config.drafter_path
    group_size, threshold = _group_size_and_threshold(module, args)
    rows, decode = measure(module, module.drafter.eval(), args)
    cap = module.rollout_settings.max_new_tokens
    arms = summarise(rows, cap, args.permutations, args.seed)
    for arm in arms:
        arms[arm]["decode"] = decode[arm]
    compile_seconds = decode["compile_seconds"]
    payload = {
        "benchmark": "lengths",
        "complete": True,
        "command": "python -m benchmarks " + " ".join(getattr(args, "argv", [])),
        "config": str(config_path),
        "drafter": str(path) if path is not None else "the config's fresh drafter",
        "rollout_dtype": str(module.rollout_dtype),
        "rollout_decode": module.rollout_decode,
        "compile_seconds": compile_seconds,  # before the timed groups
        "step_costs": decode["step_costs"],  # the crossover arm's (seconds per step by rows and arm)
        "max_new_tokens": cap,
        "temperature": module.rollout_settings.temperature,
        "threshold": threshold,
        "groups": args.groups,
        "prompts_per_group": args.prompts,
        "group_size": group_size,
        "responses_per_arm": len(rows["off"]),
        "seed": args.seed,
        "machine": machine_info(),
        "arms": arms,
        "lengths": {arm: [r["length"] for r in rs] for arm, rs in rows.items()},
    }
    json_path = write_json(args.json, payload)
    payload["plot"] = str(
        plot(payload, rows, Path(args.plot) if args.plot else json_path.with_suffix(".png"))
    )
    write_json(json_path, payload)
    for arm, s in arms.items():
        v = s.get("vs_off")
        tail = (
            ""
            if v is None
            else (
                f"; {s['decode']['speedup_vs_off']:.2f}x plain, {v['lengths_changed']} lengths changed"
                f"; vs off: length p {v['length_sign_flip_p']:.3f}, at-cap p {v['at_cap_sign_flip_p']:.3f}, "
                f"reward p {v['reward_sign_flip_p']:.3f}, KS {v['ks_distance']:.3f} (p {v['ks_p']:.3f})"
            )
        )
        print(
            f"[bench lengths] {arm}: mean {s['mean_length']:.1f}, p50/p90 {s['p50']:.0f}/{s['p90']:.0f}, "
            f"at the cap {s['at_cap']}/{s['responses']}, reward {s['reward']:.3f}{tail}",
            flush=True,
        )
        buckets = [
            f"{b}: {r['cpu_vs_off']:.2f}x" for b, r in s["decode"]["buckets"].items() if "cpu_vs_off" in r
        ]
        if buckets:
            print(
                f"[bench lengths]   {arm} tokens/s by batch bucket vs plain (CPU): {', '.join(buckets)}",
                flush=True,
            )
    print(f"[bench lengths] wrote {json_path}", flush=True)
    return payload
