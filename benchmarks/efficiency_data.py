"""Shared pieces of ``bench efficiency``: a reasoning-gym SFT task, tiny models, training and evaluation.

The task is reasoning-gym's ``basic_arithmetic`` (by default 2-3 terms of one digit, ``+``/``-``:
a mix of easy two-term and harder three-term problems), built through
:class:`~tlt_lightning.rl.tasks.TaskConfig` like the RL prompts. An SFT example is
``question + " " + answer`` with the loss on the answer and the end token only. Text is tokenized
by characters (digits are single tokens, the vocabulary has ~25 entries), so a model of a few
million parameters learns the task in minutes on one CPU thread.

Accuracy is exact match under teacher forcing: every answer token and the end token is the
argmax. That is the same event as greedy decoding writing exactly the answer and stopping, at the
cost of one forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tlt_lightning.efficiency.sampler import per_example_loss
from tlt_lightning.rl.tasks import TaskConfig, reasoning_gym

__all__ = [
    "CharTokenizer",
    "SFTData",
    "build_sft_data",
    "collate",
    "evaluate",
    "lm_loss",
    "lr_factor",
    "make_model",
    "optimizer_step",
    "token_count",
    "train_loop",
    "uniform_batches",
]

PAD, BOS, EOS = 0, 1, 2
DEFAULT_TASK_KWARGS: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


class CharTokenizer:
    """Characters -> ids 3.. (0 pad, 1 begin, 2 end), from a fixed alphabet."""

    def __init__(self, alphabet: str) -> None:
        self.alphabet = "".join(sorted(set(alphabet)))
        self.ids = {c: i + 3 for i, c in enumerate(self.alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, prompt: str, answer: str) -> dict[str, torch.Tensor]:
        """``[BOS] prompt " " answer [EOS]``; labels ``-100`` on ``[BOS] prompt " "``."""
        head = [BOS, *(self.ids[c] for c in prompt + " ")]
        tail = [*(self.ids[c] for c in answer), EOS]
        ids = torch.tensor(head + tail)
        labels = torch.tensor([-100] * len(head) + tail)
        return {"input_ids": ids, "labels": labels}


@dataclass
class SFTData:
    """Tokenized splits: ``train`` (the sampled pool), ``holdout`` (RHO-LOSS proxy), ``eval`` (unseen)."""

    train: list[dict[str, torch.Tensor]]
    holdout: list[dict[str, torch.Tensor]]
    eval: list[dict[str, torch.Tensor]]
    tokenizer: CharTokenizer
    task: dict[str, Any]


def _pairs(config: TaskConfig) -> list[tuple[str, str]]:
    source = reasoning_gym().create_dataset(
        config.name, size=config.size, seed=config.seed, **config.reasoning_gym_kwargs()
    )
    return [(e["question"], str(e["answer"])) for e in source]


def build_sft_data(
    task: str = "basic_arithmetic",
    train: int = 4096,
    holdout: int = 1024,
    eval_size: int = 512,
    seed: int = 0,
    task_kwargs: dict[str, Any] | None = None,
    unseen_eval: bool = False,
) -> SFTData:
    """Generate the three splits from far-apart seeds (``unseen_eval``: drop eval questions seen in
    train or holdout; ``task["eval_seen"]`` reports the fraction seen either way)."""
    kwargs = dict(DEFAULT_TASK_KWARGS if task_kwargs is None else task_kwargs)
    # reasoning-gym seeds item i with seed + i: splits get far-apart seeds so they do not overlap.
    configs = [
        TaskConfig(name=task, size=n, seed=seed + k * 1_000_003, task_kwargs=kwargs)
        for k, n in enumerate((train, holdout, 4 * eval_size))
    ]
    splits = [_pairs(c) for c in configs]
    seen = {q for q, _ in splits[0] + splits[1]}
    if unseen_eval:
        splits[2] = [p for p in splits[2] if p[0] not in seen]
    splits[2] = splits[2][:eval_size]
    eval_seen = sum(q in seen for q, _ in splits[2]) / max(len(splits[2]), 1)
    tokenizer = CharTokenizer("".join(q + " " + a for split in splits for q, a in split))
    tokenized = [[tokenizer.encode(q, a) for q, a in split] for split in splits]
    return SFTData(
        *tokenized,
        tokenizer=tokenizer,
        task={
            "name": task,
            "kwargs": configs[0].reasoning_gym_kwargs(),
            "train": train,
            "holdout": holdout,
            "eval": len(splits[2]),
            "eval_seen": eval_seen,
            "seed": seed,
        },
    )


def collate(examples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to ``[B, T]``: ``input_ids``, ``labels`` (``-100`` padded), ``attention_mask``."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), PAD, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = e["input_ids"], e["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def token_count(batch: dict[str, torch.Tensor]) -> int:
    """Real (unpadded) tokens in a batch: the unit of the equal-token comparison."""
    return int(batch["attention_mask"].sum())


def make_model(vocab: int, hidden: int, layers: int, seed: int) -> torch.nn.Module:
    """A Llama-architecture causal LM with random weights (heads of 32, MLP 2.5x, untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % 32:
        raise ValueError(f"hidden must be a multiple of 32 (heads of 32), got {hidden}")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=(hidden * 5 // 2 + 31) // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).train()


def uniform_batches(
    data: Sequence[dict[str, torch.Tensor]], batch_size: int, seed: int
) -> Iterator[list[int]]:
    """Endless uniform batches of indices (reshuffled epochs)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(len(data), generator=g).tolist()
        for s in range(0, len(perm) - batch_size + 1, batch_size):
            yield perm[s : s + batch_size]


def lm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Token-mean cross-entropy on the labelled tokens."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits
    counts = (batch["labels"][:, 1:] != -100).sum(-1)
    return (per_example_loss(logits, batch["labels"]) * counts).sum() / counts.sum().clamp(min=1)


def lr_factor(fraction: float) -> float:
    """Learning-rate multiplier at ``fraction`` of training: linear warm-up (first 5%), cosine decay."""
    fraction = min(max(fraction, 0.0), 1.0)
    return min((fraction + 1e-3) / 0.05, 0.5 * (1 + math.cos(math.pi * fraction)), 1.0)


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, lr: float, fraction: float) -> float:
    """Backward, clip to norm 1, AdamW step at ``lr * lr_factor(fraction)``; returns the loss."""
    for group in opt.param_groups:
        group["lr"] = lr * lr_factor(fraction)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    return float(loss.detach())


def train_loop(
    params: Sequence[torch.nn.Parameter], steps: int, lr: float, step_fn: Callable[[int], torch.Tensor]
) -> list[float]:
    """``steps`` AdamW steps on ``step_fn(step)`` (the loss) with :func:`lr_factor`; the losses."""
    opt = torch.optim.AdamW(list(params), lr=lr, weight_decay=0.0)
    return [optimizer_step(opt, step_fn(step), lr, step / max(steps, 1)) for step in range(steps)]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    data: Sequence[dict[str, torch.Tensor]],
    batch_size: int = 256,
    teacher: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Answer loss (token mean), exact-match accuracy and, with a teacher, the KL to it on answer tokens."""
    was = model.training
    model.eval()
    total_loss = total_tokens = correct = kl_sum = 0.0
    for s in range(0, len(data), batch_size):
        batch = collate(data[s : s + batch_size])
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        targets = batch["labels"][:, 1:]
        labelled = targets != -100
        logits = logits[:, :-1].float()
        token_loss = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), targets, ignore_index=-100, reduction="none"
        )
        total_loss += float(token_loss[labelled].sum())
        total_tokens += float(labelled.sum())
        hit = (logits.argmax(-1) == targets) | ~labelled
        correct += float(hit.all(-1).sum())
        if teacher is not None:
            t = teacher(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
            ).logits
            log_p = torch.log_softmax(t[:, :-1].float(), -1)
            kl = (log_p.exp() * (log_p - torch.log_softmax(logits, -1))).sum(-1)
            kl_sum += float(kl[labelled].sum())
    model.train(was)
    out = {"loss": total_loss / max(total_tokens, 1), "accuracy": correct / max(len(data), 1)}
    if teacher is not None:
        out["kl_to_teacher"] = kl_sum / max(total_tokens, 1)
    return out
