"""One trial of the tiny Llama shows one progress bar (on a terminal), not a dict per step: the per-step dicts go
to the run's log file."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from src.measure import progress
from tests.conftest import run_cli


@pytest.mark.slow(seconds=14)
def test_a_trial_prints_no_per_step_dicts_and_logs_them_to_its_file(root: Path, mlflow_client) -> None:
    done = run_cli(
        "src.train", "trainer=probe", "trainer.max_steps=3", "trainer.logging_steps=1", "trainer.bf16=false", root=root
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'loss'" not in done.stdout and "'loss'" not in done.stderr, done.stdout[-2000:]
    logs = [p.read_text() for p in root.rglob("*.log")]
    assert any('"loss"' in text for text in logs), "the per-step dicts are in the run's log file"


def test_the_bar_shows_loss_tokens_per_second_and_peak_memory() -> None:
    shown = io.StringIO()
    meas = SimpleNamespace(steps=[], host=SimpleNamespace(peak_gib=lambda: 0.12))
    bar = progress.ProgressBar(meas, file=shown)
    bar.bar = __import__("tqdm").tqdm(total=3, file=shown, mininterval=0)  # as on a terminal
    bar.on_log(None, SimpleNamespace(global_step=1), None, logs={"loss": 2.5})
    meas.steps.append({"time_s": 0.5, "tokens": 1000})
    bar.on_step_end(None, SimpleNamespace(global_step=1), None)
    bar.bar.refresh()
    text = shown.getvalue()
    assert "1/3" in text and "loss=2.500" in text and "tok/s=2000" in text, text
    assert "peak=0.12 GiB" in text or ("peak=" in text and "GiB" in text), text


def test_without_a_terminal_the_progress_is_a_line_now_and_then() -> None:
    written = io.StringIO()  # a file: no terminal
    meas = SimpleNamespace(steps=[{"time_s": 0.5, "tokens": 1000}], host=SimpleNamespace(peak_gib=lambda: 0.12))
    bar = progress.ProgressBar(meas, file=written, line_every_s=3600)
    bar.on_train_begin(None, SimpleNamespace(max_steps=3, global_step=0), None)
    bar.on_log(None, SimpleNamespace(global_step=1), None, logs={"loss": 2.5})
    for step in (1, 2, 3):
        bar.on_step_end(None, SimpleNamespace(global_step=step, max_steps=3), None)
    lines = written.getvalue().splitlines()
    assert len(lines) == 2, lines  # the first step, then none within the interval but the last
    assert lines[0].startswith("step 1/3: loss 2.500, tok/s 2000, peak 0.12 GiB, 0m0")
    assert lines[1].startswith("step 3/3:")
