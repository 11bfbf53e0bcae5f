"""A custom search space (hydra.sweeper.custom_search_space) for the fault-taxonomy sweep test: each trial
picks one scenario, and the hook returns the overrides that produce it."""

from __future__ import annotations

from typing import Any

SCENARIOS: dict[str, dict[str, Any]] = {
    "ok": {},
    "oom": {"fault.kind": "oom"},
    "launch_failure": {"fault.kind": "launch_failure"},
    "illegal_memory_access": {"fault.kind": "illegal_memory_access"},
    "device_assert": {"fault.kind": "device_assert"},
    "segfault": {"fault.kind": "segfault"},
    "killed": {"fault.kind": "kill"},
    "timeout": {"fault.kind": "hang"},
    "nan_loss": {"fault.kind": "nan_loss"},
    "data_error": {"data.path": "/nonexistent/clinical.xlsx"},
    "config_error": {"lora.r": "not-a-number"},
}


def fault_scenarios(cfg: Any, trial: Any) -> dict[str, Any]:
    return SCENARIOS[trial.suggest_categorical("scenario", list(SCENARIOS))]
