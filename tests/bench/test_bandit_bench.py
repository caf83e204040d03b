import json

from tlt_lightning.cli import main


def test_bench_bandit_cli_writes_json_and_plot(tmp_path, capsys):
    path = tmp_path / "bandit.json"
    main(["bench", "bandit", "--steps", "1500", "--json", str(path)])
    data = json.loads(path.read_text())
    assert {"begmab", "ucb", "fixed:off"} <= set(data["strategies"])
    assert 0 < data["strategies"]["begmab"]["reward_vs_oracle"] <= 1.05
    assert path.with_suffix(".png").stat().st_size > 10_000
    assert "reward / per-bucket oracle" in capsys.readouterr().out
