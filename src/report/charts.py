"""The report page's charts (plotly figures) and the words they and the page share for a trial: its setting, its
class, a knob's axis name, a figure as drawn (measured, or an OOM's need). src.report.page assembles them into
report.html; plotly.js is inlined there, so nothing here reaches the network (no logo link, no cloud button).
"""

from __future__ import annotations

import html
from typing import Any

from src.failures import MEMORY, oom_needed_gib
from src.knobs import label
from src.report.plots import COLOURS, is_repeat, knob_values
from src.report.text import fmt
from src.study import Sweep, TrialRow, sort_key

# A class's colour wherever the page shows it (the map's and the PNGs' for the first three).
CLASS_COLOURS = {
    "stable": COLOURS["stable"],
    "marginal": COLOURS["marginal"],
    "failed": COLOURS["failed"],
    "skipped": "#9e9e9e",
    "pruned": "#bdbdbd",
    "running": "#64b5f6",
}
_OUTCOME_AXIS = ("failed", "marginal", "stable")  # the parallel-coordinates axis, worst at the bottom
# The metrics the charts offer, in menu order, with their axis titles.
_METRICS = {
    "tokens_per_s": "tokens/s",
    "peak_vram_reserved_gib": "peak reserved VRAM (GiB)",
    "peak_rss_gib": "peak host RSS (GiB)",
    "vram_headroom_frac": "headroom (share of budget free)",
    "step_time_s": "step time (s, median)",
}
# No logo link, no cloud button, no MathJax: nothing that reaches the network.
_PLOT_CONFIG = {"displaylogo": False, "responsive": True}


def _metric_name(sweep: Sweep, metric: str) -> str:
    """A metric's name on the page; peak "VRAM" in the words of what it was on this study's machine."""
    if metric == "peak_vram_reserved_gib":
        return sweep.memory_words()[0]
    return _METRICS.get(metric, metric)


def memory_figure(sweep: Sweep, x: str | None, metric: str) -> Any:
    """Peak memory per trial against the map's first knob, one trace per class; the budget and the margin as lines;
    OOMs at what they held plus what they asked for (capped), as in the PNG."""
    import plotly.graph_objects as go

    fig = go.Figure()
    rows = [r for r in sweep.plain_rows() if not is_repeat(sweep, r)]
    gpu = metric.startswith("peak_vram") and bool(sweep.budget)
    axis, what = sweep.memory_words() if gpu else (_metric_name(sweep, metric), "")
    for verdict in ("stable", "marginal", "failed"):
        points = []
        for r in rows:
            if sweep.effective(r) != verdict:
                continue
            value = r.metrics.get(metric)
            oom = gpu and verdict == "failed" and r.failure_kind in MEMORY
            if oom:
                value = min(max(oom_needed_gib(r.metrics, sweep.budget), sweep.budget), 1.15 * sweep.budget)
            elif verdict == "failed" or not value:
                continue  # a failure's zeros are "not measured"
            points.append((r, value, oom))
        if not points:
            continue
        fig.add_trace(
            go.Scatter(
                x=[_x_value(r, x) for r, _, _ in points],
                y=[v for _, v, _ in points],
                mode="markers",
                name=verdict + (" (OOM: held + asked, capped)" if verdict == "failed" and gpu else ""),
                marker={
                    "color": CLASS_COLOURS[verdict],
                    "size": 11,
                    "symbol": ["x" if oom else "circle" for _, _, oom in points],
                    "line": {"width": 1, "color": "#333"},
                },
                text=[_hover(sweep, r) for r, _, _ in points],
                hovertemplate="%{text}<br>" + axis + ": %{y:.2f}<extra></extra>",
            )
        )
    if gpu:
        fig.add_hline(
            y=sweep.budget,
            line={"color": COLOURS["failed"], "dash": "dash"},
            annotation_text=f"budget {sweep.budget:g} GiB",
        )
        fig.add_hline(
            y=sweep.budget * (1 - sweep.margin),
            line={"color": COLOURS["marginal"], "dash": "dot"},
            annotation_text=f"margin {sweep.margin:.0%}",
            annotation_position="bottom right",
        )
    title = (
        f"{what} per trial; dashed: the budget, dotted: the margin below it"
        if gpu
        else "peak host RSS per trial (this study ran without a GPU: VRAM was 0)"
    )
    _layout(fig, title, axis_name(x), axis, categorical=_categorical(sweep, x))
    if gpu:
        fig.update_yaxes(rangemode="tozero")
    return fig


