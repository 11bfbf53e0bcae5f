"""A single run that survives its process's faults: `python -m src.train` (experiment=production included; never a
sweep's probe) is one MLflow run whose training happens in attempts (src/trial/attempts.py), each a fresh process
started by torch's elastic agent (the launcher that also starts data-parallel trials), each continuing from the
last checkpoint.

- The agent restarts an attempt that exits non-zero, up to `checkpoint.max_restarts` times. An attempt decides
  (`attempts.stop_reason`) whether its failure is the process's (launch failure, illegal address, device assert, cuBLAS,
  NCCL, a kill, a segfault, a hang: worth a fresh process) or the setting's (an OOM at the same step twice, a NaN
  loss, a data or config error, a full disk: a restart would fail the same way), and in the second case records
  it and exits 0, so that the agent restarts nothing. An attempt that dies without a word (a signal) is the
  process's; the agent's record of its exit code says which kind (`_Deaths`).
- A hang: the supervisor watches the attempt's progress file and kills an attempt with no step (or start-up phase)
  for `checkpoint.stall_timeout_s`; the agent then restarts it.
- The run's folder (`src/checkpoints.py`) holds its ledger: the MLflow run, every attempt and checkpoint. The same
  command after the machine itself died finds it and continues; `checkpoint.resume=false` starts over.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from src import checkpoints as ck
from src import redact, stores, tracking
from src.handoff import PROGRESS_FILE, RESULT_FILE, RUN_ENV
from src.trial.attempts import RUN_DIR_ENV

# ---- the supervisor (the parent's side) -------------------------------------------------------------------------------


def supervise(cfg: DictConfig, out_dir: Path, argv: list[str]) -> dict[str, Any]:
    """The run: find or start its folder and MLflow run, train it in attempts under the elastic agent, and record
    the whole of it on one MLflow run. Returns the outcome (also written to result.json)."""
    stores.require(stores.of_trial(cfg))
    problems = ck.problems(cfg) + _secrets(cfg)
    if problems:  # before the run's folder or MLflow run is made (a token in tracking.experiment would name both)
        print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
        sys.exit(2)
    folder = ck.run_dir(cfg)
    if not cfg.checkpoint.resume and (aside := ck.start_over(folder)) is not None:
        print(f"checkpoint.resume=false: starting over; the run's earlier folder is now {aside}", flush=True)
    ledger = ck.Ledger(folder)
    refused = _refuse(cfg, ledger, folder)
    if refused is not None:
        print(refused, file=sys.stderr)
        sys.exit(2)
    if ledger.data.get("recorded"):
        return _already_done(ledger, folder)
    client, run_id = _open(cfg, ledger, folder, argv)
    if ledger.data.get("completed"):  # trained, but its supervisor died before it was recorded: record it now
        return _record(cfg, ledger, folder, client, run_id, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ[RUN_DIR_ENV], os.environ[RUN_ENV] = str(folder), run_id
    every = (
        f"every {cfg.trainer.save_steps} steps"
        if cfg.trainer.save_steps
        else f"every {cfg.checkpoint.every_minutes:g} min of training"
    )
    print(
        f"run {folder} (MLflow run {run_id}): checkpoints {every}, up to {cfg.checkpoint.max_restarts} restarts",
        flush=True,
    )
    deaths = _Deaths(ledger, out_dir)
    watch = _Stall(ledger, out_dir, float(cfg.checkpoint.stall_timeout_s))
    watch.start()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        _launch(cfg, argv, out_dir)
    except (KeyboardInterrupt, SignalException) as stopped:  # the agent turns SIGINT/SIGTERM into SignalException
        deaths.interrupted(str(stopped) or "SIGINT")
    finally:
        watch.stop()
        deaths.close()
    ledger.reload()
    return _record(cfg, ledger, folder, client, run_id, out_dir)


# The keys a run names things after before its attempt's preflight runs: a credential there would be written into
# the store as an experiment's name or onto the disk as a folder's. Others are refused by the attempt's preflight,
# which records the refusal (redacted) on the run.
_NAMING_KEYS = ("tracking.experiment", "tracking.registered_model", "checkpoint.dir", "model.name")


def _secrets(cfg: DictConfig) -> list[str]:
    """A credential in a key the run names something after, refused before anything is named."""
    from omegaconf import OmegaConf

    found = (redact.refusal(key, OmegaConf.select(cfg, key, default=None)) for key in _NAMING_KEYS)
    return [why for why in found if why]


def _refuse(cfg: DictConfig, ledger: ck.Ledger, folder: Path) -> str | None:
    """An explicit checkpoint.dir that holds another setting's run is not continued with this one."""
    recorded = ledger.data.get("fingerprint")
    if recorded and recorded != ck.fingerprint(cfg):
        return (
            f"error: checkpoint.dir={folder} holds a run of other settings (fingerprint {recorded}, this command's "
            f"{ck.fingerprint(cfg)}): continuing it with these would not train the same model. Run it with the "
            "settings it was started with, give this one another checkpoint.dir, or start over there with "
            "checkpoint.resume=false"
        )
    return None


