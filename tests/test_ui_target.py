"""`make ui` as the README tells it: no line per HTTP request, and the plain `mlflow` CLI's stray store ignored."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from src.config import PROJECT_DIR


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_ui_quiets_the_access_log_and_keeps_one_worker() -> None:
    shown = subprocess.run(["make", "-n", "ui"], cwd=PROJECT_DIR, capture_output=True, text=True, check=True).stdout
    command = next(line for line in shown.replace("\\\n", " ").splitlines() if "mlflow ui" in line)
    assert "--workers 1" in command and '--uvicorn-opts "--no-access-log"' in command, command


def test_a_stray_mlflow_db_of_the_plain_cli_is_ignored_by_git() -> None:
    done = subprocess.run(["git", "check-ignore", "-q", "mlflow.db"], cwd=PROJECT_DIR)
    assert done.returncode == 0, "mlflow.db (what the mlflow CLI makes without MLFLOW_TRACKING_URI) is not ignored"
