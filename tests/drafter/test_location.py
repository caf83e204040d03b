"""``drafter_path`` settings: relative to the config file that names them, from any working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from tlt_lightning.drafter.location import check_drafter_location, drafter_location
from tlt_lightning.rl.config import SpeculativeConfig
from tlt_lightning.spot.config import SpotConfig


def parse(args: list[str]) -> tuple[SpotConfig, SpeculativeConfig]:
    """The two settings as LightningCLI parses them (jsonargparse, dataclass types, config files)."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action="config")
    parser.add_argument("--spot", type=SpotConfig, default=SpotConfig())
    parser.add_argument("--speculative", type=SpeculativeConfig, default=SpeculativeConfig())
    init = parser.instantiate(parser.parse_args(args))
    return init.spot, init.speculative


@pytest.fixture
def layout(tmp_path, monkeypatch) -> Path:
    """``configs/job.yaml`` naming ``../drafters/a``, run from an unrelated working directory."""
    (tmp_path / "drafters" / "a").mkdir(parents=True)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "job.yaml").write_text(
        "spot:\n  drafter_path: ../drafters/a\nspeculative:\n  drafter_path: ../drafters/a\n"
    )
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def test_a_relative_path_in_a_config_file_is_resolved_against_that_files_directory(layout):
    spot, speculative = parse(["--config", str(layout / "configs" / "job.yaml")])
    expected = os.path.join(layout / "configs", "../drafters/a")
    assert spot.drafter_path == speculative.drafter_path == expected
    assert isinstance(spot.drafter_path, str) and Path(spot.drafter_path).is_dir()


def test_a_relative_path_on_the_command_line_is_resolved_against_the_working_directory(layout):
    relative = "../drafters/a"
    spot, speculative = parse(["--spot.drafter_path", relative, f"--speculative.drafter_path={relative}"])
    assert Path(spot.drafter_path) == Path(speculative.drafter_path) == layout / "elsewhere" / "../drafters/a"
    assert Path(spot.drafter_path).is_absolute()


def test_uris_and_missing_directories_stay_the_strings_given(layout):
    spot, speculative = parse(["--spot.drafter_path", "models:/tlt/3", "--speculative.drafter_path", "nope"])
    assert (spot.drafter_path, speculative.drafter_path) == ("models:/tlt/3", "nope")


def test_python_paths_become_strings_and_bad_types_are_refused():
    assert SpotConfig(drafter_path=Path("d")).drafter_path == "d"
    assert SpeculativeConfig(drafter_path=Path("d")).drafter_path == "d"
    assert drafter_location(None) is None
    with pytest.raises(ValueError, match="speculative.drafter_path"):
        SpeculativeConfig(drafter_path=3)


def test_a_missing_directory_is_refused_saying_how_relative_paths_resolve(tmp_path):
    check_drafter_location("models:/tlt/3", "x")  # a URI passes: MLflow reports what it cannot find
    check_drafter_location(str(tmp_path), "x")
    with pytest.raises(ValueError, match="x 'nope' is not a drafter directory .* resolved against that file"):
        check_drafter_location("nope", "x")
