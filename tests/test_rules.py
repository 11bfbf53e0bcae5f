"""The sweep's decision rules on in-memory Optuna studies, no process and no model: which proposals the gate skips
(a repeat, a certain OOM by the knob registry's memory rules, a predicted OOM), how a setting is told infeasible,
which running trials a dead worker left, which finalists the soak takes, and when the sweep has nothing left to
launch. The subprocess sweeps (tests/test_sweep.py, test_resilience.py) keep what needs a process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow.entities  # noqa: F401 - see below
import optuna
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from src import knobs, record
from src.fit.model import MemoryModel, Prediction
from src.study import Sweep, TrialRow
from src.sweep import soak
from src.sweep.gate import SKIPS_IN_A_ROW, Gate, space_size
from src.sweep.memory import MemoryGate
from src.sweep.rules import (
    CONSTRAINTS_KEY,
    LaunchRules,
    infeasible,
    infeasible_state,
    predicted_skip,
    recorded_constraints,
)
from src.sweep.space import SpaceError
from src.sweep.storage import StudyStore, start_ticks, worker_identity

optuna.logging.set_verbosity(optuna.logging.WARNING)
# mlflow.entities, above: the gate records a prediction on the trial's run through them; imported with this module
# (seconds, once per process, as for any test of the suite that records), so a test's time is its rule's.

SEQ, ACC, R, BATCH, CKPT = (
    "data.max_seq_length",
    "trainer.gradient_accumulation_steps",
    "lora.r",
    "trainer.per_device_train_batch_size",
    "trainer.gradient_checkpointing",
)
SPACE = {
    SEQ: CategoricalDistribution([256, 512, 1024]),
    ACC: CategoricalDistribution([1, 2, 8]),
    R: CategoricalDistribution([8, 16]),
    BATCH: CategoricalDistribution([1, 2, 4]),
    CKPT: CategoricalDistribution([False, True]),
}
BASE = {SEQ: 512, ACC: 2, R: 8, BATCH: 1, CKPT: False}
BUDGET = 24.0


def _rules(*fixed: str) -> LaunchRules:
    """The launch rules with the knob registry's memory rules (hydra.sweeper.memory_monotone's default)."""
    return LaunchRules(OmegaConf.create({}), list(fixed), knobs.memory_directions(), BUDGET)


def _gate(rules: LaunchRules | None = None, **sweeper: Any) -> Gate:
    return Gate(OmegaConf.create({"skip_duplicates": True, "n_trials": 20, **sweeper}), rules or _rules(), BUDGET)


def _told(study: optuna.Study, status: str, kind: str | None = None, lever: list[str] | None = None, **knob: Any):
    """A finished trial of `study` at BASE changed by `knob` (keys by their last segment: max_seq_length=1024)."""
    params = _params(**knob)
    attrs = record.outcome_tags(status, {"kind": kind} if kind else None)
    if lever:
        attrs[record.LEVER] = json.dumps(lever)
    state = TrialState.COMPLETE if status == "ok" else TrialState.PRUNED
    study.add_trial(
        optuna.trial.create_trial(
            params=params, distributions=SPACE, value=1.0 if status == "ok" else None, user_attrs=attrs, state=state
        )
    )
    return study.trials[-1]


def _params(**knob: Any) -> dict[str, Any]:
    by_name = {key.rsplit(".", 1)[1]: key for key in SPACE}
    return {**BASE, **{by_name[name]: value for name, value in knob.items()}}


def _proposal(study: optuna.Study, lever: list[str] | None = None, **knob: Any) -> optuna.Trial:
    """The sampler's next proposal, at BASE changed by `knob`."""
    study.enqueue_trial(_params(**knob), user_attrs={record.LEVER: json.dumps(lever)} if lever else None)
    return study.ask(SPACE)


def _decide(gate: Gate, study: optuna.Study, **knob: Any):
    trial = _proposal(study, **knob)
    return gate.decide(study, trial, [f"{k}={v}" for k, v in trial.params.items()], "run", None)


# ---- skip as a repeat -------------------------------------------------------------------------------------------


