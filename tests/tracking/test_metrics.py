import math

import pytest
import torch

from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.rollout import RolloutConfig, RolloutStats
from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
from tlt_lightning.speculative import DraftSpec
from tlt_lightning.tracking import AcceptanceRate, MeanAcceptLength, RolloutTokensPerSecond


def stats(accept, strategies, sizes, depths, tokens=10, seconds=2.0):
    return RolloutStats(
        step_batch_sizes=sizes,
        step_arms=strategies,
        step_draft_depths=depths,
        step_tokens=[tokens],
        accept_lengths=torch.tensor(accept),
        total_time=seconds,
    )


def test_metrics_against_hand_computed_values():
    a = stats([3, 1], [DraftSpec(4)], [2], [4])  # one chain step of depth 4 on 2 requests
    b = stats([2, 2, 5], [None, DraftSpec(4, 2, 8)], [5, 3], [0, 4])  # plain step, then a tree step on 3
    early = DraftSpec(6, min_confidence=0.5)
    c = stats([2, 3, 1], [early, early], [2, 1], [2, 1])  # stopped after 2 drafts, then after 1
    mal, rate, tps = MeanAcceptLength(), AcceptanceRate(), RolloutTokensPerSecond()
    for s in (a, b, c):
        mal.update(s)
        rate.update(s)
        tps.update(s)
    assert float(mal.compute()) == pytest.approx(19 / 8)
    assert float(rate.compute()) == pytest.approx(
        (2 + 0 + 1 + 1 + 4 + 1 + 2 + 0) / (4 * 2 + 4 * 3 + 2 * 2 + 1)
    )
    assert float(tps.compute()) == pytest.approx(30 / 6.0)
    mal.reset()
    assert math.isnan(float(mal.compute()))  # no speculative step: undefined, never a 0 that skews means
    mal.update(stats([], [None], [4], [0]))  # a rollout of plain steps only
    assert math.isnan(float(mal.compute()))


def test_metrics_follow_a_real_speculative_rollout(tiny_llama):
    drafter = Drafter(DrafterConfig.from_target(tiny_llama), tiny_llama)
    loop = SpeculativeRolloutLoop(
        tiny_llama, drafter, RolloutConfig(max_new_tokens=12), DraftSpec(3), threshold=100
    )
    result = loop.generate([[5, 6], [7, 8, 9]], generator=torch.Generator().manual_seed(0))
    mal = MeanAcceptLength()
    mal.update(result.stats)
    assert float(mal.compute()) == pytest.approx(result.stats.mean_accept_length)
    assert 1 <= float(mal.compute()) <= 4
