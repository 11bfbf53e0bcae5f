"""The sweep's MLflow runs: one experiment per study, one parent run per sweep (every worker's), one child run per
trial, what a trial's run says it measured, and closing the run of a trial whose worker died.

What a newcomer sees in MLflow's UI without setting anything up: each run says what it is (`run.kind` = sweep |
trial | skipped) and a trial's name carries its knobs (`trial 3: seq=1024 grad_acc=4 r=16 group_len=true`; after
the report, its outcome too: `trial 3 oom: ...`; `skipped (repeat of 3): ...`); the parent run's and the
experiment's descriptions (MLflow's `mlflow.note.content`) say where the report is; and the experiment holds a
saved view (tracking.save_view) whose columns are the knobs and the key metrics instead of 160-odd config params.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from src import knobs, record, tracking
from src.failures import first_line
from src.record import RUN_KIND as KIND  # what a run of a study's experiment is: sweep | trial | skipped | soak
from src.record import Outcome

log = logging.getLogger(__name__)

# The columns of the experiment's saved view: the metrics a stability map is read by (the knobs come first).
KEY_METRICS = ("tokens_per_s", "peak_vram_reserved_gib", "vram_headroom_frac", "peak_rss_gib", "step_time_s")
KEY_TAGS = (record.REPORT_CLASS, record.REPORT_DETAIL, record.FAILURE_KIND, record.SKIP_REASON)
VIEW_NAME = "stability sweep: knobs, outcome, memory, speed"


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
                run_name=sweep_name(self.study_name),
                tags={record.OPTUNA_STUDY: self.study_name, record.ROLE: "parent", KIND: "sweep"},
            ).info.run_id
        else:
            self.client.update_run(parent, status="RUNNING")
        self.parent = parent
        # named and described afresh: a report's counts in its name and description are stale once it runs again
        about = {
            KIND: "sweep",
            "mlflow.runName": sweep_name(self.study_name),
            tracking.NOTE: parent_note(self.study_name),
        }
        tracking.set_tags(self.client, parent, {**tags, **about})
        swept = list(json.loads(tags.get("sweep.search_space") or "{}"))
        objectives = json.loads(tags.get("sweep.objectives") or "{}")  # {metric: direction}
        describe_experiment(self.client, self.experiment_id, self.study_name, swept, objectives)
        return parent

    def _missing(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return False
        except Exception:
            return True

    def child(
        self,
        number: int,
        slot: str,
        params: dict[str, Any] | None = None,
        lever: list[str] | tuple[str, ...] = (),
        recipe: dict[str, Any] | None = None,
    ) -> str:
        """A trial's run, named by its knobs when the caller passes them (`params`: config key -> value), or by what
        it changed of the recipe (`recipe`: the recipe's params) for a lever or recommendation trial."""
        run = self.client.create_run(
            self.experiment_id,
            run_name=trial_name(number, params or {}, lever, recipe=recipe),
            tags={
                record.PARENT_RUN: self.parent,
                record.OPTUNA_STUDY: self.study_name,
                record.OPTUNA_TRIAL: str(number),
                record.SLOT: slot,
                KIND: "trial",
            },
        )
        return run.info.run_id

    def soak(self, number: int, slot: str) -> str:
        """The run of trial `number`'s soak (src/sweep/soak.py), under the sweep's parent run."""
        return self._of_trial(f"soak-trial-{number:03d}", record.SOAK_OF_TRIAL, number, "soak", slot)

    def timed(self, number: int, repeat: int, slot: str) -> str:
        """The run of trial `number`'s timing run `repeat` (src/sweep/timing.py), under the sweep's parent run."""
        return self._of_trial(f"timed-trial-{number:03d}.{repeat}", record.TIMED_OF_TRIAL, number, "timing", slot)

    def _of_trial(self, name: str, of_tag: str, number: int, role: str, slot: str) -> str:
        """A run the sweep makes for trial `number` beyond its own (a soak, a timing run): its role as `run.kind`."""
        tags = {record.PARENT_RUN: self.parent, record.OPTUNA_STUDY: self.study_name, of_tag: str(number),
                record.ROLE: role, KIND: role, record.SLOT: slot}  # fmt: skip
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    def mark_skipped(
        self, run_id: str, number: int, params: dict[str, Any], why: str, because_of: int | None = None
    ) -> None:
        """A trial not launched: named so (`skipped (repeat of 3): seq=...`) and `run.kind` skipped, so it is not
        read as a finished trial that logged nothing."""
        tracking.set_tags(self.client, run_id, skipped_tags(number, params, why, because_of))

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
        if run.info.status not in ("FINISHED", "FAILED", "KILLED"):
            return None
        return record.from_tags(run.data.tags, run.data.metrics)

    def end(self, run_id: str, status: str) -> None:
        """End a run its trial recorded but did not end (killed between its result file and its run's end)."""
        if self.client.get_run(run_id).info.status == "RUNNING":
            self.client.set_terminated(run_id, "FINISHED" if status == "ok" else "FAILED")

    def close_dead(self, trial: FrozenTrial, failure: dict[str, Any]) -> str:
        """The run of a trial whose worker died, closed as KILLED (created if the worker died before making it).
        A FINISHED run too, when Optuna's own stale-trial machinery failed the trial before its records were read:
        Optuna holds it as killed, and MLflow must say the same; a FAILED run keeps the trial's own failure."""
        run_id = trial.user_attrs.get(record.RUN_ID)
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
        "sweep.promote_different_optimisation": json.dumps(bool(sweeper.promote_different_optimisation)),
        "sweep.storage": storage_url,
        "sweep.n_trials": sweeper.n_trials,
        "vram_budget_gib": budget,
    }


