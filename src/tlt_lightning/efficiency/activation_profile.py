"""What checkpointing each block would save and cost: a profile measured on one real forward pass.

Memory model (bytes of activations, as :class:`~tlt_lightning.efficiency.memory.ActivationMemoryMeter`
counts them). Walking the forward in order with ``m`` = bytes held so far: a block adds ``held``
(its saved tensors and output) or, checkpointed, only ``output`` plus any *transient* input it keeps
alive (an input the rest of the forward would have freed, such as position ids or a mask: paid
once, however many checkpointed blocks share it). While a block runs (forward, or its
recomputation during backward, when everything before it is still held and everything after it is
freed) memory reaches ``m + peak``. The code between blocks (embeddings, norms, residual adds, the
head, the loss) is a :class:`Gap` that is never checkpointed. An output no later op reads (attention
weights returned next to the attention output) counts as dropped by the caller at once. The predicted
peak is the largest of these points; with HF Llama models it matches the meter's measurement to the
byte without checkpointing and errs high (never low, in our tests) with it: recomputation stops early.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tlt_lightning.efficiency.memory import ActivationMemoryMeter
from tlt_lightning.validation import check, is_int

__all__ = ["ActivationCheckpointPlan", "ActivationCheckpointProfile", "BlockCost", "Gap", "profile_blocks"]


class BlockCost(NamedTuple):
    """One block's profile. ``held >= output``; ``peak >= held``."""

    held_bytes: int  # created in the block and alive when it returns: saved for backward + output
    output_bytes: int  # the part of ``held_bytes`` that is its output (all a checkpointed block keeps)
    peak_bytes: int  # the most bytes created in the block alive at once while it runs
    seconds: float  # forward time: what checkpointing costs in recomputation
    # Indices into ``ActivationCheckpointProfile.transient_bytes``: inputs that would be freed before the
    # end of the forward but that a checkpoint keeps alive (position ids, masks: often shared by all blocks).
    transient: tuple[int, ...] = ()


class Gap(NamedTuple):
    """The code before, between or after the blocks (never checkpointed)."""

    delta_bytes: int  # change of held bytes across the gap (negative when it frees more than it makes)
    peak_bytes: int  # the most bytes above the level at the gap's start


@dataclass(frozen=True)
class ActivationCheckpointProfile:
    """Costs of ``n`` blocks and of the ``n + 1`` gaps around them, in execution order.

    ``gaps[i]`` runs before ``blocks[i]``; ``gaps[n]`` is everything after the last block.
    ``transient_bytes[j]`` is the size of the ``j``-th transient input: held from the first
    checkpointed block that takes it (paid once, however many blocks share it).
    """

    blocks: tuple[BlockCost, ...]
    gaps: tuple[Gap, ...]
    transient_bytes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.gaps) != len(self.blocks) + 1:
            raise ValueError(
                f"gaps must have len(blocks) + 1 = {len(self.blocks) + 1} entries, got {len(self.gaps)}"
            )
        for i, block in enumerate(self.blocks):
            if any(not 0 <= j < len(self.transient_bytes) for j in block.transient):
                raise ValueError(
                    f"blocks[{i}].transient must index transient_bytes (len {len(self.transient_bytes)}), "
                    f"got {block.transient}"
                )

    def __len__(self) -> int:
        return len(self.blocks)

    def peak_bytes(self, checkpointed: Sequence[bool]) -> int:
        """Predicted peak activation bytes of a training step with these blocks checkpointed."""
        if len(checkpointed) != len(self.blocks):
            raise ValueError(f"checkpointed must have {len(self.blocks)} entries, got {len(checkpointed)}")
        held = peak = 0
        paid: set[int] = set()
        for gap, block, ckpt in zip(self.gaps, self.blocks, checkpointed):
            peak = max(peak, held + gap.peak_bytes)
            held += gap.delta_bytes
            peak = max(peak, held + block.peak_bytes)
            held += block.output_bytes if ckpt else block.held_bytes
            if ckpt:
                held += sum(self.transient_bytes[j] for j in set(block.transient) - paid)
                paid.update(block.transient)
        return max(peak, held + self.gaps[-1].peak_bytes, held + self.gaps[-1].delta_bytes)

    def recompute_seconds(self, checkpointed: Sequence[bool]) -> float:
        return sum(b.seconds for b, c in zip(self.blocks, checkpointed) if c)

    @property
    def min_peak_bytes(self) -> int:
        """The lowest peak any plan reaches (every block checkpointed)."""
        return self.peak_bytes([True] * len(self.blocks))

    @property
    def max_peak_bytes(self) -> int:
        """The peak without checkpointing."""
        return self.peak_bytes([False] * len(self.blocks))

    def plan(self, checkpointed: Sequence[bool], method: str) -> ActivationCheckpointPlan:
        flags = tuple(bool(c) for c in checkpointed)
        return ActivationCheckpointPlan(flags, self.peak_bytes(flags), self.recompute_seconds(flags), method)


