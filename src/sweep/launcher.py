"""How a trial's process starts: a fresh interpreter (`python -m src.train ...`), or a fork of a warm one.

A fresh interpreter imports torch, transformers, peft, trl, mlflow... for every trial: 20-25 s of a trial's
~30 s start-up on the H200 image (benchmarks/results/import_profile_h200.json). With `hydra.sweeper.preload`
naming modules, trials are started by multiprocessing's forkserver, which imported those modules once: every
trial is still a new OS process in a session of its own, with its own CUDA context, killed and classified the
same way; only the imported code is shared (copy-on-write).

Only modules that leave CUDA alone on import may be preloaded: a process forked after CUDA was initialized
cannot use it. bitsandbytes reads the device's compute capability as it loads (and peft, trl's trainer and
`transformers.Trainer` import it); `src.sweep.warm` imports them with that question answered by NVML instead. The
forkserver asks torch about GPUs through NVML (PYTORCH_NVML_BASED_CUDA_CHECK=1), and before the first trial a
probe child checks that CUDA was not initialized before the fork and still works after it; if not, trials
start as fresh interpreters, with a warning.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from src.handoff import PARENT_ENV, die_with_parent

log = logging.getLogger(__name__)

# Safe to preload (none creates a CUDA context; src.sweep.warm imports bitsandbytes, peft and trl without one);
# missing ones are skipped. What those import in turn comes with them: trl's torchvision and sklearn where they are
# installed (the GPU image), nothing of the kind on a CPU machine, whose trials never import them.
DEFAULT_PRELOAD = (
    "torch",
    "torch._dynamo",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "accelerate",
    "datasets",
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",  # the SQLite store's SQLAlchemy and alembic: ~0.6 s a trial
    "pandas",
    "hydra",
    "src.config",
    "src.redact",
    "src.tracking",
    "src.data",
    "src.models",
    "src.failures",
    "src.sweep.warm",
)
_TRACKER_QUIET = "ignore:resource_tracker:UserWarning"  # its "There appear to be N leaked semaphore objects" warning
_lock = threading.Lock()
_context: Any = None  # the forkserver context once it proved safe, False once it did not
_spawned = False  # begin() started the forkserver


class ForkedTrial:
    """A forked trial with the part of `subprocess.Popen` the engine uses (pid, poll, wait, returncode)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("trial", timeout or 0)
        return self.process.exitcode


def begin(preload: list[str]) -> None:
    """Start the forkserver importing `preload` now, without waiting for it: the engine's own checks run meanwhile
    (on a CPU the imports take ~10 s). Call it from the engine's main thread: the forkserver dies with the thread
    that started it (src/sweep/tether.py), and a slot's thread ends before the engine does."""
    global _spawned
    with _lock:
        if _context is None and not _spawned and sys.platform == "linux":
            _spawn(preload)
            _spawned = True


def forkserver(preload: list[str]) -> Any:
    """The forkserver context with `preload` imported, or None where forking a warm interpreter is unsafe."""
    global _context
    with _lock:
        if _context is None:
            _context = _start(preload)
        return _context or None


def _spawn(preload: list[str]) -> Any:
    # Inherited by the forkserver (and the trials): torch.cuda.is_available() then asks NVML, not the driver.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    # multiprocessing's resource tracker starts with the forkserver and serves the trials forked from it: it removes
    # the semaphores a killed trial leaves behind (joblib's, in /dev/shm), and says so in a warning on the sweep's
    # terminal as the sweep ends. A trial killed on purpose (a timeout, a hang, Ctrl-C) is no leak to report. The
    # tracker takes its warning filters from this process's -W options when it starts.
    if _TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_QUIET)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["src.sweep.tether", *preload])
    # Started from the main thread, the forkserver dies with it (src/sweep/tether.py): its lifetime is the engine's.
    # Started from another thread, it is left to notice the engine's end by itself.
    tethered = threading.current_thread() is threading.main_thread()
    if tethered:
        os.environ[PARENT_ENV] = str(os.getpid())
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if tethered:
            os.environ.pop(PARENT_ENV)
    return ctx


def _start(preload: list[str]) -> Any:
    if sys.platform != "linux":
        log.warning("hydra.sweeper.preload needs Linux (fork); trials start as fresh interpreters")
        return False
    ctx = multiprocessing.get_context("forkserver") if _spawned else _spawn(preload)
    probe = ctx.Process(target=_probe, name="preload-probe")
    probe.start()  # once the forkserver has imported `preload`
    probe.join(300)
    if probe.exitcode != 0:
        if probe.exitcode is None:
            probe.kill()
        log.warning(
            "hydra.sweeper.preload: a child forked from the preloaded interpreter cannot use CUDA (probe exit %s; "
            "a preloaded module initialized CUDA); trials start as fresh interpreters",
            probe.exitcode,
        )
        return False
    return ctx


def _probe() -> None:
    import torch

    if torch.cuda._is_in_bad_fork():  # the forkserver had initialized CUDA: this child cannot use it
        sys.exit(4)
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()


def start(ctx: Any, argv: list[str], stdout: Path, stderr: Path, env: dict[str, str]) -> ForkedTrial:
    """Fork `python -m src.train argv` from the forkserver: same output files, environment and exit codes."""
    process = ctx.Process(target=_trial_main, args=(argv, str(stdout), str(stderr), env), name="trial")
    process.start()
    return ForkedTrial(process)


def child_setup() -> None:
    """In a forked trial: its own session (killed as one group), and death when its parent (the forkserver, which
    dies with the engine) dies."""
    parent = os.getppid()
    os.setsid()
    _leave_the_forkserver()
    die_with_parent(parent)


def _leave_the_forkserver() -> None:
    """multiprocessing hands each forked child the write end of the forkserver's "alive" pipe, so that the server
    lives while any of its clients does. A trial starts no forked children of its own, and holding that end kept
    the forkserver alive after the engine died, and the trial with it (its parent-death signal waits for the
    forkserver): a SIGKILLed sweep left its trials training. Dropped here, the forkserver exits with the engine and
    the trial with the forkserver; a forkserver the trial might ask for later would be a new one of its own."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the module's one ForkServer (no public handle on the inherited pipe)
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        server._forkserver_address = None


def _own_threads(env: dict[str, str]) -> None:
    """The slot's share of the cores (OMP_NUM_THREADS) for torch's thread pool. A fresh interpreter reads it as
    torch loads; a fork inherits the pool the forkserver sized for the whole machine, and trials at once then run
    more busy-waiting threads than there are cores: each CPU step took 6x as long (1.48 s against 0.24 s)."""
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def _trial_main(argv: list[str], stdout: str, stderr: str, env: dict[str, str]) -> None:
    """In the forked trial: what `python -m src.train` would be, in its own session, output to its files."""
    import runpy

    child_setup()  # own session (killed as a group), dies with its parent
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.enable(file=sys.stderr)  # what PYTHONFAULTHANDLER gives a fresh interpreter
    os.environ.update(env)
    _own_threads(env)
    sys.argv = [str(Path(__file__).parent.parent / "train.py"), *argv]
    try:
        runpy.run_module("src.train", run_name="__main__", alter_sys=True)
    finally:
        # A forked child leaves with os._exit: flush what atexit would have.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
