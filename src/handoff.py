"""What a trial process and the sweep engine that launched it tell each other: files in the trial's folder and
environment variables. Both sides read the names here; the trial's side of two of them (dying with the engine
that names itself in PARENT_ENV, and its launch time from STARTED_ENV) is here too.
"""

from __future__ import annotations

import contextlib
import os
import signal

RESULT_FILE = "result.json"  # the trial's outcome (status, metrics, failure), written last
PROGRESS_FILE = "progress.json"  # phase, step and time at every step: the engine's stall watchdog reads it
STARTED_ENV = "QLORA_TRIAL_STARTED"  # the launcher's clock at launch (epoch seconds): start-up counts from it
RUN_ENV = "MLFLOW_RUN_ID"  # the MLflow run the engine created for the trial (MLflow's own variable)
TRIAL_ENV = "QLORA_OPTUNA_TRIAL"  # the Optuna trial number
PARENT_ENV = "QLORA_TRIAL_PARENT"  # the engine's pid: the trial dies with it (die_with_parent)
# What Hydra saves under a trial's <run dir>/.hydra/; the trial logs them to its MLflow run as `config/`, whence
# promotion reads them
HYDRA_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def trial_started() -> float:
    """When this trial was launched: the engine's clock at launch (STARTED_ENV, so a forked trial counts its fork
    too), else this process's start. The kernel's process start time is only as exact as its boot time (whole
    seconds), so it can be up to a second early. Here, not in src.measure: a trial's first start-up phase ends
    before it loads the training stack that src.measure imports (torch, transformers' trainer, peft)."""
    launched = os.environ.get(STARTED_ENV)
    if launched:
        with contextlib.suppress(ValueError):
            return float(launched)
    import psutil

    return psutil.Process().create_time()


def die_with_parent(parent: int | None = None) -> None:
    """In the trial's process, first thing: be killed when the process that started it dies (Linux's parent-death
    signal), so that no trial outlives a dead engine. The engine names itself in PARENT_ENV (`parent` for a fork);
    a parent that died before the signal was set is seen here, and the trial ends at once. The variable is
    removed: what the trial starts itself (torchrun's ranks) has a parent of its own."""
    named = os.environ.pop(PARENT_ENV, None)
    parent = parent if parent is not None else (int(named) if named else None)
    if parent is None:
        return  # started by hand: nobody to die with
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the engine's watch still ends its trials
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
