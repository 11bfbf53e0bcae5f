"""What one trial shows while it trains: one progress bar (loss, tokens/s, peak memory) on a terminal, and the
trainer's per-step log dicts in the log file, not on the console (transformers' PrinterCallback printed each)."""

from __future__ import annotations

import json
import logging
import sys
import time
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
    far (the card's allocator, or the CPU budget's peak) on a terminal; elsewhere (output to a file: a sweep's trial,
    a production run under nohup) the same as a line every `line_every_s`. Every log dict the trainer makes goes to
    the log file."""

    def __init__(self, meas: Any, file: Any = None, line_every_s: float = 30.0) -> None:
        self.meas = meas
        self.file = file or sys.stderr
        self.bar: Any = None
        self.loss: float | None = None
        self.log = _step_log()
        self.line_every_s = line_every_s
        self._last_line: float | None = None
        self._began = time.time()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from tqdm.auto import tqdm

        # a resumed run's bar starts at its checkpoint's step
        self.bar = tqdm(
            total=state.max_steps,
            initial=state.global_step,
            unit="step",
            file=self.file,
            disable=None,
            dynamic_ncols=True,
        )
        self._began = time.time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is None:
            return
        shown = self._shown()
        if self.bar.disable:  # not a terminal
            self._line(state, shown)
            return
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(state.global_step - self.bar.n)

    def _line(self, state: Any, shown: dict[str, str]) -> None:
        now, last = time.time(), state.global_step >= state.max_steps
        if self._last_line is not None and now - self._last_line < self.line_every_s and not last:
            return
        self._last_line = now
        what = ", ".join(f"{k} {v}" for k, v in shown.items())
        elapsed = int(now - self._began)
        print(
            f"step {state.global_step}/{state.max_steps}: {what}{', ' if what else ''}{elapsed // 60}m{elapsed % 60:02d}s",
            file=self.file,
            flush=True,
        )

    def _shown(self) -> dict[str, str]:
        shown: dict[str, str] = {}
        if self.loss is not None:
            shown["loss"] = f"{self.loss:.3f}"
        last = self.meas.steps[-1] if getattr(self.meas, "steps", None) else None
        if last and last.get("time_s"):
            shown["tok/s"] = f"{last['tokens'] / last['time_s']:.0f}"
        peak = _peak_gib(self.meas)
        if peak is not None:
            shown["peak"] = f"{peak:.2f} GiB"
        return shown

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
