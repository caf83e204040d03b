"""Decode and verify forward of the target on three paths, side by side: transformers' module tree
(``HFTarget(decode="hf")``), the lean forward (``HFTarget(decode="lean")``) and, with ``--compile``,
the lean forward through ``torch.compile`` (Inductor, static shapes, key length rounded up to a
bucket so one graph serves many steps, gpt-fast style).

Each timed call is one target forward over ``q`` new tokens per row plus the LM head, at
``--context`` cached positions; the paths alternate round by round (A B C A B C) and medians are
printed, so machine noise hits all of them alike. Compile time (first call of each shape) is
printed separately; ``max|diff|`` is the largest logit difference from the transformers path.

    python scripts/decode_paths.py [--dtype bfloat16] [--batch 1 8] [--queries 1 7] [--compile]

With ``--engine N`` it times whole greedy rollouts instead: ``RolloutEngine`` on the hf and the lean
path alternately (A B A B, ``--repeats`` each), ``N`` new tokens for each of ``B`` countdown prompts;
it prints the median decode step, decode tokens/s and whether the outputs are identical.

    python scripts/decode_paths.py --engine 64 [--dtype bfloat16] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.models.attention import grouped_sdpa
from tlt_lightning.models.lean import _rms_norm, _rotate_half
from tlt_lightning.rollout import RolloutConfig, RolloutEngine
from tlt_lightning.rollout.engine import causal_decode_mask


@torch.library.custom_op("tlt_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """oneDNN's packed linear as an op Inductor leaves alone (its own lowering wants frozen weights)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def pack_weights(model) -> dict[str, torch.Tensor]:
    """oneDNN-packed copies of every linear weight (what ``set_weight_layout("packed")`` multiplies by)."""
    with torch.no_grad():
        return {name: torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().contiguous(), 8)
                for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def static_lean(model, ids, positions, mask, keys, values, kv_len: int, packed=None) -> torch.Tensor:
    """The lean forward in a form Inductor compiles without graph breaks: per-layer cache tensors,
    ``F.linear`` or, given ``packed`` (:func:`pack_weights`), oneDNN's packed linear, a static key
    length; returns logits."""

    def linear(x: torch.Tensor, module: torch.nn.Linear, name: str) -> torch.Tensor:
        if packed is None:
            return F.linear(x, module.weight, module.bias)
        return packed_linear(x, packed[name], module.bias, module.out_features)

    decoder = model.get_decoder()
    n, q = ids.shape
    hidden = decoder.embed_tokens(ids)
    cos, sin = decoder.rotary_emb(hidden, positions)
    cos, sin = cos[:, None], sin[:, None]
    rows = torch.arange(n, device=ids.device)[:, None]
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, hidden)
        shape = (n, q, -1, attn.head_dim)
        pre = f"model.layers.{i}."
        query = linear(x, attn.q_proj, pre + "self_attn.q_proj").view(shape).transpose(1, 2)
        key = linear(x, attn.k_proj, pre + "self_attn.k_proj").view(shape).transpose(1, 2)
        value = linear(x, attn.v_proj, pre + "self_attn.v_proj").view(shape).transpose(1, 2)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        keys[i][rows, :, positions] = key.transpose(1, 2)
        values[i][rows, :, positions] = value.transpose(1, 2)
        out = grouped_sdpa(query, keys[i][:n, :, :kv_len], values[i][:n, :, :kv_len], mask, attn.scaling)
        hidden = hidden + linear(out.transpose(1, 2).reshape(n, q, -1), attn.o_proj, pre + "self_attn.o_proj")
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        gate, up = linear(x, mlp.gate_proj, pre + "mlp.gate_proj"), linear(x, mlp.up_proj, pre + "mlp.up_proj")
        hidden = hidden + linear(mlp.act_fn(gate) * up, mlp.down_proj, pre + "mlp.down_proj")
    hidden = _rms_norm(decoder.norm, hidden)
    return linear(hidden, model.get_output_embeddings(), "lm_head")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--weight-layout", default="packed", choices=["out_in", "in_out", "packed"],
                   help="layout of the hf and lean paths (the compiled path reads the parameters with F.linear)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 7], help="new tokens per row (1 = decode)")
    p.add_argument("--context", type=int, default=300, help="cached positions per row")
    p.add_argument("--bucket", type=int, default=64, help="compiled path: key length rounded up to this")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="also time the torch.compile'd lean forward")
    p.add_argument("--compile-packed", action="store_true",
                   help="the compiled forward multiplies by oneDNN-packed weights (as the packed layout does)")
    p.add_argument("--engine", type=int, default=0, metavar="N",
                   help="time greedy RolloutEngine rollouts of N new tokens instead of single forwards")
    p.add_argument("--repeats", type=int, default=3, help="--engine: alternating runs per path")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype)
    model = loaded.model
    hf, lean = HFTarget(model), HFTarget(model, decode="lean")
    if args.engine:
        engine_rollouts(args, loaded.tokenizer, hf, lean)
        return
    compiled = torch.compile(static_lean, dynamic=False) if args.compile else None
    print(f"{args.model} {args.dtype} layout={args.weight_layout} threads={args.threads} context={args.context}; "
          f"ms per forward+head, median of {args.rounds} alternating rounds")
    for B in args.batch:
        for q in args.queries:
            med, diffs, compile_s = measure(args, model, hf, lean, compiled, B, q)
            parts = [f"{k} {m:6.1f} ms ({B * q / m * 1e3:6.0f} tokens fed/s, max|diff| {diffs[k]:.1e})"
                     for k, m in med.items()]
            extra = f", compile {compile_s:.0f} s" if compiled is not None else ""
            print(f"B={B} q={q}: " + "; ".join(parts) + f"; lean/hf {med['hf'] / med['lean']:.2f}x{extra}", flush=True)


