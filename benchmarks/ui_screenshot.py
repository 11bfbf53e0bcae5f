"""The MLflow UI over a study's store, in headless Chromium: the README's picture of a sweep (docs/mlflow_compare.png),
opened on the sweep's own saved view (its trials by knob, with their class, failure kind, memory and speed).

    python -m benchmarks run ui_screenshot        # a fresh CPU demo study, then this (benchmarks/suites/ui_screenshot.yaml)
    python -m benchmarks.ui_screenshot [--root DIR] [--study demo] [--out docs/mlflow_compare.png]

By default it shows what `make demo` left in this checkout (study `demo`: sweeps/demo/, mlruns/mlflow.db); it refuses a
study without a failure, whose picture would show none. The UI starts as `make ui` starts it (no job runner, one
worker) on a free port; Debian's chromium is driven by playwright, as tests/test_mlflow_view.py drives it, with the
flags of ../shared/SERVICES.md and a fresh profile. The server and the browser are stopped whatever happens; it exits
non-zero when the UI never answers or the picture is blank.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from src import report, tracking
from src.config import PROJECT_DIR
from src.sweep.process import stop_process_group

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
# What a person would have clicked once: the "Model training" layout, MLflow's assistant panel closed (MLflow 3.17)
UI_STATE = {"mlflow.workflowType_v1": json.dumps("machine_learning"), "mlflow.assistant.panelOpen_v1": "false",
            "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until `url` answers 200; an error when `proc` dies or time runs out."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")


def shoot(origin: str, url: str, out: Path, marker: str, size: tuple[int, int] = (1920, 1000)) -> None:
    """The page at `url` once a trial's row (`marker`, its run name) is drawn, as a PNG at `out`."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise RuntimeError("chromium is not installed (Debian: apt-get install -y chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            profile, executable_path=chromium, args=list(CHROMIUM_FLAGS), viewport={"width": size[0], "height": size[1]}
        )
        try:
            page = browser.new_page()
            page.goto(f"{origin}/health")  # the UI's origin: its localStorage is the UI's
            page.evaluate("s => { for (const k in s) localStorage.setItem(k, s[k]); }", UI_STATE)
            page.goto(url)
            page.get_by_text(marker).first.wait_for(timeout=90_000)
            page.wait_for_timeout(2_000)  # columns and charts settle
            page.screenshot(path=str(out))
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    from matplotlib.image import imread
    from mlflow.tracking import MlflowClient

    p = argparse.ArgumentParser(prog="python -m benchmarks.ui_screenshot", description=__doc__.splitlines()[0])
    root = Path(os.environ.get("QLORA_ROOT", PROJECT_DIR))
    p.add_argument("--root", type=Path, default=root, help="holds sweeps/ and mlruns/ (default: where make demo wrote)")
    p.add_argument("--study", default="demo", help="default: demo, the study `make demo` runs")
    p.add_argument("--out", type=Path, default=PROJECT_DIR / "docs" / "mlflow_compare.png")
    args = p.parse_args(argv)
    store = f"sqlite:///{args.root.resolve() / 'mlruns' / 'mlflow.db'}"
    sweep = report.load(args.study, args.root.resolve() / "sweeps", tracking_uri=store)
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name(sweep.name)
    views = [
        k[len(tracking.VIEW_TAG) :] for k in (experiment.tags if experiment else {}) if k.startswith(tracking.VIEW_TAG)
    ]
    runs = [r.run_id for r in sweep.rows if r.run_id]
    problem = (
        f"no MLflow experiment '{sweep.name}' in {store}" if experiment is None
        else f"study '{sweep.name}' has no failed trial: the picture would show no failure"
        if not any(r.verdict == "failed" for r in sweep.rows)
        else f"study '{sweep.name}' names no MLflow run for its trials" if not runs
        else f"experiment '{sweep.name}' has no saved view: run python -m src.report {args.study}" if not views
        else None
    )  # fmt: skip
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    port = free_port()
    origin = f"http://127.0.0.1:{port}"
    url = f"{origin}/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={views[0]}"
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "ui", "--backend-store-uri", store, "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(f"{origin}/health", server, timeout_s=240)  # a busy 2-core machine takes minutes to start it
        shoot(origin, url, args.out, client.get_run(runs[0]).info.run_name)
    finally:
        stop_process_group(server, grace_s=10.0)
    pixels = imread(args.out)
    if pixels.reshape(-1, pixels.shape[-1]).std(axis=0).max() < 0.01:
        print(f"error: {args.out} is blank", file=sys.stderr)
        return 1
    print(f"saved {args.out}: experiment '{sweep.name}' ({len(sweep.rows)} trials), its saved view {views[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
