"""Custom search spaces (hydra.sweeper.custom_search_space) for the sweep tests that run real trials: each trial
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


def rank_follows_length(cfg: Any, trial: Any) -> None:
    """hydra-optuna-sweeper's style: suggest, return nothing; the suggestions are the overrides."""
    if trial.suggest_categorical("data.max_seq_length", [512, 2048]) > 1024:
        trial.suggest_categorical("lora.r", [8, 16])  # long rows: only the rank varies
    else:
        trial.suggest_categorical("trainer.per_device_train_batch_size", [4, 8])  # short rows: the batch
