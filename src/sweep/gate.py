"""The sweep's gate: one decision per proposal before anything is launched — run it, or skip it as a repeat of a
measured setting, a certain OOM (src/sweep/rules.py) or a predicted OOM (src/sweep/memory.py) — and what the sweep
knows of the setting before it runs (the memory model's prediction, the data facts of its knobs' values), recorded
on the trial and its run. It also says when the sweep has nothing new left to launch (every setting of a finite
space told, or `max_skips_in_a_row` proposals skipped in a row).
"""

from __future__ import annotations

import threading
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from src import record, tracking
from src.sweep.checks import SpaceFacts
from src.sweep.memory import MemoryGate, predicted_attrs
from src.sweep.rules import TOLD, LaunchRules, Skip, predicted_skip
from src.sweep.space import SpaceError, outside_space

# hydra.sweeper.max_skips_in_a_row's default: proposals skipped in a row (repeats, certain or predicted OOMs) after
# which a sweep stops, as it can launch nothing new (every remaining setting a repeat or a certain OOM); skips cost
# milliseconds each, so a sweep that only skips would otherwise make thousands of empty trials.
SKIPS_IN_A_ROW = 50


class Gate:
    def __init__(self, sweeper: Any, rules: LaunchRules, budget: float) -> None:
        self.sweeper = sweeper
        self.rules = rules
        self.budget = budget
        self.memory: MemoryGate | None = None  # once the space is checked (src/sweep/memory.py)
        self.facts = SpaceFacts()
        self.lock = threading.Lock()
        self.skips_in_a_row = 0
        self.shares: dict[int, float] = {}  # trial number -> its share of a shared card (src/sweep/ledger.py)
        self.max_skips = int(sweeper.get("max_skips_in_a_row", SKIPS_IN_A_ROW))
        if self.max_skips < 0:
            raise SpaceError(
                f"hydra.sweeper.max_skips_in_a_row={self.max_skips}: must be at least 0 (0: the sweep never ends early)"
            )

    def decide(
        self, study: optuna.Study, trial: optuna.Trial, overrides: list[str], run_id: str, runs: Any
    ) -> Skip | None:
        """None (launch it), or the skip: a repeat, a certain OOM or a predicted OOM (the prediction is recorded on
        the trial either way)."""
        original = self.rules.finished_twin(study, trial) if self.sweeper.skip_duplicates else None
        if original is not None:
            return Skip("repeat", f"same setting as trial {original.number}", original)
        dominating = self.rules.certain_oom(study, trial)
        if dominating is not None:
            return Skip("certain_oom", f"certain oom: needs at least trial {dominating.number}'s memory", dominating)
        prediction = self.predict(study, trial, overrides, run_id, runs)
        if prediction is not None and self.memory is not None and self.memory.skips(prediction):
            return predicted_skip(prediction, self.budget)
        if self.memory is not None:
            with self.lock:
                self.shares[trial.number] = self.memory.share_of(prediction)
        return None

    def share(self, number: int) -> float | None:
        """The card memory (GiB) the launched trial `number` may take beside others on its card (`decide` set it;
        None: its whole budget)."""
        with self.lock:
            return self.shares.pop(number, None)

    def predict(self, study: optuna.Study, trial: optuna.Trial, overrides: list[str], run_id: str, runs: Any) -> Any:
        """The memory model's prediction for the trial, recorded on it and its run before it is launched."""
        if self.memory is None or not self.memory.active:
            return None
        self.memory.refresh(len(study.get_trials(deepcopy=False, states=TOLD)))
        prediction = self.memory.predict(overrides)
        if prediction is not None:
            values = predicted_attrs(prediction)
            for key, value in values.items():
                trial.set_user_attr(key, value)
            tracking.log_metrics(runs.client, run_id, values)
        return prediction

    def record_facts(self, trial: optuna.Trial, setting: dict[str, Any], run_id: str, runs: Any) -> None:
        """What the data says of this setting's knob values (the knob registry's facts: the answers its
        max_seq_length cuts), on the trial and its run."""
        facts = self.facts.of(setting)
        for key, value in facts.items():
            trial.set_user_attr(key, value)
        tracking.log_metrics(runs.client, run_id, facts)

    def count(self, decision: Skip | None, occupied: int) -> str | None:
        """Count skips in a row; the line that ends the sweep once `max_skips_in_a_row` were skipped in a row."""
        with self.lock:
            self.skips_in_a_row = self.skips_in_a_row + 1 if decision is not None else 0
            if 0 < self.max_skips <= self.skips_in_a_row:
                return (
                    f"sweep ended early: the last {self.max_skips} proposals were all skipped (repeats or certain "
                    f"OOMs: nothing new left to measure) after {occupied} trials of "
                    f"hydra.sweeper.n_trials={self.sweeper.n_trials}; widen the space to measure more "
                    "(hydra.sweeper.max_skips_in_a_row=0 never ends early)"
                )
        return None

    def exhausted(
        self, study: optuna.Study, distributions: dict[str, BaseDistribution], custom: bool, occupied: int
    ) -> str | None:
        """The line that ends the sweep when every setting of this finite space is told (measured, failed by itself,
        or skipped) and nothing is queued: a new proposal could only repeat one. None otherwise."""
        if custom or not self.sweeper.skip_duplicates or not distributions or not self.max_skips:
            return None  # a custom space's suggestions are its own; without skips, repeats are measured again
        size = space_size(distributions)
        if size is None or study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return None
        names = set(distributions)
        # Settings of this space only: a resumed study whose numeric range moved holds settings outside it, which
        # counted toward the size and ended the sweep before the new settings were measured.
        told = {
            tuple(sorted((k, repr(v)) for k, v in t.params.items()))
            for t in study.get_trials(deepcopy=False, states=TOLD)
            if set(t.params) == names
            and record.LEVER not in t.user_attrs
            and not outside_space(t.params, distributions)
        }
        if len(told) < size:
            return None
        return (
            f"sweep ended early: all {size} settings of the space are on the map after {occupied} "
            f"trials of hydra.sweeper.n_trials={self.sweeper.n_trials}; nothing new left to launch"
        )


def space_size(distributions: dict[str, BaseDistribution]) -> int | None:
    """How many settings a space holds; None for one with a continuous knob."""
    size = 1
    for d in distributions.values():
        if isinstance(d, CategoricalDistribution):
            size *= len(d.choices)
        elif isinstance(d, IntDistribution) and not d.log:
            size *= (d.high - d.low) // d.step + 1
        elif isinstance(d, FloatDistribution) and d.step is not None:
            size *= int(round((d.high - d.low) / d.step)) + 1
        else:
            return None
    return size
