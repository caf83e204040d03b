"""One-command check of the compiled decode path (``HFTarget(decode="compiled")``) on a device.

On ``--device cuda`` the graphs run in ``"reduce-overhead"`` mode (CUDA graphs per bucket). Checks,
in fp32 greedy, against transformers' path on the same weights:

1. plain decoding (``RolloutEngine``): token for token;
2. chain and tree verification (``SpeculativeRolloutLoop`` with a random drafter): token for token
   with plain decoding;
3. the RL case: weights changed in place after compiling; the compiled forward follows them.

Prints compile time per bucket and decode tokens/s of both paths (one run each: a smoke figure, not
a benchmark), and exits non-zero on any mismatch.

    python scripts/compiled_check.py --device cuda [--model smollm2-135m] [--batch 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import CompileConfig, HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.engine import causal_decode_mask
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec


def prompts_for(target: HFTarget, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    high = min(target.info.vocab_size, 1000)
    return [torch.randint(3, high, (int(k),), generator=g).tolist() for k in torch.randint(4, 40, (n,), generator=g)]


def same_tokens(a, b) -> int:
    return sum(x.token_ids.tolist() == y.token_ids.tolist() for x, y in zip(a.rollouts, b.rollouts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="tiny-llama", help="registry name (tiny-llama, tiny-qwen2, smollm2-135m)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--mode", default=None, help="torch.compile mode (default: reduce-overhead on CUDA)")
    args = p.parse_args()
    model = load_model(args.model, dtype="float32").model.to(args.device)
    hf = HFTarget(model)
    config = CompileConfig(batch_buckets=(1, 2, 4, 8, 16), query_buckets=(1, 4, 8), mode=args.mode)
    compiled = HFTarget(model, decode="compiled", compile_config=config)
    layers = (hf.info.num_layers,)
    rollout = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, feature_layers=layers)
    prompts = prompts_for(hf, args.batch, seed=0)
    failures = []

    expected = RolloutEngine(hf, rollout).generate(prompts)
    got = RolloutEngine(compiled, rollout).generate(prompts)  # compiles
    start = time.perf_counter()
    got = RolloutEngine(compiled, rollout).generate(prompts)
    print(f"plain decode: identical {same_tokens(expected, got)}/{len(prompts)}; decode tok/s hf "
          f"{expected.stats.decode_tokens_per_s:.1f}, compiled {got.stats.decode_tokens_per_s:.1f} "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    if same_tokens(expected, got) != len(prompts):
        failures.append("plain decode")

    drafter = Drafter(DrafterConfig.from_target(hf), hf)
    for arm in (DraftSpec(3), DraftSpec(3, 2, 6)):
        loop = SpeculativeRolloutLoop(compiled, drafter, replace(rollout, feature_layers=()), arm, threshold=1000)
        result = loop.generate(prompts)
        print(f"{arm}: identical to plain {same_tokens(expected, result)}/{len(prompts)}", flush=True)
        if same_tokens(expected, result) != len(prompts):
            failures.append(str(arm))

    lens = torch.tensor([5, 9], device=args.device)
    before = one_step(compiled, lens)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.25)  # in place, as an optimizer step
    after, reference = one_step(compiled, lens), one_step(hf, lens)
    followed = torch.allclose(after, reference, rtol=1e-4, atol=1e-4) and not torch.allclose(before, after)
    print(f"weights changed in place: compiled follows {followed} "
          f"(max|diff| {(after - reference).abs().max().item():.1e})", flush=True)
    if not followed:
        failures.append("weight update")

    for bucket, seconds in compiled.compile_times.items():
        print(f"compiled {tuple(bucket)} in {seconds:.1f} s")
    print(f"compile total {compiled.compile_seconds:.1f} s, mode {compiled._compiled.mode}, device {args.device}")
    print("OK" if not failures else f"FAILED: {failures}")
    return 1 if failures else 0


def one_step(target: HFTarget, lens: torch.Tensor, q: int = 4) -> torch.Tensor:
    """Prefill random tokens of lengths ``lens``, then one forward of ``q`` tokens per row: ``[n, q, H]``."""
    device, n, width = lens.device, lens.numel(), int(lens.max())
    cache = target.new_cache(n, 32)
    slots = torch.arange(width, device=device)
    mask = (slots[None, None, :] <= slots[None, :, None]) & (slots[None, None, :] < lens[:, None, None])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (n, width + q), generator=g).to(device)
    with torch.no_grad():
        target.forward(ids[:, :width], slots.expand(n, width), mask[:, None], cache)
        cache.lengths[:n] = lens
        positions = lens[:, None] + torch.arange(q, device=device)
        mask = causal_decode_mask(lens, q, int(positions.max()) + 1)
        return target.forward(ids[:, width:], positions, mask, cache, feature_layers=(target.info.num_layers,)).hidden


if __name__ == "__main__":
    sys.exit(main())