def test_a_setting_measured_or_failed_by_itself_is_a_repeat_naming_the_trial_that_tells_it() -> None:
    study = optuna.create_study()
    measured = _told(study, "ok")
    failed = _told(study, "failed", "config_error", r=16)
    repeat = _decide(_gate(), study)
    assert (repeat.why, repeat.original.number) == ("repeat", measured.number)
    assert repeat.reason == f"same setting as trial {measured.number}"
    assert _decide(_gate(), study, r=16).original.number == failed.number
    assert _decide(_gate(), study, max_seq_length=256) is None, "a new setting runs"
    assert _decide(_gate(skip_duplicates=False), study) is None, "skip_duplicates=false measures it again"


def test_a_skipped_trial_or_another_lever_is_not_a_repeat() -> None:
    study = optuna.create_study()
    _told(study, "skipped", max_seq_length=256)  # told what its origin tells, but measured nothing itself
    _told(study, "ok", lever=["model.attn_implementation=sdpa"])
    assert _decide(_gate(), study, max_seq_length=256) is None
    assert _decide(_gate(), study) is None, "the recipe's setting without the lever was never measured"
    lever = _proposal(study, lever=["model.attn_implementation=sdpa"])
    assert _gate().decide(study, lever, [], "run", None).why == "repeat"


# ---- skip as a certain OOM (src/knobs.py's memory rules) ---------------------------------------------------------


def test_a_setting_that_needs_at_least_an_ooms_memory_on_every_knob_is_a_certain_oom() -> None:
    study = optuna.create_study()
    oom = _told(study, "failed", "oom")
    certain = _decide(_gate(), study, max_seq_length=1024)
    assert (certain.why, certain.original.number) == ("certain_oom", oom.number)
    assert certain.reason == f"certain oom: needs at least trial {oom.number}'s memory"
    gate = _gate()
    for knob in ({"r": 16}, {"per_device_train_batch_size": 4}, {"max_seq_length": 1024, "r": 16}):
        assert _decide(gate, study, **knob).why == "certain_oom", f"increasing: {knob}"
    assert _decide(gate, study, gradient_accumulation_steps=8).why == "certain_oom", "neutral: the same micro-step"
    for knob in ({"max_seq_length": 256}, {"gradient_checkpointing": True}, {"max_seq_length": 1024, "gradient_checkpointing": True}):  # fmt: skip
        assert _decide(gate, study, **knob) is None, f"may need less on one knob: {knob}"


def test_checkpointing_off_needs_more_than_on() -> None:
    """gradient_checkpointing is `decreasing` in the registry: an OOM with it on makes it off a certain OOM, not the
    other way round."""
    study = optuna.create_study()
    _told(study, "failed", "oom", gradient_checkpointing=True)
    assert _decide(_gate(), study, gradient_checkpointing=False).why == "certain_oom"
    other = optuna.create_study()
    _told(other, "failed", "oom", gradient_checkpointing=False)
    assert _decide(_gate(), other, gradient_checkpointing=True) is None


def test_a_setting_measured_ok_is_never_a_certain_oom_and_a_contradicted_oom_rules_nothing() -> None:
    study = optuna.create_study()
    _told(study, "failed", "oom", gradient_accumulation_steps=8)
    _told(study, "ok", gradient_accumulation_steps=1)  # accumulation is neutral: this OOM was not the setting's
    gate = _gate(skip_duplicates=False)  # not a repeat: the rule alone
    assert _decide(gate, study, gradient_accumulation_steps=1) is None, "measured ok"
    assert _decide(gate, study, max_seq_length=1024) is None, "the contradicted OOM extends to nothing"
    _told(study, "failed", "oom", per_device_train_batch_size=4)  # nothing contradicts this one
    assert _decide(gate, study, per_device_train_batch_size=4, r=16).why == "certain_oom"
    assert _decide(gate, study, per_device_train_batch_size=2) is None


