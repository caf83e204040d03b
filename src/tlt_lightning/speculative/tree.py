"""The shape of a draft tree given by its parents: node depths and the tree attention mask.

A tree of ``N`` draft nodes is given by ``parents`` (``[N]`` or ``[B, N]`` int64): ``parents[n]`` is
the node ``n`` continues, ``-1`` for the root's children, and ``parents[n] < n`` (topological order),
as :func:`~tlt_lightning.speculative.verify_tree` takes it.
"""

from __future__ import annotations

import torch

__all__ = ["tree_attention_mask", "tree_depths"]


def _check_parents(parents: torch.Tensor) -> None:
    if parents.ndim not in (1, 2):
        raise ValueError(f"parents must have shape [N] or [B, N], got {list(parents.shape)}")
    if parents.is_floating_point() or parents.is_complex() or parents.dtype == torch.bool:
        raise TypeError(f"parents must be an integer tensor of token ids, got dtype {parents.dtype}")
    index = torch.arange(parents.shape[-1], device=parents.device)
    if bool(((parents < -1) | (parents >= index)).any()):
        raise ValueError(
            "parents must satisfy -1 <= parents[n] < n (topological order, -1 = root), "
            f"got {parents.tolist()}"
        )


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each tree node: 0 for the root's children.

    Node ``n`` is the ``depths[n] + 1``-th token after the root, so its position id is
    ``root_position + 1 + depths[n]`` and an accepted node sits in ``accepted_nodes[:, depths[n]]``.

    Args:
        parents: ``[N]`` or ``[B, N]`` int64, ``-1`` for the root's children, ``parents[n] < n``.

    Returns:
        int64 tensor shaped like ``parents``.

    Raises:
        ValueError: bad shape or not topologically ordered.

    Example:
        >>> tree_depths(torch.tensor([-1, -1, 0, 2])).tolist()
        [0, 0, 1, 2]
    """
    _check_parents(parents)
    parents = parents.long()
    depths = torch.zeros_like(parents)
    for n in range(parents.shape[-1]):
        parent = parents[..., n : n + 1]
        above = depths.gather(-1, parent.clamp(min=0)) + 1
        depths[..., n : n + 1] = torch.where(parent < 0, 0, above)
    return depths


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """Which tree nodes each node may attend to: itself and its ancestors.

    Args:
        parents: ``[N]`` or ``[B, N]`` int64, ``-1`` for the root's children, ``parents[n] < n``.

    Returns:
        ``[N, N]`` or ``[B, N, N]`` bool; ``mask[..., i, j]`` is true iff ``j == i`` or ``j`` is an
        ancestor of ``i``. The committed prefix is visible to all nodes and is not included.

    Raises:
        ValueError: bad shape or not topologically ordered.

    Example:
        >>> tree_attention_mask(torch.tensor([-1, 0, -1])).int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    _check_parents(parents)
    parents = parents.long()
    n_nodes = parents.shape[-1]
    eye = torch.eye(n_nodes, dtype=torch.bool, device=parents.device)
    mask = eye.expand(*parents.shape[:-1], n_nodes, n_nodes).clone()
    for n in range(n_nodes):
        parent = parents[..., n]
        index = parent.clamp(min=0)[..., None, None].expand(*parent.shape, 1, n_nodes)
        ancestors = mask.gather(-2, index).squeeze(-2) & (parent >= 0).unsqueeze(-1)
        mask[..., n, :] |= ancestors
    return mask
