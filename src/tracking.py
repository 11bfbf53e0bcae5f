"""MLflow: where trials and sweeps are recorded, with every credential redacted on the way in (src/redact.py).

The store is `tracking.uri` (default sqlite:///mlruns/mlflow.db, artifacts beside it); an MLflow server
works the same way (`tracking.uri=http://...`, credentials from MLFLOW_TRACKING_USERNAME/PASSWORD).
"""

from __future__ import annotations

import json
import platform
import re
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

from src import gpus, record
from src.config import flatten
from src.failures import ConfigError
from src.redact import REDACTED, is_secret_key, redact_text, refusal

# MLflow's description of a run or an experiment (markdown, shown on its page and editable there).
NOTE = "mlflow.note.content"
# A saved view of an experiment's runs table, listed in the UI's "Saved views" menu and opened by
# `#/experiments/<id>/runs?viewStateShareKey=<key>`. Checked against MLflow 3.17.2's UI bundle (its saved views:
# the tag holds {name, createdAt, updatedAt, state}, `state` a JSON string of the page's search facets and UI
# state; a key the state omits takes the UI's default).
VIEW_TAG = "mlflow.sharedViewState."
# The registry's alias of the version in production: the promoted setting, or the adapter a run of it trained.
ALIAS = "production"


def params(config: dict[str, Any]) -> dict[str, str]:
    """A composed config as MLflow params: dotted keys, string values (lists as JSON), secrets redacted."""
    out = {}
    for key, value in flatten(config).items():
        secret = any(is_secret_key(part) for part in key.split("."))
        if secret and value not in (None, "") and not isinstance(value, bool | int | float):
            out[key] = REDACTED
        else:
            out[key] = redact_text(json.dumps(value) if isinstance(value, list) else str(value))
    return out


def versions() -> dict[str, str]:
    found = {}
    for dist in (
        "torch",
        "transformers",
        "trl",
        "peft",
        "bitsandbytes",
        "accelerate",
        "datasets",
        "optuna",
        "mlflow-skinny",
    ):
        try:
            found[dist.replace("-skinny", "")] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def system_tags() -> dict[str, str]:
    import torch

    tags = {f"version.{k}": v for k, v in versions().items()}
    tags["python"] = platform.python_version()
    tags["host"] = platform.node()
    tags["torch.num_threads"] = str(torch.get_num_threads())  # the slot's share of the cores (OMP_NUM_THREADS)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        tags["gpu.name"] = props.name
        tags["gpu.count"] = str(torch.cuda.device_count())
        tags["gpu.total_gib"] = f"{props.total_memory / 1024**3:.1f}"
        tags["gpu.capability"] = f"{props.major}.{props.minor}"
        tags["cuda.runtime"] = str(torch.version.cuda)
        tags["gpu.driver"] = gpus.driver().get("version", "unknown")
    else:
        tags["gpu.name"] = "none (cpu)"
    return tags


# How the sweep engine talks to a tracking server (`tracking.uri=http://...`): MLflow's own client retries a server
# that does not answer for ~4 minutes (7 retries, backoff factor 2, 120 s timeout), during which the sweep can
# neither stop nor say why. The engine fails fast instead and stops the sweep (src/sweep/stop.py). A value the user
# set in the environment wins; trial processes started by the engine inherit these.
FAIL_FAST = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def fail_fast() -> None:
    """Bounded retries and timeouts for this process's MLflow HTTP calls (FAIL_FAST), unless the user set them."""
    import os

    for key, value in FAIL_FAST.items():
        os.environ.setdefault(key, value)


def try_once() -> None:
    """Once a tracking server is found unreachable: the calls still to come (closing the parent run, recording the
    killed trials) try once, briefly; a server that hangs would otherwise hold the stop for a retry budget per call."""
    import os

    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")


def setup(uri: str) -> None:
    """Point MLflow at `uri`; a sqlite store's folder is created first, and its tables by one process at a time
    (runs started together on a new store would otherwise each create and migrate them: "duplicate column name")."""
    import mlflow

    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        db.parent.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock
        from mlflow.tracking import MlflowClient

        with FileLock(str(db) + ".lock"):
            MlflowClient(uri).search_experiments(max_results=1)  # creates (or migrates) the tables, once
    mlflow.set_tracking_uri(uri)


def experiment_id(name: str, artifacts_dir: str | None, key: str = "tracking.experiment") -> str:
    """The experiment `name`, created with its artifacts under `artifacts_dir` (local stores) if new. A name shaped
    like a credential (the config's `key`) is refused before anything is made: MLflow keeps a name in clear, in its
    store and as the artifacts' folder, and shows it in its UI."""
    why = refusal(key, name)
    if why:
        raise ConfigError(why)
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if artifacts_dir and not mlflow.get_tracking_uri().startswith("http"):
        location = (Path(artifacts_dir).resolve() / name).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # another worker created it first
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


# MlflowClient.log_batch splits what it is given into the store's batch limits itself.


