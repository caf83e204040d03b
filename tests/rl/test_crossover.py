import pytest

from tests.rl.test_module import make_module
from tlt_lightning.drafter import Drafter, DrafterConfig
from tlt_lightning.rl import crossover
from tlt_lightning.rl.config import SpeculativeConfig
from tlt_lightning.rl.crossover import calibrate_crossover, calibration_sizes, measure_step_costs
from tlt_lightning.rollout import RolloutConfig
from tlt_lightning.scheduling import BEGMABStrategy, StepCostModel
from tlt_lightning.speculative import DraftSpec

CHAIN2 = DraftSpec(2)


def test_calibration_sizes_cover_speculations_range():
    assert calibration_sizes(1) == []
    assert calibration_sizes(2) == [1]
    assert calibration_sizes(5) == [1, 2, 3, 4]
    sizes = calibration_sizes(64)
    assert sizes[0] == 1 and sizes[-1] == 63 and len(sizes) < 15


def test_measure_step_costs_times_plain_and_each_arm_at_each_batch_size(tiny_llama):
    drafter = Drafter(DrafterConfig.from_target(tiny_llama), tiny_llama).eval()
    lines = []
    costs = measure_step_costs(
        tiny_llama,
        drafter,
        RolloutConfig(temperature=1.0),
        [5, 6, 7],
        [1, 3],
        [CHAIN2],
        context=20,
        steps=6,
        progress=lines.append,
    )
    assert sorted(costs.seconds) == [1, 3] and costs.context == 20
    for row in costs.seconds.values():
        assert set(row) == {"off", "chain2"} and all(0 < s < 5 for s in row.values())
    assert len(lines) == 2 and lines[0].startswith("step costs at 1 rows: off ")
    with pytest.raises(ValueError, match="non-empty prompt"):
        measure_step_costs(tiny_llama, drafter, RolloutConfig(), [], [1], [CHAIN2], context=20)


def module_with_bandit(crossover_mode: str):
    module = make_module(drafter_kind="eagle1", threshold=3, crossover=crossover_mode, max_new_tokens=16)
    module.configure_model()
    module.draft_strategy = BEGMABStrategy([None, CHAIN2], (1, 2))
    return module


def test_calibrate_crossover_measures_once_per_machine_then_reads_the_table_back(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path))
    module = module_with_bandit("measure")
    costs = calibrate_crossover(module, [CHAIN2])
    assert sorted(costs.seconds) == [1, 2] and "chain2" in costs.seconds[1]
    assert module.draft_strategy.step_costs == costs
    stored = list((tmp_path / "step_costs").glob("*.json"))
    assert len(stored) == 1 and costs.machine["model"] == "tiny-llama"

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although the table is stored")

    monkeypatch.setattr(crossover, "measure_step_costs", no_measuring)
    again = module_with_bandit("measure")
    assert calibrate_crossover(again, [CHAIN2]) == costs
    # Other settings are another table: another threshold measures other batch sizes.
    other = make_module(drafter_kind="eagle1", threshold=5, crossover="measure", max_new_tokens=16)
    other.configure_model()
    other.draft_strategy = BEGMABStrategy([None, CHAIN2], (1, 2))
    with pytest.raises(AssertionError, match="measured again"):
        calibrate_crossover(other, [CHAIN2])


def test_calibrate_crossover_runs_only_where_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_LIGHTNING_CACHE", str(tmp_path))
    assert calibrate_crossover(module_with_bandit("off"), [CHAIN2]) is None
    assert calibrate_crossover(module_with_bandit("auto"), [CHAIN2]) is None  # eager rollouts: not compiled
    assert calibrate_crossover(module_with_bandit("measure"), []) is None  # no arm to weigh
    reproducible = module_with_bandit("measure")  # its decisions must not depend on timing
    reproducible.draft_strategy = BEGMABStrategy([None, CHAIN2], (1, 2), cost_model=StepCostModel())
    assert calibrate_crossover(reproducible, [CHAIN2]) is None
    assert not (tmp_path / "step_costs").exists()


def test_crossover_setting_is_checked():
    assert SpeculativeConfig().crossover == "auto"
    with pytest.raises(ValueError, match="speculative.crossover"):
        SpeculativeConfig(crossover="sometimes")
