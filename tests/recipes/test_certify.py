"""tlt-lightning certify on a tiny model: one folder per arm, exit status 0 when lossless."""

from __future__ import annotations

import json

import pytest

from tlt_lightning.cli import main


def test_the_command_certifies_each_arm(tmp_path, capsys):
    argv = ["--threads", "1", "certify", "--model", "tiny-llama", "--arm", "off", "tree3x2/4"]
    argv += ["--rows", "300", "--depth", "2", "--positions", "0", "--num-prompts", "1"]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    for folder in ("off", "tree3x2-4"):
        report = json.loads((tmp_path / folder / "certificate.json").read_text())
        assert report["lossless"] and report["model"] == "tiny-llama" and "machine" in report
    assert "LOSSLESS at this power" in capsys.readouterr().out


def test_the_command_certifies_a_vllm_backend(tmp_path, monkeypatch, capsys):
    """Through the fake vLLM (our engine inside), on the CPU, where sampled speculation is sent anyway."""
    from tests.vllm.fake_vllm import fake_vllm_module
    from tlt_lightning.vllm import backend as vb

    built = []
    api = fake_vllm_module()
    monkeypatch.setattr(
        api, "LLM", lambda model, **kw: built.append(kw) or fake_vllm_module().LLM(model, **kw)
    )
    monkeypatch.setattr(vb, "require_vllm", lambda: api)
    monkeypatch.setattr(vb, "resolve_device", lambda config: "cpu")
    argv = ["--threads", "1", "certify", "--model", "tiny-llama", "--backend", "vllm", "--drafter", "random"]
    argv += ["--arm", "off", "chain3", "--rows", "200", "--depth", "2", "--positions", "0"]
    argv += ["--num-prompts", "1", "--temperature", "0.8", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "speculative_config" not in built[0]
    assert built[1]["speculative_config"]["num_speculative_tokens"] == 3
    for folder in ("off", "chain3"):
        report = json.loads((tmp_path / folder / "certificate.json").read_text())
        assert report["lossless"] and report["backend"] == "vllm" and report["arm"] == folder
        assert report["stack"] == "backend VLLMRolloutBackend" and report["config"]["temperature"] == 0.8
    with pytest.raises(
        ValueError, match="--backend vllm drafts plain chains .EAGLE.: arm tree3x2/4 is not one"
    ):
        main([*argv[:9], "--arm", "tree3x2/4", *argv[12:]])
