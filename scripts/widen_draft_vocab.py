"""Copy a drafter with a wider draft vocabulary (or the full one), keeping its trained weights.

A drafter's LM head is the target's own, frozen: the draft vocabulary only picks which of its rows
the drafter scores, so a drafter trained on 8192 tokens drafts from more without retraining. The
new vocabulary keeps the old one and adds the tokens most frequent in ``--rollouts`` (responses
sampled from the target, e.g. a ``drafter warmup --rollouts-cache`` file), then the lowest ids
(BPE merges come in frequency order). Compare the copies with ``tlt-lightning drafter evaluate``
(acceptance against the target's whole vocabulary) and ``bench rollout --speculative --drafter A B``.

    python scripts/widen_draft_vocab.py DRAFTER_DIR OUT_DIR --size 16384 --rollouts FILE [--held-out N]
    python scripts/widen_draft_vocab.py DRAFTER_DIR OUT_DIR --size 0 ...   # the full vocabulary
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from tlt_lightning.drafter import Drafter, load_drafter, save_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.rollout import load_rollouts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("drafter")
    p.add_argument("out")
    p.add_argument("--size", type=int, required=True, help="draft vocabulary size; 0 = the target's whole vocabulary")
    p.add_argument("--rollouts", required=True, help="rollouts whose token counts rank the added tokens")
    p.add_argument("--held-out", type=int, default=0, metavar="N",
                   help="leave the file's first N rollouts out of the counts (evaluate on them)")
    p.add_argument("--model", default="smollm2-135m")
    args = p.parse_args()
    target = HFTarget(load_model(args.model).model)
    old = load_drafter(args.drafter, target)
    V = old.config.vocab_size
    if args.size and not old.config.draft_vocab < args.size < V:
        raise ValueError(f"--size must lie between the drafter's {old.config.draft_vocab} and {V} (0: all {V})")
    config = replace(old.config, draft_vocab_size=args.size or None)
    rollouts, _ = load_rollouts(args.rollouts)
    counts = torch.bincount(torch.cat([r.token_ids for r in rollouts[args.held_out:]]), minlength=V).double()
    # Rank: the old draft tokens first, then by count, ties (and unseen tokens) by lower id.
    rank = counts + old.t2d.double() * (counts.max() + 1) + (V - torch.arange(V)).double() / (V + 1)
    new = Drafter(config, target, token_counts=rank if args.size else None)
    state = {k: v for k, v in old.state_dict().items() if k not in ("d2t", "t2d")}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"d2t", "t2d"}:
        raise RuntimeError(f"weights do not carry over: missing {missing}, unexpected {unexpected}")
    kept = new.t2d if args.size else torch.ones(V, dtype=torch.bool)
    assert bool(kept[old.t2d].all()), "the old draft vocabulary must be kept"
    print(f"{args.out}: draft vocabulary {config.draft_vocab} (was {old.config.draft_vocab}); the added tokens "
          f"hold {float(counts[kept & ~old.t2d].sum() / counts.sum()):.1%} of the counted rollouts' tokens")
    save_drafter(new.to(torch.bfloat16), args.out)


if __name__ == "__main__":
    main()
