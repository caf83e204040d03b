"""One optimizer step's training forward and backward, micro-batched three ways, on a fit config's model.

The step's sequences are the config's task prompts (``group_size`` rollouts each, in rollout order) with
completions of ``--lengths`` tokens (default: one long-tail worker's step as ``bench e2e`` recorded it);
every row trains (advantages +-1). Each round times, in alternating order, the gradient of the whole
step through the module's own ``policy_loss``, in the precision the fit would pick here (``--precision``):

* ``rows``: ``micro_batch_size`` rows in rollout order, the LM head over ``[b, T, V]`` padded
  completion positions (as before ``head_logprobs``);
* ``rows, head on tokens``: the same micro-batches, the LM head on real completion tokens only;
* ``tokens N``: the rows longest first, packed to ``N`` padded tokens (``micro_batch_tokens``) and
  at most ``micro_batch_size`` rows, the head on real tokens. The default budget is ``micro_batch_size``
  rows of the longest possible sequence: the memory bound ``rows`` has.

CPU seconds per step (medians over rounds), padded tokens through the decoder, micro-batches, and the
gradient's relative difference to ``rows``'s: the same gradient, up to float rounding (bf16 autocast
rounds each product's output, so there that is ~1e-2; in float32 ~1e-6).

    python -m benchmarks.train_step --config configs/grpo_smollm2_longtail.yaml [--lengths 236 81 ...]
        [--budgets 2048 4096] [--rounds 5] [--json docs/results/train_step_longtail.json]
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml

from benchmarks.common import machine_info, median, write_json
from benchmarks.lengths import _module
from tlt_lightning.models import training_precision
from tlt_lightning.rl.batch import PolicyBatch, micro_batches, policy_batch
from tlt_lightning.rl.grpo import token_logprobs
from tlt_lightning.rollout.types import Rollout, RolloutResult, RolloutStats

__all__ = ["main", "measure"]

LONG_TAIL_STEP = (236, 81, 69, 768, 80, 7, 768, 37)
"""Response lengths of one worker's first step of ``bench e2e`` on the long-tail config, without TLT."""


def padded_head_logprobs(module, batch: PolicyBatch) -> torch.Tensor:
    """``[B, T]`` log-probabilities, the LM head over every ``[B, T]`` completion position (padding too)."""
    hidden = module.policy.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [B, S, H]
    S, T = hidden.shape[1], batch.tokens.shape[1]
    idx = (batch.prompt_lens[:, None] - 1 + torch.arange(T)).clamp(max=S - 1)
    picked = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, T, H]
    logits = module.policy.get_output_embeddings()(picked)
    return token_logprobs(logits, batch.tokens, module.rollout_settings.temperature)


