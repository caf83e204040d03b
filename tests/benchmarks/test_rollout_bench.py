import json
import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.__main__ import main
from benchmarks.common import compile_report
from benchmarks.rollout import length_summary
from tlt_lightning.models.compiled import Bucket


def test_length_summary_idle_fraction():
    import torch

    out = length_summary(torch.tensor([10, 20, 30, 100]))
    assert out["max"] == 100 and out["mean"] == 40
    assert out["idle_fraction_static_batch"] == pytest.approx(0.6)


@pytest.mark.slow
def test_bench_rollout_cli_writes_json_and_plot(tmp_path):
    path = tmp_path / "rollout.json"
    main(
        [
            "--threads",
            "1",
            "rollout",
            "--batch-sizes",
            "2",
            "--max-new-tokens",
            "8",
            "--long-tail-requests",
            "4",
            "--long-tail-max-new",
            "16",
            "--repeats",
            "1",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    batch = data["batches"][0]
    assert batch["batch_size"] == 2 and batch["identical_outputs"] == 2  # greedy: same tokens as HF
    assert len(batch["runs_tokens_per_s"]) == len(batch["runs_hf_tokens_per_s"]) == 1  # --repeats 1, A B
    lengths = data["long_tail"]["lengths"]
    assert set(lengths) >= {"p50", "p90", "max", "idle_fraction_static_batch"}
    assert 1 <= lengths["p50"] <= lengths["p90"] <= lengths["max"] <= 16  # --long-tail-max-new
    assert 0 <= lengths["idle_fraction_static_batch"] < 1 and data["long_tail"]["requests"] == 4
    assert path.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.slow
def test_bench_rollout_compiled_decode_reports_compile_time_apart(tmp_path, fresh_compile):
    path = tmp_path / "rollout.json"
    main(
        [
            "--threads",
            "1",
            "rollout",
            "--decode",
            "compiled",
            "--batch-sizes",
            "1",
            "--max-new-tokens",
            "8",
            "--long-tail-requests",
            "0",
            "--repeats",
            "1",
            "--json",
            str(path),
        ]
    )
    data = json.loads(path.read_text())
    batch = data["batches"][0]
    assert data["decode"] == "compiled" and batch["identical_outputs"] == 1  # fp32 greedy: HF's tokens
    assert batch["compile_seconds"] > 0 and batch["compile_seconds_in_runs"] == 0  # compiled in the warm-up
    assert data["compile_seconds"] == pytest.approx(sum(b["seconds"] for b in data["compile_buckets"]))
    assert data["compile_buckets"][0]["batch"] == 1 and data["compile_buckets"][0]["queries"] == 1


def test_compile_report_lists_buckets_and_their_seconds():
    target = SimpleNamespace(compile_times={Bucket(1, 1, 256, ()): 2.0, Bucket(8, 4, 512, (30,)): 3.5})
    report = compile_report(target)
    assert report["compile_seconds"] == 5.5
    assert report["compile_buckets"][1] == {
        "batch": 8,
        "queries": 4,
        "kv_len": 512,
        "feature_layers": [30],
        "all_slots": False,
        "few_rows": False,
        "seconds": 3.5,
    }
    assert compile_report(object()) == {"compile_seconds": 0, "compile_buckets": []}


def test_layer_skip_assistant_shares_the_targets_first_layers():
    from benchmarks.speculative import layer_skip_assistant
    from tlt_lightning.models import load_model

    model = load_model("tiny-llama", seed=0).model
    assistant = layer_skip_assistant(model, 2)
    assert assistant.config.num_hidden_layers == len(assistant.model.layers) == 2
    assert model.config.num_hidden_layers == 4  # the target is untouched
    target_weights = model.state_dict()
    for name, value in assistant.state_dict().items():
        assert torch.equal(value, target_weights[name]), name
    with pytest.raises(ValueError, match=r"--assistant-layers must be in \[1, 3\], got 4"):
        layer_skip_assistant(model, 4)


def test_full_batch_step_time_compares_steps_with_every_request_active():
    from types import SimpleNamespace

    from benchmarks.speculative import full_batch_step_time

    stats = SimpleNamespace(
        step_times=[0.5, 0.1, 0.3, 0.2, 0.9],
        step_batch_sizes=[4, 4, 4, 4, 3],
        step_speculative=[False, True, True, True, True],
    )
    assert full_batch_step_time(stats, 4, True) == pytest.approx(0.2)  # not the prefill-like 0.5, not batch 3
    assert full_batch_step_time(stats, 4, False) == 0.5
    assert math.isnan(full_batch_step_time(stats, 8, True))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hf_peer_samples_and_decodes_greedily(monkeypatch, temperature):
    """The batch-1 HF peer runs at the comparison's temperature, greedy included (HF refuses
    temperature 0 with sampling on): greedy it emits exactly our engine's tokens; sampling, its
    seed decides its tokens. (Its speed is a benchmark figure, not a property.)"""
    from benchmarks import speculative as bench
    from tlt_lightning.models import HFTarget, load_model
    from tlt_lightning.rollout import RolloutConfig, RolloutEngine

    model = load_model("tiny-llama", seed=0).model.eval()
    prompt, outputs, real = [5, 6, 7], [], bench.timed

    def timed(fn):
        out = real(fn)
        outputs.append(out[0][0, len(prompt) :].tolist())
        return out

    monkeypatch.setattr(bench, "timed", timed)
    for seed in (0, 0, 1):
        bench._hf_peer(model, prompt, 8, seed=seed, temperature=temperature)
    assert 1 <= len(outputs[0]) <= 8 and outputs[0] == outputs[1]  # the same seed, the same tokens
    if temperature == 0:
        engine = RolloutEngine(HFTarget(model), RolloutConfig(max_new_tokens=8, temperature=0.0))
        assert engine.generate([prompt]).rollouts[0].token_ids.tolist() == outputs[0]
        assert outputs[2] == outputs[0]  # greedy: the seed changes nothing
    else:
        assert outputs[2] != outputs[0]  # sampled: another seed, other tokens (vocabulary 128, 8 tokens)


@pytest.mark.parametrize("with_batches", [False, True])
def test_speculative_plot_has_a_panel_per_workload_kind(monkeypatch, tmp_path, with_batches):
    from benchmarks import speculative_plot as bench
    from tlt_lightning.drafter import Drafter, DrafterConfig
    from tlt_lightning.models import HFTarget, load_model
    from tlt_lightning.rollout import RolloutConfig
    from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop

    target = HFTarget(load_model("tiny-llama", seed=0).model.eval())
    loop = SpeculativeRolloutLoop(
        target,
        Drafter(DrafterConfig.from_target(target), target),
        RolloutConfig(max_new_tokens=6, temperature=1.0),
        threshold=4,
    )
    long_tail = loop.generate([[5, 6, 7], [8, 9]], generator=torch.Generator().manual_seed(0))
    batches = (
        [
            {
                "requests": 1,
                "strategy": "chain4",
                "plain_tokens_per_s": 10.0,
                "sd_tokens_per_s": 15.0,
                "speedup_tokens_per_s": 1.5,
                "mean_accept_length": 2.0,
            }
        ]
        if with_batches
        else []
    )
    figures = []
    monkeypatch.setattr(bench, "save_figure", lambda fig, path: figures.append(fig) or path)
    results = {"batches": batches, "strategies": ["chain4"], "temperature": 1.0}
    bench.plot(results, long_tail, tmp_path / "p.png")
    titles = [ax.get_title() for ax in figures[0].axes]
    assert titles == ["Throughput, T=1"] * with_batches + [
        "Long tail: accept-length histogram",
        "Long tail: batch over time (SD run)",
    ]
    with pytest.raises(ValueError, match="nothing to plot"):
        bench.plot({**results, "batches": []}, None, tmp_path / "q.png")


def test_speculative_plot_of_several_temperatures_draws_speedup_against_temperature(monkeypatch, tmp_path):
    from benchmarks import speculative_plot as bench

    batches = [
        {
            "temperature": t,
            "requests": n,
            "strategy": arm,
            "speedup_tokens_per_s": s,
            "mean_accept_length": 2.0,
        }
        for t, s in ((1.0, 1.5), (0.0, 2.5))
        for n in (1, 4)
        for arm in ("chain3", "chain6")
    ]
    figures = []
    monkeypatch.setattr(bench, "save_figure", lambda fig, path: figures.append(fig) or path)
    bench.plot(
        {
            "batches": batches,
            "strategies": ["chain3", "chain6"],
            "temperature": 1.0,
            "temperatures": [1.0, 0.0],
        },
        None,
        tmp_path / "p.png",
    )
    [ax] = figures[0].axes
    assert ax.get_title().startswith("Speedup against temperature")
    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]  # not the y = 1 rule
    assert [line.get_label() for line in lines] == [
        "chain3, batch 1",
        "chain3, batch 4",
        "chain6, batch 1",
        "chain6, batch 4",
    ]
    assert all(list(line.get_ydata()) == [1.5, 2.5] for line in lines)


def test_speculative_compare_warms_up_on_every_group_it_times():
    """``--decode compiled``: each loop first runs every timed group once untimed (so its graphs compile
    there), with the seed of that repeat; then the timed runs, plain and speculative alternating."""
    from benchmarks.speculative import _compare
    from tlt_lightning.drafter import Drafter, DrafterConfig
    from tlt_lightning.models import HFTarget, load_model
    from tlt_lightning.rollout import RolloutConfig, RolloutEngine
    from tlt_lightning.rollout.speculative import SpeculativeRolloutLoop
    from tlt_lightning.speculative import DraftSpec

    target = HFTarget(load_model("tiny-llama", seed=0).model)
    drafter = Drafter(DrafterConfig.from_target(target), target).eval()
    cfg = RolloutConfig(max_new_tokens=4, temperature=1.0)
    plain, spec = (
        RolloutEngine(target, cfg),
        SpeculativeRolloutLoop(target, drafter, cfg, DraftSpec(2), threshold=3),
    )
    calls = []
    for name, loop in (("plain", plain), ("sd", spec)):
        generate = loop.generate
        loop.generate = lambda group, generator, name=name, generate=generate: (
            calls.append((name, group[0][0], generator.initial_seed()))
            or generate(group, generator=generator)
        )
    prompts = [[i + 3, 7, 8] for i in range(3)]
    [out] = _compare(plain, {"chain2": spec}, prompts, size=2, repeats=2, seed=10, warm_up=True)
    runs = [("plain", 3, 10), ("sd", 3, 10), ("plain", 5, 11), ("sd", 5, 11)]
    assert calls == runs + runs and out["requests"] == 2


def test_speculative_bench_rejects_bad_arms(tmp_path):
    with pytest.raises(ValueError, match="distinct names to label the results"):
        main(["rollout", "--speculative", "--drafter", str(tmp_path / "a" / "d"), str(tmp_path / "b" / "d")])
    bench = ["rollout", "--speculative", "--drafter", str(tmp_path), "--arms"]
    with pytest.raises(ValueError, match="leave 'off' out"):
        main([*bench, "off", "chain4"])
    with pytest.raises(ValueError, match=r"names an arm twice: \['chain4', 'chain4'\]"):
        main([*bench, "chain4", "chain4"])
    with pytest.raises(ValueError, match="arm 'chain4@x' is not"):
        main([*bench, "chain4@x"])
