"""Scale-out on real services: several sweep processes are workers of one study in PostgreSQL and record to one
`mlflow server` with basic auth; a worker SIGKILLed mid-trial leaves a trial that another worker fails (by its
heartbeat) and retries. The shared study's two workers are submitted through submitit to a real single-node SLURM,
and one of them is the worker killed mid-trial: one study shows both, for the CPU time of one.

Each test starts what it needs itself (tests/services.py) on 127.0.0.1 and stops it, pass or fail.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import optuna
import pytest
import requests
from optuna.trial import TrialState

from src.config import PROJECT_DIR
from src.study import failure_kind, retried_numbers
from src.sweep.engine import SweepEngine
from tests.conftest import compose_cfg, run_cli, sweep_argv
from tests.services import CONNECTION_BUDGET

if TYPE_CHECKING:
    from tests.services import MlflowServer, Postgres, Slurm

pytestmark = pytest.mark.slow

# How long a sweep worker may take, as a guard against a hang: on two cores shared with other work a worker took
# 3 minutes to import and open its study and a minute per trial, so these are far above an idle machine's figures.
WORKER_S = 900

PROBE = [
    "sweep=demo",
    "hydra.sweeper.progress=false",
    "hydra.sweeper.trial_overrides=['trainer.max_steps=4']",
    # the demo's two smallest batches, far from its memory edge: these tests are about workers, not memory
    "hydra.sweeper.enqueue_trials=[]",
    "trainer.per_device_train_batch_size=choice(1,2)",
    "hardware.vram_budget_gib=24",
]
PROBE += ["hydra.sweeper.soak_top_k=0"]  # no soak: minutes of training per setting


def sweep_args(study: str, storage: str, n_trials: int, server: MlflowServer, *extra: str) -> list[str]:
    """One worker's command line: the same for every worker (disjoint slots: one CPU slot each)."""
    return [
        *PROBE,
        f"hydra.sweeper.study_name={study}",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweeper.n_trials={n_trials}",
        "hydra.sweeper.cpu_slots=1",
        f"tracking.uri={server.url}",
        *extra,
    ]


def worker_env(root: Path, cache: Path, pg: Postgres, server: MlflowServer) -> dict[str, str]:
    return {**os.environ, "QLORA_ROOT": str(root), "QLORA_CACHE": str(cache), **pg.env, **server.env}


def start_worker(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", *sweep_argv(*args)],
            cwd=PROJECT_DIR,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@functools.cache
def rdb(url: str) -> optuna.storages.RDBStorage:
    """This test process's one Optuna storage per database. Each RDBStorage has an engine whose pool keeps its
    connection open: a storage opened per poll held one more connection per poll (PGPASSWORD: set by the caller)."""
    return optuna.storages.RDBStorage(url)


def load_study(name: str, url: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=rdb(url))


def mlflow_runs(server: MlflowServer, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.url)
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id], max_results=1000)


def assert_one_run_per_trial(trials: list, runs: list) -> None:
    parents = [r for r in runs if r.data.tags.get("sweep.role") == "parent"]
    assert len(parents) == 1, "every worker records into the study's one parent run"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    per_trial = Counter(r.data.tags["optuna.trial"] for r in children)
    assert per_trial == Counter(str(t.number) for t in trials)
    by_number = {r.data.tags["optuna.trial"]: r for r in children}
    for t in trials:
        assert by_number[str(t.number)].info.run_id == t.user_attrs["mlflow_run_id"]
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    assert parents[0].info.status == "FINISHED"


# ---- the cross-host lock ------------------------------------------------------------------------------------


