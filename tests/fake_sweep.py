"""A sweep process whose trials are stand-ins (no model), for tests that kill, interrupt or starve the sweep process
itself and then run it again:

    python -m tests.fake_sweep [overrides...]      # QLORA_ROOT and QLORA_CACHE as for python -m src.train

Each stand-in trial records itself as a real one does (src/trial/single.py: its MLflow run's metrics and tags,
result.json, then the run ended FINISHED). QLORA_FAKE_FAULT=<fault>@<trial number> strikes once that trial has
recorded itself, before the engine tells Optuna: `sigkill` or `sigterm` the sweep process, or `disk_full`: every
write to the Optuna storage fails from then on, as SQLite fails on a full disk (`mlflow_full`: to the MLflow store;
`everything_full`: to both, through SQLAlchemy, so that MLflow logs each failed write as it does on a real full
disk); or `server_down`: the MLflow server whose process group is QLORA_FAKE_SERVER_PID is killed (the tracking
server dying mid-sweep). `sigterm@soak` strikes while a soak runs, before it records anything: the stand-in then ends
as a watched process ends when the sweep stops; QLORA_FAKE_HOLD=<trial number> makes that trial such a stand-in,
running until the sweep stops.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

FAULT_ENV = "QLORA_FAKE_FAULT"
HOLD_ENV = "QLORA_FAKE_HOLD"
_WRITES = ("set_trial_user_attr", "set_trial_system_attr", "set_trial_state_values", "record_heartbeat")


def trial(overrides: list[str], log_dir: Path, env: dict, sweeper: Any, heartbeat: Any = None) -> Any:
    from mlflow.tracking import MlflowClient

    from src import tracking
    from src.handoff import RESULT_FILE, RUN_ENV, TRIAL_ENV
    from src.record import STOPPED_WHILE
    from src.sweep.process import Outcome
    from src.sweep.stop import stopping

    label, run_id = env[TRIAL_ENV], env[RUN_ENV]
    fault, _, at = os.environ.get(FAULT_ENV, "").partition("@")
    held = label == os.environ.get(HOLD_ENV)
    if held or (label.startswith("soak-") and (fault, at) == ("sigterm", "soak")):
        if not held:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stopping.wait(60), "the sweep stops"
        stopping.count_stopped()  # as src/sweep/process.py records a process it ended for the stop
        failure = {"kind": "killed", "message": f"{stopping.reason}{STOPPED_WHILE}", "step": None}
        return Outcome("failed", failure=failure, recorded=False, log_dir=log_dir)
    number = int(label.removeprefix("soak-"))
    metrics = {"tokens_per_s": 100.0 + number, "peak_vram_reserved_gib": 8.0, "vram_budget_gib": 24.0}
    client = MlflowClient()
    client.update_run(run_id, status="RUNNING")
    tracking.log_metrics(client, run_id, metrics)
    tracking.set_tags(client, run_id, {"trial.status": "ok"})
    log_dir.mkdir(parents=True, exist_ok=True)
    result = {"status": "ok", "run_id": run_id, "metrics": metrics, "failure": None, "attention_kernel": None}
    (log_dir / RESULT_FILE).write_text(json.dumps(result))
    client.set_terminated(run_id, "FINISHED")
    if at.isdigit() and int(at) == number and not label.startswith("soak-"):
        if fault in ("sigkill", "sigterm"):
            os.kill(os.getpid(), getattr(signal, fault.upper()))
        elif fault == "disk_full":
            _fill_the_disk()
        elif fault in ("mlflow_full", "everything_full"):
            _fill_the_disk_under_sqlalchemy(only="mlflow.db" if fault == "mlflow_full" else "")
        elif fault == "server_down":
            _kill_the_server(int(os.environ["QLORA_FAKE_SERVER_PID"]))
    return Outcome("ok", metrics=metrics)


def _kill_the_server(pid: int) -> None:
    import socket
    import time
    from urllib.parse import urlparse

    import mlflow

    os.killpg(pid, signal.SIGKILL)
    where = urlparse(mlflow.get_tracking_uri())
    for _ in range(200):  # gone once its port refuses
        try:
            socket.create_connection((where.hostname, where.port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.05)


def _fill_the_disk() -> None:
    import optuna
    import sqlalchemy

    def full(*_: Any, **__: Any) -> None:
        error = sqlite3.OperationalError("database or disk is full")
        raise sqlalchemy.exc.OperationalError("UPDATE trials SET ...", {}, error)

    for name in _WRITES:
        setattr(optuna.storages.RDBStorage, name, full)


def _fill_the_disk_under_sqlalchemy(only: str) -> None:
    """Every write through SQLAlchemy to a SQLite file whose name ends with `only` fails from now on, as SQLite's
    does on a full disk (the error is raised where the driver would raise it, so MLflow handles and logs it)."""
    import sqlalchemy
    from sqlalchemy import event

    def full(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        writes = statement.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE")
        if writes and str(conn.engine.url.database or "").endswith(only):
            raise sqlite3.OperationalError("database or disk is full")

    event.listen(sqlalchemy.engine.Engine, "before_cursor_execute", full)


def engine(overrides: list[str]) -> Any:
    """The sweep engine the command runs, on the command's config. Its trials are `trial` once `main` put the
    stand-ins in place (a test that runs it in its own process patches them in for the test's duration)."""
    from src.config import compose
    from src.sweep.engine import SweepEngine

    cfg = compose(
        [
            "hydra/sweeper=optuna",
            "hydra.sweeper.cpu_slots=1",
            "hydra.sweeper.progress=false",
            "hydra.sweeper.soak_top_k=0",  # stand-in trials: nothing to soak
            "hydra.sweeper.preload=false",  # ...and no forkserver to start
            "hydra.sweeper.skip_duplicates=false",
            "hydra.sweeper.enqueue_trials=[]",
            "trainer.output_dir=/tmp/unused",
            *overrides,
        ],
        hydra_config=True,
    )
    return SweepEngine(cfg, ["lora.r=choice(4,8,16)"])


def main(overrides: list[str]) -> None:
    from src.sweep import launch, prepare

    launch.run_process = trial
    prepare.build_model = lambda *a: None  # stand-in trials: no model to build
    engine(overrides).run()


if __name__ == "__main__":
    main(sys.argv[1:])
