"""The drafter's references to its target's token embedding and LM head (borrowed, never copied)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from tlt_lightning.models.target import HFTarget, TargetModel

__all__ = ["TargetRefs", "TiedHead", "target_refs"]


class TargetRefs:
    """Unregistered references to the target's embedding and LM head: shared, never copied."""

    __slots__ = ("embedding", "head")

    def __init__(self, embedding: nn.Module, head: nn.Module) -> None:
        self.embedding, self.head = embedding, head

    def __deepcopy__(self, memo: dict) -> TargetRefs:
        return self  # a copied drafter (e.g. for an async checkpoint) still reads the live target


class TiedHead:
    """An LM head tied to an embedding (torchtune's ``TiedLinear``): ``weight`` ``[V, H]`` is the
    embedding's own parameter, read at each use (so it follows in-place updates); no bias."""

    __slots__ = ("tied",)
    bias = None

    def __init__(self, tied: nn.Module) -> None:
        self.tied = tied

    @property
    def weight(self) -> torch.Tensor:
        return self.tied.weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., V]`` logits."""
        return F.linear(hidden, self.weight)


def _torchtune_head(output: object) -> nn.Module | TiedHead:
    from torchtune.modules import TiedLinear  # torchtune is imported: a TorchtuneTarget exists

    if isinstance(output, TiedLinear):
        return TiedHead(output.tied_module)
    if isinstance(output, nn.Linear):
        return output
    raise TypeError(
        "Drafter needs the torchtune decoder's output to be an nn.Linear or a TiedLinear "
        f"(a [V, H] weight), got {type(output).__name__}"
    )


def target_refs(target: TargetModel) -> TargetRefs:
    """The embedding and LM head modules of ``target``, for a drafter to borrow.

    Raises:
        TypeError: ``target`` is not an :class:`~tlt_lightning.models.HFTarget` or a ``TorchtuneTarget``,
            or a torchtune decoder's output is neither an ``nn.Linear`` nor a ``TiedLinear``.
    """
    if isinstance(target, HFTarget):
        return TargetRefs(target.model.get_input_embeddings(), target.model.get_output_embeddings())
    # Only a loaded adapter module can have made `target`: never import torchtune for the check.
    tt = sys.modules.get("tlt_lightning.models.torchtune_target")
    if tt is not None and isinstance(target, tt.TorchtuneTarget):
        return TargetRefs(target.decoder.tok_embeddings, _torchtune_head(target.decoder.output))
    raise TypeError(
        "Drafter needs the target's embedding and LM head modules; supported adapters: HFTarget and "
        f"TorchtuneTarget (torchtune extra), got {type(target).__name__}"
    )
