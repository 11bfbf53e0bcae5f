"""MLflow: where trials and sweeps are recorded, with every credential redacted on the way in.

The store is `tracking.uri` (default sqlite:///mlruns/mlflow.db, artifacts beside it); an MLflow server
works the same way (`tracking.uri=http://...`, credentials from MLFLOW_TRACKING_USERNAME/PASSWORD).
"""

from __future__ import annotations

import json
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

REDACTED = "***"
# Keys whose values are secrets, and values that look like secrets wherever they appear.
_SECRET_KEY = re.compile(r"token|password|passwd|secret|api[_-]?key|credential|auth", re.IGNORECASE)
_SECRET_VALUES = [
    re.compile(r"hf_[A-Za-z0-9]{20,}"),  # Hugging Face tokens
    re.compile(r"(?<=://)[^/\s:@]+:[^/\s@]+(?=@)"),  # user:password@ in URIs
    re.compile(r"(?i)(?<=password=)[^&\s]+"),  # password=... in query strings / DSNs
    re.compile(r"\b(?:sk|ghp|gho|github_pat|xox[abp])[-_][A-Za-z0-9_-]{16,}"),  # common API token shapes
]
_ENV_SECRET_NAMES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_PASSWORD", "PGPASSWORD")


def redact_text(text: str) -> str:
    for pattern in _SECRET_VALUES:
        text = pattern.sub(REDACTED, text)
    for name in _ENV_SECRET_NAMES:
        value = os.environ.get(name)
        if value and len(value) >= 6:
            text = text.replace(value, REDACTED)
    return text


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys with string values, secrets redacted."""
    out: dict[str, str] = {}
    if isinstance(node, dict):
        for key, value in node.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if _SECRET_KEY.search(str(key)) and value not in (None, ""):
                out[name] = REDACTED
            else:
                out.update(flatten(value, name))
    elif isinstance(node, list):
        out[prefix] = redact_text(json.dumps(node))
    else:
        out[prefix] = redact_text(str(node))
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
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        tags["gpu.name"] = props.name
        tags["gpu.count"] = str(torch.cuda.device_count())
        tags["gpu.total_gib"] = f"{props.total_memory / 1024**3:.1f}"
        tags["gpu.capability"] = f"{props.major}.{props.minor}"
        tags["cuda.runtime"] = str(torch.version.cuda)
        try:
            import pynvml

            pynvml.nvmlInit()
            tags["gpu.driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            tags["gpu.driver"] = "unknown"
    else:
        tags["gpu.name"] = "none (cpu)"
    return tags


def setup(uri: str) -> None:
    """Point MLflow at `uri`; a sqlite store's folder is created first."""
    import mlflow

    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)


def experiment_id(name: str, artifacts_dir: str | None) -> str:
    """The experiment `name`, created with its artifacts under `artifacts_dir` (local stores) if new."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = None
    if artifacts_dir and not client._tracking_client.tracking_uri.startswith("http"):
        location = (Path(artifacts_dir).resolve() / name).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # another worker created it first
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def log_metrics(client: Any, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
    for i in range(0, len(batch), 500):
        client.log_batch(run_id, metrics=batch[i : i + 500])


def log_params(client: Any, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])


def set_tags(client: Any, run_id: str, tags: dict[str, Any]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, redact_text(str(v))[:5000]) for k, v in tags.items() if v is not None]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, tags=items[i : i + 100])


def log_text(client: Any, run_id: str, text: str, name: str) -> None:
    client.log_text(run_id, redact_text(text), name)


def close_failed(client: Any, run_id: str, failure: dict[str, Any], status: str = "FAILED") -> None:
    """End a run that its trial could not end itself, with the failure's tags."""
    tags = {"trial.status": "failed", "failure.kind": failure.get("kind"), "failure.message": failure.get("message")}
    if failure.get("step") is not None:
        tags["failure.step"] = failure["step"]
    if failure.get("rank") is not None:
        tags["failure.rank"] = failure["rank"]
    set_tags(client, run_id, tags)
    client.set_terminated(run_id, status)
