"""The sweep engine behind `hydra/sweeper=optuna`: Optuna asks, each trial runs in a fresh process on a slot
of its own, the outcome (or the way the process died) is classified and told back, MLflow records it all.

- Slots: GPUs found (or `devices`), `gpus_per_trial` whole cards each, `slots_per_gpu` trials per card; CPU
  slots where there is no GPU. One worker thread per slot asks for the next trial as soon as its slot is
  free: no batch barrier.
- Isolation: every trial is `python -m src.train` in its own process group (a poisoned CUDA context dies
  with it); it is killed with its group past `trial_timeout_s`, or after `stall_timeout_s` without a step.
- Learning: failures caused by the setting itself (OOM, refused data or config) are told as COMPLETE with a
  violated constraint (measured: what the trial needed over the budget), so TPE and NSGA-II rank that
  region below every feasible one; other failures are FAIL. Nothing a trial does stops the sweep.
- Resume and many workers: the study lives in an Optuna RDB storage; a new trial is asked only while the
  study holds fewer than `n_trials` finished + running trials (under a lock), heartbeats mark live trials,
  and trials of dead workers are failed with their MLflow runs closed: at start-up and each time a worker
  asks. Any number of sweep processes with the same command and one storage are workers of one study; the
  lock is a file lock for SQLite (one host) and a PostgreSQL advisory lock for `postgresql://` storages (any
  host). A worker whose study is full waits while other workers' trials still run, so the one that outlives
  a dead worker fails (or retries) its trial and the study never stalls short of `n_trials`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from filelock import FileLock
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from src import launcher, tracking
from src.failures import MEMORY, STICKY_CUDA, classify_exit, first_line, oom_needed_gib
from src.trial import PROGRESS_FILE, RESULT_FILE

log = logging.getLogger(__name__)

# Failures that the setting itself causes, the same way every time: the sampler must steer away from them.
SETTING_FAILURES = (*MEMORY, "data_error", "config_error")
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


# ---- search space -------------------------------------------------------------------------------------------


def distribution(override: Override) -> BaseDistribution | Any:
    """An Optuna distribution from hydra-optuna-sweeper's grammar (choice, range, interval, tag(log, ...))."""
    if not override.is_sweep_override():
        return override.value()
    value = override.value()
    if override.is_choice_sweep():
        # A list or dict choice (model.sdpa_backends=choice([flash,efficient],[math])) is kept as its Hydra text,
        # which Optuna can store and format_value passes through as a literal.
        choices = [c if isinstance(c, str | int | float | bool) or c is None else _hydra_literal(c) for c in value.list]
        return CategoricalDistribution(choices)
    if override.is_range_sweep():
        ints = all(isinstance(x, int) for x in (value.start, value.stop, value.step))
        if ints:
            return IntDistribution(int(value.start), int(value.stop) - int(value.step), step=int(value.step))
        return FloatDistribution(value.start, value.stop - value.step, step=value.step)
    if override.is_interval_sweep():
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(value.start, value.end, log=log_scale)
    raise ValueError(f"hydra.sweeper.params: cannot turn '{override.input_line}' into a search space")


def outside_space(params: dict[str, Any], distributions: dict[str, BaseDistribution]) -> list[str]:
    """'key=value (space)' for each of `params` the space holds but whose value it cannot take."""
    outside = []
    for key, value in params.items():
        dist = distributions.get(key)
        if dist is None:
            continue  # not swept: Optuna ignores it
        try:
            inside = dist._contains(dist.to_internal_repr(value))
        except (ValueError, TypeError):
            inside = False
        if not inside:
            outside.append(f"{key}={value} ({dist})")
    return outside


def _hydra_literal(value: Any) -> str:
    """A list or dict from Hydra's override parser back as override text: [flash,efficient], {a:1}."""
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_literal(v)}" for k, v in value.items()) + "}"
    return format_value(value)