def test_only_memory_failures_of_the_same_lever_rule_and_packed_batches_make_neutral_knobs_count() -> None:
    study = optuna.create_study()
    _told(study, "failed", "segfault")
    _told(study, "failed", "oom", lever=["model.attn_implementation=sdpa"])
    assert _decide(_gate(), study, max_seq_length=1024) is None, "a crash or another lever's OOM says nothing here"
    packed = optuna.create_study()
    _told(packed, "failed", "oom", gradient_accumulation_steps=2)
    assert _decide(_gate(_rules()), packed, gradient_accumulation_steps=8).why == "certain_oom"
    # packed rows: how many rows the probe holds moves the peak, so accumulation must be equal to compare
    assert _decide(_gate(_rules("trainer.packing=true")), packed, gradient_accumulation_steps=8) is None


# ---- skip as a predicted OOM (src/sweep/memory.py) ---------------------------------------------------------------


def _prediction(reserved: float, error: float = 0.1, context: float = 0.5) -> Prediction:
    return Prediction({"weights": reserved}, context, error)


def _memory(mode: str, tmp_path: Path, model: MemoryModel | None = None) -> MemoryGate:
    if model is not None:
        mode = str(tmp_path / "model.json")
        model.save(Path(mode))
    config = OmegaConf.create({"tracking": {"uri": "sqlite:///unused.db"}, "model": {"name": "tiny"}})
    return MemoryGate(config, mode, None, BUDGET)


