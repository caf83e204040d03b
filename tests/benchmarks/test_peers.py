import io
import json
import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import parse
from benchmarks.common import prompt_groups
from benchmarks.peers import alternate, compare, eos_ignored, warm_up
from benchmarks.peers_client import PeerClient, RunTiming
from benchmarks.peers_report import agreement, summarise
from benchmarks.peers_worker import handle, serve
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.models import CompileConfig, HFTarget, load_model
from tlt_lightning.rollout import RolloutConfig, RolloutEngine

FAKE_WORKER = Path(__file__).with_name("fake_peer_worker.py")
ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
# $TLT_VLLM_PYTHON, else the checkout's .venv-vllm (`make setup-vllm`), as tests/vllm/test_backend.py.
VLLM_PYTHON = Path(
    os.environ.get("TLT_VLLM_PYTHON") or Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python"
)


def _fake_command() -> list[str]:
    return [sys.executable, str(FAKE_WORKER)]


def _env() -> dict[str, str]:
    path = os.pathsep.join([SRC, str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _prompts(n: int, seed: int = 0, high: int = 120) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (5 + i % 4,), generator=g).tolist() for i in range(n)]


# ----------------------------------------------------------------------------------- timing and alternation
def test_run_timing_counts_prefill_in_and_out():
    t = RunTiming(tokens=[[1] * 10, [2] * 10], total_s=2.0, first_s=0.5)
    assert t.generated == 20
    assert t.end_to_end_tps == pytest.approx(10.0)
    assert t.decode_tps == pytest.approx(18 / 1.5)  # the first token of each request is the prefill's


def test_alternate_runs_engines_in_turn_on_the_same_groups():
    calls = []

    def engine(name):
        def call(prompts):
            calls.append((name, [p[0] for p in prompts]))
            return RunTiming([[0]] * len(prompts), 1.0, 0.1)

        return call

    prompts = [[i] for i in range(5)]
    runs = alternate({"a": engine("a"), "b": engine("b")}, prompt_groups(prompts, size=2, repeats=3))
    assert calls == [("a", [0, 1]), ("b", [0, 1]), ("a", [2, 3]), ("b", [2, 3]), ("a", [4, 0]), ("b", [4, 0])]
    assert [len(v) for v in runs.values()] == [3, 3]
    calls.clear()
    warm = warm_up(
        {"a": engine("a")}, prompt_groups(prompts, size=2, repeats=3) + prompt_groups(prompts, 2, 1)
    )
    assert calls == [("a", [0, 1]), ("a", [2, 3]), ("a", [4, 0])] and set(warm) == {"a"}  # each group once


def test_summarise_medians_ratios_and_agreement():
    a = [RunTiming([[1, 2, 3], [4, 5, 6]], s, 0.5) for s in (1.0, 2.0, 3.0)]
    b = [RunTiming([[1, 2, 3], [4, 9, 6]], s, 0.5) for s in (2.0, 4.0, 6.0)]
    out = summarise({"ours": a, "vllm": b}, [("ours", "vllm")], greedy=True)
    assert out["engines"]["ours"]["end_to_end_tokens_per_s"] == pytest.approx(3.0)  # 6 tokens / 2 s
    ratio = out["ratios"]["ours/vllm"]
    assert ratio["end_to_end"] == pytest.approx(2.0)
    assert ratio["decode"] == pytest.approx((4 / 1.5) / (4 / 3.5))
    assert ratio["agreement"]["identical"] == 3 and ratio["agreement"]["responses"] == 6
    assert ratio["agreement"]["mean_common_prefix"] == pytest.approx((1 + 1 / 3) / 2)
    assert (
        "agreement"
        not in summarise({"ours": a, "vllm": b}, [("ours", "vllm")], greedy=False)["ratios"]["ours/vllm"]
    )


def test_agreement_of_different_lengths():
    out = agreement([RunTiming([[1, 2, 3, 4]], 1.0, 0.0)], [RunTiming([[1, 2]], 1.0, 0.0)])
    assert out["identical"] == 0 and out["mean_common_prefix"] == pytest.approx(0.5)


def test_eos_ignored_runs_every_request_to_max_new_tokens(tiny_llama):
    eos = tiny_llama.info.eos_token_ids
    engine = RolloutEngine(tiny_llama, RolloutConfig(max_new_tokens=12, temperature=1.0))
    with eos_ignored(tiny_llama):
        result = engine.generate(_prompts(4), generator=torch.Generator().manual_seed(0))
    assert tiny_llama.info.eos_token_ids == eos  # restored
    assert [r.length for r in result.rollouts] == [12] * 4


# ---------------------------------------------------------------------------------------- worker protocol
class _Peer:
    device = "cpu"

    def __init__(self, spec):
        self.spec = spec
        self.target = HFTarget(load_model("tiny-llama", seed=0).model)

    def generate(self, prompts, config, ignore_eos):
        with eos_ignored(self.target) if ignore_eos else _null():
            return RolloutEngine(self.target, config).generate(prompts)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _serve(lines):
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(x) + "\n" for x in lines)), out, _Peer)
    return [json.loads(x) for x in out.getvalue().splitlines()]


