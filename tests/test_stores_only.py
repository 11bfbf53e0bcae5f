"""A study needs only its two stores: with the Optuna storage outside sweeps/ and the study's folder (trial logs,
Hydra's .hydra/ files) deleted, the report and the promotion read everything from the storage and the trials'
MLflow runs, and the experiment file still composes what the promoted trial ran."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow.artifacts
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from src import report, tracking
from src.config import PROJECT_DIR, compose
from tests.conftest import FAST_SWEEP, run_cli

STUDY = "stores_only"
SETTINGS = [{"data.max_seq_length": 256, "lora.r": 8}, {"data.max_seq_length": 512, "lora.r": 4}]
PROBE_KEYS = {"trainer.max_steps", "trainer.warmup_steps", "trainer.output_dir", "preflight.max_truncated_answer_frac"}


@pytest.mark.slow
def test_report_and_promotion_need_only_the_storage_and_the_tracking_store(root: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    storage = f"sqlite:///{tmp_path}/elsewhere/optuna.db"
    store = f"sqlite:///{root}/mlruns/mlflow.db"
    enqueue = ",".join("{" + ",".join(f"{k}:{v}" for k, v in s.items()) + "}" for s in SETTINGS)
    done = run_cli(
        "src.train",
        "-m",
        "hydra/sweeper=optuna",
        f"hydra.sweeper.study_name={STUDY}",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweeper.n_trials={len(SETTINGS)}",
        *FAST_SWEEP,
        f"hydra.sweeper.enqueue_trials=[{enqueue}]",
        "data.max_seq_length=choice(256,512)",
        "lora.r=choice(4,8)",
        "model=tiny_llama",
        "trainer.save_adapter=true",
        root=root,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    shutil.rmtree(root / "sweeps" / STUDY)  # trial logs and .hydra/ files gone: as on a machine that only reads
    where = ["--storage", storage, "--tracking-uri", store]

    shown = run_cli("src.report", STUDY, *where, root=root)
    assert shown.returncode == 0, shown.stderr[-4000:]
    sweep = report.load(STUDY, root / "sweeps", storage=storage, tracking_uri=store)
    best = sweep.best()
    assert [r.params for r in sweep.rows] == SETTINGS and best is not None
    assert f"{STUDY}: 2 trials, 2 stable, 0 marginal, 0 failed" in shown.stdout
    assert f"best stable: trial {best.number}; promote it: python -m src.promote {STUDY}" in shown.stdout

    conf = tmp_path / "conf"  # a copy of the project's configs, so the repo's conf/ is never written
    shutil.copytree(PROJECT_DIR / "conf", conf)
    target = conf / "experiment" / "production.yaml"
    target.unlink(missing_ok=True)
    promoted = run_cli("src.promote", STUDY, *where, "--allow-unsoaked", "--experiment-file", str(target), root=root)
    assert promoted.returncode == 0, promoted.stderr[-4000:]
    assert f"promoted trial {best.number} of study {STUDY}" in promoted.stdout
    client = MlflowClient(store)
    assert client.get_model_version_by_alias("llama3-qlora", "production").run_id == best.run_id

    cfg = compose(["experiment=production"], config_dir=conf)
    for key, value in best.params.items():
        assert OmegaConf.select(cfg, key) == value, key
    assert cfg.trainer.save_adapter is True and cfg.model.name == "tiny_llama"
    logged = mlflow.artifacts.download_artifacts(
        run_id=best.run_id, artifact_path="config/config.yaml", dst_path=str(tmp_path / "logged"), tracking_uri=store
    )
    measured = tracking.params(OmegaConf.to_container(OmegaConf.load(logged)))
    composed = tracking.params(OmegaConf.to_container(cfg))
    differ = {k for k in measured.keys() | composed.keys() if measured.get(k) != composed.get(k)}
    assert differ <= PROBE_KEYS, differ
