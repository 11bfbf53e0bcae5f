"""What one trial shows while it trains: one progress bar (loss, tokens/s, peak memory) on a terminal, and the
trainer's per-step log dicts in the log file, not on the console (transformers' PrinterCallback printed each)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

STEP_LOG = "src.trial.steps"  # the logger of the per-step dicts: the log file only


def install(trainer: Any, meas: Any) -> ProgressBar:
    """Replace the trainer's printer of log dicts with the bar and the file log; returns the bar."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    bar = ProgressBar(meas)
    trainer.add_callback(bar)
    return bar


def _step_log() -> logging.Logger:
    """A logger that writes to the run's log files (Hydra's `<job>.log`) and never to the console."""
    log = logging.getLogger(STEP_LOG)
    log.propagate = False
    log.setLevel(logging.INFO)
    log.handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    return log


class ProgressBar(TrainerCallback):
    """One tqdm bar over the trial's steps with the last loss, tokens/s of the last step and the peak memory so
    far (the card's allocator, or the CPU budget's peak); shown only on a terminal (a sweep's trial logs to a file).
    Every log dict the trainer makes goes to the log file."""

    def __init__(self, meas: Any, file: Any = None) -> None:
        self.meas = meas
        self.file = file or sys.stderr
        self.bar: Any = None
        self.loss: float | None = None
        self.log = _step_log()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, unit="step", file=self.file, disable=None, dynamic_ncols=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is None:
            return
        shown: dict[str, str] = {}
        if self.loss is not None:
            shown["loss"] = f"{self.loss:.3f}"
        last = self.meas.steps[-1] if getattr(self.meas, "steps", None) else None
        if last and last.get("time_s"):
            shown["tok/s"] = f"{last['tokens'] / last['time_s']:.0f}"
        peak = _peak_gib(self.meas)
        if peak is not None:
            shown["peak"] = f"{peak:.2f} GiB"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        logs = logs or {}
        if "loss" in logs:
            self.loss = float(logs["loss"])
        self.log.info("step %d: %s", state.global_step, json.dumps(logs, default=str))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _peak_gib(meas: Any) -> float | None:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / 1024**3
    host = getattr(meas, "host", None)
    return host.peak_gib() if host is not None else None
