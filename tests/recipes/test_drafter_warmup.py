import argparse
import json
import statistics
from pathlib import Path

import pytest

from benchmarks.__main__ import main as bench
from tlt_lightning.cli import main
from tlt_lightning.drafter import load_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.recipes.drafter_warmup import collect_rollouts, sampling_setup, warmup_task
from tlt_lightning.rl.tasks import TaskConfig
from tlt_lightning.rollout import RolloutConfig, RolloutEngine, load_rollouts, save_rollouts
from tlt_lightning.validation import UserError

ROOT = Path(__file__).resolve().parents[2]


class _Stop(Exception):
    pass


def test_interrupted_sampling_resumes_to_the_same_rollouts(tiny_llama, tmp_path):
    """Chunks are saved as they finish; resuming from the file gives what one run gives."""
    engine = RolloutEngine(tiny_llama, RolloutConfig(max_new_tokens=6, temperature=1.0))
    prompts = [[1, 2 + i, 3] for i in range(5)]
    whole, _ = collect_rollouts(engine, prompts, chunk=2, seed=3)
    path = tmp_path / "cache.safetensors"

    def save_then_crash(so_far, seconds):
        save_rollouts(path, so_far, {"seconds": seconds, "chunk": 2}, features=False)
        if len(so_far) == 2:
            raise _Stop

    with pytest.raises(_Stop):
        collect_rollouts(engine, prompts, chunk=2, seed=3, on_chunk=save_then_crash)
    saved, meta = load_rollouts(path)
    assert len(saved) == 2 and meta["chunk"] == 2 and not path.with_name("cache.safetensors.tmp").exists()
    resumed, _ = collect_rollouts(engine, prompts, chunk=2, seed=3, done=saved)
    assert [r.token_ids.tolist() for r in resumed] == [r.token_ids.tolist() for r in whole]
    with pytest.raises(ValueError, match="cannot resume from 3 rollouts: not a whole number of chunks of 2"):
        collect_rollouts(engine, prompts, chunk=2, seed=3, done=whole[:3])


