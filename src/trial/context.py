"""What one trial holds while it runs (`TrialContext`), and its MLflow run's opening: the run the engine created for
it or a new one (`open_run`), what the run says of the trial before training (`describe`: params, config, system
tags) and the preflight's findings (`check`). A single trial and a data-parallel trial's parent go through the same
functions; a data-parallel rank has no run (its context's client is None: only the parent records).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from src import tracking
from src.config import to_container
from src.failures import ConfigError, DataError
from src.handoff import HYDRA_FILES, RUN_ENV, trial_started

if TYPE_CHECKING:
    import cProfile

    from src.measure import AttentionProbe, Measurements, StepProfiler


@dataclass
class TrialContext:
    """One trial's run and what it built, kept for the outcome even when training raises (src.trial.single.record
    reads it)."""

    client: Any = None  # the MlflowClient of the trial's run; None in a data-parallel rank (the parent records)
    run_id: str = ""
    rank_dir: Path | None = None  # a data-parallel rank's own folder (its progress file, result and traceback)
    meas: Measurements | None = None  # the trainer's measurements (src.measure), once training is being set up
    budget: dict[str, float] = field(default_factory=dict)  # what the memory budget set (src.measure.memory.budget)
    phases: dict[str, float] = field(default_factory=dict)  # startup.<phase>_s, in the order they ended (`mark`)
    phases_end_s: float | None = None  # when the last phase ended, in seconds since the trial's launch
    trainer: Any = None  # the SFTTrainer, once built
    attention: AttentionProbe | None = None  # which attention kernels a step ran
    profiler: StepProfiler | None = None  # measure.profile_step's profile of one step
    startup_profiler: cProfile.Profile | None = None  # measure.profile_startup's profile of the start-up
    # A data-parallel trial's parent: the figures its ranks measured (merged) and the kernel rank 0 saw.
    metrics: dict[str, float] = field(default_factory=dict)
    attention_tag: str | None = None
    # An attempt of a single run (src/trial/supervised.py): its checkpoints, resume point and ledger; None for a
    # sweep's probe and a data-parallel trial.
    attempt: Any = None
    fault: Any = None  # the FaultInjector (src/faults.py), once the callbacks are built

    def mark(self, phase: str) -> None:
        """End a start-up phase: its duration in seconds, since the previous phase ended (the first: since the
        trial's launch), as the metric `startup.<phase>_s`. The phases add up to the start-up so far; `startup_s` is
        the whole start-up, launch to first step, and `startup.train_begin_s` (set by `record`) what the trainer did
        before it."""
        now = time.time() - trial_started()
        self.phases[f"startup.{phase}_s"] = now - (self.phases_end_s or 0.0)
        self.phases_end_s = now

    def kernel(self) -> str | None:
        """The attention kernels the trial ran (tag `attention.kernel`): its probe's, or its rank 0's."""
        return self.attention.tag if self.attention is not None else self.attention_tag

    # What the trial writes to its run; nothing where it has none (a data-parallel rank).

    def log_text(self, text: str, name: str) -> None:
        if self.client is not None:
            tracking.log_text(self.client, self.run_id, text, name)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        if self.client is not None:
            tracking.log_metrics(self.client, self.run_id, metrics)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.client is not None:
            tracking.set_tags(self.client, self.run_id, tags)

    def log_artifacts(self, local_dir: Path, path: str) -> None:
        if self.client is not None:
            self.client.log_artifacts(self.run_id, str(local_dir), path)


def open_run(cfg: DictConfig) -> tuple[Any, str]:
    """The run the engine created for this trial (handoff.RUN_ENV), or a new one for a single trial."""
    from mlflow.tracking import MlflowClient

    tracking.setup(cfg.tracking.uri)
    client = MlflowClient()
    run_id = os.environ.get(RUN_ENV)
    if run_id:
        client.update_run(run_id, status="RUNNING")
    else:
        exp = tracking.experiment_id(cfg.tracking.experiment, str(Path(cfg.paths.mlruns_dir) / "artifacts"))
        run_id = client.create_run(exp, tags={"mlflow.runName": f"{cfg.model.name}-trial"}).info.run_id
    return client, run_id


def describe(cfg: DictConfig, ctx: TrialContext, out_dir: Path, **tags: Any) -> None:
    """What the run says of the trial before it trains: the composed config as params (flattened, secrets
    redacted) and as artifacts, the system's tags, the model's name and `tags`. A re-run on the same run
    (CUDA_LAUNCH_BLOCKING) keeps the first's params. Ends the start-up phases `log_params` and `torch_and_cuda`."""
    if not ctx.client.get_run(ctx.run_id).data.params:
        tracking.log_params(ctx.client, ctx.run_id, tracking.params(to_container(cfg)))
        log_config(ctx.client, ctx.run_id, cfg, out_dir)
    ctx.mark("log_params")
    system = tracking.system_tags()  # imports torch and creates the CUDA context (device properties)
    ctx.mark("torch_and_cuda")
    ctx.set_tags({**system, "model.name": cfg.model.name, **tags})


def log_config(client: Any, run_id: str, cfg: DictConfig, out_dir: Path) -> None:
    """The trial's composed config as artifacts `config/<name>`, so a run alone says how to repeat it: the files
    Hydra saved under `<out_dir>/.hydra/` (already redacted by src.redact's callback), else the config itself."""
    for name in HYDRA_FILES:
        saved = out_dir / ".hydra" / name
        if saved.exists():
            text = saved.read_text()
        elif name == "config.yaml":  # composed without Hydra's run dir: unresolved, as Hydra would have saved it
            text = OmegaConf.to_yaml(cfg)
        else:
            continue
        tracking.log_text(client, run_id, text, f"config/{name}")  # redacted again


def check(cfg: DictConfig, ctx: TrialContext) -> None:
    """Refuse a trial before any GPU work (ConfigError, DataError); the run keeps what preflight found either way
    (preflight.txt and its tags)."""
    from src import preflight

    try:
        report = preflight.run(cfg)
    except (ConfigError, DataError) as exc:
        found = getattr(exc, "report", None)  # none when the data could not even be read
        if found is not None:
            ctx.log_text(found.to_text(), "preflight.txt")
            ctx.set_tags(found.tags())
        raise
    ctx.log_text(report.to_text(), "preflight.txt")
    ctx.set_tags(report.tags())
