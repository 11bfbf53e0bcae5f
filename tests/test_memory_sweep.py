"""The memory model and the soak in a real sweep of the tiny Llama on the CPU: a setting predicted beyond the budget
is skipped and recorded (`predicted_oom`, with its prediction) while the other runs with its prediction beside what
it measured; the best stable setting is soaked (a whole epoch of the data, its own run), the report shows both, and
promotion takes only a soaked setting unless told otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from src import promote, report
from src.config import PROJECT_DIR, compose
from src.fit.calibration import Lengths, vocab_fallback
from src.fit.model import DEFAULTS, MemoryModel
from src.fit.setting import Setting, peak_batch
from tests.conftest import new_store, run_cli, run_main, sweep_argv

STUDY = "memory"
SMALL, LARGE = 1, 8  # per-device batch: eight of the longest rows at once need about eight times the activations
KNOB = "trainer.per_device_train_batch_size"


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, empty_store: Path) -> tuple[Path, float]:
    root = tmp_path_factory.mktemp("memory_sweep")
    new_store(root, empty_store)  # the file MLflow's migrations make (~2.5 s of a fresh sweep's start-up): copied
    rows = pd.read_excel(PROJECT_DIR / "data" / "clinical_sample.xlsx").head(12)
    data = root / "twelve.jsonl"
    rows.to_json(data, orient="records", lines=True)
    # A fitted model whose activations are large enough that the longer setting cannot fit a budget the shorter fits
    model = MemoryModel(
        coefficients={**DEFAULTS, "activations": 3000.0, "allocator_overhead": 0.0},
        context_gib=0.0,
        error=0.02,
        points=30,
    )
    model.save(root / "model.json")
    cfg = compose(["model=tiny_llama", "data=clinical_sample", f"data.path={data}"])
    lengths = Lengths().of(cfg)
    vocab = vocab_fallback(cfg)
    predicted = {}
    for batch in (SMALL, LARGE):
        cfg.trainer.per_device_train_batch_size = batch
        s = Setting.from_config(cfg, vocab_fallback=vocab)
        predicted[batch] = model.predict(s, peak_batch(lengths, s)).reserved_gib
    budget = round((predicted[SMALL] * predicted[LARGE]) ** 0.5, 3)
    assert predicted[SMALL] < budget < predicted[LARGE] * 0.98
    env = {"QLORA_CACHE": str(cache_dir)}
    done = run_cli(
        *sweep_argv("hydra.sweeper.n_trials=2", study=STUDY, fast=True),
        "hydra/sweeper/sampler=grid", "hydra.sweeper.enqueue_trials=[]",
        f"{KNOB}=choice({SMALL},{LARGE})", "data.max_seq_length=512", "model=tiny_llama", "data=clinical_sample", f"data.path={data}",
        f"hardware.vram_budget_gib={budget}", f"hydra.sweeper.memory_model={root / 'model.json'}",
        "hydra.sweeper.soak_top_k=1", "hydra.sweeper.soak_minutes=0",
        root=root, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "soak: trial 0 passed" in done.stdout or "soak: trial 1 passed" in done.stdout, done.stdout[-3000:]
    return root, budget


def _study(root: Path) -> optuna.Study:
    return optuna.load_study(study_name=STUDY, storage=f"sqlite:///{root}/sweeps/{STUDY}/optuna.db")


def test_a_setting_predicted_beyond_the_budget_is_skipped_and_recorded(swept: tuple[Path, float]) -> None:
    root, budget = swept
    trials = {t.params[KNOB]: t for t in _study(root).trials}
    large, small = trials[LARGE], trials[SMALL]
    assert large.state == optuna.trial.TrialState.PRUNED
    assert large.user_attrs["trial.status"] == "skipped" and large.user_attrs["failure.kind"] == "oom"
    assert large.user_attrs["skipped.reason"].startswith("predicted oom")
    assert large.user_attrs["predicted_peak_vram_device_gib"] > budget
    assert large.system_attrs["constraints"][0] > 0  # infeasible, in Optuna's own record
    assert not (root / "sweeps" / STUDY / "trials" / f"{large.number:03d}" / "stdout.log").exists()  # never launched
    assert small.state == optuna.trial.TrialState.COMPLETE and small.user_attrs["trial.status"] == "ok"
    assert 0 < small.user_attrs["predicted_peak_vram_reserved_gib"] < budget
    client = MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")
    skipped_run = client.get_run(large.user_attrs["mlflow_run_id"])
    assert skipped_run.data.tags["skip.reason"] == "predicted_oom"
    assert skipped_run.data.metrics["predicted_peak_vram_reserved_gib"] == pytest.approx(
        large.user_attrs["predicted_peak_vram_reserved_gib"]
    )
    ran = client.get_run(small.user_attrs["mlflow_run_id"]).data.metrics
    assert "predicted_peak_vram_reserved_gib" in ran and "peak_vram_reserved_gib" in ran


def test_the_best_stable_setting_is_soaked_for_a_whole_epoch(swept: tuple[Path, float]) -> None:
    root, _ = swept
    study = _study(root)
    small = next(t for t in study.trials if t.params[KNOB] == SMALL)
    soak = study.user_attrs[f"soak.{small.number}"]
    assert soak["status"] == "passed", soak
    # 12 rows, one per micro-batch, two micro-batches per optimizer step: an epoch is 6 steps
    assert soak["steps"] >= 6
    assert soak["map_peak_vram_reserved_gib"] == pytest.approx(small.user_attrs["peak_vram_reserved_gib"])
    client = MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")
    run = client.get_run(soak["run_id"])
    assert run.data.tags["sweep.role"] == "soak" and run.data.tags["soak.status"] == "passed"
    assert run.info.status == "FINISHED"
    assert client.get_run(small.user_attrs["mlflow_run_id"]).data.tags["soak.status"] == "passed"


def test_the_report_sets_predictions_against_measurements_and_shows_the_soak(
    swept: tuple[Path, float], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    root, _ = swept
    code, _, err = run_main(report.main, [STUDY, "--no-mlflow"], root, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    text = (root / "sweeps" / STUDY / "report.md").read_text()
    assert "## Memory model: predicted against measured" in text
    assert "predicted oom" in text
    assert "## Soak" in text and "passed" in text


def test_promotion_takes_only_a_soaked_setting_unless_told(
    swept: tuple[Path, float], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    root, _ = swept
    target = tmp_path / "production.yaml"

    def dry_run(*flags: str) -> tuple[int, str, str]:
        return run_main(
            promote.main, [STUDY, "--dry-run", *flags, "--experiment-file", str(target)], root, monkeypatch, capsys
        )

    code, out, err = dry_run()
    assert code == 0, err[-3000:]
    assert "soak:       passed" in out
    # The study's soak taken away: nothing promoted, and the flag that would is named
    study = _study(root)
    soak = study.user_attrs[next(k for k in study.user_attrs if k.startswith("soak."))]
    key = next(k for k in study.user_attrs if k.startswith("soak."))
    study.set_user_attr(key, {**soak, "status": "failed", "detail": "oom at step 3"})
    try:
        code, _, err = dry_run()
        assert code == 1 and "--allow-unsoaked" in err and "oom at step 3" in err
        code, out, err = dry_run("--allow-unsoaked")
        assert code == 0, err[-3000:]
        assert "soak:       FAILED (oom at step 3) - promoted with --allow-unsoaked" in out
    finally:
        study.set_user_attr(key, soak)
    assert json.loads(json.dumps(soak))  # the record is plain JSON (it is also on the study for other tools)
