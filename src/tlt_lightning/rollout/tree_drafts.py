"""The tree arms of :class:`~tlt_lightning.rollout.speculative_step.SpeculativeStep`, as plain functions.

EAGLE-2's deterministic tree (the best nodes by cumulative draft log-probability, :func:`draft_best_tree`)
and sampled chains forking at the root (:func:`draft_sampled_tree`) each return a :class:`DraftTree`,
which :func:`verify_draft_tree` verifies in one target forward with
:func:`~tlt_lightning.speculative.verify_tree` and commits.

The drafter's cache holds one entry per committed position; a tree's nodes are drafted into scratch slots
past each row's committed length ``L`` (overwritten next time), and the cache's lengths are set back to
``L`` when the tree is drafted.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import torch

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.drafting import DraftModel, draft_probs
from tlt_lightning.rollout.engine import ActiveBatch, Emission
from tlt_lightning.rollout.types import RolloutConfig
from tlt_lightning.speculative import DraftSpec, SamplingParams, sample, sampling_probs, verify_tree
from tlt_lightning.speculative.tree import tree_attention_mask, tree_depths

__all__ = ["DraftTree", "draft_best_tree", "draft_sampled_tree", "level_tree", "verify_draft_tree"]


class DraftTree(NamedTuple):
    """A tree of drafts for ``n`` rows, ``N`` nodes each, numbered parents before children.

    Attributes:
        tokens: ``[n, N]`` the nodes' target token ids.
        parents: ``[N]`` or ``[n, N]`` parent of each node (``-1``: the root's children).
        depth: ``[N]`` or ``[n, N]`` depth of each node (0: the root's children).
        anc: ``[n, N, N]`` bool, ``anc[i, a, b]``: node ``b`` is ``a`` or one of its ancestors.
        draft_probs: ``[n, N + 1, V]`` or ``None``, and ``siblings``: as
            :func:`~tlt_lightning.speculative.verify_tree` takes them.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    anc: torch.Tensor
    draft_probs: torch.Tensor | None
    siblings: str


@functools.lru_cache(maxsize=64)
def level_tree(widths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree whose level ``d`` holds ``widths[d]`` nodes, the children of a node consecutive.

    Returns:
        ``parents`` ``[N]`` (``-1``: the root's children), ``depth`` ``[N]`` and ``anc`` ``[N, N]``
        (:func:`~tlt_lightning.speculative.tree.tree_attention_mask`), ``N = sum(widths)``.

    Example:
        >>> level_tree((2, 4, 4))[0].tolist()
        [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    """
    parents, start = [-1] * widths[0], 0
    for above, w in zip(widths, widths[1:]):
        parents += [start + j // (w // above) for j in range(w)]
        start += above
    parents = torch.tensor(parents)
    return parents, tree_depths(parents), tree_attention_mask(parents)


def draft_best_tree(
    drafter: DraftModel,
    cache: KVCache,
    hidden: torch.Tensor,
    lengths: torch.Tensor,
    first: torch.Tensor,
    arm: DraftSpec,
) -> DraftTree:
    """Grow a draft tree (EAGLE-2 style) and keep its best nodes.

    Each of ``arm.num_steps`` levels expands the ``topk`` best nodes of the previous level into
    their ``topk`` most likely children and keeps the ``topk`` best by cumulative draft
    log-probability; the ``num_draft_tokens`` best nodes overall form the tree that is verified.
    Children are a deterministic function of the drafter (top-k of its raw distribution), so
    :func:`~tlt_lightning.speculative.verify_tree` with ``siblings="deterministic"`` keeps the
    output distribution exactly the target's, at any temperature.

    Args:
        drafter: the drafter; ``cache`` is its cache, caught up to ``lengths``.
        hidden: ``[n, H]`` its output at each row's last committed pair.
        lengths: ``[n]`` the rows' committed lengths ``L``.
        first: ``[n]`` each row's first drafter slot (the slots before it are not attended).
        arm: the tree's shape (``num_steps`` levels, ``topk``, ``num_draft_tokens`` nodes kept).
    """
    n, k, depth = hidden.shape[0], arm.topk, arm.num_steps
    device, L = lengths.device, lengths
    rows = torch.arange(n, device=device)
    P = k * depth  # pool: level-major, k nodes per level
    tokens = torch.zeros(n, P, dtype=torch.long, device=device)
    parents = torch.full((n, P), -1, dtype=torch.long, device=device)
    scores = torch.zeros(n, P, device=device)
    anc = torch.zeros(n, P, P, dtype=torch.bool, device=device)  # anc[i, a, b]: b is a or its ancestor
    level = torch.arange(k, device=device)
    logp = drafter.logits(hidden).float().log_softmax(-1)  # [n, Vd]
    scores[:, :k], top = logp.topk(k, dim=-1)
    tokens[:, :k] = drafter.draft_to_target(top)
    anc[:, level, level] = True
    parent_hidden = hidden[:, None].expand(n, k, hidden.shape[-1])
    for d in range(1, depth):
        idx = level + (d - 1) * k  # the frontier
        slots = L[:, None] + idx[None]
        kv_len = int(L.max()) + d * k
        key = torch.arange(kv_len, device=device)
        in_tree = key[None, :] - L[:, None]  # [n, kv]: pool index of each slot (< 0: committed)
        sees_node = anc[:, idx].gather(2, in_tree.clamp(0, P - 1)[:, None].expand(n, k, kv_len))
        committed = (in_tree < 0) & (key[None, :] >= first[:, None])
        drafted = sees_node & (in_tree >= 0)[:, None] & (in_tree < d * k)[:, None]
        mask = torch.where(committed[:, None], True, drafted)[:, None]
        positions = (L + d - 1)[:, None].expand(n, k)
        out = drafter(tokens[:, idx], parent_hidden, positions, mask, cache, slots=slots)
        logp = drafter.logits(out).float().log_softmax(-1)  # [n, k, Vd]
        cand = (scores[:, idx, None] + logp).flatten(1)
        best, flat = cand.topk(k, dim=-1)
        parent_local, child = flat // logp.shape[-1], flat % logp.shape[-1]
        new = level + d * k
        tokens[:, new] = drafter.draft_to_target(child)
        scores[:, new] = best
        parents[:, new] = idx[parent_local]
        anc[:, new] = anc[rows[:, None], idx[parent_local]]
        anc[:, new, new] = True
        parent_hidden = out.gather(1, parent_local[..., None].expand(n, k, out.shape[-1]))
    cache.lengths[:n] = L  # draft entries are scratch
    return _best_nodes(tokens, parents, scores, anc, k, arm.num_draft_tokens)


def _best_nodes(
    tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, anc: torch.Tensor, k: int, N: int
) -> DraftTree:
    """The ``N`` best of a pool of ``[n, P]`` nodes, ``k`` per level, as a tree.

    Ancestors score higher than descendants (log-probs <= 0; ties broken by depth), so the selection is
    a tree; sorting keeps parents before children.
    """
    n, P = tokens.shape
    device = tokens.device
    rows = torch.arange(n, device=device)
    node_depth = torch.arange(P, device=device) // k
    sel = (scores - 1e-6 * node_depth).topk(N, dim=-1).indices.sort(-1).values  # [n, N]
    remap = torch.full((n, P), -1, dtype=torch.long, device=device)
    remap[rows[:, None], sel] = torch.arange(N, device=device)
    sel_parents = parents.gather(1, sel)
    sel_parents = torch.where(sel_parents < 0, -1, remap.gather(1, sel_parents.clamp(min=0)))
    sel_tokens = tokens.gather(1, sel)
    sel_anc = anc[rows[:, None, None], sel[:, :, None], sel[:, None, :]]  # [n, N, N]
    return DraftTree(sel_tokens, sel_parents, node_depth[sel], sel_anc, None, "deterministic")


def draft_sampled_tree(
    drafter: DraftModel,
    cache: KVCache,
    hidden: torch.Tensor,
    lengths: torch.Tensor,
    first: torch.Tensor,
    arm: DraftSpec,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> DraftTree:
    """A sampled tree (see :class:`~tlt_lightning.speculative.DraftSpec`).

    At its first ``arm.fork_depth`` levels every node's ``arm.topk`` children are drawn without
    replacement from the distribution a chain's draft is sampled from (:func:`draft_probs`), in draw
    order (Gumbel-top-k; past the end of its support, e.g. under top-p, the extra children get no
    mass and the verifier skips them); deeper, every node has one child sampled like a chain
    draft. :func:`~tlt_lightning.speculative.verify_tree` with ``siblings="without_replacement"``
    keeps the output distribution exactly the target's. With a greedy target the forking
    nodes' children are the drafter's top-k and the others its argmax
    (``siblings="deterministic"``). Nodes are numbered level by level, a node's children
    consecutive; node ``m``'s drafter entry sits in the scratch slot ``L + m``.

    Args:
        drafter, cache, hidden, lengths, first: as :func:`draft_best_tree` takes them.
        arm: the tree's shape (``level_widths``).
        sampling: the rollout's sampling settings.
        generator: the random source of the draws.
    """
    n, widths = hidden.shape[0], arm.level_widths
    device, L = lengths.device, lengths
    parents, depth, anc = (t.to(device) for t in level_tree(widths))
    starts = [0, *itertools.accumulate(widths)]  # level d: nodes starts[d] .. starts[d + 1] - 1
    N = starts[-1]
    L_max = int(L.max())  # the one sync of the draft loop
    greedy = sampling.greedy
    hidden = hidden[:, None]  # [n, w, H]: outputs of the nodes whose children come next
    tokens, probs = [], []  # per level: [n, w_d] target ids; [n, w_{d-1}, Vd] their law
    branches = 1  # children per node of the level fed last (set below once level d is drafted)
    for d, w in enumerate(widths):
        if d > 0:  # feed level d - 1: pairs (its parents' outputs, its tokens) at position L + d - 1
            idx = torch.arange(starts[d - 1], starts[d], device=device)
            key = torch.arange(L_max + starts[d], device=device)
            rel = key[None, :] - L[:, None]  # [n, kv]: node of each scratch slot (< 0: committed)
            fed = (rel >= 0) & (rel < starts[d])
            sees = anc[idx[None, :, None], rel.clamp(0, N - 1)[:, None, :]] & fed[:, None]
            committed = (rel < 0) & (key[None, :] >= first[:, None])
            mask = (committed[:, None] | sees)[:, None]  # [n, 1, w_{d-1}, kv]
            positions = (L + d - 1)[:, None].expand(n, idx.numel())
            parent_out = hidden.repeat_interleave(branches, dim=1)  # a node's children are consecutive
            slots = L[:, None] + idx[None]
            hidden = drafter(tokens[-1], parent_out, positions, mask, cache, slots=slots)
        branches = w // hidden.shape[1]
        logits = drafter.logits(hidden)  # [n, w_{d-1}, Vd]
        if greedy:
            children = logits.topk(branches, dim=-1).indices
        else:
            q = draft_probs(logits, sampling)
            probs.append(q)
            if branches == 1:
                children = sample(q, generator)[..., None]
            else:  # Gumbel-top-k: the k largest perturbed log-probs, in order, are k draws w/o replacement
                u = torch.rand(q.shape, generator=generator, device=device).clamp_(min=1e-20)
                children = (q.log() - (-u.log()).log()).topk(branches, dim=-1).indices
        tokens.append(drafter.draft_to_target(children.flatten(1)))
    cache.lengths[:n] = L  # draft entries are scratch

    tree_probs = None
    if not greedy:  # row 0: the root's children's law; row m + 1: node m's children's (leaves: unused)
        leaves = probs[-1].new_zeros(n, widths[-1], probs[-1].shape[-1])
        tree_probs = drafter.to_target_vocab(torch.cat([*probs, leaves], 1))  # [n, N + 1, V]
    siblings = "deterministic" if greedy else "without_replacement"
    return DraftTree(torch.cat(tokens, 1), parents, depth, anc.expand(n, N, N), tree_probs, siblings)


def verify_draft_tree(
    target: TargetModel,
    batch: ActiveBatch,
    lengths: torch.Tensor,
    tree: DraftTree,
    config: RolloutConfig,
    arm: DraftSpec,
    generator: torch.Generator | None,
) -> Emission:
    """Verify a draft tree in one target forward and commit what is accepted.

    Args:
        target: the model being sampled; ``batch.cache`` is its cache.
        batch: the active rows.
        lengths: ``[n]`` the rows' committed lengths ``L``.
        tree: the drafts.
        config: the rollout's settings (``sampling``, ``feature_layers``).
        arm: the arm the tree was drafted for (reported in the emission).
        generator: the random source of the verification.
    """
    L, tokens = lengths, tree.tokens
    n, N = tokens.shape
    device = L.device
    rows = torch.arange(n, device=device)
    # Target: last_token at slot L, node j at slot L + 1 + j, rotary position L + 1 + depth.
    ids = torch.cat([batch.last_token[:n, None], tokens], 1)
    positions = torch.cat([L[:, None], L[:, None] + 1 + tree.depth], 1)
    slots = L[:, None] + torch.arange(N + 1, device=device)
    kv_len = int(L.max()) + N + 1
    key = torch.arange(kv_len, device=device)
    rel = key[None, :] - L[:, None] - 1  # [n, kv]: node index of each slot
    sees = tree.anc.gather(2, rel.clamp(0, N - 1)[:, None].expand(n, N, kv_len)) & (rel < N)[:, None]
    node_mask = torch.where((rel < 0)[:, None], True, sees)  # committed slots and last_token
    root_mask = (rel < 0)[:, None]
    mask = torch.cat([root_mask, node_mask], 1)[:, None]
    out = target.forward(ids, positions, mask, batch.cache, config.feature_layers, slots=slots)
    target_probs = sampling_probs(target.lm_head(out.hidden), config.sampling)  # [n, N+1, V]
    result = verify_tree(
        target_probs, tree.draft_probs, tokens, tree.parents, generator, siblings=tree.siblings
    )

    # Emitted: accepted nodes' tokens, then next_token. Token i was predicted at verify index
    # 0 (i = 0) or 1 + accepted_nodes[i - 1].
    a = result.num_accepted
    acc = result.accepted_nodes  # [n, D]
    D = acc.shape[1]
    emitted = torch.cat([tokens.gather(1, acc.clamp(min=0)), torch.zeros_like(a)[:, None]], 1)
    emitted[rows, a] = result.next_token
    pred_idx = torch.cat([torch.zeros_like(a)[:, None], 1 + acc.clamp(min=0)], 1)  # [n, D + 1]
    logprobs = target_probs[rows[:, None], pred_idx].gather(-1, emitted[..., None]).squeeze(-1).log()
    if config.sampling.greedy:
        logprobs = torch.zeros_like(logprobs)
    features = None
    if out.features is not None:
        features = out.features[rows[:, None], pred_idx]
    # Commit: move accepted nodes' keys/values from their slots to follow last_token.
    offs = torch.arange(D, device=device)
    src = torch.where(offs[None] < a[:, None], L[:, None] + 1 + acc.clamp(min=0), L[:, None] + 1 + offs[None])
    batch.cache.gather_positions(rows, src, L + 1)
    batch.cache.lengths[:n] += a + 1
    return Emission(emitted, a + 1, logprobs, features, arm=arm, draft_depth=arm.num_steps)
