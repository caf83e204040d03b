"""Anatomy of a chain-``K`` speculative step at batch 1 on SmolLM2: the parts timed in the order
the step runs them, so each drafter pass finds the caches as the target's verify forward left them.

Per round: a plain decode forward (1 token, the yardstick), a verify forward of ``K + 1`` tokens,
then ``K`` drafter passes (the drafter layer, then its LM head over the draft vocabulary). Prints
the medians in ms and each part in plain decode steps. Packed bf16 weights, one thread.

    python scripts/chain_step.py [--drafter examples/drafters/smollm2-countdown] [--depth 6] [--context 300]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout.engine import causal_decode_mask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--drafter", default="examples/drafters/smollm2-countdown")
    p.add_argument("--depth", type=int, default=6, help="drafts per step (K)")
    p.add_argument("--context", type=int, default=300, help="cached positions")
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    target = HFTarget(load_model("smollm2-135m", dtype="bfloat16").model)
    target.set_weight_layout("packed")
    drafter = load_drafter(args.drafter, target).eval()
    drafter.set_weight_layout("packed")
    K, L = args.depth, args.context
    cache, dcache = target.new_cache(1, L + K + 1), drafter.new_cache(1, L + K + 1)
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"plain forward": [], f"verify forward ({K + 1} tokens)": [],
                                     "drafter layer": [], "drafter head": []}

    def forward(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return target.lm_head(target.forward(ids, pos, mask, cache).hidden)  # [1, q, V]: every row verified

    def timed(name: str, fn, *fn_args):
        start = time.perf_counter()
        out = fn(*fn_args)
        times[name].append(time.perf_counter() - start)
        return out

    with torch.inference_mode():
        for _ in range(args.rounds):
            for q, name in ((1, "plain forward"), (K + 1, f"verify forward ({K + 1} tokens)")):
                cache.lengths[:] = L  # writes past the context only: the timed work is the same every round
                ids, pos = torch.randint(100, 1000, (1, q), generator=g), L + torch.arange(q)[None]
                mask = causal_decode_mask(torch.tensor([L]), q, L + q)
                timed(name, forward, ids, pos, mask)
            dcache.lengths[:] = L
            hidden = torch.randn(1, 1, target.info.hidden_size, dtype=torch.bfloat16, generator=g)
            for k in range(K):
                pos = torch.tensor([[L + k]])
                mask = torch.ones(1, 1, 1, L + k + 1, dtype=torch.bool)
                hidden = timed("drafter layer", drafter, torch.tensor([[42]]), hidden, pos, mask, dcache)
                timed("drafter head", drafter.logits, hidden[:, 0])
    plain = statistics.median(times["plain forward"])
    print(f"{'part':<28} {'ms':>7} {'plain steps':>12}")
    for name, values in times.items():
        ms = statistics.median(values)
        per_step = ms * (K if name.startswith("drafter") else 1)
        label = f"{name} x {K}" if name.startswith("drafter") else name
        print(f"{label:<28} {per_step * 1e3:7.2f} {per_step / plain:12.2f}")


if __name__ == "__main__":
    main()
