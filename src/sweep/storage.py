"""The study in its Optuna RDB storage: opening it (sampler, seeds of joining workers), the lock every worker takes
to count and ask, and recovery of trials whose worker died (a dead process on this host, or a heartbeat that
stopped on any host). A trial that had finished and recorded itself when its worker died is told what its own
records say; only the others are failed as killed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
from filelock import FileLock
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState

from src import record
from src.places import study_storage
from src.record import DEAD_WORKER, LEVER, WORKER_HOST, WORKER_PID, retried_numbers
from src.sweep.rules import CONSTRAINTS, CONSTRAINTS_KEY
from src.sweep.space import SpaceError

log = logging.getLogger(__name__)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
# Called with (study, trial) for each trial Optuna's stale-trial machinery failed, to close its MLflow run; returns
# the run's id.
OnDead = Callable[[optuna.Study, FrozenTrial], str | None]


class StudyStore:
    def __init__(
        self,
        sweeper: DictConfig,
        study_name: str,
        study_dir: Path,
        host: str,
        on_dead: OnDead,
    ) -> None:
        self.sweeper = sweeper
        self.study_name = study_name
        self.study_dir = study_dir
        self.host = host
        self.on_dead = on_dead
        self._lock_engine: sqlalchemy.Engine | None = None
        self.storage: optuna.storages.RDBStorage | None = None
        self.study_id: int | None = None

    @property
    def url(self) -> str:
        return self.sweeper.storage or study_storage(self.study_dir.parent, self.study_name)

    def open(
        self, directions: list[str], distributions: dict[str, BaseDistribution], objectives: list[str]
    ) -> optuna.Study:
        url = self.url
        engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
        sampler_cfg = OmegaConf.to_container(self.sweeper.sampler, resolve=True) if self.sweeper.sampler else None
        if (
            sampler_cfg
            and sampler_cfg.get("_target_", "").endswith("GridSampler")
            and not sampler_cfg.get("search_space")
        ):
            sampler_cfg["search_space"] = _grid(distributions)
        if sampler_cfg:
            _check_sampler(sampler_cfg)  # before the study or its folder is made
        self.study_dir.mkdir(parents=True, exist_ok=True)
        if not url.startswith(("sqlite", "postgresql")):
            log.warning("storage %s: only workers on this host are serialized (a file lock)", url.split(":")[0])
        # Under the lock: workers started at once on an empty database would race to create Optuna's tables.
        with self.lock():
            self.storage = optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=self.sweeper.heartbeat_interval_s,
                grace_period=self.sweeper.grace_period_s,
                heartbeat_stale_trial_callback=self._stale,
            )
            study = optuna.create_study(
                study_name=self.study_name, storage=self.storage, directions=directions, load_if_exists=True
            )
            joined = int(study.user_attrs.get("sweep.processes", 0))
            study.set_user_attr("sweep.processes", joined + 1)
            # Optuna's own names for what the study holds: its objectives (plots, the dashboard, trials_dataframe
            # name them instead of "Objective 0") and its constraint record's entries.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(list(objectives))
            study.set_user_attr("sweep.constraints", list(CONSTRAINTS))
            if self.sweeper.retry_failed_trials:  # what an earlier run's kill -9 or Ctrl-C ended runs again
                for trial in self.killed_not_retried(study):
                    self._retry(study, trial)
        self.study_id = self.storage.get_study_id_from_name(self.study_name)
        if sampler_cfg and sampler_cfg.get("seed") is not None:
            # Processes of one study seeded alike would propose the same points: each process that joins
            # later (another worker, a resumed sweep) draws from a seed of its own; the first keeps the seed.
            sampler_cfg["seed"] += joined
        if sampler_cfg:
            study.sampler = instantiate(sampler_cfg)
        return study

    def fresh_name(self) -> str:
        """A study name not taken yet in this storage or under sweeps/: `<name>-2`, `<name>-3`..."""
        taken = set(optuna.get_all_study_names(self.storage)) if self.storage else set()
        k = 2
        while f"{self.study_name}-{k}" in taken or (self.study_dir.parent / f"{self.study_name}-{k}").exists():
            k += 1
        return f"{self.study_name}-{k}"

    # -- trials by number (the storage's public API addresses trials by id) --

    def trial_id(self, number: int) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)

    def get(self, number: int) -> FrozenTrial:
        return self.storage.get_trial(self.trial_id(number))

    def set_attrs(self, number: int, attrs: dict[str, Any]) -> None:
        trial_id = self.trial_id(number)
        for key, value in attrs.items():
            self.storage.set_trial_user_attr(trial_id, key, value)

    def set_constraints(self, number: int, record: list[float]) -> None:
        """Optuna's constraint record of a running trial (src/sweep/rules.py: why not Trial.set_constraint)."""
        self.storage.set_trial_system_attr(self.trial_id(number), CONSTRAINTS_KEY, list(record))

    def heartbeat(self, number: int) -> None:
        self.storage.record_heartbeat(self.trial_id(number))

    # -- the lock --

    def lock(self) -> AbstractContextManager:
        """Serializes count-then-ask across every worker of the study: a file lock for SQLite (the database is
        on this host anyway), a PostgreSQL advisory lock for a PostgreSQL storage (workers on any host)."""
        if self.url.startswith("postgresql"):
            return self._advisory_lock(self.url)
        return FileLock(str(self.study_dir / ".ask.lock"))

    @contextmanager
    def _advisory_lock(self, url: str) -> Iterator[None]:
        """`pg_advisory_lock` on a connection of its own, held for the critical section only. The server
        drops the lock with the connection, so a worker that dies inside never blocks the others."""
        if self._lock_engine is None:
            # NullPool: one fresh connection per critical section (once per trial), never one left idle
            self._lock_engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        key = lock_key(self.study_name)
        with self._lock_engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:key)"), {"key": key})
            conn.commit()  # nothing else rides on this connection's transaction
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:key)"), {"key": key})
                conn.commit()

    # -- what the study holds --

    def occupied(self, study: optuna.Study) -> int:
        """Finished and running trials toward `n_trials`: a retried trial counted once (by its retry), the recipe's
        lever trials not at all (they are extra: src/sweep/recipe.py)."""
        trials = study.get_trials(deepcopy=False)
        retried = retried_numbers(trials)
        return sum(
            1
            for t in trials
            if t.state in (*FINISHED, TrialState.RUNNING) and t.number not in retried and LEVER not in t.user_attrs
        )

    def full(self, study: optuna.Study, n_trials: int) -> bool:
        """The study holds `n_trials` trials and no lever trial waits to run."""
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        return self.occupied(study) >= n_trials and not any(LEVER in t.user_attrs for t in waiting)

    def complete(self, study: optuna.Study, n_trials: int) -> bool:
        """The study holds `n_trials` finished trials, none runs and no lever trial waits: a sweep with this command
        has nothing left to do."""
        return self.full(study, n_trials) and not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))

    def others_running(self, study: optuna.Study) -> list[FrozenTrial]:
        """Running trials of other sweep processes (this process's own are watched by its own threads)."""
        me = (self.host, os.getpid())
        return [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if (t.user_attrs.get(WORKER_HOST), t.user_attrs.get(WORKER_PID)) != me
        ]

    # -- recovery --

    def dead(self, study: optuna.Study) -> list[FrozenTrial]:
        """Running trials whose worker is gone: on any host, its heartbeat expired (Optuna's rule); on this host, its
        process is dead (no need to wait for the heartbeat). The caller settles each (told from its own records if
        they say it finished, else `fail_dead`) while still running: Optuna freezes a finished trial."""
        stale = self._stale_numbers()
        found = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            here = t.user_attrs.get(WORKER_HOST) == self.host
            # Asked, then its worker died before writing who runs it and a first heartbeat (they are written under
            # the study's lock right after the ask): no heartbeat will ever expire, so age alone tells.
            orphan = WORKER_PID not in t.user_attrs and _older_than(t.datetime_start, self.sweeper.grace_period_s)
            if t.number in stale or orphan or (here and not _alive_worker(t)):
                found.append(t)
        return found

    def fail_dead(self, study: optuna.Study, trial: FrozenTrial, run_id: str | None) -> None:
        """A dead worker's trial that its records do not tell: failed as killed (what it died of written first),
        `run_id` its closed MLflow run; queued again if asked."""
        attrs = record.outcome_tags("failed", DEAD_WORKER)
        if run_id and record.RUN_ID not in trial.user_attrs:
            attrs[record.RUN_ID] = run_id
        self.set_attrs(trial.number, attrs)
        if self.storage.set_trial_state_values(self.trial_id(trial.number), TrialState.FAIL):
            self._requeue(study, trial)

    def fail_stale(self, study: optuna.Study) -> None:
        """Optuna's own machinery, for a heartbeat that expired since `dead` looked (it fails first, then calls
        `_stale`): milliseconds against a grace period, but no trial is ever left running for ever."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)

    def _stale_numbers(self) -> set[int]:
        """Running trials whose heartbeat expired: what fail_stale_trials would fail, seen before it fails them so
        that their records are read first. No public API says it without failing them: this is the call
        fail_stale_trials makes (RDBStorage, checked against Optuna 4.2-5.1)."""
        if self.storage.get_heartbeat_interval() is None:
            return set()
        ids = self.storage._get_stale_trial_ids(self.study_id)
        return {self.storage.get_trial_number_from_id(i) for i in ids}

    def _stale(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Optuna failed `trial` (its heartbeat stopped since `recover` looked): close its MLflow run, queue it
        again if asked."""
        self.on_dead(study, trial)
        self._requeue(study, trial)

    def _requeue(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self.sweeper.retry_failed_trials:
            self._retry(study, trial)
        log.warning("trial %d was left running by a dead worker: failed (killed)", trial.number)

    def killed_not_retried(self, study: optuna.Study) -> list[FrozenTrial]:
        """Trials their sweep killed (a dead worker, the sweep's stop: record.killed_by_sweep) that no trial retries
        yet: each counts toward `n_trials` as a failure that says nothing of its setting."""
        trials = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        retried = retried_numbers(study.get_trials(deepcopy=False))
        return [t for t in trials if t.number not in retried and record.killed_by_sweep(t)]

    def _retry(self, study: optuna.Study, trial: FrozenTrial) -> None:
        """Queue `trial`'s setting again (`retry_failed_trials`), as what it was queued as: the recipe, a lever or a
        recommendation keeps its mark and its overrides; the retry counts toward `n_trials`, the trial no more."""
        params = {k: v for k, v in trial.params.items() if k not in record.STAGE_PARAMS}
        kept = {k: trial.user_attrs[k] for k in _QUEUED_AS if k in trial.user_attrs}
        study.enqueue_trial(params, user_attrs={**kept, record.RETRY_OF: trial.number})
        log.warning("trial %d (killed by its sweep) queued again (hydra.sweeper.retry_failed_trials)", trial.number)


# What a queued trial was queued as, kept by its retry
_QUEUED_AS = (record.RECIPE, record.LEVER, record.LEVER_OF, record.RECOMMENDED, record.FASTER)


def _grid(distributions: dict[str, BaseDistribution]) -> dict[str, list[Any]]:
    """GridSampler's search space: each knob's values (a choice's, an integer range's); an interval has none to
    list, and the grid sampler failed the sweep's first ask with a traceback."""
    grid: dict[str, list[Any]] = {}
    for key, dist in distributions.items():
        if isinstance(dist, CategoricalDistribution):
            grid[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            grid[key] = list(range(dist.low, dist.high + 1, dist.step))
        else:
            raise SpaceError(
                f"hydra.sweeper.sampler is a grid, but {key} is {dist.__class__.__name__.removesuffix('Distribution')}"
                f"({dist.low:g}, {dist.high:g}{', log' if dist.log else ''}): a grid needs the values, give "
                f"{key}=choice(...) or range(a,b,step), or use another sampler (hydra/sweeper/sampler=tpe)"
            )
    return grid


def _check_sampler(sampler_cfg: dict[str, Any]) -> None:
    """A sampler its own class refuses (a seed below 0, an unknown argument) is a SpaceError naming the key."""
    try:
        instantiate(sampler_cfg)
    except Exception as exc:  # Hydra's InstantiationException around the sampler's own error: a page of traceback
        cause = exc.__cause__ or exc
        why = " ".join(str(cause).split()) or type(cause).__name__
        raise SpaceError(f"hydra.sweeper.sampler ({sampler_cfg.get('_target_')}): {why}") from None


def lock_key(study_name: str) -> int:
    """A stable signed 64-bit key for pg_advisory_lock, one per study (Python's hash() differs per process)."""
    digest = hashlib.blake2b(f"qlora-sweep:{study_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def create_time(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch: the kernel's boot time (whole seconds, re-derived from
    the wall clock on each read) plus `start_ticks`, so two reads of one process may differ by a second."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def start_ticks(pid: int) -> float | None:
    """When process `pid` started, in clock ticks since the machine booted (Linux's /proc/<pid>/stat, field 22; None
    elsewhere): a figure that never moves."""
    try:
        # fields after the command's closing parenthesis start at field 3: starttime (22) is the 20th of them
        return float(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def worker_identity(pid: int) -> dict[str, Any]:
    """What a worker records on the trials it runs, so that a worker on the same host can tell whether it lives."""
    return {
        WORKER_PID: pid,
        record.WORKER_STARTED: create_time(pid),
        record.WORKER_STARTED_SINCE_BOOT: start_ticks(pid),
    }


def _older_than(started: Any, seconds: float) -> bool:
    """Whether a trial's start (Optuna's naive local datetime) lies more than `seconds` in the past."""
    return started is not None and (datetime.now() - started).total_seconds() > float(seconds)


# An epoch start time read twice of one process differs by up to a second (create_time); a reused pid's process
# started later than that by far (the pid space wraps around first).
_EPOCH_SLACK_S = 2.0


def _alive_worker(trial: FrozenTrial) -> bool:
    a = trial.user_attrs
    return _alive(a.get(WORKER_PID), a.get(record.WORKER_STARTED), a.get(record.WORKER_STARTED_SINCE_BOOT))


def _alive(pid: int | None, started: float | None, since_boot: float | None = None) -> bool:
    """Whether the worker process `pid` that recorded these start times still runs (on this host): the same process
    when its start, in clock ticks since boot, is the one recorded. Older records hold only the epoch figure, read
    with a second's rounding either way: this process is then alive by definition, another within the slack."""
    if pid is None:
        return False
    if since_boot is not None:
        ticks = start_ticks(int(pid))
        if ticks is not None:
            return abs(ticks - float(since_boot)) < 0.05
    if int(pid) == os.getpid():
        return True
    created = create_time(int(pid))
    return created is not None and (started is None or abs(created - float(started)) < _EPOCH_SLACK_S)
