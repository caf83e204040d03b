"""One-command check of the compiled decode path (``HFTarget(decode="compiled")``) on a device.

On ``--device cuda`` the graphs run in ``"reduce-overhead"`` mode (CUDA graphs per bucket). Checks,
in fp32 greedy, against transformers' path on the same weights:

1. plain decoding (``RolloutEngine``): token for token;
2. chain and tree verification (``SpeculativeRolloutLoop`` with a random drafter): token for token
   with plain decoding;
3. the RL case: weights changed in place after compiling; the compiled forward follows them.

Prints compile time per bucket and decode tokens/s of both paths (one run each: a smoke figure), and
exits non-zero on any mismatch. With ``--speed B ...`` it then times greedy decoding in bf16 at each
batch size ``B``: transformers' path and the compiled one alternately (``--repeats`` runs each, after
one untimed run that compiles), every request running to ``--speed-tokens`` (no EOS), and prints the
median decode tokens/s of each (``--json``: all runs).

``--random-weights`` builds ``--model`` (a directory with a ``config.json``) with random weights: the
same shapes, kernels and speed as the real model, for a machine that cannot hold its weights.

    python -m benchmarks.compiled_check --device cuda [--model smollm2-135m] [--batch 8] [--speed 1 8 32]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import replace

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import CompileConfig, HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.engine import causal_decode_mask
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec


def prompts_for(target: HFTarget, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    high = min(target.info.vocab_size, 1000)
    return [
        torch.randint(3, high, (int(k),), generator=g).tolist()
        for k in torch.randint(4, 40, (n,), generator=g)
    ]


def same_tokens(a, b) -> int:
    return sum(x.token_ids.tolist() == y.token_ids.tolist() for x, y in zip(a.rollouts, b.rollouts))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--model", default="tiny-llama", help="registry name (tiny-llama, tiny-qwen2, smollm2-135m)"
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--batch-buckets",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16],
        help="compiled batch sizes (fewer buckets, fewer compiles)",
    )
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--mode", default=None, help="torch.compile mode (default: reduce-overhead on CUDA)")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="--model is a directory with a config.json: build it with random weights",
    )
    p.add_argument(
        "--speed", type=int, nargs="*", default=[], metavar="B", help="time bf16 decoding at these batches"
    )
    p.add_argument("--speed-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the speed runs here")
    p.add_argument(
        "--peer-generate",
        action="store_true",
        help=(
            "--speed: also time transformers' own generate with a static cache "
            "(compiled by transformers on CUDA)"
        ),
    )
    p.add_argument("--speed-only", action="store_true", help="skip the exactness checks")
    return p


def _follows_weight_update(model: torch.nn.Module, compiled: HFTarget, hf: HFTarget, device: str) -> bool:
    """Scale the weights in place (as an optimizer step): does the compiled step follow?"""
    lens = torch.tensor([5, 9], device=device)
    before = one_step(compiled, lens)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.25)  # in place, as an optimizer step
    after, reference = one_step(compiled, lens), one_step(hf, lens)
    followed = torch.allclose(after, reference, rtol=1e-4, atol=1e-4) and not torch.allclose(before, after)
    print(
        f"weights changed in place: compiled follows {followed} "
        f"(max|diff| {(after - reference).abs().max().item():.1e})",
        flush=True,
    )
    return followed


def main() -> int:
    args = _parser().parse_args()
    model = build_model(args.model, args.random_weights).to(args.device)
    if args.speed_only:
        speed(model, args)
        return 0
    hf = HFTarget(model)
    config = CompileConfig(batch_buckets=tuple(args.batch_buckets), query_buckets=(1, 4, 8), mode=args.mode)
    compiled = HFTarget(model, decode="compiled", compile_config=config)
    layers = (hf.info.num_layers,)
    rollout = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, feature_layers=layers)
    prompts = prompts_for(hf, args.batch, seed=0)
    failures = []

    expected = RolloutEngine(hf, rollout).generate(prompts)
    got = RolloutEngine(compiled, rollout).generate(prompts)  # compiles
    start = time.perf_counter()
    got = RolloutEngine(compiled, rollout).generate(prompts)
    print(
        f"plain decode: identical {same_tokens(expected, got)}/{len(prompts)}; decode tok/s hf "
        f"{expected.stats.decode_tokens_per_s:.1f}, compiled {got.stats.decode_tokens_per_s:.1f} "
        f"({time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    if same_tokens(expected, got) != len(prompts):
        failures.append("plain decode")

    drafter = Drafter(DrafterConfig.from_target(hf), hf)
    for arm in (DraftSpec(3), DraftSpec(3, 2, 6)):
        loop = SpeculativeRolloutLoop(
            compiled, drafter, replace(rollout, feature_layers=()), arm, threshold=1000
        )
        result = loop.generate(prompts)
        print(f"{arm}: identical to plain {same_tokens(expected, result)}/{len(prompts)}", flush=True)
        if same_tokens(expected, result) != len(prompts):
            failures.append(str(arm))

    if not _follows_weight_update(model, compiled, hf, args.device):
        failures.append("weight update")

    for bucket, seconds in compiled.compile_times.items():
        print(f"compiled {tuple(bucket)} in {seconds:.1f} s")
    print(
        f"compile total {compiled.compile_seconds:.1f} s, mode {compiled._compiled.mode}, "
        f"device {args.device}"
    )
    print("OK" if not failures else f"FAILED: {failures}")
    if args.speed:
        speed(model, args)
    return 1 if failures else 0


def build_model(name: str, random_weights: bool) -> torch.nn.Module:
    if not random_weights:
        return load_model(name, dtype="float32").model
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name), dtype=torch.float32).eval()


def speed(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """Greedy decode tokens/s in bf16, transformers' path and the compiled one alternately; medians."""
    model = copy.deepcopy(model).to(torch.bfloat16)
    config = CompileConfig(batch_buckets=tuple(sorted(set(args.speed))), query_buckets=(1,), mode=args.mode)
    paths = {"hf": HFTarget(model), "compiled": HFTarget(model, decode="compiled", compile_config=config)}
    for target in paths.values():
        target.info = replace(target.info, eos_token_ids=())  # every request runs to --speed-tokens
    rollout = RolloutConfig(max_new_tokens=args.speed_tokens, temperature=0.0)
    runs = []
    for batch in args.speed:
        prompts = prompts_for(paths["hf"], batch, seed=batch)
        rates = {name: [] for name in paths}
        end_to_end = {name: [] for name in [*paths, *(["generate-static"] if args.peer_generate else [])]}
        for repeat in range(args.repeats + 1):  # the first round compiles: untimed
            for name, target in paths.items():
                stats = RolloutEngine(target, rollout).generate(prompts).stats
                if repeat:
                    rates[name].append(stats.decode_tokens_per_s)
                    end_to_end[name].append(stats.tokens_per_s)
            if args.peer_generate:
                rate = generate_static(model, prompts, args.speed_tokens)
                if repeat:
                    end_to_end["generate-static"].append(rate)
        median = {name: statistics.median(r) for name, r in rates.items()}
        median_e2e = {name: statistics.median(r) for name, r in end_to_end.items()}
        runs.append(
            {
                "batch": batch,
                "decode_tokens_per_s": rates,
                "median": median,
                "end_to_end_tokens_per_s": end_to_end,
                "median_end_to_end": median_e2e,
            }
        )
        print(
            f"bf16 batch {batch:3d}: decode tok/s hf {median['hf']:8.1f}, compiled {median['compiled']:8.1f} "
            f"({median['compiled'] / median['hf']:.2f}x); end to end "
            + ", ".join(f"{k} {v:.1f}" for k, v in median_e2e.items()),
            flush=True,
        )
    print(f"speed compile total {paths['compiled'].compile_seconds:.1f} s")
    if args.json:
        device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
        result = {
            "model": args.model,
            "random_weights": args.random_weights,
            "device": device,
            "torch": torch.__version__,
            "mode": paths["compiled"]._compiled.mode,
            "max_new_tokens": args.speed_tokens,
            "repeats": args.repeats,
            "runs": runs,
            "compile_times_s": {str(k): v for k, v in paths["compiled"].compile_times.items()},
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def generate_static(model: torch.nn.Module, prompts: list[list[int]], tokens: int) -> float:
    """transformers' own fast path, ``generate`` with a static cache (compiled by transformers on CUDA):
    end-to-end tokens/s of greedy decoding, ``tokens`` per request (EOS suppressed), prompts left-padded."""
    device, width = model.device, max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    mask = torch.arange(width, device=device)[None] >= width - lengths[:, None]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
    )
    sync()
    assert out.shape[1] - width == tokens, out.shape
    return len(prompts) * tokens / (time.perf_counter() - start)


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
        return target.forward(
            ids[:, width:], positions, mask, cache, feature_layers=(target.info.num_layers,)
        ).hidden


if __name__ == "__main__":
    sys.exit(main())
