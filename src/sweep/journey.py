"""The sweep finishes the job: when the user's recipe is not stable within the policies (the headroom margin, the
truncation policy), or no measured setting is, the sweep searches for the best setting that satisfies all of them.

After the map and the recipe's levers, the memory model (calibrated on this sweep's own trials where it can be)
ranks every combination of the levers with the lengths the data needs (src/fit/recommend.py: the rule `python -m
src.fit --card` applies too); the first `hydra.sweeper.recommend_trials` of those predicted to fit with the margin
are measured as trials (beyond `n_trials`, as the levers are: `sweep.recommended` on them), and the soak then takes
the best stable ones. What was searched, and why, is kept on the study (`sweep.recommendation`), so the report says
which policy no setting met and which came closest when nothing did.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution

from src import record
from src.config import override_value
from src.failures import MEMORY
from src.fit import recommend
from src.study import Sweep, TrialRow
from src.sweep import recipe as recipe_levers

log = logging.getLogger(__name__)
SEQ = recommend.SEQ


def needed(sweep: Sweep) -> str | None:
    """Why the sweep must search for a setting (None: the recipe is stable within the policies)."""
    recipe = sweep.recipe_row()
    if recipe is not None and sweep.good(recipe):
        return None
    if recipe is not None and recipe.verdict in ("running", "skipped", "pruned"):
        return None  # not measured (yet): nothing to answer
    if recipe is not None and recipe.verdict == "failed" and recipe.failure_kind not in MEMORY:
        return None  # it failed for a reason no lever addresses (a config or data error, a crash)
    if recipe is None:
        return None if sweep.ranked() else "no measured setting is stable within the policies"
    if recipe.verdict == "stable":
        return f"the recipe cuts {sweep.cut_answers(recipe):.0%} of answers, more than the truncation policy allows"
    return f"the recipe is {recipe.verdict} ({recipe.detail})"


def plan(
    sweep: Sweep,
    recipe: TrialRow,
    config: Any,
    memory: Any,
    facts: Any,
    fixed: list[str],
    distributions: dict[str, BaseDistribution],
    budget: float,
) -> tuple[list[recommend.Candidate], recommend.Candidate | None, list[int]]:
    """(candidates best first, the closest one when none fits, the lengths tried): the rule of src/fit/recommend.py
    applied to the recipe, predicted by the sweep's memory model."""
    params = dict(recipe.params)
    levers = recipe_levers.levers(config, params)
    recipe_length = int(params.get(SEQ, config.data.max_seq_length))

    def predict(changes: list[str]) -> Any:
        keys = {o.partition("=")[0] for o in changes}
        base = [f"{k}={override_value(v)}" for k, v in params.items() if k not in keys]
        return memory.predict([*fixed, *base, *recipe.lever, *changes])

    def cut(length: int) -> float:
        return float(facts.cut(length).get("truncated_answer_frac", 0.0))

    probe = memory.setting([*fixed, f"{SEQ}={recipe_length}"])
    max_positions = probe.arch.max_positions if probe is not None else 8192
    longest = int(facts.lengths.max()) if facts.lengths is not None and len(facts.lengths) else None
    dist = distributions.get(SEQ)
    choices = [recipe_length, *(dist.choices if isinstance(dist, CategoricalDistribution) else [])]
    policy = sweep.max_truncated_answer_frac if sweep.max_truncated_answer_frac is not None else 0.0
    lengths = recommend.lengths_to_try(recommend.ladder(choices, longest, max_positions), cut, policy)
    found = recommend.candidates(predict, levers, lengths, cut, budget, sweep.margin, memory.describes_device())
    closest = None if found else recommend.closest(predict, levers, lengths, cut)
    return found, closest, lengths


def queue(
    study: optuna.Study,
    recipe: TrialRow,
    found: list[recommend.Candidate],
    distributions: dict[str, BaseDistribution],
    k: int,
) -> list[tuple[recommend.Candidate, list[str]]]:
    """Queue `k` of the candidates the study holds no trial of yet (recommend.pick: hedged over the levers), as
    trials of the recipe with their changes; each with its trial's lever overrides."""

    def key(params: dict[str, Any], lever: Any) -> tuple[str, str]:
        knobs = {k: v for k, v in params.items() if k not in record.STAGE_PARAMS}
        return json.dumps(knobs, sort_keys=True, default=str), lever if isinstance(lever, str) else json.dumps(lever)

    seen = {key(t.params, t.user_attrs.get(record.LEVER, "[]")) for t in study.get_trials(deepcopy=False)}
    unseen = [c for c in found if key(*as_trial(recipe, c, distributions)) not in seen]
    queued = []
    for candidate in recommend.pick(unseen, k):
        params, lever = as_trial(recipe, candidate, distributions)
        study.enqueue_trial(
            params,
            user_attrs={record.LEVER: json.dumps(lever), record.LEVER_OF: recipe.number, record.RECOMMENDED: True},
        )
        queued.append((candidate, lever))
    return queued


