"""The stability map of a study: which settings are safe on the card, which are marginal, and why the rest fail.

    python -m src.report [study] [--margin 0.1]     # default: the study whose optuna.db changed last

Every trial is classified (src.study) from what the sweep engine recorded in the Optuna storage (the same
figures MLflow holds): **stable** (finished, headroom against the VRAM budget at least the margin, the allocator
never had to retry), **marginal** (finished, but under the margin or with allocator retries: one longer batch
or a fragmented cache away from an OOM), **failed** (by kind), **skipped** (not launched: a repeat of a
measured setting, or certain to OOM). "What to change" (src.report.advice) answers the user's question in
sentences from those measurements: the user's recipe, the smallest changes that make it stable, the fastest
stable setting. The table and the sentences go to the terminal; `sweeps/<study>/report.md` and its
pictures go beside the study and onto the sweep's parent MLflow run (artifacts under `report/`), and each
trial's run gets a `report.class` tag so the MLflow UI can filter by it. `src.promote` uses the same classes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from src.knobs import label
from src.places import StudyNotFound, places
from src.redact import redact_text
from src.report.advice import what_to_change
from src.report.importance import Importance, importance
from src.report.memory import plot_predicted, plot_soak, section
from src.report.page import html_page
from src.report.plots import COLOURS, map_axes, plot_map, plot_memory, plot_throughput, put
from src.report.publish import log_to_mlflow
from src.report.text import fmt, markdown, summary, table
from src.study import DEFAULT_MARGIN, Sweep, TrialRow, load

__all__ = [
    "COLOURS",
    "DEFAULT_MARGIN",
    "Importance",
    "Report",
    "StudyNotFound",
    "Sweep",
    "TrialRow",
    "fmt",
    "importance",
    "label",
    "load",
    "log_to_mlflow",
    "main",
    "markdown",
    "places",
    "summary",
    "table",
    "what_to_change",
    "write",
]


@dataclass
class Report:
    sweep: Sweep
    files: list[Path]
    importances: list[Importance]
    logged_to: str | None
    advice: list[str]  # the "What to change" sentences
    mlflow_view: str | None = None  # where MLflow's UI shows the trials by knobs and metrics (set when logged)


NAMES = ("report.md", "stability_map.png", "peak_vram.png", "tokens_per_s.png", "report.html")
EXTRA = ("predicted_vs_measured.png", "soak_memory.png")  # drawn where the study has what they show


def write(sweep: Sweep) -> Report:
    """report.md and its pictures in the study's folder, each written whole (src.report.plots `put`): a link in
    place of one is replaced, never written through, and the terminal is told."""
    import matplotlib

    matplotlib.use("Agg")
    sweep.study_dir.mkdir(parents=True, exist_ok=True)
    _say_links(sweep.study_dir)
    imps = [importance(sweep, "peak_vram_reserved_gib", "minimize"), importance(sweep, "tokens_per_s", "maximize")]
    axes = map_axes(sweep, imps[0].values or imps[1].values)
    files = [sweep.study_dir / n for n in NAMES]
    plot_map(sweep, *axes, files[1])
    metric = plot_memory(sweep, *axes, files[2])
    plot_throughput(sweep, files[3])
    advice = what_to_change(sweep)
    page = html_page(sweep, imps, axes, metric, advice)  # the same, to explore (src.report.page)
    put(files[4], lambda f: f.write(page.encode()))
    # the memory model's predictions against what was measured, and the soak (src.report.memory)
    extra = {EXTRA[0]: plot_predicted, EXTRA[1]: plot_soak}
    drawn = {name: draw(sweep, sweep.study_dir / name) for name, draw in extra.items()}
    files += [sweep.study_dir / name for name, done in drawn.items() if done]
    text = markdown(sweep, imps, axes, metric, advice)
    if lines := section(sweep, drawn[EXTRA[0]], drawn[EXTRA[1]]):
        text += "\n" + redact_text("\n".join(lines))
    put(files[0], lambda f: f.write(text.encode()))
    return Report(sweep, files, imps, None, advice)


def _say_links(folder: Path) -> None:
    """One line for the links found in place of the report's files (a shared sweeps/ folder, a planted link to a
    file outside the project): the report replaces them with its own files and never writes where they point."""
    links = [folder / n for n in (*NAMES, *EXTRA) if (folder / n).is_symlink()]
    if links:
        shown = ", ".join(f"{p.name} -> {os.readlink(p)}" for p in links)
        print(
            redact_text(
                f"warning: {folder}: {shown}: symbolic links where the report writes its files, replaced by the "
                "report's own; the files they pointed at are untouched"
            ),
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> int:
    """`python -m src.report` (src/report/__main__.py). Imported when called: `python -m` runs __main__.py
    itself, and warns when the package has imported it already."""
    from src.report.__main__ import main as run

    return run(argv)
