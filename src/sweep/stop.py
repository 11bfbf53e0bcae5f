"""How a sweep process stops before its trials are done: Ctrl-C, SIGTERM, or a store the engine cannot write (a
full disk) or reach (a tracking server that died). One flag per process (`stopping`): once set, workers ask no new trial, every trial process this
sweep process watches is ended with its group and recorded as killed with the reason, the parent run is closed
KILLED, and the terminal gets one line that says why and how to resume. Trials that finished meanwhile are told
as they finished; any the stores could not take are told from their own records by the next run.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import NamedTuple

from src.redact import redact_text

RESUME = "run the same command again to resume"
SWEEP_LOG = "sweep.log"  # sweeps/<study>/sweep.log: the sweep process's log, the stores' libraries' records with it
_FULL = ("database or disk is full", "no space left on device", "disk quota exceeded")


class Stop:
    """The sweep process's stop: whether it was asked, why, and what the terminal is told."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason = ""  # what stopped the sweep; each trial it ended says so
        self.advice = RESUME
        self.exit_code = 0
        self.signal: int | None = None  # the signal that came, if one did
        self.stopped = 0  # trial processes ended for it
        self.patient = False  # workers run: a signal sets the flag, a second one raises (see workers_running)
        self.log: Path | None = None  # the study's log file, once it holds an error or a traceback (see logged_to)

    def request(self, reason: str, exit_code: int, advice: str = RESUME) -> None:
        """Stop the sweep; the first reason stands (a full disk seen by every worker is one stop)."""
        with self._lock:
            if not self._event.is_set():
                self.reason, self.exit_code, self.advice = reason, exit_code, advice
                self._event.set()

    def interrupted(self) -> None:
        """A signal (or a KeyboardInterrupt) stopped the sweep."""
        sig = signal.Signals(self.signal or signal.SIGINT)
        self.request(f"the sweep was interrupted ({sig.name})", 128 + sig.value)

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep `timeout` seconds, or less if the sweep stops meanwhile."""
        return self._event.wait(timeout)

    def count_stopped(self) -> None:
        with self._lock:
            self.stopped += 1

    @contextmanager
    def workers_running(self) -> Iterator[None]:
        """While the main thread waits for the workers, a signal only sets the flag: each worker ends its trial and
        records it, and the main thread keeps waiting for them (a KeyboardInterrupt raised inside Thread.join can
        mark a live thread as finished: CPython 3.11's _wait_for_tstate_lock). A second signal raises."""
        self.patient = True
        try:
            yield
        finally:
            self.patient = False

    def clear(self) -> None:
        with self._lock:
            self._event.clear()
            self.reason, self.advice, self.exit_code, self.signal, self.stopped = "", RESUME, 0, None, 0
            self.log = None

    def message(self) -> str:
        """The terminal's line: why, what became of the running trials, how to resume (the command, where known)."""
        trials = ""
        if self.stopped:
            trials = f": {self.stopped} running trial{'s' * (self.stopped != 1)} stopped and recorded as killed"
        command = ""
        if sys.argv and sys.argv[0].endswith(os.path.join("src", "train.py")):
            command = ": " + redact_text(shlex.join(["python", "-m", "src.train", *sys.argv[1:]]))
        logged = f"; tracebacks in {self.log}" if self.log else ""
        return f"{self.reason}{trials}{logged}; {self.advice}{command}"


stopping = Stop()  # signals are the process's: one flag for the sweep this process runs


@contextmanager
def on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM stop the sweep (`stopping.interrupted`) and raise KeyboardInterrupt in the main thread,
    unless the workers run (`Stop.workers_running`); the handlers are put back after. A signal the process ignores
    (started with nohup, or in the background of a script) stays ignored; off the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        again = stopping.signal is not None
        stopping.signal = stopping.signal or signum
        stopping.interrupted()
        if again or not stopping.patient:
            raise KeyboardInterrupt

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, interrupt)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def logged_to(study_dir: Path) -> Iterator[None]:
    """While the sweep runs, what MLflow, alembic and SQLAlchemy log goes to `study_dir`/sweep.log, not the terminal
    (src/quiet.py `to_file`; this process's own records go there too): a full disk's store errors are a traceback
    each, and the terminal gets the stop's one line, which names the file when it holds them."""
    import mlflow  # noqa: F401 - it sets its loggers' handlers when imported: first, so that ours stand

    from src import quiet

    with quiet.to_file(study_dir / SWEEP_LOG) as handler:
        try:
            yield
        finally:
            if handler.error_records:
                stopping.log = study_dir / SWEEP_LOG


class Trouble(NamedTuple):
    """Why a sweep stops for its own stores, and what to do before resuming."""

    why: str
    advice: str
    unreachable: bool  # a server that cannot be reached (not a full disk)


def store_trouble(exc: BaseException, stores: dict[str, str]) -> Trouble | None:
    """Why to stop for an error the engine hit in its own stores, or None for any other error: a full disk
    (SQLite's "database or disk is full", ENOSPC), naming the store written to, or a store's server that cannot be
    reached (connection refused, no answer in time: an MLflow tracking server that died; its calls fail fast,
    src/tracking.py FAIL_FAST). `stores`: the top-level package of each store's client ("optuna", "mlflow") -> how
    to name the store; a file is named by its path."""
    chain = _chain(exc)
    full = next((e for e in chain if _is_full(e)), None)
    if full is None:
        gone = next((e for e in chain if _is_unreachable(e)), None)
        if gone is None:
            return None
        where = next((stores[m] for m in _modules(chain) if m in stores), "a store of the sweep")
        return Trouble(
            f"sweep stopped: {where} cannot be reached ({_why_unreachable(gone)})",
            f"start it (or point tracking.uri elsewhere), then {RESUME}",
            unreachable=True,
        )
    detail = os.strerror(full.errno) if isinstance(full, OSError) and full.errno else _FULL[0]
    if isinstance(full, OSError) and full.filename:
        where = str(full.filename)
    else:
        where = next((stores[m] for m in _modules(chain) if m in stores), "a store of the sweep")
    return Trouble(
        f"sweep stopped: disk full: {where} cannot be written ({detail})", f"free space, then {RESUME}", False
    )


def _is_unreachable(exc: BaseException) -> bool:
    """A server that refused the connection or did not answer in time (requests' and urllib3's own errors)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"ConnectionError", "Timeout", "MaxRetryError", "NewConnectionError", "ProtocolError"}:
        return type(exc).__module__.split(".")[0] in ("requests", "urllib3", "builtins")
    return False


def _why_unreachable(exc: BaseException) -> str:
    """A few words: "Connection refused", "Read timed out", ... (the system's reason where there is one)."""
    import re

    text = str(exc)
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip()
    if "timed out" in text.lower() or "Timeout" in type(exc).__name__:
        return "no answer in time"
    return (text.strip().splitlines() or [type(exc).__name__])[0][:200]


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _is_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(words in str(exc).lower() for words in _FULL)


def _modules(chain: list[BaseException]) -> Iterator[str]:
    """Top-level packages of the frames the error passed through, innermost first."""
    for exc in chain:
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_globals.get("__name__", ""))
            tb = tb.tb_next
        for name in reversed(frames):
            yield name.split(".")[0]
