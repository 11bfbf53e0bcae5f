"""The report as one page to explore (report.html): the stability map, every trial with its peak memory against the
budget, and the knobs against speed and memory in charts you can hover, filter and re-axis (plotly).

The page is one self-contained file: plotly.js is inlined and nothing is fetched when it is opened, so it works
from `sweeps/<study>/` with no network and inside MLflow's artifact view, which shows an .html artifact in an
iframe sandboxed to `allow-scripts` (no storage, no same-origin access: the page needs neither). Everything the
study wrote (knob values, failure messages, advice) is redacted; plotly.js itself is left as shipped.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from src import redact
from src.failures import MEMORY, oom_needed_gib
from src.knobs import label
from src.report.plots import COLOURS, is_repeat, knob_values, map_cells
from src.report.text import fmt, promote_command, share, summary, trial_grid
from src.study import Sweep, TrialRow, sort_key

if TYPE_CHECKING:
    from src.report.importance import Importance

# A class's colour wherever the page shows it (the map's and the PNGs' for the first three).
CLASS_COLOURS = {
    "stable": COLOURS["stable"],
    "marginal": COLOURS["marginal"],
    "failed": COLOURS["failed"],
    "skipped": "#9e9e9e",
    "pruned": "#bdbdbd",
    "running": "#64b5f6",
}
_MAP_ORDER = ("untested", "failed", "marginal", "stable")  # plots.map_cells' colour index
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


def html_page(
    sweep: Sweep,
    imps: list[Importance],
    axes: tuple[str | None, str | None],
    memory_metric: str,
    advice: list[str],
) -> str:
    """report.html's text. `axes` and `memory_metric` are the PNG map's and memory picture's (src.report.write)."""
    from plotly.offline import get_plotlyjs

    sections = [
        _opening(sweep, advice),
        _section("map", "Stability map", _map(sweep, axes)),
        _section("memory", "Peak memory against the budget", _chart(_memory_figure(sweep, axes[0], memory_metric))),
        _section("knobs", "Knobs against speed and memory", _knob_charts(sweep, memory_metric)),
        _section("trials", "Trials", _trials(sweep, memory_metric)),
        _section("importance", "Which knobs matter", _importances(imps)),
    ]
    body = redact.redact_text("\n".join(sections))
    title = html.escape(redact.redact_text(f"Stability map: {sweep.name}"))
    # plotly.js goes in last and untouched (redaction is for what the study wrote; the library holds no secret).
    return (
        _HEAD.replace("{title}", title)
        + "<script>"
        + get_plotlyjs()
        + "</script>\n</head>\n<body>\n"
        + body
        + _SCRIPT
        + "\n</body>\n</html>\n"
    )


# ---- the parts ----------------------------------------------------------------------------------------------------


def _section(anchor: str, title: str, content: str) -> str:
    return f'<section id="{anchor}"><h2>{html.escape(title)}</h2>\n{content}\n</section>'


def _opening(sweep: Sweep, advice: list[str]) -> str:
    best = sweep.best()
    budget = f"Budget {sweep.budget:g} GiB, margin {sweep.margin:.0%}." if sweep.budget else ""
    best_line = (
        f"Best stable: <b>trial {best.number}</b> ({html.escape(_setting(sweep, best))}); promote it with "
        f"<code>{html.escape(promote_command(sweep, best))}</code>."
        if best
        else "No stable setting: nothing to promote."
    )
    items = "".join(f"<li>{html.escape(s)}</li>" for s in advice)
    return (
        f"<header><h1>Stability map: {html.escape(sweep.name)}</h1>"
        f'<p class="summary">{html.escape(summary(sweep))}. {budget}</p><p>{best_line}</p>'
        + (f"<h3>What to change</h3><ul>{items}</ul>" if items else "")
        + '<nav><a href="#map">map</a> · <a href="#memory">memory</a> · <a href="#knobs">knobs</a> · '
        '<a href="#trials">trials</a> · <a href="#importance">which knobs matter</a></nav></header>'
    )


