"""Tree shape from parents: node depths and the ancestor attention mask."""

from __future__ import annotations

import pytest
import torch

from tlt_lightning.speculative.tree import tree_attention_mask, tree_depths


def test_tree_depths_and_mask() -> None:
    parents = torch.tensor([-1, -1, 0, 1, 0, -1, 2, 2])
    assert tree_depths(parents).tolist() == [0, 0, 1, 1, 1, 0, 2, 2]
    mask = tree_attention_mask(parents)
    ancestors = {0: [0], 1: [1], 2: [0, 2], 3: [1, 3], 4: [0, 4], 5: [5], 6: [0, 2, 6], 7: [0, 2, 7]}
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for i, js in ancestors.items():
        expected[i, js] = True
    assert torch.equal(mask, expected)
    batched = torch.stack([parents, torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6])])
    assert torch.equal(tree_attention_mask(batched)[0], expected)
    assert torch.equal(tree_attention_mask(batched)[1], torch.ones(8, 8, dtype=torch.bool).tril())
    assert tree_depths(batched)[1].tolist() == list(range(8))


@pytest.mark.parametrize("bad", [[0, -1], [-1, 1], [-2, 0]])
def test_parents_must_be_topological(bad) -> None:
    with pytest.raises(ValueError, match="parents must satisfy"):
        tree_depths(torch.tensor(bad))
    with pytest.raises(ValueError, match="parents must satisfy"):
        tree_attention_mask(torch.tensor(bad))
