"""The sweep engine: every fault a CPU can raise is caught, classified and recorded while the sweep goes on;
a SIGKILLed sweep resumes to exactly n_trials; the sampler learns to stay out of the OOM region."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from src import report
from src.config import PROJECT_DIR
from src.sweep import soak
from src.sweep.engine import SweepEngine
from src.sweep.process import Outcome
from src.sweep.rules import named_constraints
from tests.conftest import compose_cfg, empty_store_file, new_store, run_cli, sweep_argv


def _study(root: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{root}/sweeps/{name}/optuna.db")


def _runs(client, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000)


# The ways a trial's process ends that the engine reads from the process itself (a clean exit with its result, death
# by a signal), which a fresh interpreter must show as a forked trial does; every kind runs forked (the default
# launcher). A SIGKILL and a SIGSEGV differ only in the signal's number, read by the one classifier both launchers use
# (src/failures.py), so `killed` runs forked only; a hang is killed by the one watch loop both launchers share
# (src/sweep/process.py), shown on a fresh interpreter by test_a_trial_past_its_time_limit_is_killed_as_a_timeout...
BY_PROCESS = ("ok", "segfault")
# Forked: one of each way a trial ends, as the engine tells it apart (recorded by the trial: ok, an OOM, a sticky CUDA
# error re-run with CUDA_LAUNCH_BLOCKING=1; refused: data, config; dead: a signal, SIGKILL; a hang). The other sticky
# CUDA errors and a NaN loss take the first of those paths with another message: the classifier's table is tested
# message by message (tests/test_trial.py::test_exception_taxonomy), a NaN loss as a whole trial there too.
FORKED = ("ok", "oom", "launch_failure", "segfault", "killed", "timeout", "data_error", "config_error")


@pytest.mark.parametrize(
    ("launcher", "scenarios"),
    [
        pytest.param("interpreter", BY_PROCESS, marks=pytest.mark.slow(seconds=26)),
        pytest.param("forkserver", FORKED, marks=pytest.mark.slow(seconds=50)),
    ],
)
def test_every_fault_kind_is_classified_and_the_sweep_goes_on(
    root: Path, mlflow_client, launcher: str, scenarios: tuple[str, ...]
) -> None:
    """Fresh interpreters, or forks of a warm preloaded one (hydra.sweeper.preload): the same isolation. The forked
    sweep's study is also read by Optuna's own tools (tests/test_optuna_native.py)."""
    from tests.test_optuna_native import assert_native, assert_report_reads

    n = len(scenarios)
    name = f"faults-{launcher}"
    # The hang second, beside the first: its stall timeout then runs beside the other trials instead of after them.
    # The first queued setting is the recipe (the ok one): a failed recipe would add lever trials (src/sweep/recipe.py).
    queued = sorted(scenarios, key=lambda s: (s != "ok", s != "timeout"))
    done = run_cli(
        *sweep_argv(study=name),
        f"hydra.sweeper.preload={str(launcher == 'forkserver').lower()}",
        f"hydra.sweeper.n_trials={n}",
        "hydra.sweeper.custom_search_space=tests.sweep_scenarios.fault_scenarios",
        "hydra.sweeper.stall_timeout_s=10",  # a hang; under CI load a slow step (~1 s here) must not look like one
        "hydra.sweeper.soak_top_k=0",  # the soak's overrides of a labelled trial: asserted below, without training
        f"hydra.sweeper.enqueue_trials=[{','.join('{scenario:' + s + '}' for s in queued)}]",
        "hydra.sweeper.trial_overrides=['trainer.max_steps=4','trainer.warmup_steps=0']",  # faults strike at step 2
        "fault.step=2",
        root=root,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    study = _study(root, name)
    trials = study.get_trials()
    assert len(trials) == n
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    assert {t.user_attrs.get("trial.launcher") for t in trials} == {launcher}
    seen = {t.params["scenario"]: t for t in trials}
    assert sorted(seen) == sorted(scenarios)
    for scenario, t in seen.items():
        expected = None if scenario == "ok" else scenario
        assert t.user_attrs.get("failure.kind") == expected, (scenario, t.user_attrs)
        assert t.user_attrs["trial.status"] == ("ok" if scenario == "ok" else "failed")
    # What Optuna learns: setting-caused failures are PRUNED (no value) with a violated constraint, the others FAIL.
    if "oom" in seen:
        assert seen["oom"].state == TrialState.PRUNED and named_constraints(seen["oom"])["vram_budget"] > 0
        assert seen["oom"].values is None and seen["oom"].user_attrs["failure.step"] == 2
    if "data_error" in seen:
        assert seen["data_error"].state == TrialState.PRUNED and seen["data_error"].values is None
        assert named_constraints(seen["data_error"])["valid_setting"] > 0
    assert seen["segfault"].state == TrialState.FAIL and named_constraints(seen["ok"])["vram_budget"] <= 0
    # The step where it happened, when training had started.
    assert seen["segfault"].user_attrs["failure.step"] == 2
    # What each label stood for is recorded, and a soak would train that, never the label (no config key)
    assert seen["segfault"].user_attrs["sweep.settings"] == {"fault.kind": "segfault"}
    rows = {r.number: r for r in report.load(name, root / "sweeps").rows}
    ok_soak = soak.overrides(rows[seen["ok"].number], ["data.max_rows=8"], 1.0)
    assert not [o for o in ok_soak if o.startswith("scenario=")] and "data.max_rows=8" in ok_soak
    assert "fault.kind='segfault'" in soak.overrides(rows[seen["segfault"].number], [], 1.0)

    runs = {r.data.tags.get("optuna.trial"): r for r in _runs(mlflow_client, name)}
    parent = next(r for r in runs.values() if r.data.tags.get("sweep.role") == "parent")
    children = [r for r in runs.values() if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == n and not [r for r in runs.values() if r.info.status == "RUNNING"]
    for scenario, t in seen.items():
        run = runs[str(t.number)]
        assert run.info.run_id == t.user_attrs["mlflow_run_id"]
        assert run.data.tags.get("failure.kind") == (None if scenario == "ok" else scenario)
        assert run.info.status == {"ok": "FINISHED", "killed": "KILLED", "timeout": "KILLED"}.get(scenario, "FAILED")
    # Sticky CUDA errors are re-run once with CUDA_LAUNCH_BLOCKING=1 and both traces are kept.
    for scenario in {"launch_failure", "illegal_memory_access", "device_assert"} & set(seen):
        run_id = seen[scenario].user_attrs["mlflow_run_id"]
        artifacts = {a.path for a in mlflow_client.list_artifacts(run_id)}
        assert {"traceback.txt", "traceback_launch_blocking.txt"} <= artifacts, scenario
        assert runs[str(seen[scenario].number)].data.tags["failure.launch_blocking.kind"] == scenario
    # A process that died without recording (segfault, SIGKILL, hang) gets its stderr tail attached.
    for scenario in {"segfault", "killed", "timeout"} & set(seen):
        artifacts = {a.path for a in mlflow_client.list_artifacts(seen[scenario].user_attrs["mlflow_run_id"])}
        assert "stderr_tail.txt" in artifacts
    counts = parent.data.metrics
    assert counts["trials_finished"] == n and counts["trials_ok"] == 1 and counts["trials_failed"] == n - 1
    for scenario in scenarios:
        if scenario != "ok":
            assert counts[f"trials_failed_{scenario}"] == 1
    assert parent.info.status == "FINISHED"
    # Each trial's torch ran on its slot's share of the cores (two CPU slots), forked or fresh: a fork inherits the
    # forkserver's pool, sized for the whole machine, unless the trial resizes it (src/sweep/launcher.py).
    share = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))  # conftest may set it
    threads = {scenario: runs[str(t.number)].data.tags.get("torch.num_threads") for scenario, t in seen.items()}
    assert threads["ok"] == share and set(threads.values()) <= {share, None}, threads  # None: refused at compose
    # Each trial's own logs.
    for t in trials:
        assert (root / "sweeps" / name / "trials" / f"{t.number:03d}" / "stderr.log").exists()
    if launcher == "forkserver":  # what Optuna's own tools and the report read in it
        native = assert_native(root, name, ["tokens_per_s"], TrialState.PRUNED, skips=False)
        assert_report_reads(root, name, native, f"sqlite:///{root}/mlruns/mlflow.db")


@pytest.mark.slow(seconds=38)
def test_sigkilled_sweep_resumes_to_exactly_n_trials(root: Path, mlflow_client) -> None:
    args = [
        sys.executable,
        "-m",
        *sweep_argv("sweep=demo", study="resume"),
        # the demo's smallest settings, none near its memory edge: this test is about the sweep process, not memory
        "hydra.sweeper.enqueue_trials=[]",
        "trainer.per_device_train_batch_size=choice(1,2)",
        "hardware.vram_budget_gib=24",
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.skip_duplicates=false",
        "hydra.sweeper.trial_overrides=['trainer.max_steps=24']",  # long enough to be caught mid-trial under load
        "hydra.sweeper.soak_top_k=0",  # the demo soaks its best setting: not this test's business
    ]
    env = {**os.environ, "QLORA_ROOT": str(root)}
    log = root / "sweep.log"
    with log.open("w") as out:
        sweep = subprocess.Popen(args, cwd=PROJECT_DIR, env=env, stdout=out, stderr=subprocess.STDOUT)
    # Looked at once a trial's folder exists: the sweep has made Optuna's tables by then. Opening a brand-new
    # SQLite file as it does so would race it (both create the tables and stamp alembic's version; the sweep lost).
    trials_dir = root / "sweeps" / "resume" / "trials"
    seen: list[dict] = []  # the study's states at each look, for the message if the moment never comes
    deadline = time.time() + 240
    while time.time() < deadline and sweep.poll() is None:
        time.sleep(0.5)
        if not trials_dir.exists():
            continue
        trials = _study(root, "resume").get_trials()
        states = dict(Counter(t.state.name for t in trials))
        if not seen or seen[-1] != states:
            seen.append(states)
        # A trial started after another finished: at the start of its 24 steps, so the kill lands mid-trial (a
        # trial started with the first one may be writing its result at that moment, and is then told it).
        first_done = min((t.datetime_complete for t in trials if t.state == TrialState.COMPLETE), default=None)
        if first_done and [t for t in trials if t.state == TrialState.RUNNING and t.datetime_start > first_done]:
            break
    else:
        sweep.kill()
        pytest.fail(f"the sweep never had a finished and a running trial at once: {seen}\n{log.read_text()[-3000:]}")
    family = psutil.Process(sweep.pid).children(recursive=True)  # its trials, and the forkserver they were forked from
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    # They die with it: the forkserver with the engine's main thread (src/sweep/tether.py), a trial with the
    # forkserver. A trial at its last step may still have written its result; judged once all are gone.
    assert not psutil.wait_procs(family, timeout=60)[1], "a trial outlived its sweep"
    running = [t.number for t in _study(root, "resume").get_trials() if t.state == TrialState.RUNNING]
    # A trial that had finished and written its result when the sweep died is told what it measured (issue 17.4).
    measured = {n for n in running if (root / "sweeps" / "resume" / "trials" / f"{n:03d}" / "result.json").exists()}
    killed = [n for n in running if n not in measured]
    assert killed

    again = subprocess.run(args, cwd=PROJECT_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-4000:]
    trials = _study(root, "resume").get_trials()
    assert len([t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)]) == 4
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    for number in killed:
        assert trials[number].state == TrialState.FAIL and trials[number].user_attrs["failure.kind"] == "killed"
    for number in measured:
        assert trials[number].state == TrialState.COMPLETE and "failure.kind" not in trials[number].user_attrs
    runs = _runs(mlflow_client, "resume")
    per_trial = Counter(r.data.tags.get("optuna.trial") for r in runs if r.data.tags.get("sweep.role") != "parent")
    assert set(per_trial.values()) == {1} and len(per_trial) == len(trials)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    for number in killed:
        run = next(r for r in runs if r.data.tags.get("optuna.trial") == str(number))
        assert run.info.status == "KILLED" and run.data.tags["failure.kind"] == "killed"


def _ok_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
    return Outcome("ok", metrics={"tokens_per_s": 100.0, "peak_vram_reserved_gib": 8.0})


def _fake_sweep(
    monkeypatch: pytest.MonkeyPatch,
    study: str,
    n_trials: int,
    arguments: list[str],
    *overrides: str,
    process=_ok_process,
    queue_seed: bool = False,
):
    """The engine, in this process, with `process` standing in for each trial's process (no model is built):
    one CPU slot, no progress bar, nothing queued unless `queue_seed`, into the test's root (QLORA_ROOT, the `root`
    fixture's), whose MLflow store is a copy of the run's empty one (conftest.empty_store_file) where it has none
    yet. Returns the composed config."""
    new_store(Path(os.environ["QLORA_ROOT"]), empty_store_file(Path(os.environ["QLORA_CACHE"])))
    monkeypatch.setattr("src.sweep.launch.run_process", process)
    monkeypatch.setattr("src.sweep.prepare.build_model", lambda *a: None)
    cfg = compose_cfg(
        [
            "hydra/sweeper=optuna",
            f"hydra.sweeper.study_name={study}",
            f"hydra.sweeper.n_trials={n_trials}",
            "hydra.sweeper.cpu_slots=1",
            "hydra.sweeper.progress=false",
            "hydra.sweeper.soak_top_k=0",  # the soak runs real training for minutes: a test of it asks for it
            "hydra.sweeper.preload=false",  # stand-in trials: no forkserver to start
            *([] if queue_seed else ["hydra.sweeper.enqueue_trials=[]"]),
            "trainer.output_dir=/tmp/unused",
            *overrides,
        ]
    )
    SweepEngine(cfg, arguments).run()
    return cfg


@pytest.mark.slow(seconds=8)
def test_sampler_learns_to_avoid_the_oom_region(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A synthetic objective with a memory model: the engine's telling (constraint = need / budget - 1) must make
    TPE spend fewer trials in the OOM region in the second half of the sweep than in the first."""
    budget = 24.0

    def memory(params: dict) -> float:
        return 6.0 + params["data.max_seq_length"] / 1024 * params["trainer.per_device_train_batch_size"] * 3.0

    def fake_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        params = {k: int(v) for k, v in (o.split("=", 1) for o in overrides if o.split("=", 1)[0] in SPACE)}
        need = memory(params)
        if need > budget:
            return Outcome(
                "failed",
                metrics={"peak_vram_reserved_gib": budget - 0.6, "oom_request_gib": need - budget + 0.6},
                failure={"kind": "oom", "message": "CUDA out of memory", "step": 1},
            )
        tokens = params["data.max_seq_length"] * params["trainer.per_device_train_batch_size"]
        return Outcome("ok", metrics={"tokens_per_s": float(tokens), "peak_vram_reserved_gib": need})

    SPACE = {"data.max_seq_length": [512, 1024, 2048, 4096], "trainer.per_device_train_batch_size": [1, 2, 4, 8]}
    n = 48
    space = [f"{k}=choice({','.join(map(str, v))})" for k, v in SPACE.items()]
    _fake_sweep(monkeypatch, "learn", n, space, "hydra.sweeper.skip_duplicates=false", process=fake_process)
    trials = sorted(_study(root, "learn").get_trials(), key=lambda t: t.number)
    assert len(trials) == n
    # GPU time spent in the OOM region: trials launched there (skipped ones never ran).
    spent = [t.user_attrs["trial.status"] == "failed" for t in trials]
    assert all(memory({k: t.params[k] for k in SPACE}) > budget for t, s in zip(trials, spent, strict=True) if s)
    first, second = sum(spent[: n // 2]), sum(spent[n // 2 :])
    assert first >= 3, "the start-up trials explore the space, OOM region included"
    assert second < first / 2, (first, second)
    skipped = [t for t in trials if t.user_attrs.get("skipped.reason", "").startswith("certain oom")]
    assert skipped and all(memory({k: t.params[k] for k in SPACE}) > budget for t in skipped)
    assert all(named_constraints(t)["vram_budget"] > 0 for t in skipped), "the sampler is told they are infeasible"
    best = _study(root, "learn").best_trial  # Optuna's best respects the constraint: never an OOM trial
    assert memory({k: best.params[k] for k in SPACE}) <= budget


def test_seed_settings_outside_the_users_space_are_not_queued_and_the_sweep_finishes(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The default enqueue_trials holds the seed's lora.r=16; a space of choice(4,8) cannot take it. Optuna
    would fail the ask and leave a RUNNING trial no worker owns, and the sweep would wait for it for ever."""
    space = ["lora.r=choice(4,8)", "data.max_seq_length=choice(512,1024)"]
    with caplog.at_level("WARNING", logger="src.sweep.engine"):
        cfg = _fake_sweep(monkeypatch, "outside", 3, space, queue_seed=True)
    assert cfg.hydra.sweeper.enqueue_trials[0]["lora.r"] == 16, "the seed's own rank is queued by default"
    trials = _study(root, "outside").get_trials()
    assert len(trials) == 3 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)  # a repeat
    assert all((t.state == TrialState.PRUNED) == (t.user_attrs["trial.status"] == "skipped") for t in trials)
    assert {t.params["lora.r"] for t in trials} <= {4, 8}
    assert "hydra.sweeper.enqueue_trials[0] not queued: lora.r=16" in caplog.text


def test_the_report_knows_the_probe_and_margin_the_sweep_ran_with(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trials never see hydra.sweeper.*: the engine's parent run is where the report and the promotion learn
    the probe length (never carried into production) and the margin given on the command line."""
    from src import report

    def fake_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        return Outcome("ok", metrics={"tokens_per_s": 100.0, "peak_vram_reserved_gib": 20.0, "vram_budget_gib": 24.0})

    cfg = _fake_sweep(
        monkeypatch,
        "probe6",
        1,
        ["lora.r=choice(8)"],
        "hydra.sweeper.trial_overrides=['trainer.max_steps=6','trainer.warmup_steps=0']",
        "hydra.sweeper.headroom_margin=0.2",
        process=fake_process,
    )
    sweep = report.load("probe6", root / "sweeps", tracking_uri=str(cfg.tracking.uri))
    # the sweep's own relaxation of the truncation policy is a probe setting too: never carried into production
    relaxed = "preflight.max_truncated_answer_frac=1.0"
    assert sweep.probe_overrides == ["trainer.max_steps=6", "trainer.warmup_steps=0", relaxed]
    assert sweep.margin == pytest.approx(0.2)
    assert sweep.rows[0].verdict == "marginal", "4 GiB left of 24 is under the sweep's 20% margin"


def test_a_custom_space_that_returns_nothing_gets_its_suggestions(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []

    def fake_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        seen.append(dict(o.split("=", 1) for o in overrides))
        return Outcome("ok", metrics={"tokens_per_s": 100.0, "peak_vram_reserved_gib": 8.0})

    custom = "hydra.sweeper.custom_search_space=tests.sweep_scenarios.rank_follows_length"
    _fake_sweep(monkeypatch, "custom-none", 4, [], "hydra.sweeper.skip_duplicates=false", custom, process=fake_process)
    assert len(seen) == 4
    for overrides in seen:
        long_rows = overrides["data.max_seq_length"] == "2048"
        assert ("lora.r" in overrides, "trainer.per_device_train_batch_size" in overrides) == (long_rows, not long_rows)


def test_an_engine_error_fails_the_trial_and_closes_its_mlflow_run(
    root: Path, monkeypatch: pytest.MonkeyPatch, mlflow_client
) -> None:
    def broken_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        raise RuntimeError("disk full while writing the trial's command")

    _fake_sweep(monkeypatch, "engine-error", 2, ["lora.r=choice(8,16)"], process=broken_process)
    trials = _study(root, "engine-error").get_trials()
    assert len(trials) == 2 and all(t.state == TrialState.FAIL for t in trials), "the sweep went on"
    assert {t.user_attrs["failure.message"] for t in trials} == {"disk full while writing the trial's command"}
    children = [r for r in _runs(mlflow_client, "engine-error") if r.data.tags.get("sweep.role") != "parent"]
    assert len(children) == 2 and {r.info.status for r in children} == {"FAILED"}
    assert {r.data.tags.get("failure.kind") for r in children} == {"other"}


def test_a_knob_whose_choices_are_lists_reaches_the_trial_as_lists(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    composed: list = []

    def fake_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        composed.append(list(compose_cfg(overrides).model.sdpa_backends))  # as the trial composes them
        return Outcome("ok", metrics={"tokens_per_s": 100.0, "peak_vram_reserved_gib": 8.0})

    space = ["model.sdpa_backends=choice([flash,efficient],[math])"]
    sdpa = "model.attn_implementation=sdpa"  # SDPA's backends with eager attention are refused before any trial
    _fake_sweep(monkeypatch, "lists", 2, [*space, sdpa], "hydra/sweeper/sampler=grid", sdpa, process=fake_process)
    assert sorted(composed) == [["flash", "efficient"], ["math"]]


def test_certain_oom_follows_memory_monotone_knobs(root: Path) -> None:
    """A proposal is skipped as a certain OOM only when it needs at least an OOM setting's memory on every knob:
    larger on `increasing` ones, equal on undeclared ones, whatever it is on `neutral` ones (accumulation,
    group_by_length)."""
    from types import SimpleNamespace

    from optuna.distributions import CategoricalDistribution

    cfg = compose_cfg(["hydra/sweeper=optuna", "hydra.sweeper.study_name=mono", "trainer.output_dir=/tmp/unused"])
    engine = SweepEngine(cfg, [])
    space = {
        "data.max_seq_length": [512, 2048, 4096],
        "trainer.gradient_accumulation_steps": [1, 2, 8],
        "lora.r": [8, 16],
        "trainer.group_by_length": [True, False],
        "trainer.packing": [True, False],
    }

    def setting(seq: int, acc: int, r: int, grouped: bool = True, packed: bool = False) -> dict:
        return {
            "data.max_seq_length": seq,
            "trainer.gradient_accumulation_steps": acc,
            "lora.r": r,
            "trainer.group_by_length": grouped,
            "trainer.packing": packed,
        }

    study = optuna.create_study()
    study.add_trial(
        optuna.trial.create_trial(
            params=setting(2048, 2, 16),
            distributions={k: CategoricalDistribution(v) for k, v in space.items()},
            value=0.0,
            user_attrs={"failure.kind": "oom", "trial.status": "failed"},
        )
    )

    def certain(*args: object, **kwargs: object) -> bool:
        return engine.rules.certain_oom(study, SimpleNamespace(params=setting(*args, **kwargs))) is not None

    assert certain(2048, 8, 16) and certain(4096, 1, 16)  # accumulation never changes the peak
    assert certain(4096, 2, 16, grouped=False)  # nor does the order of the batches
    assert not certain(2048, 2, 8)  # lower rank: might fit
    assert not certain(512, 2, 16)
    assert not certain(4096, 2, 16, packed=True)  # a knob not declared must be equal
    # Packed batches are as big as what is packed into them: order and accumulation are no longer neutral.
    study.add_trial(
        optuna.trial.create_trial(
            params=setting(2048, 2, 16, packed=True),
            distributions={k: CategoricalDistribution(v) for k, v in space.items()},
            value=0.0,
            user_attrs={"failure.kind": "oom", "trial.status": "failed"},
        )
    )
    assert certain(4096, 2, 16, packed=True) and not certain(2048, 8, 16, packed=True)
    assert not certain(2048, 2, 16, grouped=False, packed=True)


def test_memory_monotone_typo_is_refused(root: Path) -> None:
    cfg = compose_cfg(
        ["hydra/sweeper=optuna", "+hydra.sweeper.memory_monotone.rank=bigger", "trainer.output_dir=/tmp/unused"]
    )
    with pytest.raises(ValueError, match=r"memory_monotone\.rank='bigger'.*increasing, decreasing, neutral"):
        SweepEngine(cfg, [])


def test_trials_at_once_share_the_machines_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    from src.sweep.slots import discover_slots

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    slots = {"devices": [0, 1], "gpus_per_trial": 1, "slots_per_gpu": 3, "cpu_slots": 2}
    sweeper = OmegaConf.create({**slots, "n_trials": 6, "n_jobs": None})
    slots = discover_slots(sweeper)
    assert [s.name for s in slots] == ["cuda0#0", "cuda0#1", "cuda0#2", "cuda1#0", "cuda1#1", "cuda1#2"]
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in slots[:3]} == {"0"}
    assert {s.env["OMP_NUM_THREADS"] for s in slots} == {"2"}, "16 cores over 6 trials at once"
    cpu = OmegaConf.merge(sweeper, {"devices": []})
    assert [s.env["OMP_NUM_THREADS"] for s in discover_slots(cpu)] == ["8", "8"], "16 cores over 2 CPU slots"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's own setting wins, on GPUs and on the CPU
    assert {s.env["OMP_NUM_THREADS"] for s in discover_slots(sweeper)} == {"4"}
    assert {s.env["OMP_NUM_THREADS"] for s in discover_slots(cpu)} == {"4"}


@pytest.mark.parametrize(
    "slots,message",
    [
        ({"slots_per_gpu": 0}, "hydra.sweeper.slots_per_gpu=0: must be at least 1"),
        ({"cpu_slots": 0, "devices": []}, "hydra.sweeper.cpu_slots=0: must be at least 1"),
        ({"gpus_per_trial": 3}, "hydra.sweeper.gpus_per_trial=3 but this machine shows 2 GPU(s)"),
    ],
)
def test_impossible_slot_settings_are_refused_before_the_sweep_records_anything(
    root: Path, slots: dict, message: str
) -> None:
    overrides = [f"hydra.sweeper.{k}={v}" for k, v in {"devices": [0, 1], **slots}.items()]
    cfg = compose_cfg(["hydra/sweeper=optuna", "hydra.sweeper.study_name=slots", *overrides])
    with pytest.raises(ValueError, match=re.escape(message)):
        SweepEngine(cfg, []).run()
    assert not (root / "sweeps" / "slots").exists() and not (root / "mlruns" / "mlflow.db").exists()


@pytest.mark.slow(seconds=15)
def test_a_trial_past_its_time_limit_is_killed_as_a_timeout_even_while_it_makes_steps(root: Path) -> None:
    """trial_timeout_s is the whole trial's limit, apart from the stall watchdog (stall_timeout_s, set far
    beyond it here): a hung trial is killed with its process group and classified as a timeout."""
    from omegaconf import OmegaConf

    from src.sweep.process import run_process

    sweeper = OmegaConf.create(
        {"trial_timeout_s": 15, "stall_timeout_s": 3600, "heartbeat_interval_s": 10, "preload": False}
    )
    overrides = ["model=tiny_llama", "trainer=probe", "fault=hang", "fault.step=1", "measure.profile_attention=false"]
    started = time.time()
    outcome = run_process(overrides, root / "trial", {"QLORA_ROOT": str(root)}, sweeper)
    assert outcome.status == "failed" and outcome.failure["kind"] == "timeout", outcome.failure
    assert outcome.failure["message"].startswith("killed by the watchdog after")
    assert outcome.failure["message"].endswith("(hydra.sweeper.trial_timeout_s=15)"), "the time limit, not the stall"
    assert 15 <= time.time() - started < 80


def test_a_two_objective_sweep_tells_optuna_both_and_keeps_ooms_off_the_front(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from src import report

    def fake_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        seq = int(dict(o.split("=", 1) for o in overrides)["data.max_seq_length"])
        if seq == 4096:
            return Outcome(
                "failed",
                metrics={"peak_vram_reserved_gib": 23.4, "oom_request_gib": 4.0},
                failure={"kind": "oom", "message": "CUDA out of memory", "step": 1},
            )
        return Outcome("ok", metrics={"tokens_per_s": seq / 2.0, "peak_vram_reserved_gib": 6.0 + seq / 256})

    cfg = _fake_sweep(
        monkeypatch,
        "pareto",
        6,
        ["data.max_seq_length=choice(512,1024,4096)"],
        "hydra/sweeper/sampler=nsgaii",
        "hydra.sweeper.objectives=[tokens_per_s,peak_vram_reserved_gib]",
        "hydra.sweeper.direction=[maximize,minimize]",
        process=fake_process,
    )
    study = _study(root, "pareto")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert study.metric_names == ["tokens_per_s", "peak_vram_reserved_gib"]
    trials = [t for t in study.get_trials() if t.user_attrs.get("trial.status") != "skipped"]
    # NSGA-II breeds from COMPLETE trials only: an OOM is told COMPLETE, infeasible, so it is ranked below every
    # feasible setting (told PRUNED, NSGA-II would never see it).
    assert trials and all(t.state == TrialState.COMPLETE and len(t.values) == 2 for t in trials)
    for t in trials:
        seq = t.params["data.max_seq_length"]
        expected = [0.0, 23.4] if seq == 4096 else [seq / 2.0, 6.0 + seq / 256]  # an OOM: no speed, its memory
        assert t.values == pytest.approx(expected), (seq, t.values)
        assert (named_constraints(t)["vram_budget"] > 0) == (seq == 4096)
    front = {t.params["data.max_seq_length"] for t in study.best_trials}
    assert front and 4096 not in front, "an OOM is infeasible: never on the Pareto front"
    sweep = report.load("pareto", root / "sweeps", tracking_uri=str(cfg.tracking.uri))
    assert sweep.objectives == ["tokens_per_s", "peak_vram_reserved_gib"]


def test_a_sweep_run_again_on_a_complete_study_says_so_in_one_line(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, mlflow_client
) -> None:
    """`make demo` twice: the second sweep runs nothing and says why, with the report's command and both ways to
    sweep again (a new study name that is free, or more trials); the study and its parent run are left as they were."""
    space = ["lora.r=choice(8,16)"]
    _fake_sweep(monkeypatch, "again", 2, space, "hydra/sweeper/sampler=grid")
    (root / "sweeps" / "again-2").mkdir()  # taken: the suggested name is a free one
    parent = next(r for r in _runs(mlflow_client, "again") if r.data.tags.get("sweep.role") == "parent")
    capsys.readouterr()

    def never(*args: object, **kwargs: object) -> Outcome:
        raise AssertionError("a complete study launched a trial")

    _fake_sweep(monkeypatch, "again", 2, space, "hydra/sweeper/sampler=grid", process=never)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines == [
        "study 'again' is already complete: it holds 2 finished trials (hydra.sweeper.n_trials=2), so no trial was "
        "run. Its map: python -m src.report again  |  to sweep again, start a new study with "
        "hydra.sweeper.study_name=again-3, or add trials to this one with hydra.sweeper.n_trials=4"
    ]
    assert len(_study(root, "again").get_trials()) == 2
    again = mlflow_client.get_run(parent.info.run_id)
    assert again.info.status == "FINISHED" and again.info.end_time == parent.info.end_time