# ---- what a run is called and says -----------------------------------------------------------------------------------


def describe_experiment(
    client: Any, experiment_id: str, study: str, swept: list[str], objectives: dict[str, str]
) -> str | None:
    """The experiment's description and its saved view (columns: the swept knobs, the objectives and key metrics,
    the outcome tags; best first by the first objective (`objectives`: metric -> direction); charts: knobs against
    speed and memory), without the parent run. Returns the view's key, or None (with a warning) where the store
    refuses: a convenience never stops a sweep or a report."""
    try:
        key = tracking.save_view(
            client,
            experiment_id,
            VIEW_NAME,
            params=knobs.ordered(set(swept)),
            metrics=list(dict.fromkeys([*objectives, *KEY_METRICS])),
            tags=[KIND, *KEY_TAGS],
            search=f"tags.`{KIND}` != 'sweep'",
            ascending=next(iter(objectives.values()), "maximize") == "minimize",
        )
        client.set_experiment_tag(experiment_id, tracking.NOTE, experiment_note(study, key))
    except Exception as exc:  # noqa: BLE001 - e.g. a server user who may log runs but not edit the experiment
        log.warning("experiment %s: its saved view and description were not written (%s)", study, first_line(str(exc)))
        return None
    return key


def view_address(tracking_uri: str, experiment_id: str, key: str) -> str:
    """The address of the experiment's saved view: on the tracking server, or on `make ui`'s (its default port) for
    a local store. `workflowType`: MLflow 3.17 opens an experiment in its GenAI layout (traces) unless told."""
    base = tracking_uri.rstrip("/") if tracking_uri.startswith("http") else "http://127.0.0.1:5000"
    return f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={key}"


def setting_words(params: dict[str, Any], lever: list[str] | tuple[str, ...] = ()) -> str:
    """A setting in the report's words: the knobs' short labels in registry order, a lever's overrides after."""
    words = [f"{knobs.label(k)}={knobs.fmt(params[k])}" for k in knobs.ordered(set(params))]
    for override in lever:
        key, _, value = override.partition("=")
        words.append(f"+{knobs.label(key.lstrip('+~'))}={value}")
    return " ".join(words)


def trial_name(
    number: int,
    params: dict[str, Any],
    lever: list[str] | tuple[str, ...] = (),
    outcome: str | None = None,
    recipe: dict[str, Any] | None = None,
) -> str:
    """`trial 3: seq=1024 r=16`; with the report's outcome (class, or a failure's kind): `trial 3 oom: ...`. A trial
    of the recipe with changes (a lever or recommendation trial; `recipe`: the recipe's params) says what it
    changed: `trial 4 stable: recipe + gradient_checkpointing`."""
    head = f"trial {number}" + (f" {outcome}" if outcome else "")
    words = change_words(recipe, params, lever) if recipe is not None and lever else setting_words(params, lever)
    return f"{head}: {words}"[:_NAME_LIMIT] if words else head