def _already_done(ledger: ck.Ledger, folder: Path) -> dict[str, Any]:
    run_id = ledger.data.get("run_id", "")
    print(
        f"this run finished on {ledger.data['completed']} (MLflow run {run_id}); its adapter: {folder / ck.ADAPTER}. "
        "To train it again from the start: the same command with checkpoint.resume=false",
        flush=True,
    )
    return {
        "status": "ok",
        "run_id": run_id,
        "metrics": ledger.data.get("metrics", {}),
        "failure": None,
        "already": True,
    }


def _open(cfg: DictConfig, ledger: ck.Ledger, folder: Path, argv: list[str]) -> tuple[Any, str]:
    """The run's MLflow run: the one its ledger names (RUNNING again), or a new one named after the folder."""
    from mlflow.tracking import MlflowClient

    tracking.setup(cfg.tracking.uri)
    client = MlflowClient()
    run_id = ledger.data.get("run_id")
    if run_id:
        client.update_run(run_id, status="RUNNING")
    else:
        exp = tracking.experiment_id(cfg.tracking.experiment, str(Path(cfg.paths.mlruns_dir) / "artifacts"))
        name = f"{folder.name}-{time.strftime('%m%d-%H%M')}"
        run_id = client.create_run(exp, tags={"mlflow.runName": name}).info.run_id
        ledger.data.update(
            run_id=run_id,
            fingerprint=ck.fingerprint(cfg),
            created=ck.now_iso(),
            command=redact.redact_text(" ".join(["python -m src.train", *argv])),
        )
    tracking.set_tags(client, run_id, {"run.kind": "trial", "checkpoint.dir": str(folder)})
    dead = ledger.open_attempt()
    if dead is not None:  # the machine (or the whole run) died: nothing recorded its end
        _died(dead, "killed", "the run's processes died without a record (the machine, or a kill of the run)", None)
        print(f"attempt {dead['attempt']} ended without a record; continuing the run", flush=True)
    ledger.save()
    return client, run_id


