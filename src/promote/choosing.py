"""Which trial is promoted: the best stable one by the study's first objective, or the stable one asked for; and
when none qualifies, why, in counts."""

from __future__ import annotations

from collections import Counter

from src.study import Sweep, TrialRow


class NotPromotable(Exception):
    """No trial qualifies (or the one asked for does not); the message says why."""


def choose(sweep: Sweep, trial: int | None = None) -> TrialRow:
    """The best stable trial by the study's first objective, or the stable trial asked for."""
    if trial is not None:
        row = sweep.row(trial)
        if row is None:
            raise NotPromotable(f"study {sweep.name} has no trial {trial}")
        if row.verdict != "stable":
            raise NotPromotable(f"trial {trial} is {row.verdict} ({row.detail}), not stable")
        return row
    best = sweep.best()
    if best is not None:
        return best
    stable = [r for r in sweep.rows if r.verdict == "stable"]
    if stable:
        raise NotPromotable(f"{len(stable)} stable trial(s), but none recorded the objective {sweep.objectives[0]}")
    raise NotPromotable(why_none(sweep))


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
