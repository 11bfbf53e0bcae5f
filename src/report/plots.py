"""The report's pictures: the stability map over two knobs, peak memory against the budget, throughput of the
settings that finished."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from src.failures import MEMORY, oom_needed_gib
from src.knobs import label
from src.report.text import fmt
from src.study import Sweep, TrialRow, sort_key

COLOURS = {"stable": "#2e7d32", "marginal": "#f9a825", "failed": "#c62828", "untested": "#e0e0e0"}


def put(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Every file of the report: written whole into a file of its own beside `path` (made new: never a link), then
    renamed onto `path`. A link planted in its place (to a file outside the project) is replaced itself, its target
    never written (#47.17), and a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # one a killed report left (a link there: the link goes)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(fig: Any, path: Path) -> None:
    """Every picture of the report: 110 dpi, trimmed to what is drawn, and the figure's memory freed."""
    import matplotlib.pyplot as plt

    put(path, lambda f: fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=110, bbox_inches="tight"))
    plt.close(fig)


def finish(fig: Any, ax: Any, path: Path, title: str, *, size: int = 10, legend: int = 8, where: str = "best") -> None:
    """A picture with a title, a light grid and a legend, saved (`save`)."""
    ax.set_title(title, fontsize=size)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend, loc=where)
    save(fig, path)


def map_axes(sweep: Sweep, ranking: dict[str, float]) -> tuple[str | None, str | None]:
    """The two knobs of the map: max_seq_length (what users change first) against the knob that moves
    memory most (importance `ranking`), or else the one with most values, in the knob registry's order."""
    varying = sweep.varying_knobs()
    if not varying:
        return None, None
    x = "data.max_seq_length" if "data.max_seq_length" in varying else max(varying, key=lambda k: ranking.get(k, -1))
    rest = [k for k in varying if k != x]
    if not rest:
        return x, None
    values = {k: len({sort_key(r.params.get(k)) for r in sweep.plain_rows()}) for k in rest}
    return x, max(rest, key=lambda k: (ranking.get(k, -1.0), values[k], -rest.index(k)))


def knob_values(sweep: Sweep, knob: str | None) -> list[Any]:
    if knob is None:
        return [None]
    found = {sort_key(r.params[knob]): r.params[knob] for r in sweep.plain_rows() if knob in r.params}
    return sorted(found.values(), key=sort_key)


def _outcome(sweep: Sweep, row: TrialRow) -> str:
    verdict = sweep.effective(row)
    if verdict == "failed":
        verdict = row.failure_kind or "failed"
    return f"{verdict} (inferred)" if row.verdict == "skipped" else verdict


def is_repeat(sweep: Sweep, row: TrialRow) -> bool:
    """A skipped trial with exactly its origin's setting (params and lever): the map counts that setting once."""
    origin = sweep.row(row.because_of) if row.because_of is not None else None
    return row.verdict == "skipped" and origin is not None and (origin.params, origin.lever) == (row.params, row.lever)


# ---- the stability map -----------------------------------------------------------------------------------------------

_ORDER = ["untested", "failed", "marginal", "stable"]  # a cell's colour: the best outcome among its trials


def map_cells(sweep: Sweep, x: str | None, y: str | None) -> tuple[list[list[int]], list[list[str]]]:
    """Per cell (y row, x column): its colour's index in _ORDER and its text. Lever trials stay out: they sit at
    the recipe's params but are another setting (the trials table and the advice show them)."""
    xs, ys = knob_values(sweep, x), knob_values(sweep, y)
    grid = [[0] * len(xs) for _ in ys]
    text = [[""] * len(xs) for _ in ys]
    for j, yv in enumerate(ys):
        for i, xv in enumerate(xs):
            cell = [
                r
                for r in sweep.plain_rows()
                if (x is None or sort_key(r.params.get(x)) == sort_key(xv))
                and (y is None or sort_key(r.params.get(y)) == sort_key(yv))
                and sweep.effective(r) in ("stable", "marginal", "failed")
                and not is_repeat(sweep, r)
            ]
            if not cell:
                text[j][i] = "not run"
                continue
            grid[j][i] = max(_ORDER.index(sweep.effective(r)) for r in cell)
            counts = Counter(_outcome(sweep, r) for r in cell)
            lines = [f"{n} {o}" if n > 1 else o for o, n in counts.most_common()]
            text[j][i] = "\n".join(lines[:3] + ([f"+{len(lines) - 3} more"] if len(lines) > 3 else []))
    return grid, text


