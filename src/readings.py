"""How a trial's speed was read, in the words the report, the sweep's closing line and promotion use: the median of
its runs alone where the sweep timed it (src/sweep/timing.py), else how its one reading was taken."""

from __future__ import annotations

from src import knobs
from src.study import Sweep, TrialRow


def read_how(sweep: Sweep, row: TrialRow) -> str:
    """How a trial's speed was read, as words after it: " (the median of 3 runs alone on its card: 1,850-1,990)"
    where the sweep timed it (src/sweep/timing.py), " (read alone on its card)", " (read on a card shared by up to 4
    trials)", " (read on a CPU)"; "" where the trial's slot is not known."""
    timed = row.timed
    if timed.get("tokens_per_s"):
        low, high = timed["tokens_per_s_min"], timed["tokens_per_s_max"]
        return f" (the median of {timed['finished']} runs alone on its card: {low:,.0f}-{high:,.0f})"
    slot = row.slot or ""
    if not slot:
        return ""
    if slot.startswith("cpu"):
        return " (read on a CPU)"
    if "#" in slot:
        return f" (read on a card shared by up to {sweep.card_shared_by()} trials)"
    return " (read alone on its card)"


def timed_how(sweep: Sweep, row: TrialRow) -> str:
    """read_how's words where the study's objective is tokens/s and the sweep timed the trial alone (its score is
    then that median); "" otherwise."""
    timed = sweep.objectives[0] == "tokens_per_s" and row.timed.get("tokens_per_s")
    return read_how(sweep, row) if timed else ""


def best_line(sweep: Sweep) -> str | None:
    """The sweep's closing line on its best setting, as the report reads it: the first ranked trial (none that
    trains another model or failed the same-model check) and its objective, the median of its runs alone where the
    sweep timed it; None where nothing stable is within the policies."""
    best = sweep.best()
    if best is None:
        return None
    objective = sweep.objectives[0]
    how = read_how(sweep, best) if objective == "tokens_per_s" else ""
    return f"best stable {objective} within the policies: {knobs.figure(sweep.score(best))}{how} (trial {best.number})"
