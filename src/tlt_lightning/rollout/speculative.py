"""Lossless speculative decoding of rollouts: a drafter proposes, the target verifies in one forward.

:class:`SpeculativeStep` is a decode step for :class:`~tlt_lightning.rollout.engine.RolloutEngine`.
At every step it asks a :class:`~tlt_lightning.speculative.DraftStrategy` what to do for the
current number of active requests: plain decoding, or draft ``K`` tokens with the drafter and
verify them with :func:`~tlt_lightning.speculative.verify_chain` (or a tree of drafts, EAGLE-2's
deterministic one or sampled chains forking at the root, with
:func:`~tlt_lightning.speculative.verify_tree`). Speculation only runs below
``threshold`` active requests: at large batch the target is compute-bound and verifying extra
tokens costs nearly their full price, in the tail it is weight-bound and they are almost free.

Drafter bookkeeping. The drafter reads pairs ``(f_p, x_{p+1})``: the target's features at position
``p`` and the token that followed, from the last prompt position on (the context it is trained
with). Its own cache holds one entry per position; its committed length ``dl`` trails the target's ``L`` and catches up at the start of every speculative step, from
the features the engine keeps in the batch transcripts (so switching speculation on mid-rollout,
or after plain steps, needs no extra target forward). Draft positions beyond ``L`` are scratch and
are simply overwritten next time.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from tlt_lightning.models.kv_cache import KVCache
from tlt_lightning.models.target import TargetModel
from tlt_lightning.rollout.engine import ActiveBatch, Emission, PlainStep, RolloutEngine, causal_decode_mask
from tlt_lightning.rollout.types import RolloutConfig, RolloutResult
from tlt_lightning.speculative import (
    DraftSpec,
    DraftStrategy,
    as_strategy,
    sample,
    sampling_probs,
    verify_chain,
    verify_tree,
)
from tlt_lightning.speculative.verify import tree_attention_mask, tree_depths

__all__ = ["SpeculativeRolloutLoop", "SpeculativeStep"]


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


def _mask_from_positions(positions: torch.Tensor, kv_len: int, first: torch.Tensor) -> torch.Tensor:
    """``[n, 1, q, kv_len]``: query at position ``p`` of row ``i`` sees slots ``first[i] .. p``."""
    slots = torch.arange(kv_len, device=positions.device)
    return ((slots[None, None, :] <= positions[:, :, None]) & (slots[None, None, :] >= first[:, None, None]))[:, None]


class SpeculativeStep:
    """Decode step that speculates with ``drafter`` when its strategy says so.

    Args:
        target: the model being sampled.
        drafter: an EAGLE-style drafter for ``target`` (see :class:`~tlt_lightning.drafter.Drafter`);
            it takes the ``"packed"`` weight layout of a packed target (values unchanged).
        config: the rollout's sampling settings; ``config.feature_layers`` must start with the
            drafter's ``feature_layers``.
        strategy: picks the arm per step: a :class:`~tlt_lightning.speculative.DraftStrategy` (e.g.
            ``BEGMABStrategy``), or a :class:`~tlt_lightning.speculative.DraftSpec` to always use,
            or ``None`` to never speculate.
        threshold: speculate only while fewer than this many requests are active.
        max_depth: deepest draft a strategy may ask for (the target cache keeps that much room).
        drafter_context: where the drafter's context starts: ``"response"`` (the last prompt
            position, as drafters are trained here) or ``"prompt"`` (position 0).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter,
        config: RolloutConfig,
        strategy: DraftStrategy | DraftSpec | None,
        threshold: int = 32,
        max_depth: int = 32,
        drafter_context: str = "response",
    ) -> None:
        layers = tuple(drafter.config.feature_layers)
        if drafter_context not in ("response", "prompt"):
            raise ValueError(f"drafter_context must be 'response' or 'prompt', got {drafter_context!r}")
        if tuple(config.feature_layers[: len(layers)]) != layers:
            raise ValueError(
                f"config.feature_layers {config.feature_layers} must start with the drafter's feature_layers {layers}"
            )
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold}")
        if getattr(target, "weight_layout", None) == "packed" and getattr(drafter, "weight_layout", None) == "out_in":
            drafter.set_weight_layout("packed")  # same values; its drafts on a CPU get cheaper too
        self.target, self.drafter, self.config = target, drafter, config
        self.strategy, self.threshold, self.max_depth = as_strategy(strategy), threshold, max_depth
        self.drafter_context = drafter_context
        self.num_features = len(layers)
        self.plain = PlainStep(target, config)
        self.dcache: KVCache | None = None

    def start(self, batch: ActiveBatch) -> None:
        # One slot more than the target: padded catch-up queries write there (see _catch_up).
        self.dcache = self.drafter.new_cache(batch.cache.max_batch, batch.cache.max_len + 1)
        batch.aux_caches.append(self.dcache)
        self.dcache.lengths[: batch.n] = self._first(batch)

    def _first(self, batch: ActiveBatch) -> torch.Tensor:
        """``[n]`` first drafter slot of each active row.

        ``"response"``: the last prompt position, so the first pair is ``(f_{P-1}, first response
        token)``: the context drafters are trained with (see ``drafter.train``). ``"prompt"``: 0.
        """
        if self.drafter_context == "prompt":
            return torch.zeros(batch.n, dtype=torch.long, device=batch.prompt_len.device)
        return batch.prompt_len[batch.request[: batch.n]] - 1

    def __call__(self, batch: ActiveBatch, generator: torch.Generator | None) -> Emission:
        n = batch.n
        arm = self.strategy.select(n) if n < self.threshold else None
        start = time.perf_counter()
        if arm is not None and max(arm.num_steps, arm.num_draft_tokens) > self.max_depth:
            raise ValueError(
                f"strategy {arm} drafts deeper or verifies more tokens than max_depth={self.max_depth} "
                "(the room the caches keep past each row's length)"
            )
        if arm is None:
            emission = self.plain(batch, generator)
        elif arm.sampled:
            emission = self._sampled_tree(batch, arm, generator)
        elif arm.is_chain:
            emission = self._chain(batch, arm, generator)
        else:
            emission = self._tree(batch, arm, generator)
        if n < self.threshold:
            elapsed = time.perf_counter() - start
            self.strategy.update(n, arm, float(emission.counts.float().mean()), elapsed)
        return emission

    # ------------------------------------------------------------------------------------------
    def _draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V_draft]`` drafter logits -> ``[n, V_draft]`` the distribution drafts are sampled from.

        It lives on the draft vocabulary (the target's other tokens have probability 0, so the
        sampling transforms give the same distribution as on the full one, at a sixth of the cost
        on SmolLM2); the verifier gets it scattered into the target's with ``to_target_vocab``.
        """
        return sampling_probs(logits.float(), self.config.sampling)

    def _catch_up(self, batch: ActiveBatch) -> torch.Tensor:
        """Feed the drafter every pair it has not seen; return ``[n, H]`` its output at the last one.

        Row ``i`` has pairs at positions ``dl_i .. L_i - 1`` (``L_i >= dl_i + 1`` always: at least
        the pair ending in ``last_token`` is new). Rows with fewer pairs are padded; the padding
        writes to the scratch slot past the target's cache length and its outputs are ignored.
        """
        n, dc = batch.n, self.dcache
        L, dl = batch.lengths, dc.lengths[:n]
        count = L - dl
        q = int(count.max())
        offs = torch.arange(q, device=L.device)
        valid = offs[None] < count[:, None]
        positions = torch.where(valid, dl[:, None] + offs[None], dc.max_len - 1)
        src = torch.minimum(dl[:, None] + offs[None], (L - 1)[:, None])  # clamp padding to a real pair
        req = batch.request[:n, None]
        feats = batch.features[req, src, : self.num_features]  # [n, q, C, H]
        tokens = batch.seq[req, src + 1]
        kv_len = int(positions.max()) + 1
        mask = _mask_from_positions(positions, kv_len, self._first(batch))
        out = self.drafter(tokens, self.drafter.lift(feats), positions, mask, dc)
        dc.lengths[:n] = L
        return out[torch.arange(n, device=L.device), count - 1]

    def _chain(self, batch: ActiveBatch, arm: DraftSpec, generator: torch.Generator | None) -> Emission:
        """Draft up to ``arm.num_steps`` tokens one after another, verify them in one target forward.

        With ``arm.min_confidence`` the chain stops once no row's confidence (the product of its
        drafts' probabilities) reaches it: a draft the drafter itself doubts is likely rejected,
        and on a CPU each drafter pass costs a noticeable share of a step.
        """
        n, K = batch.n, arm.num_steps
        L = batch.lengths.clone()
        hidden = self._catch_up(batch)
        first = self._first(batch)
        drafts, draft_probs = [], []
        confidence = torch.ones(n, device=L.device)
        for k in range(K):
            logits = self.drafter.logits(hidden).float()
            q = self._draft_probs(logits)
            d = sample(q, generator)
            token = self.drafter.draft_to_target(d)
            drafts.append(token)
            draft_probs.append(q)
            if arm.min_confidence:
                if self.config.sampling.greedy:  # q is one-hot: rate the argmax by the raw distribution
                    confidence *= logits.softmax(-1).amax(-1)
                else:
                    confidence *= q.gather(-1, d[:, None])[:, 0]
                if not bool((confidence >= arm.min_confidence).any()):  # one sync per draft, only here
                    break
            if k + 1 < K:  # pair (h_k, d_k) sits at drafter position L + k
                pos = (L + k)[:, None]
                mask = _mask_from_positions(pos, int(pos.max()) + 1, first)
                hidden = self.drafter(token[:, None], hidden[:, None], pos, mask, self.dcache)[:, 0]
        self.dcache.lengths[:n] = L  # draft entries are scratch
        draft_tokens = torch.stack(drafts, 1)  # [n, K], K = the drafts made
        K = draft_tokens.shape[1]

        ids = torch.cat([batch.last_token[:n, None], draft_tokens], 1)
        positions = L[:, None] + torch.arange(K + 1, device=L.device)
        mask = causal_decode_mask(L, K + 1, int(positions.max()) + 1)
        out = self.target.forward(ids, positions, mask, batch.cache, self.config.feature_layers)
        target_probs = sampling_probs(self.target.lm_head(out.hidden), self.config.sampling)  # [n, K+1, V]
        q = self.drafter.to_target_vocab(torch.stack(draft_probs, 1))  # [n, K, V]
        result = verify_chain(target_probs, q, draft_tokens, generator)
        emitted = result.emitted(draft_tokens).clamp(min=0)  # [n, K+1]
        counts = result.num_accepted + 1
        batch.cache.lengths[:n] += counts  # last_token and the accepted drafts are now committed
        logprobs = target_probs.gather(-1, emitted[..., None]).squeeze(-1).log()
        if self.config.sampling.greedy:
            logprobs = torch.zeros_like(logprobs)
        return Emission(emitted, counts, logprobs, out.features, arm=arm, draft_depth=K)


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


class SpeculativeRolloutLoop:
    """Runs rollouts of prompt batches with lossless speculative decoding in the tail.

    Args:
        target: the policy being sampled.
        drafter: an EAGLE-style drafter for it.
        config: sampling and length settings (``feature_layers`` are extended with the drafter's).
        strategy: picks the arm per step (see :class:`SpeculativeStep`); default: a 4-token chain
            whenever speculation is on.
        threshold: speculate only while fewer than this many requests are active.
        max_depth: deepest draft a strategy may ask for.
        drafter_context: ``"response"`` or ``"prompt"``, see :class:`SpeculativeStep`.

    Example:
        >>> from tlt_lightning.models import HFTarget, load_model
        >>> from tlt_lightning.drafter import Drafter, DrafterConfig
        >>> target = HFTarget(load_model("tiny-llama").model)
        >>> loop = SpeculativeRolloutLoop(target, Drafter(DrafterConfig.from_target(target), target),
        ...                               RolloutConfig(max_new_tokens=8, temperature=0))
        >>> loop.generate([[5, 6, 7]]).rollouts[0].length
        8
    """

    def __init__(
        self,
        target: TargetModel,
        drafter,
        config: RolloutConfig | None = None,
        strategy: DraftStrategy | DraftSpec | None = DraftSpec(4),
        threshold: int = 32,
        max_depth: int = 32,
        drafter_context: str = "response",
    ) -> None:
        config = config or RolloutConfig()
        layers = tuple(drafter.config.feature_layers)
        extra = tuple(i for i in config.feature_layers if i not in layers)
        self.config = replace(config, feature_layers=layers + extra)
        self.drafter = drafter
        self.strategy = as_strategy(strategy)
        self.threshold, self.max_depth, self.drafter_context = threshold, max_depth, drafter_context
        self.engine = RolloutEngine(target, self.config, cache_margin=max_depth + 1)

    def generate(
        self, prompts: Sequence[Sequence[int]], generator: torch.Generator | None = None, progress: bool = False
    ) -> RolloutResult:
        """Sample one response per prompt; same distribution as plain decoding, fewer target passes."""
        step = SpeculativeStep(
            self.engine.target, self.drafter, self.config, self.strategy, self.threshold, self.max_depth,
            self.drafter_context,
        )
        return self.engine.generate(prompts, generator=generator, step=step, progress=progress)
