"""The memory model in the sweep: every trial's setting gets a predicted peak before it is launched (recorded on the
trial and its run, so the report sets it against what was measured); a setting predicted beyond the budget even if
the model over-predicts by the most it was seen to (its `error_over`) is not launched (`skipped`, reason
`predicted_oom`); on a grid, the settings nearest the budget's edge are queued first.

`hydra.sweeper.memory_model`: `auto` fits the model to the measured trials of this stack in the MLflow store (the
sweep's own included, refitted as they finish) and skips only once at least `MIN_POINTS` were measured; `predict`
records predictions and never skips; `off` does neither; a path names a fitted model (`python -m src.fit --save`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from src.fit.calibration import MIN_POINTS, calibrated, configured, current_stack, vocab_fallback
from src.fit.model import MemoryModel, Prediction
from src.fit.setting import Setting, peak_batch
from src.sweep.space import SpaceError

log = logging.getLogger(__name__)
MODES = ("auto", "predict", "off")


class MemoryGate:
    def __init__(self, config: DictConfig, mode: str, lengths: np.ndarray | None, budget: float) -> None:
        self.mode = str(mode)
        if self.mode not in MODES and not Path(self.mode).exists():
            raise SpaceError(
                f"hydra.sweeper.memory_model={self.mode!r}: use one of {', '.join(MODES)} or the path of a fitted "
                "model (python -m src.fit --save model.json)"
            )
        self.base = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        self.tracking_uri = str(config.tracking.uri)
        self.model_name = str(config.model.name)
        self.lengths = lengths
        self.budget = budget
        self.lock = threading.Lock()
        self.model: MemoryModel | None = None
        self.note = ""
        self.fitted_on = -1
        self.stack: dict[str, str] | None = None  # this machine's, asked once at the first fit
        if self.mode not in MODES:
            self.model, self.note = MemoryModel.load(Path(self.mode)), f"fitted model {self.mode}"

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def refresh(self, measured: int) -> None:
        """Refit from the store when trials were measured since the last fit (`measured`: the study's count)."""
        if self.mode != "auto" or measured == self.fitted_on:
            return
        with self.lock:
            if measured == self.fitted_on:
                return
            try:
                if self.fitted_on < 0:
                    self.stack = current_stack()
                self.model, self.note = calibrated(self.tracking_uri, self.model_name, self.stack)
            except Exception as exc:  # the model must never stop a sweep: predictions are then first principles
                log.warning("memory model: calibration failed (%s); first principles instead", exc)
                self.model, self.note = MemoryModel(), "first principles (calibration failed)"
            self.fitted_on = measured

    def setting(self, overrides: list[str]) -> Setting | None:
        """The trial's setting: the sweep's config with the trial's dotted overrides applied; None where that
        config cannot be built here (a value of the wrong type: the trial itself reports it as config_error)."""
        try:
            return Setting.from_config(configured(self.base, overrides), vocab_fallback=vocab_fallback(self.base))
        except Exception as exc:  # no prediction; the trial still runs and says what is wrong
            log.debug("memory model: no setting for %s (%s)", overrides, exc)
            return None

    def predict(self, overrides: list[str]) -> Prediction | None:
        if not self.active:
            return None
        s = self.setting(overrides)
        if s is None:
            return None
        model = self.model or MemoryModel()
        return model.predict(s, peak_batch(self.lengths, s))

    def describes_device(self) -> bool:
        """Whether its predictions describe what a trial here measures: a fitted model's file, or a GPU (first
        principles or calibrated); not a CPU, whose trials measure the process's own memory, not VRAM."""
        if self.mode not in MODES:
            return True
        if self.mode == "auto" and self.fitted_on < 0:
            self.refresh(0)
        return self.active and (self.stack is not None or (self.fitted_on < 0 and current_stack() is not None))

    def decides(self) -> bool:
        """Whether its predictions may decide what the sweep launches (skips, the card's shares): a fitted model's
        file, or `auto` fitted to at least MIN_POINTS measured trials of a GPU's stack (a CPU's trials hold no
        VRAM); `predict` and `off` never decide."""
        if self.mode in ("predict", "off") or self.model is None:
            return False
        return self.mode != "auto" or (self.stack is not None and self.model.points >= MIN_POINTS)

    def skips(self, prediction: Prediction | None) -> bool:
        """Beyond the budget even if the model over-predicts by its `error_over`, from a model that may decide."""
        return prediction is not None and self.decides() and prediction.certainly_over(self.budget)

    def share_of(self, prediction: Prediction | None) -> float:
        """The card memory (GiB) a trial may take, for the trials that share its card (src/sweep/ledger.py): its
        predicted peak reserved with its CUDA context (its cache included even under expandable segments: a trial
        gives its cache back to its own allocations, not to another process's) plus the most the model
        under-predicts, from a model that may decide, never more than its budget (the card it stands in for, CUDA
        context included); the budget where no such prediction exists."""
        if prediction is None or not self.decides():
            return self.budget
        return min(self.budget, prediction.reserved_gib * (1 + prediction.error) + prediction.context_gib)

    def edge_order(self, grid: list[dict[str, Any]], fixed: list[str]) -> list[dict[str, Any]]:
        """Grid points, nearest the budget's edge first (predicted on the card / budget closest to 1)."""

        def distance(params: dict[str, Any]) -> float:
            pred = self.predict([*fixed, *(f"{k}={v}" for k, v in params.items())])
            return abs(pred.device_gib / self.budget - 1) if pred else float("inf")

        return sorted(grid, key=distance)


def predicted_attrs(prediction: Prediction) -> dict[str, float]:
    """What a trial records of its prediction (user attrs and MLflow metrics)."""
    return {
        "predicted_peak_vram_reserved_gib": prediction.reserved_gib,
        "predicted_peak_vram_device_gib": prediction.device_gib,  # what the card must hold (needed + context)
        "predicted_error_frac": prediction.error,
    }