def test_a_setting_predicted_beyond_the_budget_by_more_than_the_models_error_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fitted model's prediction: GiB = 10 x batch. Batch 4 (40 GiB) is over 24 GiB even 10% lower: skipped as
    a predicted OOM with its violation as the constraint record; batch 2 (20 GiB) runs. Either way the prediction
    is recorded on the trial and its run before anything is launched."""
    gate = _gate()
    gate.memory = _memory("", tmp_path, MemoryModel(points=20))
    monkeypatch.setattr(gate.memory, "predict", lambda overrides: _prediction(10.0 * int(_value(overrides, BATCH))))
    logged: list[Any] = []
    runs = SimpleNamespace(client=SimpleNamespace(log_batch=lambda run_id, metrics: logged.append((run_id, metrics))))
    study = optuna.create_study()
    big = _proposal(study, per_device_train_batch_size=4)
    skip = gate.decide(study, big, [f"{k}={v}" for k, v in big.params.items()], "run-4", runs)
    assert (skip.why, skip.failure_kind) == ("predicted_oom", "oom") and skip.original is None
    assert infeasible(skip.constraints) and skip.constraints[0] == pytest.approx(40.5 / BUDGET - 1)
    assert (
        skip.reason
        == "predicted oom: 40.5 GiB on the card (the model over-predicts by at most 10%) for a 24 GiB budget"
    )
    small = _proposal(study, per_device_train_batch_size=2)
    assert gate.decide(study, small, [f"{k}={v}" for k, v in small.params.items()], "run-2", runs) is None
    assert small.user_attrs["predicted_peak_vram_device_gib"] == pytest.approx(20.5)
    assert [run_id for run_id, _ in logged] == ["run-4", "run-2"]


def _value(overrides: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


def test_a_prediction_within_the_models_error_or_from_a_model_that_may_not_decide_skips_nothing(
    tmp_path: Path,
) -> None:
    near = _prediction(25.0, error=0.1)  # 25.5 GiB on the card, but 10% less fits a 24 GiB budget
    over = _prediction(40.0)
    fitted = _memory("", tmp_path, MemoryModel(points=20))
    assert not fitted.skips(near) and fitted.skips(over)
    assert not _memory("predict", tmp_path).skips(over), "predict: records, never skips"
    assert not _memory("off", tmp_path).skips(over)
    auto = _memory("auto", tmp_path)
    auto.model, auto.stack = MemoryModel(points=20), None
    assert not auto.skips(over), "auto on a CPU: its trials measured no VRAM"
    auto.model, auto.stack = MemoryModel(points=3), {"gpu.name": "H200"}
    assert not auto.skips(over), "auto on a GPU with fewer measured trials than the model needs"
    auto.model = MemoryModel(points=20)
    assert auto.skips(over)


def test_a_repeat_or_a_certain_oom_is_decided_before_any_prediction(tmp_path: Path) -> None:
    gate = _gate()
    gate.memory = _memory("", tmp_path, MemoryModel(points=20))
    gate.memory.predict = lambda overrides: pytest.fail("predicted a setting the rules already decided")
    study = optuna.create_study()
    _told(study, "ok")
    _told(study, "failed", "oom", r=16)
    assert _decide(gate, study).why == "repeat"
    assert _decide(gate, study, r=16, max_seq_length=1024).why == "certain_oom"


def test_predicted_skip_is_infeasible_by_how_far_it_is_over() -> None:
    skip = predicted_skip(_prediction(47.5), BUDGET)
    assert skip.constraints == pytest.approx([48.0 / BUDGET - 1, 0.0])


# ---- infeasibility: how a setting is told (src/sweep/rules.py) ---------------------------------------------------


def test_samplers_that_learn_from_pruned_trials_are_told_infeasible_settings_pruned() -> None:
    for sampler in (optuna.samplers.TPESampler(), optuna.samplers.RandomSampler()):
        assert infeasible_state(sampler) == TrialState.PRUNED
    assert infeasible_state(optuna.samplers.NSGAIISampler()) == TrialState.COMPLETE, "it sees COMPLETE trials only"


def test_the_constraint_record_is_feasible_only_for_a_setting_that_left_the_margin_free() -> None:
    rules = _rules()  # the default headroom margin, 10%
    assert not infeasible(rules.measured({"peak_vram_reserved_gib": 12.0, "vram_budget_gib": BUDGET})), "50% free"
    marginal = rules.measured({"peak_vram_reserved_gib": 23.0, "vram_budget_gib": BUDGET})
    assert infeasible(marginal) and marginal[0] == pytest.approx(0.1 - (1 - 23.0 / BUDGET))
    assert rules.measured({"tokens_per_s": 9.0}) == [0.0, 0.0], "no VRAM measured: nothing known"
    oom = rules.violation("oom", {"peak_vram_reserved_gib": 20.0, "oom_request_gib": 8.0})
    assert oom[0] == pytest.approx(28.0 / BUDGET - 0.9) and oom[1] == 0.0
    assert rules.violation("oom", {})[0] >= 0.01, "an OOM is infeasible even when it recorded nothing"
    assert rules.violation("config_error", {}) == [0.0, 1.0], "a refused setting: valid_setting violated"


def test_an_infeasible_setting_told_complete_gets_the_worst_values_and_keeps_the_memory_it_held() -> None:
    worst = _rules().worst({"peak_vram_reserved_gib": 23.5}, ["tokens_per_s", "peak_vram_reserved_gib", "step_time_s"], ["maximize", "minimize", "minimize"])  # fmt: skip
    assert worst == [0.0, 23.5, float("inf")]


def test_the_constraint_record_is_read_back_as_written_or_by_name() -> None:
    study = optuna.create_study()
    trial = study.ask()
    study.tell(trial, state=TrialState.PRUNED)
    assert recorded_constraints(study.trials[0]) is None, "told without one"
    for written in ({CONSTRAINTS_KEY: [0.3, 0.0]}, {"constraints:vram_budget": 0.3}):
        frozen = optuna.trial.create_trial(state=TrialState.PRUNED, system_attrs=written)
        assert recorded_constraints(frozen) == [0.3, 0.0]


# ---- recovery of dead trials (src/sweep/storage.py) --------------------------------------------------------------


@pytest.fixture(scope="module")
def rdb() -> optuna.storages.RDBStorage:
    """One in-memory RDB storage for the recovery tests (each test makes its own study): StudyStore speaks to an
    RDB storage's heartbeat."""
    return optuna.storages.RDBStorage("sqlite:///:memory:")


def _store(rdb: optuna.storages.RDBStorage, tmp_path: Path, **sweeper: Any) -> tuple[StudyStore, optuna.Study]:
    settings = {"grace_period_s": 3600, "retry_failed_trials": False, "storage": None, **sweeper}
    store = StudyStore(OmegaConf.create(settings), tmp_path.name, tmp_path, "this-host", on_dead=lambda s, t: None)
    study = optuna.create_study(storage=rdb, study_name=tmp_path.name)
    store.storage, store.study_id = rdb, rdb.get_study_id_from_name(tmp_path.name)
    return store, study