def _launch(cfg: DictConfig, argv: list[str], out_dir: Path) -> None:
    """The attempts, by torch's elastic agent: one process, restarted on a non-zero exit."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=int(cfg.checkpoint.max_restarts),
        monitor_interval=0.5,
    )
    worker = ["-m", "src.train", *argv, f"hydra.run.dir={out_dir}"]
    with contextlib.suppress(ChildFailedError):  # the last attempt's outcome is in the ledger
        elastic_launch(config, sys.executable)(*worker)


def _died(entry: dict[str, Any], kind: str, message: str, step: int | None) -> None:
    entry.update(
        ended=time.time(),
        status="failed",
        failure={"kind": kind, "message": message, "step": step, "rank": None},
        stop=None,
    )


class _Deaths(logging.Handler):
    """The agent's record of each attempt that failed ("failed (exitcode: N) ... (pid: P)"): an attempt that died
    without recording its own end gets its failure from the exit code (a signal, a segfault)."""

    _LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self, ledger: ck.Ledger, out_dir: Path) -> None:
        super().__init__(logging.ERROR)
        self.ledger, self.out_dir = ledger, out_dir
        log = logging.getLogger(self._LOGGER)
        self.propagated, log.propagate = log.propagate, False  # said in our words instead (emit)
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("failed (exitcode") or not record.args:
            return
        code, pid = int(record.args[0]), int(record.args[2])  # type: ignore[index]
        from src.failures import classify_exit

        with self.ledger.changing() as ledger:
            entry = next((a for a in ledger.attempts if a.get("pid") == pid), None)
            if entry is None or "ended" in entry:
                return  # it recorded its own end
            progress = _progress(self.out_dir)
            stalled = entry.get("stalled")
            kind = "timeout" if stalled else classify_exit(code)
            message = stalled or f"the attempt's process exited with {code} without a record"
            _died(entry, kind, message, progress.get("step", 0) + 1 if progress.get("phase") == "training" else None)
            entry["ended"] = max(entry["launched"], progress.get("time", entry["ended"]))  # its last sign of life
        f = entry["failure"]
        print(f"attempt {entry['attempt']} failed ({f['kind']} at step {f['step']}): {message}", flush=True)

    def interrupted(self, how: str) -> None:
        with self.ledger.changing() as ledger:
            entry = ledger.open_attempt()
            if entry is not None:
                why = f"interrupted ({how}): the same command continues from the last checkpoint"
                _died(entry, "killed", why, None)

    def close(self) -> None:
        log = logging.getLogger(self._LOGGER)
        log.removeHandler(self)
        log.propagate = self.propagated
        super().close()


class _Stall(threading.Thread):
    """Kills an attempt that made no progress for `timeout_s` (no step; before its first, nothing since its launch or
    since its model began loading); the agent restarts it."""

    def __init__(self, ledger: ck.Ledger, out_dir: Path, timeout_s: float) -> None:
        super().__init__(daemon=True, name="stall-watch")
        self.ledger, self.out_dir, self.timeout_s = ledger, out_dir, timeout_s
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            try:
                self._look()
            except Exception as exc:  # noqa: BLE001 - a bad read is no reason to stop watching
                print(f"stall watch: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def _look(self) -> None:
        entry = ck.Ledger(self.ledger.path.parent).open_attempt()
        if entry is None or "stalled" in entry:
            return
        progress = _progress(self.out_dir)
        if time.time() - max(entry["launched"], progress.get("time", 0.0)) <= self.timeout_s:
            return
        with ck.Ledger(self.ledger.path.parent).changing() as ledger:
            open_entry = ledger.open_attempt()
            if open_entry is None or open_entry["pid"] != entry["pid"]:
                return
            where = f"at step {progress.get('step', 0) + 1}" if progress.get("phase") == "training" else "in start-up"
            open_entry["stalled"] = (
                f"no progress for {self.timeout_s:g} s {where} (checkpoint.stall_timeout_s): a hang, killed"
            )
        print(f"attempt {entry['attempt']}: {open_entry['stalled']}", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry["pid"], signal.SIGKILL)

    def stop(self) -> None:
        self.done.set()


def _progress(out_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((out_dir / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return {}


# ---- the record ---------------------------------------------------------------------------------------------------------


def summary(ledger: ck.Ledger) -> dict[str, float]:
    """The run's resilience figures from its ledger: restarts, the time each failure cost, the checkpoints' cost."""
    attempts = ledger.attempts
    m: dict[str, float] = {"restarts": float(max(0, len(attempts) - 1)), "attempts": float(len(attempts))}
    lost = redone = 0.0
    for this, after in zip(attempts, attempts[1:], strict=False):
        this_redone = _redone_s(this, ledger.checkpoints)
        startup = after["train_began"] - after["launched"] if "train_began" in after else 0.0
        this["redone_s"], this["lost_s"] = this_redone, this_redone + startup
        redone, lost = redone + this_redone, lost + this_redone + startup
    m["lost_s"], m["redone_s"] = lost, redone
    training = sum(max(0.0, a["ended"] - a["train_began"]) for a in attempts if "train_began" in a and "ended" in a)
    saves = ledger.checkpoints
    m["checkpoint.count"] = float(len(saves))
    if saves:
        m["checkpoint.save_s"] = sum(s["save_s"] for s in saves)
        m["checkpoint.size_mib"] = saves[-1]["size_bytes"] / 2**20
        if training > 0:
            m["checkpoint_overhead_frac"] = m["checkpoint.save_s"] / training
    m["training_s"] = training
    return m


def _redone_s(attempt: dict[str, Any], saves: list[dict[str, Any]]) -> float:
    """The training an attempt did that its failure threw away: from its last committed checkpoint (or the start of
    its training) to its end."""
    began = attempt.get("train_began")
    if began is None or "ended" not in attempt:
        return 0.0
    commits = [s["at_s"] for s in saves if began <= s.get("at_s", 0.0) <= attempt["ended"]]
    return max(0.0, attempt["ended"] - max([began, *commits]))


def _record(
    cfg: DictConfig, ledger: ck.Ledger, folder: Path, client: Any, run_id: str, out_dir: Path
) -> dict[str, Any]:
    """The run's outcome on its MLflow run: each attempt (tags attempt.<n>.*, metrics by attempt), the totals, the
    ledger as an artifact; the adapter's registration; result.json; the run ended."""
    from src import record as rec

    with ledger.changing():
        m = summary(ledger)
        ledger.data["metrics"] = m
    tags: dict[str, Any] = {}
    for a in ledger.attempts:
        n, f = a["attempt"], a.get("failure") or {}
        tags[f"attempt.{n}.status"] = a.get("status", "running")
        tags[f"attempt.{n}.resumed_from_step"] = a.get("resumed_from_step", 0)
        if f:
            tags.update({f"attempt.{n}.failure.{k}": f.get(k) for k in ("kind", "step", "message")})
        if a.get("stop"):
            tags[f"attempt.{n}.stop"] = a["stop"]
        for key in ("lost_s", "redone_s"):
            if key in a:
                tracking.log_metrics(client, run_id, {f"attempt_{key}": a[key]}, step=n)
    tracking.log_metrics(client, run_id, m)
    last = ledger.attempts[-1] if ledger.attempts else {}
    completed = bool(ledger.data.get("completed"))
    failure = (
        None if completed else (last.get("failure") or {"kind": "other", "message": "no attempt ran", "step": None})
    )
    if failure is not None and last.get("stop") is None and len(ledger.attempts) > cfg.checkpoint.max_restarts:
        failure = {**failure, "message": f"{failure.get('message')} (after {int(m['restarts'])} restarts)"}
    tags.update(rec.outcome_tags("ok" if completed else "failed", failure))
    if completed:  # an attempt's failure tags give way to the run's outcome (attempt.<n>.failure.* keep them)
        for key in [k for k in client.get_run(run_id).data.tags if k.startswith(rec.FAILURE)]:
            client.delete_tag(run_id, key)
    tracking.set_tags(client, run_id, tags)
    tracking.log_text(client, run_id, json.dumps(ledger.data, indent=2), "run.json")
    if completed and cfg.tracking.registered_version is not None:
        version = tracking.register_adapter(
            client, cfg.tracking.registered_model, int(cfg.tracking.registered_version), run_id
        )
        if version is not None:
            print(f"registered its adapter: {cfg.tracking.registered_model} version {version}", flush=True)
    client.set_terminated(run_id, "FINISHED" if completed else "FAILED")
    status = "ok" if completed else "failed"
    last_result = _read(out_dir / RESULT_FILE)
    metrics = {**last_result.get("metrics", {}), **m}
    result = {**last_result, "status": status, "run_id": run_id, "metrics": metrics, "failure": failure}
    result["run_dir"], result["stop"] = str(folder), last.get("stop")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    if completed:
        with ledger.changing():
            ledger.data["recorded"] = ck.now_iso()  # the same command now says the run is done, and trains nothing
    return result


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
