"""Fault injection: ``tlt-lightning fit`` processes stopped by SIGKILL, SIGTERM or SIGINT at a step, then
resumed with ``--ckpt_path=last``: the resumed run ends bit-identical to the uninterrupted one, in one
MLflow run, and the signals a scheduler sends exit ``128 + signal`` with ``last.ckpt`` of the step.

The step is chosen by waiting for a file the fit writes (the drafter's checkpoint of a step, saved after
every step), never by sleeping: the signal lands at the end of that step or in a later one.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same, callback_state
from tests.test_fit_processes import Fit, rewards, runs, the_one, tlt_config
from tlt_lightning.tracking import mlflow_available

pytestmark = pytest.mark.skipif(not mlflow_available(), reason="the mlflow extra is not installed")

STEPS = 6


def last_checkpoint(root: Path) -> dict:
    return torch.load(the_one("*/*/checkpoints/last.ckpt", root), weights_only=False, mmap=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Iterator[Callable[[], tuple[Path, dict]]]:
    """The reference, the same fit never stopped, started at once (beside the first test's fits): call it
    for ``(its store, its last checkpoint)`` once it has ended."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    store, root = tmp / "mlflow.db", tmp / "fit"
    fit = Fit(tmp, "full", tlt_config(tmp), root, store, f"--trainer.max_steps={STEPS}")

    @functools.cache
    def result() -> tuple[Path, dict]:
        fit.succeed()
        return store, last_checkpoint(root)

    yield result
    if fit.proc.poll() is None:  # a test failed before it waited
        fit.proc.kill()
        fit.proc.wait()


@pytest.mark.parametrize(
    ("sig", "after_drafter_step"),
    # SIGKILL after the drafter of step 3: the Lightning checkpoint of step 2 is on disk (saved after it).
    [(signal.SIGTERM, 2), (signal.SIGINT, 3), (signal.SIGKILL, 3)],
    ids=["SIGTERM", "SIGINT", "SIGKILL"],
)
def test_fit_stopped_by_a_signal_resumes_into_the_uninterrupted_run(
    tmp_path, uninterrupted, sig, after_drafter_step
):
    config, store, root = tlt_config(tmp_path), tmp_path / "mlflow.db", tmp_path / "fit"
    victim = Fit(tmp_path, "victim", config, root, store, f"--trainer.max_steps={STEPS}")
    marker = f"*/*/drafter/checkpoints/step-{after_drafter_step:08d}"
    victim.wait_for(lambda: any(root.glob(marker)), f"the drafter of step {after_drafter_step}")
    victim.proc.send_signal(sig)
    rc = victim.wait()

    (run,) = runs(store)
    stopped = last_checkpoint(root)["global_step"]
    if sig == signal.SIGKILL:
        assert rc == -signal.SIGKILL, f"it ended before the kill; make it longer:\n{victim.output()}"
        assert run.info.status == "RUNNING"  # nothing could end it
        assert stopped < STEPS
    else:
        # At the end of the step it was in: that step saved, the run marked, one line saying so.
        assert rc == 128 + sig, victim.output()
        assert after_drafter_step <= stopped < STEPS, victim.output()
        assert run.info.status == "KILLED"
        assert not any(root.glob(f"*/*/drafter/checkpoints/step-{stopped + 1:08d}"))  # no step after it
        saved = the_one("*/*/checkpoints/last.ckpt", root)
        line = (
            f"tlt-lightning fit: stopped by {sig.name} after step {stopped}: saved {saved}; MLflow run "
            f"{run.info.run_id} marked KILLED; resume: the same command with --ckpt_path={saved}"
        )
        assert line in victim.output().splitlines(), victim.output()

    resume = ("resumed", config, root, store, f"--trainer.max_steps={STEPS}", "--ckpt_path=last")
    Fit(tmp_path, *resume).succeed()

    # One MLflow run, finished, its rewards the uninterrupted run's step for step.
    (after,) = runs(store)
    assert (after.info.run_id, after.info.status) == (run.info.run_id, "FINISHED")
    assert after.data.tags["resumed_from_status"] == "KILLED"
    full_store, full = uninterrupted()
    (full_run,) = runs(full_store)
    assert rewards(store, run.info.run_id) == rewards(full_store, full_run.info.run_id)
    # Policy, optimizer, drafter and bandit: bit-identical.
    end = last_checkpoint(root)
    assert end["global_step"] == full["global_step"] == STEPS
    assert_same(end["state_dict"], full["state_dict"], "policy")
    assert_same(end["optimizer_states"], full["optimizer_states"], "optimizer")
    spot, spot_full = (callback_state(c, "SpotDrafterCallback") for c in (end, full))
    assert_same(spot["drafter"], spot_full["drafter"], "drafter")
    assert callback_state(end, "BanditCallback") == callback_state(full, "BanditCallback")