def _running(study: optuna.Study, host: str, **identity: Any) -> int:
    trial = study.ask(SPACE)
    trial.set_user_attr(record.WORKER_HOST, host)
    for key, value in identity.items():
        trial.set_user_attr(key, value)
    return trial.number


def test_a_running_trial_is_dead_when_its_worker_on_this_host_is_gone(rdb, tmp_path: Path) -> None:
    store, study = _store(rdb, tmp_path)
    exited = subprocess.Popen(["true"])  # a worker that has ended
    exited.wait()
    alive = _running(study, "this-host", **worker_identity(os.getpid()))
    dead = _running(study, "this-host", **worker_identity(exited.pid))
    ticks = start_ticks(os.getpid())
    reused = _running(study, "this-host", **{**worker_identity(os.getpid()), record.WORKER_STARTED_SINCE_BOOT: ticks - 500})  # fmt: skip
    elsewhere = _running(study, "other-host", **worker_identity(exited.pid))  # its heartbeat decides, not our pids
    found = {t.number for t in store.dead(study)}
    assert dead in found and reused in found, "its process is gone, or the pid is another process's now"
    assert alive not in found and elsewhere not in found


def test_a_trial_asked_whose_worker_died_before_saying_who_it_is_is_dead_after_the_grace_period(
    rdb, tmp_path: Path
) -> None:
    store, study = _store(rdb, tmp_path, grace_period_s=3600)
    orphan = _running(study, "other-host")  # no worker.pid: it never got to write one
    assert store.dead(study) == []
    store.sweeper.grace_period_s = 0
    assert [t.number for t in store.dead(study)] == [orphan]


def test_a_dead_workers_trial_is_failed_as_killed_and_queued_again_when_asked(rdb, tmp_path: Path) -> None:
    store, study = _store(rdb, tmp_path, retry_failed_trials=True)
    number = _running(study, "this-host", **{record.WORKER_PID: None})
    (trial,) = store.dead(study)
    store.fail_dead(study, trial, "run-7")
    failed = store.get(number)
    assert failed.state == TrialState.FAIL
    assert record.status(failed.user_attrs) == "failed" and record.recorded_kind(failed.user_attrs) == "killed"
    assert failed.user_attrs[record.RUN_ID] == "run-7"
    retry = study.ask(SPACE)  # the queued one comes first
    assert retry.params == trial.params and retry.user_attrs[record.RETRY_OF] == number
    assert store.dead(study) == [], "settled once"


# ---- soak choice (src/sweep/soak.py) -----------------------------------------------------------------------------


def _row(number: int, verdict: str, tokens_per_s: float, cut: float = 0.0) -> TrialRow:
    metrics = {"tokens_per_s": tokens_per_s, "truncated_answer_frac": cut}
    return TrialRow(number, {SEQ: 512}, {}, verdict, "", metrics)


def _sweep(rows: list[TrialRow]) -> Sweep:
    return Sweep(
        "s", "sqlite://", Path("."), ["tokens_per_s"], ["maximize"], 0.1, BUDGET, [SEQ], rows, None, [],
        max_truncated_answer_frac=0.05,
    )  # fmt: skip


def test_the_soak_takes_the_fastest_stable_settings_within_the_truncation_policy() -> None:
    rows = [
        _row(0, "stable", 100.0),
        _row(1, "marginal", 500.0),  # faster, too near the budget
        _row(2, "stable", 300.0, cut=0.2),  # faster, cuts too many answers
        _row(3, "stable", 200.0),
        _row(4, "stable", 100.0),  # ties trial 0: the earlier trial first
        _row(5, "failed", 0.0),
    ]
    study = optuna.create_study()
    assert [r.number for r in soak.pending(study, _sweep(rows), 2)] == [3, 0]
    assert [r.number for r in soak.pending(study, _sweep(rows), 10)] == [3, 0, 4]
    assert soak.pending(study, _sweep(rows), 0) == []


