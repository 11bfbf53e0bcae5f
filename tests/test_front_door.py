"""The front door: what `python -m src.train [-m]`, `src.report` and `src.promote` refuse before they create or
contact anything, each in one line that names the key (issue 17: Hydra's basic sweeper, items 2 and 5; credentials
in a store's URI and stores that do not answer, item 3; stores that cannot be written, item 11)."""

from __future__ import annotations

import os
import random
import shutil
import socket
import string
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
import pytest

from tests.conftest import run_cli, sweep_argv

SWEEP = sweep_argv(study="door")


def _secret(prefix: str) -> str:
    return prefix + "".join(random.choice(string.ascii_letters) for _ in range(24))


def _refusal(done: subprocess.CompletedProcess) -> str:
    """The command was refused in one line, `error: ...`, without a traceback; that line."""
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-4000:]
    return errors[0]


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _nowhere(secret: str, root: Path, *outputs: subprocess.CompletedProcess) -> None:
    """`secret` is in no file under `root` (every byte, SQLite databases included) and on no terminal."""
    for path in _files(root):
        assert secret.encode() not in path.read_bytes(), f"leaked into {path.relative_to(root)}"
    for done in outputs:
        assert secret not in done.stdout + done.stderr, "reached the terminal"


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens: a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Listener:
    """A TCP port on 127.0.0.1 that accepts connections, never answers and counts them: whatever is sent to it
    shows up in `connections`, and a client that reaches it waits for an answer that never comes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.connections.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def listener() -> Iterator[_Listener]:
    server = _Listener()
    yield server
    server.close()


def _study_with_parent(root: Path, name: str) -> None:
    """A study in sweeps/<name>/optuna.db whose parent MLflow run the report and promotion would look up."""
    (root / "sweeps" / name).mkdir(parents=True)
    storage = f"sqlite:///{root}/sweeps/{name}/optuna.db"
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    study.set_user_attr("mlflow_parent_run_id", "0123456789abcdef")


# ---- Hydra's basic sweeper (items 2 and 5) ----------------------------------------------------------------------


@pytest.mark.parametrize("sweeper", [[], ["hydra/sweeper=basic"]], ids=["default", "by-name"])
def test_hydras_basic_sweeper_is_refused_before_it_writes_or_prints_anything(root: Path, sweeper: list[str]) -> None:
    """Hydra's basic sweeper runs the jobs one after another in this process, ends the command at the first failing
    job, writes every override to sweeps/multirun/multirun.yaml, prints them in its launch line and overwrites
    trials/0/ on the next run. It is refused, pointing to hydra/sweeper=optuna, before any of that."""
    token = _secret("hf_")
    done = run_cli(
        "src.train",
        "-m",
        *sweeper,
        "lora.r=-1,4",
        f"data.system_prompt='Answer briefly. {token}'",
        root=root,
        timeout=300,
    )
    line = _refusal(done)
    assert "hydra/sweeper=optuna" in line and "basic sweeper is not supported" in line
    assert not (root / "sweeps").exists() and not (root / "mlruns").exists()
    _nowhere(token, root, done)


# ---- credentials in a store's URI (item 3) ---------------------------------------------------------------------

_WITH_PASSWORD = {  # command, the key the message names
    "trial": (["src.train", "tracking.uri={http}"], "tracking.uri"),
    "sweep": ([*SWEEP, "tracking.uri={http}"], "tracking.uri"),
    "sweep-storage": ([*SWEEP, "hydra.sweeper.storage={pg}"], "hydra.sweeper.storage"),
    "report": (["src.report", "door", "--tracking-uri", "{http}"], "--tracking-uri"),
    "report-storage": (["src.report", "door", "--storage", "{pg}"], "--storage"),
    "promote": (["src.promote", "door", "--tracking-uri", "{http}"], "--tracking-uri"),
}


@pytest.mark.parametrize("case", list(_WITH_PASSWORD))
def test_a_password_in_a_store_uri_is_refused_before_the_store_is_contacted(
    root: Path, listener: _Listener, case: str
) -> None:
    """The store is a port that counts connections: none is made. The password is nowhere, terminal included."""
    password = _secret("pw-")
    http = f"http://alice:{password}@127.0.0.1:{listener.port}"
    pg = f"postgresql://alice:{password}@127.0.0.1:{listener.port}/optuna"
    _study_with_parent(root, "door")
    command, key = _WITH_PASSWORD[case]
    done = run_cli(*(a.format(http=http, pg=pg) for a in command), root=root, timeout=90)
    line = _refusal(done)
    assert line.startswith(f"error: {key} holds a password inside a URI. Credentials never go"), line
    assert "MLFLOW_TRACKING_PASSWORD" in line and "PGPASSWORD" in line
    assert listener.connections == []
    assert not (root / "mlruns").exists() and [p.name for p in _files(root / "sweeps" / "door")] == ["optuna.db"]
    _nowhere(password, root, done)


# ---- stores that do not answer (item 3) ----------------------------------------------------------------------

_UNREACHABLE = {  # command, the key the message names, what cannot be reached
    "trial": (["src.train", "tracking.uri={http}"], "tracking.uri", "the MLflow tracking store"),
    "sweep": ([*SWEEP, "tracking.uri={http}"], "tracking.uri", "the MLflow tracking store"),
    "sweep-storage": ([*SWEEP, "hydra.sweeper.storage={pg}"], "hydra.sweeper.storage", "the Optuna"),
    "report": (["src.report", "door", "--tracking-uri", "{http}"], "--tracking-uri", "the MLflow tracking store"),
    "report-storage": (["src.report", "--storage", "{pg}"], "--storage", "the Optuna storage"),
    "promote": (["src.promote", "door", "--tracking-uri", "{http}"], "--tracking-uri", "the MLflow tracking store"),
    "promote-storage": (["src.promote", "--storage", "{pg}"], "--storage", "the Optuna storage"),
}


@pytest.mark.parametrize("case", list(_UNREACHABLE))
def test_an_unreachable_store_fails_fast_in_one_line_naming_the_key(root: Path, case: str) -> None:
    """Nothing listens on the port: one line naming the key within seconds, where MLflow's client retried for
    minutes and a database driver printed a page of traceback; nothing was created."""
    port = _closed_port()
    http, pg = f"http://127.0.0.1:{port}", f"postgresql://alice@127.0.0.1:{port}/optuna"
    _study_with_parent(root, "door")
    command, key, what = _UNREACHABLE[case]
    started = time.monotonic()
    done = run_cli(*(a.format(http=http, pg=pg) for a in command), root=root, timeout=90)
    line = _refusal(done)
    assert line.startswith(f"error: {key}: {what}") and "cannot be reached" in line and str(port) in line, line
    assert time.monotonic() - started < 60
    assert not (root / "mlruns").exists() and [p.name for p in _files(root / "sweeps" / "door")] == ["optuna.db"]


def test_an_mlflow_server_that_never_answers_is_given_up_after_a_few_seconds(root: Path, listener: _Listener) -> None:
    """It accepts the connection and says nothing: one probe with a short timeout, not MLflow's minutes."""
    started = time.monotonic()
    done = run_cli("src.train", f"tracking.uri=http://127.0.0.1:{listener.port}", root=root, timeout=90)
    line = _refusal(done)
    assert line.startswith("error: tracking.uri: the MLflow tracking store") and "no answer within" in line, line
    assert time.monotonic() - started < 60 and len(listener.connections) == 1


