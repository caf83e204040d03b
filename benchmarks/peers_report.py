"""The report of ``python -m benchmarks peers``: medians, ratios, agreement, the printed lines, the plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import median, new_figure, save_figure
from benchmarks.peers_client import RunTiming

__all__ = ["agreement", "batch_line", "long_tail_line", "plot", "summarise"]


def agreement(a: list[RunTiming], b: list[RunTiming]) -> dict[str, Any]:
    """Token-for-token comparison of two engines' greedy runs of the same groups."""
    same = total = 0
    prefix: list[float] = []
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x.tokens, y.tokens, strict=True):
            total += 1
            same += s == t
            k = next((i for i, (u, v) in enumerate(zip(s, t)) if u != v), min(len(s), len(t)))
            prefix.append(k / max(1, max(len(s), len(t))))
    return {"identical": same, "responses": total, "mean_common_prefix": sum(prefix) / max(1, len(prefix))}


def summarise(
    runs: dict[str, list[RunTiming]], pairs: Sequence[tuple[str, str]], greedy: bool
) -> dict[str, Any]:
    """Medians per engine; ratios (and, if greedy, agreement) for each ``(ours, peer)`` pair."""
    engines = {
        name: {
            "end_to_end_tokens_per_s": median([t.end_to_end_tps for t in ts]),
            "decode_tokens_per_s": median([t.decode_tps for t in ts]),
            "seconds": median([t.total_s for t in ts]),
            "first_token_s": median([t.first_s for t in ts]),
            "tokens": median([float(t.generated) for t in ts]),
            "mean_accept_length": median([t.accept_length for t in ts]),
            "runs_end_to_end_tokens_per_s": [t.end_to_end_tps for t in ts],
            "runs_decode_tokens_per_s": [t.decode_tps for t in ts],
        }
        for name, ts in runs.items()
    }
    ratios = {}
    for ours, peer in pairs:
        o, p = engines[ours], engines[peer]
        entry = {
            "end_to_end": o["end_to_end_tokens_per_s"] / p["end_to_end_tokens_per_s"],
            "decode": o["decode_tokens_per_s"] / p["decode_tokens_per_s"],
        }
        if greedy:
            entry["agreement"] = agreement(runs[ours], runs[peer])
        ratios[f"{ours}/{peer}"] = entry
    return {"engines": engines, "ratios": ratios}


def batch_line(out: dict[str, Any], greedy: bool) -> str:
    """One fixed batch's printed line: each engine's rates, each pair's ratios (and agreement if
    ``greedy``), the speculative engines' accept lengths."""
    return (
        f"  batch {out['batch_size']}: "
        + ", ".join(
            f"{n} decode {e['decode_tokens_per_s']:.1f} / e2e {e['end_to_end_tokens_per_s']:.1f} tok/s"
            for n, e in out["engines"].items()
        )
        + "".join(
            f"; {pair} decode x{r['decode']:.2f}, e2e x{r['end_to_end']:.2f}"
            + (f", identical {r['agreement']['identical']}/{r['agreement']['responses']}" if greedy else "")
            for pair, r in out["ratios"].items()
        )
        + "".join(
            f", {n} accept {e['mean_accept_length']:.2f}"
            for n, e in out["engines"].items()
            if e["mean_accept_length"]
        )
    )


def long_tail_line(long_tail: dict[str, Any]) -> str:
    """The long tail's printed line: each engine's seconds and end-to-end rate."""
    return "  " + ", ".join(
        f"{k} {e['seconds']:.1f} s, e2e {e['end_to_end_tokens_per_s']:.1f} tok/s"
        for k, e in long_tail["engines"].items()
    )


def plot(payload: dict[str, Any], path: Path) -> Path:
    """Decode and end-to-end tokens/s per engine and batch size (labels: ours/vLLM)."""
    batches = payload["batches"]
    fig, axes = new_figure(1, 2, figsize=(11, 4.5), squeeze=False)
    names = list(dict.fromkeys((b["phase"] == "sampled", n) for b in batches for n in b["engines"]))
    sizes = list(dict.fromkeys(b["batch_size"] for b in batches))
    width = 0.8 / max(1, len(names))
    for ax, key, title in zip(
        axes[0],
        ("decode_tokens_per_s", "end_to_end_tokens_per_s"),
        ("decode (prefill counted out)", "end to end (prefill counted in)"),
    ):
        for j, (sampled, name) in enumerate(names):
            label = f"{name} T=1" if sampled else name
            for x, n in enumerate(sizes):
                entry = next(
                    (
                        b
                        for b in batches
                        if b["batch_size"] == n
                        and name in b["engines"]
                        and (b["phase"] == "sampled") == sampled
                    ),
                    None,
                )
                if entry is not None:
                    ax.bar(
                        x - 0.4 + width * (j + 0.5),
                        entry["engines"][name][key],
                        width=width,
                        color=f"C{j}",
                        label=label,
                    )
                    label = None  # one legend entry per engine
        ax.set_xticks(list(range(len(sizes))), [str(n) for n in sizes])
        ax.set_yscale("log")
        ax.set(
            xlabel=f"batch size ({payload['max_new_tokens']} tokens, EOS ignored; greedy unless T=1)",
            ylabel="tokens / s",
            title=title,
        )
        ax.legend(fontsize=8)
    return save_figure(fig, path)
