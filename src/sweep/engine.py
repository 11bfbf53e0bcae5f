"""The sweep's loop: one worker thread per slot asks Optuna for the next trial as soon as its slot is free (no batch
barrier), lets the gate decide (src/sweep/gate.py: launch, or skip as a repeat, a certain or a predicted OOM), runs
the trial's process through the one launcher (src/sweep/launch.py) and lets the teller record how it went
(src/sweep/teller.py). Three phases: the map (with the recipe's levers), the search for a setting when the recipe is
not stable within the policies (src/sweep/journey.py), the soak of the finalists (src/sweep/soak.py).

- Learning (src/sweep/rules.py, told by src/sweep/teller.py): a measured trial is COMPLETE; a failure caused by the setting itself (OOM,
  refused data or config) carries a violated constraint in Optuna's constraint record (what the trial needed over
  the budget), PRUNED without a value where the sampler learns from that (TPE), so the sampler ranks that region
  below every feasible one and no tool reads a value that was never measured; a skip (`skip`) is told as its
  origin; a skipped repeat of a measured setting is PRUNED; other failures are FAIL. Nothing a trial does stops
  the sweep.
- A study that already holds `n_trials` finished trials (and no search or finalist left) is not swept again: one
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

import json
import logging
import os
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.trial import FrozenTrial

from src import quiet, record, stores, tracking
from src.config import override_value, study_name_problem
from src.failures import first_line
from src.knobs import with_overrides
from src.readings import best_line
from src.record import DEAD_WORKER
from src.redact import redact_text
from src.study import load as load_sweep
from src.sweep import faster, journey, prepare, recipe, seeds, soak, timing
from src.sweep.checks import check_space
from src.sweep.gate import Gate
from src.sweep.launch import launch
from src.sweep.ledger import CardLedger
from src.sweep.memory import MemoryGate
from src.sweep.process import start_launcher
from src.sweep.rules import LaunchRules
from src.sweep.runs import SweepRuns, parent_tags
from src.sweep.slots import Slot, devices, discover_slots
from src.sweep.space import SpaceError, custom_space, refuse_changed, sweep_space
from src.sweep.stop import logged_to, on_signals, stopping, store_trouble
from src.sweep.storage import StudyStore, worker_identity
from src.sweep.tally import Tally
from src.sweep.teller import Teller

log = logging.getLogger(__name__)
quiet.install()  # sweeps started without src.train (src.cluster's workers, tests): the same quiet (src/quiet.py)


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _objectives(sweeper: Any) -> tuple[list[str], list[str]]:
    """(objectives, directions): one direction per objective."""
    objectives, directions = _as_list(sweeper.objectives), _as_list(sweeper.direction)
    if bad := [d for d in directions if d not in ("maximize", "minimize")]:  # Optuna's error was a raw traceback
        raise SpaceError(f"hydra.sweeper.direction={directions}: {bad[0]!r} is not maximize or minimize")
    if len(directions) != len(objectives) or not objectives:
        raise SpaceError(
            f"hydra.sweeper.direction has {len(directions)} entries for {len(objectives)} objectives "
            f"{objectives}; give one direction (maximize/minimize) per objective"
        )
    return objectives, directions


class SweepEngine:
    """The loop (ask, gate, launch, tell; src/sweep/gate.py decides, src/sweep/teller.py records), then the search for
    a setting when the recipe is not stable within the policies (src/sweep/journey.py), then the soak."""

    def __init__(self, config: DictConfig, arguments: list[str]) -> None:
        self.config = config
        self.sweeper = config.hydra.sweeper
        self.study_name = str(self.sweeper.study_name)
        if why := study_name_problem(self.study_name):  # before any folder, lock or store is made from it
            raise SpaceError(why)
        self.study_dir = Path(config.paths.sweeps_dir) / self.study_name
        self.objectives, self.directions = _objectives(self.sweeper)
        self.fixed, self.distributions = sweep_space(self.sweeper, arguments)
        self.custom = custom_space(self.sweeper.custom_search_space)
        self.budget = float(config.hardware.vram_budget_gib)
        monotone = OmegaConf.to_container(self.sweeper.memory_monotone, resolve=True) or {}
        self.rules = LaunchRules(config, self.fixed, monotone, self.budget)
        self.gate = Gate(self.sweeper, self.rules, self.budget)
        self.lock = threading.Lock()  # this process's threads; the study's lock is self.store.lock()
        self.ledger: CardLedger | None = None  # the shared cards' memory, once the slots are known
        self.host = socket.gethostname()
        self.store = StudyStore(self.sweeper, self.study_name, self.study_dir, self.host, self.close_dead_run)
        # How every trial runs: a probe (hydra.sweeper.trial_overrides), and settings that cut answers measured and
        # recorded (the gate's facts) instead of refused. Recorded on the parent run: promotion leaves them out.
        self.truncation_policy = float(config.preflight.max_truncated_answer_frac)
        maximize, margin = self.directions[0] == "maximize", float(self.sweeper.headroom_margin)
        self.tally = Tally(self.study_name, self.objectives[0], maximize, margin, self.truncation_policy)
        # records each outcome in Optuna and MLflow (src/sweep/teller.py)
        self.teller = Teller(config, self.store, self.rules, self.objectives, self.directions, self.tally, self.lock)
        self.runs: SweepRuns | None = None
        self.ended: str | None = None  # why the sweep stopped short of n_trials: nothing left to launch
        self.trial_overrides = [*map(str, self.sweeper.trial_overrides), "preflight.max_truncated_answer_frac=1.0"]

    # -- the study and its runs --

    def open_study(self) -> optuna.Study:
        refuse_changed(self.store.url, self.study_name, self.distributions, self.study_dir.parent)  # a resumed study
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
        tags["sweep.truncation"] = json.dumps(self.gate.facts.truncation)
        parent = self.runs.open_parent(study.user_attrs.get(record.PARENT_RUN_ID), tags)
        self.teller.runs = self.runs
        study.set_user_attr(record.PARENT_RUN_ID, parent)

    def close_dead_run(self, study: optuna.Study, trial: FrozenTrial) -> str | None:
        return self.runs.close_dead(trial, DEAD_WORKER) if self.runs else None

    def recover(self, study: optuna.Study) -> None:
        """Settle the trials whose worker died (Teller.recover)."""
        self.teller.recover(study, self.study_dir / "trials", self.close_dead_run)

    # -- the loop --

    def run(self) -> None:
        """The sweep; Ctrl-C, SIGTERM or a store it cannot write stop it cleanly (src/sweep/stop.py): running trials
        ended and recorded, the parent run closed KILLED, one line that says why and how to resume, a non-zero
        exit (128 + the signal, or 1)."""
        stopping.clear()
        try:
            with on_signals(), logged_to(self.study_dir):  # the stores' libraries log to sweeps/<study>/sweep.log
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
        # the data, each value, and the first trial's config (a fixed setting every trial would refuse), once
        self.gate.facts = check_space(self.config, self.distributions, [*self.trial_overrides, *self.fixed])
        self.gate.memory = MemoryGate(self.config, self.sweeper.memory_model, self.gate.facts.lengths, self.budget)
        study = self.open_study()
        with self.store.lock():  # workers starting at once: one parent run, one copy of each enqueued trial
            if self.store.complete(study, self.sweeper.n_trials) and not left_to_do(
                self.sweeper, study, self.classified
            ):
                self.tally.refresh(study)
                print(self.tally.complete(self.sweeper.n_trials, self.report_command(), self.store.fresh_name()))
                return  # its parent run and its settings stay as the sweep that ran it left them
            self.open_parent(study)
            faster.record_step(study, self.config)  # what one optimizer step trains on, where trials do not say
            self.recover(study)
            seeds.enqueue(study, self.store, self.sweeper, self.distributions, self.gate.memory, self.fixed)
        try:  # from here on, however the sweep ends, its parent run is closed
            prepare.build_model(self.config, self.trial_overrides, self.fixed, self.study_dir, slots[0])
            start_launcher(self.sweeper)  # started here, so it dies with the engine (src/sweep/tether.py)
            slots = slots[: min(len(slots), self.sweeper.n_jobs or len(slots))]
            self.ledger = CardLedger.for_slots(slots)  # trials sharing a card: as many at once as its memory holds
            log.info("study %s: %d slots (%s), storage %s", self.study_name, len(slots),
                     ", ".join(s.name for s in slots), redact_text(self.store.url))  # fmt: skip
            self.tally.refresh(study)
            self.tally.start_bar(self.sweeper)
            self.run_workers(study, slots)  # the map, and the recipe's levers
            for stage in (journey.search_once, faster.search_once):  # the search, then the same model faster
                if not stopping.is_set() and self.search(study, stage):
                    self.run_workers(study, slots)
            if not stopping.is_set():  # then the finalists that train the same model as the reference, soaked
                self.tally.close_bar()
                finalists(self, study, slots)
        finally:
            self.tally.close_bar()
            self.close_parent(study)
            for line in self.ledger.summary() if self.ledger else []:
                log.info(line)
        if self.ended:
            print(self.ended)
        best = None if self.ended or stopping.is_set() else _best_said(self.classified)
        print(
            self.tally.summary(
                self.store.url, self.config.tracking.uri, self.study_dir / "trials", self.report_command(), best
            )
        )

    def run_workers(self, study: optuna.Study, slots: list[Slot]) -> None:
        """One worker thread per slot until the study is full and nothing of it runs here."""
        workers = [threading.Thread(target=self.worker, args=(study, s), daemon=True) for s in slots]
        with stopping.workers_running():  # Ctrl-C: each worker ends its trial's process group and records it
            for w in workers:
                w.start()
            _join(workers)

    def report_command(self) -> str:
        return report_command(self.sweeper, self.study_name, self.store.url, str(self.config.tracking.uri))

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

    def worker(self, study: optuna.Study, slot: Slot) -> None:
        """One slot's loop; an error of the engine's own (a store it cannot write) stops the whole sweep cleanly."""
        try:
            self.work(study, slot)
        except Exception as exc:
            _stop_for(exc, slot, self.store.url, str(self.config.tracking.uri))

    def work(self, study: optuna.Study, slot: Slot) -> None:
        while not stopping.is_set() and self.ended is None:
            with self.store.lock():
                self.recover(study)  # a worker elsewhere may have died since: its trials are failed here
                full = self.store.full(study, self.sweeper.n_trials)
                if full and not self.store.others_running(study):
                    return
                if not full:
                    ended = self.gate.exhausted(
                        study, self.distributions, bool(self.custom), self.store.occupied(study)
                    )
                    if ended:
                        self.ended = ended
                        return
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
                self.teller.engine_error(study, trial, exc)

    # -- one trial --

    def run_trial(self, study: optuna.Study, trial: optuna.Trial, slot: Slot) -> None:
        params = _params(self.custom, self.config, trial, self.distributions)
        lever = recipe.lever_overrides(trial)
        of = trial.user_attrs.get(record.LEVER_OF)
        recipe_params = self.store.get(of).params if of is not None else None
        # the second stage's settings run alone on their card (below): their slot is the card, not a share of it
        where = slot.name.split("#", 1)[0] if trial.user_attrs.get(record.FASTER) else slot.name
        run_id = self.runs.child(trial.number, where, params, lever, recipe_params)
        trial.set_user_attr(record.RUN_ID, run_id)
        trial.set_user_attr(record.SLOT, where)
        self.gate.record_facts(trial, with_overrides(params, lever), run_id, self.runs)
        changed = {o.partition("=")[0].lstrip("+~") for o in lever}  # a lever's value wins over the param's
        kept = [f"{k}={override_value(v)}" for k, v in params.items() if k not in changed]
        overrides = [*self.trial_overrides, *self.fixed, *kept, *lever]
        decision = self.gate.decide(study, trial, overrides, run_id, self.runs)
        self.ended = self.ended or self.gate.count(decision, self.store.occupied(study))
        if decision is not None:
            self.teller.skip(study, trial, run_id, decision)
            return
        log_dir = self.study_dir / "trials" / f"{trial.number:03d}"
        with self.lock:
            self.tally.counts["running"] += 1
            self.tally.show()
        try:  # through the one launcher every trial and soak takes (src/sweep/launch.py)
            beat = lambda: self.store.heartbeat(trial.number)  # noqa: E731
            args = (self.runs, self.sweeper, slot, str(trial.number), overrides, log_dir, run_id, self.budget, beat)
            # the second stage's settings are read alone on the card: their speed is what they are for
            alone = bool(trial.user_attrs.get(record.FASTER))
            outcome = launch(*args, self.ledger, self.gate.share(trial.number), alone=alone)
        finally:
            with self.lock:
                self.tally.counts["running"] -= 1
        self.teller.tell(study, trial, outcome)

    # -- after the map --

    def search(self, study: optuna.Study, stage: Any) -> bool:
        """Settings a stage chooses, queued (src/sweep/journey.py: the recipe unstable; faster.py: same model)."""
        args = (self.config, self.gate.memory, self.gate.facts, self.fixed, self.distributions, self.budget)
        if not stage(study, self.store, self.classified, *args):
            return False
        self.tally.start_bar(self.sweeper)
        return True

    def classified(self) -> Any:
        """The study as the report reads it (src/study.py): every trial classified, the stable ones ranked."""
        where = (Path(self.config.paths.sweeps_dir), self.store.url, float(self.sweeper.headroom_margin))
        return load_sweep(self.study_name, *where, self.config.tracking.uri)


def finalists(engine: SweepEngine, study: optuna.Study, slots: list[Slot]) -> None:
    """After the map, the search and the second stage: the finalists the soak would take, checked to train the
    reference's model and timed alone (round after round: `settle`), then soaked."""
    e, probe = engine, [*engine.trial_overrides, *engine.fixed]
    settle(
        lambda: faster.check_finalists(study, e.store, e.classified, e.sweeper, e.fixed, slots[0].env),
        lambda: timing.finalists(study, e.store, e.classified, e.sweeper, slots, probe, e.runs, e.budget, e.ledger),
    )
    soak.finalists(study, e.store, e.classified, e.sweeper, slots, e.fixed, e.runs, e.budget, e.ledger)


