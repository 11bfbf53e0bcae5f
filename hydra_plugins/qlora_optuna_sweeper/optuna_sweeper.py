"""`hydra/sweeper=optuna`, on current Optuna: the registration Hydra discovers, and nothing heavy.

Hydra imports every module under `hydra_plugins` at start-up, so this file only declares the config
schema and a Sweeper that hands the work to `src.sweep.engine` (imported when a sweep actually starts).
Keys follow hydra-optuna-sweeper's (sampler, direction, storage, study_name, n_trials, n_jobs, params,
custom_search_space) so its users keep their configs; the rest are ours (see conf/hydra/sweeper/optuna.yaml).
No `from __future__ import annotations` here: Hydra executes plugin modules outside sys.modules, where
dataclasses cannot resolve string annotations.
"""

import sys
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig

from src.knobs import memory_directions


@dataclass
class OptunaSweeperConf:
    """Types only: every value is set in conf/hydra/sweeper/optuna.yaml (documented there), except the knobs'
    memory rules, whose home is src/knobs.py."""

    _target_: str = "hydra_plugins.qlora_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    _recursive_: bool = False  # the engine builds the sampler itself (a grid needs the search space first)
    sampler: Any = None  # the defaults list picks one (hydra/sweeper/sampler=tpe)
    direction: Any = MISSING
    objectives: Any = MISSING
    storage: str | None = MISSING
    study_name: str = MISSING
    n_trials: int = MISSING
    n_jobs: int | None = MISSING
    params: dict[str, Any] = MISSING
    default_params: dict[str, Any] = MISSING
    custom_search_space: str | None = MISSING
    enqueue_trials: list[Any] = MISSING
    trial_overrides: list[str] = MISSING
    devices: list[int] | None = MISSING
    gpus_per_trial: int = MISSING
    slots_per_gpu: int = MISSING
    cpu_slots: int = MISSING
    trial_timeout_s: float = MISSING
    stall_timeout_s: float = MISSING
    startup_timeout_s: float = MISSING
    launch_blocking_rerun: bool = MISSING
    retry_failed_trials: bool = MISSING
    heartbeat_interval_s: int = MISSING
    grace_period_s: int = MISSING
    headroom_margin: float = MISSING
    skip_duplicates: bool = MISSING
    max_skips_in_a_row: int = MISSING
    memory_monotone: dict[str, str] = field(default_factory=memory_directions)
    preload: Any = MISSING
    progress: bool = MISSING
    memory_model: str = MISSING
    soak_top_k: int = MISSING
    soak_minutes: float = MISSING
    recommend_trials: int = MISSING
    speed_trials: int = MISSING
    same_model_steps: int = MISSING
    timing_repeats: int = MISSING
    promote_different_optimisation: bool = MISSING


ConfigStore.instance().store(group="hydra/sweeper", name="optuna_schema", node=OptunaSweeperConf, provider="qlora")


class OptunaSweeper(Sweeper):
    def __init__(self, **_: Any) -> None:
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config

    def sweep(self, arguments: list[str]) -> None:
        from src.stores import StoreError
        from src.sweep.engine import SweepEngine
        from src.sweep.slots import SlotsError
        from src.sweep.space import SpaceError

        assert self.config is not None
        try:
            SweepEngine(self.config, arguments).run()
        except (SpaceError, StoreError, SlotsError) as exc:  # refused before anything was recorded: one line
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(getattr(exc, "exit_code", 1))  # 2: settings every trial would refuse, as a single run exits


class OptunaSweeperOnly(Callback):
    """Hydra callback (hydra.callbacks.optuna_sweeper_only in conf/train.yaml): `-m` sweeps with this sweeper only.

    Hydra's basic sweeper would run the jobs one after another in this process, end the command at the first
    failing job, save every override to sweeps/multirun/multirun.yaml, print them in its launch line, and overwrite
    trials/0/ on the next run. Hydra calls this before it builds the sweeper: nothing has run, been written or
    printed. (A callback's exception is only a warning to Hydra, so this exits.)
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.sweeper.get("_target_") != OptunaSweeperConf._target_:
            sys.exit(
                "error: `python -m src.train -m` sweeps with hydra/sweeper=optuna only: add hydra/sweeper=optuna to "
                "the command (a list such as lora.r=4,8 becomes a choice of the search space, and each job a trial "
                "in its own process, recorded in sweeps/<study>/ and MLflow). Hydra's basic sweeper is not "
                "supported: it runs the jobs in this process, stops at the first failing one and overwrites "
                "sweeps/multirun/. Nothing was run or written."
            )
