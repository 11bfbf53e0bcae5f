"""The sweep's loop: one worker thread per slot asks Optuna for the next trial as soon as its slot is free (no batch
barrier), applies the launch rules, runs the trial's process and tells Optuna how it went.

- Learning: failures caused by the setting itself (OOM, refused data or config) are told as COMPLETE with a
  violated constraint (measured: what the trial needed over the budget), so TPE and NSGA-II rank that region
  below every feasible one; other failures are FAIL. Nothing a trial does stops the sweep.
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

from src import stores, tracking
from src.config import override_value
from src.failures import MEMORY, STICKY_CUDA, first_line
from src.redact import redact_text
from src.study import classify
from src.sweep import recipe
from src.sweep.checks import SpaceFacts, check_space
from src.sweep.process import Outcome, recorded_outcome, run_process, tail
from src.sweep.rules import SETTING_FAILURES, LaunchRules
from src.sweep.runs import SweepRuns, parent_tags
from src.sweep.slots import Slot, discover_slots
from src.sweep.space import outside_space, refuse_credentials, split_arguments
from src.sweep.stop import RESUME, on_signals, stopping, store_trouble
from src.sweep.storage import DEAD_WORKER, StudyStore, create_time
from src.sweep.tally import Tally
from src.trial.handoff import RUN_ENV, TRIAL_ENV

log = logging.getLogger(__name__)


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


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
        self.facts = SpaceFacts()
        # What the trials would refuse for truncation; the sweep measures such settings and records what they cut.
        self.truncation_policy = float(config.preflight.max_truncated_answer_frac)
        # How every trial runs: a probe (hydra.sweeper.trial_overrides), and settings that cut answers measured and
        # recorded (record_truncation) instead of refused. Recorded on the parent run: promotion leaves them out.
        self.trial_overrides = [*map(str, self.sweeper.trial_overrides), "preflight.max_truncated_answer_frac=1.0"]

    # -- the study and its runs --

    def open_study(self) -> optuna.Study:
        return self.store.open(self.directions, self.distributions)

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
        if because is not None:  # a skip, decided and written on the trial before its worker died
            self.skip(study, live, self.store.get(int(because)), run_id, trial.user_attrs.get("skipped.reason", ""))
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
        self.facts = check_space(self.config, self.distributions)  # the data and each value, once: before anything
        study = self.open_study()
        with self.store.lock():  # workers starting at once: one parent run, one copy of each enqueued trial
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
        finally:
            self.tally.close_bar()
            self.close_parent(study)
        trials_dir = self.study_dir / "trials"
        print(self.tally.summary(self.store.url, self.config.tracking.uri, trials_dir, bool(self.sweeper.storage)))

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
        """Build the model (random models) and its 4-bit copy once, before any trial: trials then only load it,
        and no trial's peak includes the build."""
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
        run_id = self.runs.child(trial.number, slot.name)
        trial.set_user_attr("mlflow_run_id", run_id)
        trial.set_user_attr("sweep.slot", slot.name)
        self.record_truncation(trial, params, run_id)
        original = self.rules.finished_twin(study, trial) if self.sweeper.skip_duplicates else None
        if original is not None:
            self.skip(study, trial, original, run_id, f"same setting as trial {original.number}")
            return
        dominating = self.rules.certain_oom(study, trial)
        if dominating is not None:
            reason = f"certain oom: needs at least trial {dominating.number}'s memory"
            self.skip(study, trial, dominating, run_id, reason)
            return
        overrides = [
            *self.trial_overrides,
            *self.fixed,
            *(f"{k}={override_value(v)}" for k, v in params.items()),
            *recipe.lever_overrides(trial),
        ]
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

    def skip(self, study: optuna.Study, trial: optuna.Trial, original: FrozenTrial, run_id: str, reason: str) -> None:
        """Not launched: trial `original` already tells what this setting does; its outcome is told again."""
        trial.set_user_attr("trial.status", "skipped")
        trial.set_user_attr("skipped.because_of", original.number)
        trial.set_user_attr("skipped.reason", reason)
        if "failure.kind" in original.user_attrs:
            trial.set_user_attr("failure.kind", original.user_attrs["failure.kind"])
        for key, value in original.constraints.items():
            trial.set_constraint(key, value)
        tags = {"trial.status": "skipped", "skipped.because_of": original.number, "skipped.reason": reason}
        tracking.set_tags(self.runs.client, run_id, tags)
        self.runs.client.set_terminated(run_id, "FINISHED")
        _tell(study, trial, original.values)
        self.finished(study)

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
            trial.set_constraint("vram_budget", m.get("peak_vram_reserved_gib", 0.0) / self.budget - 1.0)
            _tell(study, trial, [m[o] for o in self.objectives])
        elif kind in SETTING_FAILURES:
            trial.set_constraint("vram_budget" if kind in MEMORY else "valid_setting", self.rules.violation(kind, m))
            worst = [0.0 if d == "maximize" else float("inf") for d in self.directions]
            values = [
                m.get(o, w) if o.startswith("peak_vram") else w for o, w in zip(self.objectives, worst, strict=True)
            ]
            _tell(study, trial, values)
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