def change_words(recipe: dict[str, Any], params: dict[str, Any], lever: list[str] | tuple[str, ...]) -> str:
    """What a trial changed of the recipe: `recipe + gradient_checkpointing + attn_implementation=sdpa +
    max_seq_length=4096` (a switch turned on by its name, other values with theirs)."""
    parts = [f"{k.rsplit('.', 1)[-1]}={knobs.fmt(v)}" for k, v in params.items() if recipe.get(k, v) != v]
    for override in lever:
        key, _, value = override.partition("=")
        name, value = key.lstrip("+~").rsplit(".", 1)[-1], value.strip("'\"")  # sdpa, not 'sdpa' (Hydra's quoting)
        parts.append(name if value == "true" else f"{name}={value}")
    return " + ".join(["recipe", *parts])


def skipped_name(number: int, params: dict[str, Any], why: str | None, because_of: int | None) -> str:
    """`skipped (repeat of 3): seq=...`, `skipped (certain oom: > trial 5): ...`, `skipped (predicted oom): ...`.
    `why`: the contract's `skip.reason` (repeat | certain_oom | predicted_oom)."""
    if why == "certain_oom":
        reason = "certain oom" + (f": > trial {because_of}" if because_of is not None else "")
    elif why == "predicted_oom":
        reason = "predicted oom"
    elif because_of is not None:
        reason = f"repeat of {because_of}"
    else:
        reason = "not launched"
    text = setting_words(params) or f"trial {number}"
    return f"skipped ({reason}): {text}"[:_NAME_LIMIT]


def skipped_tags(number: int, params: dict[str, Any], why: str | None, because_of: int | None) -> dict[str, Any]:
    return {"mlflow.runName": skipped_name(number, params, why, because_of), KIND: "skipped"}


_NAME_LIMIT = 250  # MLflow's SQL stores keep run names up to 250 characters


def sweep_name(study: str, summary: str | None = None) -> str:
    """The parent run's name; with the report's counts once it ran (`sweep demo: 8 trials, 5 stable, ...`)."""
    return (f"sweep {study}" + (f": {summary}" if summary else ""))[:_NAME_LIMIT]


def parent_note(study: str) -> str:
    """The parent run's description (MLflow shows it on the run's page)."""
    return (
        f"The sweep of study **{study}**: one child run per trial (`run.kind` trial, or skipped when not launched).\n\n"
        f"The stability report, written by `python -m src.report {study}`, is in this run's **Artifacts** under "
        "`report/`: open `report/report.html` for the map, every trial's peak memory against the budget, and the "
        "knobs against speed and memory; `report/report.md` for the same in words. Its counts are this run's "
        "`report.*` tags; each trial's run gets `report.class` (stable | marginal | failed | skipped)."
    )


def experiment_note(study: str, view_key: str) -> str:
    """The experiment's description (MLflow shows it above the runs): what its runs are and how to see the knobs
    and metrics. MLflow 3.17 nests runs under their parent only while they are sorted by creation time (it then
    fetches a matching trial's parent too): the saved view sorts by a metric, so a filter shows trials alone."""
    return (
        f"Stability sweep **{study}** (Optuna study of the same name). MLflow opens in its GenAI layout: pick "
        "**Model training** (top left) to see the runs. The sweep's parent run folds its trials, each named by its "
        "knobs and outcome (`trial 3 stable: seq=1024 r=16 ...`), and holds the report (Artifacts → "
        "`report/report.html`). For the knobs and key metrics as columns, open the saved view "
        f"**{VIEW_NAME}** (**Views**, top right, or add `?viewStateShareKey={view_key}` to this page's address): "
        "trials only, best first. Filters there: ``tags.`report.class` = 'stable'``, ``tags.`failure.kind` = "
        "'oom'``, ``tags.`run.kind` = 'skipped'``."
    )
