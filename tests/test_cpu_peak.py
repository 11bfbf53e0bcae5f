"""Without a GPU the CPU's memory stands in for the card's, and its peak must move as a card's does: with the
micro-batch, not with gradient accumulation, and the same on every run (the demo's map rests on it)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
import torch

from tests.conftest import run_cli, sweep_argv

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not Path("/proc/self/clear_refs").exists(), reason="the CPU's budget: Linux, no GPU"
)

BATCH, ACCUMULATION = "trainer.per_device_train_batch_size", "trainer.gradient_accumulation_steps"
# (batch, accumulation, run) in the order the sweep runs them. Optuna queues a setting once: the same setting's
# second run differs in `fault.step`, which does nothing without a fault (fault.kind=none).
SETTINGS = [(4, 1, 1), (4, 2, 1), (4, 1, 2), (8, 1, 1)]


@pytest.mark.slow(seconds=33)
def test_the_cpu_peak_moves_with_the_micro_batch_not_with_accumulation_and_is_the_same_on_every_run(
    root: Path, mlflow_client
) -> None:
    """Each setting is one trial of the tiny Llama in its own process, as a sweep launches it (forked from the
    sweep's warm interpreter, one at a time); each one's peak_vram_reserved_gib."""
    queued = ",".join(f"{{{BATCH}:{b},{ACCUMULATION}:{a},fault.step:{run}}}" for b, a, run in SETTINGS)
    done = run_cli(
        *sweep_argv(study="peaks", fast=True),
        *("trainer=probe", "trainer.bf16=false", "hardware.vram_budget_gib=0.32"),
        f"{BATCH}=choice(4,8)",
        f"{ACCUMULATION}=choice(1,2)",
        "fault.step=choice(1,2)",
        f"hydra.sweeper.n_trials={len(SETTINGS)}",
        f"hydra.sweeper.enqueue_trials=[{queued}]",
        "hydra.sweeper.trial_overrides=['trainer.max_steps=2']",  # two optimizer steps, as before
        *("hydra.sweeper.cpu_slots=1", "hydra.sweeper.skip_duplicates=false", "hydra.sweeper.recommend_trials=0"),
        root=root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="peaks", storage=f"sqlite:///{root}/sweeps/peaks/optuna.db")
    trials = sorted(study.trials, key=lambda t: t.number)
    assert [(t.params[BATCH], t.params[ACCUMULATION], t.params["fault.step"]) for t in trials] == SETTINGS
    peaks = []
    for t in trials:
        assert t.user_attrs["trial.status"] == "ok", t.user_attrs
        peaks.append(mlflow_client.get_run(t.user_attrs["mlflow_run_id"]).data.metrics["peak_vram_reserved_gib"])
    once, accumulated, again, bigger = peaks
    # Measured forked (2-core machine, busy): batch 4 0.097-0.102 GiB at accumulation 1 and 2, batch 8 0.124-0.151
    # (fresh interpreters: 0.069-0.074 and 0.10-0.13); before, accumulation 2 read 0.31 against 0.21 (the process's
    # growth over every micro-step counted)
    assert accumulated == pytest.approx(once, abs=0.012), "accumulation does not move the peak"
    assert again == pytest.approx(once, abs=0.012), "the same setting peaks the same on another run"
    assert bigger > max(once, accumulated, again) + 0.015, "the micro-batch moves it"
