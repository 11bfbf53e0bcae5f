"""The sweep's loop: one worker thread per slot asks Optuna for the next trial as soon as its slot is free (no batch
barrier), applies the launch rules, runs the trial's process and tells Optuna how it went.

- Learning (src/sweep/rules.py, told by src/sweep/teller.py): a measured trial is COMPLETE; a failure caused by the setting itself (OOM,
  refused data or config) carries a violated constraint in Optuna's constraint record (what the trial needed over
  the budget), PRUNED without a value where the sampler learns from that (TPE), so the sampler ranks that region
  below every feasible one and no tool reads a value that was never measured; a skip (`skip`) is told as its
  origin; a skipped repeat of a measured setting is PRUNED; other failures are FAIL. Nothing a trial does stops
  the sweep.
- A study that already holds `n_trials` finished trials (and no finalist left to soak) is not swept again: one
  line says so, with the report's command and how to sweep again (a new study name, or more trials).
- Resume and many workers: a new trial is asked only while the study holds fewer than `n_trials` finished +
  running trials (under the study's lock), heartbeats mark live trials, and trials of dead workers are failed
  with their MLflow runs closed, at start-up and each time a worker asks. Any number of sweep processes with the
  same command and one storage are workers of one study. A worker whose study is full waits while other
  workers' trials still run, so the one that outlives a dead worker fails (or retries) its trial and the study
  never stalls short of `n_trials`. A trial that finished and recorded itself before its worker died is told
  what its records say (`Teller.tell_from_records`), never failed; StudyStore.dead names the dead, `recover`
  settles them.
- Stopping (src/sweep/stop.py): Ctrl-C, SIGTERM or a store the engine cannot write (a full disk) end the running
  trials' processes, record them as killed by the stop, close the parent run KILLED and exit non-zero with one
  line that says how to resume.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import optuna
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from src import quiet, record, stores, tracking
from src.config import override_value, study_name_problem
from src.failures import first_line
from src.record import DEAD_WORKER
from src.redact import redact_text
from src.study import load as load_sweep
from src.sweep import recipe, soak
from src.sweep.checks import SpaceFacts, check_space
from src.sweep.launch import launch
from src.sweep.memory import MemoryGate, predicted_attrs
from src.sweep.process import Outcome, start_launcher
from src.sweep.rules import (
    TOLD,
    LaunchRules,
    Skip,
    predicted_skip,
)
from src.sweep.runs import SweepRuns, parent_tags
from src.sweep.slots import Slot, discover_slots
from src.sweep.space import SpaceError, outside_space, refuse_credentials, split_arguments
from src.sweep.stop import on_signals, stopping, store_trouble
from src.sweep.storage import StudyStore, worker_identity
from src.sweep.tally import Tally
from src.sweep.teller import Teller, tell

log = logging.getLogger(__name__)
quiet.install()  # sweeps started without src.train (src.cluster's workers, tests): the same quiet (src/quiet.py)


# hydra.sweeper.max_skips_in_a_row's default: proposals skipped in a row (repeats, certain or predicted OOMs) after
# which a sweep stops, as it can launch nothing new (every remaining setting a repeat or a certain OOM); skips cost
# milliseconds each, so a sweep that only skips would otherwise make thousands of empty trials.
SKIPS_IN_A_ROW = 50


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


class SweepEngine:
    def __init__(self, config: DictConfig, arguments: list[str]) -> None:
        self.config = config
        self.sweeper = config.hydra.sweeper
        self.study_name = str(self.sweeper.study_name)
        if why := study_name_problem(self.study_name):  # before any folder, lock or store is made from it
            raise SpaceError(why)
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
        refuse_credentials(self.space, self.sweeper.enqueue_trials)  # Optuna would store them in clear
        self.distributions = {k: v for k, v in self.space.items() if isinstance(v, BaseDistribution)}
        self.fixed += [f"{k}={override_value(v)}" for k, v in self.space.items() if not isinstance(v, BaseDistribution)]
        self.custom = get_method(self.sweeper.custom_search_space) if self.sweeper.custom_search_space else None
        self.budget = float(config.hardware.vram_budget_gib)
        monotone = OmegaConf.to_container(self.sweeper.memory_monotone, resolve=True) or {}
        self.rules = LaunchRules(config, self.fixed, monotone, self.budget)
        self.lock = threading.Lock()  # this process's threads; the study's lock is self.store.lock()
        self.host = socket.gethostname()
        self.store = StudyStore(self.sweeper, self.study_name, self.study_dir, self.host, self.close_dead_run)
        self.tally = Tally(self.study_name, self.objectives[0], self.directions[0] == "maximize")
        # records each outcome in Optuna and MLflow (src/sweep/teller.py)
        self.teller = Teller(config, self.store, self.rules, self.objectives, self.directions, self.tally, self.lock)
        self.runs: SweepRuns | None = None
        self.memory: MemoryGate | None = None  # src/sweep/memory.py: predictions, predicted-OOM skips
        self.facts = SpaceFacts()
        self.ended: str | None = None  # why the sweep stopped short of n_trials: nothing left to launch
        self.skips_in_a_row = 0
        self.max_skips = int(self.sweeper.get("max_skips_in_a_row", SKIPS_IN_A_ROW))
        if self.max_skips < 0:
            raise SpaceError(
                f"hydra.sweeper.max_skips_in_a_row={self.max_skips}: must be at least 0 (0: the sweep never ends early)"
            )
        # What the trials would refuse for truncation; the sweep measures such settings and records what they cut.
        self.truncation_policy = float(config.preflight.max_truncated_answer_frac)
        # How every trial runs: a probe (hydra.sweeper.trial_overrides), and settings that cut answers measured and
        # recorded (record_truncation) instead of refused. Recorded on the parent run: promotion leaves them out.
        self.trial_overrides = [*map(str, self.sweeper.trial_overrides), "preflight.max_truncated_answer_frac=1.0"]

    # -- the study and its runs --

    def open_study(self) -> optuna.Study:
        return self.store.open(self.directions, self.distributions, self.objectives)

    def open_parent(self, study: optuna.Study) -> None:
        self.runs = SweepRuns(
            self.config.tracking.uri, self.study_name, Path(self.config.paths.mlruns_dir) / "artifacts"
        )
        tags = parent_tags(
            self.sweeper, self.objectives, self.directions, self.distributions, self.store.url, self.budget
        )
        tags["sweep.trial_overrides"] = json.dumps(self.trial_overrides)
        tags["sweep.max_truncated_answer_frac"] = json.dumps(self.truncation_policy)
        tags["sweep.truncation"] = json.dumps(self.facts.truncation)
        parent = self.runs.open_parent(study.user_attrs.get(record.PARENT_RUN_ID), tags)
        self.teller.runs = self.runs
        study.set_user_attr(record.PARENT_RUN_ID, parent)

    def close_dead_run(self, study: optuna.Study, trial: FrozenTrial) -> str | None:
        return self.runs.close_dead(trial, DEAD_WORKER) if self.runs else None

    def recover(self, study: optuna.Study) -> None:
        """Settle the trials whose worker died (StudyStore.dead): each told from its own records if they say it
        finished, else failed as killed with its MLflow run closed (and queued again if asked)."""
        for trial in self.store.dead(study):
            log_dir = self.study_dir / "trials" / f"{trial.number:03d}"
            if not self.teller.tell_from_records(study, trial, log_dir):
                self.store.fail_dead(study, trial, self.close_dead_run(study, trial))
        self.store.fail_stale(study)

    # -- the loop --

    def run(self) -> None:
        """The sweep; Ctrl-C, SIGTERM or a store it cannot write stop it cleanly (src/sweep/stop.py): running trials
        ended and recorded, the parent run closed KILLED, one line that says why and how to resume, a non-zero
        exit (128 + the signal, or 1)."""
        stopping.clear()
        try:
            with on_signals():
                self.sweep()
        except KeyboardInterrupt:  # before the workers started, or again while they recorded their trials
            stopping.interrupted()
        if stopping.is_set():
            print(stopping.message(), file=sys.stderr)
            raise SystemExit(stopping.exit_code)

    def sweep(self) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # Heartbeats are recorded by our own watch loop, not Study.optimize's thread: that is intended.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        stores.check(stores.of_sweep(self.config, self.study_dir))  # before any store is contacted or written
        tracking.fail_fast()  # a tracking server that dies mid-sweep stops it in seconds, not minutes
        slots = discover_slots(self.sweeper)  # refuses impossible slot settings before anything is recorded
        start_launcher(self.sweeper, wait=False)  # the forkserver imports the stack while the checks below run
        self.facts = check_space(self.config, self.distributions)  # the data and each value, once: before anything
        self.memory = MemoryGate(self.config, self.sweeper.memory_model, self.facts.lengths, self.budget)
        study = self.open_study()
        with self.store.lock():  # workers starting at once: one parent run, one copy of each enqueued trial
            if self.store.complete(study, self.sweeper.n_trials) and not self.soak_left(study):
                self.tally.refresh(study)
                print(self.tally.complete(self.sweeper.n_trials, self.report_command(), self.store.fresh_name()))
                return  # its parent run and its settings stay as the sweep that ran it left them
            self.open_parent(study)
            self.recover(study)
            self.enqueue(study)
        try:  # from here on, however the sweep ends, its parent run is closed
            self.prepare(slots[0])
            n_workers = min(len(slots), self.sweeper.n_jobs or len(slots))
            self.tally.refresh(study)
            self.tally.start_bar(self.sweeper)
            log.info(
                "study %s: %d slots (%s), storage %s",
                self.study_name,
                n_workers,
                ", ".join(s.name for s in slots[:n_workers]),
                redact_text(self.store.url),
            )
            workers = [threading.Thread(target=self.worker, args=(study, s), daemon=True) for s in slots[:n_workers]]
            with stopping.workers_running():  # Ctrl-C: each worker ends its trial's process group and records it
                for w in workers:
                    w.start()
                _join(workers)
            if not stopping.is_set():
                self.soak(study, slots[:n_workers])
        finally:
            self.tally.close_bar()
            self.close_parent(study)
        trials_dir = self.study_dir / "trials"
        if self.ended:
            print(self.ended)
        print(self.tally.summary(self.store.url, self.config.tracking.uri, trials_dir, self.report_command()))

    def report_command(self) -> str:
        """The command that prints this study's map (with where the stores are, when not where it looks)."""
        report = f"python -m src.report {self.study_name}"
        if self.sweeper.storage:
            report += f" --storage {self.store.url} --tracking-uri {self.config.tracking.uri}"
        return report

    def close_parent(self, study: optuna.Study) -> None:
        """The sweep's parent run is every worker's: the last one out closes it, KILLED if this sweep stopped."""
        try:
            with self.store.lock():
                self.tally.refresh(study)
                self.runs.log_counts(self.tally.counts, self.tally.counts["finished"])
                if not self.store.others_running(study):
                    self.runs.client.set_terminated(self.runs.parent, "KILLED" if stopping.is_set() else "FINISHED")
        except Exception:
            if not stopping.is_set():
                raise
            log.debug("the parent run could not be closed (the next run reopens it)", exc_info=True)

    def prepare(self, slot: Slot) -> None:
        """Before any trial, in the engine's main thread: the model built, and the forkserver that starts trials
        (hydra.sweeper.preload) started, so that it dies with the engine (src/sweep/tether.py)."""
        self.build_model(slot)
        start_launcher(self.sweeper)

    def build_model(self, slot: Slot) -> None:
        """Build the model (random models) and its 4-bit copy once, before any trial: trials then only load it,
        and no trial's peak includes the build. Once built (by an earlier sweep, or a trial), nothing is started:
        a process that imports the training stack only to find the files there costs seconds of every sweep."""
        from src import models

        # a probe that changes the model or the paths (model=..., model.dtype=..., paths.cache_dir=...) is prepared
        own = [o for o in self.trial_overrides if o.lstrip("+~").split("=")[0].split(".")[0] in ("model", "paths")]
        if not own and models.prepared(self.config.model, self.config.paths.cache_dir):
            return
        log_dir = self.study_dir / "prepare"
        cmd = [
            sys.executable,
            "-m",
            "src.models",
            *self.trial_overrides,
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

    def room(self, study: optuna.Study) -> int:
        """How many more settings may be queued: `n_trials` bounds the map's trials, queued ones included (the
        recipe's lever trials are apart: src/sweep/recipe.py)."""
        waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        queued = sum(1 for t in waiting if record.LEVER not in t.user_attrs)
        return int(self.sweeper.n_trials) - self.store.occupied(study) - queued

    def queue(self, study: optuna.Study, params: dict[str, Any], user_attrs: dict[str, Any] | None = None) -> bool:
        """Queue one setting unless the study holds it already or has no room for it; whether it has room left."""
        if self.room(study) <= 0:
            return False
        study.enqueue_trial(params, skip_if_exists=True, user_attrs=user_attrs)
        return True

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
            # The first queued setting is the user's recipe: the report answers what to change in it.
            if not self.queue(study, params, {record.RECIPE: True} if i == 0 else None):
                log.info(
                    "hydra.sweeper.enqueue_trials[%d:] not queued: hydra.sweeper.n_trials=%d bounds the map's trials",
                    i,
                    self.sweeper.n_trials,
                )
                return
        self.enqueue_edge_first(study)

    def enqueue_edge_first(self, study: optuna.Study) -> None:
        """On a grid, the settings the memory model puts nearest the budget's edge run first: they are the ones
        the map is for (and each measured one refines the model before the rest are decided)."""
        if not (self.memory and self.memory.active and isinstance(study.sampler, optuna.samplers.GridSampler)):
            return
        if any(t.state != TrialState.WAITING for t in study.get_trials(deepcopy=False)):
            return  # a resumed grid: its queue was set when it started
        if not all(isinstance(d, optuna.distributions.CategoricalDistribution) for d in self.distributions.values()):
            return
        self.memory.refresh(0)
        names = list(self.distributions)
        choices = [self.distributions[k].choices for k in names]  # a grid's space is categorical
        grid = [dict(zip(names, values, strict=True)) for values in itertools.product(*choices)]
        for params in self.memory.edge_order(grid, self.fixed):
            if not self.queue(study, params):
                return

    def worker(self, study: optuna.Study, slot: Slot) -> None:
        """One slot's loop; an error of the engine's own (a store it cannot write) stops the whole sweep cleanly."""
        try:
            self.work(study, slot)
        except Exception as exc:
            named = {
                "optuna": f"the Optuna storage {self.store.url}",
                "mlflow": f"the MLflow store {self.config.tracking.uri}",
            }
            trouble = store_trouble(exc, named)
            if trouble is not None:
                if trouble.unreachable:
                    tracking.try_once()  # the stop's own MLflow calls must not wait on a dead server
                stopping.request(redact_text(trouble.why), 1, advice=trouble.advice)
                return
            log.exception("the sweep worker on slot %s failed", slot.name)
            what = redact_text(first_line(f"{type(exc).__name__}: {exc}"))
            stopping.request(f"sweep stopped: the worker on slot {slot.name} failed: {what}", 1)

    def work(self, study: optuna.Study, slot: Slot) -> None:
        while not stopping.is_set() and self.ended is None:
            with self.store.lock():
                self.recover(study)  # a worker elsewhere may have died since: its trials are failed here
                full = self.store.full(study, self.sweeper.n_trials)
                if full and not self.store.others_running(study):
                    return
                if not full and self.exhausted(study):
                    return
                if not full:
                    trial = study.ask(self.distributions)
                    trial.set_user_attr(record.WORKER_HOST, self.host)
                    for key, value in worker_identity(os.getpid()).items():
                        trial.set_user_attr(key, value)
                    # A first heartbeat at once: a trial without one is never stale, so a worker dying
                    # before its first beat would leave it running for ever.
                    self.store.heartbeat(trial.number)
            if full:
                # Other workers' last trials still run: if one of them dies, this worker fails (or retries)
                # its trial, so the study ends at n_trials instead of stalling.
                stopping.wait(self.sweeper.heartbeat_interval_s)
                continue
            try:
                self.run_trial(study, trial, slot)
            except Exception as exc:  # the engine's own trouble: record it on the trial, keep sweeping
                if store_trouble(exc, {}) is not None:
                    raise  # a full disk: no trial is to blame, and the stores take nothing more
                self.engine_error(study, trial, exc)

    def exhausted(self, study: optuna.Study) -> bool:
        """Whether every setting of a finite space is told (measured, failed by itself, or skipped) and nothing is
        queued: a new proposal could only repeat one. Sets `ended`, the one line that says so."""
        if self.custom or not self.sweeper.skip_duplicates or not self.distributions or not self.max_skips:
            return False  # a custom space's suggestions are its own; without skips, repeats are measured again
        size = space_size(self.distributions)
        if size is None or study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return False
        names = set(self.distributions)
        told = {
            tuple(sorted((k, repr(v)) for k, v in t.params.items()))
            for t in study.get_trials(deepcopy=False, states=TOLD)
            if set(t.params) == names and record.LEVER not in t.user_attrs
        }
        if len(told) < size:
            return False
        self.ended = (
            f"sweep ended early: all {size} settings of the space are on the map after {self.store.occupied(study)} "
            f"trials of hydra.sweeper.n_trials={self.sweeper.n_trials}; nothing new left to launch"
        )
        return True

    def engine_error(self, study: optuna.Study, trial: optuna.Trial, exc: Exception) -> None:
        log.exception("trial %d: engine error", trial.number)
        frozen = self.store.get(trial.number)
        if frozen.state.is_finished():
            return  # another worker took it for dead and failed it meanwhile
        message = redact_text(first_line(str(exc)))
        self.store.set_attrs(trial.number, record.failure_fields({"kind": "other", "message": message}))
        run_id = frozen.user_attrs.get(record.RUN_ID)
        if not self.runs.close_errored(run_id, message):
            log.warning("trial %d: its MLflow run %s could not be closed", trial.number, run_id)
        tell(study, trial, state=TrialState.FAIL)

    # -- one trial --

    def run_trial(self, study: optuna.Study, trial: optuna.Trial, slot: Slot) -> None:
        # A custom space returns the overrides its suggestions stand for (its suggestions may be labels, as in
        # tests/sweep_scenarios.py); one that returns None, as hydra-optuna-sweeper's do, gets its suggestions.
        extra = self.custom(self.config, trial) if self.custom else {}
        if extra is None:
            extra = {k: v for k, v in trial.params.items() if k not in self.distributions}
        params = {**{k: v for k, v in trial.params.items() if k in self.distributions}, **extra}
        run_id = self.runs.child(trial.number, slot.name, params)
        trial.set_user_attr(record.RUN_ID, run_id)
        trial.set_user_attr(record.SLOT, slot.name)
        self.record_truncation(trial, params, run_id)
        overrides = [
            *self.trial_overrides,
            *self.fixed,
            *(f"{k}={override_value(v)}" for k, v in params.items()),
            *recipe.lever_overrides(trial),
        ]
        decision = self.gate(study, trial, overrides, run_id)
        with self.lock:
            self.skips_in_a_row = self.skips_in_a_row + 1 if decision is not None else 0
            if 0 < self.max_skips <= self.skips_in_a_row and self.ended is None:
                self.ended = (
                    f"sweep ended early: the last {self.max_skips} proposals were all skipped (repeats or certain "
                    f"OOMs: nothing new left to measure) after {self.store.occupied(study)} trials of "
                    f"hydra.sweeper.n_trials={self.sweeper.n_trials}; widen the space to measure more "
                    "(hydra.sweeper.max_skips_in_a_row=0 never ends early)"
                )
        if decision is not None:
            self.teller.skip(study, trial, run_id, decision)
            return
        log_dir = self.study_dir / "trials" / f"{trial.number:03d}"
        with self.lock:
            self.tally.counts["running"] += 1
            self.tally.show()
        try:
            outcome = self.launch(slot, trial.number, overrides, log_dir, run_id)
        finally:
            with self.lock:
                self.tally.counts["running"] -= 1
        self.teller.tell(study, trial, outcome)

    def launch(self, slot: Slot, number: int, overrides: list[str], log_dir: Path, run_id: str) -> Outcome:
        """The trial's process, through the one launcher every trial and soak takes (src/sweep/launch.py)."""
        heartbeat = lambda: self.store.heartbeat(number)  # noqa: E731
        return launch(self.runs, self.sweeper, slot, str(number), overrides, log_dir, run_id, self.budget, heartbeat)

    def gate(self, study: optuna.Study, trial: optuna.Trial, overrides: list[str], run_id: str) -> Skip | None:
        """One decision per proposal: None (launch it), or skip it as a repeat, a certain OOM or a predicted OOM
        (src/sweep/rules.py, src/sweep/memory.py; the prediction is recorded on the trial either way)."""
        original = self.rules.finished_twin(study, trial) if self.sweeper.skip_duplicates else None
        if original is not None:
            return Skip("repeat", f"same setting as trial {original.number}", original)
        dominating = self.rules.certain_oom(study, trial)
        if dominating is not None:
            return Skip("certain_oom", f"certain oom: needs at least trial {dominating.number}'s memory", dominating)
        prediction = self.predict(study, trial, overrides, run_id)
        if prediction is not None and self.memory.skips(prediction):
            return predicted_skip(prediction, self.budget)
        return None

    def predict(self, study: optuna.Study, trial: optuna.Trial, overrides: list[str], run_id: str) -> Any:
        """The memory model's prediction for the trial, recorded on it and its run before it is launched."""
        if self.memory is None or not self.memory.active:
            return None
        self.memory.refresh(len(study.get_trials(deepcopy=False, states=TOLD)))
        prediction = self.memory.predict(overrides)
        if prediction is not None:
            values = predicted_attrs(prediction)
            for key, value in values.items():
                trial.set_user_attr(key, value)
            tracking.log_metrics(self.runs.client, run_id, values)
        return prediction

    def soak_left(self, study: optuna.Study) -> bool:
        """Whether a complete study still has finalists to soak (a re-run soaks them)."""
        if int(self.sweeper.soak_top_k) <= 0:
            return False
        return bool(soak.pending(study, self.classified(), int(self.sweeper.soak_top_k)))

    def classified(self) -> Any:
        """The study as the report reads it (src/study.py): every trial classified, the stable ones ranked."""
        return load_sweep(
            self.study_name,
            Path(self.config.paths.sweeps_dir),
            self.store.url,
            float(self.sweeper.headroom_margin),
            self.config.tracking.uri,
        )

    def soak(self, study: optuna.Study, slots: list[Slot]) -> None:
        """After the map: the best stable settings train much longer (src/sweep/soak.py)."""
        soak.finalists(study, self.store, self.classified, self.sweeper, slots, self.fixed, self.runs, self.budget)

    def record_truncation(self, trial: optuna.Trial, params: dict[str, Any], run_id: str) -> None:
        """What this setting's max_seq_length cuts from the data (checked once for the space), on the trial."""
        length = params.get("data.max_seq_length", self.config.data.max_seq_length)
        shares = self.facts.truncation.get(int(length), {})
        for key, value in shares.items():
            trial.set_user_attr(key, value)
        tracking.log_metrics(self.runs.client, run_id, shares)


def space_size(distributions: dict[str, BaseDistribution]) -> int | None:
    """How many settings a space holds; None for one with a continuous knob."""
    size = 1
    for d in distributions.values():
        if isinstance(d, optuna.distributions.CategoricalDistribution):
            size *= len(d.choices)
        elif isinstance(d, optuna.distributions.IntDistribution) and not d.log:
            size *= (d.high - d.low) // d.step + 1
        elif isinstance(d, optuna.distributions.FloatDistribution) and d.step is not None:
            size *= int(round((d.high - d.low) / d.step)) + 1
        else:
            return None
    return size


def _join(workers: list[threading.Thread]) -> None:
    for w in workers:
        while w.is_alive():
            w.join(timeout=0.5)  # short waits: a signal's handler runs in this thread between them
