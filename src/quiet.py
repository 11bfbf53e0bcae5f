"""The one place that silences what libraries say on every trial and sweep when it is harmless and not ours to fix.

Each entry names who says it, the versions it was seen with, and why it can be ignored; what we caused ourselves is
fixed where we cause it instead (checkpointing under its current name: src/config.py, src/models.py). Called first
thing by the trial's and the sweep's entry points (`python -m src.train`), before the libraries are imported.
"""

from __future__ import annotations

import logging
import os
import warnings

# (category, message regex): warnings that every trial would print, each harmless here
_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    # peft 0.21's PeftModel reads `model.is_gradient_checkpointing`, which transformers 5.23 renamed (same value)
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # bitsandbytes 0.50 on a CPU: paging is a CUDA feature; the optimizer is the same one, unpaged
    (UserWarning, r"Paged optimizers are not supported on CPU"),
    # Optuna 5 marks features as experimental (heartbeats, constraints, the GP sampler): ExperimentalWarning, a plain
    # Warning; we use them on purpose
    (Warning, r".*(is experimental \(supported from|is an experimental feature)"),
)
# loggers whose warnings are harmless here, raised to ERROR
_LOGGERS = (
    # bitsandbytes 0.50 on a CPU with AVX512-BF16 tries the optional `kernels` package for a faster 4-bit matmul,
    # and uses its own when it is missing
    "bitsandbytes.backends.cpu.ops",
)
# Progress bars of loading a checkpoint and preparing the data set (huggingface_hub's, which transformers and
# datasets use): a carriage-return line each, per trial, in every trial's log. Set the variable to 0 to see them.
_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def install() -> None:
    """Silence the harmless warnings above for this process (and the processes it starts, through the env)."""
    for category, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)