def engine_rollouts(args, tokenizer, hf: HFTarget, lean: HFTarget) -> None:
    """Greedy rollouts on both paths, alternating; medians over ``args.repeats`` runs each."""
    from tlt_lightning.bench.common import task_prompts

    hf.set_weight_layout(args.weight_layout)
    prompts = task_prompts(tokenizer, "countdown", max(args.batch), seed=0)
    config = RolloutConfig(max_new_tokens=args.engine, temperature=0.0)
    print(f"{args.model} {args.dtype} layout={args.weight_layout} threads={args.threads}: greedy RolloutEngine, "
          f"{args.engine} new tokens per request, median of {args.repeats} alternating runs")
    for B in args.batch:
        step_ms: dict[str, list[float]] = {"hf": [], "lean": []}
        tok_s: dict[str, list[float]] = {"hf": [], "lean": []}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, target in (("hf", hf), ("lean", lean)):
                result = RolloutEngine(target, config).generate(prompts[:B])
                step_ms[name].append(statistics.median(result.stats.step_times) * 1e3)
                tok_s[name].append(result.stats.decode_tokens_per_s)
                outputs[name] = [r.token_ids.tolist() for r in result.rollouts]
        med = {k: statistics.median(v) for k, v in step_ms.items()}
        tps = {k: statistics.median(v) for k, v in tok_s.items()}
        same = sum(a == b for a, b in zip(outputs["hf"], outputs["lean"]))
        print(f"B={B}: hf {med['hf']:.1f} ms/step {tps['hf']:.1f} tok/s; lean {med['lean']:.1f} ms/step "
              f"{tps['lean']:.1f} tok/s; lean/hf {med['hf'] / med['lean']:.2f}x; identical {same}/{B}", flush=True)


def measure(args, model, hf: HFTarget, lean: HFTarget, compiled, B: int, q: int):
    """Medians (ms) per path, max logit difference from the hf path, and the compile seconds."""
    L = args.context
    cache = hf.new_cache(B, L + q + args.bucket)
    per_layer = ([cache.keys[i] for i in range(hf.info.num_layers)],
                 [cache.values[i] for i in range(hf.info.num_layers)])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(1000, hf.info.vocab_size), (B, q), generator=g)
    lengths = torch.full((B,), L)
    pos = L + torch.arange(q)[None].expand(B, q)
    mask = causal_decode_mask(lengths, q, L + q)
    kv = -(-(L + q) // args.bucket) * args.bucket
    static_mask = causal_decode_mask(lengths, q, kv)
    fns = {
        "hf": lambda: hf.lm_head(hf.forward(ids, pos, mask, cache).hidden),
        "lean": lambda: lean.lm_head(lean.forward(ids, pos, mask, cache).hidden),
    }
    packed = pack_weights(model) if args.compile_packed else None
    if compiled is not None:
        fns["compiled"] = lambda: compiled(model, ids, pos, static_mask, *per_layer, kv, packed)
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        hf.set_weight_layout(args.weight_layout)  # packed keeps the parameters row-major
        compile_s = 0.0
        if compiled is not None:
            start = time.perf_counter()
            fns["compiled"]()
            compile_s = time.perf_counter() - start
        ref = fns["hf"]().float()
        diffs = {k: (f().float() - ref).abs().max().item() for k, f in fns.items()}
        for _ in range(args.rounds):
            for k, f in fns.items():
                f()  # a warm call: each path finds the caches as it leaves them
                start = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, diffs, compile_s


if __name__ == "__main__":
    main()
