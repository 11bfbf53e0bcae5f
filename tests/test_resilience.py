"""Nothing lost, clean stops (issue #17): a trial that recorded itself before its sweep process died is told what it
measured; Ctrl-C, SIGTERM and a full disk stop the sweep with one line that says how to resume, nothing left
RUNNING that can be closed; impossible counts are refused before anything is recorded; trial processes start in a
session of their own without preexec_fn and die with the engine that started them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from src.config import PROJECT_DIR
from src.sweep.rules import named_constraints
from tests.conftest import run_cli, sweep_argv
from tests.fake_sweep import FAULT_ENV


def _study(root: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{root}/sweeps/{name}/optuna.db")


def _runs(client, experiment: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000)


def _fake_sweep(root: Path, study: str, *overrides: str, fault: str | None = None) -> subprocess.CompletedProcess:
    """tests/fake_sweep.py as its own process: trials are stand-ins, the sweep process is the real engine."""
    env = {FAULT_ENV: fault} if fault else {}
    args = [f"hydra.sweeper.study_name={study}", "hydra.sweeper.n_trials=3", *overrides]
    return run_cli("tests.fake_sweep", *args, root=root, timeout=300, env=env)


def _resume(root: Path, monkeypatch: pytest.MonkeyPatch, study: str, *overrides: str) -> int:
    """The same command as `_fake_sweep` again, in this process: the sweep process that died or stopped is gone, and
    the resume reads only what it left in the stores and the study's folder; a fresh interpreter would add ~5 s of
    imports and nothing the resume reads. Its exit code; what it prints is the test's capsys and caplog."""
    from tests import fake_sweep

    monkeypatch.setenv("QLORA_ROOT", str(root))
    monkeypatch.setattr("src.sweep.launch.run_process", fake_sweep.trial)
    monkeypatch.setattr("src.sweep.prepare.build_model", lambda *a: None)
    try:
        fake_sweep.engine([f"hydra.sweeper.study_name={study}", "hydra.sweeper.n_trials=3", *overrides]).run()
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _assert_told_what_it_measured(root: Path, study: str, client, number: int = 1) -> None:
    trials = _study(root, study).get_trials()
    assert len(trials) == 3 and not [t.number for t in trials if not t.state.is_finished()]
    told = trials[number]
    assert told.state == TrialState.COMPLETE and told.values == [100.0 + number], told.user_attrs
    assert told.user_attrs["trial.status"] == "ok" and "failure.kind" not in told.user_attrs
    assert named_constraints(told)["vram_budget"] < 0, "its constraint told too: 8 GiB of 24"
    runs = {r.data.tags.get("optuna.trial"): r for r in _runs(client, study)}
    assert runs[str(number)].info.status == "FINISHED" and "failure.kind" not in runs[str(number)].data.tags
    assert not [r.info.run_name for r in runs.values() if r.info.status == "RUNNING"]


# ---- item 4: a measured trial is never turned into `killed` -------------------------------------------------


