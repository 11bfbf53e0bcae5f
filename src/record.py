"""A trial's record, in one place: the name of every Optuna attribute and MLflow tag a trial, a skip, a soak or a
sweep worker writes, the outcome and failure shapes and their conversions, and one way to read a trial's outcome
whatever wrote it (the trial's result.json, its MLflow run's tags, or the engine on its Optuna trial). Writers
(src/trial/, src/tracking.py, src/sweep/) and readers (src/study.py, the report, promotion) take these names here;
nothing else spells them. It imports nothing of the project: every floor may read it.

A failure has one shape between the trial and the report: a dict {kind, message, step, rank} (`Failure.as_dict`
in src/failures.py), written as `failure.<key>` tags and attributes and read back by `failure_from`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- names: a trial's outcome (Optuna user attrs and MLflow tags alike) ------------------------------------------

STATUS = "trial.status"  # ok | failed | skipped | pruned
FAILURE = "failure."  # the prefix of a failure's fields: failure.kind, failure.message, failure.step, failure.rank
FAILURE_KIND = "failure.kind"  # oom | launch_failure | ... | other (src/failures.py)
FAILURE_MESSAGE = "failure.message"
FAILURE_STEP = "failure.step"
FAILURE_RANK = "failure.rank"
# The sticky-CUDA failure's second run with CUDA_LAUNCH_BLOCKING=1: what it failed of (the first kind stays)
LAUNCH_BLOCKING_KIND = "failure.launch_blocking.kind"
LAUNCH_BLOCKING_MESSAGE = "failure.launch_blocking.message"
RERUN_ALONE = "trial.rerun_alone"  # why the trial ran again alone on its card (its first OOM was the shared card's)
LAUNCHER = "trial.launcher"  # forkserver | interpreter
ATTENTION_KERNEL = "attention.kernel"
RUN_ID = "mlflow_run_id"  # on an Optuna trial: its MLflow run
# A skip (not launched): its code (repeat | certain_oom | predicted_oom), in words, and the trial that stands for it
SKIP_REASON = "skip.reason"
SKIPPED_REASON = "skipped.reason"
SKIPPED_BECAUSE_OF = "skipped.because_of"
SKIPPED_DUPLICATE_OF = "skipped.duplicate_of"  # an older engine's name for because_of (read only)
RETRY_OF = "retry_of"  # a trial queued again by retry_failed_trials: the trial it retries
RETRIED = "retried"  # an older engine marked the retried trial itself (read only)

# ---- names: the sweep's own, on trials and runs ----------------------------------------------------------------

SLOT = "sweep.slot"  # the slot it ran on: cuda0, cuda0#2, cpu1
RECIPE = "sweep.recipe"  # True on the user's recipe's trial
LEVER = "sweep.lever"  # JSON list of the overrides a lever trial adds to the recipe
LEVER_OF = "sweep.lever_of"  # a lever trial: the recipe trial's number
# A trial of a custom search space whose suggestions are labels (hydra.sweeper.custom_search_space returns the
# overrides they stand for): the config keys and values it ran with, which the soak trains again
SETTINGS = "sweep.settings"
# A lever trial's Optuna param (categorical, told with its outcome; no sampler suggests it): its overrides joined by
# ", ", so Optuna's tools and the dashboard see a lever trial's setting apart from the recipe's. The report, the
# soak and promotion read the lever from LEVER and leave this param out of a trial's knobs.
LEVER_PARAM = "lever"
# A recommendation trial (src/sweep/journey.py): a lever trial (LEVER, LEVER_OF) the sweep chose with the memory
# model, combining levers with the length the data needs; True on it. Its Optuna param (as LEVER_PARAM, over the
# study's queued recommendations) is RECOMMEND_PARAM; the study keeps what was chosen and why in RECOMMENDATION.
RECOMMENDED = "sweep.recommended"
RECOMMEND_PARAM = "recommendation"
# A finalist checked against the reference (src/sweep/faster.py), a study user attr per trial ("sweep.same_model.7"):
# {"passed", "max_loss_diff", "max_loss_rel_diff", "adapter_rel_diff", "tolerance", "reference": its trial number,
# "steps", "losses"}; a finalist
# that failed it is never ranked or promoted
SAME_MODEL = "sweep.same_model"
# Study user attr: the optimizer step of the sweep's fixed config ({batch key: value, accumulation key: value}), for
# trials whose params and levers do not set them
STEP_DEFAULTS = "sweep.step_defaults"
# A trial the second stage queued (src/sweep/faster.py: the reference with same-model levers), True; the study keeps
# what it queued and against which reference under the same name
FASTER = "sweep.faster"
# A second-stage trial's Optuna param (as LEVER_PARAM, over the levers the second stage queued: one distribution for
# all of them)
FASTER_PARAM = "same_model_lever"
# The params that name what a stage added to the recipe: not knobs (the report, the soak and promotion read LEVER)
STAGE_PARAMS = (LEVER_PARAM, RECOMMEND_PARAM, FASTER_PARAM)


def same_model_key(number: int) -> str:
    return f"{SAME_MODEL}.{number}"


# A setting's speed read alone on its card, several times (src/sweep/timing.py), a study user attr per trial
# ("sweep.timed.7"): {"tokens_per_s": the median, "tokens_per_s_min", "tokens_per_s_max", "readings", "runs",
# "finished", "mfu_standard", "peak_vram_reserved_gib", "alone": True}; the ranking reads the median
TIMED = "sweep.timed"


def timed_key(number: int) -> str:
    return f"{TIMED}.{number}"


RECOMMENDATION = "sweep.recommendation"  # study user attr: {"why", "queued": [[overrides]], "closest", "note"}
ROLE = "sweep.role"  # parent | soak | timing
RUN_KIND = "run.kind"  # sweep (the parent) | trial | skipped | soak
OPTUNA_STUDY = "optuna.study"
OPTUNA_TRIAL = "optuna.trial"
PARENT_RUN = "mlflow.parentRunId"
PARENT_RUN_ID = "mlflow_parent_run_id"  # on the Optuna study: the sweep's parent run
REPORT_CLASS = "report.class"
REPORT_DETAIL = "report.detail"
# The worker that runs a trial (a live worker on the same host is told from a dead one by its start in ticks)
WORKER_HOST = "worker.host"
WORKER_PID = "worker.pid"
WORKER_STARTED = "worker.started"
WORKER_STARTED_SINCE_BOOT = "worker.started_since_boot"

# ---- names: the soak (src/sweep/soak.py) -----------------------------------------------------------------------

SOAK = "soak.{}"  # study user attr per finalist: its soak's record
SOAK_PREFIX = "soak."
SOAK_STATUS = "soak.status"  # passed | failed, on the soak's run and on the finalist's
SOAK_RUN_ID = "soak.run_id"  # on the finalist's run
SOAK_OF_TRIAL = "soak.of_trial"  # on the soak's run
TIMED_OF_TRIAL = "timed.of_trial"  # on a timing run (src/sweep/timing.py)

# ---- a dead worker's trial -------------------------------------------------------------------------------------

# A FAIL trial that no one labelled was failed by Optuna's stale-trial machinery (optuna.storages.
# fail_stale_trials): its worker stopped beating, and a finished trial takes no more attributes.
STALE_KIND = "killed"
STALE_MESSAGE = "the sweep worker running this trial died"
DEAD_WORKER = {"kind": STALE_KIND, "message": STALE_MESSAGE, "step": None}
# How the message of a trial the sweep's stop ended ends (src/sweep/process.py): "<the stop's reason> while this trial
# ran"
STOPPED_WHILE = " while this trial ran"
# Failures the sweep's stop or a watchdog caused: its run is closed KILLED, not FAILED
KILLED_KINDS = ("killed", "timeout")


# ---- the outcome and its conversions ------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How one trial (or soak) ended, whatever wrote it."""

    status: str  # ok | failed
    metrics: dict[str, float] = field(default_factory=dict)
    failure: dict[str, Any] | None = None  # {kind, message, step, rank}
    recorded: bool = True  # the trial ended its MLflow run itself
    attention_kernel: str | None = None
    log_dir: Path | None = None
    launcher: str = "interpreter"


