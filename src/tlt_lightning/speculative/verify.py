"""Lossless verification of speculative drafts: chains and trees, batched.

A verify step turns the target's distributions at the drafted positions into the tokens a rollout
emits: a prefix of the drafts followed by one token the target samples itself. The rules here are
exact: the emitted tokens have the same distribution as sampling the target token by token, for
any temperature, top-p or top-k, as long as the inputs say truthfully how the drafts were made.
The target distributions must come from :func:`~tlt_lightning.speculative.sampling.sampling_probs`
(the processed distribution the plain rollout samples from), never from raw logits.

Why tree verification (:func:`verify_tree`) is lossless. One sibling step is ordinary speculative
sampling with proposal ``q_j``: it outputs ``x`` with probability ``min(p, q_j)(x)`` and otherwise a
draw from the residual, so its output has law ``p`` *provided* the continuation after a rejection has
law ``normalise(max(0, p - q_j))``. The continuation is the same procedure on the remaining siblings,
whose next proposal ``q_{j+1}`` is the true law of the next sibling given the earlier ones; by
induction from the last sibling (which falls back to sampling the residual), the first emitted token
has law ``p``. Given that token came from accepting child ``c``, ``c``'s subtree was drafted from
``c``'s token alone, independent of the coins, so the same argument applies one level down with the
target's next-token distribution: the whole emitted sequence has the target's law. A node whose
proposal gives its token no mass (``q_j(x) = 0``: e.g. siblings drawn without replacement past the
end of ``q``'s support) is skipped, as if absent.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from tlt_lightning.speculative.sampling import sample
from tlt_lightning.speculative.tree import tree_attention_mask, tree_depths

__all__ = [
    "SiblingRule",
    "VerifyResult",
    "tree_attention_mask",
    "tree_depths",
    "verify_chain",
    "verify_tree",
]

SiblingRule = Literal["iid", "without_replacement", "deterministic"]
_SIBLING_RULES = ("iid", "without_replacement", "deterministic")


class VerifyResult(NamedTuple):
    """What one verify step emits, per batch row.

    Attributes:
        num_accepted: ``[B]`` int64, how many drafted tokens were accepted (``0..D``).
        next_token: ``[B]`` int64, the token sampled by the target after the accepted ones
            (a correction after a rejection, or the bonus token when the path ran out).
        accepted_nodes: ``[B, D]`` int64, indices of the accepted drafts in order, ``-1`` beyond
            ``num_accepted``. For a chain ``D = K`` and row ``b`` is ``0, 1, .., n_b - 1, -1, ..``;
            for a tree ``D`` is the number of levels and entries are node indices.
    """

    num_accepted: torch.Tensor
    next_token: torch.Tensor
    accepted_nodes: torch.Tensor

    def emitted(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """The tokens this step emits: the accepted drafts, then ``next_token``.

        Args:
            draft_tokens: ``[B, K]`` chain drafts or ``[B, N]`` tree tokens, as verified.

        Returns:
            ``[B, D + 1]`` int64; row ``b`` holds ``num_accepted[b] + 1`` tokens, then ``-1``.

        Example:
            >>> r = VerifyResult(torch.tensor([1]), torch.tensor([7]), torch.tensor([[0, -1]]))
            >>> r.emitted(torch.tensor([[5, 6]])).tolist()
            [[5, 7, -1]]
        """
        nodes = self.accepted_nodes
        accepted = draft_tokens.long().gather(1, nodes.clamp(min=0)).masked_fill(nodes < 0, -1)
        out = torch.cat([accepted, accepted.new_full((accepted.shape[0], 1), -1)], dim=1)
        return out.scatter(1, self.num_accepted[:, None], self.next_token[:, None])


def _check_probs(name: str, probs: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(probs.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(probs.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"{name} must be a float tensor of probabilities, got dtype {probs.dtype}")


def _check_tokens(name: str, tokens: torch.Tensor, ndim: int) -> None:
    if tokens.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {list(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got dtype {tokens.dtype}")


def _accept(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    # u < p/q without dividing. The second term makes p >= q an exact accept whatever the
    # rounding (so p == q accepts everything), but never accepts a token the target rules out.
    return (u * q_x < p_x) | ((p_x >= q_x) & (p_x > 0))


def _normalise(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    mass = weights.sum(-1, keepdim=True)
    return torch.where(mass > 0, weights / mass.clamp_min(torch.finfo(weights.dtype).tiny), fallback)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    # normalise(max(0, p - q)); its mass is the rejection probability, so it is 0 only when p == q
    # and no rejection can happen: then any row is right, and p keeps the result finite.
    return _normalise((p - q).clamp_min_(0), p)


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Speculative sampling over a chain of ``K`` drafts (Leviathan et al. 2023, Chen et al. 2023).

    Draft ``i`` (token ``x``) is accepted with probability ``min(1, p_i(x) / q_i(x))``, in order;
    at the first rejection ``i`` the next token is drawn from ``normalise(max(0, p_i - q_i))``, and
    when all ``K`` are accepted from the bonus distribution ``p_K``. The emitted tokens are then
    distributed exactly as ``K + 1`` (or fewer) tokens sampled from the target. A one-hot target
    (greedy) accepts exactly the prefix equal to the argmax and corrects with the argmax.

    Args:
        target_probs: ``[B, K + 1, V]`` the target's processed distribution at each draft position
            and at the bonus position (row ``i`` is conditioned on drafts ``< i``).
        draft_probs: ``[B, K, V]`` the distribution each draft was actually sampled from (one-hot
            for argmax drafts). Drafts need ``q_i(x) > 0``.
        draft_tokens: ``[B, K]`` int64 drafted token ids; ``K`` may be 0.
        generator: random source (on the probs' device) for every draw; same seed, same result.

    Returns:
        ``VerifyResult`` with ``accepted_nodes`` ``[B, K]``.

    Raises:
        ValueError: shapes disagree; the message names the argument.
        TypeError: token ids are not integers or probabilities are not floats.

    Example:
        >>> p = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])  # greedy target: argmax 1, then 0
        >>> q = torch.tensor([[[0.5, 0.5]]])
        >>> verify_chain(p, q, torch.tensor([[1]])).num_accepted.tolist()
        [1]
    """
    _check_tokens("draft_tokens", draft_tokens, 2)
    batch, k = draft_tokens.shape
    if target_probs.ndim != 3:
        raise ValueError(f"target_probs must have shape [B, K + 1, V], got {list(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    _check_probs("target_probs", target_probs, (batch, k + 1, vocab))
    _check_probs("draft_probs", draft_probs, (batch, k, vocab))
    device = target_probs.device
    tokens = draft_tokens.long().unsqueeze(-1)

    # Only the K gathered entries and two rows per batch element are read in float32.
    p_x = target_probs[:, :k].gather(2, tokens).squeeze(-1).float()
    q_x = draft_probs.gather(2, tokens).squeeze(-1).float()
    u = torch.rand(batch, k, generator=generator, device=device)
    accepted = _accept(u, p_x, q_x)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # length of the all-accepted prefix

    rows = torch.arange(batch, device=device)
    p = target_probs[rows, num_accepted].float()
    if k > 0:
        # Bonus rows (all accepted) subtract nothing: the residual of p against 0 is p itself.
        q = draft_probs[rows, num_accepted.clamp(max=k - 1)].float()
        p = _residual(p, q * (num_accepted < k).unsqueeze(-1))
    positions = torch.arange(k, device=device).expand(batch, k)
    nodes = positions.masked_fill(positions >= num_accepted.unsqueeze(-1), -1)
    return VerifyResult(num_accepted, sample(p, generator), nodes)


def verify_tree(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    siblings: SiblingRule,
) -> VerifyResult:
    """Lossless verification of a draft tree: recursive rejection sampling over siblings.

    The rule. Walk down from the root with ``p`` = the target distribution at the current node.
    Try the current node's children in index order; child ``j`` (token ``x``) comes with a
    proposal distribution ``q_j``, the law it was drawn from given its earlier siblings:

    - ``"iid"``: children are independent samples of the node's draft distribution ``q``
      (SpecInfer's multi-step speculative sampling): ``q_j = q``.
    - ``"without_replacement"``: children were drawn one after another from ``q`` without
      replacement (e.g. Gumbel-top-k, in order): ``q_j`` = ``q`` with earlier siblings' tokens
      zeroed and renormalised (recursive rejection sampling, Jeon et al. 2024).
    - ``"deterministic"``: the children are a function of the draft model alone, e.g. the top-k
      of ``q`` as EAGLE-2 and SGLang expand trees: ``q_j`` = one-hot on ``x``. ``draft_probs``
      is not read and may be ``None``.

    Accept child ``j`` with probability ``min(1, p(x) / q_j(x))`` and descend into it (``p``
    becomes the target's distribution after that node). On rejection set
    ``p <- normalise(max(0, p - q_j))`` and try the next sibling. When no child is left
    (all rejected, or a leaf) sample ``next_token`` from ``p``. For ``"deterministic"`` this reads:
    accept ``x`` with probability ``p(x)``, else zero ``x`` out of ``p`` and renormalise, which is
    exactly EAGLE's ``qx = 1`` rule and SGLang's target-only tree sampling.

    The module docstring says why this is lossless. Each rule is exact only for drafts made the way
    it says: the ``q``-based rules are biased for deterministic top-k children (the top token is not a
    sample of ``q``), and the deterministic rule wastes acceptance on sampled children. A one-hot
    (greedy) target accepts the first child whose token is the argmax under every rule, and corrects
    with the argmax.

    Args:
        target_probs: ``[B, N + 1, V]``; row 0 is the target's distribution at the root (for the
            root's children), row ``n + 1`` the distribution after node ``n``.
        draft_probs: ``[B, N + 1, V]`` laid out the same way: row 0 is the distribution the root's
            children were drawn from, row ``n + 1`` the one node ``n``'s children were drawn from.
            Unused (may be ``None``) for ``siblings="deterministic"``.
        tree_tokens: ``[B, N]`` int64 token of each node.
        parents: ``[N]`` or ``[B, N]`` int64 parent of each node, ``-1`` for the root's children;
            topologically ordered (``parents[n] < n``). On the CPU it costs no device sync.
        generator: random source (on the probs' device) for every draw.
        siblings: how each node's children were drawn, see above.

    Returns:
        ``VerifyResult`` with ``accepted_nodes`` ``[B, D]``, ``D`` = the number of tree levels.

    Raises:
        ValueError: bad shapes, parents not topologically ordered, or unknown ``siblings``.
        TypeError: token ids or parents are not integers, or probabilities are not floats.

    Example:
        >>> p = torch.tensor([[[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]])  # greedy: argmax 1 at root
        >>> r = verify_tree(p, None, torch.tensor([[0, 1]]), torch.tensor([-1, -1]),
        ...                 siblings="deterministic")
        >>> r.accepted_nodes.tolist(), r.next_token.tolist()
        ([[1]], [0])
    """
    _check_tree_inputs(target_probs, draft_probs, tree_tokens, parents, siblings)
    batch, n_nodes = tree_tokens.shape
    device = target_probs.device
    levels = int(tree_depths(parents).max()) + 1 if n_nodes else 0
    parents = parents.to(device=device, dtype=torch.long).expand(batch, n_nodes)
    u = torch.rand(batch, n_nodes, generator=generator, device=device)  # [B, N] one coin per node
    proposals = None if siblings == "deterministic" else draft_probs
    rejected_leave = siblings == "without_replacement"
    walk = _walk_tree(target_probs, proposals, tree_tokens.long(), parents, u, levels, rejected_leave)
    return VerifyResult(walk.num_accepted, sample(walk.p, generator), walk.nodes)


def _check_tree_inputs(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tree_tokens: torch.Tensor,
    parents: torch.Tensor,
    siblings: str,
) -> None:
    """The shape and dtype checks of :func:`verify_tree` (``parents``' order is checked by
    :func:`tree_depths`)."""
    if siblings not in _SIBLING_RULES:
        raise ValueError(f"siblings must be one of {_SIBLING_RULES}, got {siblings!r}")
    _check_tokens("tree_tokens", tree_tokens, 2)
    batch, n_nodes = tree_tokens.shape
    if target_probs.ndim != 3:
        raise ValueError(f"target_probs must have shape [B, N + 1, V], got {list(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    _check_probs("target_probs", target_probs, (batch, n_nodes + 1, vocab))
    if siblings != "deterministic":
        if draft_probs is None:
            raise ValueError(f"draft_probs is required for siblings={siblings!r}")
        _check_probs("draft_probs", draft_probs, (batch, n_nodes + 1, vocab))
    if tuple(parents.shape) not in ((n_nodes,), (batch, n_nodes)):
        raise ValueError(
            f"parents must have shape [{n_nodes}] or [{batch}, {n_nodes}], got {list(parents.shape)}"
        )


class _TreeWalk(NamedTuple):
    """Where every row's walk down the tree ended.

    Attributes:
        num_accepted: ``[B]`` int64, accepted nodes (one per level descended).
        nodes: ``[B, D]`` int64, the accepted nodes in order, ``-1`` beyond ``num_accepted``.
        p: ``[B, V]`` float32, the law ``next_token`` is drawn from (the target's after the last
            accepted node, less the residuals of the children rejected there).
    """

    num_accepted: torch.Tensor
    nodes: torch.Tensor
    p: torch.Tensor


def _walk_tree(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    u: torch.Tensor,
    levels: int,
    without_replacement: bool,
) -> _TreeWalk:
    """Recursive rejection sampling over the nodes in index order, all rows at once.

    Args:
        target_probs, draft_probs: ``[B, N + 1, V]`` as :func:`verify_tree` takes them;
            ``draft_probs`` is ``None`` for deterministic children (each one-hot on its token).
        tokens: ``[B, N]`` int64 token of each node.
        parents: ``[B, N]`` int64 parent of each node, ``-1`` for the root's children.
        u: ``[B, N]`` uniform coins, one per node.
        levels: ``D``, the number of tree levels.
        without_replacement: siblings were drawn without replacement (a rejected token leaves ``q``).
    """
    batch, n_nodes = tokens.shape
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    current = torch.full((batch,), -1, dtype=torch.long, device=device)  # [B] node each row stands at
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    nodes = torch.full((batch, levels), -1, dtype=torch.long, device=device)
    p = target_probs[:, 0].float()  # [B, V]
    q = None if draft_probs is None else draft_probs[:, 0].float()  # [B, V]
    # Index order visits every child of a node after the node and in sibling order; a row only
    # looks at the nodes whose parent is where it stands, so siblings may be interleaved.
    for n in range(n_nodes):
        x = tokens[:, n : n + 1]  # [B, 1]
        accept, reject, p_rejected = _try_child(p, q, x, u[:, n], current == parents[:, n])
        descend = accept.unsqueeze(1)  # [B, 1]
        p = torch.where(descend, target_probs[:, n + 1].float(), torch.where(reject, p_rejected, p))
        if q is not None:
            q = _next_proposal(q, x, reject, descend, draft_probs[:, n + 1], without_replacement)
        col = num_accepted.clamp(max=max(levels - 1, 0))
        nodes[rows, col] = torch.where(accept, n, nodes[rows, col])
        num_accepted = num_accepted + accept.long()
        current = torch.where(accept, n, current)
    return _TreeWalk(num_accepted, nodes, p)


def _try_child(
    p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor, u: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sibling step: the rows standing at a node's parent try the node.

    Args:
        p: ``[B, V]`` float32, the target law at each row's node, less its rejected children.
        q: ``[B, V]`` float32, the law this child was drawn from given its earlier siblings, or
            ``None`` for a deterministic child (``q`` one-hot on its token: accept with ``p(x)``,
            the residual is ``p`` with ``x`` zeroed).
        x: ``[B, 1]`` int64, the child's token.
        u: ``[B]`` uniform coins.
        candidate: ``[B]`` bool, the rows standing at the child's parent.

    Returns:
        ``accept`` ``[B]`` bool; ``reject`` ``[B, 1]`` bool, the candidates that rejected it; and
        ``[B, V]`` the residual law a rejecting row moves on with.
    """
    p_x = p.gather(1, x).squeeze(1)  # [B]
    if q is None:
        accept = candidate & _accept(u, p_x, torch.ones_like(p_x))
        p_rejected = _normalise(p.scatter(1, x, 0.0), p)
    else:
        # A node its proposal gives no mass (a sibling drawn past the end of q's support) is
        # skipped: never accepted, and p and q stay as they are.
        q_x = q.gather(1, x).squeeze(1)
        candidate = candidate & (q_x > 0)
        accept = candidate & _accept(u, p_x, q_x)
        p_rejected = _residual(p, q)
    return accept, (candidate & ~accept).unsqueeze(1), p_rejected


def _next_proposal(
    q: torch.Tensor,
    x: torch.Tensor,
    reject: torch.Tensor,
    descend: torch.Tensor,
    q_child: torch.Tensor,
    without_replacement: bool,
) -> torch.Tensor:
    """``[B, V]`` float32: the law the next node a row tries was drawn from.

    A row that rejected ``x`` drawn without replacement drops it from ``q``; a row that accepted it
    moves on to ``q_child`` (``[B, V]``), the law of the accepted node's children.
    """
    if without_replacement:
        q = torch.where(reject, _normalise(q.scatter(1, x, 0.0), q), q)
    return torch.where(descend, q_child.float(), q)
