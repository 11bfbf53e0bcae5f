"""The launch rules: which proposals are not launched (a repeat of a measured setting, a certain OOM) and how a
failure is told to Optuna so that the sampler steers away from the settings that cause it.

How each trial is told, so that Optuna's own tools (`Study.best_trials`, `optuna best-trials`, optuna-dashboard's
trial list; its "Best Trial" card ranks by value alone, see the README) read it as the sweep does and the sampler
learns what it can:

- measured (`trial.status=ok`): COMPLETE with its objectives and its constraint record (`CONSTRAINTS_KEY`), feasible
  when it left the headroom margin free (the report's stable), violated when it did not (the report's marginal), so
  `best_trials` is the report's best stable;
- a failure of the setting itself (OOM, refused data or config): infeasible, a violated constraint record, in the
  state the study's sampler learns from (`infeasible_state`): PRUNED without a value where it can (TPE ranks an
  infeasible trial by its violation, COMPLETE or PRUNED alike; random and grid learn from no value), so nothing
  reads a value that was never measured (best trials, importances and the dashboard's plots count COMPLETE trials
  only); COMPLETE with the worst values for samplers that see COMPLETE trials only (NSGA-II, GP, CMA-ES): told
  PRUNED, they would never learn of the failure (a GP sweep then proposes the OOM region again and again);
- a skipped proposal: a certain OOM, or a repeat of an infeasible setting, is told infeasible once more, the same
  way; a repeat of a measured setting is PRUNED (nothing was measured, and a copied value would count twice; Optuna's
  FAQ prunes duplicates so the sampler proposes them less);
- any other failure (segfault, kill, timeout, NaN loss...): FAIL; it says nothing of the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.samplers import BaseSampler, BruteForceSampler, GridSampler, QMCSampler, RandomSampler, TPESampler
from optuna.trial import FrozenTrial, TrialState

from src import record
from src.failures import MEMORY, oom_needed_gib
from src.knobs import MEMORY_DIRECTIONS
from src.study import DEFAULT_MARGIN, headroom_of
from src.sweep.recipe import lever_overrides
from src.sweep.space import SpaceError

# Failures that the setting itself causes, the same way every time: the sampler must steer away from them.
SETTING_FAILURES = (*MEMORY, "data_error", "config_error")

# Optuna's constraint record: the trial system attr "constraints", a list of floats, feasible when each is <= 0. It is
# what Optuna's samplers and `Study.best_trials` read (`Trial.constraints`, as `optuna.samplers._base` writes it for a
# `constraints_func`; the name is optuna.study._constrained_optimization._CONSTRAINTS_KEY) and the only key
# optuna-dashboard reads (`optuna_dashboard._serializer.CONSTRAINTS_KEY`); `Trial.set_constraint` writes
# "constraints:<name>" keys, which the dashboard does not read. Checked against Optuna 5.1 and optuna-dashboard 0.21
# (tests/test_optuna_native.py holds both names to this one).
CONSTRAINTS_KEY = "constraints"
# The record's entries, in order (also on the study, user attr `sweep.constraints`): the peak over what the setting
# may use, the card's budget less the headroom margin (peak / budget - (1 - headroom_margin): > 0 for a setting the
# report calls marginal, as for an OOM, where the peak is what it held plus what it asked for), and whether the
# setting can run at all.
CONSTRAINTS = ("vram_budget", "valid_setting")
# Trials that tell what a setting does: measured (COMPLETE) or failed by the setting itself (PRUNED; a PRUNED skip
# carries `trial.status=skipped` and is told apart by it). Studies of an older engine hold such failures COMPLETE.
TOLD = (TrialState.COMPLETE, TrialState.PRUNED)


# Samplers that learn an infeasible setting from a PRUNED trial's constraint record (TPE splits its trials into
# feasible and infeasible before it looks at their state; checked on Optuna 5.1), or that learn from no trial's outcome.
LEARN_FROM_PRUNED = (TPESampler, RandomSampler, GridSampler, BruteForceSampler, QMCSampler)


def infeasible_state(sampler: BaseSampler) -> TrialState:
    """The state an infeasible setting is told in: PRUNED (no value) where the sampler learns from it so, else
    COMPLETE with the worst values (see the module's docstring)."""
    return TrialState.PRUNED if isinstance(sampler, LEARN_FROM_PRUNED) else TrialState.COMPLETE


def infeasible(record: list[float] | None) -> bool:
    return record is not None and any(v > 0 for v in record)


@dataclass(frozen=True)
class Skip:
    """The gate's decision not to launch a proposal: `why` the contract's `skip.reason` (repeat | certain_oom |
    predicted_oom), `reason` in words; `original` the trial that already tells what this setting does (its failure
    kind and constraint record become the skip's), else `constraints` and `failure_kind` say it."""

    why: str
    reason: str
    original: FrozenTrial | None = None
    constraints: list[float] | None = None
    failure_kind: str | None = None


def predicted_skip(prediction: Any, budget: float) -> Skip:
    """The memory model puts the setting beyond the budget even if it over-predicts by the most it was seen to: its
    predicted violation is its constraint record, so the sampler learns the region as it would from an OOM."""
    over = prediction.error if prediction.error_over is None else prediction.error_over
    reason = (
        f"predicted oom: {prediction.device_gib:.1f} GiB on the card (the model over-predicts by at most {over:.0%}) "
        f"for a {budget:g} GiB budget"
    )
    return Skip(
        "predicted_oom",
        reason,
        constraints=constraint_record(vram_budget=prediction.device_gib / budget - 1),
        failure_kind="oom",
    )


def constraint_record(vram_budget: float = 0.0, valid_setting: float = 0.0) -> list[float]:
    """A trial's constraint record; 0 (met, nothing more known) for what was not violated."""
    return [float(vram_budget), float(valid_setting)]


def recorded_constraints(trial: FrozenTrial) -> list[float] | None:
    """A trial's constraint record as the engine wrote it (or by name, as an older engine wrote it with
    `Trial.set_constraint`); None for a trial told without one (FAIL)."""
    record = trial.system_attrs.get(CONSTRAINTS_KEY)
    if record is not None:
        return [float(v) for v in record]
    named = trial.constraints
    return constraint_record(**{k: v for k, v in named.items() if k in CONSTRAINTS}) if named else None


def named_constraints(trial: FrozenTrial) -> dict[str, float]:
    """{"vram_budget": ..., "valid_setting": ...} of a trial; {} for one told without constraints."""
    record = recorded_constraints(trial)
    return dict(zip(CONSTRAINTS, record, strict=True)) if record is not None else {}


def check_monotone(monotone: dict[str, str]) -> None:
    for knob, way in monotone.items():
        if way not in MEMORY_DIRECTIONS:
            raise SpaceError(
                f"hydra.sweeper.memory_monotone.{knob}={way!r}: use one of {', '.join(MEMORY_DIRECTIONS)} "
                "(how peak memory moves as the knob grows)"
            )


class LaunchRules:
    def __init__(self, config: DictConfig, fixed: list[str], monotone: dict[str, str], budget: float) -> None:
        check_monotone(monotone)
        self.config = config
        self.fixed = fixed
        self.monotone = monotone
        self.budget = budget

    def finished_twin(self, study: optuna.Study, trial: Any) -> FrozenTrial | None:
        """An earlier measured trial with exactly these settings (samplers over small spaces repeat points)."""
        for t in study.get_trials(deepcopy=False, states=TOLD):
            if (
                t.number != trial.number
                and t.params == trial.params
                and lever_overrides(t) == lever_overrides(trial)
                and record.status(t.user_attrs) in ("ok", "failed")
            ):
                return t
        return None

    def certain_oom(self, study: optuna.Study, trial: Any) -> FrozenTrial | None:
        """A trial that ran out of memory with a setting this one can only need more memory than.

        Peak memory only grows with the knobs in `memory_monotone` (longer sequences, bigger per-device batch,
        higher rank, checkpointing off) and does not move with its `neutral` ones (accumulation and batch
        order, on padded batches); with every other knob equal, a proposal at or beyond an OOM setting on each
        of them would OOM too. It is not launched (`skipped`) and Optuna is told it is infeasible.

        A setting measured ok is never a certain OOM, and an OOM that a measured ok setting needing at least its
        memory contradicts (a flaky OOM, or a knob's rule that does not hold here) is no evidence for any other.
        """
        if not self.monotone:
            return None
        proposal = trial.params
        told = study.get_trials(deepcopy=False, states=TOLD)
        comparable = [
            t for t in told if set(t.params) == set(proposal) and lever_overrides(t) == lever_overrides(trial)
        ]
        fits = [t.params for t in comparable if record.status(t.user_attrs) == "ok"]
        if any(self.needs_at_least(ok, proposal) for ok in fits):
            return None  # something needing at least this setting's memory ran: it fits, or may
        for t in comparable:  # a lever changes a knob outside the params: only the same lever compares
            if record.recorded_kind(t.user_attrs) not in MEMORY or record.status(t.user_attrs) != "failed":
                continue
            if any(self.needs_at_least(ok, t.params) for ok in fits):
                continue  # contradicted by a measured setting: not a rule to extend
            if self.needs_at_least(proposal, t.params):
                return t
        return None

    def needs_at_least(self, setting: dict[str, Any], reference: dict[str, Any]) -> bool:
        """Whether `setting` needs at least `reference`'s memory on every knob (same knobs, by `memory_monotone`).
        A packed (padding-free) micro-batch is as large as the rows packed into it: which rows share a batch
        (group_by_length) and how many rows the probe has (accumulation) then move the peak."""
        packed = self.packed(setting) or self.packed(reference)
        rules = {k: ("equal" if packed and v == "neutral" else v) for k, v in self.monotone.items()}
        return all(at_least(setting[k], reference[k], rules.get(k)) for k in setting)

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

    @property
    def margin(self) -> float:
        """The headroom share a setting must leave to be stable (`hydra.sweeper.headroom_margin`)."""
        return float(OmegaConf.select(self.config, "hydra.sweeper.headroom_margin", default=DEFAULT_MARGIN))

    def measured(self, metrics: dict[str, float]) -> list[float]:
        """The constraint record of a trial that ran: its peak reserved memory over the budget less the headroom
        margin (margin - headroom), so a setting the report calls marginal (headroom below the margin) is infeasible
        to every outside tool too and `best_trials` picks among the report's stable ones. Nothing measured its peak
        (no VRAM measurement): 0, nothing known."""
        headroom = headroom_of(metrics, self.budget)
        return constraint_record(vram_budget=self.margin - headroom if headroom is not None else 0.0)

    def worst(self, metrics: dict[str, Any], objectives: list[str], directions: list[str]) -> list[float]:
        """The values of an infeasible setting told COMPLETE: the worst of each objective, except memory it held
        when it failed (an OOM's peak, for a memory objective)."""
        values = []
        for objective, direction in zip(objectives, directions, strict=True):
            worst = 0.0 if direction == "maximize" else float("inf")
            held = metrics.get(objective) if objective.startswith("peak_vram") else None
            values.append(float(held) if isinstance(held, int | float) else worst)
        return values

    def violation(self, kind: str, metrics: dict[str, float]) -> list[float]:
        """The constraint record of a setting that failed by itself: for an OOM, what it held plus what it asked
        for, over the budget (at least a hair above 0: it did fail); for a refused setting, 1 on `valid_setting`."""
        if kind not in MEMORY:
            return constraint_record(valid_setting=1.0)
        needed = oom_needed_gib(metrics, self.budget) / self.budget
        return constraint_record(vram_budget=max(needed - (1.0 - self.margin), 0.01))


def at_least(value: Any, reference: Any, direction: str | None) -> bool:
    """Whether `value` needs at least the memory `reference` needs, on a knob that moves memory `direction`."""
    if direction == "increasing":
        return value >= reference
    if direction == "decreasing":
        return value <= reference
    if direction == "neutral":  # the knob does not move the peak (gradient accumulation: same micro-step)
        return True
    return value == reference