class ActivationCheckpointPlan(NamedTuple):
    """Which blocks to checkpoint, with the profile's predictions for it."""

    checkpointed: tuple[bool, ...]
    peak_bytes: int
    recompute_seconds: float
    method: str

    @property
    def indices(self) -> list[int]:
        return [i for i, c in enumerate(self.checkpointed) if c]


def profile_blocks(
    blocks: Sequence[nn.Module], forward: Callable[[], Any], repeats: int = 3
) -> ActivationCheckpointProfile:
    """Measure each block's activation memory and forward time on ``forward()``.

    One run under an :class:`~tlt_lightning.efficiency.memory.ActivationMemoryMeter` gives the
    bytes; ``repeats`` more runs without it give the times (median per block). ``forward`` runs with
    grad mode on and should compute the loss as training does (its graph is dropped, no backward).

    Args:
        blocks: the candidate modules in execution order, each called exactly once per ``forward()``,
            none inside another.
        forward: one training forward pass, e.g. ``lambda: model(ids, labels=ids, use_cache=False).loss``.
        repeats: timed runs (>= 1).

    Returns:
        A :class:`ActivationCheckpointProfile` with ``len(blocks)`` entries.

    Raises:
        ValueError: no blocks, ``repeats < 1``, a block whose ``forward`` is patched (already
            checkpointed), nested blocks, a block not called exactly once, or blocks out of order.

    Example:
        >>> from tlt_lightning.models import load_model
        >>> model = load_model("tiny-llama").model.train()
        >>> ids = torch.randint(3, 128, (2, 32))
        >>> step = lambda: model(ids, labels=ids, use_cache=False).loss
        >>> profile = profile_blocks(list(model.model.layers), step)
        >>> len(profile), profile.max_peak_bytes > profile.min_peak_bytes
        (4, True)
    """
    _check_blocks(blocks, repeats)
    n = len(blocks)
    recorder = _Recorder(n)
    handles = []
    for i, block in enumerate(blocks):
        pre = block.register_forward_pre_hook(lambda m, a, k, i=i: recorder.pre(i, a, k), with_kwargs=True)
        handles.append(pre)
        handles.append(block.register_forward_hook(lambda m, a, o, i=i: recorder.post(i, o)))
    runs: list[list[float]] = []
    try:
        measured = _metered_run(recorder, forward)
        for _ in range(repeats):
            recorder.reset(None)
            with torch.enable_grad():
                out = forward()
                del out
            recorder.check()
            runs.append([t[0] for t in recorder.times])
    finally:
        for h in handles:
            h.remove()
    seconds = [statistics.median(r[i] for r in runs) for i in range(n)]
    return _profile(measured, seconds)


def _check_blocks(blocks: Sequence[nn.Module], repeats: int) -> None:
    if len(blocks) == 0:
        raise ValueError("blocks must hold at least one module, got none")
    check(is_int(repeats) and repeats >= 1, "repeats", repeats, "an int >= 1")
    patched = [i for i, b in enumerate(blocks) if "forward" in b.__dict__]
    if patched:
        raise ValueError(
            f"blocks {patched} have a patched forward (already checkpointed?): remove it before profiling"
        )


class _Measured(NamedTuple):
    """What the metered run of :func:`profile_blocks` saw, per block (``costs``, ``inputs``, ``output_bytes``)
    and per gap between blocks (``gaps``); ``transient``: the tensors made before a block and freed
    before the forward ended."""

    costs: list[tuple[int, int]]
    inputs: list[set[Any]]
    output_bytes: list[int]
    gaps: list[Gap]
    transient: list[Any]