def test_postgres_ask_lock_serializes_workers_and_dies_with_its_holder(
    postgres: Postgres, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    storage = postgres.create_db("optuna_lock")
    cfg = compose_cfg(
        ["hydra/sweeper=optuna", f"hydra.sweeper.storage={storage}", "hydra.sweeper.study_name=lock"]
        + ["trainer.output_dir=/tmp/unused"]
    )
    engines = [SweepEngine(cfg, []) for _ in range(3)]  # as if on three hosts: nothing shared but the database
    inside, most = 0, 0
    count = threading.Lock()

    def critical(engine: SweepEngine) -> None:
        nonlocal inside, most
        for _ in range(5):
            with engine.store.lock():
                with count:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.02)
                with count:
                    inside -= 1

    threads = [threading.Thread(target=critical, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert most == 1

    # A worker SIGKILLed inside the critical section does not block the others: its connection, and with it
    # the lock, goes with it.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlalchemy, sys, time; from src.sweep.storage import lock_key\n"
            f"c = sqlalchemy.create_engine('{storage}').connect()\n"
            "c.execute(sqlalchemy.text('SELECT pg_advisory_lock(:k)'), {'k': lock_key('lock')}); c.commit()\n"
            "print('held', flush=True); time.sleep(600)",
        ],
        cwd=PROJECT_DIR,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"

        def take() -> None:
            with engines[0].store.lock():
                pass

        waiter = threading.Thread(target=take)
        waiter.start()
        waiter.join(timeout=2)
        assert waiter.is_alive(), "the lock is held by the other process"
        holder.kill()
        waiter.join(timeout=30)
        assert not waiter.is_alive()
    finally:
        holder.kill()


def test_each_process_of_a_study_draws_from_its_own_seed(root: Path) -> None:
    """Seeded alike, two workers would propose the same settings in the same order; the first process keeps the
    configured seed, so a sweep run alone stays reproducible."""
    cfg = compose_cfg(
        ["hydra/sweeper=optuna", "sweep=demo", "hydra/sweeper/sampler=random", "hydra.sweeper.study_name=seeds"]
        + ["trainer.output_dir=/tmp/unused"]
    )
    first, second = SweepEngine(cfg, []), SweepEngine(cfg, [])
    proposals = [e.open_study().ask(e.distributions).params for e in (first, second)]
    assert proposals[0] != proposals[1]
    alone = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=cfg.hydra.sweeper.sampler.seed))
    assert alone.ask(first.distributions).params == proposals[0]


def test_a_worker_dead_before_naming_its_run_still_leaves_one_closed_run_per_trial(root: Path) -> None:
    """Recovery closes the run a dead worker created but had not yet named on its trial, and creates one (KILLED)
    for a trial whose worker died before creating any."""
    from mlflow.tracking import MlflowClient

    cfg = compose_cfg(["hydra/sweeper=optuna", "hydra.sweeper.study_name=orphans", "trainer.output_dir=/tmp/unused"])
    engine = SweepEngine(cfg, [])
    study = engine.open_study()
    engine.open_parent(study)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphans = []
    for _ in range(2):
        trial = study.ask(engine.distributions)
        trial.set_user_attr("worker.host", engine.host)
        trial.set_user_attr("worker.pid", int(dead.stdout))  # a process that has exited
        orphans.append(trial)
    unnamed = engine.runs.child(orphans[0].number, "cpu0")  # created, never set on the trial
    engine.recover(study)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL]
    assert trials[0].user_attrs["mlflow_run_id"] == unnamed
    client = MlflowClient()
    for t in trials:
        run = client.get_run(t.user_attrs["mlflow_run_id"])
        assert run.info.status == "KILLED" and run.data.tags["failure.kind"] == "killed"
        assert (
            run.data.tags["optuna.trial"] == str(t.number) and run.data.tags["mlflow.parentRunId"] == engine.runs.parent
        )


# ---- two workers, one study, one server; one of them dies mid-trial ----------------------------------------


@dataclass
class SharedStudy:
    name: str
    storage: str
    root: Path
    done: subprocess.CompletedProcess  # `python -m src.cluster ... cluster.wait=true`
    folder: Path  # submitit's: sweeps/<study>/cluster/[<job>/]
    slurm: bool
    seconds: float
    killed: int  # the trial whose worker was SIGKILLed while it trained
    victim: int  # that worker's pid

    def logs(self) -> str:
        """The tail of the submission's output and of each job's log, for a failure's message."""
        jobs = [f"{f}:\n{f.read_text()[-2000:]}" for f in sorted(self.folder.rglob("*_log.*"))]
        return "\n".join([self.done.stdout[-2000:], self.done.stderr[-2000:], *jobs])

    def job_logs(self) -> list[str]:
        """Each job's log (its worker's output and what submitit wrote of its end)."""
        return [f.read_text() + f.with_suffix(".out").read_text() for f in sorted(self.folder.rglob("*_log.err"))]


