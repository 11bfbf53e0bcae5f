"""The MLflow UI over a study's store, driven in headless Chromium: a picture of the sweep's experiment page
(each trial a child run with its knobs, metrics, report class and failure kind) for the README.

    make demo && .venv/bin/python -m benchmarks.ui_screenshot      # the README's picture: the demo's own store
    python -m benchmarks.ui_screenshot [--root DIR] [--study NAME] [--out docs/mlflow_compare.png]

By default it shows what `make demo` left in this checkout (study `demo`: `sweeps/demo/`, `mlruns/mlflow.db`), the
map a newcomer gets, OOMs included; it refuses a study without a failure, whose picture would not show one.

The UI is started the way `make ui` starts it (`mlflow ui --backend-store-uri sqlite:///<root>/mlruns/mlflow.db
--host 127.0.0.1 --workers 1`, no job runner), on a free port. Debian's `chromium` (flags from ../shared/SERVICES.md, a fresh profile) is
driven over the DevTools protocol: the page's own saved view state (localStorage) is set to what a person would
click: the "Model training" workflow, the sweep's parent run expanded, the knobs / metrics / class as columns,
the assistant panel closed. The server and the browser are stopped whatever happens; exits non-zero when the
UI never answers or the picture is blank.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
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
from typing import Any

from src import knobs, report
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
METRICS = ("tokens_per_s", "step_time_s", "peak_vram_reserved_gib", "vram_headroom_frac", "peak_rss_gib")
TAGS = ("report.class", "failure.kind")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> bytes:
    """The body of `url` once it answers 200 (polling), or an error when `proc` dies or time runs out."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return answer.read()
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")


def stop(proc: subprocess.Popen) -> None:
    """End the server or browser and everything it spawned (mlflow ui starts job workers)."""
    stop_process_group(proc, grace_s=10.0)


class DevTools:
    """The few Chrome DevTools Protocol calls this needs, over aiohttp's websocket (MLflow brings aiohttp)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def js(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")


def view_state(experiment_id: str, parent_run_id: str | None, knobs: list[str]) -> dict[str, str]:
    """The MLflow UI's own saved state (its localStorage keys, MLflow 3.17) for the view we want to show."""
    columns = [f"tags.`{t}`" for t in TAGS] + [f"params.`{k}`" for k in knobs] + [f"metrics.`{m}`" for m in METRICS]
    page = {
        "searchFilter": "",
        "orderByKey": "attributes.start_time",
        "orderByAsc": True,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "datasetsFilter": [],
        "modelVersionFilter": "All Runs",
        "selectedColumns": columns,
        "columnOrder": [],
        "columnWidths": {},
        "runsExpanded": {parent_run_id: True} if parent_run_id else {},
        "runsPinned": [],
        "runsHidden": [],
        "runsVisibilityMap": {},
        "runsHiddenMode": "FIRST_10_RUNS",
        "viewMaximized": False,
        "runListHidden": False,
        "isAccordionReordered": False,
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
        "groupBy": None,
        "groupsExpanded": {},
        "autoRefreshEnabled": False,
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }
    return {
        "mlflow.workflowType_v1": json.dumps("machine_learning"),
        "mlflow.assistant.panelOpen_v1": "false",
        "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
        f"MLflowLocalStorage-1.1-ExperimentView-{experiment_id}-expandRows": "true",
        f'MLflowLocalStorage-1.1-ExperimentPage-["{experiment_id}"]-ReactComponentState': json.dumps(page),
    }


async def _capture(
    devtools_url: str, origin: str, url: str, state: dict[str, str], out: Path, size: tuple[int, int], marker: str
):
    import aiohttp

    targets = json.loads(urllib.request.urlopen(f"{devtools_url}/json/list", timeout=5).read())
    ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        page = DevTools(ws)
        await page.call(
            "Emulation.setDeviceMetricsOverride", width=size[0], height=size[1], deviceScaleFactor=1, mobile=False
        )
        await page.call("Page.navigate", url=f"{origin}/health")  # same origin: its localStorage is the UI's
        await asyncio.sleep(1.0)
        await page.js(
            f"(() => {{ const s = {json.dumps(state)}; for (const k in s) localStorage.setItem(k, s[k]); }})()"
        )
        await page.call("Page.navigate", url=url)
        for _ in range(60):  # the runs table is there once a trial's row (its run name) renders
            await asyncio.sleep(0.5)
            if await page.js(f"document.body && document.body.innerText.includes({json.dumps(marker)})"):
                break
        await asyncio.sleep(2.0)  # let columns settle
        shot = await page.call("Page.captureScreenshot", format="png")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(shot["data"]))


def screenshot(
    origin: str, url: str, state: dict[str, str], out: Path, marker: str, size: tuple[int, int] = (1920, 1000)
) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise RuntimeError("chromium is not installed (Debian: apt-get install -y chromium)")
    port = free_port()
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={port}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            devtools = f"http://127.0.0.1:{port}"
            wait_for(f"{devtools}/json/version", browser, timeout_s=30)
            asyncio.run(_capture(devtools, origin, url, state, out, size, marker))
        finally:
            stop(browser)


def main(argv: list[str] | None = None) -> int:
    from matplotlib.image import imread
    from mlflow.tracking import MlflowClient

    p = argparse.ArgumentParser(prog="python -m benchmarks.ui_screenshot", description=__doc__.splitlines()[0])
    root = Path(os.environ.get("QLORA_ROOT", PROJECT_DIR))
    p.add_argument("--root", type=Path, default=root, help="holds sweeps/ and mlruns/ (default: where make demo wrote)")
    p.add_argument("--study", default="demo", help="default: demo, the study `make demo` runs")
    p.add_argument("--out", type=Path, default=PROJECT_DIR / "docs" / "mlflow_compare.png")
    args = p.parse_args(argv)
    root = args.root.resolve()
    store = f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    sweep = report.load(args.study, root / "sweeps", tracking_uri=store)
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name(sweep.name)
    if experiment is None:
        print(f"error: no MLflow experiment '{sweep.name}' in {store}", file=sys.stderr)
        return 1
    if not any(r.verdict == "failed" for r in sweep.rows):
        print(f"error: study '{sweep.name}' has no failed trial: the picture would show no failure", file=sys.stderr)
        return 1
    trial_runs = [r.run_id for r in sweep.rows if r.run_id]
    if not trial_runs:
        print(f"error: study '{sweep.name}' names no MLflow run for its trials", file=sys.stderr)
        return 1
    marker = client.get_run(trial_runs[0]).info.run_name  # whatever the engine names its runs
    varying = sweep.varying_knobs()  # registered knobs first, in the registry's order
    registered = set(knobs.keys())
    shown = [k for k in varying if k in registered] or varying
    state = view_state(experiment.experiment_id, sweep.parent_run_id, shown)
    port = free_port()
    origin = f"http://127.0.0.1:{port}"
    url = f"{origin}/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "ui", "--backend-store-uri", store]
        + ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(f"{origin}/health", server, timeout_s=240)  # a busy 2-core machine takes minutes to start it
        screenshot(origin, url, state, args.out, marker)
    finally:
        stop(server)
    pixels = imread(args.out)
    if pixels.reshape(-1, pixels.shape[-1]).std(axis=0).max() < 0.01:
        print(f"error: {args.out} is blank", file=sys.stderr)
        return 1
    print(f"saved {args.out}: experiment '{sweep.name}' ({len(sweep.rows)} trials) at {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
