"""The report as one page to explore (report.html): the stability map, every trial with its peak memory against the
budget, and the knobs against speed and memory in charts you can hover, filter and re-axis (plotly, drawn by
src.report.charts).

The page is one self-contained file: plotly.js is inlined and nothing is fetched when it is opened, so it works
from `sweeps/<study>/` with no network and inside MLflow's artifact view, which shows an .html artifact in an
iframe sandboxed to `allow-scripts` (no storage, no same-origin access: the page needs neither). Everything the
study wrote (knob values, failure messages, advice) is redacted; plotly.js itself is left as shipped.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from src import redact
from src.knobs import label
from src.report.charts import (
    CLASS_COLOURS,
    axis_name,
    chart,
    class_words,
    knob_charts,
    measured,
    memory_figure,
    setting,
)
from src.report.plots import knob_values, map_cells
from src.report.text import fmt, promote_command, share, summary, trial_grid
from src.study import Sweep, TrialRow, sort_key

if TYPE_CHECKING:
    from src.report.importance import Importance

_MAP_ORDER = ("untested", "failed", "marginal", "stable")  # plots.map_cells' colour index


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
        _section("memory", "Peak memory against the budget", chart(memory_figure(sweep, axes[0], memory_metric))),
        _section("knobs", "Knobs against speed and memory", knob_charts(sweep, memory_metric)),
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
        f"Best stable: <b>trial {best.number}</b> ({html.escape(setting(sweep, best))}); promote it with "
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
    corner = f"{axis_name(y)} ↓ / {axis_name(x)} →" if y else f"{axis_name(x)} →"
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
            tip = "\n".join(f"trial {r.number}: {class_words(r)}" for r in trials) or "not run"
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


def _bar(sweep: Sweep, row: TrialRow, metric: str) -> str:
    """Peak memory against the budget as a bar (the budget is the box's right edge; an OOM fills it, striped)."""
    value = measured(sweep, row, metric)
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
