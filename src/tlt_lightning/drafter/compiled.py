"""The drafter's step through compiled, bucketed graphs: the target's mechanism, one layer (opt-in).

:meth:`~tlt_lightning.drafter.Drafter.use_compiled_steps` routes the drafter's cached forwards
(catching up on the target's features, each draft step) through graphs compiled per shape bucket by
:class:`~tlt_lightning.models.compiled.BucketedGraphs`: the same buckets, padding to a spare cache
slot, compile timing and eager fallback (with one warning) as ``HFTarget(decode="compiled")``. What is
traced is the drafter's own layer code (:meth:`Drafter.layers_forward`) over a
:class:`~tlt_lightning.models.compiled.StaticKV`, so there is one copy of the math. The LM head stays
one eager product (a single op: nothing to fuse; packed on a CPU with the ``"packed"`` layout), and
the layer's linears multiply by the parameters (weights are graph inputs: training between
rollouts is followed).

Numerics as the target's compiled path: rounding-level differences from the eager drafter, which
can change a draft but never what is emitted (speculative sampling is exact for any drafter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tlt_lightning.models.compiled import BucketedGraphs, CompileConfig, StaticKV
from tlt_lightning.models.kv_cache import KVCache

if TYPE_CHECKING:
    from tlt_lightning.drafter.model import Drafter

__all__ = ["CompiledDrafterStep"]


def _static_step(
    drafter: Drafter,
    tokens: torch.Tensor,
    hidden_in: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    store = StaticKV(keys, values, slots, kv_len=mask.shape[-1])
    return drafter.layers_forward(tokens, hidden_in, positions, mask, store)


class CompiledDrafterStep(BucketedGraphs):
    """Cached drafter forwards through compiled graphs, one per bucket (see the module docstring).

    Args:
        drafter: the drafter whose step is compiled (read at each call: weights may change).
        config: buckets and mode (default :class:`~tlt_lightning.models.compiled.CompileConfig`).
    """

    def __init__(self, drafter: Drafter, config: CompileConfig | None = None) -> None:
        super().__init__(drafter, config, "compiled drafter step")
        self.drafter = drafter
        self.compile(_static_step)

    def __call__(
        self,
        tokens: torch.Tensor,
        hidden_in: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``[n, q, H]`` :meth:`Drafter.forward`'s output through the bucket's graph, or ``None`` (run eager).

        ``cache.begin_step`` was called.
        """
        p = self.pad(tokens, positions, attention_mask, cache, slots)
        if p is None:
            return None
        hidden = hidden_in.new_zeros(p.bucket.batch, p.bucket.queries, hidden_in.shape[-1])
        hidden[: p.n, : p.q] = hidden_in
        self.mark_rows(hidden)
        out = self.launch(
            p.bucket,
            self.drafter,
            p.input_ids,
            hidden,
            p.positions,
            p.slots,
            p.mask,
            *self.layer_views(cache),
        )
        return self.unpad(out, p)
