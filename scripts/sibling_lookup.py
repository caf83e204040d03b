"""Would model-free drafts pay at temperature 1? Suffix-match drafts from a request's own text and
from its GRPO siblings (the other responses to the same prompt), scored offline on SmolLM2's rollouts.

In the long tail of a GRPO rollout most of a straggler's siblings have finished, so their text is a
free draft source (prompt lookup, suffix decoding). This measures what such drafts would earn:
at every position of every response, the longest suffix of the context (up to ``--max-match``
tokens) found earlier in the corpus proposes the ``--depth`` tokens that followed it there (never
reading the response's own future). A fixed draft ``d`` is accepted by speculative sampling with
probability ``p(d)``, so the expected accept count ``sum_k prod_{i<=k} p(d_i | ...)`` equals the
expected common prefix of the drafts and the sampled continuation: matching drafts against the
rollouts themselves is an unbiased estimate, with no target forward.

    python scripts/sibling_lookup.py [--prompts 12] [--group 8] [--seed 2000] [--groups runs/suffix/groups.json]

Samples ``--prompts`` countdown prompts x ``--group`` responses (bf16, T=1, up to 512 tokens) unless
``--groups`` already holds them; prints the mean accepted drafts per position, by match length.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np
import torch

from tlt_lightning.rl.tasks import task_prompts
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine


def sample_groups(prompts: int, group: int, seed: int) -> list[dict]:
    loaded = load_model("smollm2-135m", dtype="bfloat16")
    engine = RolloutEngine(HFTarget(loaded.model), RolloutConfig(max_new_tokens=512, temperature=1.0))
    groups = []
    for prompt in task_prompts(loaded.tokenizer, "countdown", prompts, seed=seed):
        out = engine.generate([prompt] * group, generator=torch.Generator().manual_seed(seed + len(groups)))
        groups.append({"prompt": prompt, "responses": [r.token_ids.tolist() for r in out.rollouts]})
        print(f"sampled {len(groups)}/{prompts} groups", flush=True)
    return groups


def longest_match(corpus: np.ndarray, tail: np.ndarray, end: int, max_match: int) -> tuple[int, int]:
    """``(n, start)``: the longest suffix of ``tail`` (``n`` tokens) that occurs in ``corpus[:end]``
    with a continuation starting before ``end``; ``start`` is the latest such continuation."""
    cand = np.nonzero(corpus[: end - 1] == tail[-1])[0] + 1
    if cand.size == 0:
        return 0, -1
    n = 1
    while n < min(max_match, len(tail)):
        prev = cand - n - 1
        ok = prev >= 0
        keep = cand[ok][corpus[prev[ok]] == tail[-1 - n]]
        if keep.size == 0:
            break
        cand, n = keep, n + 1
    return n, int(cand.max())


def score(groups: list[dict], siblings: bool, depth: int, max_match: int) -> dict[int, list[int]]:
    """Accepted drafts per position, keyed by match length (0: no match, no draft)."""
    by_match: dict[int, list[int]] = collections.defaultdict(list)
    for g in groups:
        prompt, responses = g["prompt"], g["responses"]
        for i, r in enumerate(responses):
            others = [s for j, s in enumerate(responses) if j != i] if siblings else []
            docs = [prompt + s for s in others] + [prompt + r]  # a sibling's text continues the prompt too
            corpus = np.array([t for doc in docs for t in [*doc, -1]][:-1])
            own = len(corpus) - len(r)
            for t in range(len(r)):
                end = own + t  # the context is corpus[:end]: the response so far
                tail = np.array((prompt + r[:t])[-max_match:])
                n, start = longest_match(corpus, tail, end, max_match)
                accepted = 0
                if n:
                    draft = corpus[start:min(start + depth, end)]
                    draft = draft[: np.argmax(draft < 0)] if (draft < 0).any() else draft
                    for d, x in zip(draft, r[t:t + depth]):
                        if d != x:
                            break
                        accepted += 1
                by_match[n].append(accepted)
    return by_match


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--group", type=int, default=8, help="responses per prompt")
    p.add_argument("--seed", type=int, default=2000)
    p.add_argument("--groups", default=None, help="JSON of sampled groups: read if it exists, else written")
    p.add_argument("--depth", type=int, default=8, help="draft tokens per position at most")
    p.add_argument("--max-match", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(1)
    path = Path(args.groups) if args.groups else None
    if path is not None and path.exists():
        groups = json.loads(path.read_text())
    else:
        groups = sample_groups(args.prompts, args.group, args.seed)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(groups))
    for siblings in (False, True):
        by_match = score(groups, siblings, args.depth, args.max_match)
        total = sum(len(v) for v in by_match.values())
        mean = sum(sum(v) for v in by_match.values()) / total
        source = "own text + siblings" if siblings else "own text (prompt lookup)"
        print(f"{source}: {total} positions, {mean:.3f} accepted drafts per position (depth {args.depth})")
        for n in sorted(by_match):
            v = np.array(by_match[n])
            print(f"  match {n:>2}: {len(v) / total:6.1%} of positions, {v.mean():.2f} accepted, "
                  f"P(first accepted) {np.mean(v >= 1):.2f}")


if __name__ == "__main__":
    main()
