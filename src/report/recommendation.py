"""The last sentence of "What to change": one recommendation — the setting to train (Sweep.recommended: the best
stable setting within the policies that passed its soak, else the best not soaked yet), its measured memory and
speed against the recipe, its soak, the share of answers it keeps, and the exact commands that train it. Where no
measured setting satisfies every policy, it names the policy no setting met and the closest setting.
"""

from __future__ import annotations

from src.readings import read_how
from src.study import Sweep, TrialRow, short_override


def recommendation(sweep: Sweep, recipe: TrialRow | None) -> str:
    row = sweep.recommended()
    if row is None:
        return _none(sweep)
    soak = sweep.soaks.get(row.number, {})
    passed = soak.get("status") == "passed"
    promote = f"python -m src.promote {sweep.name}" + ("" if passed else " --allow-unsoaked")
    cut = sweep.cut_answers(row) or 0.0
    return (
        f"Recommended: trial {row.number} ({words(sweep, row, recipe)}): {_figures(sweep, row)}{_against(row, recipe)}"
        f"{same_model_words(sweep, row)}; {_soak(soak)}; it keeps {1 - cut:.1%} of answers whole. Train it: `{promote}`, then "
        "`python -m src.train experiment=production`."
    )


def words(sweep: Sweep, row: TrialRow, recipe: TrialRow | None) -> str:
    """What the setting changes of the recipe (`recipe + gradient_checkpointing + max_seq_length=4096`), or its
    knobs where the sweep had no recipe or the setting is the recipe itself."""
    if recipe is not None and row.number == recipe.number:
        return "your recipe"
    if recipe is None:
        return ", ".join(
            [f"{k.rsplit('.', 1)[-1]}={row.params[k]}" for k in sweep.knobs if k in row.params] + row.lever
        )
    parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in row.params.items() if recipe.params.get(k, v) != v]
    for override in row.lever:
        name, _, value = short_override(override).partition("=")
        parts.append(name if value == "true" else f"{name}={value.strip(chr(39))}")
    return " + ".join(["recipe", *parts])


def _figures(sweep: Sweep, row: TrialRow) -> str:
    m = row.metrics
    budget = m.get("vram_budget_gib") or sweep.budget
    parts = []
    if m.get("peak_vram_reserved_gib") is not None:
        parts.append(
            f"{m['peak_vram_reserved_gib']:.2f} GiB peak reserved"
            + (f" of the {budget:g} GiB budget" if budget else "")
        )
    if row.speed():
        parts.append(f"{row.speed():,.0f} tokens/s{read_how(sweep, row)}")
    return ", ".join(parts) or "no figures recorded"


def _against(row: TrialRow, recipe: TrialRow | None) -> str:
    """Against the recipe: its speed ratio where it ran, else how it failed."""
    if recipe is None or row.number == recipe.number:
        return ""
    speed, theirs = row.speed(), recipe.speed()
    if recipe.verdict in ("stable", "marginal") and speed and theirs:
        said = f" ({speed / theirs:.2f}× your recipe's speed; your recipe: {recipe.verdict}, {recipe.detail})"
    else:
        said = f" (your recipe: {recipe.verdict}, {recipe.detail})"
    new, old = row.metrics.get("tokens_per_optimizer_step"), recipe.metrics.get("tokens_per_optimizer_step")
    if new and old and not 0.8 <= new / old <= 1.25:  # batches of one setting differ a little; a step size 2x
        said += f"; a different optimisation: {new:,.0f} tokens per optimizer step instead of {old:,.0f}"
    return said


