import json

import pytest
import torch

from tlt_lightning.cli import main
from tlt_lightning.drafter import (
    Drafter,
    DrafterConfig,
    DrafterLoss,
    evaluate_drafter,
    load_drafter,
    make_batches,
    save_drafter,
)
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, save_rollouts


@pytest.fixture(scope="module")
def stored(tiny_llama, tmp_path_factory):
    """A rollout file of the tiny Llama with EAGLE-1 features, a tokens-only copy, and two drafters."""
    root = tmp_path_factory.mktemp("evaluate")
    eagle1 = DrafterConfig.from_target(tiny_llama)
    layers = eagle1.rollout_feature_layers
    engine = RolloutEngine(
        tiny_llama, RolloutConfig(max_new_tokens=10, temperature=1.0, feature_layers=layers)
    )
    prompts = [[3 + i, 4, 5 + 2 * i] for i in range(20)]
    rollouts = engine.generate(prompts, generator=torch.Generator().manual_seed(0)).rollouts
    meta = {"key": {"model": "tiny-llama", "dtype": "float32", "feature_layers": list(layers)}}
    save_rollouts(root / "full.safetensors", rollouts, meta)
    save_rollouts(root / "tokens.safetensors", rollouts, meta, features=False)
    torch.manual_seed(1)
    save_drafter(Drafter(eagle1, tiny_llama), root / "eagle1")
    save_drafter(Drafter(DrafterConfig.from_target(tiny_llama, kind="eagle3"), tiny_llama), root / "eagle3")
    return root, rollouts


def test_drafters_are_scored_on_the_same_held_out_positions(stored, tiny_llama):
    root, rollouts = stored
    out = root / "eval.json"
    main(
        [
            "drafter",
            "evaluate",
            "--drafter",
            str(root / "eagle1"),
            str(root / "eagle3"),
            "--rollouts",
            str(root / "full.safetensors"),
            "--unroll",
            "2",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert report["rollouts"] == 2  # the first tenth: a warm-up's held-out set
    assert report["positions"] == sum(r.length for r in rollouts[:2])
    scores = report["drafters"]
    assert list(scores) == [str(root / "eagle1"), str(root / "eagle3")]
    for metrics in scores.values():
        assert 0 <= metrics["accept_step2"] <= 1 and 0 <= metrics["top1"] <= 1

    # The EAGLE-1 row is evaluate_drafter on the stored features, nothing else.
    drafter = load_drafter(root / "eagle1", tiny_llama)
    direct = evaluate_drafter(
        drafter,
        tiny_llama,
        make_batches(rollouts[:2], drafter.config, 8, shuffle=False),
        DrafterLoss.for_kind("eagle1", unroll_steps=2),
        full_vocab=True,
    )
    assert scores[str(root / "eagle1")] == pytest.approx(direct, rel=1e-5)
    assert direct["vocab_mass"] == pytest.approx(1.0)  # the full vocabulary: nothing to lose

    # A tokens-only file (and the EAGLE-3 drafter on any file) gets its features recomputed: same scores.
    again = root / "again.json"
    main(
        [
            "drafter",
            "evaluate",
            "--drafter",
            str(root / "eagle1"),
            str(root / "eagle3"),
            "--rollouts",
            str(root / "tokens.safetensors"),
            "--unroll",
            "2",
            "--json",
            str(again),
        ]
    )
    recomputed = json.loads(again.read_text())["drafters"]
    for path, metrics in scores.items():
        assert recomputed[path] == pytest.approx(metrics, rel=1e-4, abs=1e-6)


def test_bad_arguments_say_what_to_do(stored, tmp_path, capsys):
    root, rollouts = stored
    with pytest.raises(FileNotFoundError, match="make one with `drafter warmup --rollouts-cache`"):
        main(["drafter", "evaluate", "--drafter", str(root / "eagle1"), "--rollouts", str(tmp_path / "none")])
    save_rollouts(tmp_path / "anonymous.safetensors", rollouts, {})
    with pytest.raises(ValueError, match="does not say which model sampled it: pass --model"):
        main(
            [
                "drafter",
                "evaluate",
                "--drafter",
                str(root / "eagle1"),
                "--rollouts",
                str(tmp_path / "anonymous.safetensors"),
            ]
        )
    with pytest.raises(SystemExit) as refused:  # a positive int by its type: the parser refuses 0
        main(
            [
                "drafter",
                "evaluate",
                "--drafter",
                str(root / "eagle1"),
                "--rollouts",
                str(root / "full.safetensors"),
                "--unroll",
                "0",
            ]
        )
    assert refused.value.code == 2 and 'key "unroll"' in capsys.readouterr().err


def test_a_reduced_draft_vocabulary_loses_the_targets_mass_outside_it(stored, tiny_llama, tmp_path):
    """By default acceptance counts the target's mass outside the draft vocabulary as rejected (what
    speculative sampling sees); --renormalise gives the warm-up's renormalised metric, higher."""
    root, _ = stored
    torch.manual_seed(2)
    save_drafter(
        Drafter(DrafterConfig.from_target(tiny_llama, draft_vocab_size=64), tiny_llama), tmp_path / "small"
    )
    args = [
        "drafter",
        "evaluate",
        "--drafter",
        str(tmp_path / "small"),
        "--rollouts",
        str(root / "full.safetensors"),
        "--unroll",
        "2",
        "--json",
    ]
    main([*args, str(tmp_path / "sd.json")])
    main([*args, str(tmp_path / "renormalised.json"), "--renormalise"])
    sd = json.loads((tmp_path / "sd.json").read_text())["drafters"][str(tmp_path / "small")]
    renormalised = json.loads((tmp_path / "renormalised.json").read_text())["drafters"][
        str(tmp_path / "small")
    ]
    assert 0 < sd["vocab_mass"] < 0.9 and "vocab_mass" not in renormalised
    for key in ("accept", "accept_step2"):
        assert sd[key] < renormalised[key]
    assert sd["top1"] == pytest.approx(renormalised["top1"])