# ---- stores that cannot be written (item 11) -------------------------------------------------------------------


@contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """`folder` made read-only for this process: chmod for a user, `chattr +i` for root (whom modes do not stop).
    Skipped where neither makes a write fail."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        undo = ["chmod", "755", str(folder)]
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        undo = ["chattr", "-i", str(folder)]
    else:
        pytest.skip("root without chattr +i here: no way to make a folder read-only")
    try:
        try:
            (folder / "probe").touch()
        except OSError:
            pass
        else:
            pytest.skip(f"{folder} stayed writable")
        yield
    finally:
        subprocess.run(undo, check=True)


_READ_ONLY = {  # the folder made read-only, command, what the message names
    "mlruns-sweep": ("mlruns", [*SWEEP], ["tracking.uri", "paths.mlruns_dir"]),
    "mlruns-trial": ("mlruns", ["src.train"], ["tracking.uri", "paths.mlruns_dir"]),
    "sweeps-sweep": ("sweeps", [*SWEEP], ["hydra.sweeper.storage", "paths.sweeps_dir"]),
}


@pytest.mark.parametrize("case", list(_READ_ONLY))
def test_a_store_that_cannot_be_written_is_named_before_anything_is_created(root: Path, case: str) -> None:
    """A read-only mlruns/ (or sweeps/): the store, its path and the keys that point at it, in one line; no empty
    Optuna study or MLflow database left behind."""
    folder, command, keys = _READ_ONLY[case]
    with _read_only(root / folder):
        done = run_cli(*command, root=root, timeout=120)
    line = _refusal(done)
    assert "cannot be written" in line and str(root / folder) in line, line
    for key in keys:
        assert key in line, line
    assert not [p for p in _files(root) if p.suffix == ".db"] and not (root / "sweeps" / "door").exists()
