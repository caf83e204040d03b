"""Tiny causal LMs and a toy SFT dataset for the sampler / distill / QAT tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 32
PAD = 0  # the tiny LMs' pad_token_id


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


def tiny_lm(hidden: int = 32, layers: int = 2, seed: int = 0, vocab: int = VOCAB) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).eval()


def toy_dataset(n: int = 40, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Variable-length sequences; labels only on the last 3 tokens (the "answer")."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 12, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g)
        labels = torch.full_like(ids, -100)
        labels[-3:] = ids[-3:]
        out.append({"input_ids": ids, "labels": labels})
    return out
