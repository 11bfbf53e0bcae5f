"""What to change: the report's answer to the user's question, in words, from measurements only.

First the user's recipe (the trial the sweep marked `sweep.recipe`, else trial 0): stable, marginal or failed, and
why. Then, when it is not stable, the smallest measured changes that make it stable, with their cost: one knob
changed (the nearest value that worked), then the sweep's levers on the recipe itself, then two knobs where
neither alone was enough. Then the fastest stable setting. Each sentence names the trial it rests on and quotes
only what that trial recorded (a ratio of two recorded speeds at most), so the advice is as good as the map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from src.failures import MEMORY
from src.readings import read_how
from src.report.recommendation import recommendation
from src.report.text import fmt, share
from src.study import Sweep, TrialRow, short_override

# Knobs that change what one optimizer step trains on (examples per step, rows per example): a setting that moves
# one is a different optimisation, whatever its speed. Levers are override strings and count by their key.
STEP_SIZE = ("trainer.gradient_accumulation_steps", "trainer.per_device_train_batch_size", "trainer.packing")
_MOST_PAIRS = 3  # two-knob changes listed at most (the nearest first)
_MOST_TRIED = 8  # trials named when nothing worked


@dataclass
class Change:
    """A measured trial as a change of the recipe: the knobs it moved, (key, recipe's value, its value), and the
    lever overrides it added."""

    row: TrialRow
    knobs: list[tuple[str, Any, Any]]
    lever: list[str]

    @property
    def kind(self) -> str:
        """one_knob | lever | two_knobs | other: the order the advice tries them in."""
        if self.lever:
            return "lever" if not self.knobs else "other"
        return {1: "one_knob", 2: "two_knobs"}.get(len(self.knobs), "other")

    def keys(self) -> set[str]:
        """The config keys it changes, knobs and levers alike."""
        return {k for k, _, _ in self.knobs} | {o.partition("=")[0].lstrip("+~") for o in self.lever}

    def words(self) -> str:
        """The change in words: max_seq_length 768 instead of 1024; your recipe with gradient_checkpointing=true."""
        if self.kind == "lever":
            return f"your recipe with {', '.join(short_override(o) for o in self.lever)}"
        news = " and ".join(f"{_name(k)} {fmt(new)}" for k, _, new in self.knobs)
        olds = " and ".join(fmt(old) for _, old, _ in self.knobs)
        return f"{news} instead of {olds}" + (
            f" with {', '.join(short_override(o) for o in self.lever)}" if self.lever else ""
        )

    def distance(self) -> float:
        """How far the knobs moved, each relative to the recipe's value (non-numbers count 1)."""
        total = 0.0
        for _, old, new in self.knobs:
            numbers = all(isinstance(v, int | float) for v in (old, new))
            total += abs(float(new) - float(old)) / max(abs(float(old)), 1.0) if numbers else 1.0
        return total


def what_to_change(sweep: Sweep) -> list[str]:
    """The user's question answered in sentences, each naming its trial (see the module's docstring), ending with
    one recommendation and the command that trains it (src/report/recommendation.py)."""
    if not sweep.rows:
        return ["No trials yet: nothing measured, nothing to advise."]
    recipe = recipe_row(sweep)
    out = []
    if recipe is not None:
        out.append(_recipe_sentence(sweep, recipe))
        if not _good(sweep, recipe):
            fixes = _fixes(sweep, recipe)
            out += [_fix_sentence(sweep, recipe, f, fixes) for f in fixes] or [_nothing_worked(sweep, recipe)]
    out += _fastest(sweep, recipe)
    if sweep.card_shared_by() > 1:
        out.append(
            f"Trials shared a card (up to {sweep.card_shared_by()} at once), so these speeds rank the settings; "
            "run the ones you care about alone before quoting them."
        )
    return [*out, recommendation(sweep, recipe)]


def recipe_row(sweep: Sweep) -> TrialRow | None:
    """The user's recipe: the trial the sweep marked as it (the first of `enqueue_trials`); None when the sweep
    queued none (`hydra.sweeper.enqueue_trials=[]`): no trial is then called "your recipe"."""
    return sweep.recipe_row()


# ---- the recipe ---------------------------------------------------------------------------------------------------


def _recipe_sentence(sweep: Sweep, recipe: TrialRow) -> str:
    """Stable, marginal or failed, and why, with the figures the trial recorded."""
    who = f"Your recipe (trial {recipe.number}: {_setting(sweep, recipe)})"
    if recipe.verdict == "stable":
        return f"{who} is stable: {_figures(sweep, recipe)}{_cut(sweep, recipe)}."
    if recipe.verdict == "marginal":
        return f"{who} is marginal ({recipe.detail}): {_figures(sweep, recipe)}{_cut(sweep, recipe)}."
    if recipe.verdict == "failed":
        return f"{who} fails: {recipe.detail}{_why_failed(sweep, recipe)}."
    return f"{who} is {recipe.verdict}: {recipe.detail}."


def _why_failed(sweep: Sweep, row: TrialRow) -> str:
    """An OOM's need as measured (held at the failure plus the request that failed); else its message."""
    m, budget = row.metrics, _budget(sweep, row)
    if row.failure_kind in MEMORY and m.get("peak_vram_reserved_gib") and budget:
        held, asked = m["peak_vram_reserved_gib"], m.get("oom_request_gib")
        if asked is None:
            return f" with {held:.2f} GiB reserved of the {budget:g} GiB budget"
        if held + asked > budget:
            return f" — it needed at least {held + asked:.2f} GiB of the {budget:g} GiB budget"
        return f" — it held {held:.2f} GiB and asked for {asked:.2f} GiB more of the {budget:g} GiB budget"
    return f" ({row.failure_message.splitlines()[0][:160]})" if row.failure_message else ""


def _good(sweep: Sweep, row: TrialRow) -> bool:
    """Needs no change: stable, and cuts no more answers than the policy allows."""
    return row.verdict == "stable" and not sweep.cuts_too_much(row)


# ---- the changes that work ------------------------------------------------------------------------------------------


def _change(recipe: TrialRow, row: TrialRow) -> Change:
    keys = sorted(set(recipe.params) | set(row.params))
    moved = [(k, recipe.params.get(k), row.params.get(k)) for k in keys if recipe.params.get(k) != row.params.get(k)]
    return Change(row, moved, [o for o in row.lever if o not in recipe.lever])


def _fixes(sweep: Sweep, recipe: TrialRow) -> list[Change]:
    """The smallest measured changes that make the recipe stable: the nearest working value of each knob, every
    working lever, then pairs of knobs neither of which worked alone. A recipe that fits but cuts too many answers
    is only fixed by settings that cut no more than the policy allows."""
    memory_fine = recipe.verdict == "stable"
    working = [
        _change(recipe, r)
        for r in sweep.rows
        if r.number != recipe.number and r.verdict == "stable" and not (memory_fine and sweep.cuts_too_much(r))
    ]
    singles = _nearest([c for c in working if c.kind == "one_knob"], lambda c: c.knobs[0][0])
    levers = _nearest([c for c in working if c.kind == "lever"], lambda c: tuple(c.lever))
    alone = {c.knobs[0][0] for c in singles}
    pairs = [c for c in working if c.kind == "two_knobs" and not (c.keys() & alone)]
    pairs = sorted(_nearest(pairs, lambda c: tuple(k for k, _, _ in c.knobs)), key=Change.distance)[:_MOST_PAIRS]
    return singles + levers + pairs


def _nearest(changes: list[Change], group: Any) -> list[Change]:
    """Per group (a knob, a lever, a pair of knobs): the change nearest the recipe; ties to the faster trial."""
    best: dict[Any, Change] = {}
    for c in changes:
        key, held = group(c), best.get(group(c))
        if held is None or (c.distance(), -_speed(c.row)) < (held.distance(), -_speed(held.row)):
            best[key] = c
    return list(best.values())


def _fix_sentence(sweep: Sweep, recipe: TrialRow, fix: Change, fixes: list[Change]) -> str:
    text = f"Trial {fix.row.number} ({fix.words()}) {_goal(recipe, 'makes it')}: {_figures(sweep, fix.row)}"
    return text + _relative(recipe, fix.row, fixes) + _cut(sweep, fix.row) + _step(recipe, fix) + "."


def _goal(recipe: TrialRow, verb: str) -> str:
    """What a fix achieves: stability, or (for a recipe that fits but cuts answers) keeping the answers whole."""
    return f"{verb} stable" if recipe.verdict != "stable" else f"{verb} stable within the truncation policy"


def _relative(recipe: TrialRow, row: TrialRow, fixes: list[Change]) -> str:
    """Speed against the recipe when it ran, else against the fastest of the other options."""
    if _speed(row) <= 0:
        return ""
    if recipe.verdict in ("stable", "marginal") and _speed(recipe) > 0:
        return f", {_speed(row) / _speed(recipe):.2f}× your recipe's speed"
    others = [f.row for f in fixes if f.row.number != row.number and _speed(f.row) > 0]
    if not others:
        return ""
    fastest = max(others, key=_speed)
    if _speed(row) >= _speed(fastest):
        return ", the fastest of these options"
    return f", {_speed(row) / _speed(fastest):.2f}× the speed of trial {fastest.number}"


def _step(recipe: TrialRow, change: Change) -> str:
    """A change of what an optimizer step trains on makes another optimisation: say so with its figures."""
    if not change.keys() & set(STEP_SIZE):
        return ""
    new, old = change.row.metrics.get("tokens_per_optimizer_step"), recipe.metrics.get("tokens_per_optimizer_step")
    if new is None:
        return "; a different optimisation (it changes what one optimizer step trains on)"
    if old is None:
        return f"; a different optimisation: {new:,.0f} tokens per optimizer step (your recipe's was not measured)"
    return f"; a different optimisation: {new:,.0f} tokens per optimizer step instead of {old:,.0f}"


def _nothing_worked(sweep: Sweep, recipe: TrialRow) -> str:
    """What was tried on the recipe (one knob or a lever), each with its outcome, when none of it was stable."""
    tried = [_change(recipe, r) for r in sweep.rows if r.number != recipe.number and r.verdict != "skipped"]
    tried = [c for c in tried if c.kind in ("one_knob", "lever")]
    if not tried:
        return (
            f"Nothing measured {_goal(recipe, 'makes your recipe')}: no trial changed one knob of it or added a lever."
        )
    shown = [f"trial {c.row.number} ({c.words()}: {c.row.verdict}, {c.row.detail})" for c in tried[:_MOST_TRIED]]
    more = f" and {len(tried) - _MOST_TRIED} more" if len(tried) > _MOST_TRIED else ""
    return f"Nothing measured {_goal(recipe, 'makes your recipe')}; tried: {'; '.join(shown)}{more}."


# ---- the fastest ----------------------------------------------------------------------------------------------------


def _fastest(sweep: Sweep, recipe: TrialRow | None) -> list[str]:
    """The fastest stable setting within the truncation policy, and a faster one that cuts too much, if any."""
    stable = [r for r in sweep.rows if r.verdict == "stable" and _speed(r) > 0]
    allowed = [r for r in stable if not sweep.cuts_too_much(r)]
    out = []
    if allowed:
        best = max(allowed, key=lambda r: (_speed(r), -r.number))
        if recipe is None:
            out.append(
                f"The fastest stable setting measured is trial {best.number} ({_setting(sweep, best)}): "
                f"{_figures(sweep, best)}{_cut(sweep, best)}."
            )
        elif best.number == recipe.number:
            out.append(f"Your recipe (trial {best.number}) is also the fastest stable setting measured.")
        else:
            change = _change(recipe, best)
            ran = recipe.verdict in ("stable", "marginal") and _speed(recipe) > 0
            out.append(
                f"The fastest stable setting measured is trial {best.number} ({_setting(sweep, best)}): "
                f"{_figures(sweep, best)}"
                + (f", {_speed(best) / _speed(recipe):.2f}× your recipe's speed" if ran else "")
                + _cut(sweep, best)
                + _step(recipe, change)
                + "."
            )
    faster = [r for r in stable if sweep.cuts_too_much(r) and (not allowed or _speed(r) > max(map(_speed, allowed)))]
    if faster:
        r = max(faster, key=_speed)
        out.append(
            f"Trial {r.number} ({_setting(sweep, r)}) is faster at {_speed(r):,.0f} tokens/s{read_how(sweep, r)}{_cut(sweep, r)}."
        )
    return out


# ---- words and figures ----------------------------------------------------------------------------------------------


def _figures(sweep: Sweep, row: TrialRow) -> str:
    """Peak reserved against the budget, headroom and tokens/s, each only where the trial recorded it."""
    m, parts = row.metrics, []
    if m.get("peak_vram_reserved_gib"):
        budget = _budget(sweep, row)
        parts.append(
            f"{m['peak_vram_reserved_gib']:.2f} GiB peak reserved"
            + (f" of the {budget:g} GiB budget" if budget else "")
            + (f" (headroom {m['vram_headroom_frac']:.0%})" if "vram_headroom_frac" in m else "")
        )
    elif m.get("peak_rss_gib"):
        parts.append(f"{m['peak_rss_gib']:.2f} GiB peak host memory (no GPU)")
    if _speed(row) > 0:
        parts.append(f"{_speed(row):,.0f} tokens/s{read_how(sweep, row)}")
    return ", ".join(parts) or "no figures recorded"


def _cut(sweep: Sweep, row: TrialRow) -> str:
    """The share of answers cut, and whether the policy forbids promoting it."""
    cut = sweep.cut_answers(row)
    if not cut:
        return ""
    if sweep.cuts_too_much(row):
        at = (
            f" at data.max_seq_length={fmt(row.params['data.max_seq_length'])}"
            if "data.max_seq_length" in row.params
            else ""
        )
        return (
            f", but it cuts {share(cut)} of answers{at}, more than "
            f"preflight.max_truncated_answer_frac={sweep.max_truncated_answer_frac:g} allows (never promoted)"
        )
    return f"; it cuts {share(cut)} of answers"


def _setting(sweep: Sweep, row: TrialRow) -> str:
    knobs = [f"{_name(k)} {fmt(row.params[k])}" for k in sweep.knobs if k in row.params]
    return ", ".join(knobs + [short_override(o) for o in row.lever])


def _budget(sweep: Sweep, row: TrialRow) -> float | None:
    return row.metrics.get("vram_budget_gib") or sweep.budget


def _speed(row: TrialRow) -> float:
    return row.speed() or 0.0


def _name(key: str) -> str:
    """A key as the user writes it: the library's field name (max_seq_length, gradient_accumulation_steps)."""
    return key.rsplit(".", 1)[-1]
