"""CertifyCallback on a tiny GRPO fit: certificates of the spot drafter's rollouts, as MLflow artifacts."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.rl.test_module import make_module, make_trainer
from tlt_lightning.callbacks import CertifyCallback, SpotDrafterCallback
from tlt_lightning.certify import CertifyConfig
from tlt_lightning.speculative import DraftSpec

QUICK = {"rows": 600, "depth": 2, "positions": [0], "chunk": 300}


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed")
def test_certificates_of_the_spot_drafter_are_artifacts_and_metrics_of_the_run(tmp_path):
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(
        experiment_name="certify",
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        artifact_location=str(tmp_path / "artifacts"),
    )
    spot = SpotDrafterCallback({"training": {"max_steps_per_rollout": 2}})
    cert = CertifyCallback({**QUICK, "top_p": 0.9}, every_n_steps=2, arm="chain2", num_prompts=2)
    trainer = make_trainer(
        2, callbacks=[spot, cert], logger=logger, default_root_dir=tmp_path / "run", log_every_n_steps=1
    )
    trainer.fit(make_module(temperature=0.7))
    # Before the first step and after step 2; the sampling settings are the fit's, top_p the override.
    assert [h["step"] for h in cert.history] == [0, 2]
    assert (cert.config.temperature, cert.config.top_p, cert.config.rows) == (0.7, 0.9, 600)
    assert all(h["lossless"] and 0 < h["detectable_tv"] < 0.2 for h in cert.history)
    saved = json.loads((cert.run_dir / "certify" / "step-00000002" / "certificate.json").read_text())
    assert saved["lossless"] and saved["rl_step"] == 2 and saved["arm"] == "chain2"
    assert saved["stack"] == "engine, arm chain2" and saved["sites"] == 2
    client, run = logger.experiment, logger.run_id
    listed = {a.path for a in client.list_artifacts(run, "certify/step-00000002")}
    assert {"certify/step-00000002/certificate.json", "certify/step-00000002/certificate.png"} <= listed
    assert [m.value for m in client.get_metric_history(run, "certify/lossless")] == [1.0]
    (tv,) = client.get_metric_history(run, "certify/detectable_tv")
    assert tv.step == 1 and tv.value == pytest.approx(cert.history[-1]["detectable_tv"])
    assert cert.state_dict()["history"] == cert.history


def test_plain_decoding_needs_no_drafter_and_a_drafter_arm_does(tmp_path):
    cert = CertifyCallback(QUICK, every_n_steps=1, arm="off", num_prompts=1)
    make_trainer(1, callbacks=[cert], default_root_dir=tmp_path).fit(make_module(speculative=False))
    assert [h["step"] for h in cert.history] == [0, 1] and cert.last.info["stack"] == "engine, arm off"
    with pytest.raises(TypeError, match="arm chain2 needs a drafter: add a SpotDrafterCallback"):
        make_trainer(1, callbacks=[CertifyCallback(QUICK, arm=DraftSpec(2))], default_root_dir=tmp_path).fit(
            make_module(speculative=False)
        )


def test_settings_are_checked_when_built(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps must be a positive int, got 0"):
        CertifyCallback(every_n_steps=0)
    with pytest.raises(ValueError, match=r"config has unknown fields \['row'\]"):
        CertifyCallback({"row": 10})
    with pytest.raises(ValueError, match="rows must be a positive int, got 0"):
        CertifyCallback({"rows": 0})
    with pytest.raises(TypeError, match="config must be a CertifyConfig or a dict of its fields, got list"):
        CertifyCallback([1])
    assert CertifyCallback(CertifyConfig(rows=10)).overrides["rows"] == 10
    with pytest.raises(ValueError, match="num_prompts=9 is more than the 4 prompts"):
        trainer = make_trainer(1, callbacks=[CertifyCallback(num_prompts=9)], default_root_dir=tmp_path)
        trainer.fit(make_module())
