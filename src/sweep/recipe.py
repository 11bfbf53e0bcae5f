"""The user's recipe in a sweep: the first queued setting is marked as the recipe, and when it is not stable the
known memory levers (src/knobs.py) are measured on it, one at a time, so that each sentence of the report's "What to
change" rests on a trial. A lever trial has the recipe's params and its own overrides, recorded on the trial.
"""

from __future__ import annotations

import json
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf

from src.failures import MEMORY
from src.fit import recommend
from src.record import (  # LEVER: a lever trial's overrides (JSON list); the recipe trial's number
    LEVER,
    LEVER_OF,
    recorded_kind,
    status,
)
from src.sweep.slots import devices


def levers(config: DictConfig, recipe_params: dict[str, Any]) -> list[list[str]]:
    """The recipe's levers (one rule for the sweep and `python -m src.fit --card`), on the device the sweep's trials
    run on: a CPU sweep does not try the CUDA allocator's."""
    return recommend.levers(config, recipe_params, cuda=bool(devices(OmegaConf.select(config, "hydra.sweeper"))))


def lever_overrides(trial: Any) -> list[str]:
    """The overrides a trial adds to its params ([] for any trial but a lever's)."""
    return json.loads(getattr(trial, "user_attrs", {}).get(LEVER, "[]"))


def queue_levers(study: optuna.Study, config: DictConfig, recipe: optuna.trial.FrozenTrial) -> list[list[str]]:
    """Queue the recipe's lever trials once (a resumed sweep finds them queued or done); returns those queued.
    None queued for a recipe that failed for a reason no lever addresses (a config or data error, a crash...): the levers
    save memory, so only a memory failure or a setting that runs too near the budget has them."""
    if addressed_by_no_lever(recipe):
        return []
    done = {t.user_attrs.get(LEVER) for t in study.get_trials(deepcopy=False) if t.user_attrs.get(LEVER_OF) is not None}
    queued = []
    for overrides in levers(config, dict(recipe.params)):
        if json.dumps(overrides) in done:
            continue
        study.enqueue_trial(dict(recipe.params), user_attrs={LEVER: json.dumps(overrides), LEVER_OF: recipe.number})
        queued.append(overrides)
    return queued


def addressed_by_no_lever(recipe: optuna.trial.FrozenTrial) -> bool:
    """Whether the recipe failed (or was skipped) for a reason other than memory: every lever would fail alike."""
    kind = recorded_kind(recipe.user_attrs)
    if status(recipe.user_attrs) == "failed":
        return kind not in MEMORY
    return status(recipe.user_attrs) == "skipped" and kind is not None and kind not in MEMORY