def test_worker_protocol_start_generate_stop():
    prompts = _prompts(2)
    answers = _serve(
        [
            {
                "op": "generate",
                "prompts": prompts,
                "max_new_tokens": 4,
            },  # before start: an error, not a crash
            {"op": "start", "model": "x"},
            {"op": "start", "model": "x"},  # twice: refused
            {
                "op": "generate",
                "prompts": prompts,
                "max_new_tokens": 6,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            {"op": "nonsense"},
            {"op": "stop"},
            {"op": "generate", "prompts": prompts, "max_new_tokens": 4},  # after stop: never read
        ]
    )
    assert len(answers) == 6
    assert answers[0]["ok"] is False and "send a start request first" in answers[0]["error"]
    assert answers[1]["ok"] and answers[1]["startup_s"] >= 0 and answers[1]["torch_threads"] >= 1
    assert answers[2]["ok"] is False and "started already" in answers[2]["error"]
    gen = answers[3]
    assert gen["ok"] and [len(t) for t in gen["tokens"]] == [6, 6] and gen["finish_reasons"] == ["length"] * 2
    assert gen["total_s"] > 0 and len(gen["first_token_s"]) == 2
    assert gen["spec"] == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    ours = RolloutEngine(
        HFTarget(load_model("tiny-llama", seed=0).model), RolloutConfig(max_new_tokens=6, temperature=0.0)
    )
    with eos_ignored(ours.target):
        assert gen["tokens"] == [r.token_ids.tolist() for r in ours.generate(prompts).rollouts]
    assert answers[4]["ok"] is False and "op must be one of" in answers[4]["error"]
    assert answers[5] == {"ok": True}


def test_handle_rejects_a_bad_temperature_with_the_field_named():
    state = {}
    handle(state, {"op": "start"}, _Peer)
    with pytest.raises(ValueError, match="temperature"):
        handle(state, {"op": "generate", "prompts": [[1, 2]], "max_new_tokens": 2, "temperature": -1}, _Peer)


def test_peer_client_reports_a_failed_start(tmp_path):
    client = PeerClient(_fake_command(), {**_env(), "FAKE_PEER_FAIL": "start"}, log=tmp_path / "w.log")
    with pytest.raises(RuntimeError, match="fake start failure"):
        client.start({"model": "unused"})
    client.close()
    assert client.proc.returncode == 0


# ------------------------------------------------------------------------- the whole comparison, fake vLLM
def _args(tmp_path, **kw) -> Namespace:
    args = parse(
        [
            "peers",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(tmp_path / "peers.json"),
            "--dtype",
            "float32",
            "--model",
            "tiny-llama",
            "--batch-sizes",
            "1",
            "3",
            "--max-new-tokens",
            "8",
            "--long-tail-requests",
            "4",
            "--long-tail-max-new",
            "12",
            "--repeats",
            "2",
            "--k",
            "2",
            "--worker-command",
            *_fake_command(),
        ]
    )
    vars(args).update(kw)
    return args


def test_compare_with_a_fake_worker_writes_json_plot_and_equal_greedy_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    loaded = load_model("tiny-llama", dtype="float32", seed=0)
    loaded.model.save_pretrained(tmp_path / "target")
    target = HFTarget(loaded.model)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(target), target).eval()
    args = _args(tmp_path)
    eos = target.info.eos_token_ids
    payload = compare(args, target, drafter, _prompts(6), tmp_path / "target", tmp_path / "unused-drafter")
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["plot"] == payload["plot"] and Path(data["plot"]).stat().st_size > 10_000
    assert set(data["vllm"]) == {"plain", "speculative"} and data["vllm"]["plain"]["startup_s"] >= 0
    assert data["decode"] == "hf" and data["compile_seconds"] == 0 and data["compile_buckets"] == []
    assert [(b["phase"], b["batch_size"]) for b in data["batches"]] == [
        ("plain", 1),
        ("plain", 3),
        ("sampled", 1),
        ("speculative", 1),
        ("speculative", 3),
    ]
    (sampled,) = [b for b in data["batches"] if b["phase"] == "sampled"]
    # T=1: ours and ours-sd against vLLM's plain engine, the tokens fixed (EOS ignored), no agreement counted.
    assert set(sampled["engines"]) == {"ours", "ours-sd", "vllm"}
    assert set(sampled["ratios"]) == {"ours/vllm", "ours-sd/vllm"}
    assert all("agreement" not in r for r in sampled["ratios"].values())
    assert all(e["tokens"] == 8 for e in sampled["engines"].values())
    for b in data["batches"]:
        if b["phase"] == "sampled":
            continue
        (ratio,) = b["ratios"].values()
        # Greedy, same weights, same engine behind the pipe: equal token for token, lossless speculation too.
        assert ratio["agreement"]["identical"] == ratio["agreement"]["responses"] == 2 * b["batch_size"]
        for engine in b["engines"].values():
            assert engine["tokens"] == 8 * b["batch_size"]  # EOS ignored: exactly max_new_tokens each
            assert len(engine["runs_decode_tokens_per_s"]) == 2
    lt = data["long_tail"]
    assert set(lt["engines"]) == {"ours", "ours-sd", "vllm"} and set(lt["ratios"]) == {
        "ours/vllm",
        "ours-sd/vllm",
    }
    assert all(v[2] <= 12 for v in lt["lengths_p50_p90_max"].values())
    assert set(lt["warmup_s"]) == set(lt["engines"]) and lt["compile_seconds_in_timed_runs"] == 0
    assert target.info.eos_token_ids == eos  # restored after the EOS-ignoring workloads
    assert data["worker_env"]["PYTHONPATH"] == os.pathsep.join(["src", "."])  # no machine paths in the file


