"""The report in words: the terminal table, the one-line summary, and report.md (redacted)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from src import redact
from src.knobs import figure, fmt, label
from src.readings import timed_how
from src.study import Sweep, TrialRow

if TYPE_CHECKING:
    from src.report.importance import Importance

# Metrics a trial reads slower when other trials share its card (memory figures are each process's own).
SPEED_METRICS = ("tokens_per_s", "samples_per_s", "step_time_s", "model_tflops_per_s")

_FIGURES = (
    ("peak_vram_allocated_gib", "alloc GiB", "{:.2f}"),
    ("peak_vram_reserved_gib", "reserved GiB", "{:.2f}"),
    ("peak_vram_device_gib", "device GiB", "{:.2f}"),
    ("vram_headroom_frac", "headroom", "{:.0%}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("step_time_s", "step s", "{:.3f}"),
)
# Shown only where some trial recorded them (studies from before the engine measured them have none).
_OPTIONAL = (
    ("tokens_per_optimizer_step", "tokens/opt step", "{:,.0f}"),
    # (4 x frozen + 6 x trainable weights) a token + causal attention over the card's spec dense bf16 peak: GPU only
    ("mfu_standard", "MFU", "{:.1%}"),
)


def share(frac: float) -> str:
    """A share as the report words it: "4%", "0.4%", "12.5%"; never "0%" for a share that is not 0."""
    if 0 < frac < 0.0005:
        return "<0.1%"
    return f"{frac:.1%}".replace(".0%", "%")


def promote_command(sweep: Sweep, row: TrialRow) -> str:
    """The command that promotes `row` as the study stands: `src.promote` takes the best soaked stable trial, and
    one never soaked (a study run with hydra.sweeper.soak_top_k=0, as the demo is) only when asked by number or
    with --allow-unsoaked (src/promote/choosing.py)."""
    command = f"python -m src.promote {sweep.name}"
    passed = [r.number for r in sweep.ranked() if sweep.soaks.get(r.number, {}).get("status") == "passed"]
    if row.number in passed:
        return command if passed[0] == row.number else f"{command} --trial {row.number}"
    if not passed and sweep.ranked() and sweep.ranked()[0].number == row.number:
        return f"{command} --allow-unsoaked"
    return f"{command} --trial {row.number} --allow-unsoaked"


def _columns(sweep: Sweep) -> list[tuple[str, Callable[[TrialRow], str]]]:
    """The table's columns (header, cell) for this sweep: a lever's change and the share of answers cut only
    where some trial has them."""
    cols: list[tuple[str, Callable[[TrialRow], str]]] = [("#", lambda r: str(r.number))]
    cols += [(label(k), lambda r, k=k: fmt(r.params.get(k))) for k in sweep.knobs]
    if any(r.lever for r in sweep.rows):
        cols.append(("change", TrialRow.change))
    cols += [("class", lambda r: r.verdict), ("detail", lambda r: r.detail)]
    # A figure no trial has (a CPU keeps no allocated/reserved split and sees no device) is no column.
    figures = [f for f in _FIGURES + _OPTIONAL if any(_figure(r, f[0], f[2]) for r in sweep.rows)]
    cols += [(head, lambda r, m=m, form=form: _figure(r, m, form)) for m, head, form in figures]
    if any(sweep.cut_answers(r) is not None for r in sweep.rows):
        cols.append(("cut answers", lambda r: _cut_cell(sweep, r)))
    return cols


def _figure(row: TrialRow, metric: str, form: str) -> str:
    if metric not in row.metrics:
        return ""
    if row.verdict in ("failed", "skipped") and row.metrics.get("peak_vram_reserved_gib", 0) == 0:
        return ""  # a failed trial's zeros are "not measured", not "used nothing"
    if row.verdict == "failed" and metric == "vram_headroom_frac":
        return ""  # an OOM's peak is where it stopped, not a setting's headroom ("-49%")
    return form.format(row.metrics[metric])


def _cut_cell(sweep: Sweep, row: TrialRow) -> str:
    """The share of answers cut (known before any GPU work, so shown for failed trials too); "> policy" marks a
    setting that is never promoted."""
    cut = sweep.cut_answers(row)
    if cut is None:
        return ""
    return share(cut) + (f" > {share(sweep.max_truncated_answer_frac or 0.0)}" if sweep.cuts_too_much(row) else "")


def trial_grid(sweep: Sweep) -> tuple[list[str], list[list[str]]]:
    """The table's headers and one row of cells per trial."""
    cols = _columns(sweep)
    return [head for head, _ in cols], [[cell(r) for _, cell in cols] for r in sweep.rows]