@pytest.mark.slow
def test_warmup_then_speculative_bench_on_the_real_model(tmp_path, capsys):
    """The warm-up and the rollout benchmark (a checkout's ``python -m benchmarks rollout``) chained on
    SmolLM2 with tiny settings: artefacts exist and reload."""
    out, cache = tmp_path / "drafter", tmp_path / "rollouts.safetensors"
    args = [
        "--threads",
        "1",
        "drafter",
        "warmup",
        "--task",
        "countdown",
        "--prompts",
        "12",
        "--max-new-tokens",
        "24",
        "--rollout-batch",
        "6",
        "--draft-vocab",
        "2048",
        "--dtype",
        "bfloat16",
        "--rollouts-cache",
        str(cache),
        "--out",
        str(out),
    ]
    main([*args, "--steps", "2"])
    main([*args, "--steps", "15"])  # same rollouts, read back from the cache
    assert "reusing 12 rollouts" in capsys.readouterr().out
    saved, meta = load_rollouts(cache)
    save_rollouts(cache, saved[:6], meta)  # as if stopped after one chunk
    main([*args, "--steps", "1", "--out", str(tmp_path / "resumed")])
    assert "sampling 6 of 12 rollouts" in capsys.readouterr().out
    resumed, _ = load_rollouts(cache)
    assert [r.token_ids.tolist() for r in resumed] == [r.token_ids.tolist() for r in saved]
    with pytest.raises(ValueError, match="was made with other settings"):
        main([*args, "--steps", "2", "--temperature", "0.5"])
    report = json.loads((out / "warmup.json").read_text())
    assert report["rollouts"] == 12 and report["draft_vocab"] == 2048
    assert 0 < report["draft_vocab_token_coverage"] <= 1
    # A 2048-token draft vocabulary: the target's mass outside it is rejected by sampling, so the
    # full-vocabulary acceptance is below the renormalised one, top-1 the same.
    sd, renormalised = report["held_out_after_full_vocab"], report["held_out_after"]
    assert 0 < sd["vocab_mass"] < 1 and sd["accept"] < renormalised["accept"]
    assert sd["top1"] == pytest.approx(renormalised["top1"])
    assert report["final_train_metrics"]["loss"] < report["held_out_before"]["loss"] * 10
    assert (out / "warmup.png").stat().st_size > 5_000
    drafter = load_drafter(out, HFTarget(load_model("smollm2-135m").model))
    assert drafter.config.draft_vocab == 2048

    # Continue training the saved drafter with an unroll: it starts where the first run ended.
    more = tmp_path / "continued"
    main(
        [
            *args,
            "--steps",
            "2",
            "--unroll",
            "2",
            "--init-from",
            str(out),
            "--out",
            str(more),
            "--save-every",
            "1",
        ]
    )
    resumed = json.loads((more / "warmup.json").read_text())
    assert resumed["held_out_before"]["top1"] == pytest.approx(report["held_out_after"]["top1"], abs=1e-6)
    assert "top1_step2" in resumed["held_out_after"] and resumed["unroll"] == 2
    with pytest.raises(ValueError, match="is an eagle1 drafter, but --kind is eagle3"):
        main([*args, "--steps", "1", "--kind", "eagle3", "--init-from", str(out), "--out", str(more)])

    # Train on this run's rollouts plus those of another warm-up (other prompts); held out: this run's.
    other = tmp_path / "other.safetensors"
    other_args = [str(other) if a == str(cache) else "6" if a == "12" else a for a in args]
    main([*other_args, "--steps", "1", "--seed", "5", "--cache-tokens-only", "--out", str(tmp_path / "o")])
    assert all(r.features is None for r in load_rollouts(other)[0])
    capsys.readouterr()
    main(
        [
            *args,
            "--steps",
            "1",
            "--pack",
            "64",
            "--train-dtype",
            "bfloat16",
            "--more-rollouts",
            str(other),
            "--out",
            str(tmp_path / "merged"),
        ]
    )
    assert "recomputing target features of 6 stored rollouts" in capsys.readouterr().out
    merged = json.loads((tmp_path / "merged" / "warmup.json").read_text())
    assert merged["rollouts"] == 12 and merged["more_rollouts"] == 6 and merged["pack"] == 64
    assert merged["train_dtype"] == "bfloat16"
    other_tokens = sum(r.length for r in load_rollouts(other)[0])
    assert merged["train_tokens"] == report["train_tokens"] + other_tokens  # all 6 train, none held out
    with pytest.raises(ValueError, match="sampled with other settings"):
        main([*args, "--steps", "1", "--max-new-tokens", "20", "--more-rollouts", str(other)])
    with pytest.raises(FileNotFoundError, match="--more-rollouts"):
        main([*args, "--steps", "1", "--more-rollouts", str(tmp_path / "missing.pt")])

    path = tmp_path / "sd.json"
    bench(
        [
            "--threads",
            "1",
            "rollout",
            "--speculative",
            "--drafter",
            str(out),
            "--batch-sizes",
            "1",
            "2",
            "--max-new-tokens",
            "12",
            "--long-tail-requests",
            "4",
            "--long-tail-max-new",
            "16",
            "--threshold",
            "5",
            "--depth",
            "2",
            "--topk",
            "2",
            "--draft-tokens",
            "3",
            "--dtype",
            "bfloat16",
            "--repeats",
            "1",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    batch = data["batches"][1]
    assert batch["requests"] == 2 and batch["sd_step_fraction"] == 1.0 and batch["mean_accept_length"] >= 1
    assert (
        batch["sd_step_cost"] > 0.5
    )  # a 3-token tree verify plus 2 drafter steps: not cheaper than half a step
    runs = batch["runs"]
    assert batch["speedup_decode"] == pytest.approx(
        statistics.median(runs["sd_decode_tps"]) / statistics.median(runs["plain_decode_tps"])
    )
    assert (
        runs["plain_decode_tps"][0] > runs["plain_tps"][0]
    )  # 12 tokens: the prefill weighs on the whole run
    assert data["strategy"] == "tree2x2/3" and data["dtype"] == "bfloat16"
    # The batch-1 peers: HF generate plain, with the 6-layer layer-skip assistant, with prompt lookup.
    assert set(data["hf_batch1_tokens_per_s"]) == {"plain", "assisted", "prompt_lookup"}
    assert (
        all(v > 0 for v in data["hf_batch1_tokens_per_s"].values())
        and data["hf_batch1_assistant_layers"] == 6
    )
    assert data["long_tail"]["threshold"] == 5 and data["long_tail"]["sd_step_fraction"] == 1.0
    assert path.with_suffix(".png").stat().st_size > 10_000

    # Several arms side by side, each against the same plain runs.
    bench(
        [
            "--threads",
            "1",
            "rollout",
            "--speculative",
            "--drafter",
            str(out),
            "--batch-sizes",
            "1",
            "2",
            "--max-new-tokens",
            "12",
            "--long-tail-requests",
            "0",
            "--arms",
            "chain3",
            "chain4@0.6",
            "--dtype",
            "bfloat16",
            "--repeats",
            "2",
            "--assistant-layers",
            "0",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    assert data["strategies"] == ["chain3", "chain4@0.6"]
    assert [(b["requests"], b["strategy"]) for b in data["batches"]] == [
        (1, "chain3"),
        (1, "chain4@0.6"),
        (2, "chain3"),
        (2, "chain4@0.6"),
    ]
    chain3, early = data["batches"][:2]
    assert chain3["runs"]["plain_s"] == early["runs"]["plain_s"]  # the same plain runs
    assert chain3["mean_draft_depth"] == 3 and 1 <= early["mean_draft_depth"] <= 4
    assert path.with_suffix(".png").stat().st_size > 10_000

    # Several temperatures: the fixed batches at each, the HF peers once (at the first).
    bench(
        [
            "--threads",
            "1",
            "rollout",
            "--speculative",
            "--drafter",
            str(out),
            "--batch-sizes",
            "1",
            "--max-new-tokens",
            "8",
            "--long-tail-requests",
            "0",
            "--arms",
            "chain2",
            "--temperature",
            "1",
            "0",
            "--dtype",
            "bfloat16",
            "--repeats",
            "1",
            "--assistant-layers",
            "0",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    assert data["temperatures"] == [1.0, 0.0] and data["temperature"] == 1.0
    assert [(b["temperature"], b["requests"]) for b in data["batches"]] == [(1.0, 1), (0.0, 1)]
    assert set(data["hf_batch1_tokens_per_s"]) == {"plain", "prompt_lookup"}
    assert path.with_suffix(".png").stat().st_size > 10_000

    # Two drafters side by side (the first run's and its continuation), against the same plain runs.
    bench(
        [
            "--threads",
            "1",
            "rollout",
            "--speculative",
            "--drafter",
            str(out),
            str(more),
            "--batch-sizes",
            "1",
            "--max-new-tokens",
            "8",
            "--long-tail-requests",
            "0",
            "--arms",
            "chain2",
            "--dtype",
            "bfloat16",
            "--repeats",
            "1",
            "--assistant-layers",
            "0",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    assert data["strategies"] == ["drafter/chain2", "continued/chain2"] and data["drafters"] == [
        str(out),
        str(more),
    ]
    first, second = data["batches"]
    assert first["runs"]["plain_s"] == second["runs"]["plain_s"] and second["mean_accept_length"] >= 1


def test_warmup_rejects_bad_counts(capsys):
    with pytest.raises(ValueError, match="--steps must be >= 1, got 0"):
        main(["drafter", "warmup", "--steps", "0", "--model", "tiny-llama"])
    for option in ("--pack", "--save-every"):  # non-negative ints by their type: the parser refuses -1
        with pytest.raises(SystemExit) as refused:
            main(["drafter", "warmup", option, "-1", "--model", "tiny-llama"])
        assert refused.value.code == 2 and f'key "{option[2:].replace("-", "_")}"' in capsys.readouterr().err


def test_rollouts_of_a_fit_configs_task_merge_across_seeds_but_not_across_settings():
    key = {"model": "m", "dtype": "bfloat16", "max_new_tokens": 8, "temperature": 1.0, "feature_layers": [2]}
    task = {"name": "basic_arithmetic", "seed": 11, "size": None, "system_prompt": "Think."}
    other_seed = sampling_setup(key | {"task": {**task, "seed": 13}})
    assert sampling_setup(key | {"task": task}) == other_seed
    assert sampling_setup(key | {"task": {**task, "system_prompt": "Answer."}}) != other_seed
    assert sampling_setup(key | {"task": "countdown"})["task"] == "countdown"  # --task: a name


def test_prompts_come_from_a_fit_configs_task_with_its_system_prompt(tmp_path):
    args = argparse.Namespace(task="countdown", prompts=64, seed=3, task_config=None)
    assert warmup_task(args) == TaskConfig(name="countdown", size=64, seed=3)
    args.task_config = str(ROOT / "configs" / "grpo_smollm2_longtail.yaml")
    task = warmup_task(args)
    assert (task.name, task.size, task.seed) == ("basic_arithmetic", 64, 3)
    assert "step by step" in task.system_prompt  # the long-tail job's prompt, not the default one
    (tmp_path / "no_task.yaml").write_text("trainer: {max_steps: 1}\n")
    for path, message in (
        (tmp_path / "missing.yaml", "no such file"),
        (tmp_path / "no_task.yaml", "no model.task"),
    ):
        args.task_config = str(path)
        with pytest.raises(UserError, match=message):
            warmup_task(args)