def format_value(value: Any) -> str:
    """A Python value as Hydra override text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str) and value[:1] + value[-1:] in ("[]", "{}"):
        return value  # a list or dict choice, kept as its Hydra text (see distribution)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def split_arguments(
    arguments: list[str], params: dict[str, Any], default_params: dict[str, Any], custom: bool = False
) -> tuple[list[str], dict[str, Any]]:
    """Command-line overrides: plain ones go to every trial, sweep ones join (and win over) `params`.
    `default_params` is the space only when neither `params`, the command line nor a custom space defines one."""
    parser = OverridesParser.create()
    fixed: list[str] = []
    cli_space: dict[str, Any] = {}
    for override in parser.parse_overrides(arguments):
        if override.is_sweep_override():
            cli_space[override.get_key_element()] = distribution(override)
        else:
            fixed.append(override.input_line)
    base = params if (params or cli_space or custom) else default_params
    space = {key: distribution(parser.parse_override(f"{key}={value}")) for key, value in base.items()}
    return fixed, {**space, **cli_space}


# ---- slots --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    name: str
    env: dict[str, str]


def discover_slots(sweeper: DictConfig) -> list[Slot]:
    for key in ("gpus_per_trial", "slots_per_gpu", "cpu_slots"):
        if int(sweeper[key]) < 1:
            raise ValueError(f"hydra.sweeper.{key}={sweeper[key]}: must be at least 1")
    devices = list(sweeper.devices) if sweeper.devices is not None else _visible_gpus()
    if devices and sweeper.gpus_per_trial > len(devices):
        raise ValueError(
            f"hydra.sweeper.gpus_per_trial={sweeper.gpus_per_trial} but this machine shows {len(devices)} GPU(s) "
            f"({devices}); lower gpus_per_trial or set hydra.sweeper.devices"
        )
    if not devices:
        threads = str(max(1, (os.cpu_count() or 1) // max(1, sweeper.cpu_slots)))
        return [Slot(f"cpu{i}", {"OMP_NUM_THREADS": threads}) for i in range(sweeper.cpu_slots)]
    per = sweeper.gpus_per_trial
    groups = [devices[i : i + per] for i in range(0, len(devices) - per + 1, per)]
    copies = sweeper.slots_per_gpu if per == 1 else 1
    # Trials at once share the machine's cores: each gets its share of CPU threads (as torchrun does), so that
    # five trials starting together do not run 5 x all-cores thread pools (tokenizing, collating, torch's own).
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // max(1, len(groups) * copies)))
    return [
        Slot(
            f"cuda{','.join(map(str, g))}" + (f"#{c}" if copies > 1 else ""),
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, g)), "OMP_NUM_THREADS": threads},
        )
        for g in groups
        for c in range(copies)
    ]


def _visible_gpus() -> list[int]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(x) for x in visible.split(",") if x.strip().isdigit()]
    try:
        import pynvml

        pynvml.nvmlInit()
        return list(range(pynvml.nvmlDeviceGetCount()))
    except Exception:
        return []


# ---- one trial process ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # ok | failed
    metrics: dict[str, float] = field(default_factory=dict)
    failure: dict[str, Any] | None = None
    recorded: bool = True  # the trial ended its MLflow run itself
    attention_kernel: str | None = None
    log_dir: Path | None = None
    launcher: str = "interpreter"


def _tail(path: Path, limit: int = 20000) -> str:
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
    (log_dir / "command.txt").write_text(tracking.redact_text(" ".join(cmd)) + "\n")
    extra_env = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **env}
    preload = _preload_modules(sweeper.get("preload"))
    ctx = launcher.forkserver(preload) if preload else None
    started = time.time()
    extra_env[launcher.STARTED_ENV] = repr(started)  # the trial's start-up is counted from here (src/measure.py)
    timed_out = False
    with (log_dir / "stdout.log").open("wb") as out, (log_dir / "stderr.log").open("wb") as err:
        if ctx is not None:  # forked from the warm interpreter: no imports to pay (src/launcher.py)
            proc: Any = launcher.start(ctx, argv, log_dir / "stdout.log", log_dir / "stderr.log", extra_env)
        else:
            proc = subprocess.Popen(  # noqa: PLW1509 - the child's own session, see launcher.child_setup
                cmd, stdout=out, stderr=err, env={**os.environ, **extra_env}, preexec_fn=launcher.child_setup
            )
        last_beat = 0.0
        while proc.poll() is None:
            time.sleep(0.2)
            now = time.time()
            if heartbeat and now - last_beat >= sweeper.heartbeat_interval_s:
                heartbeat()
                last_beat = now
            progress = _read_json(log_dir / PROGRESS_FILE)
            stalled = progress.get("phase") == "training" and now - progress.get("time", now) > sweeper.stall_timeout_s
            if now - started > sweeper.trial_timeout_s or stalled:
                timed_out = True
                why = (
                    f"{sweeper.stall_timeout_s:g}s without a step"
                    if stalled
                    else (f"hydra.sweeper.trial_timeout_s={sweeper.trial_timeout_s:g}")
                )
                stop_process_group(proc)
    how = "forkserver" if ctx is not None else "interpreter"
    result = _read_json(log_dir / RESULT_FILE)
    if result and not timed_out:
        return Outcome(
            status=result["status"],
            metrics=result.get("metrics", {}),
            failure=result.get("failure"),
            attention_kernel=result.get("attention_kernel"),
            log_dir=log_dir,
            launcher=how,
        )
    stderr = _tail(log_dir / "stderr.log")
    progress = _read_json(log_dir / PROGRESS_FILE)
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ---- the engine -------------------------------------------------------------------------------------------------


class SweepEngine:
    def __init__(self, config: DictConfig, arguments: list[str]) -> None:
        self.config = config
        self.sweeper = config.hydra.sweeper
        self.study_name = str(self.sweeper.study_name)
        self.study_dir = Path(config.paths.sweeps_dir) / self.study_name
        self.objectives = _as_list(self.sweeper.objectives)
        self.directions = _as_list(self.sweeper.direction)
        if len(self.directions) != len(self.objectives):
            raise ValueError(
                f"hydra.sweeper.direction has {len(self.directions)} entries for {len(self.objectives)} objectives "
                f"{self.objectives}; give one direction (maximize/minimize) per objective"
            )
        params = OmegaConf.to_container(self.sweeper.params, resolve=True) or {}
        defaults = OmegaConf.to_container(self.sweeper.default_params, resolve=True) or {}
        custom = bool(self.sweeper.custom_search_space)
        self.fixed, self.space = split_arguments(list(arguments), params, defaults, custom)
        self.distributions = {k: v for k, v in self.space.items() if isinstance(v, BaseDistribution)}
        self.fixed += [f"{k}={format_value(v)}" for k, v in self.space.items() if not isinstance(v, BaseDistribution)]
        self.custom = get_method(self.sweeper.custom_search_space) if self.sweeper.custom_search_space else None
        for knob, way in (self.sweeper.memory_monotone or {}).items():
            if way not in MONOTONE:
                raise ValueError(
                    f"hydra.sweeper.memory_monotone.{knob}={way!r}: use one of {', '.join(MONOTONE)} "
                    "(how peak memory moves as the knob grows)"
                )
        self.budget = float(config.hardware.vram_budget_gib)
        self.lock = threading.Lock()
        self.host = socket.gethostname()
        self._lock_engine: sqlalchemy.Engine | None = None
        self.counts: Counter[str] = Counter()
        self.best: tuple[float, int] | None = None

    # -- storage and study --

    def storage_url(self) -> str:
        return self.sweeper.storage or f"sqlite:///{(self.study_dir / 'optuna.db').resolve()}"

    def open_study(self) -> optuna.Study:
        self.study_dir.mkdir(parents=True, exist_ok=True)
        url = self.storage_url()
        engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        sampler_cfg = OmegaConf.to_container(self.sweeper.sampler, resolve=True) if self.sweeper.sampler else None
        if (
            sampler_cfg
            and sampler_cfg.get("_target_", "").endswith("GridSampler")
            and not sampler_cfg.get("search_space")
        ):
            sampler_cfg["search_space"] = {
                k: list(d.choices) for k, d in self.distributions.items() if isinstance(d, CategoricalDistribution)
            }
        if not url.startswith(("sqlite", "postgresql")):
            log.warning("storage %s: only workers on this host are serialized (a file lock)", url.split(":")[0])
        # Under the lock: workers started at once on an empty database would race to create Optuna's tables.
        with self.ask_lock():
            self.storage = optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=self.sweeper.heartbeat_interval_s,
                grace_period=self.sweeper.grace_period_s,
            )
            study = optuna.create_study(
                study_name=self.study_name, storage=self.storage, directions=self.directions, load_if_exists=True
            )
            joined = int(study.user_attrs.get("sweep.processes", 0))
            study.set_user_attr("sweep.processes", joined + 1)
        if sampler_cfg and sampler_cfg.get("seed") is not None:
            # Processes of one study seeded alike would propose the same points: each process that joins
            # later (another worker, a resumed sweep) draws from a seed of its own; the first keeps the seed.
            sampler_cfg["seed"] += joined
        if sampler_cfg:
            study.sampler = instantiate(sampler_cfg)
        return study

    def ask_lock(self) -> AbstractContextManager:
        """Serializes count-then-ask across every worker of the study: a file lock for SQLite (the database is
        on this host anyway), a PostgreSQL advisory lock for a PostgreSQL storage (workers on any host)."""
        url = self.storage_url()
        if url.startswith("postgresql"):
            return self._advisory_lock(url)
        return FileLock(str(self.study_dir / ".ask.lock"))

    @contextmanager
    def _advisory_lock(self, url: str) -> Iterator[None]:
        """`pg_advisory_lock` on a connection of its own, held for the critical section only. The server
        drops the lock with the connection, so a worker that dies inside never blocks the others."""
        if self._lock_engine is None:
            # NullPool: one fresh connection per critical section (once per trial), never one left idle
            self._lock_engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        key = _lock_key(self.study_name)
        with self._lock_engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            conn.commit()  # nothing else rides on this connection's transaction
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                conn.commit()

    def occupied(self, study: optuna.Study) -> int:
        trials = study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING))
        return sum(1 for t in trials if not t.user_attrs.get("retried"))

    def others_running(self, study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
        """Running trials of other sweep processes (this process's own are watched by its own threads)."""
        me = (self.host, os.getpid())
        return [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if (t.user_attrs.get("worker.host"), t.user_attrs.get("worker.pid")) != me
        ]

    # -- MLflow --

    def open_parent(self, study: optuna.Study) -> None:
        from mlflow.tracking import MlflowClient

        tracking.setup(self.config.tracking.uri)
        self.client = MlflowClient()
        self.experiment_id = tracking.experiment_id(
            self.study_name, str(Path(self.config.paths.mlruns_dir) / "artifacts")
        )
        parent = study.user_attrs.get("mlflow_parent_run_id")
        if parent is None or self._run_missing(parent):
            parent = self.client.create_run(
                self.experiment_id,
                run_name=f"sweep-{self.study_name}",
                tags={"optuna.study": self.study_name, "sweep.role": "parent"},
            ).info.run_id
            study.set_user_attr("mlflow_parent_run_id", parent)
        else:
            self.client.update_run(parent, status="RUNNING")
        self.parent = parent
        tracking.set_tags(
            self.client,
            parent,
            {
                "sweep.search_space": json.dumps({k: repr(v) for k, v in self.distributions.items()}),
                "sweep.objectives": json.dumps(dict(zip(self.objectives, self.directions, strict=True))),
                # What the report and the promotion must know of how trials ran (a probe's length is not
                # carried into production), command-line overrides included: trials never see hydra.sweeper.
                "sweep.headroom_margin": json.dumps(float(self.sweeper.headroom_margin)),
                "sweep.trial_overrides": json.dumps([str(o) for o in self.sweeper.trial_overrides]),
                "sweep.storage": self.storage_url(),
                "sweep.n_trials": self.sweeper.n_trials,
                "vram_budget_gib": self.budget,
            },
        )

    def _run_missing(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return False
        except Exception:
            return True

    def child_run(self, trial: optuna.Trial | optuna.trial.FrozenTrial, slot: Slot) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{trial.number:03d}",
            tags={
                "mlflow.parentRunId": self.parent,
                "optuna.study": self.study_name,
                "optuna.trial": str(trial.number),
                "sweep.slot": slot.name,
            },
        )
        return run.info.run_id

    def _runs_of(self, number: int) -> list[str]:
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`optuna.trial` = '{number}'", max_results=10
        )
        return [r.info.run_id for r in runs if r.data.tags.get("mlflow.parentRunId") == self.parent]

    # -- recovery --

    def recover(self, study: optuna.Study) -> None:
        """Fail trials whose worker is gone: on this host, its pid is dead; on any host, its heartbeat expired.

        Their failure is written first (Optuna freezes a finished trial), their MLflow runs are closed as
        KILLED, and with `retry_failed_trials` their settings are enqueued again.
        """
        stale = set(self.storage._get_stale_trial_ids(study._study_id))  # the storage's own heartbeat rule
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            here = t.user_attrs.get("worker.host") == self.host
            if t._trial_id in stale or (
                here and not _alive(t.user_attrs.get("worker.pid"), t.user_attrs.get("worker.started"))
            ):
                self.fail_orphan(study, t)

    def fail_orphan(self, study: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
        failure = {"kind": "killed", "message": "the sweep worker running this trial died", "step": None}
        for key, value in {**_attrs(failure), "trial.status": "failed"}.items():
            self.storage.set_trial_user_attr(t._trial_id, key, value)
        run_id = t.user_attrs.get("mlflow_run_id")
        if run_id is None:
            # The worker died before naming the trial's run, or before creating it: one run per trial all the same.
            run_id = next(iter(self._runs_of(t.number)), None) or self.child_run(t, Slot("unknown", {}))
            self.storage.set_trial_user_attr(t._trial_id, "mlflow_run_id", run_id)
        # FINISHED too: the trial recorded itself, but its worker died before telling Optuna, which now holds
        # it as killed; MLflow must say the same. A FAILED run keeps the trial's own, more precise failure.
        if self.client.get_run(run_id).info.status in ("RUNNING", "FINISHED"):
            tracking.close_failed(self.client, run_id, failure, status="KILLED")
        if self.sweeper.retry_failed_trials:
            self.storage.set_trial_user_attr(t._trial_id, "retried", True)
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        self.storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        log.warning("trial %d was left running by a dead worker: failed (killed)", t.number)

    # -- the loop --

    def run(self) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # Heartbeats are recorded by our own watch loop, not Study.optimize's thread: that is intended.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        slots = discover_slots(self.sweeper)  # refuses impossible slot settings before anything is recorded
        study = self.open_study()
        with self.ask_lock():  # workers starting at once: one parent run, one copy of each enqueued trial
            self.open_parent(study)
            self.recover(study)
            self.enqueue(study)
        self.prepare(slots[0])
        n_workers = min(len(slots), self.sweeper.n_jobs or len(slots))
        self.refresh_counts(study)
        self.progress = _progress(self.sweeper, self.study_name, self.counts["finished"])
        log.info(
            "study %s: %d slots (%s), storage %s",
            self.study_name,
            n_workers,
            ", ".join(s.name for s in slots[:n_workers]),
            tracking.redact_text(self.storage_url()),
        )
        workers = [threading.Thread(target=self.worker, args=(study, slot), daemon=True) for slot in slots[:n_workers]]
        try:
            for w in workers:
                w.start()
            for w in workers:
                while w.is_alive():
                    w.join(timeout=0.5)
        finally:
            self.progress.close()
            with self.ask_lock():
                self.refresh_counts(study)
                self.log_parent_counts()
                # The sweep's parent run is every worker's: the last one out closes it.
                if not self.others_running(study):
                    self.client.set_terminated(self.parent, "FINISHED")
        self.print_summary(study)

    def prepare(self, slot: Slot) -> None:
        """Build the model (random models) and its 4-bit copy once, before any trial: trials then only load it,
        and no trial's peak includes the build."""
        log_dir = self.study_dir / "prepare"
        cmd = [
            sys.executable,
            "-m",
            "src.models",
            *self.sweeper.trial_overrides,
            *self.fixed,
            f"hydra.run.dir={log_dir}",
        ]
        log_dir.mkdir(parents=True, exist_ok=True)
        with (log_dir / "prepare.log").open("wb") as out:
            done = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **slot.env}, check=False
            )
        if done.returncode != 0:
            log.warning(
                "model preparation failed (see %s); each trial will report the problem itself", log_dir / "prepare.log"
            )

    def enqueue(self, study: optuna.Study) -> None:
        for i, params in enumerate(self.sweeper.enqueue_trials or []):
            params = OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else dict(params)
            outside = outside_space(params, self.distributions)
            if outside:
                # Optuna would fail the ask for it (a categorical value not among the choices) and leave a
                # trial RUNNING that no worker owns: the seed's settings may well lie outside a user's space.
                log.warning(
                    "hydra.sweeper.enqueue_trials[%d] not queued: %s outside this sweep's space (add the value to "
                    "the space to place that setting on the map; hydra.sweeper.enqueue_trials=[] silences this)",
                    i,
                    "; ".join(outside),
                )
                continue
            study.enqueue_trial(params, skip_if_exists=True)

    def worker(self, study: optuna.Study, slot: Slot) -> None:
        while True:
            with self.ask_lock():
                self.recover(study)  # a worker elsewhere may have died since: its trials are failed here
                full = self.occupied(study) >= self.sweeper.n_trials
                if full and not self.others_running(study):
                    return
                if not full:
                    trial = study.ask(self.distributions)
                    trial.set_user_attr("worker.host", self.host)
                    trial.set_user_attr("worker.pid", os.getpid())
                    trial.set_user_attr("worker.started", _create_time(os.getpid()))
                    # A first heartbeat at once: a trial without one is never stale, so a worker dying
                    # before its first beat would leave it running for ever.
                    self.storage.record_heartbeat(trial._trial_id)
            if full:
                # Other workers' last trials still run: if one of them dies, this worker fails (or retries)
                # its trial, so the study ends at n_trials instead of stalling.
                time.sleep(self.sweeper.heartbeat_interval_s)
                continue
            try:
                self.run_trial(study, trial, slot)
            except Exception as exc:  # the engine's own trouble: record it on the trial, keep sweeping
                log.exception("trial %d: engine error", trial.number)
                frozen = self.storage.get_trial(trial._trial_id)
                if frozen.state.is_finished():
                    continue  # another worker took it for dead and failed it meanwhile
                self.storage.set_trial_user_attr(trial._trial_id, "failure.kind", "other")
                message = tracking.redact_text(first_line(str(exc)))
                self.storage.set_trial_user_attr(trial._trial_id, "failure.message", message)
                run_id = frozen.user_attrs.get("mlflow_run_id")
                try:
                    if run_id and self.client.get_run(run_id).info.status == "RUNNING":
                        tracking.close_failed(self.client, run_id, {"kind": "other", "message": message})
                except Exception:  # noqa: BLE001 - MLflow itself may be the trouble; the study has the record
                    log.warning("trial %d: its MLflow run %s could not be closed", trial.number, run_id)
                _tell(study, trial, state=TrialState.FAIL)

    def run_trial(self, study: optuna.Study, trial: optuna.Trial, slot: Slot) -> None:
        # A custom space returns the overrides its suggestions stand for (its suggestions may be labels, as in
        # tests/sweep_scenarios.py); one that returns None, as hydra-optuna-sweeper's do, gets its suggestions.
        extra = self.custom(self.config, trial) if self.custom else {}
        if extra is None:
            extra = {k: v for k, v in trial.params.items() if k not in self.distributions}
        params = {**{k: v for k, v in trial.params.items() if k in self.distributions}, **extra}
        run_id = self.child_run(trial, slot)
        trial.set_user_attr("mlflow_run_id", run_id)
        trial.set_user_attr("sweep.slot", slot.name)
        original = self.finished_twin(study, trial) if self.sweeper.skip_duplicates else None
        if original is not None:
            self.skip(study, trial, original, run_id, f"same setting as trial {original.number}")
            return
        dominating = self.certain_oom(study, trial)
        if dominating is not None:
            self.skip(
                study, trial, dominating, run_id, f"certain oom: needs at least trial {dominating.number}'s memory"
            )
            return
        overrides = [
            *self.sweeper.trial_overrides,
            *self.fixed,
            *(f"{k}={format_value(v)}" for k, v in params.items()),
        ]
        log_dir = self.study_dir / "trials" / f"{trial.number:03d}"
        env = {**slot.env, "MLFLOW_RUN_ID": run_id, "QLORA_OPTUNA_TRIAL": str(trial.number)}
        heartbeat = lambda: self.storage.record_heartbeat(trial._trial_id)  # noqa: E731
        with self.lock:
            self.counts["running"] += 1
            self.update_progress()
        outcome = run_process(overrides, log_dir, env, self.sweeper, heartbeat)
        tracking.set_tags(self.client, run_id, {"trial.launcher": outcome.launcher})
        if outcome.failure and outcome.failure["kind"] in STICKY_CUDA and self.sweeper.launch_blocking_rerun:
            outcome = self.rerun_launch_blocking(overrides, log_dir, env, run_id, outcome, heartbeat)
        if not outcome.recorded:
            tracking.log_text(self.client, run_id, _tail(log_dir / "stderr.log"), "stderr_tail.txt")
            tracking.log_metrics(self.client, run_id, {**outcome.metrics, "vram_budget_gib": self.budget})
            status = "KILLED" if outcome.failure["kind"] in ("killed", "timeout") else "FAILED"
            tracking.close_failed(self.client, run_id, outcome.failure, status=status)
        self.tell(study, trial, outcome, run_id)

    def finished_twin(self, study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial | None:
        """An earlier measured trial with exactly these settings (samplers over small spaces repeat points)."""
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if (
                t.number != trial.number
                and t.params == trial.params
                and t.user_attrs.get("trial.status") in ("ok", "failed")
            ):
                return t
        return None

    def certain_oom(self, study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial | None:
        """A trial that ran out of memory with a setting this one can only need more memory than.

        Peak memory only grows with the knobs in `memory_monotone` (longer sequences, bigger per-device batch,
        higher rank, checkpointing off) and does not move with its `neutral` ones (accumulation and batch
        order, on padded batches); with every other knob equal, a proposal at or beyond an OOM setting on each
        of them would OOM too. It is not launched (`skipped`) and Optuna is told it is infeasible.
        """
        monotone = dict(self.sweeper.memory_monotone or {})
        if not monotone:
            return None
        proposal = trial.params
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.user_attrs.get("failure.kind") not in MEMORY or t.user_attrs.get("trial.status") != "failed":
                continue
            if set(t.params) != set(proposal):
                continue
            # A packed (padding-free) micro-batch is as large as the rows packed into it: which rows share a
            # batch (group_by_length) and how many rows the probe has (accumulation) then move the peak.
            packed = self.packed(proposal) or self.packed(t.params)
            rules = {k: ("equal" if packed and v == "neutral" else v) for k, v in monotone.items()}
            if all(_at_least(proposal[k], t.params[k], rules.get(k)) for k in proposal):
                return t
        return None

    def packed(self, params: dict[str, Any]) -> bool:
        """Whether a setting trains on packed or padding-free batches (its own value, else the sweep's)."""
        for key in ("trainer.packing", "trainer.padding_free"):
            if key in params:
                value = params[key]
            else:
                fixed = [o.split("=", 1)[1] for o in self.fixed if o.split("=", 1)[0].lstrip("+") == key]
                value = fixed[-1].lower() == "true" if fixed else OmegaConf.select(self.config, key, default=False)
            if value is True or value == "true":
                return True
        return False

    def skip(
        self, study: optuna.Study, trial: optuna.Trial, original: optuna.trial.FrozenTrial, run_id: str, reason: str
    ) -> None:
        """Not launched: trial `original` already tells what this setting does; its outcome is told again."""
        trial.set_user_attr("trial.status", "skipped")
        trial.set_user_attr("skipped.because_of", original.number)
        trial.set_user_attr("skipped.reason", reason)
        if "failure.kind" in original.user_attrs:
            trial.set_user_attr("failure.kind", original.user_attrs["failure.kind"])
        for key, value in original.constraints.items():
            trial.set_constraint(key, value)
        tracking.set_tags(
            self.client,
            run_id,
            {"trial.status": "skipped", "skipped.because_of": original.number, "skipped.reason": reason},
        )
        self.client.set_terminated(run_id, "FINISHED")
        _tell(study, trial, original.values)
        with self.lock:
            self.refresh_counts(study)
            self.log_parent_counts()
            self.progress.update(1)
            self.update_progress()

    def rerun_launch_blocking(
        self, overrides: list[str], log_dir: Path, env: dict[str, str], run_id: str, first: Outcome, heartbeat: Any
    ) -> Outcome:
        """The seed answer's first step, automated: the same trial once more with CUDA_LAUNCH_BLOCKING=1, so the
        recorded stack points at the kernel that failed. The first attempt's kind stays the trial's."""
        second = run_process(
            overrides, log_dir / "launch_blocking", {**env, "CUDA_LAUNCH_BLOCKING": "1"}, self.sweeper, heartbeat
        )
        tags = {
            "failure.kind": first.failure["kind"],
            "failure.message": first.failure["message"],
            "failure.step": first.failure.get("step"),
            "failure.launch_blocking.kind": second.failure["kind"] if second.failure else "none (passed)",
            "failure.launch_blocking.message": second.failure["message"] if second.failure else "",
            "trial.status": "failed",
        }
        tracking.set_tags(self.client, run_id, tags)
        if second.recorded:
            self.client.set_terminated(run_id, "FAILED")
        first.recorded = first.recorded and second.recorded
        first.failure["launch_blocking_kind"] = tags["failure.launch_blocking.kind"]
        return first

    def tell(self, study: optuna.Study, trial: optuna.Trial, outcome: Outcome, run_id: str) -> None:
        m = outcome.metrics
        for key, value in {**m, **_attrs(outcome.failure)}.items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("trial.status", outcome.status)
        trial.set_user_attr("trial.launcher", outcome.launcher)
        if outcome.attention_kernel:
            trial.set_user_attr("attention.kernel", outcome.attention_kernel)
        kind = outcome.failure["kind"] if outcome.failure else None
        if outcome.status == "ok" and all(o in m for o in self.objectives):
            trial.set_constraint("vram_budget", m.get("peak_vram_reserved_gib", 0.0) / self.budget - 1.0)
            _tell(study, trial, [m[o] for o in self.objectives])
        elif kind in SETTING_FAILURES:
            trial.set_constraint("vram_budget" if kind in MEMORY else "valid_setting", self.violation(kind, m))
            worst = [0.0 if d == "maximize" else float("inf") for d in self.directions]
            _tell(
                study,
                trial,
                [m.get(o, w) if o.startswith("peak_vram") else w for o, w in zip(self.objectives, worst, strict=True)],
            )
        else:
            _tell(study, trial, state=TrialState.FAIL)
        with self.lock:
            self.counts["running"] -= 1
            self.refresh_counts(study)
            self.log_parent_counts()
            self.progress.update(1)
            self.update_progress()

    def violation(self, kind: str, m: dict[str, float]) -> float:
        """How far the setting is from feasible: for an OOM, what it held plus what it asked for, over the
        budget (at least a hair above 0: it did fail); for a refused setting, 1."""
        if kind not in MEMORY:
            return 1.0
        return max(oom_needed_gib(m, self.budget) / self.budget - 1.0, 0.01)

    # -- reporting --

    def refresh_counts(self, study: optuna.Study) -> None:
        running = self.counts["running"]
        self.counts = Counter(running=running)
        best = None
        for t in study.get_trials(deepcopy=False, states=FINISHED):
            if t.user_attrs.get("retried"):
                continue
            self.counts["finished"] += 1
            status = t.user_attrs.get("trial.status")
            if status == "skipped":
                self.counts["skipped"] += 1
            elif status == "ok":
                self.counts["ok"] += 1
                value = t.user_attrs.get(self.objectives[0])
                if value is not None and (best is None or (value > best[0]) == (self.directions[0] == "maximize")):
                    best = (value, t.number)
            else:
                self.counts[f"failed_{t.user_attrs.get('failure.kind', 'other')}"] += 1
                self.counts["failed"] += 1
        self.best = best

    def log_parent_counts(self) -> None:
        metrics = {f"trials_{k}": float(v) for k, v in self.counts.items() if k != "running"}
        tracking.log_metrics(self.client, self.parent, metrics, step=self.counts["finished"])

    def update_progress(self) -> None:
        failed = " ".join(f"{k[7:]}={v}" for k, v in sorted(self.counts.items()) if k.startswith("failed_"))
        best = f" best={self.best[0]:.4g} {self.objectives[0]} (#{self.best[1]})" if self.best else ""
        skipped = f" skipped={self.counts['skipped']}" if self.counts["skipped"] else ""
        self.progress.set_postfix_str(
            f"running={self.counts['running']} ok={self.counts['ok']}{skipped} {failed}{best}".strip()
        )

    def print_summary(self, study: optuna.Study) -> None:
        failed = ", ".join(f"{v} {k[7:]}" for k, v in sorted(self.counts.items()) if k.startswith("failed_"))
        print(
            f"\nstudy '{self.study_name}': {self.counts['finished']} trials finished, {self.counts['ok']} ok, "
            f"{self.counts['skipped']} skipped as repeats" + (f", failed: {failed}" if failed else "")
        )
        if self.best:
            print(f"best {self.objectives[0]}: {self.best[0]:.4g} (trial {self.best[1]})")
        where = f"storage: {self.storage_url()}  |  MLflow: {self.config.tracking.uri} (experiment '{self.study_name}')"
        print(tracking.redact_text(where))
        report = f"python -m src.report {self.study_name}"
        if self.sweeper.storage:  # not where the report looks by default
            report += f" --storage {self.storage_url()} --tracking-uri {self.config.tracking.uri}"
        print(tracking.redact_text(f"trial logs: {self.study_dir / 'trials'}  |  map: {report}"))


def _tell(study: optuna.Study, trial: Any, values: Any = None, state: TrialState | None = None) -> None:
    """study.tell, tolerating GridSampler's study.stop() once its grid is exhausted: that raises outside
    Study.optimize, after the trial was told (stopping is n_trials' job here anyway)."""
    try:
        study.tell(trial, values, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


MONOTONE = ("increasing", "decreasing", "neutral")


def _at_least(value: Any, reference: Any, direction: str | None) -> bool:
    """Whether `value` needs at least the memory `reference` needs, on a knob that moves memory `direction`."""
    if direction == "increasing":
        return value >= reference
    if direction == "decreasing":
        return value <= reference
    if direction == "neutral":  # the knob does not move the peak (gradient accumulation: same micro-step)
        return True
    return value == reference


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _attrs(failure: dict[str, Any] | None) -> dict[str, Any]:
    if not failure:
        return {}
    # What a failed process printed may quote a credential (a storage URL in a traceback): the study keeps none.
    return {
        f"failure.{k}": tracking.redact_text(v) if isinstance(v, str) else v
        for k, v in failure.items()
        if v is not None
    }


def _create_time(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def _alive(pid: int | None, started: float | None) -> bool:
    if pid is None:
        return False
    created = _create_time(int(pid))
    return created is not None and (started is None or abs(created - started) < 1.0)


def _progress(sweeper: DictConfig, study_name: str, done: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=sweeper.n_trials,
        initial=min(done, sweeper.n_trials),
        desc=study_name,
        unit="trial",
        disable=not sweeper.progress,
        dynamic_ncols=True,
        file=sys.stderr,
    )


def _lock_key(study_name: str) -> int:
    """A stable signed 64-bit key for pg_advisory_lock, one per study (Python's hash() differs per process)."""
    digest = hashlib.blake2b(f"qlora-sweep:{study_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
