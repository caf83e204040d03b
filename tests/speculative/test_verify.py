"""Verification is lossless: emitted tokens follow the target, checked with chi-square tests.

The target and the drafter are small Markov chains (``P[prev] -> next``, ``Q[prev] -> next``) over
a tiny vocabulary, so the exact law of any emitted sequence is known in closed form. Each test
runs many independent rollouts as one batch (rows), drafting, verifying and continuing until every
row has emitted ``length`` tokens, then compares the empirical joint law with the Markov chain's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tlt_lightning.speculative import (
    SamplingParams,
    VerifyResult,
    sample,
    sampling_probs,
    verify_chain,
    verify_tree,
)

ALPHA = 1e-3
START = 0
# Root children 0, 1, 5 (interleaved with deeper nodes on purpose), depth 3, 8 nodes.
TREE = [-1, -1, 0, 1, 0, -1, 2, 2]

Step = Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def markov(vocab: int, p_params: SamplingParams, q_params: SamplingParams, seed: int):
    """Target and draft transition tables ``[V, V]``; the draft is a noisy copy of the target."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * 1.2
    noisy = logits + torch.randn(vocab, vocab, generator=g) * 0.8
    return sampling_probs(logits, p_params), sampling_probs(noisy, q_params)


def chain_step(p_table: torch.Tensor, q_table: torch.Tensor, k: int) -> Step:
    def step(state: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        prev, tokens, drafts = state, [], []
        for _ in range(k):
            drafts.append(q_table[prev])
            prev = sample(drafts[-1], g)
            tokens.append(prev)
        draft_tokens = torch.stack(tokens, 1) if k else state.new_zeros(len(state), 0)
        draft_probs = torch.stack(drafts, 1) if k else q_table.new_zeros(len(state), 0, q_table.shape[1])
        target_probs = p_table[torch.cat([state[:, None], draft_tokens], 1)]
        result = verify_chain(target_probs, draft_probs, draft_tokens, g)
        return result.emitted(draft_tokens), result.num_accepted + 1

    return step


def draft_tree(state, q_table, parents, siblings, g):
    """Tree tokens ``[B, N]`` drawn from the draft chain the way ``siblings`` says."""
    tokens = state.new_zeros(len(state), len(parents))
    for parent in [-1, *range(len(parents))]:
        children = [n for n, par in enumerate(parents) if par == parent]
        if not children:
            continue
        q = q_table[state if parent < 0 else tokens[:, parent]]
        if siblings == "iid":
            picks = sample(q.unsqueeze(1).expand(-1, len(children), -1), g)
        elif siblings == "without_replacement":  # Gumbel-top-k = ordered sampling without replacement
            gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=g).clamp_min(1e-20)))
            picks = (q.log() + gumbel).topk(len(children), -1).indices
        else:  # deterministic: EAGLE-style top-k of the draft distribution
            picks = q.topk(len(children), -1).indices
        tokens[:, children] = picks
    return tokens


