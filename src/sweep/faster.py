"""The fastest setting that trains the same model: before the soak, each finalist that trains on the recipe's rows
per optimizer step in another way than the reference (another micro-batch split, attention kernel, compiled
layers...) is checked to train the same model (src/same_model.py): from the same adapter initialisation and the same
rows in the same order, both train `hydra.sweeper.same_model_steps` optimizer steps; their per-step losses and the
adapters they end with must agree within the stated tolerance. A finalist that fails is never ranked, soaked or
promoted (src/study.py `Sweep.ranked`), and the next one is checked in its place.

The reference is the stable setting at the recipe's optimisation with the recipe's own micro-batch split: the recipe
itself when it is good, else the best good setting with its batch and accumulation (the recipe with the levers that
made it fit). Settings with other rows per optimizer step are another optimisation: shown apart by the report, and
ranked only with `hydra.sweeper.promote_different_optimisation=true`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import optuna
from omegaconf import OmegaConf

from src import record, same_model
from src.config import override_value
from src.redact import redact_text
from src.study import PACKING, STEP_KEYS, Sweep, TrialRow

log = logging.getLogger(__name__)


def record_step(study: optuna.Study, config: Any) -> None:
    """The sweep's fixed batch, accumulation and packing on the study (record.STEP_DEFAULTS): a trial's rows per
    optimizer step where its params and levers do not set them (src/study.py `Sweep.rows_per_step`)."""
    study.set_user_attr(record.STEP_DEFAULTS, {k: OmegaConf.select(config, k) for k in (*STEP_KEYS, PACKING)})


def reference(sweep: Sweep) -> TrialRow | None:
    """The setting every finalist is checked against (module docstring); None where nothing is good."""
    recipe = sweep.recipe_row()
    ranked = sweep.ranked()
    if recipe is None:
        return ranked[0] if ranked else None
    if sweep.good(recipe):
        return recipe
    split = [recipe.setting().get(k) for k in STEP_KEYS]
    same_split = [r for r in ranked if sweep.same_optimisation(r) and _split(sweep, r) == split]
    return same_split[0] if same_split else None


def _split(sweep: Sweep, row: TrialRow) -> list[Any]:
    recipe = sweep.recipe_row()
    setting = {**(recipe.setting() if recipe else {}), **row.setting()}
    for override in row.lever:
        key, _, value = override.partition("=")
        if key.lstrip("+~") in STEP_KEYS:
            setting[key.lstrip("+~")] = int(value)
    return [setting.get(k) for k in STEP_KEYS]


def overrides(row: TrialRow) -> list[str]:
    """A trial's own setting as overrides: its params, then its levers (a lever's value wins)."""
    return [*(f"{k}={override_value(v)}" for k, v in row.setting().items()), *row.lever]


def to_check(sweep: Sweep, top_k: int) -> tuple[TrialRow | None, list[TrialRow]]:
    """(the reference, the finalists among the first `top_k` ranked that still need the check)."""
    ref = reference(sweep)
    if ref is None:
        return None, []
    return ref, [r for r in sweep.ranked()[:top_k] if r.number != ref.number and not r.same_model]


def check_finalists(
    study: optuna.Study,
    store: Any,
    classified: Callable[[], Sweep],
    sweeper: Any,
    fixed: list[str],
    env: dict[str, str],
) -> list[dict[str, Any]]:
    """The last worker out checks the finalists the soak would take, each against the reference, until the first
    `soak_top_k` ranked settings are the reference or passed; each verdict is kept on the study (record.SAME_MODEL;
    a finished trial's own attributes are closed). No soak, no check: an unsoaked setting is promoted only when
    asked by number. What was checked."""
    steps, top_k = int(sweeper.same_model_steps), int(sweeper.soak_top_k)
    if steps <= 0 or top_k <= 0:
        return []
    checked: list[dict[str, Any]] = []
    while True:
        with store.lock():
            if store.others_running(study):
                return checked
            ref, rows = to_check(classified(), top_k)
        if ref is None or not rows or len(checked) >= 2 * top_k + 2:
            return checked
        row = rows[0]
        print(
            f"same model: checking trial {row.number} against trial {ref.number} ({steps} optimizer steps each, "
            "the same rows from the same adapter)",
            flush=True,
        )
        started = time.time()
        try:
            verdict = same_model.check(overrides(ref), overrides(row), steps, fixed, env)
        except RuntimeError as exc:  # a run of the check failed: the candidate is not shown to train the same model
            verdict = {"passed": False, "why": redact_text(str(exc)).splitlines()[0][:300]}
        verdict = {**verdict, "reference": ref.number, "seconds": round(time.time() - started, 1)}
        verdict.pop("candidate", None)  # the trial's own setting; the reference's is kept beside its number
        study.set_user_attr(record.same_model_key(row.number), verdict)
        words = "passed" if verdict["passed"] else f"failed ({verdict.get('why') or _diffs(verdict)})"
        print(f"same model: trial {row.number} {words}: {_diffs(verdict)}", flush=True)
        checked.append({"trial": row.number, **verdict})


def _diffs(verdict: dict[str, Any]) -> str:
    if "max_loss_diff" not in verdict:
        return verdict.get("why", "")
    tol = verdict["tolerance"]
    return (
        f"largest loss difference {verdict['max_loss_diff']:.2e} (tolerance {tol['max_loss_diff']:g}), adapter "
        f"difference {verdict['adapter_rel_diff']:.2%} (tolerance {tol['adapter_rel_diff']:.0%})"
    )