def knob_charts(sweep: Sweep, memory_metric: str) -> str:
    return (
        chart(_parallel_figure(sweep, memory_metric))
        + '<p class="note">Each line is a trial: its knobs, its outcome, its peak memory and its speed. Drag along '
        "an axis to keep only the lines crossing there (click the axis outside the band to clear); drag an axis "
        "title to reorder. A figure a trial did not measure sits at 0 on its axis: a failed trial has no speed, and "
        "only an OOM has a peak (what it held plus what it asked for).</p>"
        + chart(_scatter_figure(sweep, memory_metric))
    )


def _parallel_figure(sweep: Sweep, memory_metric: str) -> Any:
    """Parallel coordinates over every measured setting: the knobs that varied, the change of a lever trial, the
    outcome, peak memory and tokens/s; coloured by outcome."""
    import plotly.graph_objects as go

    rows = [r for r in sweep.rows if sweep.effective(r) in _OUTCOME_AXIS and not is_repeat(sweep, r)]
    dims = [_dimension(label(k), [r.params.get(k) for r in rows]) for k in sweep.varying_knobs()]
    if any(r.lever for r in rows):
        dims.append(_dimension("change", [r.change() or "none" for r in rows]))
    outcome = [_OUTCOME_AXIS.index(sweep.effective(r)) for r in rows]
    dims.append({"label": "outcome", "values": outcome, "tickvals": [0, 1, 2], "ticktext": list(_OUTCOME_AXIS)})
    for metric in (memory_metric, "tokens_per_s"):
        values = [measured(sweep, r, metric) for r in rows]
        if any(v is not None for v in values):
            # a trial that did not measure it sits at 0 and the axis says so (plotly has no gap for a NaN)
            name = _metric_name(sweep, metric) + (" (0: not measured)" if None in values else "")
            dims.append({"label": name, "values": [v or 0.0 for v in values]})
    scale = [[0.0, COLOURS["failed"]], [0.5, COLOURS["marginal"]], [1.0, COLOURS["stable"]]]
    fig = go.Figure(go.Parcoords(line={"color": outcome, "colorscale": scale, "cmin": 0, "cmax": 2}, dimensions=dims))
    fig.update_layout(
        title={"text": "knobs → outcome, memory, speed (one line per trial)", "font": {"size": 14}},
        margin={"l": 70, "r": 70, "t": 90, "b": 30},
        height=460,
        template="plotly_white",
    )
    return fig


def _scatter_figure(sweep: Sweep, memory_metric: str) -> Any:
    """Any knob or peak memory (x) against tokens/s, peak memory or headroom (y), one trace per class; the menus
    switch the axes."""
    import plotly.graph_objects as go

    rows = [r for r in sweep.rows if sweep.effective(r) in ("stable", "marginal") and not is_repeat(sweep, r)]
    by_class = [(v, [r for r in rows if r.verdict == v]) for v in ("stable", "marginal")]
    by_class = [(v, rs) for v, rs in by_class if rs]
    metrics = [m for m in _METRICS if m != "peak_rss_gib" or memory_metric == m]
    metrics = [m for m in metrics if any(m in r.metrics for r in rows)]
    xs = [*(k for k in sweep.knobs if any(k in r.params for r in rows)), *(m for m in metrics if m != "tokens_per_s")]
    if not rows or not metrics or not xs:
        return None
    x0 = memory_metric if memory_metric in xs else xs[0]
    y0 = "tokens_per_s" if "tokens_per_s" in metrics else metrics[0]

    def column(key: str, rs: list[TrialRow]) -> list[Any]:
        if key in sweep.knobs:
            return [_x_value(r, key) for r in rs]
        return [r.metrics.get(key) for r in rs]

    fig = go.Figure()
    for verdict, rs in by_class:
        fig.add_trace(
            go.Scatter(
                x=column(x0, rs),
                y=column(y0, rs),
                mode="markers",
                name=verdict,
                marker={"color": CLASS_COLOURS[verdict], "size": 11, "line": {"width": 1, "color": "#333"}},
                text=[_hover(sweep, r) for r in rs],
                hovertemplate="%{text}<br>x: %{x}<br>y: %{y:.4g}<extra></extra>",
            )
        )

    def name(key: str) -> str:
        return _metric_name(sweep, key) if key in _METRICS else axis_name(key)

    x_menu = [
        {
            "label": name(k),
            "method": "update",
            "args": [
                {"x": [column(k, rs) for _, rs in by_class]},
                {"xaxis.title.text": name(k), "xaxis.type": "category" if _categorical(sweep, k) else "linear"},
            ],
        }
        for k in xs
    ]
    y_menu = [
        {
            "label": name(m),
            "method": "update",
            "args": [{"y": [column(m, rs) for _, rs in by_class]}, {"yaxis.title.text": name(m)}],
        }
        for m in metrics
    ]
    _layout(fig, "finished trials: pick the axes", name(x0), name(y0), categorical=_categorical(sweep, x0))
    fig.update_layout(
        updatemenus=[
            {"buttons": x_menu, "active": xs.index(x0), "x": 0.0, "y": 1.2, "xanchor": "left", "yanchor": "top"},
            {"buttons": y_menu, "active": metrics.index(y0), "x": 0.45, "y": 1.2, "xanchor": "left", "yanchor": "top"},
        ],
        annotations=[
            {"text": "x:", "x": -0.03, "y": 1.17, "xref": "paper", "yref": "paper", "showarrow": False},
            {"text": "y:", "x": 0.42, "y": 1.17, "xref": "paper", "yref": "paper", "showarrow": False},
        ],
        margin={"t": 110},
    )
    return fig