@pytest.fixture(scope="module")
def shared_study(
    tmp_path_factory: pytest.TempPathFactory,
    cache_dir: Path,
    postgres: Postgres,
    tracking_server: MlflowServer,
    cluster: Slurm | None,
) -> SharedStudy:
    """Two sweep workers submitted at once by `python -m src.cluster` (a SLURM job array when SLURM runs here, else
    submitit's local executor), the same command on a fresh database: one study of 10 trials. Once a trial trains,
    its worker is SIGKILLed, as a node dies: the other worker must fail that trial by its stopped heartbeat, queue
    its setting again and finish the study."""
    root = tmp_path_factory.mktemp("shared")
    storage = postgres.create_db("optuna_shared")  # empty: both workers create Optuna's tables at once
    # Two settings for ten trials: repeats are recorded as skipped at once, so asks come fast and often (where
    # a race would over-ask), and the suite stays within minutes on two cores.
    space = [
        "data.max_seq_length=choice(192,256)",
        "trainer.per_device_train_batch_size=choice(1)",  # PROBE's two batches would make it four settings
        "trainer.gradient_accumulation_steps=choice(1)",
        "trainer.group_by_length=choice(true)",
        "hydra.sweeper.enqueue_trials=[]",
        "hydra.sweeper.heartbeat_interval_s=1",
        "hydra.sweeper.grace_period_s=8",  # a live trial's heartbeat can lag seconds on two loaded cores
        "hydra.sweeper.retry_failed_trials=true",
        "hydra.sweeper.max_skips_in_a_row=0",  # the two settings measured, the repeats go on to n_trials
        "hydra.sweeper.trial_overrides=['trainer.max_steps=12']",  # still training when its worker dies
    ]
    args = sweep_args("shared", storage, 10, tracking_server, *space)
    env = {**worker_env(root, cache_dir, postgres, tracking_server), **(cluster.env if cluster else {})}
    submission = ["cluster=slurm", "cluster.mem_gb=1"] if cluster else ["cluster=local"]
    submission += ["cluster.workers=2", "cluster.gpus_per_node=0", "cluster.cpus_per_task=1"]
    command = [sys.executable, "-m", "src.cluster", *submission, "cluster.timeout_min=15", "cluster.wait=true", *args]
    started = time.time()
    out, err = root / "cluster.out", root / "cluster.err"
    with out.open("w") as o, err.open("w") as e:
        submit = subprocess.Popen(command, cwd=PROJECT_DIR, env=env, stdout=o, stderr=e)
    trials_dir = root / "sweeps" / "shared" / "trials"
    mine = None
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PGPASSWORD", postgres.password)
            deadline = time.time() + WORKER_S / 2
            while mine is None and time.time() < deadline and submit.poll() is None:
                time.sleep(0.5)
                if not trials_dir.exists():
                    continue  # no trial yet: the workers may still be making Optuna's tables
                running = load_study("shared", storage).get_trials(states=(TrialState.RUNNING,))
                # mid-trial: its process is training
                mine = next(
                    (t for t in running if '"training"' in _read(trials_dir / f"{t.number:03d}" / "progress.json")),
                    None,
                )
            assert mine is not None, (out.read_text() + err.read_text())[-3000:]
            # As if the victim ran on another node: only its stopped heartbeat can tell that it died.
            store = rdb(storage)
            mine_id = store.get_trial_id_from_study_id_trial_number(store.get_study_id_from_name("shared"), mine.number)
            store.set_trial_user_attr(mine_id, "worker.host", "another-node")
            os.kill(mine.user_attrs["worker.pid"], signal.SIGKILL)
        submit.wait(timeout=WORKER_S)
    finally:
        if submit.poll() is None:
            submit.kill()
    done = subprocess.CompletedProcess(command, submit.returncode, out.read_text(), err.read_text())
    folder = root / "sweeps" / "shared" / "cluster"
    return SharedStudy(
        "shared", storage, root, done, folder, cluster is not None, time.time() - started, mine.number,
        mine.user_attrs["worker.pid"],
    )  # fmt: skip


