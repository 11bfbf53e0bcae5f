"""Shared fixtures: every test writes under its own temporary QLORA_ROOT; the tiny Llama (tokenizer and
weights, built locally, no network) is built once per session in a shared cache and reused."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig

from src.config import PROJECT_DIR, compose

CONF = PROJECT_DIR / "conf"


@pytest.fixture(scope="session", autouse=True)
def _mlflow_init_locks() -> Iterator[None]:
    """MLflow leaves a lock file in the temp dir for every SQLite store it initializes
    (`db_init_lock-<hash of the URL>`); each test's store has its own URL. Remove the ones this session made."""
    import tempfile

    pattern = "db_init_lock-*"
    before = set(Path(tempfile.gettempdir()).glob(pattern))
    yield
    for lock in set(Path(tempfile.gettempdir()).glob(pattern)) - before:
        lock.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def root(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh output root (sweeps/, mlruns/) for one test, with the session's model cache."""
    monkeypatch.setenv("QLORA_ROOT", str(tmp_path))
    monkeypatch.setenv("QLORA_CACHE", str(cache_dir))
    return tmp_path


def compose_cfg(overrides: list[str] | None = None) -> DictConfig:
    """The real config, composed the way `python -m src.train` composes it, Hydra's own node included."""
    return compose(overrides, hydra_config=True)


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


@pytest.fixture
def mlflow_client(root: Path) -> Iterator:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{root}/mlruns/mlflow.db"
    (root / "mlruns").mkdir(exist_ok=True)
    mlflow.set_tracking_uri(uri)
    yield MlflowClient(tracking_uri=uri)
