"""Which knobs matter: Optuna's parameter importances of the knobs for one metric, over the finished trials."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import optuna

from src.knobs import figure
from src.study import Sweep, sort_key


@dataclass
class Importance:
    target: str
    values: dict[str, float]  # knob -> share of the explained variance; empty when not computed
    method: str
    note: str
    n_trials: int


def importance(sweep: Sweep, target: str, direction: str) -> Importance:
    """Optuna's fANOVA importances of the knobs for `target`, over the trials that finished (skipped repeats
    excluded: they add no measurement; lever trials too: their params are the recipe's, their setting is not).
    PED-ANOVA when fANOVA cannot fit; a reason when neither can run."""
    rows = [r for r in sweep.plain_rows() if r.verdict in ("stable", "marginal") and target in r.metrics]
    n = len(rows)
    if n < 2:
        return Importance(target, {}, "", f"not computed: {n} finished trial(s) with {target}; 2 or more needed", n)
    knobs = [
        k for k in sweep.knobs if all(k in r.params for r in rows) and len({sort_key(r.params[k]) for r in rows}) > 1
    ]
    if not knobs:
        return Importance(target, {}, "", "not computed: no knob took two values among the finished trials", n)
    values = [r.metrics[target] for r in rows]
    if max(values) - min(values) <= 1e-9 * max(1.0, abs(max(values))):
        return Importance(
            target,
            {},
            "",
            f"not computed: {target} was {figure(values[0])} in all {n} finished trials (no knob moved it)",
            n,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = optuna.create_study(direction=direction)
        for r in rows:
            probe.add_trial(
                optuna.trial.create_trial(
                    params={k: r.params[k] for k in knobs},
                    distributions={k: r.distributions[k] for k in knobs},
                    value=r.metrics[target],
                )
            )
        return _evaluate(probe, target, n)


def _evaluate(probe: optuna.Study, target: str, n: int) -> Importance:
    """fANOVA, else PED-ANOVA (with the reason fANOVA could not fit), else why neither ran."""
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator, get_param_importances

    tried: list[str] = []
    for method, evaluator in (
        ("fANOVA (optuna.importance.FanovaImportanceEvaluator, 64 trees, seed 0)", FanovaImportanceEvaluator(seed=0)),
        ("PED-ANOVA (optuna.importance.PedAnovaImportanceEvaluator)", PedAnovaImportanceEvaluator()),
    ):
        try:
            found = get_param_importances(probe, evaluator=evaluator)
            note = f"fANOVA could not fit ({tried[0]}); " if tried else ""
            if n < 10:
                note += f"only {n} finished trials: a hint, not a measurement"
            return Importance(target, {k: float(v) for k, v in found.items()}, method, note, n)
        except Exception as exc:  # noqa: BLE001 - too few or degenerate trials: say so, try the next
            tried.append(f"{type(exc).__name__}: {exc}")
    return Importance(target, {}, "", "not computed: " + "; ".join(tried), n)