def failure_fields(failure: Mapping[str, Any] | None) -> dict[str, Any]:
    """A failure's fields as `failure.<key>` attributes or tags (None fields left out)."""
    return {FAILURE + k: v for k, v in (failure or {}).items() if v is not None}


def outcome_tags(status: str, failure: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tags (or attributes) that say how a trial ended: its status and its failure's fields."""
    return {STATUS: status, **failure_fields(failure)}


def failed_tags(failure: Mapping[str, Any]) -> dict[str, Any]:
    """A run closed by someone other than its trial (the engine, a dead worker's recovery): failed, and why."""
    return outcome_tags("failed", {k: failure.get(k) for k in ("kind", "message", "step", "rank")})


def failure_from(values: Mapping[str, Any]) -> dict[str, Any]:
    """A failure read back from `failure.<key>` attributes or tags (MLflow keeps them as text)."""
    step = values.get(FAILURE_STEP)
    if isinstance(step, str):
        step = int(step) if step.isdigit() else None
    return {"kind": values.get(FAILURE_KIND, "other"), "message": values.get(FAILURE_MESSAGE, ""), "step": step}


def from_result(result: Mapping[str, Any], log_dir: Path | None = None, launcher: str = "unknown") -> Outcome:
    """The outcome a trial wrote in its result.json."""
    return Outcome(
        status=result["status"],
        metrics=result.get("metrics", {}),
        failure=result.get("failure"),
        attention_kernel=result.get("attention_kernel"),
        log_dir=log_dir,
        launcher=launcher,
    )


def result_of(status: str, run_id: str, metrics: dict[str, float], failure: Any, kernel: str | None) -> dict:
    """A trial's result.json (`failure`: a src.failures.Failure or None)."""
    return {
        "status": status,
        "run_id": run_id,
        "metrics": metrics,
        "failure": failure.as_dict() if failure else None,
        "attention_kernel": kernel,
    }


def from_tags(tags: Mapping[str, str], metrics: Mapping[str, float]) -> Outcome | None:
    """The outcome a finished run's tags say (ended by its trial, or by the engine for a process that died without
    one); None when they hold none."""
    status = tags.get(STATUS)
    if status not in ("ok", "failed"):
        return None
    failure = failure_from(tags) if status == "failed" else None
    launcher = tags.get(LAUNCHER, "unknown")
    return Outcome(status, dict(metrics), failure, attention_kernel=tags.get(ATTENTION_KERNEL), launcher=launcher)


def attrs_of(outcome: Outcome) -> dict[str, Any]:
    """What the engine writes on the Optuna trial it tells (redaction of the failure's words is the writer's)."""
    attrs: dict[str, Any] = {
        **outcome.metrics,
        **outcome_tags(outcome.status, outcome.failure),
        LAUNCHER: outcome.launcher,
    }
    if outcome.attention_kernel:
        attrs[ATTENTION_KERNEL] = outcome.attention_kernel
    return attrs


def status(attrs: Mapping[str, Any]) -> str | None:
    """A trial's recorded status (ok | failed | skipped | pruned) from its attributes or tags."""
    return attrs.get(STATUS)


def recorded_kind(attrs: Mapping[str, Any]) -> str | None:
    """The failure kind a trial's attributes or tags hold (None: none recorded)."""
    return attrs.get(FAILURE_KIND)


def skipped_attrs(why: str, reason: str, because_of: int | None, kind: str | None) -> dict[str, Any]:
    """A skip's record: `why` the code (skip.reason), `reason` in words, the trial that stands for it, its kind."""
    attrs: dict[str, Any] = {STATUS: "skipped", SKIP_REASON: why, SKIPPED_REASON: reason}
    if because_of is not None:
        attrs[SKIPPED_BECAUSE_OF] = because_of
    if kind is not None:
        attrs[FAILURE_KIND] = kind
    return attrs


def skip_of(attrs: Mapping[str, Any]) -> tuple[str, str, int | None, str | None] | None:
    """A skip the engine decided (written before anything else of it) read back: (code, words, because_of, kind);
    None when the trial is not one."""
    because = attrs.get(SKIPPED_BECAUSE_OF)
    if because is None and SKIP_REASON not in attrs:
        return None
    return (
        attrs.get(SKIP_REASON, "repeat"),
        attrs.get(SKIPPED_REASON, ""),
        int(because) if because is not None else None,
        attrs.get(FAILURE_KIND),
    )


def origin(attrs: Mapping[str, Any]) -> int | None:
    """The trial a skip stands for (an older engine's name too)."""
    because = attrs.get(SKIPPED_BECAUSE_OF, attrs.get(SKIPPED_DUPLICATE_OF))
    return int(because) if because is not None else None


def failure_kind(trial: Any) -> str | None:
    """An Optuna trial's recorded `failure.kind`; `killed` for a FAIL trial nobody labelled; None otherwise."""
    kind = trial.user_attrs.get(FAILURE_KIND)
    if kind is None and trial.state.name == "FAIL":
        return STALE_KIND
    return kind


def killed_by_sweep(trial: Any) -> bool:
    """A FAIL trial that its sweep, not its setting, ended: its worker died (kill -9, a lost node) or the sweep's stop
    ended it (Ctrl-C, SIGTERM, a full disk). What `hydra.sweeper.retry_failed_trials` queues again; a trial killed
    by its own doing (a fault, the watchdog) is not."""
    if trial.state.name != "FAIL" or failure_kind(trial) != STALE_KIND:
        return False
    message = trial.user_attrs.get(FAILURE_MESSAGE)
    return message is None or message == STALE_MESSAGE or str(message).endswith(STOPPED_WHILE)


def retried_numbers(trials: Any) -> set[int]:
    """Trials whose settings were queued again (`hydra.sweeper.retry_failed_trials`): the retry counts, not them."""
    return {int(t.user_attrs[RETRY_OF]) for t in trials if t.user_attrs.get(RETRY_OF) is not None}


def is_soak_key(key: str, value: Any) -> bool:
    """A study user attr that holds a finalist's soak record (`soak.<trial>`)."""
    return key.startswith(SOAK_PREFIX) and key.split(".", 1)[1].isdigit() and isinstance(value, dict)


def lever_value(overrides: list[str]) -> str:
    """A lever's LEVER_PARAM value: "trainer.gradient_checkpointing=true"."""
    return ", ".join(overrides)