def table(sweep: Sweep) -> Any:
    """The trials as a rich Table, coloured by class."""
    from rich.table import Table

    styles = {"stable": "green", "marginal": "yellow", "failed": "red", "skipped": "dim", "pruned": "dim"}
    t = Table(
        title=f"{sweep.name}: {summary(sweep)}",
        title_justify="left",
        caption=sweep.shared_card_caption(),
        caption_justify="left",
    )
    headers, cells = trial_grid(sweep)
    for h, column in zip(headers, zip(*cells, strict=True) if cells else [()] * len(headers), strict=True):
        if h == "class":  # never the column cut on a narrow terminal: the others wrap or shorten first
            t.add_column(h, justify="left", no_wrap=True, min_width=max(len(c) for c in (*styles, h)))
        elif h in ("change", "detail"):
            t.add_column(h, justify="left")
        else:  # a figure: never cut to "res…"; its header wraps at a space instead
            widest = max([*(len(w) for w in h.split()), *(len(c) for c in column)])
            t.add_column(h, justify="right", min_width=widest)
    for row, line in zip(sweep.rows, cells, strict=True):
        t.add_row(*line, style=styles.get(row.verdict))
    return t


def summary(sweep: Sweep) -> str:
    """The counts in one line: 12 trials, 5 stable, 2 marginal, 5 failed (4 oom, 1 timeout)."""
    c = sweep.counts()
    kinds = Counter(r.failure_kind or "other" for r in sweep.rows if r.verdict == "failed")
    failed = f"{c['failed']} failed" + (f" ({', '.join(f'{n} {k}' for k, n in kinds.most_common())})" if kinds else "")
    parts = [f"{len(sweep.rows)} trials", f"{c['stable']} stable", f"{c['marginal']} marginal", failed]
    parts += [f"{c[k]} {k}" for k in ("skipped", "pruned", "running") if c[k]]
    return ", ".join(parts)


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


# ---- report.md, section by section --------------------------------------------------------------------------------


def markdown(
    sweep: Sweep,
    imps: list[Importance],
    axes: tuple[str | None, str | None],
    memory_metric: str,
    advice: list[str] | None = None,
) -> str:
    """report.md, with every credential redacted (it names the storage, quotes failure messages, and is
    uploaded to MLflow as an artifact). `advice`: the "What to change" sentences (src.report.advice)."""
    out = [
        *_opening(sweep),
        *(["## What to change", "", *(f"- {line}" for line in advice), ""] if advice else []),
        *differently(sweep),
        *_pictures(sweep, axes, memory_metric),
        *_importances(imps),
        *_trials(sweep),
        *_classes(sweep),
    ]
    return redact.redact_text("\n".join(out))


