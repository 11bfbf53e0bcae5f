"""What Optuna's own tools see in a study the sweep made: `optuna.load_study`, `Study.best_trials`, the `optuna
best-trials` CLI and optuna-dashboard's own server (the API its UI reads). Settings that ran out of memory or were
refused are infeasible by Optuna's constraint record; nothing that was not measured carries a value where the
sampler allows (TPE: PRUNED); skipped repeats are never best; the objectives are named.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState

from src import promote, report
from src.sweep.process import Outcome
from src.sweep.rules import CONSTRAINTS, CONSTRAINTS_KEY, SETTING_FAILURES, named_constraints, recorded_constraints
from tests.test_sweep import _fake_sweep

BUDGET = 24.0


def _storage(root: Path, name: str) -> str:
    return f"sqlite:///{root}/sweeps/{name}/optuna.db"


def _infeasible(t: FrozenTrial) -> bool:
    """Infeasible as Optuna's samplers and best_trials read it (Trial.constraints), not only by our names."""
    return any(v > 0 for v in t.constraints.values())


def _dashboard(storage: str, path: str) -> Any:
    """GET `path` from optuna-dashboard's own server app (what its UI fetches), in this process."""
    from optuna_dashboard import wsgi

    app = wsgi(storage)
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(),
        "wsgi.errors": sys.stderr,
    }
    status: list[str] = []
    body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
    assert status and status[0].startswith("200"), (path, status, body[:500])
    return json.loads(body)