def test_two_workers_share_one_study_of_exactly_n_trials(
    shared_study: SharedStudy, postgres: Postgres, tracking_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = shared_study
    print(f"\ntwo workers, 10 trials, one worker killed mid-trial: {s.seconds:.0f}s")
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    trials = load_study(s.name, s.storage).get_trials()
    counted = [t for t in trials if t.number not in retried_numbers(trials)]
    assert len(counted) == 10 and sorted(t.number for t in trials) == list(range(len(trials))), s.logs()
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED) for t in trials)
    assert all(t.user_attrs["trial.status"] == "skipped" for t in trials if t.state == TrialState.PRUNED)  # repeats
    launched = [t for t in trials if t.user_attrs.get("trial.status") != "skipped"]
    assert len(launched) >= 3
    ok = [t for t in launched if t.number != s.killed]
    assert all(t.user_attrs["trial.status"] == "ok" for t in ok), [t.user_attrs for t in ok]
    # Both processes did the work (each asks as soon as its own slot frees).
    assert len({t.user_attrs["worker.pid"] for t in trials}) == 2
    # Trial logs of distinct numbers never collide, whichever worker ran them.
    assert len(list((s.root / "sweeps" / s.name / "trials").iterdir())) == len(launched)

    for k, v in tracking_server.env.items():
        monkeypatch.setenv(k, v)
    runs = mlflow_runs(tracking_server, s.name)
    assert_one_run_per_trial(trials, runs)
    # Artifacts go through the server (--serve-artifacts) into its artifact root, not into a local mlruns/.
    run_id = ok[0].user_attrs["mlflow_run_id"]
    from mlflow.tracking import MlflowClient

    assert "preflight.txt" in {a.path for a in MlflowClient(tracking_server.url).list_artifacts(run_id)}
    assert list(tracking_server.artifacts.rglob(f"{run_id}/artifacts/preflight.txt"))
    assert not (s.root / "mlruns").exists()