def differently(sweep: Sweep) -> list[str]:
    """ "Faster, but trains differently": the stable settings that put other rows into an optimizer step than the
    recipe (another optimisation, not the same model faster), apart, with what the change of step would ask."""
    recipe = sweep.recipe_row()
    rows = sweep.trains_differently()
    if recipe is None or not rows:
        return []
    theirs = sweep.rows_per_step(recipe)
    speed = recipe.metrics.get("tokens_per_s") if recipe.verdict in ("stable", "marginal") else None
    opted = sweep.different_optimisation
    out = [
        "## Faster, but trains differently",
        "",
        f"These settings put other rows into each optimizer step than your recipe ({theirs} per device): another "
        "optimisation, not your model trained faster. With k times the rows per step an epoch takes k times fewer "
        "optimizer steps, and the learning rate and schedule need retuning (common starting points: the learning "
        "rate times √k, square-root scaling, to times k, linear scaling; the warm-up in steps divided by k). "
        + (
            "This sweep ranks and promotes them like the others (hydra.sweeper.promote_different_optimisation=true)."
            if opted
            else "They are not promoted; `hydra.sweeper.promote_different_optimisation=true` on the sweep's command "
            "ranks, soaks and promotes them too."
        ),
        "",
    ]
    table = []
    for row in rows[:10]:
        mine = sweep.rows_per_step(row)
        k = mine / theirs if mine and theirs else None
        table.append(
            [
                str(row.number),
                ", ".join(f"{label(key)} {fmt(value)}" for key, value in row.setting().items() if key in sweep.knobs)
                + (f" + {row.change()}" if row.lever else ""),
                _figure(row, "tokens_per_s", "{:,.0f}"),
                f"{row.metrics['tokens_per_s'] / speed:.2f}×" if speed and row.metrics.get("tokens_per_s") else "",
                "packed" if mine is None else str(mine),
                _figure(row, "tokens_per_optimizer_step", "{:,.0f}"),
                "" if k is None else (f"{k:.3g}× fewer" if k >= 1 else f"{1 / k:.3g}× more"),
            ]
        )
    headers = ["trial", "setting", "tokens/s", "vs recipe", "rows / step", "tokens / step", "optimizer steps"]
    return [*out, _md_table(headers, table), ""]


def _opening(sweep: Sweep) -> list[str]:
    """The title, the counts, and the best stable setting with the command that promotes it."""
    objective, direction = sweep.objectives[0], sweep.directions[0]
    best = sweep.best()
    shared = sweep.card_shared_by()
    out = [
        f"# Stability map: {sweep.name}",
        "",
        f"{summary(sweep)}. Budget {sweep.budget:g} GiB, margin {sweep.margin:.0%}."
        if sweep.budget
        else f"{summary(sweep)}. Margin {sweep.margin:.0%}.",
        "",
    ]
    if not best:
        cutting = any(r.verdict == "stable" and sweep.cuts_too_much(r) for r in sweep.rows)
        policy = f" within preflight.max_truncated_answer_frac={sweep.max_truncated_answer_frac:g}" if cutting else ""
        return [*out, f"No stable setting{policy}: nothing to promote.", ""]
    m = best.metrics
    setting = [f"{k}={fmt(best.params[k])}" for k in sweep.knobs if k in best.params] + best.lever
    promote = promote_command(sweep, best)
    how = timed_how(sweep, best)
    return [
        *out,
        f"Best stable setting by the study's objective ({objective}, {direction}): **trial {best.number}** "
        f"({', '.join(setting)}): "
        f"{figure(sweep.score(best)) if objective in m else 'nan'} {objective}{how}, "
        f"peak reserved {m.get('peak_vram_reserved_gib', 0):.2f} GiB, "
        f"headroom {m.get('vram_headroom_frac', float('nan')):.0%}"
        + (
            f" ({objective} read on a card shared by up to {shared} trials: see Throughput)"
            if shared > 1 and objective in SPEED_METRICS and not how
            else ""
        )
        + f". Promote it: `{promote}`"
        + (" (never soaked: its evidence is its short probe)." if "--allow-unsoaked" in promote else "."),
        "",
    ]


def _pictures(sweep: Sweep, axes: tuple[str | None, str | None], memory_metric: str) -> list[str]:
    """Map, Memory and Throughput: each picture with how to read it."""
    shared = sweep.card_shared_by()
    shared_note = (
        f"Throughput here was read with up to {shared} trials sharing each card (`hydra.sweeper.slots_per_gpu`): "
        "each ran slower than it would alone, by an amount that depends on what ran beside it, so these figures "
        "rank settings roughly and are not speeds to quote. Run the settings you care about alone "
        "(`python -m src.train` with the setting's overrides) before comparing them or quoting one."
        if shared > 1
        else ""
    )
    x, y = axes
    return [
        "## Map",
        "",
        "![stability map](stability_map.png)",
        "",
        f"Each cell is a pair of {x or 'settings'}{' × ' + y if y else ''}; other knobs may differ within a cell. Its "
        "colour is the best outcome among the trials there, its text lists every outcome (failures by kind). "
        "A repeated setting counts once; a setting skipped as a certain OOM shows as an inferred OOM.",
        "",
        "## Memory",
        "",
        "![peak memory](peak_vram.png)",
        "",
        "Peak reserved VRAM (what the allocator held, the figure headroom is measured on) per finished trial; "
        "filled: stable, hollow: marginal; the line joins the highest peak at each value. Dashed: the budget; "
        "dotted: the margin below it; crosses: OOMs, drawn at what they held plus what they asked for (capped)."
        if memory_metric.startswith("peak_vram")
        else "This study ran without a GPU (peak VRAM 0), so the picture shows peak host RSS instead.",
        "",
        "## Throughput",
        "",
        "![tokens per second](tokens_per_s.png)",
        "",
        *([shared_note, ""] if shared_note else []),
    ]