@pytest.mark.slow(seconds=7)
@pytest.mark.parametrize("death", ["sigkill", "sigkill_elsewhere", "sigterm"])
def test_a_trial_that_recorded_itself_before_its_sweeper_died_is_told_what_it_measured(
    root: Path, mlflow_client, death: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweep process dies between the trial's own records (result.json, its MLflow run FINISHED) and telling
    Optuna. kill -9: the next run tells it from its folder, or from its MLflow run alone when it ran on another
    host (only its stopped heartbeat says it died; its folder is not here). SIGTERM: it is told before the sweep
    stops, like Ctrl-C."""
    heartbeat = ["hydra.sweeper.heartbeat_interval_s=1", "hydra.sweeper.grace_period_s=2"]
    signal_name = death.split("_")[0]
    first = _fake_sweep(root, "died", *heartbeat, fault=f"{signal_name}@1")
    if death == "sigterm":
        assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
        assert "Traceback" not in first.stderr and "the sweep was interrupted (SIGTERM)" in first.stderr
        assert _study(root, "died").get_trials()[1].state == TrialState.COMPLETE, "told before it stopped"
    else:
        assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
        assert _study(root, "died").get_trials()[1].state == TrialState.RUNNING, "measured, never told"
    if death == "sigkill_elsewhere":
        storage = optuna.storages.RDBStorage(f"sqlite:///{root}/sweeps/died/optuna.db")
        trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name("died"), 1)
        storage.set_trial_user_attr(trial_id, "worker.host", "another-node")
        shutil.rmtree(root / "sweeps" / "died" / "trials" / "001")
        time.sleep(3)  # past the grace period: its heartbeat is stale
    with caplog.at_level("WARNING", logger="src.sweep.teller"):
        assert _resume(root, monkeypatch, "died", *heartbeat) == 0
    _assert_told_what_it_measured(root, "died", mlflow_client)
    if death != "sigterm":
        assert "trial 1 had finished (ok) when its sweep worker died: told what its records say" in caplog.text


@pytest.mark.slow(seconds=8)
def test_a_sigterm_during_a_soak_leaves_no_run_running_and_the_resume_finishes_the_soak(
    root: Path, mlflow_client, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Issue 30 finding 10: a soak is launched, stopped and recorded as every trial is (src/sweep/launch.py). A
    SIGTERM while the finalist soaks ends the sweep with its one line, the soak's run KILLED (it stayed RUNNING for
    good), and the same command again soaks the finalist to the end."""
    soak = ["hydra.sweeper.soak_top_k=1"]
    first = _fake_sweep(root, "soaked", *soak, fault="sigterm@soak")
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    assert "the sweep was interrupted (SIGTERM): 1 running trial stopped and recorded as killed" in first.stderr
    runs = _runs(mlflow_client, "soaked")
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    soaks = [r for r in runs if r.data.tags.get("run.kind") == "soak"]
    assert [(r.info.status, r.data.tags["failure.kind"]) for r in soaks] == [("KILLED", "killed")]
    assert _study(root, "soaked").user_attrs["soak.2"]["status"] == "stopped"

    capsys.readouterr()
    assert _resume(root, monkeypatch, "soaked", *soak) == 0
    printed = capsys.readouterr().out
    assert "soak: trial 2 passed" in printed, printed[-3000:]
    assert _study(root, "soaked").user_attrs["soak.2"]["status"] == "passed"
    runs = _runs(mlflow_client, "soaked")
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    assert sorted(r.info.status for r in runs if r.data.tags.get("run.kind") == "soak") == ["FINISHED", "KILLED"]


# ---- item 7: a full disk ------------------------------------------------------------------------------------


@pytest.mark.slow(seconds=7)
def test_a_full_disk_stops_the_sweep_with_one_line_and_the_resume_keeps_what_was_measured(
    root: Path, mlflow_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _fake_sweep(root, "full", fault="disk_full@1")
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    line = f"sweep stopped: disk full: the Optuna storage sqlite:///{root}/sweeps/full/optuna.db cannot be written"
    said = [text for text in first.stderr.splitlines() if "disk" in text]
    assert len(said) == 1 and said[0].startswith(line), first.stderr[-3000:]
    assert said[0].endswith("free space, then run the same command again to resume")
    runs = _runs(mlflow_client, "full")
    parent = next(r for r in runs if r.data.tags.get("sweep.role") == "parent")
    assert parent.info.status == "KILLED", "stopped, not finished"
    assert len(_study(root, "full").get_trials()) == 2, "no trial asked after the disk filled"

    assert _resume(root, monkeypatch, "full") == 0
    _assert_told_what_it_measured(root, "full", mlflow_client)


@pytest.mark.slow(seconds=7)
@pytest.mark.parametrize("full", ["mlflow_full", "everything_full"])
def test_a_full_disk_under_mlflow_says_one_line_keeps_the_tracebacks_in_the_study_log_and_leaves_nothing_running(
    root: Path, mlflow_client, full: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30, 21: a real full disk under the MLflow store made MLflow log each failed write with its traceback, 180
    lines on the terminal before the sweep's one line. Now they go to sweeps/<study>/sweep.log and the terminal gets
    the one line, naming the store, the file and what to do. A trial that was running on the other slot is ended by
    the stop; its records, where the stores could not take them, are settled by the resume: nothing stays RUNNING."""
    from tests.fake_sweep import HOLD_ENV

    env = {FAULT_ENV: f"{full}@1", HOLD_ENV: "0"}
    first = run_cli(
        "tests.fake_sweep", "hydra.sweeper.study_name=full", "hydra.sweeper.n_trials=3", "hydra.sweeper.cpu_slots=2",
        root=root, timeout=300, env=env,
    )  # fmt: skip
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Traceback" not in first.stderr and "OperationalError" not in first.stderr, first.stderr[-3000:]
    lines = [line for line in first.stderr.splitlines() if line.strip()]
    log = root / "sweeps" / "full" / "sweep.log"
    said = [line for line in lines if line.startswith("sweep stopped")]
    stores = (f"the MLflow store sqlite:///{root}/mlruns/mlflow.db", f"the Optuna storage sqlite:///{root}/sweeps/full")
    assert len(said) == 1 and any(f"disk full: {store}" in said[0] for store in stores), lines
    assert f"; tracebacks in {log}; free space, then run the same command again to resume" in said[0], said
    assert len(lines) <= 3, lines
    kept = log.read_text()
    assert "Traceback" in kept and "database or disk is full" in kept and "ERROR mlflow" in kept

    assert _resume(root, monkeypatch, "full") == 0
    trials = _study(root, "full").get_trials()
    assert not [t.number for t in trials if not t.state.is_finished()]
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs["failure.kind"] == "killed"
    runs = _runs(mlflow_client, "full")
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    held = next(r for r in runs if r.data.tags.get("optuna.trial") == "0")
    assert held.info.status == "KILLED" and held.data.tags["failure.kind"] == "killed"


@pytest.mark.slow(seconds=14)
def test_the_tracking_server_dying_stops_the_sweep_with_one_line_within_a_minute(root: Path, tmp_path: Path) -> None:
    """The MLflow server killed once a trial ran (issue #30, 15): the engine's calls fail fast (bounded retries, not
    MLflow's ~4 minutes of backoff), and the sweep stops as for a full disk: one line naming the store, exit 1,
    how to resume; no page of traceback."""
    from tests.services import start_mlflow_server

    server = start_mlflow_server(tmp_path / "srv", f"sqlite:///{tmp_path}/srv.db", {})
    try:
        env = {FAULT_ENV: "server_down@1", "QLORA_FAKE_SERVER_PID": str(server.proc.pid)}
        args = ["hydra.sweeper.study_name=down", "hydra.sweeper.n_trials=3", f"tracking.uri={server.url}"]
        start = time.monotonic()
        done = run_cli("tests.fake_sweep", *args, root=root, timeout=120, env=env)
        took = time.monotonic() - start
    finally:
        server.stop()
    assert done.returncode == 1, done.stderr[-3000:]
    assert took < 60, f"{took:.0f} s"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [text for text in done.stderr.splitlines() if "sweep stopped" in text]
    assert len(said) == 1 and f"the MLflow store {server.url} cannot be reached" in said[0], done.stderr
    assert said[0].endswith("run the same command again to resume"), said[0]


# ---- issue 30, 21: a resume whose killed trials filled n_trials ------------------------------------------------


def test_a_resume_whose_killed_trials_filled_n_trials_says_so_and_retry_failed_trials_runs_them(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A sweep of 3 trials kill -9ed with two trials running: the resume fails them as killed, and they fill n_trials,
    so it ran nothing, saying nothing of `retry_failed_trials`; nor did that key run them on a later resume (it only
    queued trials failed in the same run). Now each resume says how many were killed and which key runs them again,
    and the key queues them again, a run after the kill too."""
    import socket

    from optuna.distributions import CategoricalDistribution

    from tests.test_sweep import _fake_sweep

    space, again = ["lora.r=choice(4,8)"], "hydra.sweeper.skip_duplicates=false"
    _fake_sweep(monkeypatch, "killed", 1, space, again)  # trial 0, measured
    study = _study(root, "killed")
    gone = subprocess.Popen(["true"])
    gone.wait()  # the worker that ran trials 1 and 2, killed
    for _ in range(2):
        trial = study.ask({"lora.r": CategoricalDistribution((4, 8))})
        trial.set_user_attr("worker.host", socket.gethostname())
        trial.set_user_attr("worker.pid", gone.pid)
    capsys.readouterr()

    _fake_sweep(monkeypatch, "killed", 3, space, again)  # the resume: fails them, and is full
    said = capsys.readouterr().out
    assert "2 of them were killed when a sweep stopped or its worker died" in said, said
    assert "add hydra.sweeper.retry_failed_trials=true to the same command" in said
    assert [t.state for t in _study(root, "killed").get_trials()] == [TrialState.COMPLETE] + [TrialState.FAIL] * 2

    _fake_sweep(monkeypatch, "killed", 3, space, again)  # once more: the study is complete, and says why
    said = capsys.readouterr().out
    assert "is already complete" in said and "2 of them were killed" in said and "retry_failed_trials=true" in said

    _fake_sweep(monkeypatch, "killed", 3, space, again, "hydra.sweeper.retry_failed_trials=true")
    said = capsys.readouterr().out
    trials = _study(root, "killed").get_trials()
    retries = {t.user_attrs["retry_of"]: t for t in trials if "retry_of" in t.user_attrs}
    assert sorted(retries) == [1, 2] and len(trials) == 5, [(t.number, t.state) for t in trials]
    for number, retry in retries.items():
        assert retry.state == TrialState.COMPLETE and retry.params == trials[number].params
    assert "3 trials finished, 3 ok" in said and "were killed" not in said, said


def test_retry_failed_trials_queues_only_what_the_sweep_killed_as_what_it_was_queued_as(tmp_path: Path) -> None:
    """A lever trial the sweep's stop ended is queued again as that lever (its overrides, the recipe it levers, no
    `lever` param to clash with the sampler's); a trial killed by its own doing (a fault, SIGKILL) is not retried."""
    from omegaconf import OmegaConf
    from optuna.distributions import CategoricalDistribution

    from src.sweep.storage import StudyStore

    sweeper = OmegaConf.create(
        {
            "storage": None,
            "heartbeat_interval_s": 10,
            "grace_period_s": 60,
            "retry_failed_trials": True,
            "sampler": None,
        }
    )
    store = StudyStore(sweeper, "retry", tmp_path / "retry", "host", lambda s, t: None)
    study = store.open(["maximize"], {}, ["tokens_per_s"])
    r = CategoricalDistribution((4, 8))
    lever = '["trainer.gradient_checkpointing=true"]'
    study.enqueue_trial({"lora.r": 8}, user_attrs={"sweep.lever": lever, "sweep.lever_of": 0})
    for message in ("the sweep was interrupted (SIGINT) while this trial ran", "process ended by signal SIGKILL"):
        trial = study.ask({"lora.r": r})
        trial.set_user_attr("failure.kind", "killed")
        trial.set_user_attr("failure.message", message)
        study.tell(trial, state=TrialState.FAIL)
    study = store.open(["maximize"], {}, ["tokens_per_s"])  # the resume, with retry_failed_trials=true
    (retry,) = study.get_trials(states=(TrialState.WAITING,))
    assert retry.user_attrs == {"sweep.lever": lever, "sweep.lever_of": 0, "retry_of": 0}
    assert retry.system_attrs["fixed_params"] == {"lora.r": 8}
    store.open(["maximize"], {}, ["tokens_per_s"])  # and once only
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1


# ---- item 6: Ctrl-C -----------------------------------------------------------------------------------------


@pytest.mark.slow(seconds=10)
def test_ctrl_c_stops_the_trials_marks_them_interrupted_and_says_how_to_resume(root: Path, mlflow_client) -> None:
    """A real trial runs (it would hang at its first step); Ctrl-C (SIGINT to the sweep process: its trials are in
    sessions of their own, out of the terminal's reach) ends the trial's process group, records it as killed by the
    interruption, closes the parent run KILLED and exits 130 with the way to resume, and no traceback. The trial
    starts from a fresh interpreter and is interrupted once it has begun (Hydra wrote its config): the engine stops
    a forked trial the same way (src/sweep/process.py), and forked trials die with their sweep in the sigkill test."""
    args = [
        sys.executable,
        "-m",
        *sweep_argv("sweep=demo", study="ctrl-c"),
        # the demo's smallest settings, none near its memory edge: this test is about the sweep process, not memory
        "hydra.sweeper.enqueue_trials=[]",
        "trainer.per_device_train_batch_size=choice(1,2)",
        "hardware.vram_budget_gib=24",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.cpu_slots=1",
        "hydra.sweeper.stall_timeout_s=3600",
        "hydra.sweeper.preload=false",
        "fault=hang",
        "fault.step=1",
    ]
    env = {**os.environ, "QLORA_ROOT": str(root)}
    log = root / "sweep.log"
    with log.open("w") as out:
        sweep = subprocess.Popen(args, cwd=PROJECT_DIR, env=env, stdout=subprocess.DEVNULL, stderr=out)
    try:
        begun = root / "sweeps" / "ctrl-c" / "trials" / "000" / ".hydra" / "config.yaml"
        deadline = time.time() + 300
        while time.time() < deadline and not begun.exists():
            assert sweep.poll() is None, _read(log)[-3000:]
            time.sleep(0.2)
        # A trial is the leader of its own session: a child of the sweep (a fresh interpreter) or of its forkserver
        trials = [p for p in psutil.Process(sweep.pid).children(recursive=True) if os.getsid(p.pid) == p.pid]
        assert len(trials) == 1, "the hanging trial"
        assert os.getsid(trials[0].pid) == trials[0].pid != os.getsid(sweep.pid), "a session of its own"
        sweep.send_signal(signal.SIGINT)
        sweep.wait(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    stderr = _read(log)
    assert sweep.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    said = stderr.strip().splitlines()[-1]
    assert said.startswith("the sweep was interrupted (SIGINT): 1 running trial stopped and recorded as killed; ")
    assert "run the same command again to resume: python -m src.train -m hydra/sweeper=optuna sweep=demo" in said
    assert not psutil.pid_exists(trials[0].pid) or trials[0].status() == psutil.STATUS_ZOMBIE

    trial = _study(root, "ctrl-c").get_trials()
    assert len(trial) == 1 and trial[0].state == TrialState.FAIL
    assert trial[0].user_attrs["failure.kind"] == "killed"
    assert trial[0].user_attrs["failure.message"] == "the sweep was interrupted (SIGINT) while this trial ran"
    runs = _runs(mlflow_client, "ctrl-c")
    parent = next(r for r in runs if r.data.tags.get("sweep.role") == "parent")
    child = next(r for r in runs if r.data.tags.get("optuna.trial") == "0")
    assert child.info.status == "KILLED" and child.data.tags["failure.kind"] == "killed"
    assert parent.info.status == "KILLED"


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# ---- item 8: counts that run nothing ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting,message",
    [
        ("hydra.sweeper.n_jobs=-5", "hydra.sweeper.n_jobs=-5: must be at least 1 (or null: one trial per slot)"),
        ("hydra.sweeper.n_trials=0", "hydra.sweeper.n_trials=0: must be at least 1"),
    ],
)
def test_a_sweep_that_would_run_nothing_is_refused_on_the_command_line(root: Path, setting: str, message: str) -> None:
    done = run_cli(*sweep_argv(setting, study="nothing"), root=root)
    assert done.returncode != 0 and f"error: {message}" in done.stderr.splitlines(), done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert not (root / "sweeps" / "nothing").exists() and not (root / "mlruns" / "mlflow.db").exists()


# ---- item 13: how a trial process starts --------------------------------------------------------------------


def test_trials_start_in_a_session_of_their_own_without_preexec_fn(root: Path, monkeypatch) -> None:
    """preexec_fn can deadlock a child forked from a threaded parent (the engine runs one thread per slot)."""
    from omegaconf import OmegaConf

    from src.handoff import PARENT_ENV
    from src.sweep import process

    seen: dict = {}

    class Stop(Exception):
        pass

    def popen(cmd: list[str], **kwargs) -> None:
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(process.subprocess, "Popen", popen)
    sweeper = OmegaConf.create({"trial_timeout_s": 60, "stall_timeout_s": 60, "heartbeat_interval_s": 10})
    with pytest.raises(Stop):
        process.run_process(["model=tiny_llama"], root / "trial", {}, sweeper)
    assert "preexec_fn" not in seen and seen["start_new_session"] is True
    assert seen["env"][PARENT_ENV] == str(os.getpid()), "the trial learns whose death it dies with"


@pytest.mark.parametrize("wrote", [None, "loading"])
def test_a_trial_that_hangs_before_its_first_step_is_killed_at_the_stall_timeout(
    tmp_path: Path, monkeypatch, wrote: str | None
) -> None:
    """Issue 47 #13: a trial hung while loading (no progress file yet, or one left in "loading") held its slot until
    trial_timeout_s (an hour); it is a stall like one mid-training."""
    from omegaconf import OmegaConf

    from src.handoff import PROGRESS_FILE
    from src.sweep import process

    hang = tmp_path / "hang.sh"
    log_dir = tmp_path / "trial"
    progress = f'echo \'{{"phase": "{wrote}", "step": 0, "time": \'$(date +%s)\'}}\' > {log_dir / PROGRESS_FILE}'
    hang.write_text("#!/bin/sh\n" + (progress if wrote else "") + "\nexec sleep 120\n")
    hang.chmod(0o755)
    monkeypatch.setattr(process.sys, "executable", str(hang))
    sweeper = OmegaConf.create(
        {"trial_timeout_s": 100, "stall_timeout_s": 60, "startup_timeout_s": 2, "heartbeat_interval_s": 10}
    )
    started = time.monotonic()
    outcome = process.run_process(["model=tiny_llama"], log_dir, {}, sweeper)
    assert time.monotonic() - started < 30, "killed at the stall timeout, not at trial_timeout_s"
    assert outcome.failure["kind"] == "timeout" and outcome.failure["step"] is None
    assert "2s without progress in start-up, hydra.sweeper.startup_timeout_s" in outcome.failure["message"]


@pytest.mark.slow(seconds=3)
def test_a_trial_dies_with_the_engine_thread_that_started_it(root: Path) -> None:
    """The engine's stand-in starts a real trial from a thread, as each slot does, and is killed with SIGKILL once
    the trial has begun (Hydra has written its config: its parent-death signal is set before that, src/train.py):
    the trial, in its own session, dies too. Left alone it would never end (it hangs at its first step)."""
    code = (
        "import sys, threading; from pathlib import Path; from omegaconf import OmegaConf;"
        "from src.sweep.process import run_process;"
        "sweeper = OmegaConf.create({'trial_timeout_s': 600, 'stall_timeout_s': 600, 'heartbeat_interval_s': 10});"
        "overrides = ['model=tiny_llama', 'trainer=probe', 'fault=hang', 'fault.step=1',"
        " 'measure.profile_attention=false'];"
        "t = threading.Thread(target=run_process, args=(overrides, Path(sys.argv[1]), {}, sweeper)); t.start(); t.join()"
    )
    env = {**os.environ, "QLORA_ROOT": str(root)}
    engine = subprocess.Popen([sys.executable, "-c", code, str(root / "trial")], cwd=PROJECT_DIR, env=env)
    trial = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (root / "trial" / ".hydra" / "config.yaml").exists():
            assert engine.poll() is None
            time.sleep(0.2)
        trial = psutil.Process(engine.pid).children()[0]
        assert os.getsid(trial.pid) == trial.pid != os.getsid(engine.pid)
        engine.kill()
        engine.wait()
        trial.wait(timeout=30)  # psutil.TimeoutExpired if it outlived its engine (killed below)
    finally:
        if engine.poll() is None:
            engine.kill()
        if trial is not None and trial.is_running():
            trial.kill()


@pytest.mark.parametrize("parent", ["alive", "gone"])
def test_a_trial_whose_engine_died_before_it_started_exits_at_once(parent: str) -> None:
    """The race a parent-death signal leaves: the engine dies before the trial asks for the signal. The trial
    compares its parent with the one it was started by, and exits if they differ. The variable is its own only:
    what it starts (torchrun's ranks) does not inherit it."""
    from src.handoff import PARENT_ENV

    if parent == "gone":
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        pid = gone.stdout.strip()
    else:
        pid = str(os.getpid())
    code = (
        "import os; from src.handoff import PARENT_ENV, die_with_parent; die_with_parent();"
        "print('alive', os.environ.get(PARENT_ENV))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PROJECT_DIR,
        env={**os.environ, PARENT_ENV: pid},
        capture_output=True,
        text=True,
    )
    if parent == "alive":
        assert done.returncode == 0 and done.stdout.strip() == "alive None", done.stderr
    else:
        assert done.returncode == -signal.SIGKILL and "alive" not in done.stdout


def test_a_trial_whose_worker_died_right_after_asking_is_failed_once_the_grace_period_passed(tmp_path: Path) -> None:
    """SIGKILL between Optuna's ask and the engine writing its worker and first heartbeat leaves a RUNNING trial that
    no heartbeat will ever expire; recovery fails it by age (past grace_period_s), not before."""
    import optuna
    from omegaconf import OmegaConf

    from src.sweep.storage import StudyStore

    def store(grace: int) -> StudyStore:
        sweeper = OmegaConf.create(
            {
                "storage": None,
                "heartbeat_interval_s": 10,
                "grace_period_s": grace,
                "retry_failed_trials": False,
                "sampler": None,
            }
        )
        return StudyStore(sweeper, "orphan", tmp_path / "orphan", "host", lambda s, t: None)

    def recover(store: StudyStore, study: optuna.Study) -> None:  # as the engine settles them, with no records
        for dead in store.dead(study):
            store.fail_dead(study, dead, None)

    patient = store(3600)
    study = patient.open(["maximize"], {}, ["tokens_per_s"])
    trial = study.ask()  # and its worker dies here
    recover(patient, study)
    assert study.trials[trial.number].state == optuna.trial.TrialState.RUNNING  # young: its worker may be writing
    impatient = store(1)  # another worker, a second's grace period, and that second gone
    time.sleep(1.2)
    recover(impatient, impatient.open(["maximize"], {}, ["tokens_per_s"]))
    assert study.trials[trial.number].state == optuna.trial.TrialState.FAIL


def test_a_live_worker_is_never_judged_dead_from_its_clocks_rounding(monkeypatch):
    """Issue 30 finding 12: a process's epoch start time is the kernel's boot time (whole seconds, re-derived from
    the wall clock) plus its start in ticks, so two reads of one live worker can differ by a whole second. The
    worker's trial was failed as left by a dead worker while it ran. Read a second apart, it is still alive."""
    from src.sweep import storage

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (os.getpid(), other.pid):
            recorded = storage.worker_identity(pid)
            assert recorded["worker.started_since_boot"] is not None, "Linux gives every process its start in ticks"
            real = storage.create_time

            def read_a_second_later(p, real=real):
                value = real(p)
                return None if value is None else value + 1.0

            monkeypatch.setattr(storage, "create_time", read_a_second_later)
            assert storage._alive(
                recorded["worker.pid"], recorded["worker.started"], recorded["worker.started_since_boot"]
            )
            # a record of an older worker (no ticks): the same process, a second off, is still alive
            assert storage._alive(pid, recorded["worker.started"])
            monkeypatch.setattr(storage, "create_time", real)
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        assert not storage._alive(int(ended.stdout), recorded["worker.started"], recorded["worker.started_since_boot"])
    finally:
        other.kill()
        other.wait()
