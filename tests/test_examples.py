"""The runnable examples of examples/ run (on tiny random models) and use only public import paths."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str) -> dict:
    """The example's module namespace (``main`` and its helpers), without running ``__main__``."""
    return runpy.run_path(str(EXAMPLES / name))


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Examples write under ``runs/`` here; the tiny models' files go to a temporary cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path / "cache"))


def test_spot_drafter_callback_on_a_grpo_module_then_export_its_checkpoint(tmp_path, capsys):
    """The design card's ``Trainer(callbacks=[SpotDrafterCallback()])``: the drafter trains and is
    checkpointed; the checkpoint exports for vLLM."""
    done = example("spot_drafter_grpo.py")["main"](["--tiny", "--out", str(tmp_path / "spot")])
    assert len(done["rewards"]) == 2 and len(done["accept"]) == 2
    checkpoint = Path(done["checkpoint"])
    assert (checkpoint / "model.safetensors").is_file() and "mean reward per step" in capsys.readouterr().out

    export = example("export_drafter.py")["main"]
    out = export([str(checkpoint), "--model", "tiny-llama", "--out", str(tmp_path / "e")])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["EagleLlamaForCausalLM"]
    assert "speculative_config" in capsys.readouterr().out


def test_export_drafter_tiny(tmp_path, capsys):
    export = example("export_drafter.py")["main"]
    out = export(["--tiny", "--out", str(tmp_path / "eagle"), "--engine", "sglang"])
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    assert "exported an eagle1 drafter for tiny-llama" in capsys.readouterr().out


def test_torchtune_recipe_with_overrides(tmp_path):
    pytest.importorskip("torchtune")
    main = example("torchtune_grpo.py")["main"]
    overrides = [
        "logger=null",
        f"output_dir={tmp_path / 'tt'}",
        "module.rollout_progress=false",
        "trainer.max_steps=1",
        "module.optim.lr=0.05",
    ]
    assert main(["--tiny", *overrides]) == 0
    assert (tmp_path / "tt").is_dir()


def public_names(module_name: str) -> set[str]:
    return set(getattr(importlib.import_module(module_name), "__all__", ()))


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_import_only_public_names(path):
    """``from tlt_lightning... import X`` in an example names an ``__all__`` entry of that module."""
    tree = ast.parse(path.read_text())
    imports = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tlt_lightning"
    ]
    assert imports, f"{path.name} imports nothing from tlt_lightning"
    for node in imports:
        if importlib.util.find_spec(node.module) is None:
            pytest.fail(f"{path.name}: no module {node.module}")
        private = [a.name for a in node.names if a.name not in public_names(node.module)]
        assert private == [], f"{path.name}: {node.module} does not export {private} in __all__"
