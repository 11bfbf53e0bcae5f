"""The sweep's teller: one outcome of a trial recorded in Optuna and in MLflow, whatever decided it (a launched
trial's process, a skip the launch rules decided, a trial a dead worker left that its own records tell).

- A measured trial is COMPLETE with its objectives and its measured constraint record; a failure of the setting
  itself (src/sweep/rules.py SETTING_FAILURES) is told infeasible, in the state its sampler learns from; any other
  failure is FAIL. A skip is told as its origin (or its predicted record), PRUNED when nothing says it is
  infeasible. Failures' words are redacted before the study keeps them.
- The user's recipe, told and not stable, queues the memory levers (src/sweep/recipe.py).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from src import record, tracking
from src.failures import first_line
from src.record import Outcome
from src.redact import redact_text
from src.study import classify
from src.sweep import recipe
from src.sweep.process import recorded_outcome
from src.sweep.rules import (
    SETTING_FAILURES,
    LaunchRules,
    Skip,
    infeasible,
    infeasible_state,
    recorded_constraints,
)
from src.sweep.stop import stopping
from src.sweep.storage import StudyStore
from src.sweep.tally import Tally

log = logging.getLogger(__name__)


class Teller:
    def __init__(
        self,
        config: DictConfig,
        store: StudyStore,
        rules: LaunchRules,
        objectives: list[str],
        directions: list[str],
        tally: Tally,
        lock: threading.Lock,
    ) -> None:
        self.config = config
        self.store = store
        self.rules = rules
        self.objectives = objectives
        self.directions = directions
        self.tally = tally
        self.lock = lock  # this process's threads (the tally)
        self.budget = float(config.hardware.vram_budget_gib)
        self.runs: Any = None  # the sweep's MLflow runs (src/sweep/runs.py), once its parent run is open

    def tell(self, study: optuna.Study, trial: optuna.Trial, outcome: Outcome) -> None:
        """A launched trial's outcome."""
        self.lever_param(trial)
        m = outcome.metrics
        for key, value in record.attrs_of(outcome).items():
            # What a failed process printed may quote a credential (a storage URL in a traceback): the study keeps
            # none.
            is_failure = key.startswith(record.FAILURE) and isinstance(value, str)
            trial.set_user_attr(key, redact_text(value) if is_failure else value)
        kind = outcome.failure["kind"] if outcome.failure else None
        if outcome.status == "ok" and all(o in m for o in self.objectives):
            self.store.set_constraints(trial.number, self.rules.measured(m))
            tell(study, trial, [m[o] for o in self.objectives])
        elif kind in SETTING_FAILURES:
            self.tell_infeasible(study, trial, self.rules.violation(kind, m), m)
        else:
            tell(study, trial, state=TrialState.FAIL)
        if not (kind == "killed" and stopping.is_set()):  # ended by the sweep's stop: it says nothing of its setting
            self.after_recipe(study, trial)
        self.finished(study)

    def skip(self, study: optuna.Study, trial: optuna.Trial, run_id: str, decision: Skip) -> None:
        """Not launched; every skip goes through here (src/sweep/rules.py Skip: why, in words, and what tells the
        setting). Nothing was measured: a violated record of a setting that did not run (an OOM, a refused or
        predicted one) is told as an infeasible setting is (`tell_infeasible`); anything else, a repeat of a measured
        setting too (a marginal one keeps its violated record), PRUNED without a value: its original already tells
        every sampler its value. Written on the trial first, so a worker that dies midway is redone
        alike."""
        self.lever_param(trial)
        original, constraints, failure_kind = decision.original, decision.constraints, decision.failure_kind
        metrics: dict[str, Any] = {}
        if original is not None:
            failure_kind = original.user_attrs.get(record.FAILURE_KIND, failure_kind)
            constraints, metrics = recorded_constraints(original), dict(original.user_attrs)
        because = original.number if original else None
        attrs = record.skipped_attrs(decision.why, decision.reason, because, failure_kind)
        for key, value in attrs.items():
            trial.set_user_attr(key, value)
        if constraints is not None:
            self.store.set_constraints(trial.number, constraints)
        tags = {k: v for k, v in attrs.items() if k != record.FAILURE_KIND}
        tracking.set_tags(self.runs.client, run_id, tags)
        self.runs.mark_skipped(run_id, trial.number, trial.params, decision.why, because)
        self.runs.client.set_terminated(run_id, "FINISHED")
        measured = original is not None and record.status(original.user_attrs) == "ok"
        if infeasible(constraints) and not measured:
            self.tell_infeasible(study, trial, constraints, metrics)
        else:
            tell(study, trial, state=TrialState.PRUNED)
        self.finished(study)

    def tell_infeasible(
        self, study: optuna.Study, trial: optuna.Trial, constraints: list[float], metrics: dict[str, Any]
    ) -> None:
        """A setting that cannot run: its violated constraint record, in the state its sampler learns from
        (src/sweep/rules.py: PRUNED without a value for TPE, COMPLETE with the worst values for NSGA-II or GP)."""
        self.store.set_constraints(trial.number, constraints)
        if infeasible_state(study.sampler) == TrialState.PRUNED:
            tell(study, trial, state=TrialState.PRUNED)
        else:
            tell(study, trial, self.rules.worst(metrics, self.objectives, self.directions))

    def tell_from_records(self, study: optuna.Study, trial: FrozenTrial, log_dir: Path) -> bool:
        """A trial whose worker died before telling Optuna: told what its own records say it measured, if they say
        it finished (its result.json in `log_dir`, else its MLflow run, which a worker on any host can read)."""
        run_id = trial.user_attrs.get(record.RUN_ID)
        if run_id is None or self.runs is None:
            return False  # it never got as far as its own run: it did not finish
        # A live handle on the running trial, as Study.optimize makes one (the constructor Optuna advises against
        # calling directly is the one that takes an existing trial).
        live = optuna.Trial(study, self.store.trial_id(trial.number))
        skipped = record.skip_of(trial.user_attrs)
        if skipped is not None:  # a skip, decided before its worker died
            why, reason, because, kind = skipped
            original = self.store.get(because) if because is not None else None
            self.skip(study, live, run_id, Skip(why, reason, original, recorded_constraints(trial), kind))
            return True
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

    def recover(self, study: optuna.Study, trials_dir: Path, close_dead_run: Any) -> None:
        """Settle the trials whose worker died (StudyStore.dead): each told from its own records if they say it
        finished, else failed as killed with its MLflow run closed (and queued again if asked)."""
        for trial in self.store.dead(study):
            if not self.tell_from_records(study, trial, trials_dir / f"{trial.number:03d}"):
                self.store.fail_dead(study, trial, close_dead_run(study, trial))
        self.store.fail_stale(study)

    def engine_error(self, study: optuna.Study, trial: optuna.Trial, exc: Exception) -> None:
        """The engine's own trouble with one trial (not the trial's): recorded on it as `other`, its run closed,
        the sweep goes on."""
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

    def lever_param(self, trial: optuna.Trial) -> None:
        """A lever trial's lever as an Optuna param (record.LEVER_PARAM), written before it is told: its params are
        the recipe's, so without it every outside tool would read one setting with several outcomes. Categorical
        over the recipe's levers (one distribution for every lever trial of the study, as Optuna requires); written
        in the storage, not suggested, so no sampler draws it, and samplers that model the params every trial shares
        leave it out."""
        overrides = recipe.lever_overrides(trial)
        name = _param_name(trial.user_attrs)
        if not overrides or name in trial.params:
            return
        value = record.lever_value(overrides)
        if name != record.LEVER_PARAM:  # over what the stage queued (a study attr): one distribution for all
            attr, key = _QUEUED[name]
            queued = (study_attrs(self.store).get(attr) or {}).get(key, [])
            choices = sorted({record.lever_value(c) for c in queued})
        else:
            params = {k: v for k, v in trial.params.items() if k != record.LEVER_PARAM}
            choices = [record.lever_value(o) for o in recipe.levers(self.config, params)]
        if value not in choices:  # a lever of an older config: still one setting of its own
            choices.append(value)
        distribution = CategoricalDistribution(choices)
        trial_id = self.store.trial_id(trial.number)
        try:
            self.store.storage.set_trial_param(trial_id, name, distribution.to_internal_repr(value), distribution)
        except ValueError as exc:  # the study's earlier lever trials have other choices (a changed config)
            log.warning("trial %d: its lever is in user attr %s only (%s)", trial.number, record.LEVER, exc)

    def after_recipe(self, study: optuna.Study, trial: optuna.Trial) -> None:
        """The user's recipe told and not stable: measure the memory levers on it (src/sweep/recipe.py)."""
        if not trial.user_attrs.get(record.RECIPE):
            return
        frozen = self.store.get(trial.number)
        verdict, detail = classify(frozen, float(self.config.hydra.sweeper.headroom_margin))
        if verdict == "stable":
            return
        queued = recipe.queue_levers(study, self.config, frozen)
        if queued:
            log.info("the recipe (trial %d) is %s (%s): measuring %s", trial.number, verdict, detail, queued)

    def finished(self, study: optuna.Study) -> None:
        """The tally and the parent run's counts, after each trial told."""
        with self.lock:
            self.tally.refresh(study)
            self.runs.log_counts(self.tally.counts, self.tally.counts["finished"])
            self.tally.show(finished=1)


# A stage's param, and the study attr (and its key) that lists the levers the stage queued
_QUEUED = {record.RECOMMEND_PARAM: (record.RECOMMENDATION, "levers"), record.FASTER_PARAM: (record.FASTER, "queued")}


def _param_name(attrs: dict[str, Any]) -> str:
    """A lever trial's param: a second-stage trial's (FASTER_PARAM), a recommendation's, or a recipe lever's."""
    if attrs.get(record.FASTER):
        return record.FASTER_PARAM
    return record.RECOMMEND_PARAM if attrs.get(record.RECOMMENDED) else record.LEVER_PARAM


def study_attrs(store: StudyStore) -> dict[str, Any]:
    """The study's user attrs, read from its storage."""
    return store.storage.get_study_user_attrs(store.study_id)


def tell(study: optuna.Study, trial: Any, values: Any = None, state: TrialState | None = None) -> None:
    """study.tell, tolerating GridSampler's study.stop() once its grid is exhausted: that raises outside
    Study.optimize, after the trial was told (stopping is n_trials' job here anyway)."""
    try:
        study.tell(trial, values, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise
