"""`src.fit` right after CPU trials: it says why they do not calibrate it, not that nothing was measured."""

from __future__ import annotations

from pathlib import Path

from src.fit.calibration import calibrated


def test_cpu_trials_are_named_as_the_reason_the_model_is_not_calibrated(root: Path, mlflow_client) -> None:
    exp = mlflow_client.create_experiment("demo")
    for _ in range(2):
        tags = {"model.name": "tiny_llama", "trial.status": "ok", "gpu.name": "none"}
        run = mlflow_client.create_run(exp, tags=tags).info.run_id
        mlflow_client.log_metric(run, "peak_vram_reserved_gib", 0.12)
    model, note = calibrated(f"sqlite:///{root}/mlruns/mlflow.db", "tiny_llama")
    assert model.points == 0
    assert "no measured trial" not in note, note
    assert "the 2 measured trial(s) of this model ran on a CPU" in note and "no GPU trial" in note, note
