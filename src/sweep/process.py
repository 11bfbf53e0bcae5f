"""One trial's process: `python -m src.train <overrides>` (or a fork of a warm interpreter) in a session of its
own, watched for the time limit, for steps that stop coming and for the sweep stopping (src/sweep/stop.py), and
how it ended, read from the trial's own result file or, when it died without one, from its exit code and the
tail of its stderr.

A fresh interpreter is started with `start_new_session`, not a `preexec_fn` (which can deadlock a child forked
from a threaded parent: the engine runs one thread per slot); it asks for its parent-death signal itself, first
thing (src/handoff.py `die_with_parent`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from src import record
from src.failures import classify_exit, first_line
from src.handoff import PARENT_ENV, PROGRESS_FILE, RESULT_FILE, STARTED_ENV
from src.record import Outcome
from src.redact import redact_text
from src.sweep import launcher
from src.sweep.stop import stopping

__all__ = ["Outcome", "recorded_outcome", "run_process", "start_launcher", "stop_process_group", "tail"]


def tail(path: Path, limit: int = 20000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_process(
    overrides: list[str], log_dir: Path, env: dict[str, str], sweeper: DictConfig, heartbeat: Any = None
) -> Outcome:
    """Run `python -m src.train overrides` in `log_dir`, watch it, and say how it ended."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for stale in (RESULT_FILE, PROGRESS_FILE):
        (log_dir / stale).unlink(missing_ok=True)
    argv = [*overrides, f"hydra.run.dir={log_dir}"]
    cmd = [sys.executable, "-m", "src.train", *argv]
    (log_dir / "command.txt").write_text(redact_text(" ".join(cmd)) + "\n")
    extra_env = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **env}
    preload = _preload_modules(sweeper.get("preload"))
    ctx = launcher.forkserver(preload) if preload else None
    started = time.time()
    extra_env[STARTED_ENV] = repr(started)  # the trial's start-up is counted from here (src/measure/)
    how = "forkserver" if ctx is not None else "interpreter"
    if stopping.is_set():  # asked as the sweep stopped: not launched
        return _stopped(log_dir, how, None)
    timed_out = interrupted = False
    with (log_dir / "stdout.log").open("wb") as out, (log_dir / "stderr.log").open("wb") as err:
        if ctx is not None:  # forked from the warm interpreter: no imports to pay (src/sweep/launcher.py)
            proc: Any = launcher.start(ctx, argv, log_dir / "stdout.log", log_dir / "stderr.log", extra_env)
        else:
            extra_env[PARENT_ENV] = str(os.getpid())  # the trial dies with this process (handoff.die_with_parent)
            env = {**os.environ, **extra_env}
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            last_beat = 0.0
            while proc.poll() is None:
                time.sleep(0.2)
                now = time.time()
                if heartbeat and now - last_beat >= sweeper.heartbeat_interval_s:
                    heartbeat()
                    last_beat = now
                progress = read_json(log_dir / PROGRESS_FILE)
                # No step for stall_timeout_s; before the first, nothing for startup_timeout_s since the launch or
                # since the model began loading (a trial hung in start-up holds its slot no longer than that).
                training = progress.get("phase") == "training"
                key = "stall_timeout_s" if training else "startup_timeout_s"
                limit = float(sweeper.get(key) or sweeper.stall_timeout_s)
                stalled = now - max(started, progress.get("time", 0.0)) > limit
                if stopping.is_set():
                    interrupted = True
                    stop_process_group(proc)
                elif now - started > sweeper.trial_timeout_s or stalled:
                    timed_out = True
                    where = "without a step" if training else "without progress in start-up"
                    why = (
                        f"{limit:g}s {where}, hydra.sweeper.{key}"
                        if stalled
                        else (f"hydra.sweeper.trial_timeout_s={sweeper.trial_timeout_s:g}")
                    )
                    stop_process_group(proc)
        except BaseException:  # the watch itself failed (a store that takes no heartbeat): no trial left behind
            stop_process_group(proc)
            raise
    result = recorded_outcome(log_dir, launcher=how)
    if result and not timed_out:
        return result  # finished, even if the sweep stopped meanwhile: what it measured stands
    if interrupted:
        return _stopped(log_dir, how, read_json(log_dir / PROGRESS_FILE))
    stderr = tail(log_dir / "stderr.log")
    progress = read_json(log_dir / PROGRESS_FILE)
    kind = classify_exit(proc.returncode, stderr, timed_out=timed_out)
    step = progress.get("step", 0) + 1 if progress.get("phase") == "training" else None
    if timed_out:
        message = f"killed by the watchdog after {time.time() - started:.0f}s ({why})"
    else:
        sig = -proc.returncode if proc.returncode < 0 else None
        message = first_line(_last_error_line(stderr)) or (
            f"process ended by signal {signal.Signals(sig).name}" if sig else f"process exited with {proc.returncode}"
        )
    return Outcome(
        "failed",
        failure={"kind": kind, "message": message, "step": step},
        recorded=False,
        log_dir=log_dir,
        launcher=how,
    )


def recorded_outcome(log_dir: Path, run_id: str | None = None, launcher: str = "unknown") -> Outcome | None:
    """The outcome the trial wrote in `log_dir` (result.json, for MLflow run `run_id` where given), if it wrote one."""
    result = read_json(log_dir / RESULT_FILE)
    if not result or (run_id is not None and result.get("run_id") != run_id):
        return None
    return record.from_result(result, log_dir, launcher)


def _stopped(log_dir: Path, how: str, progress: dict[str, Any] | None) -> Outcome:
    """A trial ended (or never launched) because the sweep stopped: killed, and why."""
    stopping.count_stopped()
    step = progress.get("step", 0) + 1 if progress and progress.get("phase") == "training" else None
    failure = {"kind": "killed", "message": f"{stopping.reason}{record.STOPPED_WHILE}", "step": step}
    return Outcome("failed", failure=failure, recorded=False, log_dir=log_dir, launcher=how)


def start_launcher(sweeper: DictConfig, wait: bool = True) -> None:
    """The forkserver (`hydra.sweeper.preload`), started by the engine's main thread before any slot's thread asks
    for it, so that it dies with the engine (src/sweep/tether.py). wait=False: started, importing in the background."""
    preload = _preload_modules(sweeper.get("preload"))
    if preload and wait:
        launcher.forkserver(preload)
    elif preload:
        launcher.begin(preload)


def _preload_modules(setting: Any) -> list[str]:
    """`hydra.sweeper.preload`: false (fresh interpreters), true (launcher.DEFAULT_PRELOAD) or a module list."""
    if not setting:
        return []
    if setting is True:
        return list(launcher.DEFAULT_PRELOAD)
    return [str(m) for m in setting]


def _last_error_line(stderr: str) -> str:
    for line in reversed(stderr.strip().splitlines()):
        if any(w in line for w in ("Error", "error", "Fatal", "fault", "Killed")):
            return line
    return ""


def stop_process_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End a process started in a session of its own and everything it spawned: SIGTERM to the group, SIGKILL
    after `grace_s`, then SIGKILL to whatever of the group outlived its leader (a rank, a server's workers)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
