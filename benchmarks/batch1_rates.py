"""Where batch-1 plain decoding's tokens/s go: end to end vs decode, short responses, prompt length, layout.

Issue 29 asked why ``docs/results/speculative_v8_temperatures_zen4.json`` records 14-16 tokens/s
plain at batch 1 while a direct measurement gave 34.7. This runs our plain engine at batch 1
(bf16, one thread) on the same countdown prompts as that benchmark (``--seed 1000``) in several
settings, alternated prompt by prompt, and reports for each the end-to-end rate (prefill counted
in), the decode rate (decode steps only) and CPU seconds per token (not inflated by a busy machine):

* ``v8``: that benchmark's setting: T=1 (``--temperature``), up to 128 new tokens, EOS respected,
  packed weights;
* ``v8_ignore_eos``: the same, every response 128 tokens;
* ``short_prompt``: 128 tokens after a 16-token prompt (attention over fewer keys, a cheap prefill);
* ``out_in``: as ``v8_ignore_eos`` with the plain ``[out, in]`` weight layout.

    OMP_NUM_THREADS=1 python -m benchmarks.batch1_rates --prompts 6 \\
        --json docs/results/peers_batch1_rates_zen4.json
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import machine_info, median, task_prompts, write_json
from benchmarks.peers import eos_ignored
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine


def _rates(
    target: HFTarget, cfg: RolloutConfig, ids: list[int], seed: int, ignore_eos: bool
) -> dict[str, float]:
    """One batch-1 rollout of ``ids``: its end-to-end and decode rates, prefill and CPU time."""
    engine = RolloutEngine(target, cfg)
    gen = torch.Generator().manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    if ignore_eos:
        with eos_ignored(target):
            result = engine.generate([ids], generator=gen)
    else:
        result = engine.generate([ids], generator=gen)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = result.stats
    n = s.generated_tokens
    return {
        "end_to_end_tokens_per_s": n / wall,
        "decode_tokens_per_s": s.decode_tokens_per_s,
        "decode_wall_tokens_per_s": (n - 1) / (wall - s.prefill_time),
        "prefill_s": s.prefill_time,
        "prefill_share": s.prefill_time / wall,
        "response_tokens": float(n),
        "prompt_tokens": float(len(ids)),
        "cpu_ms_per_token": 1000 * cpu / n,
        "decode_step_cpu_ms": 1000 * median(s.step_cpu_times),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--seed", type=int, default=1000, help="countdown prompts (the v8 temperatures run used 1000)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="1 as the v8 run; 0: greedy (no sampling step)"
    )
    p.add_argument("--json", default="runs/bench/batch1_rates.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m", dtype="bfloat16")
    packed = HFTarget(loaded.model)
    packed.set_weight_layout("packed")
    plain = HFTarget(load_model("smollm2-135m", dtype="bfloat16").model)
    plain.set_weight_layout("out_in")
    prompts = task_prompts(loaded.tokenizer, "countdown", args.prompts, seed=args.seed)
    cfg = RolloutConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    settings = {
        "v8": (packed, False, False),
        "v8_ignore_eos": (packed, True, False),
        "short_prompt": (packed, True, True),
        "out_in": (plain, True, False),
    }
    rows: dict[str, dict[str, list[float]]] = {k: {} for k in settings}
    for target in (packed, plain):  # warm-up: the packed copy is made on first use
        RolloutEngine(target, RolloutConfig(max_new_tokens=4)).generate(prompts[:1])
    for i, prompt in enumerate(prompts):
        for name, (target, ignore, short) in settings.items():
            ids = prompt[-16:] if short else prompt
            for key, value in _rates(target, cfg, ids, args.seed + i, ignore).items():
                rows[name].setdefault(key, []).append(value)
        print(
            f"prompt {i}: "
            + ", ".join(
                f"{k} {rows[k]['end_to_end_tokens_per_s'][-1]:.1f}/{rows[k]['decode_tokens_per_s'][-1]:.1f}"
                for k in settings
            ),
            flush=True,
        )
    out = {
        "benchmark": "batch1-rates",
        "command": "python -m benchmarks.batch1_rates "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": machine_info(),
        "settings": {
            k: {"layout": t.weight_layout, "ignore_eos": ig, "short_prompt": sh}
            for k, (t, ig, sh) in settings.items()
        },
        "medians": {k: {m: median(v) for m, v in r.items()} for k, r in rows.items()},
        "runs": rows,
    }
    write_json(args.json, out)
    for k, r in out["medians"].items():
        print(
            f"{k}: e2e {r['end_to_end_tokens_per_s']:.1f}, decode {r['decode_tokens_per_s']:.1f} tok/s, "
            f"prefill {r['prefill_s']:.3f} s ({r['prefill_share']:.0%}), {r['response_tokens']:.0f} tokens, "
            f"{r['cpu_ms_per_token']:.1f} CPU ms/token, decode step {r['decode_step_cpu_ms']:.1f} CPU ms"
        )


if __name__ == "__main__":
    main()