def _map(sweep: Sweep, axes: tuple[str | None, str | None]) -> str:
    """The map as a table: one cell per pair of the two map knobs, coloured by the best outcome there (the PNG's
    cells, src.report.plots), every trial at that pair in the cell's tooltip."""
    x, y = axes
    xs, ys = knob_values(sweep, x), knob_values(sweep, y)
    grid, text = map_cells(sweep, x, y)
    corner = f"{_axis_name(y)} ↓ / {_axis_name(x)} →" if y else f"{_axis_name(x)} →"
    head = f'<th class="corner">{html.escape(corner)}</th>'
    head += "".join(f"<th>{html.escape(fmt(v))}</th>" for v in xs)
    rows = []
    for j, yv in enumerate(ys):
        cells = []
        for i, xv in enumerate(xs):
            outcome = _MAP_ORDER[grid[j][i]]
            trials = [
                r
                for r in sweep.plain_rows()
                if (x is None or sort_key(r.params.get(x)) == sort_key(xv))
                and (y is None or sort_key(r.params.get(y)) == sort_key(yv))
            ]
            tip = "\n".join(f"trial {r.number}: {_class_words(r)}" for r in trials) or "not run"
            lines = "<br>".join(html.escape(t) for t in text[j][i].split("\n"))
            cells.append(f'<td class="cell {outcome}" data-outcome="{outcome}" title="{html.escape(tip)}">{lines}</td>')
        rows.append(f"<tr><th>{html.escape(fmt(yv) if y else '')}</th>{''.join(cells)}</tr>")
    legend = "".join(f'<span class="swatch {o}"></span>{o} ' for o in ("stable", "marginal", "failed", "untested"))
    note = (
        "A cell's colour is the best outcome among the trials at that pair (other knobs may differ); its text lists "
        "every outcome, failures by kind. A repeated setting counts once; one skipped as a certain OOM shows as an "
        "inferred OOM. Hover a cell for its trials."
    )
    return (
        f'<table class="map" id="stability-map"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
        f'<p class="legend">{legend}</p><p class="note">{note}</p>'
    )


def _metric_name(sweep: Sweep, metric: str) -> str:
    """A metric's name on the page; peak "VRAM" in the words of what it was on this study's machine."""
    if metric == "peak_vram_reserved_gib":
        return sweep.memory_words()[0]
    return _METRICS.get(metric, metric)


def _memory_figure(sweep: Sweep, x: str | None, metric: str) -> Any:
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
    _layout(fig, title, _axis_name(x), axis, categorical=_categorical(sweep, x))
    if gpu:
        fig.update_yaxes(rangemode="tozero")
    return fig