def _importances(imps: list[Importance]) -> list[str]:
    """Which knobs matter, per metric, and how that was computed."""
    out = ["## Which knobs matter", ""]
    for imp in imps:
        out.append(f"**{imp.target}** ({imp.n_trials} finished trials)")
        out.append("")
        if imp.values:
            out.append(_md_table(["knob", "importance"], [[k, f"{v:.2f}"] for k, v in imp.values.items()]))
            out += ["", f"Method: {imp.method}." + (f" Note: {imp.note}." if imp.note else "")]
        else:
            out.append(f"{imp.note[0].upper()}{imp.note[1:]}.")
        out.append("")
    return [
        *out,
        "How these were computed: Optuna's parameter importances (`optuna.importance.get_param_importances`) over "
        "the trials that finished (stable and marginal; failed and skipped trials have no full measurement), "
        "with each knob the sweep varied as a parameter and the metric as the value. fANOVA fits a random forest "
        "and attributes the variance of the metric to each knob (shares sum to 1); PED-ANOVA is used when fANOVA "
        "cannot fit. Knobs that never changed among those trials are left out.",
        "",
    ]


def _trials(sweep: Sweep) -> list[str]:
    """Every trial in a table, then the failures grouped by kind with their commonest messages."""
    out = ["## Trials", "", _md_table(*trial_grid(sweep)), ""]
    if any(r.lever for r in sweep.rows):
        out += [
            "change: a lever trial, the recipe's knobs with this override on top (measured because the recipe was "
            "not stable); it stays off the map and the importances, which group trials by their knobs.",
            "",
        ]
    if any(sweep.cut_answers(r) is not None for r in sweep.rows):
        policy = sweep.max_truncated_answer_frac
        out += [
            "cut answers: the share of answers this data.max_seq_length cuts (`truncated_answer_frac`, known before "
            "any GPU work); the sweep measured such settings instead of refusing them"
            + (
                f". Above preflight.max_truncated_answer_frac={policy:g} (marked `> {share(policy)}`) a setting keeps "
                "its class but is never the best or promoted, and a single run refuses it."
                if policy is not None
                else "."
            ),
            "",
        ]
    failures: dict[str, list[TrialRow]] = {}
    for r in sweep.rows:
        if r.verdict == "failed":
            failures.setdefault(r.failure_kind or "other", []).append(r)
    if failures:
        out += ["## Failures", ""]
        for kind, rows in sorted(failures.items(), key=lambda kv: -len(kv[1])):
            messages = Counter(r.failure_message or "" for r in rows)
            out.append(f"- **{kind}** ({len(rows)}: trials {', '.join(str(r.number) for r in rows)})")
            out += [f"  - `{m[:200]}`" + (f" ×{n}" if n > 1 else "") for m, n in messages.most_common(3) if m]
        out.append("")
    return out


def _classes(sweep: Sweep) -> list[str]:
    return [
        "## Classes",
        "",
        f"- **stable**: finished, peak reserved VRAM leaves at least {sweep.margin:.0%} of the budget free, and the "
        "allocator never had to retry (`alloc_retries` 0).",
        "- **marginal**: finished, but under the margin or with allocator retries: a longer batch or a fragmented "
        "cache away from an OOM.",
        "- **failed**: by `failure.kind` (oom, data_error and config_error are the setting's own; the others are "
        "the process's: segfault, timeout, host_oom (the machine's RAM, not the card's), ...).",
        "- **skipped**: not launched; the trial it follows from tells its outcome.",
        "",
        f"Storage: `{sweep.storage}`. Trial logs: `{sweep.study_dir / 'trials'}`.",
        "",
    ]
