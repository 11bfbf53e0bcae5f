"""The one place that silences what libraries say on every trial and sweep when it is harmless and not ours to fix,
and that sends what the stores' libraries say during a sweep to the study's log file instead of the terminal.

Each entry names who says it, the versions it was seen with, and why it can be ignored; what we caused ourselves is
fixed where we cause it instead (checkpointing under its current name: src/config.py, src/models.py). Called first
thing by the trial's and the sweep's entry points (`python -m src.train`), before the libraries are imported.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

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


# The stores' libraries: while a sweep runs, everything they log goes to the study's log file, not the terminal. A
# full disk made MLflow log each failed write with its traceback (mlflow.store.db.utils, ERROR): 180 lines before the
# sweep's own one line (#30.21); alembic and SQLAlchemy speak for the same stores.
# MLflow gives "mlflow", "sqlalchemy.engine" and "alembic" handlers of their own when it is imported (mlflow 3.18
# utils/logging_utils.py `_configure_mlflow_loggers`): import it before `to_file`.
STORE_LOGGERS = ("mlflow", "alembic", "sqlalchemy", "sqlalchemy.engine")


class LogFile(logging.FileHandler):
    """A log file that never troubles the terminal: opened (its folder made) at its first record, and a record it
    cannot write (the full disk it may be reporting) dropped instead of logging's "--- Logging error ---" page, with
    the file's buffer: closing a file whose buffered write the disk refused raised that write's `OSError: [Errno 28]`
    (a 38-line traceback in place of the sweep's stop line, #47.15). The next record opens it again.
    `error_records`: records at ERROR or with a traceback that it did write."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, delay=True, encoding="utf-8")
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.setLevel(logging.INFO)
        self.error_records = 0
        self._lost = False  # the record being written could not be

    def emit(self, record: logging.LogRecord) -> None:
        self._lost = False
        try:
            Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
            super().emit(record)
        except OSError:
            self._lost = True
        if self._lost:
            self._drop()
        elif record.levelno >= logging.ERROR or record.exc_info:
            self.error_records += 1

    def handleError(self, record: logging.LogRecord) -> None:
        self._lost = True

    def close(self) -> None:
        self.acquire()
        try:
            self._drop()
        finally:
            self.release()
        super().close()

    def _drop(self) -> None:
        """Close the file, letting go of what it could not write (its descriptor is closed all the same)."""
        stream, self.stream = self.stream, None
        if stream is not None:
            with suppress(OSError):
                stream.close()


@contextmanager
def to_file(path: Path) -> Iterator[LogFile]:
    """While it lasts: the stores' libraries (STORE_LOGGERS) log to `path` only, and this process's own records go
    there too (besides wherever they went). Their handlers are put back after."""
    handler = LogFile(path)
    kept = {}
    for name in STORE_LOGGERS:
        logger = logging.getLogger(name)
        kept[name] = (logger.handlers[:], logger.propagate)
        logger.handlers, logger.propagate = [handler], False
    root = logging.getLogger()
    # A root logger without handlers prints warnings through logging.lastResort, which this file would replace
    terminal = [logging.lastResort] if not root.handlers and logging.lastResort is not None else []
    for added in (*terminal, handler):
        root.addHandler(added)
    try:
        yield handler
    finally:
        for added in (*terminal, handler):
            root.removeHandler(added)
        for name, (handlers, propagate) in kept.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        handler.close()
