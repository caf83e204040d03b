"""Rollout files: many rollouts in one safetensors file, with or without their target features.

A drafter's training data is the target's own rollouts plus the target's hidden states along them.
The states are 1-4 vectors of ``hidden_size`` per token (SmolLM2, EAGLE-1: 197 MB for 640
countdown rollouts in fp32), the tokens ~13 bytes per generated token, prompts included (1.1 MB for
the same rollouts). A file keeps token ids, log-probabilities, finish reasons and timings,
concatenated with offsets, a JSON ``metadata`` dict (the sampling settings) and, unless
``features=False``, the features. Without them it is small enough to keep in git, and
:func:`tlt_lightning.drafter.target_features` recomputes them with one teacher-forced forward (on a
loaded 2-core CPU at ~2x the sampling rate).
Nothing is unpickled on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from tlt_lightning.rollout.types import Rollout

__all__ = ["load_rollouts", "save_rollouts"]

FORMAT = "tlt_lightning.rollouts/1"
FINISH_REASONS = ("eos", "length")


def _cat(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.to(dtype) for t in tensors]) if tensors else torch.zeros(0, dtype=dtype)


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


def save_rollouts(
    path: str | os.PathLike,
    rollouts: list[Rollout],
    metadata: dict[str, Any] | None = None,
    features: bool = True,
) -> Path:
    """Write ``rollouts`` and ``metadata`` (JSON-able) to ``path``, atomically.

    Args:
        features: also store the rollouts' ``features`` (all of them must have some, of one shape
            per token and one dtype); ``False``: tokens only.

    Example:
        >>> tokens, logprobs = torch.tensor([7, 2]), torch.tensor([-0.5, -0.1])
        >>> r = Rollout(torch.tensor([5, 6]), tokens, logprobs, "eos", 0.1, 0.2)
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "r.safetensors"
        >>> _ = save_rollouts(p, [r], {"task": "countdown"}, features=False)
        >>> loaded, meta = load_rollouts(p)
        >>> loaded[0].token_ids.tolist(), meta
        ([7, 2], {'task': 'countdown'})
    """
    for i, r in enumerate(rollouts):
        if r.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"rollouts[{i}].finish_reason must be one of {FINISH_REASONS}, got {r.finish_reason!r}"
            )
    tensors = {  # token ids as int32: any vocabulary fits
        "prompt_ids": _cat([r.prompt_ids for r in rollouts], torch.int32),
        "prompt_offsets": _offsets([r.prompt_ids.numel() for r in rollouts]),
        "token_ids": _cat([r.token_ids for r in rollouts], torch.int32),
        "logprobs": _cat([r.logprobs for r in rollouts], torch.float32),
        "token_offsets": _offsets([r.length for r in rollouts]),
        "eos": torch.tensor([r.finish_reason == "eos" for r in rollouts], dtype=torch.bool),
        "times": torch.tensor([[r.first_token_time, r.finish_time] for r in rollouts], dtype=torch.float64),
    }
    if features and rollouts:
        missing = [i for i, r in enumerate(rollouts) if r.features is None]
        if missing:
            raise ValueError(
                f"rollouts {missing[:5]} have no features: sample with RolloutConfig.feature_layers, "
                "or save with features=False"
            )
        tensors["features"] = _cat(
            [r.features for r in rollouts], rollouts[0].features.dtype
        )  # [sum T, C, H]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        tmp,
        metadata={"format": FORMAT, "metadata": json.dumps(metadata or {})},
    )
    os.replace(tmp, path)
    return path


def load_rollouts(path: str | os.PathLike) -> tuple[list[Rollout], dict[str, Any]]:
    """Read a file of :func:`save_rollouts`: ``(rollouts, metadata)``; ``features`` are ``None`` when
    the file has none.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a rollout file (or a corrupt one).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no rollout file at {path}")
    try:
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
        t = load_file(path)
    except (SafetensorError, OSError) as err:
        raise ValueError(
            f"{path} is not a readable rollout file (safetensors, from save_rollouts): {err}"
        ) from err
    if header.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a rollout file: format {header.get('format')!r}, expected {FORMAT!r}"
        )
    po, to = t["prompt_offsets"].tolist(), t["token_offsets"].tolist()
    feats = t.get("features")
    rollouts = [
        Rollout(
            prompt_ids=t["prompt_ids"][po[i] : po[i + 1]].long(),
            token_ids=t["token_ids"][to[i] : to[i + 1]].long(),
            logprobs=t["logprobs"][to[i] : to[i + 1]].clone(),
            finish_reason="eos" if bool(t["eos"][i]) else "length",
            first_token_time=float(t["times"][i, 0]),
            finish_time=float(t["times"][i, 1]),
            features=None if feats is None else feats[to[i] : to[i + 1]].clone(),
        )
        for i in range(len(po) - 1)
    ]
    return rollouts, json.loads(header["metadata"])
