"""The sweep's MLflow runs: one experiment per study, one parent run per sweep (every worker's), one child run per
trial, what a trial's run says it measured, and closing the run of a trial whose worker died.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from src import tracking
from src.sweep.process import Outcome


class SweepRuns:
    def __init__(self, tracking_uri: str, study_name: str, artifacts_dir: Path) -> None:
        from mlflow.tracking import MlflowClient

        tracking.setup(tracking_uri)
        self.client = MlflowClient()
        self.study_name = study_name
        self.experiment_id = tracking.experiment_id(study_name, str(artifacts_dir))
        self.parent = ""

    def open_parent(self, parent: str | None, tags: dict[str, Any]) -> str:
        """The sweep's parent run: `parent` (the study's, from an earlier process) running again, or a new one."""
        if parent is None or self._missing(parent):
            parent = self.client.create_run(
                self.experiment_id,
                run_name=f"sweep-{self.study_name}",
                tags={"optuna.study": self.study_name, "sweep.role": "parent"},
            ).info.run_id
        else:
            self.client.update_run(parent, status="RUNNING")
        self.parent = parent
        tracking.set_tags(self.client, parent, tags)
        return parent

    def _missing(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return False
        except Exception:
            return True

    def child(self, number: int, slot: str) -> str:
        run = self.client.create_run(
            self.experiment_id,
            run_name=f"trial-{number:03d}",
            tags={
                "mlflow.parentRunId": self.parent,
                "optuna.study": self.study_name,
                "optuna.trial": str(number),
                "sweep.slot": slot,
            },
        )
        return run.info.run_id

    def of_trial(self, number: int) -> list[str]:
        """This sweep's runs of trial `number` (a worker may die after creating one, before naming it)."""
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`optuna.trial` = '{number}'", max_results=10
        )
        return [r.info.run_id for r in runs if r.data.tags.get("mlflow.parentRunId") == self.parent]

    def recorded(self, run_id: str) -> Outcome | None:
        """What a trial's run says it measured, if it was ended with an outcome (by its trial, or by the engine for a
        process that died without one); None while it runs or when it holds none."""
        try:
            run = self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - gone or unreachable: no record to go by
            return None
        tags = run.data.tags
        status = tags.get("trial.status")
        if run.info.status not in ("FINISHED", "FAILED", "KILLED") or status not in ("ok", "failed"):
            return None
        failure = None
        if status == "failed":
            step = tags.get("failure.step")
            failure = {
                "kind": tags.get("failure.kind", "other"),
                "message": tags.get("failure.message", ""),
                "step": int(step) if step and step.isdigit() else None,
            }
        launcher = tags.get("trial.launcher", "unknown")
        metrics = dict(run.data.metrics)
        return Outcome(status, metrics, failure, attention_kernel=tags.get("attention.kernel"), launcher=launcher)

    def end(self, run_id: str, status: str) -> None:
        """End a run its trial recorded but did not end (killed between its result file and its run's end)."""
        if self.client.get_run(run_id).info.status == "RUNNING":
            self.client.set_terminated(run_id, "FINISHED" if status == "ok" else "FAILED")

    def close_dead(self, trial: FrozenTrial, failure: dict[str, Any]) -> str:
        """The run of a trial whose worker died, closed as KILLED (created if the worker died before making it).
        A FINISHED run too, when Optuna's own stale-trial machinery failed the trial before its records were read:
        Optuna holds it as killed, and MLflow must say the same; a FAILED run keeps the trial's own failure."""
        run_id = trial.user_attrs.get("mlflow_run_id")
        if run_id is None:
            run_id = next(iter(self.of_trial(trial.number)), None) or self.child(trial.number, "unknown")
        if self.client.get_run(run_id).info.status in ("RUNNING", "FINISHED"):
            tracking.close_failed(self.client, run_id, failure, status="KILLED")
        return run_id

    def close_errored(self, run_id: str | None, message: str) -> bool:
        """Close a trial's run that the engine's own error left RUNNING; False if MLflow itself failed."""
        try:
            if run_id and self.client.get_run(run_id).info.status == "RUNNING":
                tracking.close_failed(self.client, run_id, {"kind": "other", "message": message})
            return True
        except Exception:  # noqa: BLE001 - MLflow itself may be the trouble; the study has the record
            return False

    def log_counts(self, counts: dict[str, int], step: int) -> None:
        metrics = {f"trials_{k}": float(v) for k, v in counts.items() if k != "running"}
        tracking.log_metrics(self.client, self.parent, metrics, step=step)


def parent_tags(
    sweeper: Any,
    objectives: list[str],
    directions: list[str],
    distributions: dict[str, Any],
    storage_url: str,
    budget: float,
) -> dict[str, Any]:
    """What the report and the promotion must know of how the trials ran, command-line overrides included
    (trials never see hydra.sweeper; a probe's length is not carried into production). Redacted as set."""
    return {
        "sweep.search_space": json.dumps({k: repr(v) for k, v in distributions.items()}),
        "sweep.objectives": json.dumps(dict(zip(objectives, directions, strict=True))),
        "sweep.headroom_margin": json.dumps(float(sweeper.headroom_margin)),
        "sweep.trial_overrides": json.dumps([str(o) for o in sweeper.trial_overrides]),
        "sweep.storage": storage_url,
        "sweep.n_trials": sweeper.n_trials,
        "vram_budget_gib": budget,
    }
