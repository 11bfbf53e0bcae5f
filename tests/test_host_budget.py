"""Without a GPU the trial's device is the CPU: `hardware.vram_budget_gib` holds the trial process's own memory
(beyond its start-up) for real, an allocation past it fails and is the setting's `oom`, and the peak is measured
against it. Linux only (the budget is RLIMIT_DATA, the measure /proc)."""

from __future__ import annotations

import resource
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from src import failures
from src.measure import memory
from src.trial import single
from tests.conftest import run_cli

GIB = 1024**3

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not Path("/proc/self/statm").exists(), reason="the CPU's budget: Linux, no GPU"
)


def test_the_budget_refuses_an_allocation_past_it_measures_the_peak_and_is_lifted_after() -> None:
    before = resource.getrlimit(resource.RLIMIT_DATA)
    meas = SimpleNamespace(host=None, startup_s=None)  # a trial that had not begun training
    with memory.budget(0.25, meas) as facts:
        held = torch.ones(int(0.1 * GIB) // 4)  # 0.1 GiB, written: within the budget
        with pytest.raises(RuntimeError) as refused:
            torch.empty(int(0.3 * GIB), dtype=torch.uint8)  # past it, though the machine has the memory
        assert meas.host.sample() >= 0.1
    del held
    assert facts["host_limit_gib"] == pytest.approx(facts["host_startup_gib"] + 0.25)
    assert 0.1 <= meas.host.peak_gib() < 0.25
    # torch's CPU allocator says "can't allocate memory": the host's words; under the trial's budget, the setting's
    assert failures.classify_exception(refused.value) == "host_oom"
    assert single.failure_of(refused.value, meas).kind == "oom"
    assert single.failure_of(refused.value, None).kind == "host_oom", "no budget: the machine ran out"
    assert failures.oom_request_gib(str(refused.value)) == pytest.approx(0.3)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before, "the process gets its own limit back"
    torch.empty(int(0.3 * GIB), dtype=torch.uint8)


@pytest.mark.slow(seconds=15)
def test_a_trial_past_its_budget_fails_as_oom_with_what_it_held_and_asked_for(root: Path, mlflow_client) -> None:
    """Batch 8 of the sample's rows needs ~0.28 GiB beyond the start-up (most of it trl's LM-head tile: 128 KiB per
    token); on a 0.15 GiB budget its first step fails, as on a card of that size."""
    done = run_cli(
        "src.train",
        *("trainer=probe", "trainer.max_steps=2", "trainer.per_device_train_batch_size=8", "trainer.bf16=false"),
        "hardware.vram_budget_gib=0.15",
        root=root,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "trial failed (oom at step 1)" in done.stderr
    run = mlflow_client.search_runs([mlflow_client.get_experiment_by_name("qlora-trials").experiment_id])[0]
    assert f"run {run.info.run_id}" in done.stderr and "results: " in done.stderr, "where the failure was recorded"
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FAILED" and tags["failure.kind"] == "oom" and tags["failure.step"] == "1"
    assert "can't allocate memory" in tags["failure.message"]
    assert 0 < m["peak_vram_reserved_gib"] < 0.15 and m["vram_budget_gib"] == 0.15
    needed = m["peak_vram_reserved_gib"] + m["oom_request_gib"]  # what it held at the failure, and asked for
    assert needed > 0.15 and m["vram_headroom_frac"] == pytest.approx(1 - needed / 0.15)