def plot_map(sweep: Sweep, x: str | None, y: str | None, path: Path) -> None:
    """Stable / marginal / failed over two knobs. A cell holds every trial at that pair (other knobs may
    differ): its colour is the best outcome there, its text lists them all."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    xs, ys = knob_values(sweep, x), knob_values(sweep, y)
    grid, text = map_cells(sweep, x, y)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 * len(xs) + 1.5), max(2.5, 1.0 * len(ys) + 1.5)))
    ax.imshow(grid, cmap=ListedColormap([COLOURS[o] for o in _ORDER]), vmin=0, vmax=3, aspect="auto")
    for j in range(len(ys)):
        for i in range(len(xs)):
            dark = grid[j][i] in (1, 3)
            ax.text(i, j, text[j][i], ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(xs)), [fmt(v) for v in xs])
    ax.set_yticks(range(len(ys)), [fmt(v) for v in ys] if y else [""])
    ax.set_xlabel(x or "")
    ax.set_ylabel(y or "")
    budget = f"{sweep.budget:g} GiB budget, " if sweep.budget else ""
    ax.set_title(f"{sweep.name}: stability ({budget}margin {sweep.margin:.0%})", fontsize=10)
    ax.legend(
        handles=[Patch(color=COLOURS[o], label=o) for o in ("stable", "marginal", "failed", "untested")],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    save(fig, path)


# ---- peak memory -------------------------------------------------------------------------------------------------------


def plot_memory(sweep: Sweep, x: str | None, series: str | None, path: Path) -> str:
    """Peak reserved VRAM against `x` (max_seq_length), one line per value of `series`, budget as a line.
    Returns the metric drawn: host RSS when the study ran without a GPU (VRAM all zero)."""
    import matplotlib.pyplot as plt

    finished = [r for r in sweep.plain_rows() if r.verdict in ("stable", "marginal")]  # levers: not on these axes
    metric = "peak_vram_reserved_gib"
    if not any(r.metrics.get(metric) for r in finished):
        metric = "peak_rss_gib"
    xs = knob_values(sweep, x)
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in xs)
    pos = (lambda v: float(v)) if numeric else (lambda v: float(xs.index(v)) if v in xs else 0.0)  # noqa: E731
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    _memory_lines(ax, sweep, finished, metric, x, series, pos)
    if metric.startswith("peak_vram") and sweep.budget:
        _budget_lines(ax, sweep, x, pos)
        ax.set_ylim(bottom=0)
        label, title = sweep.memory_words()
        ax.set_ylabel(label)
    else:
        ax.set_ylabel("peak host RSS (GiB)")
        title = "peak host memory (no GPU in this study: VRAM was 0)"
    if not numeric:
        ax.set_xticks(range(len(xs)), [fmt(v) for v in xs])
    elif xs and xs != [None]:
        ax.set_xticks([float(v) for v in xs], [fmt(v) for v in xs])
    ax.set_xlabel(x or "")
    finish(fig, ax, path, f"{sweep.name}: {title}")
    return metric


def _memory_lines(
    ax: Any, sweep: Sweep, finished: list[TrialRow], metric: str, x: str | None, series: str | None, pos: Any
) -> None:
    """One line per value of `series` through the highest peak at each x; a dot per trial (hollow: marginal)."""
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis")
    svals = knob_values(sweep, series)
    for n, sv in enumerate(svals):
        colour = cmap(n / max(1, len(svals) - 1)) if len(svals) > 1 else "#1565c0"
        mine = [r for r in finished if series is None or sort_key(r.params.get(series)) == sort_key(sv)]
        points = sorted(
            ((pos(r.params.get(x)), r.metrics[metric], r) for r in mine if metric in r.metrics), key=lambda p: p[0]
        )
        if not points:
            continue
        peak: dict[float, float] = {}
        for px, py, _ in points:
            peak[px] = max(py, peak.get(px, py))
        name = f"{label(series)}={fmt(sv)}" if series else "finished"
        ax.plot(list(peak), list(peak.values()), "-", color=colour, label=name, alpha=0.8)
        for px, py, r in points:
            ax.plot(
                px,
                py,
                "o" if r.verdict == "stable" else "D",
                color=colour,
                mfc="white" if r.verdict != "stable" else colour,
            )


def _budget_lines(ax: Any, sweep: Sweep, x: str | None, pos: Any) -> None:
    """The budget, the margin below it, and each OOM drawn at what it held plus what it asked for (capped)."""
    ax.axhline(sweep.budget, color=COLOURS["failed"], ls="--", lw=1.2, label=f"budget {sweep.budget:g} GiB")
    ax.axhline(
        sweep.budget * (1 - sweep.margin),
        color=COLOURS["marginal"],
        ls=":",
        lw=1.0,
        label=f"margin {sweep.margin:.0%}",
    )
    ooms = [r for r in sweep.plain_rows() if r.verdict == "failed" and r.failure_kind in MEMORY and x in r.params]
    for r in ooms:
        needed = oom_needed_gib(r.metrics, sweep.budget)
        ax.plot(
            pos(r.params[x]),
            min(max(needed, sweep.budget), 1.15 * sweep.budget),
            "x",
            color=COLOURS["failed"],
            ms=9,
        )
    if ooms:
        ax.plot([], [], "x", color=COLOURS["failed"], label="OOM (needed more)")


# ---- throughput ---------------------------------------------------------------------------------------------------------


def plot_throughput(sweep: Sweep, path: Path, limit: int = 40) -> None:
    """tokens/s of the settings that finished: stable first in colour, marginal in amber (best at the top)."""
    import matplotlib.pyplot as plt

    rows = [r for r in sweep.rows if r.verdict in ("stable", "marginal") and "tokens_per_s" in r.metrics]
    rows = sorted(rows, key=lambda r: r.metrics["tokens_per_s"], reverse=True)[:limit]
    fig, ax = plt.subplots(figsize=(7.0, max(2.5, 0.4 * len(rows) + 1.2)))
    if not rows:
        ax.text(0.5, 0.5, "no trial finished: nothing to compare", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
    else:
        # label each bar by the knobs that differ among the bars shown
        knobs = [k for k in sweep.knobs if len({sort_key(r.params.get(k)) for r in rows}) > 1]
        names = [
            f"#{r.number}  "
            + " ".join(f"{label(k)}={fmt(r.params.get(k))}" for k in knobs)
            + (f" +{r.change()}" if r.lever else "")  # a lever trial: the recipe's knobs plus its change
            for r in rows
        ]
        speeds = [r.metrics["tokens_per_s"] for r in rows]
        bars = ax.barh(range(len(rows)), speeds, color=[COLOURS[r.verdict] for r in rows])
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.bar_label(bars, [f"{s:,.0f}" for s in speeds], padding=3, fontsize=8)
        caption = sweep.shared_card_caption()
        ax.set_xlabel("tokens/s (non-padding, warm-up excluded)" + (f"\n{caption}" if caption else ""))
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{sweep.name}: throughput of the settings that finished (amber: marginal)", fontsize=10)
    save(fig, path)
