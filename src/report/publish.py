"""The report on MLflow: its files and counts on the sweep's parent run, each trial's class on the trial's run."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from src import redact, tracking

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
    tracking.set_tags(client, sweep.parent_run_id, tags)
    for row in sweep.rows:
        if row.run_id:
            tracking.set_tags(client, row.run_id, {"report.class": row.verdict, "report.detail": row.detail})
    return sweep.parent_run_id


def _whole_sentences(sentences: list[str]) -> str:
    """The advice one sentence a line, cut after the last whole sentence that fits the tag (report.md has all)."""
    text = "\n".join(redact.redact_text(s) for s in sentences)
    if len(text) <= _TAG_LIMIT:
        return text
    more = "\n(more in report.md: What to change)"
    end = text.rfind("\n", 0, _TAG_LIMIT - len(more))
    return text[: end if end > 0 else _TAG_LIMIT - len(more)] + more