def settle(*stages: Callable[[], list]) -> None:
    """The finalists' check and timing, in turn, until a round of both does nothing: a timed median can move a
    finalist that was never checked or timed into the first `soak_top_k` (its one reading beat a median), and the
    soak must not take it so. Each trial is checked and timed once: a few rounds at most."""
    for _ in range(2 * len(stages) + 2):
        if not [done for stage in stages if (done := stage())] or stopping.is_set():
            return


def _best_said(classified: Any) -> str | None:
    """The closing line's best as the report reads it (src.study.best_line); "" where nothing stable is within the
    policies; None where the study cannot be read now (the tally's own best is said instead)."""
    try:
        return best_line(classified()) or ""
    except Exception as exc:  # noqa: BLE001 - only the closing line: the tally's reading stands in
        log.debug("the closing line's best from the tally (%s)", exc)
        return None


def left_to_do(sweeper: DictConfig, study: optuna.Study, classified: Any) -> bool:
    """Whether a complete study still has a search, a second stage, finalists to check, time or soak (a re-run does
    them); `classified`: the engine's reading of the study."""
    if int(sweeper.recommend_trials) <= 0 and int(sweeper.soak_top_k) <= 0:
        return False
    sweep, top_k = classified(), int(sweeper.soak_top_k)
    if int(sweeper.recommend_trials) > 0 and journey.left(study, sweep):
        return True
    on_gpu = bool(devices(sweeper))
    if on_gpu and int(sweeper.speed_trials) > 0 and faster.pending(study, sweep):
        return True
    if int(sweeper.same_model_steps) > 0 and faster.to_check(sweep, top_k)[1]:
        return True
    if on_gpu and int(sweeper.get("timing_repeats", 0)) > 0 and timing.to_time(sweep, top_k):
        return True
    return top_k > 0 and bool(soak.pending(study, sweep, top_k))