# ---- small pieces -------------------------------------------------------------------------------------------------


def chart(fig: Any) -> str:
    """A figure as an HTML fragment for the page (plotly.js itself is inlined once, by the page)."""
    if fig is None:
        return '<p class="note">Nothing to draw: no trial finished.</p>'
    import plotly.io as pio

    return (
        '<div class="chart">'
        + pio.to_html(fig, full_html=False, include_plotlyjs=False, config=_PLOT_CONFIG)
        + "</div>"
    )


def _layout(fig: Any, title: str, x_title: str, y_title: str, categorical: bool) -> None:
    fig.update_layout(
        title={"text": title, "font": {"size": 14}},
        xaxis={"title": {"text": x_title}, "type": "category" if categorical else "linear"},
        yaxis={"title": {"text": y_title}},
        height=460,
        template="plotly_white",
        legend={"orientation": "h", "y": -0.2},
        hovermode="closest",
    )


def _dimension(name: str, values: list[Any]) -> dict[str, Any]:
    """A parallel-coordinates axis: numbers as they are, anything else (booleans, names) as evenly spaced ticks."""
    distinct = sorted({sort_key(v): v for v in values}.values(), key=sort_key)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in distinct):
        return {"label": name, "values": values, "tickvals": distinct, "ticktext": [fmt(v) for v in distinct]}
    index = {sort_key(v): i for i, v in enumerate(distinct)}
    return {
        "label": name,
        "values": [index[sort_key(v)] for v in values],
        "tickvals": list(range(len(distinct))),
        "ticktext": [fmt(v) for v in distinct],
        "range": [0, max(1, len(distinct) - 1)],
    }


def measured(sweep: Sweep, row: TrialRow, metric: str) -> float | None:
    """A figure as the charts draw it: measured (a failure's zeros are not), or an OOM's need (held + asked)."""
    value = row.metrics.get(metric)
    if sweep.effective(row) != "failed":
        return value
    if metric.startswith("peak_vram") and row.failure_kind in MEMORY and sweep.budget:
        return oom_needed_gib(row.metrics, sweep.budget)
    return value or None


def _x_value(row: TrialRow, knob: str | None) -> Any:
    if knob is None:
        return row.number
    value = row.params.get(knob)
    return fmt(value) if isinstance(value, bool) or not isinstance(value, int | float) else value


def _categorical(sweep: Sweep, knob: str | None) -> bool:
    if knob is None or knob not in sweep.knobs:
        return False
    return not all(isinstance(v, int | float) and not isinstance(v, bool) for v in knob_values(sweep, knob))


def axis_name(knob: str | None) -> str:
    return f"{label(knob)} ({knob})" if knob else "trial"


def setting(sweep: Sweep, row: TrialRow) -> str:
    return " ".join([f"{label(k)}={fmt(row.params[k])}" for k in sweep.knobs if k in row.params] + row.lever)


def class_words(row: TrialRow) -> str:
    return f"{row.verdict} ({row.detail})" if row.detail else row.verdict


def _hover(sweep: Sweep, row: TrialRow) -> str:
    return html.escape(f"trial {row.number}: {setting(sweep, row)}") + "<br>" + html.escape(class_words(row))
