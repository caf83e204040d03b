"""Measure how a model scores on a reasoning-gym task, the way GRPO would sample it.

Samples ``--samples`` completions per prompt (a GRPO group) at temperature 1 with HF ``generate``
and reports what decides whether GRPO can learn: the mean reward, the fraction of completions
with a reward, the fraction of groups whose rewards differ (zero-variance groups give no
gradient), and response lengths. Results are in ``docs/tasks.md``.

Usage (the model dir holds a plain safetensors copy of SmolLM2-135M-Instruct)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.measure_task_reward /tmp/smollm2 \\
        --task basic_arithmetic --prompts 16 --samples 4 --json /tmp/basic_arithmetic.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tlt_lightning.rl import TaskConfig, TaskDataset
from tlt_lightning.rl.rewards import EXPLICIT_SOURCES, find_answer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="directory with a HF causal LM and its tokenizer")
    parser.add_argument("--task", default=TaskConfig.name, help="reasoning-gym task name")
    parser.add_argument("--task-kwargs", default="{}", help="JSON dict merged over the easy preset")
    parser.add_argument("--no-easy", action="store_true", help="start from reasoning-gym defaults")
    parser.add_argument("--system-prompt", default=None, help="override the default system prompt")
    parser.add_argument("--no-system-prompt", action="store_true", help="use the chat template's")
    parser.add_argument("--prompts", type=int, default=16, help="number of distinct prompts")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (group)")
    parser.add_argument("--batch-rows", type=int, default=32, help="rows per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="task seed and sampling seed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--show", type=int, default=6, help="print this many completions")
    parser.add_argument("--json", default=None, help="write the statistics (and completions) here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    system_prompt = TaskConfig.system_prompt if args.system_prompt is None else args.system_prompt
    config = TaskConfig(
        name=args.task,
        size=args.prompts,
        seed=args.seed,
        task_kwargs=json.loads(args.task_kwargs),
        easy=not args.no_easy,
        system_prompt=None if args.no_system_prompt else system_prompt,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    dataset = TaskDataset(config, tokenizer)
    rows = [i for i in range(len(dataset)) for _ in range(args.samples)]
    completions, lengths, seconds = _sample(args, model, tokenizer, dataset, rows)
    scores = [dataset.score(i, c) for i, c in zip(rows, completions)]
    stats = _statistics(args, config, dataset, rows, completions, scores, lengths)
    stats["generate_seconds"] = seconds
    for i, (row, completion, score) in enumerate(zip(rows, completions, scores)):
        if i >= args.show:
            break
        print(
            f"--- prompt {row} (answer {dataset[row].entry['answer']}) reward {score.total:.2f} "
            f"extracted {score.answer!r}\n{completion[:400]}"
        )
    print(json.dumps(stats, indent=2))
    if args.json:
        samples = [
            {
                "prompt": i,
                "answer": dataset[i].entry["answer"],
                "completion": c,
                "reward": s.total,
                "extracted": s.answer,
            }
            for i, c, s in zip(rows, completions, scores)
        ]
        with open(args.json, "w") as f:
            json.dump({**stats, "completions": samples}, f, indent=2)
    return stats


def _sample(
    args: argparse.Namespace, model: Any, tokenizer: Any, dataset: TaskDataset, rows: list[int]
) -> tuple[list[str], list[int], float]:
    """A completion of each row's prompt, ``--batch-rows`` at a time: the texts, their token counts
    (up to the first EOS) and the seconds it took."""
    completions: list[str] = []
    lengths: list[int] = []
    start = time.perf_counter()
    for lo in range(0, len(rows), args.batch_rows):
        batch = rows[lo : lo + args.batch_rows]
        enc = tokenizer(
            [dataset[i].text for i in batch], return_tensors="pt", padding=True, add_special_tokens=False
        )
        with torch.inference_mode():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=args.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        for row in new:
            ended = (row == tokenizer.eos_token_id).nonzero()
            lengths.append(int(ended[0]) + 1 if len(ended) else len(row))
            completions.append(tokenizer.decode(row, skip_special_tokens=True))
        print(f"  {lo + len(batch)}/{len(rows)} rows, {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return completions, lengths, time.perf_counter() - start


def _statistics(
    args: argparse.Namespace,
    config: TaskConfig,
    dataset: TaskDataset,
    rows: list[int],
    completions: list[str],
    scores: list[Any],
    lengths: list[int],
) -> dict[str, Any]:
    """Rewards, correctness, format, group variance, lengths and where the answers were found."""
    totals = [s.total for s in scores]
    groups = [totals[g * args.samples : (g + 1) * args.samples] for g in range(len(dataset))]
    correct = [s.correctness for s in scores]
    found = [find_answer(c, config.answer_kind) for c in completions]
    sources = collections.Counter(f.source if f else "none" for f in found)
    # What a strict extractor (explicit answers only) would have scored: how much leniency buys.
    strict = [
        dataset.source.score_answer(
            f.answer if f and f.source in EXPLICIT_SOURCES else None, dataset[i].entry
        )
        for i, f in zip(rows, found)
    ]
    return {
        "task": config.name,
        "task_kwargs": config.reasoning_gym_kwargs(),
        "system_prompt": config.rendered_system_prompt(),
        "format_weight": config.format_weight,
        "prompts": len(dataset),
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "dtype": args.dtype,
        "mean_reward": statistics.fmean(totals),
        "mean_correctness": statistics.fmean(correct),
        "frac_correct": sum(c >= 1.0 for c in correct) / len(correct),
        "frac_nonzero_correctness": sum(c > 0 for c in correct) / len(correct),
        "mean_correctness_explicit_only": statistics.fmean(strict),
        "frac_format": sum(s.format > 0 for s in scores) / len(scores),
        "frac_groups_with_variance": sum(max(g) > min(g) for g in groups) / len(groups),
        # Groups where some samples solve the problem and some do not: the correctness signal.
        "frac_groups_mixed_correct": sum(
            0 < sum(c >= 1.0 for c in correct[g * args.samples : (g + 1) * args.samples]) < args.samples
            for g in range(len(dataset))
        )
        / len(dataset),
        "mean_group_std": statistics.fmean(statistics.pstdev(g) for g in groups),
        "mean_response_tokens": statistics.fmean(lengths),
        "median_response_tokens": statistics.median(lengths),
        "frac_hit_cap": sum(n >= args.max_new_tokens for n in lengths) / len(lengths),
        "extraction_sources": dict(sources),
    }


if __name__ == "__main__":
    main()