def test_no_fixed_batches_runs_the_long_tail_alone(tmp_path, monkeypatch):
    """``--batch-sizes`` and ``--sampled-batch-sizes`` with none: the long tail (ours, ours-sd, vLLM) and no
    speculative phase (it crashed)."""
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    loaded = load_model("tiny-llama", dtype="float32", seed=0)
    loaded.model.save_pretrained(tmp_path / "target")
    target = HFTarget(loaded.model)
    drafter = Drafter(DrafterConfig.from_target(target), target).eval()
    compare(
        _args(tmp_path, batch_sizes=[], sampled_batch_sizes=[]),
        target,
        drafter,
        _prompts(4),
        tmp_path / "target",
        tmp_path / "unused",
    )
    data = json.loads((tmp_path / "peers.json").read_text())
    assert data["batches"] == [] and set(data["vllm"]) == {"plain"}
    assert set(data["long_tail"]["engines"]) == {"ours", "ours-sd", "vllm"}


def test_compiled_engines_compile_nothing_inside_the_timed_runs(tmp_path, monkeypatch, fresh_compile):
    """``--decode compiled``: target and drafter graphs compile in the warm-ups, which run every group the
    timed runs use (speculation shrinks the batch at other steps in each group: other buckets)."""
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])
    loaded = load_model("tiny-llama", dtype="float32", seed=0)
    loaded.model.save_pretrained(tmp_path / "target")
    config = CompileConfig(batch_buckets=(1, 2, 4), query_buckets=(1, 4), kv_step=16)
    target = HFTarget(loaded.model, decode="compiled", compile_config=config)
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.from_target(target), target).eval().use_compiled_steps(config)
    args = _args(tmp_path, batch_sizes=[3], repeats=3, long_tail_requests=3, long_tail_max_new=20)
    data = compare(args, target, drafter, _prompts(9), tmp_path / "target", tmp_path / "unused-drafter")
    assert (
        data["decode"] == "compiled" and data["compile_seconds"] > 0 and data["drafter_compile_seconds"] > 0
    )
    for b in data["batches"]:
        assert b["compile_seconds_in_timed_runs"] == 0, b["phase"]
        assert set(b["warmup_s"]) == set(b["engines"])
    assert data["long_tail"]["compile_seconds_in_timed_runs"] == 0


def test_cli_lists_peers():
    args = parse(["peers", "--batch-sizes", "1", "--long-tail-requests", "0"])
    assert (
        args.name == "peers" and args.vllm_python == ".venv-vllm/bin/python" and args.long_tail_requests == 0
    )


# -------------------------------------------------------------------------------------------- real vLLM
@pytest.mark.vllm
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"no vLLM environment at {VLLM_PYTHON} (make setup-vllm, or set TLT_VLLM_PYTHON)",
)
def test_real_vllm_worker_greedy_equals_ours(tmp_path):
    from tlt_lightning.recipes.vllm_stages import greedy_agreement

    loaded = load_model("smollm2-135m", dtype="float32")
    loaded.model.save_pretrained(tmp_path / "target")
    target = HFTarget(loaded.model)
    prompts = _prompts(2, seed=1)
    config = RolloutConfig(max_new_tokens=16, temperature=0.0)
    env = {**_env(), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with PeerClient([str(VLLM_PYTHON), "-m", "benchmarks.peers_worker"], env, log=tmp_path / "w.log") as c:
        info = c.start(
            {
                "model": str(tmp_path / "target"),
                "dtype": "float32",
                "gpu_memory_utilization": 0.1,
                "max_model_len": 512,
                "enforce_eager": True,
            }
        )
        assert info["vllm"] != "none" and info["device"] == "cpu" and info["startup_s"] > 0
        got = c.engine(16, 0.0, ignore_eos=True)(prompts)
    assert [len(t) for t in got.tokens] == [16, 16] and got.first_s <= got.total_s
    with eos_ignored(target):
        ref = RolloutEngine(target, config).generate(prompts).rollouts
    other = [
        type("R", (), {"prompt_ids": r.prompt_ids, "token_ids": torch.tensor(t)})
        for r, t in zip(ref, got.tokens)
    ]
    verdict = greedy_agreement(ref, other, loaded.model, tie_tolerance=0.05)
    assert verdict["ok"], verdict
