import pytest

from tlt_lightning.speculative import DraftSpec, DraftStrategy


def test_chain_and_tree_defaults():
    chain, tree = DraftSpec(4), DraftSpec(3, 2)
    assert chain.is_chain and chain.num_draft_tokens == 4 and str(chain) == "chain4"
    assert not tree.is_chain and tree.num_draft_tokens == 6 and str(tree) == "tree3x2/6"
    assert len({DraftSpec(4), DraftSpec(4, 1, 4), DraftSpec(3, 2)}) == 2  # hashable, by value


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), "num_steps must be an int >= 1, got 0"),
        ((2, 0), "topk must be an int >= 1, got 0"),
        ((2, 1, 3), r"num_draft_tokens must be an int in \[num_steps, topk \* num_steps\] = \[2, 2\], got 3"),
        ((3, 4, 2), r"= \[3, 12\], got 2"),
    ],
)
def test_invalid_strategies_name_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        DraftSpec(*args)


def test_sampled_trees_fork_into_chains():
    arm = DraftSpec(6, 2, sampled=True)
    assert str(arm) == "chain6x2" and arm.num_draft_tokens == 12 and not arm.is_chain
    assert arm != DraftSpec(6, 2, 12)  # the deterministic EAGLE-2 tree of the same size
    with pytest.raises(ValueError, match=r"forks into topk >= 2 chains, got topk=1 \(use a chain\)"):
        DraftSpec(4, sampled=True)
    with pytest.raises(ValueError, match=r"verifies all its 8 nodes, got num_draft_tokens=6"):
        DraftSpec(4, 2, 6, sampled=True)
    with pytest.raises(TypeError, match="sampled must be a bool"):
        DraftSpec(4, 2, sampled=1)


def test_sampled_trees_fork_at_their_first_levels():
    arm = DraftSpec(4, 3, sampled=True, fork_depth=2)
    assert arm.level_widths == (3, 9, 9, 9) and arm.num_draft_tokens == 30 and str(arm) == "chain4x3f2"
    assert DraftSpec(4, 2, sampled=True).level_widths == (2, 2, 2, 2)
    assert DraftSpec(3, 2, sampled=True, fork_depth=3).level_widths == (2, 4, 8)
    assert arm != DraftSpec(4, 3, sampled=True)
    for bad in (0, 5, True, 1.5):
        with pytest.raises(
            ValueError, match=r"fork_depth must be an int in \[1, num_steps\] = \[1, 4\], got"
        ):
            DraftSpec(4, 3, sampled=True, fork_depth=bad)
    with pytest.raises(ValueError, match="fork_depth=2 describes sampled trees; pass sampled=True"):
        DraftSpec(4, 2, fork_depth=2)


def test_confidence_stopped_chains():
    arm = DraftSpec(10, min_confidence=0.3)
    assert str(arm) == "chain10@0.3" and arm.is_chain and arm.num_draft_tokens == 10
    assert arm != DraftSpec(10) and str(DraftSpec(10, min_confidence=0)) == "chain10"
    for bad in (1.0, -0.1, float("nan"), True, "0.3"):
        with pytest.raises(ValueError, match=r"min_confidence must be a number in \[0, 1\), got"):
            DraftSpec(10, min_confidence=bad)
    with pytest.raises(ValueError, match=r"stops chains early; a tree \(topk=2\) needs min_confidence=0"):
        DraftSpec(4, 2, min_confidence=0.3)


def test_protocol_is_structural():
    class Always:
        def select(self, batch_size):
            return DraftSpec(2)

        def update(self, batch_size, arm, accepted_tokens, step_time):
            pass

    assert isinstance(Always(), DraftStrategy)