def _best_trials_cli(storage: str, name: str) -> list[int]:
    """`optuna best-trials`, the console script installed with Optuna, as a user runs it."""
    cli = Path(sys.executable).parent / "optuna"
    done = subprocess.run(
        [str(cli), "best-trials", "--study-name", name, "--storage", storage, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return sorted(int(r["number"]) for r in json.loads(done.stdout))


def assert_native(
    root: Path, name: str, objectives: list[str], infeasible_state: TrialState, skips: bool = True
) -> list[FrozenTrial]:
    """Every reader agrees: measured trials feasible and COMPLETE, OOMs and refused settings infeasible (in the
    state the sampler learns from), crashes FAIL, skips never measured, best trials only ones that ran ok. `skips`:
    the study holds skipped repeats, of a measured setting among them."""
    storage = _storage(root, name)
    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials()
    assert study.metric_names == objectives
    assert study.user_attrs["sweep.constraints"] == list(CONSTRAINTS)
    by = {s: [t for t in trials if t.user_attrs["trial.status"] == s] for s in ("ok", "failed", "skipped")}
    assert by["ok"] and by["failed"] and (by["skipped"] or not skips), {s: len(v) for s, v in by.items()}
    assert len(trials) == sum(len(v) for v in by.values()), "nothing else: no trial left running or unlabelled"

    for t in by["ok"]:
        assert t.state == TrialState.COMPLETE and len(t.values) == len(objectives)
        assert not _infeasible(t) and named_constraints(t)["vram_budget"] < 0, "8 GiB of 24"
    for t in by["failed"]:
        kind = t.user_attrs["failure.kind"]
        if kind not in SETTING_FAILURES:  # a crash, a kill, a hang: says nothing of the setting
            assert t.state == TrialState.FAIL and not _infeasible(t) and t.values is None, (t.number, kind, t.state)
            continue
        assert t.state == infeasible_state and _infeasible(t), (t.number, kind, t.state)
        assert named_constraints(t)["vram_budget" if kind == "oom" else "valid_setting"] > 0
        if infeasible_state == TrialState.PRUNED:
            assert t.values is None, "nothing was measured: no value"
    for t in by["skipped"]:
        origin = study.trials[t.user_attrs["skipped.because_of"]]
        assert recorded_constraints(t) == recorded_constraints(origin), "the origin's constraint record"
        unmeasured = origin.user_attrs["trial.status"] != "ok"  # a marginal origin's repeat is PRUNED too
        assert t.state == (infeasible_state if _infeasible(origin) and unmeasured else TrialState.PRUNED), t.user_attrs
        assert t.state != TrialState.COMPLETE or _infeasible(t), "a repeat is never a second measurement"
    assert [t for t in by["skipped"] if not _infeasible(t)] or not skips, "a repeat of a measured setting was skipped"
    assert [t for t in by["failed"] if t.user_attrs["failure.kind"] == "oom"]
    assert [t for t in by["failed"] if t.user_attrs["failure.kind"] != "oom"], "a refused setting"

    ok = {t.number for t in by["ok"]}
    best = sorted(t.number for t in study.best_trials)
    assert best and set(best) <= ok
    assert _best_trials_cli(storage, name) == best

    # optuna-dashboard: the study page's data, as its UI fetches it.
    (summary,) = [s for s in _dashboard(storage, "/api/studies")["study_summaries"] if s["study_name"] == name]
    detail = _dashboard(storage, f"/api/studies/{summary['study_id']}")
    assert detail["objective_names"] == objectives, "not 'Objective 0'"
    shown = {t["number"]: t for t in detail["trials"]}
    assert set(shown) == {t.number for t in trials}
    for t in trials:
        constraints = shown[t.number]["constraints"]
        assert constraints or t.state == TrialState.FAIL, f"trial {t.number}: the dashboard sees no constraint"
        assert any(c > 0 for c in constraints) == _infeasible(t), (t.number, constraints)
        assert shown[t.number]["state"] == t.state.name.capitalize()
    assert {t["number"] for t in detail["best_trials"]} <= ok
    if infeasible_state == TrialState.PRUNED:
        # What the dashboard plots and computes importances over (COMPLETE trials, with values): measured ones only.
        assert {n for n, t in shown.items() if t["state"] == "Complete"} == ok
        assert {n for n, t in shown.items() if "values" in t} == ok
    _dashboard(storage, f"/api/studies/{summary['study_id']}/param_importances")  # computes without error
    return trials


def assert_report_reads(root: Path, name: str, trials: list[FrozenTrial], tracking_uri: str | None) -> report.Sweep:
    """The report's loader classifies every trial by what it did, whatever state it was told in."""
    sweep = report.load(name, root / "sweeps", tracking_uri=tracking_uri)
    for t in trials:
        row, status = sweep.row(t.number), t.user_attrs["trial.status"]
        if status == "ok":  # marginal on a CPU: no VRAM measured
            assert row.verdict in ("stable", "marginal"), row.detail
        elif status == "failed":
            assert (row.verdict, row.failure_kind) == ("failed", t.user_attrs["failure.kind"]), row.detail
        else:
            assert row.verdict == "skipped" and sweep.effective(row) == sweep.row(row.because_of).verdict
    return sweep


def test_the_constraint_record_is_the_one_optuna_and_the_dashboard_read() -> None:
    from optuna.study._constrained_optimization import _CONSTRAINTS_KEY
    from optuna_dashboard._serializer import CONSTRAINTS_KEY as DASHBOARD_KEY

    assert CONSTRAINTS_KEY == _CONSTRAINTS_KEY == DASHBOARD_KEY


SPACE = ["data.max_seq_length=choice(256,2048)", "lora.r=choice(8,16)"]
# Every setting once, the recipe first; any trial after those repeats one (a skip).
QUEUE = (
    "hydra.sweeper.enqueue_trials=["
    + ",".join(f"{{data.max_seq_length:{s},lora.r:{r}}}" for s, r in ((256, 8), (2048, 8), (256, 16), (2048, 16)))
    + "]"
)


def _fake_trial(overrides: list[str], log_dir: Path, env: dict, sweeper: Any, heartbeat: Any = None) -> Outcome:
    """2048 tokens run out of memory; rank 16 on short rows is refused (a config error); the rest measures."""
    given = dict(o.split("=", 1) for o in overrides)
    if given["data.max_seq_length"] == "2048":
        return Outcome(
            "failed",
            metrics={"peak_vram_reserved_gib": BUDGET - 0.6, "oom_request_gib": 2.0},
            failure={"kind": "oom", "message": "CUDA out of memory", "step": 1},
        )
    if given["lora.r"] == "16":
        return Outcome("failed", failure={"kind": "config_error", "message": "refused", "step": None})
    return Outcome("ok", metrics={"tokens_per_s": 100.0, "peak_vram_reserved_gib": 8.0, "vram_budget_gib": BUDGET})


@pytest.mark.parametrize(
    "sampler,state",
    [
        ("tpe", TrialState.PRUNED),  # TPE learns infeasibility from PRUNED trials: no value is invented
        ("gp", TrialState.COMPLETE),  # GP models COMPLETE trials only: told PRUNED it would never learn of an OOM
    ],
)
def test_optunas_tools_read_a_sweep_as_it_ran(
    root: Path, monkeypatch: pytest.MonkeyPatch, sampler: str, state: TrialState
) -> None:
    name = f"native-{sampler}"
    sampled = f"hydra/sweeper/sampler={sampler}"
    # The space's 4 settings, then repeats (skips) to tell: a finite space measured out would end the sweep first.
    monkeypatch.setattr("src.sweep.gate.space_size", lambda distributions: None)
    cfg = _fake_sweep(monkeypatch, name, 7, SPACE, QUEUE, sampled, process=_fake_trial)
    trials = assert_native(root, name, ["tokens_per_s"], state)
    reasons = {t.user_attrs.get("skip.reason") for t in trials if t.user_attrs["trial.status"] == "skipped"}
    assert "certain_oom" in reasons and "repeat" in reasons

    sweep = assert_report_reads(root, name, trials, str(cfg.tracking.uri))
    assert promote.choose(sweep, allow_unsoaked=True).number == 0, "the one setting that ran ok (the recipe)"
    assert report.write(sweep).files


# A real sweep's study, read by the same checks: tests/test_sweep.py::test_every_fault_kind_is_classified_and_the_sweep_goes_on
# (forked trials of the tiny Llama on the CPU: a real OOM, refused data and config, crashes, a hang). Skips are the
# engine's own (no trial process runs): the sweeps above make them, with the real storage, CLI and dashboard.


def _marginal_is_faster(overrides: list[str], log_dir: Path, env: dict, sweeper: Any, heartbeat: Any = None) -> Outcome:
    """Rank 16 is the faster setting but leaves 2% of the budget free (marginal at the 10% margin); rank 8 is stable."""
    fast = dict(o.split("=", 1) for o in overrides)["lora.r"] == "16"
    peak = BUDGET * 0.98 if fast else 8.0
    metrics = {"tokens_per_s": 200.0 if fast else 100.0, "peak_vram_reserved_gib": peak, "vram_budget_gib": BUDGET}
    return Outcome("ok", metrics=metrics)


@pytest.mark.parametrize("sampler", ["tpe", "gp"])
def test_outside_tools_pick_the_reports_best_stable_not_a_faster_marginal(
    root: Path, monkeypatch: pytest.MonkeyPatch, sampler: str
) -> None:
    """A setting inside the headroom margin is not feasible for promotion: `study.best_trials` and `optuna
    best-trials` name the report's best stable trial, not the faster marginal one, and optuna-dashboard lists the
    marginal one infeasible."""
    name = "native-marginal"
    queue = "hydra.sweeper.enqueue_trials=[{lora.r:8},{lora.r:16}]"
    space, sampled = ["lora.r=choice(8,16)"], f"hydra/sweeper/sampler={sampler}"
    # Both settings, then repeats (skips) to tell: a finite space measured out would end the sweep first.
    monkeypatch.setattr("src.sweep.gate.space_size", lambda distributions: None)
    cfg = _fake_sweep(monkeypatch, name, 4, space, queue, sampled, process=_marginal_is_faster)
    storage = _storage(root, name)
    study = optuna.load_study(study_name=name, storage=storage)
    stable, marginal, *repeats = study.trials
    assert repeats and all(t.user_attrs["trial.status"] == "skipped" for t in repeats)
    for t in repeats:  # a repeat of a measured setting, marginal or not: never a second value, whatever the sampler
        assert t.state == TrialState.PRUNED and t.values is None, (t.number, t.state, t.values)
    assert (stable.params["lora.r"], marginal.params["lora.r"]) == (8, 16)
    assert marginal.values[0] > stable.values[0], "the marginal setting is the faster one"

    sweep = report.load(name, root / "sweeps", tracking_uri=str(cfg.tracking.uri))
    assert (sweep.row(0).verdict, sweep.row(1).verdict) == ("stable", "marginal")
    assert promote.choose(sweep, allow_unsoaked=True).number == 0

    assert _infeasible(marginal) and not _infeasible(stable)
    assert named_constraints(marginal)["vram_budget"] == pytest.approx(0.98 - 0.90)
    assert [t.number for t in study.best_trials] == [0]
    assert _best_trials_cli(storage, name) == [0]
    (summary,) = [s for s in _dashboard(storage, "/api/studies")["study_summaries"] if s["study_name"] == name]
    detail = _dashboard(storage, f"/api/studies/{summary['study_id']}")
    shown = {t["number"]: t for t in detail["trials"]}
    assert shown[1]["state"] == "Complete" and shown[1]["constraints"][0] > 0, "listed as infeasible"
    assert shown[0]["constraints"][0] <= 0
    # optuna-dashboard 0.21's "Best Trial" card ranks COMPLETE trials by value alone (storage.get_best_trial, no
    # constraints): the README says so; its trial list marks trial 1 infeasible from the record above.


def test_outside_tools_see_each_lever_trial_as_a_setting_of_its_own(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recipe is marginal, so its memory levers run on its params; each lever trial carries its lever as an
    Optuna param of its own, so Optuna's tools and the dashboard see distinct settings, not one setting with several
    outcomes, while the report, reading `sweep.lever`, keeps the param out of the knobs."""
    name = "native-levers"
    queue = "hydra.sweeper.enqueue_trials=[{lora.r:16}]"
    cfg = _fake_sweep(monkeypatch, name, 1, ["lora.r=choice(8,16)"], queue, process=_marginal_is_faster)
    storage = _storage(root, name)
    study = optuna.load_study(study_name=name, storage=storage)
    recipe, *after = study.trials
    assert all(t.user_attrs["sweep.lever_of"] == 0 for t in after)
    # the recipe stays marginal, so the search follows its levers (issue 28); its trials carry their own param
    levers = [t for t in after if not t.user_attrs.get("sweep.recommended")]
    searched = [t for t in after if t.user_attrs.get("sweep.recommended")]
    assert len(levers) >= 2 and searched
    settings = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(set(settings)) == len(settings), settings
    for t in levers:
        assert t.params["lever"] == ", ".join(json.loads(t.user_attrs["sweep.lever"]))
        assert t.params["lora.r"] == recipe.params["lora.r"]
    for t in searched:
        assert t.params["recommendation"] == ", ".join(json.loads(t.user_attrs["sweep.lever"]))
    assert "lever" not in recipe.params

    (summary,) = [s for s in _dashboard(storage, "/api/studies")["study_summaries"] if s["study_name"] == name]
    detail = _dashboard(storage, f"/api/studies/{summary['study_id']}")
    shown = [tuple(sorted((p["name"], p["param_external_value"]) for p in t["params"])) for t in detail["trials"]]
    assert len(set(shown)) == len(shown), shown
    assert {p["name"] for p in detail["union_search_space"]} == {"lora.r", "lever", "recommendation"}
    _dashboard(storage, f"/api/studies/{summary['study_id']}/param_importances")  # computes without error

    sweep = report.load(name, root / "sweeps", tracking_uri=str(cfg.tracking.uri))
    assert sweep.knobs == ["lora.r"]
    for t in after:
        assert sweep.row(t.number).lever and not {"lever", "recommendation"} & set(sweep.row(t.number).params)