class _Recorder:
    """The blocks' forward hooks: call counts, order and times of a run, and with a meter its bytes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reset(None)

    def reset(self, meter: ActivationMemoryMeter | None) -> None:
        """Start a run (metered when ``meter`` is given)."""
        self.meter = meter
        self.active: int | None = None
        self.calls, self.times = [0] * self.n, [[] for _ in range(self.n)]
        self.order: list[int] = []
        self.gaps: list[Gap] = []
        self.costs: list[tuple[int, int]] = []
        self.inputs: list[set[Any]] = []
        self.outputs: list[set[Any]] = []
        self.level, self.mark, self.start = 0, 0, 0.0

    def gap(self) -> None:
        """Close the gap since the last block (metered runs)."""
        meter = self.meter
        self.gaps.append(Gap(meter.live_bytes - self.level, meter.peak_bytes - self.level))

    def pre(self, i: int, args: Any, kwargs: Any) -> None:
        if self.active is not None:
            raise ValueError(f"blocks must not be nested: block {i} runs inside block {self.active}")
        self.active, self.calls[i] = i, self.calls[i] + 1
        self.order.append(i)
        meter = self.meter
        if meter is not None:
            self.gap()
            self.level, self.mark = meter.live_bytes, meter.sequence
            inputs = (meter.identify(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            self.inputs.append({ident for ident in inputs if ident is not None})
            meter.reset_peak()
        self.start = time.perf_counter()

    def post(self, i: int, output: Any) -> None:
        self.times[i].append(time.perf_counter() - self.start)
        self.active = None
        meter = self.meter
        if meter is not None:
            outputs = (meter.identify(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor))
            made = {o for o in outputs if o is not None and o[1] >= self.mark}
            for ident in made:
                meter.watch(ident)
            self.outputs.append(made)
            self.costs.append((meter.live_bytes - self.level, meter.peak_bytes - self.level))
            self.level = meter.live_bytes
            meter.reset_peak()

    def check(self) -> None:
        """Every block ran exactly once, in the listed order (``ValueError`` otherwise)."""
        bad = [i for i, c in enumerate(self.calls) if c != 1]
        if bad:
            raise ValueError(
                f"blocks must each run exactly once per forward; calls per block: {self.calls} "
                f"(blocks {bad} differ)"
            )
        if self.order != list(range(self.n)):
            raise ValueError(f"blocks must be listed in execution order; they ran in the order {self.order}")


def _metered_run(recorder: _Recorder, forward: Callable[[], Any]) -> _Measured:
    """One run of ``forward`` under an :class:`ActivationMemoryMeter`: the bytes of every block and gap."""
    meter = ActivationMemoryMeter()
    recorder.reset(meter)
    with torch.enable_grad():
        with meter:
            out = forward()  # held until measured: its graph is the memory kept for backward
        recorder.gap()
        measured = _Measured(
            recorder.costs,
            recorder.inputs,
            # Outputs no later op reads (attention weights next to the attention output) are
            # dropped by the caller at once: a checkpointed block does not keep them.
            [sum(o[2] for o in outs if meter.was_read(o)) for outs in recorder.outputs],
            recorder.gaps,
            # Inputs made before a block and freed before the forward ended: a checkpoint keeps them.
            sorted({ident for ins in recorder.inputs for ident in ins if not meter.is_alive(ident)}),
        )
        del out
    recorder.check()
    return measured


def _profile(measured: _Measured, seconds: list[float]) -> ActivationCheckpointProfile:
    """The profile of the metered run's bytes and the timed runs' median ``seconds`` per block."""
    index = {ident: j for j, ident in enumerate(measured.transient)}
    costs = []
    for (held, peak), out, sec, ins in zip(measured.costs, measured.output_bytes, seconds, measured.inputs):
        transient_ids = tuple(sorted(index[x] for x in ins if x in index))
        costs.append(BlockCost(held, min(out, held), max(peak, held), sec, transient_ids))
    gaps = tuple(Gap(g.delta_bytes, max(g.peak_bytes, g.delta_bytes, 0)) for g in measured.gaps)
    return ActivationCheckpointProfile(tuple(costs), gaps, tuple(ident[2] for ident in measured.transient))
