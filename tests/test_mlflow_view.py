"""What a newcomer sees in MLflow: the report as one interactive page on the sweep's parent run, trial runs named by
their knobs and outcome, skipped and parent runs told apart from trials, a saved view of knobs and key metrics,
and `make ui` under 1 GiB of RAM; the page checked in headless Chromium inside MLflow's own artifact view.

The study is made by hand the way the engine records one (Optuna attributes, MLflow runs through SweepRuns with the
composed config as params), with the classes a CPU cannot produce; the report is made by `python -m src.report`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from benchmarks.ui_screenshot import CHROMIUM_FLAGS
from src import report, tracking
from src.config import PROJECT_DIR, compose
from src.sweep.process import stop_process_group
from src.sweep.runs import KIND, VIEW_NAME, SweepRuns, skipped_name, trial_name
from tests.conftest import run_cli
from tests.services import free_port

STUDY = "view"
SPACE = {
    "data.max_seq_length": CategoricalDistribution([256, 512, 1024]),
    "lora.r": CategoricalDistribution([8, 16]),
    "trainer.group_by_length": CategoricalDistribution([True, False]),
}
BUDGET = 24.0
# (params, outcome): outcome is the reserved GiB and tokens/s of a finished trial, a failure kind, or a skip.
TRIALS: list[tuple[tuple[int, int, bool], Any]] = [
    ((256, 8, True), (9.0, 2100.0)),  # 0 stable (the recipe)
    ((512, 8, True), (14.5, 2600.0)),  # 1 stable
    ((1024, 8, True), (22.3, 2900.0)),  # 2 marginal: 7% left
    ((1024, 16, True), "oom"),  # 3 failed: oom at step 1
    ((512, 16, False), (16.0, 2400.0)),  # 4 stable
    ((512, 8, True), ("repeat", 1)),  # 5 skipped: a repeat of 1
    ((1024, 16, False), ("certain_oom", 3)),  # 6 skipped: needs at least trial 3's memory
    ((256, 16, False), "timeout"),  # 7 failed: timeout (FAIL)
]
NAMES = [
    "trial 0 stable: seq=256 r=8 group_len=true",
    "trial 1 stable: seq=512 r=8 group_len=true",
    "trial 2 marginal: seq=1024 r=8 group_len=true",
    "trial 3 oom: seq=1024 r=16 group_len=true",
    "trial 4 stable: seq=512 r=16 group_len=false",
    "skipped (repeat of 1): seq=512 r=8 group_len=true",
    "skipped (certain oom: > trial 3): seq=1024 r=16 group_len=false",
    "trial 7 timeout: seq=256 r=16 group_len=false",
]
MiB = 1024**2


def _record(root: Path) -> None:
    """Study `view` as the sweep engine leaves it: trials in sweeps/view/optuna.db, an experiment with a parent run
    and one child run per trial (the composed config as params, the contract's metrics and tags) in mlruns/."""
    uri = f"sqlite:///{root}/mlruns/mlflow.db"
    runs = SweepRuns(uri, STUDY, root / "mlruns" / "artifacts")
    parent = runs.open_parent(
        None,
        {
            "sweep.search_space": json.dumps({k: repr(v) for k, v in SPACE.items()}),
            "sweep.objectives": json.dumps({"tokens_per_s": "maximize"}),
            "sweep.headroom_margin": json.dumps(0.1),
            "sweep.trial_overrides": json.dumps([]),
            "vram_budget_gib": BUDGET,
        },
    )
    config = tracking.params(OmegaConf.to_container(compose(), resolve=False))
    storage = f"sqlite:///{root}/sweeps/{STUDY}/optuna.db"
    (root / "sweeps" / STUDY).mkdir(parents=True)
    study = optuna.create_study(study_name=STUDY, storage=storage, direction="maximize")
    study.set_user_attr("mlflow_parent_run_id", parent)
    for number, ((seq, r, grouped), outcome) in enumerate(TRIALS):
        params = {"data.max_seq_length": seq, "lora.r": r, "trainer.group_by_length": grouped}
        run_id = runs.child(number, "cuda0")  # as the engine makes it today: no knobs in the name yet
        attrs: dict[str, Any] = {"vram_budget_gib": BUDGET, "mlflow_run_id": run_id, "sweep.slot": "cuda0"}
        state, value, tags, metrics = TrialState.COMPLETE, None, {}, {}
        if isinstance(outcome, tuple) and isinstance(outcome[0], float):
            reserved, speed = outcome
            metrics = {
                "peak_vram_reserved_gib": reserved,
                "peak_vram_allocated_gib": reserved - 1.0,
                "vram_budget_gib": BUDGET,
                "vram_headroom_frac": 1 - reserved / BUDGET,
                "tokens_per_s": speed,
                "step_time_s": 1.5,
            }
            attrs |= {"trial.status": "ok", **metrics}
            value, tags = speed, {"trial.status": "ok"}
        elif isinstance(outcome, tuple):
            why, origin = outcome
            reason = (
                f"same setting as trial {origin}"
                if why == "repeat"
                else f"certain oom: needs at least trial {origin}'s memory"
            )
            tags = {
                "trial.status": "skipped",
                "skip.reason": why,
                "skipped.because_of": origin,
                "skipped.reason": reason,
            }
            attrs |= {**tags, "skipped.because_of": origin}
            state = TrialState.PRUNED
        else:
            failure = {"trial.status": "failed", "failure.kind": outcome, "failure.step": 1, "failure.message": "x"}
            attrs |= failure
            tags = failure
            if outcome == "oom":
                metrics = {"peak_vram_reserved_gib": 23.1, "vram_budget_gib": BUDGET}
                attrs |= {**metrics, "oom_request_gib": 2.0}
                value = 0.0
            else:
                state = TrialState.FAIL
        if tags.get("trial.status") != "skipped":  # a skipped trial launches no process: nothing logs its config
            own = {**config, "trainer.output_dir": f"{root}/sweeps/{STUDY}/trials/{number:03d}/trainer"}
            tracking.log_params(runs.client, run_id, {**own, **{k: str(v) for k, v in params.items()}})
        tracking.log_metrics(runs.client, run_id, metrics)
        tracking.set_tags(runs.client, run_id, tags)
        runs.client.set_terminated(run_id, "FAILED" if tags.get("trial.status") == "failed" else "FINISHED")
        study.add_trial(
            optuna.trial.create_trial(params=params, distributions=SPACE, value=value, state=state, user_attrs=attrs)
        )
    runs.client.set_terminated(parent, "FINISHED")


@pytest.fixture(scope="module")
def viewed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A QLORA_ROOT holding study `view` and its report, made by `python -m src.report view`."""
    root = tmp_path_factory.mktemp("mlflow_view")
    _record(root)
    done = run_cli("src.report", STUDY, root=root)
    assert done.returncode == 0, done.stderr[-4000:]
    (root / "report_stdout.txt").write_text(done.stdout)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _client(root: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")


def _runs(root: Path) -> tuple[Any, Any, list[Any]]:
    """The experiment, its parent run and its trial runs by trial number."""
    client = _client(root)
    experiment = client.get_experiment_by_name(STUDY)
    found = client.search_runs([experiment.experiment_id], max_results=100)
    parent = next(r for r in found if r.data.tags.get(KIND) == "sweep")
    trials = sorted((r for r in found if r is not parent), key=lambda r: int(r.data.tags["optuna.trial"]))
    return experiment, parent, trials


def _without_plotly(page: str) -> str:
    """The page less its one inlined library (plotly.js, the first script)."""
    start = page.index("<script>")
    return page[:start] + page[page.index("</script>", start) :]


# ---- the page ---------------------------------------------------------------------------------------------------------


def test_the_report_page_is_one_file_with_everything_inline_beside_the_study_and_on_the_parent_run(
    viewed: Path,
) -> None:
    page_file = viewed / "sweeps" / STUDY / "report.html"
    page = page_file.read_text()
    assert 1 * MiB < len(page.encode()) < 8 * MiB, "plotly.js inlined once, the data small"
    assert page.count("<script>") >= 2 and "Plotly.newPlot" in page
    rest = _without_plotly(page)
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=|<img[^>]+src=\"?http|@import", rest), "fetches nothing"
    assert "http://" not in rest and "https://" not in rest
    # the map: one cell per (group_len, seq) pair, coloured by the best outcome there
    cells = re.findall(r'<td class="cell (\w+)" data-outcome="\w+" title="([^"]*)">', rest)
    assert len(cells) == 6 and {c for c, _ in cells} >= {"stable", "marginal", "failed"}
    assert "trial 3: failed (oom at step 1)" in " ".join(t for _, t in cells)
    # every trial in the table with its class; peak memory drawn against the 24 GiB budget
    for number, verdict in enumerate(["stable", "stable", "marginal", "failed", "stable", "skipped", "skipped"]):
        assert re.search(rf'<tr class="{verdict}" data-class="{verdict}"( title="[^"]*")?><td>{number}</td>', rest)
    assert "22.30 / 24 GiB (7.1% free)" in rest and "(needed, OOM)" in rest
    _, parent, _ = _runs(viewed)
    logged = {a.path: a.file_size for a in _client(viewed).list_artifacts(parent.info.run_id, "report")}
    assert logged["report/report.html"] == page_file.stat().st_size
    stdout = (viewed / "report_stdout.txt").read_text()
    assert f"page:   {page_file}" in stdout and "viewStateShareKey=" in stdout


def test_the_page_redacts_what_the_study_wrote_and_draws_a_study_without_a_finished_trial(tmp_path: Path) -> None:
    password = "hunter2-" + tmp_path.name
    storage = f"sqlite:///{tmp_path}/secret.db"
    study = optuna.create_study(study_name="secret", storage=storage, direction="maximize")
    failure = {"trial.status": "failed", "failure.kind": "other", "failure.step": 1, "vram_budget_gib": BUDGET}
    message = f"could not connect to postgresql://sweeper:{password}@db-host:5432/optuna"
    for seq in (256, 512):
        params = {"data.max_seq_length": seq, "lora.r": 8, "trainer.group_by_length": True}
        attrs = {**failure, "failure.message": message}
        study.add_trial(
            optuna.trial.create_trial(params=params, distributions=SPACE, state=TrialState.FAIL, user_attrs=attrs)
        )
    written = report.write(report.load("secret", tmp_path / "sweeps", storage=storage))
    page = _without_plotly(next(p for p in written.files if p.suffix == ".html").read_text())
    assert "db-host" in page and password not in page, "the message is shown, its password is not"
    assert "Nothing to draw: no trial finished." in page and page.count('class="cell failed"') == 2


# ---- the runs ---------------------------------------------------------------------------------------------------------


def test_trial_runs_are_named_by_knobs_and_outcome_and_skipped_and_parent_runs_say_what_they_are(viewed: Path) -> None:
    client = _client(viewed)
    experiment, parent, trials = _runs(viewed)
    assert [r.info.run_name for r in trials] == NAMES
    assert [r.data.tags[KIND] for r in trials] == ["trial"] * 5 + ["skipped"] * 2 + ["trial"]
    assert parent.info.run_name == "sweep view: 8 trials, 3 stable, 1 marginal, 2 failed (1 oom, 1 timeout), 2 skipped"
    assert "report.class" not in parent.data.tags and parent.data.tags["report.stable"] == "3"
    assert "report/report.html" in parent.data.tags[tracking.NOTE]
    # the README's filter finds the stable trials and nothing else
    stable = client.search_runs([experiment.experiment_id], "tags.`report.class` = 'stable'")
    assert sorted(r.data.tags["optuna.trial"] for r in stable) == ["0", "1", "4"]
    # a skipped run gets the config it would have run with: a launched trial's, its own knobs and folder
    launched, skipped = trials[1].data.params, trials[6].data.params
    assert set(skipped) == set(launched) and len(skipped) > 50
    knob_keys = ["data.max_seq_length", "lora.r", "trainer.group_by_length"]
    assert sorted(k for k in launched if launched[k] != skipped[k]) == [*knob_keys, "trainer.output_dir"]
    assert [skipped[k] for k in knob_keys] == ["1024", "16", "False"]
    assert skipped["trainer.output_dir"].endswith("/trials/006/trainer")
    repeat = trials[5].data.params  # trial 1's setting again: only its folder differs
    assert repeat == {**launched, "trainer.output_dir": launched["trainer.output_dir"].replace("/001/", "/005/")}


def test_the_experiment_holds_a_saved_view_of_the_knobs_and_key_metrics(viewed: Path) -> None:
    client = _client(viewed)
    experiment, parent, trials = _runs(viewed)
    key = "stability-sweep-knobs-outcome-memory-speed"
    saved = json.loads(experiment.tags[tracking.VIEW_TAG + key])
    assert saved["name"] == VIEW_NAME and saved["updatedAt"] >= saved["createdAt"]
    state = json.loads(saved["state"])
    knobs = ["params.`data.max_seq_length`", "params.`lora.r`", "params.`trainer.group_by_length`"]
    assert state["selectedColumns"][:5] == [*knobs, "metrics.`tokens_per_s`", "metrics.`peak_vram_reserved_gib`"]
    assert "tags.`report.class`" in state["selectedColumns"] and state["orderByKey"] == "metrics.`tokens_per_s`"
    charts = {c["type"]: c for c in state["compareRunCharts"]}
    assert charts["PARALLEL"]["selectedParams"] == [k.split("`")[1] for k in knobs]
    assert charts["SCATTER"]["yaxis"] == {"key": "tokens_per_s", "type": "METRIC"}
    shown = client.search_runs([experiment.experiment_id], state["searchFilter"])
    assert {r.info.run_id for r in shown} == {r.info.run_id for r in trials}, "every trial, not the parent"
    assert f"viewStateShareKey={key}" in experiment.tags[tracking.NOTE]


def test_a_trial_run_can_be_named_by_its_knobs_when_it_is_made(tmp_path: Path) -> None:
    runs = SweepRuns(f"sqlite:///{tmp_path}/mlflow.db", "names", tmp_path / "artifacts")
    runs.open_parent(None, {})
    params = {"lora.r": 16, "data.max_seq_length": 1024, "trainer.gradient_accumulation_steps": 4}
    run_id = runs.child(3, "cuda0", params)
    assert runs.client.get_run(run_id).info.run_name == "trial 3: seq=1024 grad_acc=4 r=16"
    runs.mark_skipped(run_id, 3, params, "certain_oom", 2)
    run = runs.client.get_run(run_id)
    assert (run.info.run_name, run.data.tags[KIND]) == (
        "skipped (certain oom: > trial 2): seq=1024 grad_acc=4 r=16",
        "skipped",
    )
    lever = ["trainer.gradient_checkpointing=true"]
    assert trial_name(0, params, lever, "stable") == "trial 0 stable: seq=1024 grad_acc=4 r=16 +ckpt=true"
    assert skipped_name(9, {}, "predicted_oom", None) == "skipped (predicted oom): trial 9"
    assert runs.client.get_run(runs.child(4, "cpu0")).info.run_name == "trial 4"
    shutil.rmtree(tmp_path / "artifacts", ignore_errors=True)


# ---- make ui, and the page in a browser ---------------------------------------------------------------------------


def _chromium() -> str:
    """Debian's chromium (.ci/run installs it; a test set-up as root installs it if missing), else skip."""
    found = shutil.which("chromium")
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for step in (["update", "-q"], ["install", "-y", "-q", "--no-install-recommends", "chromium"]):
            subprocess.run(["apt-get", *step], env=env, capture_output=True, timeout=900, check=False)
        found = shutil.which("chromium")
    if not found:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    return found


def _tree_rss(pid: int) -> float:
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 1024**3


def _make_ui(root: Path, port: int) -> subprocess.Popen:
    """`make ui` as the Makefile has it, in `root` (so its sqlite:///mlruns/mlflow.db is the study's store), with this
    interpreter's venv and without the install step."""
    venv = Path(sys.executable).parent.parent
    cmd = [
        "make",
        "-s",
        "-f",
        str(PROJECT_DIR / "Makefile"),
        "-o",
        f"{venv}/.installed",
        "ui",
        f"VENV={venv}",
        f"PORT={port}",
    ]
    log = (root / "ui.log").open("wb")
    return subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"make ui exited: {log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} never answered: {log.read_text()[-3000:]}")


