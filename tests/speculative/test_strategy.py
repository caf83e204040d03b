import pytest

from tlt_lightning.speculative import SDStrategy, StrategyChooser


def test_chain_and_tree_defaults():
    chain, tree = SDStrategy(4), SDStrategy(3, 2)
    assert chain.is_chain and chain.num_draft_tokens == 4 and str(chain) == "chain4"
    assert not tree.is_chain and tree.num_draft_tokens == 6 and str(tree) == "tree3x2/6"
    assert len({SDStrategy(4), SDStrategy(4, 1, 4), SDStrategy(3, 2)}) == 2  # hashable, by value


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
        SDStrategy(*args)


def test_sampled_trees_fork_into_chains():
    arm = SDStrategy(6, 2, sampled=True)
    assert str(arm) == "chain6x2" and arm.num_draft_tokens == 12 and not arm.is_chain
    assert arm != SDStrategy(6, 2, 12)  # the deterministic EAGLE-2 tree of the same size
    with pytest.raises(ValueError, match=r"forks into topk >= 2 chains, got topk=1 \(use a chain\)"):
        SDStrategy(4, sampled=True)
    with pytest.raises(ValueError, match=r"all topk \* num_steps = 8 tokens, got num_draft_tokens=6"):
        SDStrategy(4, 2, 6, sampled=True)
    with pytest.raises(TypeError, match="sampled must be a bool"):
        SDStrategy(4, 2, sampled=1)


def test_confidence_stopped_chains():
    arm = SDStrategy(10, min_confidence=0.3)
    assert str(arm) == "chain10@0.3" and arm.is_chain and arm.num_draft_tokens == 10
    assert arm != SDStrategy(10) and str(SDStrategy(10, min_confidence=0)) == "chain10"
    for bad in (1.0, -0.1, float("nan"), True, "0.3"):
        with pytest.raises(ValueError, match=r"min_confidence must be a number in \[0, 1\), got"):
            SDStrategy(10, min_confidence=bad)
    with pytest.raises(ValueError, match=r"stops chains early; a tree \(topk=2\) needs min_confidence=0"):
        SDStrategy(4, 2, min_confidence=0.3)


def test_protocol_is_structural():
    class Always:
        def select(self, batch_size):
            return SDStrategy(2)

        def update(self, batch_size, arm, accepted_tokens, step_time):
            pass

    assert isinstance(Always(), StrategyChooser)