def log_metrics(client: Any, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None])


def log_params(client: Any, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, v[:6000]) for k, v in params.items()])


def set_tags(client: Any, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    client.log_batch(run_id, tags=[RunTag(k, redact_text(str(v))[:5000]) for k, v in tags.items() if v is not None])


def log_text(client: Any, run_id: str, text: str, name: str) -> None:
    client.log_text(run_id, redact_text(text), name)


def close_failed(client: Any, run_id: str, failure: dict[str, Any], status: str = "FAILED") -> None:
    """End a run that its trial could not end itself, with the failure's tags."""
    set_tags(client, run_id, record.failed_tags(failure))
    client.set_terminated(run_id, status)


def save_view(
    client: Any,
    experiment_id: str,
    name: str,
    params: list[str],
    metrics: list[str],
    tags: list[str],
    search: str = "",
    ascending: bool = False,
) -> str:
    """A saved view of the experiment's runs (see VIEW_TAG): the runs matching `search`, with these params, metrics
    and tags as the table's columns (after the run name), sorted by the first metric (`ascending` or not), every run in the charts, and
    two charts: a parallel-coordinates chart of the params against the first two metrics, and the second metric
    (memory) against the first (speed). Saved again under the same key when it exists (its creation time kept).
    Returns the key."""
    key = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    existing = client.get_experiment(experiment_id).tags.get(VIEW_TAG + key)
    created = json.loads(existing).get("createdAt") if existing else None
    now = int(time.time() * 1000)
    section = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{experiment_id}/{key}/section"))

    def chart(kind: str, **fields: Any) -> dict[str, Any]:
        return {
            "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"{experiment_id}/{key}/{kind}")),
            "type": kind,
            "metricSectionId": section,
            "deleted": False,
            "isGenerated": False,
            **fields,
        }

    charts = []
    if metrics:
        charts.append(
            chart(
                "PARALLEL",
                displayName="knobs → " + ", ".join(metrics[:2]),
                selectedParams=params,
                selectedMetrics=metrics[:2],
                showAllRuns=True,
                runsCountToCompare=100,
            )
        )
    if len(metrics) > 1:
        charts.append(
            chart(
                "SCATTER",
                displayName=f"{metrics[0]} vs {metrics[1]}",
                xaxis={"key": metrics[1], "type": "METRIC"},
                yaxis={"key": metrics[0], "type": "METRIC"},
                runsCountToCompare=100,
            )
        )
    columns = [
        f"{kind}.`{k}`" for kind, keys in (("params", params), ("metrics", metrics), ("tags", tags)) for k in keys
    ]
    state = {
        "searchFilter": search,
        **({"orderByKey": f"metrics.`{metrics[0]}`", "orderByAsc": ascending} if metrics else {}),
        "selectedColumns": columns,
        "columnOrder": columns,
        "runsHiddenMode": "SHOW_ALL",
        "compareRunCharts": charts,
        "compareRunSections": [
            {
                "uuid": section,
                "name": "Sweep",
                "display": True,
                "isReordered": False,
                "deleted": False,
                "isGenerated": False,
            }
        ],
    }
    envelope = {"name": name, "createdAt": created or now, "updatedAt": now, "state": json.dumps(state)}
    client.set_experiment_tag(experiment_id, VIEW_TAG + key, json.dumps(envelope))
    return key


def setting_version(version: Any) -> str:
    """The version whose setting `version` holds: itself, or for an adapter a production run registered, the
    promoted version it trained (its tag `setting_version`)."""
    return str(version.tags.get("setting_version", version.version))


def register_adapter(client: Any, name: str, version: int, run_id: str) -> str | None:
    """A production run that finished: its adapter (`runs:/<run>/adapter`) as a new version of `name`, tagged as the
    promoted `version` it trained (the same study, trial and figures) and with the run; the alias moves to it when it
    still points at that setting (a newer promotion keeps it). Returns the new version, or None (with why) when
    `version` is not in the registry."""
    from mlflow.exceptions import MlflowException

    try:
        promoted = client.get_model_version(name, str(version))
    except MlflowException:
        print(f"registry: {name} has no version {version} (tracking.registered_version): adapter not registered")
        return None
    tags = {**promoted.tags, "adapter": "yes", "setting_version": str(version), "trained_by_run": run_id}
    description = (
        f"The adapter production run {run_id} trained from version {version}'s setting "
        f"(trial {promoted.tags.get('trial')} of study {promoted.tags.get('study')}): runs:/{run_id}/adapter"
    )
    new = client.create_model_version(
        name, f"runs:/{run_id}/adapter", run_id=run_id, tags=tags, description=description
    )
    try:
        current = client.get_model_version_by_alias(name, ALIAS)
    except MlflowException:
        current = None
    if current is None or setting_version(current) == str(version):
        client.set_registered_model_alias(name, ALIAS, new.version)
    set_tags(client, run_id, {"registry.model": name, "registry.version": new.version})
    return str(new.version)
