"""Which trial is promoted: the best stable one by the study's first objective, or the stable one asked for; never
one that cuts more answers than the truncation policy allows; and when none qualifies, why, in counts."""

from __future__ import annotations

from collections import Counter

from src.report.text import fmt, share
from src.study import Sweep, TrialRow


class NotPromotable(Exception):
    """No trial qualifies (or the one asked for does not); the message says why."""


ALLOW_UNSOAKED = "--allow-unsoaked"


def choose(sweep: Sweep, trial: int | None = None, allow_unsoaked: bool = False) -> TrialRow:
    """The best soaked stable trial by the study's first objective, or the stable trial asked for (soaked too).
    `allow_unsoaked`: a stable trial whose only evidence is its short probe (the production file's header says so)."""
    if trial is not None:
        row = sweep.row(trial)
        if row is None:
            raise NotPromotable(f"study {sweep.name} has no trial {trial}")
        if row.verdict != "stable":
            raise NotPromotable(f"trial {trial} is {row.verdict} ({row.detail}), not stable")
        if sweep.cuts_too_much(row):
            raise NotPromotable(cuts_too_much(sweep, row))
        if not allow_unsoaked and soak_status(sweep, row) != "passed":
            raise NotPromotable(not_soaked(sweep, [row]))
        return row
    ranked = sweep.ranked()
    soaked = [r for r in ranked if soak_status(sweep, r) == "passed"]
    if soaked:
        return soaked[0]
    if ranked and allow_unsoaked:
        return ranked[0]
    if ranked:
        raise NotPromotable(not_soaked(sweep, ranked))
    stable = [r for r in sweep.rows if r.verdict == "stable"]
    cutting = [r for r in stable if sweep.cuts_too_much(r)]
    if stable and len(cutting) == len(stable):
        shown = ", ".join(f"trial {r.number} {share(sweep.cut_answers(r) or 0.0)}" for r in cutting[:5])
        raise NotPromotable(
            f"{len(stable)} stable trial(s), but each cuts more answers than "
            f"preflight.max_truncated_answer_frac={sweep.max_truncated_answer_frac:g} allows ({shown}"
            + (", ..." if len(cutting) > 5 else "")
            + "): promote a setting with a longer data.max_seq_length, or shorten or drop the long rows"
        )
    if stable:
        raise NotPromotable(f"{len(stable)} stable trial(s), but none recorded the objective {sweep.objectives[0]}")
    raise NotPromotable(why_none(sweep))


def soak_status(sweep: Sweep, row: TrialRow) -> str | None:
    """passed | failed | running for a finalist the sweep soaked (src/sweep/soak.py); None if never soaked."""
    return sweep.soaks.get(row.number, {}).get("status")


def not_soaked(sweep: Sweep, rows: list[TrialRow]) -> str:
    """Why stable trials are not promoted: their soaks failed, or they were never soaked."""
    parts = []
    for r in rows[:3]:
        soak = sweep.soaks.get(r.number)
        if soak is None:
            parts.append(f"trial {r.number} was not soaked")
        else:
            parts.append(f"trial {r.number}'s soak {soak.get('status')}: {soak.get('detail', '')}".rstrip(": "))
    return (
        f"no stable trial passed a soak ({'; '.join(parts)}{'; ...' if len(rows) > 3 else ''}). A probe of a few "
        "steps is not a long run: run a new study that soaks its finalists (hydra.sweeper.soak_top_k, "
        f"soak_minutes; a complete study launches nothing more), or promote without one with {ALLOW_UNSOAKED}"
    )


def cuts_too_much(sweep: Sweep, row: TrialRow) -> str:
    """Why a trial that cuts answers is not promoted, in the words of preflight's refusal of a single run: the
    sweep measured the setting, training it would teach the model broken targets."""
    seq = row.params.get("data.max_seq_length")
    at = f"data.max_seq_length={fmt(seq)}" if seq is not None else "its data.max_seq_length"
    return (
        f"trial {row.number} cuts {share(sweep.cut_answers(row) or 0.0)} of the assistant answers at {at} (the "
        f"model would learn a broken target); refused above "
        f"preflight.max_truncated_answer_frac={sweep.max_truncated_answer_frac:g}. Promote a setting with a longer "
        "data.max_seq_length, or shorten or drop the long rows"
    )


def why_none(sweep: Sweep) -> str:
    """Why no trial is stable, in counts: "all 12 trials failed: 9 oom, 3 timeout"."""
    if not sweep.rows:
        return f"study {sweep.name} has no trials"
    by = Counter(r.verdict for r in sweep.rows)
    kinds = Counter(r.failure_kind or "other" for r in sweep.rows if r.verdict == "failed")
    failed = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
    launched = sum(by[v] for v in ("stable", "marginal", "failed"))
    skipped = f"; {by['skipped']} more skipped (repeats or certain OOMs)" if by["skipped"] else ""
    if by["failed"] and by["failed"] == launched and not by["running"]:
        return f"all {by['failed']} trials failed: {failed}{skipped}"
    reasons: Counter[str] = Counter()
    for r in sweep.rows:
        if r.verdict == "marginal":
            reasons.update(_marginal_reason(part, sweep.margin) for part in r.detail.split("; "))
    parts = []
    if by["marginal"]:
        why = list(reasons) if len(reasons) == 1 else [f"{n} {k}" for k, n in reasons.most_common()]
        parts.append(f"{by['marginal']} marginal ({', '.join(why)})")
    if by["failed"]:
        parts.append(f"{by['failed']} failed ({failed})")
    parts += [f"{by[v]} {v}" for v in ("skipped", "pruned", "running") if by[v]]
    return "no stable trial: " + ", ".join(parts)


def _marginal_reason(detail: str, margin: float) -> str:
    if detail.startswith("headroom"):
        return f"headroom < {margin:.0%}"
    return "allocator retries" if "allocator" in detail else detail
