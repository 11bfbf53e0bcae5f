"""The soak's stopping rule, inside the trial: at least one whole epoch of the data and at least `measure.soak_minutes`
(src/sweep/soak.py runs the soak and judges it)."""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback


class SoakStop(TrainerCallback):
    def __init__(self, minutes: float) -> None:
        self.seconds = minutes * 60
        self.started = time.monotonic()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if (state.epoch or 0) >= 1 and time.monotonic() - self.started >= self.seconds:
            control.should_training_stop = True
