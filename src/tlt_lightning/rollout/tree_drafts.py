"""The tree arms of :class:`~tlt_lightning.rollout.speculative_step.SpeculativeStep`.

EAGLE-2's deterministic tree (the best nodes by cumulative draft log-probability) and sampled chains
forking at the root, both verified in one target forward with :func:`~tlt_lightning.speculative.verify_tree`.
"""

from __future__ import annotations

import functools
import itertools

import torch

from tlt_lightning.rollout.engine import ActiveBatch, Emission
from tlt_lightning.speculative import DraftSpec, sample, sampling_probs, verify_tree
from tlt_lightning.speculative.verify import tree_attention_mask, tree_depths

__all__ = ["TreeDrafts"]


@functools.lru_cache(maxsize=64)
def _level_tree(widths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree whose level ``d`` holds ``widths[d]`` nodes, the children of a node consecutive.

    Returns:
        ``parents`` ``[N]`` (``-1``: the root's children), ``depth`` ``[N]`` and ``anc`` ``[N, N]``
        (:func:`~tlt_lightning.speculative.tree_attention_mask`), ``N = sum(widths)``.

    Example:
        >>> _level_tree((2, 4, 4))[0].tolist()
        [-1, -1, 0, 0, 1, 1, 2, 3, 4, 5]
    """
    parents, start = [-1] * widths[0], 0
    for above, w in zip(widths, widths[1:]):
        parents += [start + j // (w // above) for j in range(w)]
        start += above
    parents = torch.tensor(parents)
    return parents, tree_depths(parents), tree_attention_mask(parents)


class TreeDrafts:
    """Mixin of :class:`~tlt_lightning.rollout.speculative_step.SpeculativeStep`: drafting and verifying trees.

    Uses the step's ``target``, ``drafter``, ``config``, ``dcache``, ``_catch_up`` and ``_draft_probs``.
    """

    def _tree(self, batch: ActiveBatch, arm: DraftSpec, generator: torch.Generator | None) -> Emission:
        """Grow a draft tree (EAGLE-2 style), verify its best nodes in one target forward.

        Each of ``arm.num_steps`` levels expands the ``topk`` best nodes of the previous level into
        their ``topk`` most likely children and keeps the ``topk`` best by cumulative draft
        log-probability; the ``num_draft_tokens`` best nodes overall form the tree that is verified.
        Children are a deterministic function of the drafter (top-k of its raw distribution), so
        :func:`~tlt_lightning.speculative.verify_tree` with ``siblings="deterministic"`` keeps the
        output distribution exactly the target's, at any temperature.
        """
        n, k, depth, N = batch.n, arm.topk, arm.num_steps, arm.num_draft_tokens
        device = batch.cache.lengths.device
        L = batch.lengths.clone()
        rows = torch.arange(n, device=device)
        hidden = self._catch_up(batch)
        first = self._first(batch)
        P = k * depth  # pool: level-major, k nodes per level
        tokens = torch.zeros(n, P, dtype=torch.long, device=device)
        parents = torch.full((n, P), -1, dtype=torch.long, device=device)
        scores = torch.zeros(n, P, device=device)
        anc = torch.zeros(n, P, P, dtype=torch.bool, device=device)  # anc[i, a, b]: b is a or its ancestor
        level = torch.arange(k, device=device)
        logp = self.drafter.logits(hidden).float().log_softmax(-1)  # [n, Vd]
        scores[:, :k], top = logp.topk(k, dim=-1)
        tokens[:, :k] = self.drafter.draft_to_target(top)
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
            mask = torch.where(committed[:, None], True, sees_node & (in_tree >= 0)[:, None] & (in_tree < d * k)[:, None])[:, None]
            positions = (L + d - 1)[:, None].expand(n, k)
            out = self.drafter(tokens[:, idx], parent_hidden, positions, mask, self.dcache, slots=slots)
            logp = self.drafter.logits(out).float().log_softmax(-1)  # [n, k, Vd]
            cand = (scores[:, idx, None] + logp).flatten(1)
            best, flat = cand.topk(k, dim=-1)
            parent_local, child = flat // logp.shape[-1], flat % logp.shape[-1]
            new = level + d * k
            tokens[:, new] = self.drafter.draft_to_target(child)
            scores[:, new] = best
            parents[:, new] = idx[parent_local]
            anc[:, new] = anc[rows[:, None], idx[parent_local]]
            anc[:, new, new] = True
            parent_hidden = out.gather(1, parent_local[..., None].expand(n, k, out.shape[-1]))
        self.dcache.lengths[:n] = L  # draft entries are scratch

        # The N best nodes: ancestors score higher than descendants (log-probs <= 0; ties broken by
        # depth), so the selection is a tree; sorting keeps parents before children.
        node_depth = torch.arange(P, device=device) // k
        sel = (scores - 1e-6 * node_depth).topk(N, dim=-1).indices.sort(-1).values  # [n, N]
        remap = torch.full((n, P), -1, dtype=torch.long, device=device)
        remap[rows[:, None], sel] = torch.arange(N, device=device)
        sel_parents = parents.gather(1, sel)
        sel_parents = torch.where(sel_parents < 0, -1, remap.gather(1, sel_parents.clamp(min=0)))
        sel_tokens = tokens.gather(1, sel)
        sel_anc = anc[rows[:, None, None], sel[:, :, None], sel[:, None, :]]  # [n, N, N]

        return self._verify_tree(batch, L, sel_tokens, sel_parents, node_depth[sel], sel_anc, None,
                                 "deterministic", arm, generator)

    def _sampled_tree(
        self, batch: ActiveBatch, arm: DraftSpec, generator: torch.Generator | None
    ) -> Emission:
        """A sampled tree (see :class:`~tlt_lightning.speculative.DraftSpec`), verified in one forward.

        At its first ``arm.fork_depth`` levels every node's ``arm.topk`` children are drawn without
        replacement from the distribution a chain's draft is sampled from, in draw order
        (Gumbel-top-k; past the end of its support, e.g. under top-p, the extra children get no
        mass and the verifier skips them); deeper, every node has one child sampled like a chain
        draft. :func:`~tlt_lightning.speculative.verify_tree` with ``siblings="without_replacement"``
        keeps the output distribution exactly the target's. With a greedy target the forking
        nodes' children are the drafter's top-k and the others its argmax
        (``siblings="deterministic"``). Nodes are numbered level by level, a node's children
        consecutive; node ``m``'s drafter entry sits in the scratch slot ``L + m``.
        """
        n, widths = batch.n, arm.level_widths
        device = batch.cache.lengths.device
        parents, depth, anc = (t.to(device) for t in _level_tree(widths))
        starts = [0, *itertools.accumulate(widths)]  # level d: nodes starts[d] .. starts[d + 1] - 1
        N = starts[-1]
        L = batch.lengths.clone()
        L_max = int(L.max())  # the one sync of the draft loop
        first = self._first(batch)
        greedy = self.config.sampling.greedy
        hidden = self._catch_up(batch)[:, None]  # [n, w, H]: outputs of the nodes whose children come next
        tokens, probs = [], []  # per level: [n, w_d] target ids; [n, w_{d-1}, Vd] their law
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
                hidden = self.drafter(tokens[-1], parent_out, positions, mask, self.dcache, slots=slots)
            branches = w // hidden.shape[1]
            logits = self.drafter.logits(hidden)  # [n, w_{d-1}, Vd]
            if greedy:
                children = logits.topk(branches, dim=-1).indices
            else:
                q = self._draft_probs(logits)
                probs.append(q)
                if branches == 1:
                    children = sample(q, generator)[..., None]
                else:  # Gumbel-top-k: the k largest perturbed log-probs, in order, are k draws w/o replacement
                    u = torch.rand(q.shape, generator=generator, device=device).clamp_(min=1e-20)
                    children = (q.log() - (-u.log()).log()).topk(branches, dim=-1).indices
            tokens.append(self.drafter.draft_to_target(children.flatten(1)))
        self.dcache.lengths[:n] = L  # draft entries are scratch

        draft_probs = None
        if not greedy:  # row 0: the root's children's law; row m + 1: node m's children's (leaves: unused)
            leaves = probs[-1].new_zeros(n, widths[-1], probs[-1].shape[-1])
            draft_probs = self.drafter.to_target_vocab(torch.cat([*probs, leaves], 1))  # [n, N + 1, V]
        siblings = "deterministic" if greedy else "without_replacement"
        return self._verify_tree(batch, L, torch.cat(tokens, 1), parents, depth, anc.expand(n, N, N),
                                 draft_probs, siblings, arm, generator)

    def _verify_tree(
        self,
        batch: ActiveBatch,
        L: torch.Tensor,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        depth: torch.Tensor,
        anc: torch.Tensor,
        draft_probs: torch.Tensor | None,
        siblings: str,
        arm: DraftSpec,
        generator: torch.Generator | None,
    ) -> Emission:
        """Verify a draft tree in one target forward and commit what is accepted.

        Args:
            L: ``[n]`` the rows' committed lengths.
            tokens: ``[n, N]`` node tokens, parents before children.
            parents: ``[N]`` or ``[n, N]`` parent of each node (``-1``: the root's children).
            depth: ``[N]`` or ``[n, N]`` depth of each node (0: the root's children).
            anc: ``[n, N, N]`` bool, ``anc[i, a, b]``: node ``b`` is ``a`` or one of its ancestors.
            draft_probs, siblings: as :func:`~tlt_lightning.speculative.verify_tree` takes them.
        """
        n, N = tokens.shape
        device = L.device
        rows = torch.arange(n, device=device)
        # Target: last_token at slot L, node j at slot L + 1 + j, rotary position L + 1 + depth.
        ids = torch.cat([batch.last_token[:n, None], tokens], 1)
        positions = torch.cat([L[:, None], L[:, None] + 1 + depth], 1)
        slots = L[:, None] + torch.arange(N + 1, device=device)
        kv_len = int(L.max()) + N + 1
        key = torch.arange(kv_len, device=device)
        rel = key[None, :] - L[:, None] - 1  # [n, kv]: node index of each slot
        sees = anc.gather(2, rel.clamp(0, N - 1)[:, None].expand(n, N, kv_len)) & (rel < N)[:, None]
        node_mask = torch.where((rel < 0)[:, None], True, sees)  # committed slots and last_token
        root_mask = (rel < 0)[:, None]
        mask = torch.cat([root_mask, node_mask], 1)[:, None]
        out = self.target.forward(ids, positions, mask, batch.cache, self.config.feature_layers, slots=slots)
        target_probs = sampling_probs(self.target.lm_head(out.hidden), self.config.sampling)  # [n, N+1, V]
        result = verify_tree(target_probs, draft_probs, tokens, parents, generator, siblings=siblings)

        # Emitted: accepted nodes' tokens, then next_token. Token i was predicted at verify index
        # 0 (i = 0) or 1 + accepted_nodes[i - 1].
        a = result.num_accepted
        acc = result.accepted_nodes  # [n, D]
        D = acc.shape[1]
        emitted = torch.cat([tokens.gather(1, acc.clamp(min=0)), torch.zeros_like(a)[:, None]], 1)
        emitted[rows, a] = result.next_token
        pred_idx = torch.cat([torch.zeros_like(a)[:, None], 1 + acc.clamp(min=0)], 1)  # [n, D + 1]
        logprobs = target_probs[rows[:, None], pred_idx].gather(-1, emitted[..., None]).squeeze(-1).log()
        if self.config.sampling.greedy:
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