def tree_step(p_table, q_table, parents, drafted: str, verified: str | None = None) -> Step:
    def step(state: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = draft_tree(state, q_table, parents, drafted, g)
        context = torch.cat([state[:, None], tokens], 1)
        result = verify_tree(
            p_table[context], q_table[context], tokens, torch.tensor(parents), g, siblings=verified or drafted
        )
        return result.emitted(tokens), result.num_accepted + 1

    return step


def simulate(step: Step, rows: int, length: int, seed: int) -> torch.Tensor:
    """Run speculative rollouts from ``START`` until each row emitted ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((rows, length), -1)
    filled = torch.zeros(rows, dtype=torch.long)
    state = torch.full((rows,), START)
    index = torch.arange(rows)
    while int(filled.min()) < length:
        emitted, count = step(state, g)
        for j in range(emitted.shape[1]):
            ok = (j < count) & (filled + j < length)
            out[index[ok], (filled + j)[ok]] = emitted[ok, j]
        filled += count
        state = emitted[index, count - 1]
    return out


def markov_law(p_table: torch.Tensor, length: int) -> np.ndarray:
    """Exact law of the first ``length`` tokens after ``START``, flattened over ``V**length``."""
    p = p_table.double().numpy()
    law = p[START]
    for _ in range(length - 1):
        law = law[..., None] * p.reshape((1,) * (law.ndim - 1) + p.shape)
    return law.reshape(-1)


def chi_square_pvalue(sequences: torch.Tensor, law: np.ndarray, vocab: int) -> float:
    """p-value of the sequences under ``law``; impossible sequences must never appear."""
    weights = vocab ** np.arange(sequences.shape[1])[::-1]
    counts = np.bincount(sequences.numpy() @ weights, minlength=law.size)
    possible = law > 0
    assert counts[~possible].sum() == 0, "emitted a sequence the target cannot produce"
    observed, expected = counts[possible], law[possible] / law[possible].sum() * counts.sum()
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if observed.size < 2:
        return 1.0
    return float(chisquare(observed, expected).pvalue)


TEMP1 = SamplingParams(temperature=1.0)
TOP_P = SamplingParams(temperature=1.0, top_p=0.9)
TOP_K = SamplingParams(temperature=0.8, top_k=3)


# ---------------------------------------------------------------- chain: the law of emitted tokens


@pytest.mark.parametrize(
    ("p_params", "q_params"), [(TEMP1, TEMP1), (TOP_P, TOP_P), (TOP_P, TEMP1), (TOP_K, TOP_P)]
)
def test_chain_first_token_follows_target(p_params, q_params) -> None:
    p_table, q_table = markov(8, p_params, q_params, seed=1)
    tokens = simulate(chain_step(p_table, q_table, k=3), rows=25_000, length=1, seed=2)
    assert chi_square_pvalue(tokens, markov_law(p_table, 1), 8) > ALPHA


@pytest.mark.parametrize(("p_params", "q_params"), [(TEMP1, TEMP1), (TOP_P, TOP_P), (TOP_K, TEMP1)])
def test_chain_joint_of_two_tokens_follows_target(p_params, q_params) -> None:
    p_table, q_table = markov(6, p_params, q_params, seed=3)
    tokens = simulate(chain_step(p_table, q_table, k=2), rows=40_000, length=2, seed=4)
    assert chi_square_pvalue(tokens, markov_law(p_table, 2), 6) > ALPHA


def test_chain_joint_of_three_tokens_with_zero_drafts_and_long_chains() -> None:
    p_table, q_table = markov(4, TOP_P, TEMP1, seed=5)
    law = markov_law(p_table, 3)
    for k in (0, 1, 4):
        tokens = simulate(chain_step(p_table, q_table, k=k), rows=20_000, length=3, seed=6 + k)
        assert chi_square_pvalue(tokens, law, 4) > ALPHA, f"K={k}"


def test_chain_test_detects_a_biased_verifier() -> None:
    # Power check: claiming the drafts came from the target (q := p) must be caught.
    p_table, q_table = markov(6, TEMP1, TEMP1, seed=3)

    def lying_step(state, g):
        drafts = sample(q_table[state], g)[:, None]
        target = p_table[torch.cat([state[:, None], drafts], 1)]
        result = verify_chain(target, target[:, :1], drafts, g)
        return result.emitted(drafts), result.num_accepted + 1

    tokens = simulate(lying_step, rows=40_000, length=2, seed=4)
    assert chi_square_pvalue(tokens, markov_law(p_table, 2), 6) < 1e-6


# ----------------------------------------------------------------- tree: the law of emitted tokens


@pytest.mark.parametrize(
    ("siblings", "p_params", "q_params"),
    [
        ("iid", TEMP1, TEMP1),
        ("iid", TOP_P, TOP_P),
        ("without_replacement", TEMP1, TEMP1),
        ("without_replacement", TOP_P, TEMP1),
        ("deterministic", TEMP1, TEMP1),
        ("deterministic", TOP_P, TOP_K),
    ],
)
def test_tree_joint_of_three_tokens_follows_target(siblings, p_params, q_params) -> None:
    p_table, q_table = markov(5, p_params, q_params, seed=11)
    tokens = simulate(tree_step(p_table, q_table, TREE, siblings), rows=40_000, length=3, seed=12)
    assert chi_square_pvalue(tokens, markov_law(p_table, 3), 5) > ALPHA


@pytest.mark.parametrize("wrong_rule", ["iid", "without_replacement"])
def test_q_based_rules_are_biased_for_top_k_children(wrong_rule: str) -> None:
    # Top-k children are not samples of q: verifying them with q's ratios must fail the test,
    # which is why deterministic children need siblings="deterministic".
    p_table, q_table = markov(5, TEMP1, TEMP1, seed=11)
    step = tree_step(p_table, q_table, TREE, drafted="deterministic", verified=wrong_rule)
    tokens = simulate(step, rows=40_000, length=2, seed=12)
    assert chi_square_pvalue(tokens, markov_law(p_table, 2), 5) < 1e-6


def test_tree_acceptance_beats_chain_of_same_depth() -> None:
    p_table, q_table = markov(5, TEMP1, TEMP1, seed=11)
    g = torch.Generator().manual_seed(0)
    state = torch.zeros(20_000, dtype=torch.long)
    _, tree_count = tree_step(p_table, q_table, TREE, "iid")(state, g)
    _, chain_count = chain_step(p_table, q_table, k=3)(state, g)
    assert tree_count.float().mean() > chain_count.float().mean()


# ----------------------------------------------------------------------------- degenerate inputs


@pytest.mark.parametrize("params", [TEMP1, TOP_P, TOP_K])
def test_chain_accepts_everything_when_draft_equals_target(params) -> None:
    g = torch.Generator().manual_seed(0)
    probs = sampling_probs(torch.randn(500, 6, 50, generator=g), params)
    drafts = sample(probs[:, :5], g)
    result = verify_chain(probs, probs[:, :5].clone(), drafts, g)
    assert (result.num_accepted == 5).all()
    assert torch.equal(result.accepted_nodes, torch.arange(5).expand(500, 5))


@pytest.mark.parametrize("siblings", ["iid", "without_replacement"])
def test_tree_follows_first_children_to_full_depth_when_draft_equals_target(siblings) -> None:
    g = torch.Generator().manual_seed(0)
    parents = [-1, 0, -1, 1, 0, 3]  # first-child path 0 -> 1 -> 3 -> 5 is the deepest
    probs = sampling_probs(torch.randn(300, 7, 40, generator=g), TOP_P)
    tokens = torch.empty(300, 6, dtype=torch.long)
    for n, parent in enumerate(parents):  # distinct siblings so both rules' assumptions hold
        q = probs[:, parent + 1].clone()
        for m in range(n):
            if parents[m] == parent:
                q[torch.arange(300), tokens[:, m]] = 0
        tokens[:, n] = sample(q, g)
    result = verify_tree(probs, probs.clone(), tokens, torch.tensor(parents), g, siblings=siblings)
    assert (result.num_accepted == 4).all()
    assert torch.equal(result.accepted_nodes, torch.tensor([0, 1, 3, 5]).expand(300, 4))


def test_chain_with_impossible_draft_falls_back_to_target() -> None:
    # q(x) = p(x) = 0 is invalid input, but must still emit a token from p, not NaN or an error.
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]]]).expand(1000, -1, -1)
    result = verify_chain(p, p[:, :1], torch.full((1000, 1), 2), torch.Generator().manual_seed(0))
    assert (result.num_accepted == 0).all()
    assert set(result.next_token.tolist()) == {0, 1}


def test_siblings_past_the_end_of_the_proposal_are_skipped() -> None:
    """q has one token; the second sibling (drawn "without replacement" past q's support) has no
    mass: it is never accepted and the emitted token is still distributed as p."""
    n = 20_000
    p = torch.tensor([0.3, 0.5, 0.2])
    q = torch.tensor([1.0, 0.0, 0.0])
    target = p.expand(n, 3, 3).clone()  # rows: root, after node 0, after node 1
    draft = q.expand(n, 3, 3).clone()
    tokens = torch.tensor([[0, 1]]).expand(n, 2)
    result = verify_tree(
        target,
        draft,
        tokens,
        torch.tensor([-1, -1]),
        torch.Generator().manual_seed(0),
        siblings="without_replacement",
    )
    assert not (result.accepted_nodes == 1).any()
    first = torch.where(result.num_accepted > 0, 0, result.next_token)  # node 0 carries token 0
    _, pvalue = chisquare(torch.bincount(first, minlength=3).numpy(), (p * n).numpy())
    assert pvalue > ALPHA


def test_zero_drafts_sample_the_bonus_token() -> None:
    target = torch.nn.functional.one_hot(torch.tensor([[3], [1]]), 5).float()
    result = verify_chain(target, torch.zeros(2, 0, 5), torch.zeros(2, 0, dtype=torch.long))
    assert result.num_accepted.tolist() == [0, 0]
    assert result.next_token.tolist() == [3, 1]
    assert result.accepted_nodes.shape == (2, 0)


def test_empty_tree_samples_from_root() -> None:
    target = torch.nn.functional.one_hot(torch.tensor([[4], [2]]), 5).float()
    no_nodes = torch.zeros(2, 0, dtype=torch.long)
    result = verify_tree(target, target, no_nodes, torch.zeros(0, dtype=torch.long), siblings="iid")
    assert result.num_accepted.tolist() == [0, 0] and result.next_token.tolist() == [4, 2]
    assert result.accepted_nodes.shape == (2, 0)


def test_low_precision_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    probs = sampling_probs(torch.randn(64, 4, 30, generator=g), TEMP1).bfloat16()
    drafts = sample(probs[:, :3].float(), g)
    result = verify_chain(probs, probs[:, :3], drafts, g)
    assert (result.num_accepted == 3).all()


# ------------------------------------------------------------------- greedy: exact prefix matching


def _one_hot(argmax: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(argmax, vocab).float()


@pytest.mark.parametrize("one_hot_drafts", [False, True])
def test_chain_greedy_accepts_matching_prefix_exhaustively(one_hot_drafts: bool) -> None:
    vocab, k = 3, 3
    cases = list(itertools.product(range(vocab), repeat=2 * k + 1))  # drafts, then argmaxes
    grid = torch.tensor(cases)
    drafts, argmax = grid[:, :k], grid[:, k:]
    g = torch.Generator().manual_seed(0)
    if one_hot_drafts:
        draft_probs = _one_hot(drafts, vocab)
    else:  # any q with q(draft) > 0
        draft_probs = torch.rand(len(grid), k, vocab, generator=g) + 0.01
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    result = verify_chain(_one_hot(argmax, vocab), draft_probs, drafts, g)
    match = (drafts == argmax[:, :k]).long().cumprod(1).sum(1)
    assert torch.equal(result.num_accepted, match)
    assert torch.equal(result.next_token, argmax[torch.arange(len(grid)), match])


def _greedy_walk(parents, tokens, argmax):
    """Reference: follow the first child whose token is the argmax."""
    current, path = -1, []
    while True:
        children = [n for n, par in enumerate(parents) if par == current]
        child = next((n for n in children if tokens[n] == argmax[current + 1]), None)
        if child is None:
            return path, argmax[current + 1]
        path.append(child)
        current = child


@pytest.mark.parametrize("siblings", ["iid", "without_replacement", "deterministic"])
def test_tree_greedy_follows_argmax_exhaustively(siblings: str) -> None:
    parents, vocab = [-1, -1, 0, 0, 1], 2
    n = len(parents)
    grid = torch.tensor(list(itertools.product(range(vocab), repeat=2 * n + 1)))  # tokens, argmaxes
    tokens, argmax = grid[:, :n], grid[:, n:]
    g = torch.Generator().manual_seed(0)
    draft_probs = torch.rand(len(grid), n + 1, vocab, generator=g) + 0.01
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    target = _one_hot(argmax, vocab)
    result = verify_tree(target, draft_probs, tokens, torch.tensor(parents), g, siblings=siblings)
    for row in range(len(grid)):
        path, nxt = _greedy_walk(parents, tokens[row].tolist(), argmax[row].tolist())
        assert result.num_accepted[row] == len(path)
        assert result.accepted_nodes[row].tolist() == path + [-1] * (2 - len(path))  # 2 levels
        assert result.next_token[row] == nxt


def test_tree_per_row_parents_match_single_row_calls() -> None:
    g = torch.Generator().manual_seed(3)
    batch, n, vocab = 16, 7, 3
    # Random topologically ordered trees, a different one per row.
    parents = torch.stack([torch.randint(-1, m, (batch,), generator=g) for m in range(n)], 1)
    tokens = torch.randint(vocab, (batch, n), generator=g)
    target = _one_hot(torch.randint(vocab, (batch, n + 1), generator=g), vocab)
    batched = verify_tree(target, None, tokens, parents, siblings="deterministic")
    for row in range(batch):
        rows = slice(row, row + 1)
        single = verify_tree(target[rows], None, tokens[rows], parents[row], siblings="deterministic")
        assert batched.num_accepted[row] == single.num_accepted[0]
        assert batched.next_token[row] == single.next_token[0]
        width = single.accepted_nodes.shape[1]
        assert batched.accepted_nodes[row, :width].tolist() == single.accepted_nodes[0].tolist()
        assert (batched.accepted_nodes[row, width:] == -1).all()


# ---------------------------------------------------------------------------------- reproducibility


def test_same_seed_same_result() -> None:
    p_table, q_table = markov(6, TEMP1, TEMP1, seed=0)
    state = torch.zeros(256, dtype=torch.long)
    for step in (chain_step(p_table, q_table, 3), tree_step(p_table, q_table, TREE, "iid")):
        a = step(state, torch.Generator().manual_seed(5))
        b = step(state, torch.Generator().manual_seed(5))
        c = step(state, torch.Generator().manual_seed(6))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[0], c[0])


# ------------------------------------------------------------------------------- helpers and shapes


def test_emitted_pads_after_next_token() -> None:
    result = VerifyResult(torch.tensor([0, 2]), torch.tensor([9, 8]), torch.tensor([[-1, -1], [0, 1]]))
    assert result.emitted(torch.tensor([[5, 6], [7, 4]])).tolist() == [[9, -1, -1], [7, 4, 8]]


def test_chain_shape_errors_name_the_argument() -> None:
    p, q, x = torch.rand(2, 4, 5), torch.rand(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="target_probs must have shape \\[2, 4, 5\\]"):
        verify_chain(p[:, :3], q, x)
    with pytest.raises(ValueError, match="target_probs must have shape"):
        verify_chain(p[0], q, x)
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify_chain(p, q[:, :2], x)
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify_chain(p, torch.rand(2, 3, 6), x)
    with pytest.raises(ValueError, match="draft_tokens must have 2 dims"):
        verify_chain(p, q, x[0])
    with pytest.raises(TypeError, match="draft_tokens must be an integer tensor"):
        verify_chain(p, q, x.float())
    with pytest.raises(TypeError, match="target_probs must be a float tensor"):
        verify_chain(p.long(), q, x)


def test_tree_shape_errors_name_the_argument() -> None:
    p, x, parents = torch.rand(2, 4, 5), torch.zeros(2, 3, dtype=torch.long), torch.tensor([-1, 0, 0])
    with pytest.raises(ValueError, match="target_probs must have shape"):
        verify_tree(p[:, :3], p, x, parents, siblings="iid")
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        verify_tree(p, p[:, :3], x, parents, siblings="iid")
    with pytest.raises(ValueError, match="draft_probs is required"):
        verify_tree(p, None, x, parents, siblings="iid")
    with pytest.raises(ValueError, match="tree_tokens must have 2 dims"):
        verify_tree(p, p, x[0], parents, siblings="iid")
    with pytest.raises(ValueError, match="parents must have shape"):
        verify_tree(p, p, x, parents[:2], siblings="iid")
    with pytest.raises(ValueError, match="parents must have shape"):
        verify_tree(p, p, x, parents.expand(3, 3), siblings="iid")
    with pytest.raises(ValueError, match="parents must satisfy"):
        verify_tree(p, p, x, torch.tensor([-1, 2, 0]), siblings="iid")
    with pytest.raises(ValueError, match="siblings must be one of"):
        verify_tree(p, p, x, parents, siblings="topk")
