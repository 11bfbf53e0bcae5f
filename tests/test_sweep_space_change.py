"""A sweep refuses, in one line and before any trial or MLflow run is made, what it could only do wrong: resuming a
study with a choice whose values changed (Optuna cannot change them within a study: the ask failed with a traceback
and left trials and the parent run RUNNING), and settings every trial would refuse (each trial failed as config_error
and the sweep exited 0 with a map of them). A moved numeric range is resumed, and the new space's settings measured
(issue 47 #14, #17)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from tests import fake_sweep
from tests.test_sweep import _fake_sweep, _runs, _study

# Stand-in trials that record their MLflow runs as real ones do (tests/fake_sweep.py): none is left RUNNING by them.
RECORDED = {"process": fake_sweep.trial}


class _ThroughThePlugin:
    """The sweep as `python -m src.train -m hydra/sweeper=optuna` runs it: through the Hydra plugin, whose refusals
    are one line on stderr and an exit code (stand in for SweepEngine in tests.test_sweep._fake_sweep)."""

    def __init__(self, config: Any, arguments: list[str]) -> None:
        self.config, self.arguments = config, arguments

    def run(self) -> None:
        from hydra_plugins.qlora_optuna_sweeper.optuna_sweeper import OptunaSweeper

        sweeper = OptunaSweeper()
        sweeper.setup(hydra_context=None, task_function=None, config=self.config)  # type: ignore[arg-type]
        sweeper.sweep(self.arguments)


def _refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: Any, **kwargs: Any) -> tuple:
    """(exit code, stderr) of a sweep the plugin refuses."""
    monkeypatch.setattr("tests.test_sweep.SweepEngine", _ThroughThePlugin)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        _fake_sweep(monkeypatch, *args, **kwargs)
    return exit_.value.code, capsys.readouterr().err


def _state(root: Path, client: Any, name: str) -> tuple[list, list]:
    """The study's trials and the experiment's runs, as (number, state) and (run id, status)."""
    trials = sorted((t.number, t.state) for t in _study(root, name).get_trials())
    return trials, sorted((r.info.run_id, r.info.status) for r in _runs(client, name))


@pytest.mark.slow(seconds=7)
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("lora.r=choice(8,16)", "lora.r=choice(4,32)"),  # changed
        ("lora.r=choice(4,8,16)", "lora.r=choice(4,8,32)"),  # widened: the gate said all settings were on the map
        ("lora.r=choice(8,16)", "lora.r=range(8,24,8)"),  # another kind of space
    ],
)
def test_a_resumed_study_whose_choice_changed_is_refused_in_one_line_before_anything_is_made(
    root: Path, mlflow_client: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, before, after
) -> None:
    _fake_sweep(monkeypatch, "changed", 3, [before], **RECORDED)
    was = _state(root, mlflow_client, "changed")
    code, err = _refused(monkeypatch, capsys, "changed", 8, [after], **RECORDED)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and "lora.r" in lines[0], err
    assert "hydra.sweeper.study_name=changed-2" in lines[0], "how to start a new study"
    assert "Traceback" not in err
    assert _state(root, mlflow_client, "changed") == was, "no trial, no MLflow run made; none left RUNNING"
    trials, runs = was
    assert not [n for n, s in trials if s == TrialState.RUNNING] and not [r for r, s in runs if s == "RUNNING"]


@pytest.mark.slow(seconds=13)
@pytest.mark.parametrize("sampler", ["grid", "tpe"])
def test_a_resumed_study_whose_range_moved_measures_the_new_settings(
    root: Path, mlflow_client: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, sampler: str
) -> None:
    """Optuna takes a moved numeric range in the same study: the sweep goes on, and its 'all settings of the space
    are on the map' counts the new space's settings, not the settings recorded (4, 8, 12 are three, as 8, 12, 16 are:
    16 was never measured)."""
    sampled = f"hydra/sweeper/sampler={sampler}"
    _fake_sweep(monkeypatch, "moved", 20, ["lora.r=range(4,16,4)"], sampled, **RECORDED)  # 4, 8, 12
    first = {t.params["lora.r"] for t in _study(root, "moved").get_trials() if t.state == TrialState.COMPLETE}
    assert first == {4, 8, 12}
    capsys.readouterr()
    _fake_sweep(monkeypatch, "moved", 40, ["lora.r=range(8,20,4)"], sampled, **RECORDED)  # 8, 12, 16
    out = capsys.readouterr().out
    trials = _study(root, "moved").get_trials()
    measured = sorted(t.params["lora.r"] for t in trials if t.state == TrialState.COMPLETE)
    assert measured == [4, 8, 12, 16], "16 measured once; 8 and 12 not again"
    assert "all 3 settings of the space are on the map" in out, out
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert not [r for r in _runs(mlflow_client, "moved") if r.info.status == "RUNNING"]


@pytest.mark.parametrize(
    ("fixed", "names"),
    [
        ("trainer.torch_empty_cache_steps=5", "trainer.torch_empty_cache_steps=5"),
        ("fault.kind=bogus", "fault.kind=bogus"),
        ("data.max_seq_length=100000", "data.max_seq_length=100000 exceeds the model's context"),
    ],
)
def test_a_fixed_setting_every_trial_would_refuse_is_refused_before_anything_is_made(
    root: Path, mlflow_client: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, fixed, names
) -> None:
    """The trial's own preflight (src/preflight: config guards, credentials, the data) on the config the first trial
    would get: its one-line message and exit 2, as a single run refuses, not a map of config errors."""
    code, err = _refused(monkeypatch, capsys, "fixedbad", 2, ["lora.r=choice(4,8)", fixed])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: ") and names in lines[0] and "preflight refused training" in lines[0], err
    assert not (root / "sweeps" / "fixedbad" / "optuna.db").exists(), "no study made"
    assert mlflow_client.get_experiment_by_name("fixedbad") is None, "no MLflow run made"


def test_a_swept_value_some_trials_refuse_still_sweeps_the_others(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only what every trial would refuse stops the sweep: a refused value among good ones is that trial's failure
    (a warning, and the trial's config_error), and the check of the fixed part takes a value the guards accept."""
    with caplog.at_level("WARNING", logger="src.sweep.checks"):
        _fake_sweep(monkeypatch, "somebad", 1, ["lora.r=choice(0,8)"], "hydra.sweeper.enqueue_trials=[{lora.r:8}]")
    assert "lora.r: 0: lora.r=0: must be at least 1" in caplog.text
    assert _study(root, "somebad").get_trials()


def test_a_probe_setting_no_trial_can_compose_is_refused_before_anything_is_made(
    root: Path, mlflow_client: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """hydra.sweeper.trial_overrides reach only the trials: a key there that Hydra refuses failed every trial."""
    probe = "hydra.sweeper.trial_overrides=['trainer.max_stepz=4']"
    code, err = _refused(monkeypatch, capsys, "probebad", 2, ["lora.r=choice(4,8)"], probe)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "trainer.max_stepz" in lines[0], err
    assert mlflow_client.get_experiment_by_name("probebad") is None
