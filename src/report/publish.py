"""The report on MLflow: its files and counts on the sweep's parent run, each trial's class on the trial's run.

The parent run gets the report's files (artifacts `report/`, report.html among them: MLflow's artifact view shows
it), its counts as `report.*` tags and a description that says where they are; it never gets `report.class`, so a
filter on the class finds trials only. Each trial's run gets its class, is named by its knobs and outcome
(`trial 3 oom: seq=2048 r=16`, `skipped (repeat of 3): ...`, src.sweep.runs) and says what it is (`run.kind`); a
skipped run, which launched nothing, gets the params it would have run with, so it compares like the others. The
experiment gets its saved view and description again (an older sweep's too).
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from src import record, redact, tracking
from src.report.text import summary
from src.study import Sweep, TrialRow
from src.sweep import runs

if TYPE_CHECKING:
    from src.report import Report

# What tracking.set_tags keeps of a tag's value (MLflow's SQL stores refuse longer ones).
_TAG_LIMIT = 5000


def log_to_mlflow(report: Report, tracking_uri: str) -> str | None:
    """The report onto the sweep's parent run (artifacts `report/`, counts as tags); each trial's run gets
    its class as the tag `report.class`. Returns the parent run id, or None (with a warning) when unreachable."""
    from mlflow.tracking import MlflowClient

    sweep = report.sweep
    if not sweep.parent_run_id:
        print(f"warning: study {sweep.name} names no MLflow parent run; report not logged", file=sys.stderr)
        return None
    tracking.setup(tracking_uri)
    client = MlflowClient(tracking_uri)
    try:
        client.get_run(sweep.parent_run_id)
    except Exception as exc:  # noqa: BLE001 - the files on disk are the report; MLflow is a copy
        where = redact.redact_text(f"{tracking_uri} ({exc})")
        print(f"warning: parent run {sweep.parent_run_id} not found in {where}", file=sys.stderr)
        return None
    for path in report.files:
        client.log_artifact(sweep.parent_run_id, str(path), "report")
    counts = sweep.counts()
    best = sweep.best()
    tags: dict[str, Any] = {f"report.{k}": counts[k] for k in ("stable", "marginal", "failed", "skipped")}
    tags["report.margin"] = sweep.margin
    tags["report.best_trial"] = best.number if best else "none"
    tags["report.what_to_change"] = _whole_sentences(report.advice)
    for imp in report.importances:
        if imp.values:
            tags[f"report.importance.{imp.target}"] = json.dumps({k: round(v, 3) for k, v in imp.values.items()})
    tags[runs.KIND] = "sweep"
    tags["mlflow.runName"] = runs.sweep_name(sweep.name, summary(sweep))  # the row MLflow shows first, folded
    tags[tracking.NOTE] = runs.parent_note(sweep.name) + "\n\n" + _parent_summary(report)
    tracking.set_tags(client, sweep.parent_run_id, tags)
    base = _base_params(client, sweep)  # for the skipped runs, which launched nothing
    for row in sweep.rows:
        if row.run_id and row.run_id != sweep.parent_run_id:
            tracking.set_tags(client, row.run_id, _trial_tags(row, sweep.recipe_row()))
            if row.verdict == "skipped" and base and not client.get_run(row.run_id).data.params:
                tracking.log_params(client, row.run_id, _would_have_run(sweep, base, row))
    experiment = client.get_run(sweep.parent_run_id).info.experiment_id
    objectives = dict(zip(sweep.objectives, sweep.directions, strict=False))
    key = runs.describe_experiment(client, experiment, sweep.name, sweep.knobs, objectives)
    if key:
        report.mlflow_view = runs.view_address(tracking_uri, experiment, key)
    return sweep.parent_run_id


def _trial_tags(row: TrialRow, recipe: TrialRow | None) -> dict[str, Any]:
    """A trial's class, and its name and kind as the report knows them (outcome: the class, or a failure's kind)."""
    tags: dict[str, Any] = {record.REPORT_CLASS: row.verdict, record.REPORT_DETAIL: row.detail}
    if row.verdict == "skipped":
        return {**tags, **runs.skipped_tags(row.number, row.params, _skip_reason(row.detail), row.because_of)}
    outcome = (row.failure_kind or "failed") if row.verdict == "failed" else row.verdict
    of_recipe = recipe.params if recipe is not None and row.lever and row.number != recipe.number else None
    name = runs.trial_name(row.number, row.params, row.lever, outcome, recipe=of_recipe)
    return {**tags, "mlflow.runName": name, runs.KIND: "trial"}


def _skip_reason(detail: str) -> str | None:
    """The contract's `skip.reason` from the engine's words ("same setting as trial 2", "certain oom: ...")."""
    for why in ("certain_oom", "predicted_oom"):
        if detail.startswith(why.replace("_", " ")):
            return why
    return "repeat" if "same setting" in detail or "repeat" in detail else None


def _base_params(client: Any, sweep: Sweep) -> tuple[int, dict[str, str]] | None:
    """A launched trial of this sweep (not a lever's: its overrides are not the sweep's) and the params it logged
    (its composed config)."""
    for row in sweep.rows:
        if row.run_id and row.verdict != "skipped" and not row.lever:
            params = client.get_run(row.run_id).data.params
            if params:
                return row.number, dict(params)
    return None


def _would_have_run(sweep: Sweep, base: tuple[int, dict[str, str]], row: TrialRow) -> dict[str, str]:
    """The config a skipped trial would have run with, as params: a launched trial's, with the skipped trial's own
    knobs (and a lever's overrides) and its own folder. Values written as tracking.params writes them."""
    import yaml

    number, params = base
    values: dict[str, Any] = dict(row.params)
    for override in row.lever:
        key, _, value = override.partition("=")
        values[key.lstrip("+~")] = yaml.safe_load(value)
    theirs, mine = f"{sweep.trial_dir(number)}{os.sep}", f"{sweep.trial_dir(row.number)}{os.sep}"
    out = {k: v.replace(theirs, mine) for k, v in params.items()}
    return {**out, **{k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in values.items()}}


def _parent_summary(report: Report) -> str:
    sweep = report.sweep
    best = sweep.best()
    lines = [f"**Report**: {summary(sweep)}."]
    lines.append(f"Best stable: trial {best.number}." if best else "No stable setting.")
    lines += [f"- {redact.redact_text(s)}" for s in report.advice[:3]]
    return "\n".join(lines)


def _whole_sentences(sentences: list[str]) -> str:
    """The advice one sentence a line, cut after the last whole sentence that fits the tag (report.md has all)."""
    text = "\n".join(redact.redact_text(s) for s in sentences)
    if len(text) <= _TAG_LIMIT:
        return text
    more = "\n(more in report.md: What to change)"
    end = text.rfind("\n", 0, _TAG_LIMIT - len(more))
    return text[: end if end > 0 else _TAG_LIMIT - len(more)] + more
