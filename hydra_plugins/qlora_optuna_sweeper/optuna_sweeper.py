"""`hydra/sweeper=optuna`, on current Optuna: the registration Hydra discovers, and nothing heavy.

Hydra imports every module under `hydra_plugins` at start-up, so this file only declares the config
schema and a Sweeper that hands the work to `src.sweep` (imported when a sweep actually starts).
Keys follow hydra-optuna-sweeper's (sampler, direction, storage, study_name, n_trials, n_jobs, params,
custom_search_space) so its users keep their configs; the rest are ours (see conf/hydra/sweeper/optuna.yaml).
No `from __future__ import annotations` here: Hydra executes plugin modules outside sys.modules, where
dataclasses cannot resolve string annotations.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.qlora_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    _recursive_: bool = False  # the engine builds the sampler itself (a grid needs the search space first)
    sampler: Any = None
    direction: Any = "maximize"
    objectives: Any = "tokens_per_s"
    storage: str | None = None
    study_name: str = "sweep"
    n_trials: int = 16
    n_jobs: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    default_params: dict[str, Any] = field(default_factory=dict)
    custom_search_space: str | None = None
    enqueue_trials: list[Any] = field(default_factory=list)
    trial_overrides: list[str] = field(default_factory=list)
    devices: list[int] | None = None
    gpus_per_trial: int = 1
    slots_per_gpu: int = 1
    cpu_slots: int = 2
    trial_timeout_s: float = 3600.0
    stall_timeout_s: float = 600.0
    launch_blocking_rerun: bool = True
    retry_failed_trials: bool = False
    heartbeat_interval_s: int = 10
    grace_period_s: int = 60
    headroom_margin: float = 0.10
    skip_duplicates: bool = True
    memory_monotone: dict[str, str] = field(default_factory=dict)
    preload: Any = False
    progress: bool = True


ConfigStore.instance().store(group="hydra/sweeper", name="optuna_schema", node=OptunaSweeperConf, provider="qlora")


class OptunaSweeper(Sweeper):
    def __init__(self, **_: Any) -> None:
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config

    def sweep(self, arguments: list[str]) -> None:
        from src.sweep import SweepEngine

        assert self.config is not None
        SweepEngine(self.config, arguments).run()
