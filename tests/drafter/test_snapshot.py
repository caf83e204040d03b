"""snapshot_state: the CPU copy a background save writes."""

import torch

from tlt_lightning.drafter.snapshot import snapshot_state


def test_snapshot_state_clones_nested():
    t = torch.ones(2)
    snap = snapshot_state({"a": [t, (t, 3)], "b": "x"})
    t.add_(1)
    assert snap["a"][0].tolist() == [1.0, 1.0] and snap["a"][1][1] == 3 and snap["b"] == "x"
    again = snapshot_state({"a": [t, (t, 3)], "b": "x", "c": torch.zeros(3)}, reuse=snap)
    assert again["a"][0] is snap["a"][0] and again["a"][0].tolist() == [2.0, 2.0]
    shaped = snapshot_state({"a": [torch.ones(5), (t, 3)]}, reuse=snap)  # a new shape: a new buffer
    assert shaped["a"][0] is not snap["a"][0] and shaped["a"][0].shape == (5,)