def as_trial(
    recipe: TrialRow, candidate: recommend.Candidate, distributions: dict[str, BaseDistribution]
) -> tuple[dict[str, Any], list[str]]:
    """(params, lever overrides) of a candidate's trial: the length goes into the params where the space holds it
    (the map then places the setting), else among the overrides; the recipe's own lever is kept."""
    params = dict(recipe.params)
    lever = [*recipe.lever, *candidate.levers]
    dist = distributions.get(SEQ)
    if SEQ in params and isinstance(dist, CategoricalDistribution) and candidate.length in dist.choices:
        params[SEQ] = candidate.length
    elif params.get(SEQ) != candidate.length:
        lever.append(f"{SEQ}={candidate.length}")
    return params, lever


def left(study: optuna.Study, sweep: Sweep) -> bool:
    """Whether a study still has its search to make (a re-run of a complete study makes it)."""
    return record.RECOMMENDATION not in study.user_attrs and needed(sweep) is not None


def search_once(
    study: optuna.Study,
    store: Any,
    classified: Callable[[], Sweep],
    config: Any,
    memory: Any,
    facts: Any,
    fixed: list[str],
    distributions: dict[str, BaseDistribution],
    budget: float,
) -> list[Any]:
    """The last worker out searches (under the study's lock: another worker finishing now does not search too);
    what it queued."""
    if int(config.hydra.sweeper.recommend_trials) <= 0:
        return []
    with store.lock():
        if store.others_running(study):
            return []
        queued = search(study, classified(), config, memory, facts, fixed, distributions, budget)
    if queued:
        how = (
            "the memory model predicts to fit with the headroom margin"
            if memory.describes_device()
            else "the memory model ranks first (it does not describe this device: the trials decide)"
        )
        why = study.user_attrs.get(record.RECOMMENDATION, {}).get("why", "the recipe is not good")
        print(f"search: {why}; measuring {len(queued)} setting(s) {how}, beyond n_trials", flush=True)
    return queued


def search(
    study: optuna.Study,
    sweep: Sweep,
    config: Any,
    memory: Any,
    facts: Any,
    fixed: list[str],
    distributions: dict[str, BaseDistribution],
    budget: float,
) -> list[Any]:
    """Search once per study (called by the last worker out, under the study's lock): queue the recommendation
    trials and record the search on the study; what was queued."""
    if record.RECOMMENDATION in study.user_attrs:
        return []
    why = needed(sweep)
    if why is None:
        return []
    recipe = sweep.recipe_row()
    if recipe is None:
        study.set_user_attr(record.RECOMMENDATION, {"why": why, "queued": [], "closest": None, "note": "no recipe"})
        return []
    if memory is None or not memory.active:
        note = "hydra.sweeper.memory_model=off: the sweep cannot choose settings to try"
        study.set_user_attr(record.RECOMMENDATION, {"why": why, "queued": [], "closest": None, "note": note})
        return []
    found, closest, lengths = plan(sweep, recipe, config, memory, facts, fixed, distributions, budget)
    # None predicted to fit with the margin: the closest (every lever) is measured all the same: the model's
    # stated error may be wide where it has few points, and a measurement settles what a prediction cannot.
    tried = found or ([closest] if closest is not None else [])
    queued = queue(study, recipe, tried, distributions, int(config.hydra.sweeper.recommend_trials))
    study.set_user_attr(
        record.RECOMMENDATION,
        {
            "why": why,
            "queued": [c.changes for c, _ in queued],
            "levers": [lever for _, lever in queued],  # the trials' sweep.lever: their Optuna param's choices
            "lengths": lengths,
            "closest": None
            if closest is None
            else {"changes": closest.changes, "predicted_gib": closest.predicted_gib},
            "note": (
                ("" if memory.describes_device() else "the memory model does not describe this device: measured ")
                if found
                else "no combination of the levers is predicted to fit with the headroom margin: measured the closest"
            ),
        },
    )
    for c, _ in queued:
        log.info(
            "recommendation trial: %s (predicted %.2f GiB, cuts %.1f%% of answers)",
            c.words(int(recipe.params.get(SEQ, config.data.max_seq_length))),
            c.predicted_gib,
            100 * c.cut,
        )
    return queued
