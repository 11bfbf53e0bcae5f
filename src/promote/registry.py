"""The MLflow model registry: which version the `production` alias points at, and a new version from a trial's
run, tagged with its figures, the alias moved to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from src import tracking
from src.handoff import HYDRA_FILES
from src.places import store_exists
from src.report import fmt
from src.study import Sweep, TrialRow
from src.tracking import ALIAS

DESCRIPTION = "QLoRA fine-tunes promoted from stability sweeps"  # the registered model's, when this creates it
# The trial's figures a version carries as tags (each as it was measured).
_FIGURES = (
    "tokens_per_s",
    "step_time_s",
    "peak_vram_reserved_gib",
    "peak_vram_allocated_gib",
    "peak_vram_device_gib",
    "vram_headroom_frac",
    "vram_budget_gib",
    "tokens_per_optimizer_step",
    "truncated_answer_frac",
)


@dataclass
class RegistryState:
    versions: list[Any]
    production: Any | None  # the version the alias points at now

    @property
    def next_version(self) -> int:
        return max((int(v.version) for v in self.versions), default=0) + 1


def registry_state(client: Any, name: str, uri: str) -> RegistryState:
    from mlflow.exceptions import MlflowException

    if not store_exists(uri):
        return RegistryState([], None)  # no store yet: reading it would create one
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        versions = []
    try:
        production = client.get_model_version_by_alias(name, ALIAS)
    except MlflowException:
        production = None
    return RegistryState(list(versions), production)


def register(client: Any, name: str, sweep: Sweep, row: TrialRow, description: str) -> Any:
    """A new version of `name` from the trial's run, tagged with its figures; the alias moves to it.

    Not `mlflow.register_model`: as of MLflow 3.17 it registers a `runs:/` URI only when the folder is an MLflow
    model (an MLmodel file) or a LoggedModel of the run, and the trial's `adapter/` is a plain PEFT folder."""
    from mlflow.exceptions import MlflowException

    artifacts = {a.path for a in client.list_artifacts(row.run_id)}
    if "config" not in artifacts:  # a trial from before runs logged their config: the run gets it now
        hydra_dir = sweep.trial_dir(row.number) / ".hydra"
        for f in HYDRA_FILES:
            if (hydra_dir / f).exists():
                tracking.log_text(client, row.run_id, (hydra_dir / f).read_text(), f"config/{f}")
    source = f"runs:/{row.run_id}/adapter" if "adapter" in artifacts else f"runs:/{row.run_id}"
    try:
        client.create_registered_model(name, description=DESCRIPTION)
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    tags = _version_tags(sweep, row, "adapter" in artifacts)
    version = client.create_model_version(name, source, run_id=row.run_id, tags=tags, description=description)
    client.set_registered_model_alias(name, ALIAS, version.version)
    tracking.set_tags(client, row.run_id, {"registry.model": name, "registry.version": version.version})
    return version


def _version_tags(sweep: Sweep, row: TrialRow, adapter: bool) -> dict[str, str]:
    """Where the version comes from and what it measured, as the registry's tags."""
    tags: dict[str, Any] = {
        "study": sweep.name,
        "trial": row.number,
        "mlflow_run_id": row.run_id,
        "objective": f"{sweep.objectives[0]} ({sweep.directions[0]})",
        "margin": sweep.margin,
        "adapter": "yes" if adapter else "no (the trial saved none: trainer.save_adapter=false)",
        "config": f"runs:/{row.run_id}/config/config.yaml",
    }
    tags.update({key: f"{row.metrics[key]:.4g}" for key in _FIGURES if key in row.metrics})
    if row.timed.get("tokens_per_s"):  # its speed alone on the card, as ranked and reported (src/sweep/timing.py)
        timed = row.timed
        tags["tokens_per_s_alone"] = f"{timed['tokens_per_s']:.4g}"
        tags["tokens_per_s_alone_range"] = f"{timed['tokens_per_s_min']:.4g}-{timed['tokens_per_s_max']:.4g}"
        tags["tokens_per_s_alone_runs"] = timed["finished"]
    shared = sweep.card_shared_by()
    if shared > 1:  # its throughput is a shared-card reading, not the setting's solo speed
        tags["card_shared_by"] = shared
    tags.update({f"knob.{k}": fmt(v) for k, v in row.params.items()})
    return {k: str(v) for k, v in tags.items()}
