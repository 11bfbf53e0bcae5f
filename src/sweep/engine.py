"""The sweep's loop: one worker thread per slot asks Optuna for the next trial as soon as its slot is free (no batch
barrier), applies the launch rules, runs the trial's process and tells Optuna how it went.

- Learning (src/sweep/rules.py): a measured trial is COMPLETE; a failure caused by the setting itself (OOM,
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
  what its records say (`tell_from_records`), never failed.
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

from src import quiet, stores, tracking
from src.config import override_value, study_name_problem
from src.failures import STICKY_CUDA, first_line
from src.redact import redact_text
from src.study import classify
from src.study import load as load_sweep
from src.sweep import recipe, soak
from src.sweep.checks import SpaceFacts, check_space
from src.sweep.memory import MemoryGate, predicted_attrs
from src.sweep.process import Outcome, recorded_outcome, run_process, start_launcher, tail
from src.sweep.rules import (
    SETTING_FAILURES,
    TOLD,
    LaunchRules,
    constraint_record,
    infeasible,
    infeasible_state,
    recorded_constraints,
)
from src.sweep.runs import SweepRuns, parent_tags
from src.sweep.slots import Slot, discover_slots
from src.sweep.space import SpaceError, outside_space, refuse_credentials, split_arguments
from src.sweep.stop import RESUME, on_signals, stopping, store_trouble
from src.sweep.storage import DEAD_WORKER, StudyStore, create_time
from src.sweep.tally import Tally
from src.trial.handoff import RUN_ENV, TRIAL_ENV

log = logging.getLogger(__name__)
quiet.install()  # sweeps started without src.train (src.cluster's workers, tests): the same quiet (src/quiet.py)


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
        self.store = StudyStore(
            self.sweeper, self.study_name, self.study_dir, self.host, self.close_dead_run, self.tell_from_records
        )
        self.tally = Tally(self.study_name, self.objectives[0], self.directions[0] == "maximize")
        self.runs: SweepRuns | None = None
        self.memory: MemoryGate | None = None  # src/sweep/memory.py: predictions, predicted-OOM skips
        self.facts = SpaceFacts()
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
        parent = self.runs.open_parent(study.user_attrs.get("mlflow_parent_run_id"), tags)
        study.set_user_attr("mlflow_parent_run_id", parent)

    def close_dead_run(self, study: optuna.Study, trial: FrozenTrial) -> str | None:
        return self.runs.close_dead(trial, DEAD_WORKER) if self.runs else None

    def tell_from_records(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        """A trial whose worker died before telling Optuna: told what its own records say it measured, if they say
        it finished (its result.json in its folder, else its MLflow run, which a worker on any host can read)."""
        run_id = trial.user_attrs.get("mlflow_run_id")
        if run_id is None or self.runs is None:
            return False  # it never got as far as its own run: it did not finish
        # A live handle on the running trial, as Study.optimize makes one (the constructor Optuna advises against
        # calling directly is the one that takes an existing trial).
        live = optuna.Trial(study, self.store.trial_id(trial.number))
        because = trial.user_attrs.get("skipped.because_of")
        if because is not None or "skip.reason" in trial.user_attrs:  # a skip, decided before its worker died
            self.skip(
                study,
                live,
                run_id,
                trial.user_attrs.get("skip.reason", "repeat"),
                trial.user_attrs.get("skipped.reason", ""),
                original=self.store.get(int(because)) if because is not None else None,
                record=recorded_constraints(trial),
                failure_kind=trial.user_attrs.get("failure.kind"),
            )
            return True
        log_dir = self.study_dir / "trials" / f"{trial.number:03d}"
        outcome = recorded_outcome(log_dir, run_id) or self.runs.recorded(run_id)
        if outcome is None:
            return False
        self.runs.end(run_id, outcome.status)  # a trial killed between its result and its run's end
        self.tell(study, live, outcome)
        told = outcome.status if outcome.failure is None else f"{outcome.status}, {outcome.failure['kind']}"
        log.warning(
            "trial %d had finished (%s) when its sweep worker died: told what its records say", trial.number, told
        )
        return True

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
            self.store.recover(study)
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
            study.enqueue_trial(params, skip_if_exists=True, user_attrs={recipe.RECIPE: True} if i == 0 else None)
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
            study.enqueue_trial(params, skip_if_exists=True)

    def worker(self, study: optuna.Study, slot: Slot) -> None:
        """One slot's loop; an error of the engine's own (a store it cannot write) stops the whole sweep cleanly."""
        try:
            self.work(study, slot)
        except Exception as exc:
            named = {
                "optuna": f"the Optuna storage {self.store.url}",
                "mlflow": f"the MLflow store {self.config.tracking.uri}",
            }
            why = store_trouble(exc, named)
            if why is not None:
                stopping.request(redact_text(why), 1, advice=f"free space, then {RESUME}")
                return
            log.exception("the sweep worker on slot %s failed", slot.name)
            what = redact_text(first_line(f"{type(exc).__name__}: {exc}"))
            stopping.request(f"sweep stopped: the worker on slot {slot.name} failed: {what}", 1)

    def work(self, study: optuna.Study, slot: Slot) -> None:
        while not stopping.is_set():
            with self.store.lock():
                self.store.recover(study)  # a worker elsewhere may have died since: its trials are failed here
                full = self.store.full(study, self.sweeper.n_trials)
                if full and not self.store.others_running(study):
                    return
                if not full:
                    trial = study.ask(self.distributions)
                    trial.set_user_attr("worker.host", self.host)
                    trial.set_user_attr("worker.pid", os.getpid())
                    trial.set_user_attr("worker.started", create_time(os.getpid()))
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

    def engine_error(self, study: optuna.Study, trial: optuna.Trial, exc: Exception) -> None:
        log.exception("trial %d: engine error", trial.number)
        frozen = self.store.get(trial.number)
        if frozen.state.is_finished():
            return  # another worker took it for dead and failed it meanwhile
        message = redact_text(first_line(str(exc)))
        self.store.set_attrs(trial.number, {"failure.kind": "other", "failure.message": message})
        if not self.runs.close_errored(frozen.user_attrs.get("mlflow_run_id"), message):
            log.warning(
                "trial %d: its MLflow run %s could not be closed", trial.number, frozen.user_attrs.get("mlflow_run_id")
            )
        _tell(study, trial, state=TrialState.FAIL)

    # -- one trial --

    def run_trial(self, study: optuna.Study, trial: optuna.Trial, slot: Slot) -> None:
        # A custom space returns the overrides its suggestions stand for (its suggestions may be labels, as in
        # tests/sweep_scenarios.py); one that returns None, as hydra-optuna-sweeper's do, gets its suggestions.
        extra = self.custom(self.config, trial) if self.custom else {}
        if extra is None:
            extra = {k: v for k, v in trial.params.items() if k not in self.distributions}
        params = {**{k: v for k, v in trial.params.items() if k in self.distributions}, **extra}
        run_id = self.runs.child(trial.number, slot.name, params)
        trial.set_user_attr("mlflow_run_id", run_id)
        trial.set_user_attr("sweep.slot", slot.name)
        self.record_truncation(trial, params, run_id)
        original = self.rules.finished_twin(study, trial) if self.sweeper.skip_duplicates else None
        if original is not None:
            self.skip(study, trial, run_id, "repeat", f"same setting as trial {original.number}", original=original)
            return
        dominating = self.rules.certain_oom(study, trial)
        if dominating is not None:
            reason = f"certain oom: needs at least trial {dominating.number}'s memory"
            self.skip(study, trial, run_id, "certain_oom", reason, original=dominating)
            return
        overrides = [
            *self.trial_overrides,
            *self.fixed,
            *(f"{k}={override_value(v)}" for k, v in params.items()),
            *recipe.lever_overrides(trial),
        ]
        prediction = self.predict(study, trial, overrides, run_id)
        if prediction is not None and self.memory.skips(prediction):
            self.skip_predicted(study, trial, prediction, run_id)
            return
        log_dir = self.study_dir / "trials" / f"{trial.number:03d}"
        env = {**slot.env, RUN_ENV: run_id, TRIAL_ENV: str(trial.number)}
        with self.lock:
            self.tally.counts["running"] += 1
            self.tally.show()
        try:
            outcome = self.launch(trial.number, overrides, log_dir, env, run_id)
        finally:
            with self.lock:
                self.tally.counts["running"] -= 1
        self.tell(study, trial, outcome)

    def launch(self, number: int, overrides: list[str], log_dir: Path, env: dict[str, str], run_id: str) -> Outcome:
        """Run the trial's process (again with CUDA_LAUNCH_BLOCKING=1 after a sticky CUDA error) and end its MLflow
        run where the process could not."""
        heartbeat = lambda: self.store.heartbeat(number)  # noqa: E731
        outcome = run_process(overrides, log_dir, env, self.sweeper, heartbeat)
        tracking.set_tags(self.runs.client, run_id, {"trial.launcher": outcome.launcher})
        if outcome.failure and outcome.failure["kind"] in STICKY_CUDA and self.sweeper.launch_blocking_rerun:
            outcome = self.rerun_launch_blocking(overrides, log_dir, env, run_id, outcome, heartbeat)
        if not outcome.recorded:
            tracking.log_text(self.runs.client, run_id, tail(log_dir / "stderr.log"), "stderr_tail.txt")
            tracking.log_metrics(self.runs.client, run_id, {**outcome.metrics, "vram_budget_gib": self.budget})
            status = "KILLED" if outcome.failure["kind"] in ("killed", "timeout") else "FAILED"
            tracking.close_failed(self.runs.client, run_id, outcome.failure, status=status)
        return outcome

    def skip(
        self,
        study: optuna.Study,
        trial: optuna.Trial,
        run_id: str,
        why: str,
        reason: str,
        original: FrozenTrial | None = None,
        record: list[float] | None = None,
        failure_kind: str | None = None,
    ) -> None:
        """Not launched; every skip goes through here. `why` is the contract's `skip.reason` (repeat, certain_oom,
        predicted_oom), `reason` says it in words. `original`: the trial that already tells what this setting does
        (its failure kind and constraint record become this one's); else `record` and `failure_kind` say it.
        Nothing was measured: a violated record is told as an infeasible setting is (`tell_infeasible`), anything
        else PRUNED without a value. Written on the trial first, so a worker that dies midway is redone alike."""
        attrs: dict[str, Any] = {"trial.status": "skipped", "skip.reason": why, "skipped.reason": reason}
        metrics: dict[str, Any] = {}
        if original is not None:
            attrs["skipped.because_of"] = original.number
            failure_kind = original.user_attrs.get("failure.kind", failure_kind)
            record, metrics = recorded_constraints(original), dict(original.user_attrs)
        if failure_kind is not None:
            attrs["failure.kind"] = failure_kind
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if record is not None:
            self.store.set_constraints(trial.number, record)
        tags = {k: v for k, v in attrs.items() if k != "failure.kind"}
        tracking.set_tags(self.runs.client, run_id, tags)
        self.runs.mark_skipped(run_id, trial.number, trial.params, why, original.number if original else None)
        self.runs.client.set_terminated(run_id, "FINISHED")
        if infeasible(record):
            self.tell_infeasible(study, trial, record, metrics)
        else:
            _tell(study, trial, state=TrialState.PRUNED)
        self.finished(study)

    def tell_infeasible(
        self, study: optuna.Study, trial: optuna.Trial, record: list[float], metrics: dict[str, Any]
    ) -> None:
        """A setting that cannot run: its violated constraint record, in the state its sampler learns from
        (src/sweep/rules.py: PRUNED without a value for TPE, COMPLETE with the worst values for NSGA-II or GP)."""
        self.store.set_constraints(trial.number, record)
        if infeasible_state(study.sampler) == TrialState.PRUNED:
            _tell(study, trial, state=TrialState.PRUNED)
        else:
            _tell(study, trial, self.rules.worst(metrics, self.objectives, self.directions))

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

    def skip_predicted(self, study: optuna.Study, trial: optuna.Trial, prediction: Any, run_id: str) -> None:
        """Not launched: the memory model puts it beyond the budget by more than its own error. Told with the
        predicted violation as its constraint record, so the sampler learns the region as it would from an OOM."""
        reason = (
            f"predicted oom: {prediction.device_gib:.1f} GiB on the card (model error ±{prediction.error:.0%}) "
            f"for a {self.budget:g} GiB budget"
        )
        record = constraint_record(vram_budget=prediction.device_gib / self.budget - 1)
        self.skip(study, trial, run_id, "predicted_oom", reason, record=record, failure_kind="oom")

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
        """After the map: the best stable settings train much longer (src/sweep/soak.py). The last worker out soaks
        the finalists not soaked yet; a re-run of a complete study soaks what was left."""
        top_k = int(self.sweeper.soak_top_k)
        if top_k <= 0:
            return
        with self.store.lock():
            if self.store.others_running(study):
                return
            sweep = self.classified()
            rows = soak.pending(study, sweep, top_k)
            if not sweep.ranked():
                print("soak: no setting to soak (none is stable within the truncation policy)", flush=True)
            for row in rows:  # claimed: another worker finishing now does not soak them too
                study.set_user_attr(soak.KEY.format(row.number), {"status": "running"})
        if not rows:
            return
        print(
            f"soak: trial(s) {', '.join(str(r.number) for r in rows)} train at least one epoch and "
            f"{float(self.sweeper.soak_minutes):g} min each (logs: {self.study_dir / 'soak'})",
            flush=True,
        )
        for record in soak.run(study, sweep, rows, slots, self.fixed, self.runs, self.sweeper, self.budget):
            print(f"soak: trial {record['trial']} {record['status']}: {record['detail']}", flush=True)

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
        tracking.set_tags(self.runs.client, run_id, tags)
        if second.recorded:
            self.runs.client.set_terminated(run_id, "FAILED")
        first.recorded = first.recorded and second.recorded
        first.failure["launch_blocking_kind"] = tags["failure.launch_blocking.kind"]
        return first

    def tell(self, study: optuna.Study, trial: optuna.Trial, outcome: Outcome) -> None:
        m = outcome.metrics
        for key, value in {**m, **_failure_attrs(outcome.failure)}.items():
            trial.set_user_attr(key, value)
        trial.set_user_attr("trial.status", outcome.status)
        trial.set_user_attr("trial.launcher", outcome.launcher)
        if outcome.attention_kernel:
            trial.set_user_attr("attention.kernel", outcome.attention_kernel)
        kind = outcome.failure["kind"] if outcome.failure else None
        if outcome.status == "ok" and all(o in m for o in self.objectives):
            self.store.set_constraints(trial.number, self.rules.measured(m))
            _tell(study, trial, [m[o] for o in self.objectives])
        elif kind in SETTING_FAILURES:
            self.tell_infeasible(study, trial, self.rules.violation(kind, m), m)
        else:
            _tell(study, trial, state=TrialState.FAIL)
        if not (kind == "killed" and stopping.is_set()):  # ended by the sweep's stop: it says nothing of its setting
            self.after_recipe(study, trial)
        self.finished(study)

    def record_truncation(self, trial: optuna.Trial, params: dict[str, Any], run_id: str) -> None:
        """What this setting's max_seq_length cuts from the data (checked once for the space), on the trial."""
        length = params.get("data.max_seq_length", self.config.data.max_seq_length)
        shares = self.facts.truncation.get(int(length), {})
        for key, value in shares.items():
            trial.set_user_attr(key, value)
        tracking.log_metrics(self.runs.client, run_id, shares)

    def after_recipe(self, study: optuna.Study, trial: optuna.Trial) -> None:
        """The user's recipe told and not stable: measure the memory levers on it (src/sweep/recipe.py)."""
        if not trial.user_attrs.get(recipe.RECIPE):
            return
        frozen = self.store.get(trial.number)
        verdict, detail = classify(frozen, float(self.sweeper.headroom_margin))
        if verdict == "stable":
            return
        queued = recipe.queue_levers(study, self.config, frozen)
        if queued:
            log.info("the recipe (trial %d) is %s (%s): measuring %s", trial.number, verdict, detail, queued)

    def finished(self, study: optuna.Study) -> None:
        with self.lock:
            self.tally.refresh(study)
            self.runs.log_counts(self.tally.counts, self.tally.counts["finished"])
            self.tally.show(finished=1)


def _join(workers: list[threading.Thread]) -> None:
    for w in workers:
        while w.is_alive():
            w.join(timeout=0.5)  # short waits: a signal's handler runs in this thread between them


def _tell(study: optuna.Study, trial: Any, values: Any = None, state: TrialState | None = None) -> None:
    """study.tell, tolerating GridSampler's study.stop() once its grid is exhausted: that raises outside
    Study.optimize, after the trial was told (stopping is n_trials' job here anyway)."""
    try:
        study.tell(trial, values, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


def _failure_attrs(failure: dict[str, Any] | None) -> dict[str, Any]:
    if not failure:
        return {}
    # What a failed process printed may quote a credential (a storage URL in a traceback): the study keeps none.
    return {f"failure.{k}": redact_text(v) if isinstance(v, str) else v for k, v in failure.items() if v is not None}