def step_batch(module, lengths: list[int], seed: int = 0) -> PolicyBatch:
    """The step's ``len(lengths)`` sequences: task prompts ``0, 1, ...`` ``group_size`` times each, with
    random completions of ``lengths`` tokens; advantages alternately +1 and -1."""
    G, gen = module.optim_config.group_size, torch.Generator().manual_seed(seed)
    vocab = module.policy.get_output_embeddings().weight.shape[0]
    rollouts = [
        Rollout(
            torch.tensor(module.prompt_source.prompt_ids(i // G)),
            torch.randint(vocab, (n,), generator=gen),
            torch.zeros(n),
            "length",
            0.0,
            0.0,
        )
        for i, n in enumerate(lengths)
    ]
    signs = torch.tensor([1.0, -1.0]).repeat(len(lengths))[: len(lengths)]
    return policy_batch(RolloutResult(rollouts, RolloutStats()), signs)


def _gradient(module, data: PolicyBatch, chunks, head, autocast) -> tuple[float, dict[str, torch.Tensor]]:
    """CPU seconds of the step's forward and backward over ``chunks``, and the gradient."""
    module.policy.zero_grad(set_to_none=True)
    count = data.mask.sum().float()
    start = time.process_time()
    for rows in chunks:
        mb = data.select(rows)
        with autocast:
            loss = module.policy_loss(mb, head(module, mb), count).loss
        loss.backward()
    seconds = time.process_time() - start
    return seconds, {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}


def measure(module, lengths: list[int], budgets: list[int], rounds: int, precision: str) -> dict:
    """Per variant: CPU seconds per round, padded tokens, micro-batches, and the gradient's difference to
    ``rows``'s, ``|g - g_rows| / |g_rows|`` over all parameters (the largest over rounds)."""
    data = step_batch(module, lengths)
    seq_lens = data.attention_mask.sum(1)
    rows = module.optim_config.micro_batch_size
    variants = {
        "rows": (micro_batches(seq_lens, rows), padded_head_logprobs),
        "rows, head on tokens": (micro_batches(seq_lens, rows), type(module).policy_logprobs),
    }
    for budget in budgets:
        variants[f"tokens {budget}"] = (micro_batches(seq_lens, rows, budget), type(module).policy_logprobs)
    bf16 = precision == "bf16-mixed"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    out = {name: {"cpu_s": [], "micro_batches": len(chunks)} for name, (chunks, _) in variants.items()}
    for name, (chunks, _) in variants.items():
        out[name]["padded_tokens"] = sum(len(c) * int(seq_lens[c].max()) for c in chunks)
    reference = None
    for r in range(rounds):
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            seconds, grads = _gradient(module, data, *variants[name], autocast)
            out[name]["cpu_s"].append(seconds)
            if name == "rows" and reference is None:
                reference = grads
            if reference is not None:
                diff = sum(float((grads[k] - g).square().sum()) for k, g in reference.items())
                norm = sum(float(g.square().sum()) for g in reference.values())
                out[name]["grad_diff"] = max(out[name].get("grad_diff", 0.0), (diff / norm) ** 0.5)
    return {"precision": precision, "variants": out}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a fit config (model, task, optim)")
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=list(LONG_TAIL_STEP), help="response lengths"
    )
    parser.add_argument("--budgets", type=int, nargs="*", default=None, help="micro_batch_tokens to try")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16-mixed", "32-true"],
        default="auto",
        help="auto: as the fit picks",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="runs/bench/train_step.json")
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.lengths) < 1 or min(args.budgets or [1]) < 1:
        parser.error("--rounds, --lengths and --budgets must be >= 1")
    torch.set_num_threads(args.threads)
    config = yaml.safe_load(Path(args.config).read_text())
    model = config.setdefault("model", {})
    model.update(rollout_decode="hf", speculative={"enabled": False})  # nothing decodes here
    module = _module(config)
    module.policy.train()
    G = module.optim_config.group_size
    if len(args.lengths) % G:
        parser.error(f"--lengths must be whole groups: a multiple of group_size = {G}")
    longest = max(len(module.prompt_source.prompt_ids(i)) for i in range(len(args.lengths) // G))
    rows = module.optim_config.micro_batch_size or len(args.lengths)
    budgets = (
        args.budgets
        if args.budgets is not None
        else [rows * (longest + module.rollout_settings.max_new_tokens)]
    )
    precision = training_precision() if args.precision == "auto" else args.precision
    result = measure(module, args.lengths, budgets, args.rounds, precision)
    base = median(result["variants"]["rows"]["cpu_s"])
    for name, v in result["variants"].items():
        v["median_cpu_s"] = median(v["cpu_s"])
        v["speedup_vs_rows"] = base / v["median_cpu_s"]
        print(
            f"[train_step] {name}: {v['median_cpu_s']:.2f} CPU s, {v['speedup_vs_rows']:.2f}x rows, "
            f"{v['micro_batches']} micro-batches, {v['padded_tokens']} padded tokens, "
            f"gradient {v.get('grad_diff', 0.0):.1e} off rows'",
            flush=True,
        )
    payload = {
        "benchmark": "train_step",
        "command": "python -m benchmarks.train_step " + " ".join(argv if argv is not None else []),
        "config": args.config,
        "lengths": args.lengths,
        "machine": machine_info(),
        **result,
    }
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