def test_make_ui_shows_the_report_page_and_the_saved_view_in_a_browser_under_1_gib(viewed: Path) -> None:
    chromium = _chromium()
    from playwright.sync_api import sync_playwright

    experiment, parent, _ = _runs(viewed)
    port = free_port()
    ui = _make_ui(viewed, port)
    base = f"http://127.0.0.1:{port}"
    profile = viewed / "chromium-profile"
    try:
        _wait_http(f"{base}/health", ui, viewed / "ui.log")
        started = _tree_rss(ui.pid)
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                str(profile),
                executable_path=chromium,
                args=list(CHROMIUM_FLAGS),  # the screenshot script's Chromium, as CI's Debian package runs it
                viewport={"width": 1600, "height": 1000},
            )
            page = browser.new_page()
            # MLflow's own page loads
            page.goto(f"{base}/#/experiments?workflowType=machine_learning")
            page.get_by_text(STUDY, exact=True).first.wait_for(timeout=60_000)
            # the report page in the parent run's artifact view (a sandboxed iframe on a blob: URL)
            route = f"#/experiments/{experiment.experiment_id}/runs/{parent.info.run_id}/artifacts/report/report.html"
            page.goto(f"{base}/{route}?workflowType=machine_learning")
            frame = page.frame_locator("iframe.mlflow-html-iframe")
            frame.locator("#stability-map td.cell").first.wait_for(timeout=60_000)
            frame.locator(".js-plotly-plot .main-svg").first.wait_for(timeout=60_000)
            inside = next(f for f in page.frames if f.url.startswith("blob:"))
            drawn = inside.evaluate(
                """() => ({
                    cells: document.querySelectorAll('#stability-map td.cell').length,
                    plots: document.querySelectorAll('.js-plotly-plot').length,
                    points: document.querySelectorAll('.js-plotly-plot .scatterlayer .point').length,
                    axes: document.querySelectorAll('.js-plotly-plot .parcoords .y-axis').length,
                    rows: document.querySelectorAll('#trials-table tbody tr').length,
                })"""
            )
            assert drawn["cells"] == 6 and drawn["plots"] == 3 and drawn["rows"] == len(TRIALS), drawn
            assert drawn["points"] >= 5 and drawn["axes"] >= 6, drawn  # markers drawn; knobs, outcome, metrics
            inside.locator('.class-filter[value="skipped"]').uncheck()  # the table's class filter works
            assert inside.locator("#trials-table tbody tr:visible").count() == len(TRIALS) - 2
            # the saved view: trials only, by knob and metric
            key = "stability-sweep-knobs-outcome-memory-speed"
            runs_page = f"{base}/#/experiments/{experiment.experiment_id}/runs"
            page.goto(f"{runs_page}?workflowType=machine_learning&viewStateShareKey={key}")
            page.get_by_text(NAMES[0]).first.wait_for(timeout=60_000)
            page.locator('[col-id="params.`data.max_seq_length`"]').first.wait_for(timeout=30_000)
            assert page.get_by_text("sweep view:").count() == 0, "the parent run is filtered out"
            browser.close()
        opened = _tree_rss(ui.pid)
        assert started < 1.0 and opened < 1.0, f"make ui holds {started:.2f} GiB, {opened:.2f} GiB after the pages"
    finally:
        stop_process_group(ui)
        shutil.rmtree(profile, ignore_errors=True)