def _knob_charts(sweep: Sweep, memory_metric: str) -> str:
    return (
        _chart(_parallel_figure(sweep, memory_metric))
        + '<p class="note">Each line is a trial: its knobs, its outcome, its peak memory and its speed. Drag along '
        "an axis to keep only the lines crossing there (click the axis outside the band to clear); drag an axis "
        "title to reorder. A figure a trial did not measure sits at 0 on its axis: a failed trial has no speed, and "
        "only an OOM has a peak (what it held plus what it asked for).</p>"
        + _chart(_scatter_figure(sweep, memory_metric))
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
        values = [_measured(sweep, r, metric) for r in rows]
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
        return _metric_name(sweep, key) if key in _METRICS else _axis_name(key)

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


def _trials(sweep: Sweep, memory_metric: str) -> str:
    """Every trial, as the terminal and report.md show it (src.report.text's columns), coloured by class, with its
    peak memory drawn against the budget; a class filter and sortable columns."""
    headers, cells = trial_grid(sweep)
    head = "".join(f'<th data-col="{i}">{html.escape(h)}</th>' for i, h in enumerate(headers))
    head += "<th>peak memory / budget</th><th>MLflow run</th>"
    body = []
    for row, line in zip(sweep.rows, cells, strict=True):
        tds = "".join(f"<td>{html.escape(c)}</td>" for c in line)
        why = f' title="{html.escape(row.failure_message)}"' if row.failure_message else ""  # hover: the message
        body.append(
            f'<tr class="{row.verdict}" data-class="{row.verdict}"{why}>{tds}<td>{_bar(sweep, row, memory_metric)}</td>'
            f"<td><code>{html.escape(row.run_id or '')}</code></td></tr>"
        )
    present = [c for c in CLASS_COLOURS if any(r.verdict == c for r in sweep.rows)]
    boxes = "".join(
        f'<label><input type="checkbox" class="class-filter" value="{c}" checked> '
        f'<span class="swatch {c}"></span>{c}</label> '
        for c in present
    )
    return (
        f'<p class="filters">show: {boxes}</p>'
        f'<table class="trials" id="trials-table"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
        '<p class="note">Click a header to sort; hover a failed trial for its message. A skipped trial was not launched: the trial named in its detail '
        "tells its outcome (the map shows it as inferred). Find a trial's run in MLflow by its name "
        "(`trial 3 ...`) or the filter <code>tags.`optuna.trial` = '3'</code>.</p>"
    )


def _importances(imps: list[Importance]) -> str:
    out = []
    for imp in imps:
        if imp.values:
            items = "".join(
                f'<li>{html.escape(label(k))} <span class="bar" style="width:{max(2, 200 * v):.0f}px"></span> {v:.2f}</li>'
                for k, v in imp.values.items()
            )
            out.append(
                f"<h3>{html.escape(imp.target)} ({imp.n_trials} finished trials, {imp.method})</h3><ul>{items}</ul>"
            )
        else:
            out.append(f"<h3>{html.escape(imp.target)}</h3><p>{html.escape(imp.note)}.</p>")
    return "".join(out) + (
        "<p class=\"note\">Optuna's parameter importances over the finished trials: the share of the metric's "
        "variance each knob explains (report.md says how they were computed).</p>"
    )


# ---- small pieces -------------------------------------------------------------------------------------------------


def _chart(fig: Any) -> str:
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


def _measured(sweep: Sweep, row: TrialRow, metric: str) -> float | None:
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


def _axis_name(knob: str | None) -> str:
    return f"{label(knob)} ({knob})" if knob else "trial"


def _setting(sweep: Sweep, row: TrialRow) -> str:
    return " ".join([f"{label(k)}={fmt(row.params[k])}" for k in sweep.knobs if k in row.params] + row.lever)


def _class_words(row: TrialRow) -> str:
    return f"{row.verdict} ({row.detail})" if row.detail else row.verdict


def _hover(sweep: Sweep, row: TrialRow) -> str:
    return html.escape(f"trial {row.number}: {_setting(sweep, row)}") + "<br>" + html.escape(_class_words(row))


def _bar(sweep: Sweep, row: TrialRow, metric: str) -> str:
    """Peak memory against the budget as a bar (the budget is the box's right edge; an OOM fills it, striped)."""
    value = _measured(sweep, row, metric)
    if not value:
        return ""
    budget = sweep.budget if metric.startswith("peak_vram") and sweep.budget else None
    if budget is None:
        return f"{value:.2f} GiB"
    over = row.verdict == "failed"
    width = min(100.0, 100.0 * value / budget)
    words = f"{value:.2f} / {budget:g} GiB" + (" (needed, OOM)" if over else f" ({share(1 - value / budget)} free)")
    return (
        f'<span class="mem" title="{html.escape(words)}"><span class="fill {row.verdict}{" over" if over else ""}" '
        f'style="width:{width:.1f}%"></span></span> {html.escape(words)}'
    )


_HEAD = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.2em 2em; color: #222; }
h1 { font-size: 1.5em; margin: 0 0 .3em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1em; margin: 1em 0 .3em; }
nav a { color: #1565c0; } code { background: #f3f3f3; padding: 0 .25em; border-radius: 3px; }
.summary { font-size: 1.05em; } .note { color: #555; max-width: 70em; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
td, th { border: 1px solid #ddd; padding: 3px 7px; text-align: right; vertical-align: middle; }
table.map td.cell { text-align: center; min-width: 7em; height: 3.2em; font-size: 12px; }
table.map th.corner { font-weight: normal; color: #555; }
.stable.cell, .swatch.stable { background: #2e7d32; color: #fff; }
.marginal.cell, .swatch.marginal { background: #f9a825; }
.failed.cell, .swatch.failed { background: #c62828; color: #fff; }
.untested.cell, .swatch.untested { background: #e0e0e0; color: #555; }
.swatch.skipped { background: #9e9e9e; } .swatch.pruned { background: #bdbdbd; } .swatch.running { background: #64b5f6; }
.swatch { display: inline-block; width: .9em; height: .9em; margin: 0 .25em 0 .6em; vertical-align: -1px; }
table.trials tr.stable td:nth-child(1) { border-left: 5px solid #2e7d32; }
table.trials tr.marginal { background: #fff8e1; } table.trials tr.failed { background: #ffebee; }
table.trials tr.skipped, table.trials tr.pruned { color: #777; }
table.trials th { cursor: pointer; background: #fafafa; position: sticky; top: 0; }
.mem { display: inline-block; width: 90px; height: .8em; border: 1px solid #999; vertical-align: -1px; }
.mem .fill { display: block; height: 100%; }
.fill.stable { background: #2e7d32; } .fill.marginal { background: #f9a825; }
.fill.failed, .fill.over { background: repeating-linear-gradient(45deg, #c62828 0 4px, #ef9a9a 4px 8px); }
.bar { display: inline-block; height: .7em; background: #1565c0; }
.chart { max-width: 1100px; }
</style>
"""

# Sorting and the class filter of the trials table: plain DOM, nothing stored (the sandboxed iframe has no storage).
_SCRIPT = """
<script>
(function () {
  var table = document.getElementById("trials-table");
  if (!table) return;
  document.querySelectorAll(".class-filter").forEach(function (box) {
    box.addEventListener("change", function () {
      var shown = {};
      document.querySelectorAll(".class-filter").forEach(function (b) { shown[b.value] = b.checked; });
      table.querySelectorAll("tbody tr").forEach(function (tr) {
        tr.style.display = shown[tr.dataset.class] === false ? "none" : "";
      });
    });
  });
  table.querySelectorAll("th[data-col]").forEach(function (th) {
    th.addEventListener("click", function () {
      var col = +th.dataset.col, asc = th.dataset.asc !== "1";
      th.dataset.asc = asc ? "1" : "0";
      var rows = Array.prototype.slice.call(table.tBodies[0].rows);
      var key = function (tr) {
        var t = tr.cells[col].textContent.replace(/[,%]/g, ""), n = parseFloat(t);
        return isNaN(n) ? t : n;
      };
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (typeof x !== typeof y) return (typeof x === "number" ? -1 : 1);
        return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
      });
      rows.forEach(function (tr) { table.tBodies[0].appendChild(tr); });
    });
  });
})();
</script>
"""