def test_a_soaked_finalist_is_not_soaked_again_unless_its_soak_was_stopped() -> None:
    rows = [_row(0, "stable", 100.0), _row(1, "stable", 200.0), _row(2, "stable", 300.0)]
    study = optuna.create_study()
    study.set_user_attr(record.SOAK.format(2), {"status": "passed"})
    study.set_user_attr(record.SOAK.format(1), {"status": "running"})  # another worker soaks it
    assert soak.pending(study, _sweep(rows), 2) == [], "the top two are soaked or being soaked"
    study.set_user_attr(record.SOAK.format(1), {"status": soak.STOPPED})
    assert [r.number for r in soak.pending(study, _sweep(rows), 2)] == [1]


# ---- the gate: when the sweep has nothing new to launch (src/sweep/gate.py) --------------------------------------


def test_skips_in_a_row_end_the_sweep_and_a_launch_resets_the_count() -> None:
    gate = _gate()
    skip = predicted_skip(_prediction(40.0), BUDGET)
    for _ in range(SKIPS_IN_A_ROW - 1):
        assert gate.count(skip, occupied=5) is None
    assert gate.count(None, occupied=5) is None, "a launch: the count starts again"
    for _ in range(SKIPS_IN_A_ROW - 1):
        assert gate.count(skip, occupied=5) is None
    line = gate.count(skip, occupied=5)
    assert line.startswith(f"sweep ended early: the last {SKIPS_IN_A_ROW} proposals were all skipped")
    assert "hydra.sweeper.n_trials=20" in line
    never = _gate(max_skips_in_a_row=0)
    assert all(never.count(skip, occupied=5) is None for _ in range(SKIPS_IN_A_ROW + 1))
    with pytest.raises(SpaceError, match=r"hydra.sweeper.max_skips_in_a_row=-1: must be at least 0"):
        _gate(max_skips_in_a_row=-1)


def test_a_finite_space_is_exhausted_once_every_setting_is_told() -> None:
    space = {SEQ: CategoricalDistribution([256, 512]), R: CategoricalDistribution([8, 16])}
    study = optuna.create_study()
    gate = _gate()
    for i, (seq, r) in enumerate([(256, 8), (512, 8), (256, 16)]):
        status = "failed" if i == 2 else "ok"
        _add(study, space, {SEQ: seq, R: r}, status)
    _add(study, space, {SEQ: 512, R: 16}, "ok", lever=True)  # a lever trial is not the map's setting
    assert gate.exhausted(study, space, custom=False, occupied=4) is None
    _add(study, space, {SEQ: 512, R: 16}, "failed")
    study.enqueue_trial({SEQ: 256, R: 8})
    assert gate.exhausted(study, space, custom=False, occupied=5) is None, "a queued trial still waits"
    study.ask(space)  # the queued trial runs
    line = gate.exhausted(study, space, custom=False, occupied=6)
    assert line == "sweep ended early: all 4 settings of the space are on the map after 6 trials of hydra.sweeper.n_trials=20; nothing new left to launch"  # fmt: skip
    assert gate.exhausted(study, space, custom=True, occupied=6) is None, "a custom space's suggestions are its own"
    assert _gate(skip_duplicates=False).exhausted(study, space, custom=False, occupied=6) is None
    assert _gate(max_skips_in_a_row=0).exhausted(study, space, custom=False, occupied=6) is None


def _add(study: optuna.Study, space: dict, params: dict, status: str, lever: bool = False) -> None:
    attrs = record.outcome_tags(status, {"kind": "oom"} if status == "failed" else None)
    if lever:
        attrs[record.LEVER] = json.dumps(["trainer.gradient_checkpointing=true"])
    state = TrialState.COMPLETE if status == "ok" else TrialState.PRUNED
    study.add_trial(
        optuna.trial.create_trial(
            params=params, distributions=space, value=1.0 if status == "ok" else None, user_attrs=attrs, state=state
        )
    )


def test_a_spaces_size_counts_its_settings_and_a_continuous_knob_has_none() -> None:
    assert space_size({SEQ: CategoricalDistribution([256, 512]), R: IntDistribution(4, 16, step=4)}) == 8
    assert space_size({"lora.lora_dropout": FloatDistribution(0.0, 0.1, step=0.05)}) == 3
    assert space_size({"lora.lora_dropout": FloatDistribution(0.0, 0.1)}) is None
    assert space_size({R: IntDistribution(4, 64, log=True)}) is None
