"""What the sweep queues before it asks its sampler: the user's settings (`hydra.sweeper.enqueue_trials`, the first
of them marked as the recipe) and, on a grid, the settings the memory model puts nearest the budget's edge first.
`n_trials` bounds the map's trials, queued ones included; the recipe's lever and recommendation trials are apart
(src/sweep/recipe.py, src/sweep/journey.py).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import TrialState

from src import record
from src.sweep.space import outside_space

log = logging.getLogger(__name__)


def room(study: optuna.Study, store: Any, n_trials: int) -> int:
    """How many more settings may be queued toward `n_trials`."""
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    queued = sum(1 for t in waiting if record.LEVER not in t.user_attrs)
    return int(n_trials) - store.occupied(study) - queued


def queue(
    study: optuna.Study, store: Any, n_trials: int, params: dict[str, Any], attrs: dict[str, Any] | None = None
) -> bool:
    """Queue one setting unless the study holds it already or has no room for it; whether it had room."""
    if room(study, store, n_trials) <= 0:
        return False
    study.enqueue_trial(params, skip_if_exists=True, user_attrs=attrs)
    return True


def enqueue(
    study: optuna.Study,
    store: Any,
    sweeper: Any,
    distributions: dict[str, BaseDistribution],
    memory: Any,
    fixed: list[str],
) -> None:
    """The user's settings, then (on a grid) the edge-first order."""
    for i, params in enumerate(sweeper.enqueue_trials or []):
        params = OmegaConf.to_container(params, resolve=True) if isinstance(params, DictConfig) else dict(params)
        outside = outside_space(params, distributions)
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
        if not queue(study, store, sweeper.n_trials, params, {record.RECIPE: True} if i == 0 else None):
            log.info(
                "hydra.sweeper.enqueue_trials[%d:] not queued: hydra.sweeper.n_trials=%d bounds the map's trials",
                i,
                sweeper.n_trials,
            )
            return
    edge_first(study, store, sweeper, distributions, memory, fixed)


def edge_first(
    study: optuna.Study,
    store: Any,
    sweeper: Any,
    distributions: dict[str, BaseDistribution],
    memory: Any,
    fixed: list[str],
) -> None:
    """On a grid, the settings the memory model puts nearest the budget's edge run first: they are the ones the map
    is for (and each measured one refines the model before the rest are decided)."""
    if not (memory and memory.active and isinstance(study.sampler, optuna.samplers.GridSampler)):
        return
    if any(t.state != TrialState.WAITING for t in study.get_trials(deepcopy=False)):
        return  # a resumed grid: its queue was set when it started
    if not all(isinstance(d, CategoricalDistribution) for d in distributions.values()):
        return
    memory.refresh(0)
    names = list(distributions)
    choices = [distributions[k].choices for k in names]  # a grid's space is categorical
    grid = [dict(zip(names, values, strict=True)) for values in itertools.product(*choices)]
    # The study's trials read once, not once a setting: on a fresh grid nothing but this loop queues, so the room and
    # the settings already queued (the user's) are known up front. The speed map's 96 settings queued in 7.1 s of the
    # sweep's start when each read every trial (room, and enqueue_trial's skip_if_exists), 2.9 s so (2 CPUs, SQLite).
    left = room(study, store, sweeper.n_trials)
    held = {_key(t.system_attrs.get("fixed_params") or t.params) for t in study.get_trials(deepcopy=False)}
    for params in memory.edge_order(grid, fixed):
        if left <= 0:
            return
        if _key(params) in held:  # what enqueue_trial's skip_if_exists would skip, without its read of every trial
            continue
        study.enqueue_trial(params)
        held.add(_key(params))
        left -= 1


def _key(params: dict[str, Any]) -> frozenset:
    return frozenset((k, repr(v)) for k, v in params.items())
