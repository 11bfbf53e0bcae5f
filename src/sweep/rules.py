"""The launch rules: which proposals are not launched (a repeat of a measured setting, a certain OOM) and how a
failure is told to Optuna so that the sampler steers away from the settings that cause it.
"""

from __future__ import annotations

from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.trial import FrozenTrial, TrialState

from src.failures import MEMORY, oom_needed_gib
from src.knobs import MEMORY_DIRECTIONS
from src.sweep.recipe import lever_overrides

# Failures that the setting itself causes, the same way every time: the sampler must steer away from them.
SETTING_FAILURES = (*MEMORY, "data_error", "config_error")


def check_monotone(monotone: dict[str, str]) -> None:
    for knob, way in monotone.items():
        if way not in MEMORY_DIRECTIONS:
            raise ValueError(
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
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if (
                t.number != trial.number
                and t.params == trial.params
                and lever_overrides(t) == lever_overrides(trial)
                and t.user_attrs.get("trial.status") in ("ok", "failed")
            ):
                return t
        return None

    def certain_oom(self, study: optuna.Study, trial: Any) -> FrozenTrial | None:
        """A trial that ran out of memory with a setting this one can only need more memory than.

        Peak memory only grows with the knobs in `memory_monotone` (longer sequences, bigger per-device batch,
        higher rank, checkpointing off) and does not move with its `neutral` ones (accumulation and batch
        order, on padded batches); with every other knob equal, a proposal at or beyond an OOM setting on each
        of them would OOM too. It is not launched (`skipped`) and Optuna is told it is infeasible.
        """
        if not self.monotone:
            return None
        proposal = trial.params
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.user_attrs.get("failure.kind") not in MEMORY or t.user_attrs.get("trial.status") != "failed":
                continue
            if set(t.params) != set(proposal) or lever_overrides(t) != lever_overrides(trial):
                continue  # a lever changes a knob outside the params: only the same lever compares
            # A packed (padding-free) micro-batch is as large as the rows packed into it: which rows share a
            # batch (group_by_length) and how many rows the probe has (accumulation) then move the peak.
            packed = self.packed(proposal) or self.packed(t.params)
            rules = {k: ("equal" if packed and v == "neutral" else v) for k, v in self.monotone.items()}
            if all(at_least(proposal[k], t.params[k], rules.get(k)) for k in proposal):
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

    def violation(self, kind: str, metrics: dict[str, float]) -> float:
        """How far the setting is from feasible: for an OOM, what it held plus what it asked for, over the
        budget (at least a hair above 0: it did fail); for a refused setting, 1."""
        if kind not in MEMORY:
            return 1.0
        return max(oom_needed_gib(metrics, self.budget) / self.budget - 1.0, 0.01)


def at_least(value: Any, reference: Any, direction: str | None) -> bool:
    """Whether `value` needs at least the memory `reference` needs, on a knob that moves memory `direction`."""
    if direction == "increasing":
        return value >= reference
    if direction == "decreasing":
        return value <= reference
    if direction == "neutral":  # the knob does not move the peak (gradient accumulation: same micro-step)
        return True
    return value == reference
