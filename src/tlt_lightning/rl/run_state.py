"""What a GRPOModule checkpoint holds besides weights (``checkpoint["grpo"]``), and resuming from it.

A run resumed from a Lightning checkpoint (``Trainer.fit(ckpt_path=...)``, ``tlt-lightning fit
--ckpt_path``) continues bit for bit like the uninterrupted run, by default, whenever that run is
itself reproducible (same seed, machine, thread count and settings). The checkpoint holds everything
the next steps depend on: the policy and optimizer (Lightning), the prompt loader's position
(:class:`~tlt_lightning.rl.PromptIndexLoader`), this module's seed and the global torch / Python /
NumPy RNG states (``checkpoint["grpo"]``, 15 KB; rollout generators are a function of ``(seed,
global_step, rank)``), and the callbacks' states: the spot drafter's weights, optimizer and rollout
buffer (:class:`~tlt_lightning.callbacks.SpotDrafterCallback` ``save_buffer=True``, the default)
and the bandit's statistics and RNG (:class:`~tlt_lightning.callbacks.BanditCallback`, 9 KB). The
buffer is the only part that grows: the bf16 hidden-state features of recent responses (1.1 KB per
response token on SmolLM2-135M), at most ``config.buffer_mb`` (256 MiB). Measured: 2.2 MiB after 2 steps of
``configs/grpo_smollm2.yaml`` (64 responses of ~22 tokens; the whole checkpoint, policy and AdamW
included, is 1.67 GB), 0.18 MiB on tiny-llama after 4 steps of 16 x 16 tokens. What a
checkpoint cannot hold is the clock: a bandit that learns from wall time (the default;
``BanditCallback(reproducible=True)`` learns from a modelled cost) or drafter training bounded by
seconds (the spot config's ``training.max_seconds_per_rollout`` when the step bound is not
reached first, or ``training.paid_share_of_savings``, which prices speculation in seconds) makes the
uninterrupted run and the resumed one differ as two uninterrupted runs would.
Resuming with other settings (``seed``, ``optim.lr``, ...) is refused by ``tlt-lightning fit`` unless
``--resume_overrides=apply``; a changed seed then warns here. Resuming on other prompts (another task,
dataset, size or seed: :func:`prompt_source_identity`) is refused here, unless the module's
``resume_overrides`` is ``"apply"``.

Example:
    >>> rollout_seed(0, 5, 0) == rollout_seed(0, 5, 0) != rollout_seed(0, 6, 0)
    True
"""

from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from tlt_lightning.validation import check_resumed_settings

if TYPE_CHECKING:
    from tlt_lightning.rl.config import OptimConfig
    from tlt_lightning.rl.sources import PromptSource

__all__ = [
    "global_rng_state",
    "grpo_state",
    "prompt_source_identity",
    "restore_grpo_state",
    "rollout_seed",
    "set_global_rng_state",
]

FINGERPRINT_PROMPTS = 256
"""Prompts hashed into :func:`prompt_source_identity` (the first ones: another seed changes them)."""


def global_rng_state() -> dict[str, Any]:
    """The global random states (torch CPU and CUDA, Python, NumPy) in checkpointable form."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def set_global_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`global_rng_state` returned (CUDA states only on as many devices)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for the rollouts of ``step`` on ``rank``: a hash of the three, so steps never share
    one."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def grpo_state(seed: int, source: PromptSource | None) -> dict[str, Any]:
    """``checkpoint["grpo"]``: the seed, the global random states and which prompts the run trained on.

    Rollout generators derive from (seed, global_step, rank) and the prompt order from the loader
    state Lightning saves. The global RNGs (torch, Python, NumPy; ~7 KB) are saved too, so that
    anything drawing from them (a callback, user reward code) continues identically.
    """
    return {
        "version": 2,
        "seed": seed,
        "rng": global_rng_state(),
        "prompt_source": None if source is None else prompt_source_identity(source),
    }


def prompt_source_identity(source: PromptSource) -> dict[str, Any]:
    """What a checkpoint records of the prompts it trained on: the source's name, its size and a hash of
    its first :data:`FINGERPRINT_PROMPTS` prompts' token ids (another task, dataset, size or seed
    changes one of them)."""
    digest = hashlib.sha256()
    for index in range(min(len(source), FINGERPRINT_PROMPTS)):
        digest.update(torch.as_tensor(source.prompt_ids(index), dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
    return {"name": str(source.name), "size": len(source), "sha256": digest.hexdigest()[:16]}


def restore_grpo_state(
    checkpoint: dict[str, Any],
    seed: int,
    source: PromptSource | None,
    optim: OptimConfig,
    resume_overrides: str = "refuse",
) -> None:
    """Restore the global random states of ``checkpoint["grpo"]``, warning when the seed differs from the
    checkpoint's, and set the restored optimizer's lr and weight decay to ``optim``'s.

    Raises:
        ValueError: the prompt source differs from the checkpoint's (:func:`prompt_source_identity`) and
            ``resume_overrides`` is not ``"apply"``.
    """
    grpo = checkpoint.get("grpo", {})
    saved = grpo.get("seed")
    if saved is not None and saved != seed:
        warnings.warn(
            f"resuming with seed={seed} from a checkpoint trained with seed={saved}: "
            "rollouts will differ from the uninterrupted run",
            stacklevel=3,
        )
    if source is not None:
        now = prompt_source_identity(source)
        check_resumed_settings("prompt_source", grpo.get("prompt_source"), now, resume_overrides)
    if "rng" in grpo:
        set_global_rng_state(grpo["rng"])
    # The optimizer's moments are restored; its lr / weight decay are the module's settings (they
    # differ from the checkpoint's only when resumed with `--resume_overrides=apply`). An lr saved as a
    # tensor (torchao's optimizers) stays one.
    for state in checkpoint.get("optimizer_states", []):
        for group in state.get("param_groups", []):
            lr = group.get("lr")
            group["lr"] = torch.tensor(optim.lr, dtype=lr.dtype) if isinstance(lr, torch.Tensor) else optim.lr
            group["weight_decay"] = optim.weight_decay