def test_a_worker_killed_mid_trial_is_failed_by_heartbeat_and_its_setting_retried(
    shared_study: SharedStudy, postgres: Postgres, tracking_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its stopped heartbeat seen by the other worker, its records saying it did not finish: failed as killed, its
    MLflow run KILLED, its setting queued again once and told (run again, or a repeat of the same setting measured
    meanwhile by the other worker: Optuna asks a setting again while it is still running elsewhere)."""
    s = shared_study
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    trials = load_study(s.name, s.storage).get_trials()
    killed = trials[s.killed]
    assert killed.state == TrialState.FAIL and failure_kind(killed) == "killed", killed.user_attrs
    assert retried_numbers(trials) == {s.killed}
    (retry,) = [t for t in trials if t.user_attrs.get("retry_of") == s.killed]
    assert retry.params == killed.params and retry.user_attrs["worker.pid"] != s.victim
    print(f"\ntrial {s.killed} killed mid-trial; its retry, trial {retry.number}: {retry.state.name}")
    if retry.state == TrialState.PRUNED:
        twin = int(re.search(r"as trial (\d+)", retry.user_attrs["skipped.reason"]).group(1))
        assert trials[twin].state == TrialState.COMPLETE and trials[twin].params == killed.params
    else:
        assert retry.state == TrialState.COMPLETE and retry.user_attrs["trial.status"] == "ok"
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    (survivor,) = [text for text in s.job_logs() if "the sweep worker exited with -9" not in text]
    assert f"trial {s.killed} was left running by a dead worker: failed (killed)" in survivor, s.logs()

    for k, v in tracking_server.env.items():
        monkeypatch.setenv(k, v)
    run = next(r for r in mlflow_runs(tracking_server, s.name) if r.info.run_id == killed.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["failure.kind"] == "killed"


def test_the_workers_were_submitted_through_submitit(
    shared_study: SharedStudy, postgres: Postgres, tracking_server: MlflowServer
) -> None:
    """`python -m src.cluster` submitted both workers (one SLURM job array when SLURM runs here), waited for them and
    said how each ended: one done, the killed one failed with its exit status; the pickles submitit wrote and the
    jobs' logs carry no credential: jobs get them from the environment."""
    s = shared_study
    assert s.done.returncode == 1, s.logs()
    assert s.done.stdout.count("done on") == 1, s.done.stdout
    # one worker failed, and the message (submitit's, with the job's traceback) says how its sweep process ended
    assert len([line for line in s.done.stderr.splitlines() if ": failed: " in line]) == 1, s.done.stderr[-3000:]
    assert "the sweep worker exited with -9" in s.done.stderr, s.done.stderr[-3000:]
    results = sorted(p.name for p in s.folder.rglob("*_result.pkl"))
    assert len(results) == 2
    if s.slurm:
        assert results[0].split("_")[0] == results[1].split("_")[0], "one SLURM job array"
    files = [f for f in s.folder.rglob("*") if f.is_file()]
    assert [f for f in files if f.name.endswith("_submitted.pkl")], "what submitit pickled is looked at"
    for f in files:
        assert postgres.password.encode() not in f.read_bytes()
        assert tracking_server.env["MLFLOW_TRACKING_PASSWORD"].encode() not in f.read_bytes()


def test_tracking_server_refuses_strangers_and_never_stores_a_password(
    shared_study: SharedStudy, postgres: Postgres, tracking_server: MlflowServer, tmp_path: Path
) -> None:
    api = f"{tracking_server.url}/api/2.0/mlflow/experiments/search?max_results=5"
    assert requests.get(api, timeout=30).status_code == 401
    user = tracking_server.env["MLFLOW_TRACKING_USERNAME"]
    password = tracking_server.env["MLFLOW_TRACKING_PASSWORD"]
    assert requests.get(api, auth=(user, password + "x"), timeout=30).status_code == 401
    assert requests.get(api, auth=(user, password), timeout=30).status_code == 200

    # Report and promotion read the same study and runs through the server.
    env = {**postgres.env, **tracking_server.env}
    where = ["--storage", shared_study.storage, "--tracking-uri", tracking_server.url]
    done = run_cli("src.report", shared_study.name, *where, root=shared_study.root, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    production = tmp_path / "production.yaml"
    done = run_cli(
        "src.promote",
        shared_study.name,
        *where,
        "--allow-unsoaked",
        "--experiment-file",
        str(production),
        root=shared_study.root,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert production.exists()

    # Neither password, nor the Basic header carrying one, is anywhere: the server's databases (runs, params,
    # tags, users), its artifacts and log, the study folder (trial logs, Hydra configs, report), the workers'
    # output.
    secrets = {
        "MLflow password": password,
        "MLflow Basic header": base64.b64encode(f"{user}:{password}".encode()).decode(),
        "PostgreSQL password": postgres.password,
    }
    texts = {db: postgres.dump(db) for db in ("mlflow", "mlflow_auth", "optuna_shared")}
    texts["report/promote output"] = done.stdout + done.stderr
    assert "\tsweeper\t" in texts["mlflow_auth"] and f"\t{shared_study.name}\t" in texts["mlflow"]  # dumps hold rows
    files = [
        *tracking_server.artifacts.rglob("*"),
        tracking_server.log,
        *shared_study.root.rglob("*"),
        production,
    ]
    scanned = [f for f in files if f.is_file()]
    assert len(scanned) > 50
    for what, secret in secrets.items():
        assert not [name for name, text in texts.items() if secret in text], what
        assert not [str(f) for f in scanned if secret.encode() in f.read_bytes()], what


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# ---- the cluster command ------------------------------------------------------------------------------------


def test_cluster_refuses_credentials_on_the_command_line(root: Path) -> None:
    done = run_cli(
        "src.cluster",
        "cluster=local",
        "hydra.sweeper.storage=postgresql://sweeper:hunter2hunter2@db:5432/optuna",
        root=root,
        timeout=120,
    )
    assert done.returncode != 0 and "refusing to submit credentials" in done.stderr
    assert "hunter2hunter2" not in done.stdout + done.stderr


def test_every_cluster_config_composes() -> None:
    from src.cluster import CLUSTER_DIR, load_cluster

    for path in CLUSTER_DIR.glob("*.yaml"):
        cfg = load_cluster(path.stem, [])
        assert cfg.executor == path.stem and cfg.workers >= 1


# ---- the database's connections (after every test above, in file order) ---------------------------------------


def test_the_scale_out_tests_hold_few_database_connections_at_once(postgres: Postgres) -> None:
    """The most client connections the tests' PostgreSQL held at once, sampled all along (tests/services.py),
    stays within CONNECTION_BUDGET, far under its max_connections. A storage opened per poll keeps its pooled
    connection open: a poll loop once held one connection per poll, and on a loaded machine, where trials are
    slower and polls more numerous, ran out of them ("FATAL: sorry, too many clients already")."""
    watch = postgres.watch
    print(f"\npeak: {watch.peak} connections of max_connections={watch.max_connections}: {watch.at_peak}")
    assert watch.peak <= CONNECTION_BUDGET, watch.at_peak
    assert watch.max_connections >= 3 * CONNECTION_BUDGET, "room for a loaded machine's lingering backends"


# ---- figures (opt-in: QLORA_SCALE_OUT_FIGURES=1) -------------------------------------------------------------


@pytest.mark.skipif(not os.environ.get("QLORA_SCALE_OUT_FIGURES"), reason="figures for the notes, minutes long")
def test_scale_out_figures(
    tmp_path: Path, cache_dir: Path, postgres: Postgres, tracking_server: MlflowServer, monkeypatch
) -> None:
    """Prints (1) the recording latency per trial (the engine's storage and MLflow calls plus what a trial process
    sends to MLflow, training left out) on each backend, (2) the engine's scaling from one worker to two when
    trials leave the CPU idle (as GPU trials do), (3) the wall time of the same six real CPU trials with one
    worker on each backend and with two workers."""
    import threading

    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from src import tracking
    from src.config import to_container
    from src.sweep.process import Outcome
    from tests.services import start_mlflow_server

    monkeypatch.setenv("QLORA_ROOT", str(tmp_path))
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    composed = compose_cfg(["trainer.output_dir=/tmp/unused"])
    params = tracking.params(to_container(OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])))
    sleep_s = 0.0

    def recording_only(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        """What a trial process sends to MLflow (src/trial/), and `sleep_s` where the training would be."""
        client, run_id = MlflowClient(), env["MLFLOW_RUN_ID"]
        client.update_run(run_id, status="RUNNING")
        tracking.log_params(client, run_id, params)
        tracking.set_tags(client, run_id, {f"tag.{i}": "x" * 20 for i in range(20)})
        tracking.log_text(client, run_id, "preflight\n" * 200, "preflight.txt")
        time.sleep(sleep_s)
        heartbeat()
        tracking.log_metrics(client, run_id, {f"metric_{i}": float(i) for i in range(25)})
        tracking.set_tags(client, run_id, {"trial.status": "ok"})
        client.set_terminated(run_id, "FINISHED")
        return Outcome("ok", metrics={"tokens_per_s": 1.0, "peak_vram_reserved_gib": 1.0})

    monkeypatch.setattr("src.sweep.launch.run_process", recording_only)
    monkeypatch.setattr("src.sweep.prepare.build_model", lambda *a: None)

    def engine(study: str, n: int, *extra: str) -> SweepEngine:
        cfg = compose_cfg(
            ["hydra/sweeper=optuna", "sweep=demo", f"hydra.sweeper.study_name={study}", f"hydra.sweeper.n_trials={n}"]
            + ["hydra.sweeper.cpu_slots=1", "hydra.sweeper.progress=false", "hydra.sweeper.skip_duplicates=false"]
            + ["hydra.sweeper.enqueue_trials=[]", "hydra.sweeper.preload=false", "trainer.output_dir=/tmp/unused"]
            + list(extra)
        )
        return SweepEngine(cfg, [])

    no_auth = start_mlflow_server(tmp_path / "srv-open", postgres.create_db("mlflow_open"), postgres.env)
    uncached = start_mlflow_server(  # MLflow's default: the password's scrypt hash checked on every request
        tmp_path / "srv-uncached",
        postgres.create_db("mlflow_uncached"),
        postgres.env,
        auth_db_uri=postgres.create_db("mlflow_uncached_auth"),
        users={"sweeper": tracking_server.env["MLFLOW_TRACKING_PASSWORD"]},
    )
    try:
        n = 20
        pg = lambda: f"hydra.sweeper.storage={postgres.create_db(f'optuna_{time.time_ns()}')}"  # noqa: E731
        backends = {
            "sqlite + mlruns/": ([], {}),
            "postgres + mlruns/": ([pg()], {}),
            "postgres + server": ([pg(), f"tracking.uri={no_auth.url}"], {}),
            "postgres + server, basic auth": ([pg(), f"tracking.uri={uncached.url}"], uncached.env),
            "postgres + server, basic auth cached 60 s": (
                [pg(), f"tracking.uri={tracking_server.url}"],
                tracking_server.env,
            ),
        }
        per_trial: dict[str, float] = {}
        engine("warm-up", 2).run()  # mlruns/'s database is created and migrated once, outside the figures
        for i, (label, (extra, creds)) in enumerate(backends.items()):
            for k, v in creds.items():
                monkeypatch.setenv(k, v)
            e = engine(f"latency{i}", n, *extra)
            started = time.time()
            e.run()
            per_trial[label] = (time.time() - started) / n
        latency_trials = n
        base = per_trial["sqlite + mlruns/"]
        print(f"\nrecording per trial ({n} trials, training left out), on 2 cores:")
        for label, seconds in per_trial.items():
            print(f"  {label:44s} {seconds * 1000:6.0f} ms  (+{(seconds - base) * 1000:.0f} ms)")

        # Scaling of the engine itself: trials that leave the CPU idle for 3 s, like GPU trials.
        sleep_s, n = 3.0, 12
        walls = {}
        for workers in (1, 2):
            storage = pg()
            engines = [
                engine(f"scale{workers}", n, storage, f"tracking.uri={tracking_server.url}") for _ in range(workers)
            ]
            started = time.time()
            threads = [threading.Thread(target=e.run) for e in engines]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            walls[workers] = time.time() - started
        print(f"{n} GPU-like trials of {sleep_s:g} s: 1 worker {walls[1]:.1f} s, 2 workers {walls[2]:.1f} s")
    finally:
        no_auth.stop()
        uncached.stop()
    monkeypatch.undo()

    # The same six settings (a grid) as real CPU trials.
    grid = ["hydra/sweeper/sampler=grid", "data.max_seq_length=choice(192,256,512)", "lora.r=choice(4,8)"]
    grid += ["trainer.gradient_accumulation_steps=choice(1)", "trainer.group_by_length=choice(true)"]
    grid += ["hydra.sweeper.enqueue_trials=[]", "hydra.sweeper.skip_duplicates=false"]
    runs = {
        "1 worker, sqlite + mlruns/": (1, False),
        "1 worker, postgres + server": (1, True),
        "2 workers, postgres + server": (2, True),
    }
    real: dict[str, float] = {}
    for i, (label, (workers, server)) in enumerate(runs.items()):
        root = tmp_path / f"real{i}"
        root.mkdir()
        if server:
            args = sweep_args(f"real{i}", postgres.create_db(f"optuna_real{i}"), 6, tracking_server, *grid)
        else:
            args = [
                *PROBE,
                f"hydra.sweeper.study_name=real{i}",
                "hydra.sweeper.n_trials=6",
                "hydra.sweeper.cpu_slots=1",
            ]
            args += grid
        env = worker_env(root, cache_dir, postgres, tracking_server)
        started = time.time()
        procs = [start_worker(args, env, root / f"w{w}.log") for w in range(workers)]
        assert [p.wait(timeout=900) for p in procs] == [0] * workers
        real[label] = time.time() - started
    print("six real trials (tiny Llama, 4 steps) on 2 cores (CPU-bound: two workers share the same two cores):")
    for label, seconds in real.items():
        print(f"  {label:44s} {seconds:5.0f} s")
    out = os.environ["QLORA_SCALE_OUT_FIGURES"]
    if out.endswith(".json"):  # QLORA_SCALE_OUT_FIGURES=benchmarks/results/scale_out_cpu.json: the figures on file
        import platform

        import mlflow

        Path(out).write_text(
            json.dumps(
                {
                    "command": f"QLORA_SCALE_OUT_FIGURES={out} pytest -s -k figures tests/test_scale_out.py",
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "versions": {"optuna": optuna.__version__, "mlflow": mlflow.__version__},
                    "recording_per_trial_ms": {k: round(v * 1000, 1) for k, v in per_trial.items()},
                    "recording_note": f"{latency_trials} trials per backend; what the engine and a trial send, training left out",
                    "gpu_like_trials": {
                        "trials": n,
                        "each_s": sleep_s,
                        "wall_s": {f"{k} worker(s)": round(v, 1) for k, v in walls.items()},
                    },
                    "real_cpu_trials_wall_s": {k: round(v, 1) for k, v in real.items()},
                },
                indent=2,
            )
            + "\n"
        )
