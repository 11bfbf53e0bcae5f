"""Before any trial, in the engine's main thread: the model (random models) and its 4-bit copy built once, in a
process of its own, so trials only load it and no trial's peak includes the build."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from src.sweep.slots import Slot

log = logging.getLogger(__name__)


def build_model(config: Any, trial_overrides: list[str], fixed: list[str], study_dir: Path, slot: Slot) -> None:
    """Build the model once. Once built (by an earlier sweep, or a trial), nothing is started: a process that
    imports the training stack only to find the files there costs seconds of every sweep."""
    from src import models

    # a probe that changes the model or the paths (model=..., model.dtype=..., paths.cache_dir=...) is prepared
    own = [o for o in trial_overrides if o.lstrip("+~").split("=")[0].split(".")[0] in ("model", "paths")]
    if not own and models.prepared(config.model, config.paths.cache_dir):
        return
    log_dir = study_dir / "prepare"
    cmd = [sys.executable, "-m", "src.models", *trial_overrides, *fixed, f"hydra.run.dir={log_dir}"]
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "prepare.log").open("wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **slot.env}, check=False)
    if done.returncode != 0:
        log.warning(
            "model preparation failed (see %s); each trial will report the problem itself", log_dir / "prepare.log"
        )