def same_model_words(sweep: Sweep, row: TrialRow) -> str:
    """The same-model check's verdict on the setting (src/sweep/faster.py), where the sweep made it, and its speed
    against the reference's where the sweep timed both alone (src/sweep/timing.py)."""
    check = row.same_model
    if not check:
        return _unchecked(sweep, row)
    if not check.get("passed") or "max_loss_diff" not in check:
        return ""
    tol = check["tolerance"]
    said = (
        f"; it trains the same model as trial {check['reference']} (checked over {check['steps']} optimizer steps on "
        f"the same rows: losses within {_loss(check)} of its, tolerance {_loss(tol)}; "
        f"adapter within {check['adapter_rel_diff']:.2%}, tolerance {tol['adapter_rel_diff']:.0%})"
    )
    ref = next((r for r in sweep.rows if r.number == check["reference"]), None)
    if ref is not None and ref.timed.get("tokens_per_s") and row.timed.get("tokens_per_s"):
        said += (
            f" at {row.timed['tokens_per_s'] / ref.timed['tokens_per_s']:.2f}× its speed (medians of runs alone: "
            f"{row.timed['tokens_per_s']:,.0f} against {ref.timed['tokens_per_s']:,.0f} tokens/s)"
        )
    return said


def _unchecked(sweep: Sweep, row: TrialRow) -> str:
    """A setting that splits the recipe's rows per optimizer step into other micro-batches, with nothing at the
    recipe's own split good enough to check it against (the recipe did not fit): said, since the check never ran."""
    from src.sweep.faster import reference

    recipe = sweep.recipe_row()
    if recipe is None or row is recipe or sweep.step(row) == sweep.step(recipe) or not sweep.same_optimisation(row):
        return ""
    if reference(sweep) is not None:
        return ""
    batch, accumulation = sweep.step(recipe) or (None, None)
    return (
        f"; not checked to train your recipe's model: it splits the same rows per optimizer step into other "
        f"micro-batches, and nothing at your batch {batch} x accumulation {accumulation} fit to check it against"
    )


def _loss(said: dict) -> str:
    """A loss difference or its tolerance: a share of the loss (today's check), or absolute (a study checked before)."""
    if "max_loss_rel_diff" in said:
        return f"{said['max_loss_rel_diff']:.2%}"
    return f"{said['max_loss_diff']:.1e}"


def _soak(soak: dict) -> str:
    if soak.get("status") == "passed":
        text = f"its soak passed ({soak.get('detail', '')}"
        if soak.get("peak_vs_map") is not None:
            text += f"; peak {soak['peak_vs_map']:+.1%} over its probe"
        return text + ")"
    if soak.get("status") in ("running", "stopped"):
        return "its soak did not finish (run the sweep's command again: it soaks it)"
    return (
        "not soaked yet: a probe of a few steps is not a long run (a sweep with hydra.sweeper.soak_top_k of 1 or more "
        "soaks it)"
    )


def _none(sweep: Sweep) -> str:
    """No measured setting satisfies every policy: which one none met, and the closest setting."""
    stable = [r for r in sweep.rows if r.verdict == "stable"]
    searched = sweep.recommendation or {}
    note = f" The sweep's search: {searched.get('note')}." if searched.get("note") else ""
    closest = searched.get("closest")
    if closest:
        changes = " + ".join(short_override(o) for o in closest["changes"])
        note += f" Closest predicted: recipe + {changes} at {closest['predicted_gib']:.2f} GiB."
    if stable:
        least = min(stable, key=lambda r: sweep.cut_answers(r) or 0.0)
        return (
            f"No setting to recommend: every stable setting cuts more answers than the truncation policy "
            f"(preflight.max_truncated_answer_frac={sweep.max_truncated_answer_frac:g}) allows; the closest is trial "
            f"{least.number} ({words(sweep, least, sweep.recipe_row())}), which cuts "
            f"{sweep.cut_answers(least) or 0.0:.1%} of answers.{note}"
        )
    finished = [r for r in sweep.rows if r.verdict == "marginal" and r.metrics.get("peak_vram_reserved_gib")]
    if finished:
        best = min(finished, key=lambda r: r.metrics["peak_vram_reserved_gib"])
        return (
            f"No setting to recommend: none kept the headroom margin ({sweep.margin:.0%} of the budget free); the "
            f"closest is trial {best.number} ({words(sweep, best, sweep.recipe_row())}): {best.detail}.{note}"
        )
    return f"No setting to recommend: no measured setting ran within the budget.{note}"
