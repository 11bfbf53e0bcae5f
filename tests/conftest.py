"""Shared fixtures and how the suite shares its expensive set-up.

- Every test writes under its own temporary QLORA_ROOT (`root`); the tiny Llama (tokenizer and weights, built
  locally, no network) is built once per run in a cache shared by every pytest-xdist worker (`cache_dir`; the
  build holds a file lock, src/models.py).
- `compose_cfg` composes each distinct override list once per process and hands out copies: composing costs about
  a second, a copy a few milliseconds. The copy resolves `${oc.env:...}` (QLORA_ROOT...) when read, as a fresh
  compose would.
- The real services (tests/services.py: PostgreSQL, the MLflow server on it, SLURM) are fixtures for every file.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). So that each expensive thing is
still made once, the scheduler below gives one worker every test that uses a service (group `services`: one
PostgreSQL, one SLURM), one worker every test of a file with a module-scoped fixture (a real sweep shared by the
file's tests), in file order, and an `xdist_group` mark's tests to one worker; the rest are spread test by test,
the longest first. A new test file needs nothing for this. While tests run on workers, each result line says how
long its test took, and a line every minute without a result names the tests still running.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import DictConfig

from src.config import PROJECT_DIR, compose

# Under `make test`'s workers, each worker's processes (its own torch, its sweeps' trials, the ranks they start) get
# the worker's share of the cores, as torchrun gives each rank: more threads than cores busy-wait against each other,
# and a one-slot sweep's trial beside the other worker's tests took 1.6 s a step instead of 0.3. A sweep's CPU slots
# then take this setting (src/sweep/slots.py: the user's OMP_NUM_THREADS wins).
_WORKERS = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
if _WORKERS and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(_WORKERS)))
    # torch.compile's inductor compiles its C++ kernels in a pool of worker processes, one per core, started for the
    # one compiled test: on a worker's share of two cores the pool's start-up cost ~10 CPU-s more than it saved
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

pytest_plugins = ["tests.services"]  # the fixtures postgres, tracking_server, cluster

CONF = PROJECT_DIR / "conf"
# Overrides for a test's real sweep of the tiny Llama (`python -m src.train -m hydra/sweeper=optuna ...`): a probe
# of 4 steps instead of the sweep's 8 (measure.warmup_steps=2 leaves 2 measured; training is most of a CPU trial's
# time), no soak (minutes of training per setting: a test of the soak asks for one) and no progress bar in the
# captured output. Trials are forked from a warm interpreter (hydra.sweeper.preload, on by default): a forked trial
# here costs ~7 CPU-seconds, a fresh interpreter ~18, most of it imports.
FAST_SWEEP = [
    "hydra.sweeper.progress=false",
    "hydra.sweeper.soak_top_k=0",
    "hydra.sweeper.trial_overrides=['trainer.max_steps=4','trainer.warmup_steps=0']",
]


def sweep_argv(*overrides: str, study: str | None = None, fast: bool = False) -> list[str]:
    """A sweep's command after `python -m`, as a user types it: `src.train -m hydra/sweeper=optuna`, `overrides`,
    the study's name (when given) and no progress bar (the test captures the output); `fast`: FAST_SWEEP's short
    trials and no soak. For `run_cli(*sweep_argv(...), ...)` or `[sys.executable, "-m", *sweep_argv(...), ...]`:
    what comes after overrides these (Hydra's last value of a key wins)."""
    named = [f"hydra.sweeper.study_name={study}"] if study is not None else []
    usual = FAST_SWEEP if fast else ["hydra.sweeper.progress=false"]
    return ["src.train", "-m", "hydra/sweeper=optuna", *overrides, *named, *usual]


# ---- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache of this run: under pytest-xdist, one for all workers (their temp dirs share a parent)."""
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cache"
    cache.mkdir(exist_ok=True)
    return cache


@pytest.fixture
def root(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh output root (sweeps/, mlruns/) for one test, with the session's model cache."""
    monkeypatch.setenv("QLORA_ROOT", str(tmp_path))
    monkeypatch.setenv("QLORA_CACHE", str(cache_dir))
    return tmp_path


_composed: dict[tuple[str, ...], DictConfig] = {}


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    """The real config, composed the way `python -m src.train` composes it, Hydra's own node included; a copy of
    the first composition of the same overrides in this process."""
    key = tuple(overrides or [])
    if key not in _composed:
        _composed[key] = compose(list(key), hydra_config=True)
    return copy.deepcopy(_composed[key])


def run_cli(
    module: str, *args: str, root: Path, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run one of the contract's commands (`python -m src.<module> ...`) as a user would, in the project dir."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=PROJECT_DIR,
        env={**os.environ, "QLORA_ROOT": str(root), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_main(
    main: Any, argv: list[str], root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> tuple[int, str, str]:
    """A command's `main(argv)` (`src.report.main`, `src.promote.main`) in this process, from QLORA_ROOT=root:
    (exit code, stdout, stderr). For tests whose claim is not the command line; others start it (`run_cli`)."""
    monkeypatch.setenv("QLORA_ROOT", str(root))
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_trial_here(root: Path, overrides: list[str]) -> dict[str, Any]:
    """One trial (`src.trial.single.run`: preflight, training, its MLflow run and result.json) in this process, in
    `root`/trial: the command's own path without an interpreter's start-up (~12 CPU-s of imports). Returns the
    outcome."""
    from src.trial import single

    out = root / "trial"
    return single.run(compose([*overrides, f"trainer.output_dir={out / 'trainer'}"]), out)


def empty_store_file(cache: Path) -> Path:
    """An MLflow SQLite store with nothing in it but its tables, made once per run in the run's model cache `cache`
    (under pytest-xdist, once for all workers) and copied where a test's store goes: MLflow makes a new store by
    running its schema migrations, ~1 CPU-second each time (3.5 in a fresh interpreter), and the copy is the file
    those migrations make (its Default experiment's folder is the project's mlruns/0, as for any store made from
    the project directory)."""
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    path = cache / "mlflow-empty.db"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            partial = path.with_name(path.name + ".partial")
            partial.unlink(missing_ok=True)
            cwd = Path.cwd()
            os.chdir(PROJECT_DIR)
            try:
                MlflowClient(tracking_uri=f"sqlite:///{partial}").search_experiments()
            finally:
                os.chdir(cwd)
            partial.rename(path)
    return path


@pytest.fixture(scope="session")
def empty_store(cache_dir: Path) -> Path:
    """empty_store_file of this run's model cache."""
    return empty_store_file(cache_dir)


def new_store(root: Path, empty_store: Path) -> str:
    """`root`'s MLflow store (root/mlruns/mlflow.db, where every command of the project puts it), as MLflow would
    make it; its URI."""
    (root / "mlruns").mkdir(exist_ok=True)
    db = root / "mlruns" / "mlflow.db"
    if not db.exists():
        shutil.copyfile(empty_store, db)
    return f"sqlite:///{db}"


@pytest.fixture
def mlflow_client(root: Path, empty_store: Path) -> Iterator:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = new_store(root, empty_store)
    mlflow.set_tracking_uri(uri)
    yield MlflowClient(tracking_uri=uri)


# ---- one worker for what is made once (pytest-xdist) -------------------------------------------------------------
# xdist's own `--dist loadgroup` reads `xdist_group` marks through a node id suffix that pytest 9.2 no longer
# honours (pytest-dev/pytest-xdist#1386: every test is spread as if unmarked). So the workers write each test's group
# to a file and the controller's scheduler (xdist's LoadScopeScheduling with our scopes) reads it.

SERVICES_MODULE = "tests.services"
_GROUPS_KEY = "qlora_groups_file"  # in each worker's workerinput: where it writes {node id: group}
_groups_file = pytest.StashKey[Path]()


def _group(item: pytest.Item) -> str | None:
    """An explicit `xdist_group` mark's name; `services` for a test that uses a fixture of tests/services.py; the
    file's path for a test that uses a module-scoped fixture; None for a test that shares nothing expensive."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    # item._fixtureinfo: the fixtures the test uses with their definitions (pytest 8-9.2; no public equivalent)
    definitions = [defs[-1] for defs in item._fixtureinfo.name2fixturedefs.values() if defs]
    if any(getattr(d.func, "__module__", "") == SERVICES_MODULE for d in definitions):
        return "services"
    if any(d.scope in ("module", "package", "class") for d in definitions):
        return item.nodeid.split("::")[0]
    return None


def slow_seconds(item: pytest.Item) -> float:
    """About how long the test takes in `make test`, as its mark says: `slow(seconds=N)`; a `slow` mark without
    seconds, 10; no mark, 0."""
    mark = item.get_closest_marker("slow")
    return 0.0 if mark is None else float(mark.kwargs.get("seconds", 10))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or _GROUPS_KEY not in workerinput:
        return  # not on a worker of `make test`: nothing to schedule
    groups = {item.nodeid: _group(item) for item in items}
    path = Path(workerinput[_GROUPS_KEY])
    mine = path.with_name(f"{path.name}.{workerinput['workerid']}")
    mine.write_text(json.dumps({nodeid: group for nodeid, group in groups.items() if group}))
    mine.replace(path)  # every worker writes the same map; the controller reads it once all have collected

    # Longest first, so the last minutes are short tests on both workers, not one worker alone on a long one: the
    # services, then each other group (xdist then orders the groups by their number of tests, biggest first), then
    # the tests that share nothing, by the seconds their `slow` mark says, longest first. File order is kept within
    # each (sorted() is stable), so a group's tests run in their file's order. Every worker sorts alike: xdist
    # requires one collection order.
    def rank(item: pytest.Item) -> tuple[int, float]:
        group = groups[item.nodeid]
        if group == "services":
            return (0, 0.0)
        return (1, 0.0) if group else (2, -slow_seconds(item))

    items[:] = sorted(items, key=rank)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist, on the controller: tell each worker where to write its groups."""
    node.workerinput[_GROUPS_KEY] = str(node.config.stash[_groups_file])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: each group is one unit of work for one worker, in order; every other test is a unit."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    path = config.stash[_groups_file]

    class SharedSetupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # first called once every worker has collected (and written the file)
                self.groups = json.loads(path.read_text()) if path.exists() else {}
            return self.groups.get(nodeid, nodeid)

    return SharedSetupScheduling(config, log)


# ---- progress while tests run on workers ------------------------------------------------------------------------


class _StillRunning:
    """Under pytest-xdist a test's line appears when it ends; after `every_s` without one, this names the tests
    that are running and for how long, so a long sweep is not a silent minute."""

    def __init__(self, terminal: pytest.TerminalReporter, every_s: float = 60.0) -> None:
        self.terminal, self.every_s = terminal, every_s
        self.running: dict[str, float] = {}
        self.last = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()
        threading.Thread(target=self._watch, name="still-running", daemon=True).start()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        with self.lock:
            self.running[nodeid] = time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        with self.lock:
            self.running.pop(nodeid, None)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.last = time.monotonic()

    def pytest_unconfigure(self) -> None:
        self.done.set()

    def _watch(self) -> None:
        while not self.done.wait(5):
            now = time.monotonic()
            with self.lock:
                running = sorted(self.running.items(), key=lambda kv: kv[1])
            if running and now - self.last >= self.every_s:
                self.last = now
                names = ", ".join(f"{nodeid} ({_minutes(now - started)})" for nodeid, started in running)
                self.terminal.write_line(f"still running: {names}")
                self.terminal.flush()  # a CI log is a pipe: without this the line waits for the next result


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


@pytest.hookimpl(trylast=True)  # after pytest's own pytest_configure has made the terminal reporter
def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") == "no" or hasattr(config, "workerinput"):
        return  # a plain run, or a worker
    config.stash[_groups_file] = Path(tempfile.mkdtemp(prefix="qlora-xdist-")) / "groups.json"
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:
        config.pluginmanager.register(_StillRunning(terminal), "still-running")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _groups_file in config.stash:
        shutil.rmtree(config.stash[_groups_file].parent, ignore_errors=True)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config) -> tuple | None:
    """In verbose output, how long each test took: `PASSED 12.3s`."""
    if report.when != "call" or config.getoption("verbose") <= 0 or getattr(report, "wasxfail", None):
        return None
    word = {"passed": "PASSED", "failed": "FAILED"}.get(report.outcome)
    if word is None:
        return None
    letter = "." if report.passed else "F"
    return report.outcome, letter, (f"{word} {report.duration:.1f}s", {"green" if report.passed else "red": True})


# ---- MLflow's init locks ------------------------------------------------------------------------------------------

_LOCKS = "db_init_lock-*"  # one per SQLite store MLflow initializes, in the temp dir: each test's store has its own
_locks_before = pytest.StashKey[set]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the run's own process (the controller under xdist)
        session.config.stash[_locks_before] = set(Path(tempfile.gettempdir()).glob(_LOCKS))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the init locks this run left, once every worker has finished; not one another process holds."""
    before = session.config.stash.get(_locks_before, None)
    if before is None:
        return
    for lock in set(Path(tempfile.gettempdir()).glob(_LOCKS)) - before:
        try:
            with lock.open("r") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: another process is initializing its store
                lock.unlink(missing_ok=True)
        except OSError:
            pass
