"""tlt-lightning certify on a tiny model: one folder per arm, exit status 0 when lossless."""

from __future__ import annotations

import json

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
