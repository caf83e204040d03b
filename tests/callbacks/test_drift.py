"""DrafterDriftProbe on a tiny GRPO fit: both drafters probed on the same prompts, frozen stays frozen."""

from __future__ import annotations

import json

import pytest
import torch

from tests.rl.test_module import make_module, make_trainer
from tlt_lightning.callbacks import DrafterDriftProbe, SpotDrafterCallback
from tlt_lightning.drafter import load_drafter
from tlt_lightning.speculative import DraftSpec


def test_probe_compares_spot_and_frozen_drafters(tmp_path):
    spot = SpotDrafterCallback({"training": {"max_steps_per_rollout": 2}})
    probe = DrafterDriftProbe(num_prompts=2, max_new_tokens=8, arm=DraftSpec(2))
    trainer = make_trainer(3, callbacks=[spot, probe], default_root_dir=tmp_path)
    module = make_module(lr=1e-2)
    trainer.fit(module)
    assert [h["step"] for h in probe.history] == [0, 1, 2, 3]
    # Before any training both are the same drafter on the same policy, prompts and seed.
    assert probe.history[0]["spot"] == probe.history[0]["frozen"] >= 1.0
    assert all(1.0 <= h[k] <= 3.0 for h in probe.history for k in ("spot", "frozen"))  # chain2: 1..3 tokens
    # The spot drafter trained (its final checkpoint) while the frozen copy did not.
    assert probe.run_dir == spot.run_dir == tmp_path / "version_0"
    trained = load_drafter(next((spot.run_dir / "drafter" / "checkpoints").iterdir()), module.rollout_target)
    assert not all(
        torch.equal(a, b) for a, b in zip(trained.state_dict().values(), probe._frozen.state_dict().values())
    )
    assert {"drift/accept_length_spot", "drift/accept_length_frozen"} <= set(trainer.callback_metrics)
    saved = json.loads((probe.run_dir / "drift" / "drift.json").read_text())
    assert saved["history"] == probe.history and saved["arm"] == "chain2"
    assert (probe.run_dir / "drift" / "drift.png").stat().st_size > 5_000


def test_probe_needs_a_spot_callback_and_enough_prompts(tmp_path):
    with pytest.raises(TypeError, match="needs a GRPOModule and a SpotDrafterCallback"):
        make_trainer(1, callbacks=[DrafterDriftProbe()], default_root_dir=tmp_path).fit(make_module())
    with pytest.raises(ValueError, match="num_prompts=9 is more than the 4 prompts"):
        make_trainer(
            1, callbacks=[SpotDrafterCallback(), DrafterDriftProbe(num_prompts=9)], default_root_dir=tmp_path
        ).fit(make_module())
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1, got 0"):
        DrafterDriftProbe(every_n_steps=0)