def _params(custom: Any, config: DictConfig, trial: optuna.Trial, distributions: dict[str, Any]) -> dict[str, Any]:
    """A trial's settings (config key -> value). A custom space returns the overrides its suggestions stand for (its
    suggestions may be labels, as in tests/sweep_scenarios.py: then recorded as `sweep.settings`); one that returns
    None, as hydra-optuna-sweeper's do, gets its suggestions."""
    extra = custom(config, trial) if custom else {}
    if extra is None:
        extra = {k: v for k, v in trial.params.items() if k not in distributions}
    params = {**{k: v for k, v in trial.params.items() if k in distributions}, **extra}
    if custom and params != trial.params:  # labels: what they stood for is recorded, for the soak to train again
        trial.set_user_attr(record.SETTINGS, params)
    return params


def _stop_for(exc: Exception, slot: Slot, storage_url: str, tracking_uri: str) -> None:
    """A worker's own error stops the whole sweep cleanly, with one line: a store it cannot write (a full disk, a
    server gone) says which and what to do; anything else names the slot and the error."""
    trouble = store_trouble(
        exc, {"optuna": f"the Optuna storage {storage_url}", "mlflow": f"the MLflow store {tracking_uri}"}
    )
    if trouble is not None:
        if trouble.unreachable:
            tracking.try_once()  # the stop's own MLflow calls must not wait on a dead server
        stopping.request(redact_text(trouble.why), 1, advice=trouble.advice)
        return
    log.exception("the sweep worker on slot %s failed", slot.name)
    what = redact_text(first_line(f"{type(exc).__name__}: {exc}"))
    stopping.request(f"sweep stopped: the worker on slot {slot.name} failed: {what}", 1)


def report_command(sweeper: Any, study_name: str, storage_url: str, tracking_uri: str) -> str:
    """The command that prints this study's map (with where the stores are, when not where it looks)."""
    report = f"python -m src.report {study_name}"
    if sweeper.storage:
        report += f" --storage {storage_url} --tracking-uri {tracking_uri}"
    return report


def _join(workers: list[threading.Thread]) -> None:
    for w in workers:
        while w.is_alive():
            w.join(timeout=0.5)  # short waits: a signal's handler runs in this thread between them
