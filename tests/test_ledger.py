"""Trials sharing a card (src/sweep/ledger.py): they start only while their memory fits the card together, a trial
whose OOM was the crowded card's (not its budget's) runs again alone, and a share comes from the memory model only
where that model may decide."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from src import failures, record
from src.record import Outcome
from src.sweep import launch as launch_module
from src.sweep.ledger import RESERVE_GIB, CardLedger
from src.sweep.slots import Slot

CARD = Slot("cuda0#0", {"CUDA_VISIBLE_DEVICES": "0"})
OTHER = Slot("cuda0#1", {"CUDA_VISIBLE_DEVICES": "0"})


def _start(ledger: CardLedger, share: float, alone: bool = False) -> tuple[threading.Event, threading.Event]:
    """A trial holding `share` in a thread: (started, release)."""
    started, release = threading.Event(), threading.Event()

    def trial() -> None:
        with ledger.hold(CARD, share, alone=alone):
            started.set()
            release.wait(10)

    threading.Thread(target=trial, daemon=True).start()
    return started, release


def test_trials_start_while_their_shares_fit_the_card() -> None:
    ledger = CardLedger({"0": 10.0})
    a, release_a = _start(ledger, 6.0)
    assert a.wait(2)
    b, release_b = _start(ledger, 5.0)  # 6 + 5 > 10: waits
    c, release_c = _start(ledger, 3.0)  # 6 + 3 <= 10: starts beside a
    assert c.wait(2) and not b.wait(0.3)
    release_c.set()
    assert not b.wait(0.3)  # 6 + 5 still > 10
    release_a.set()
    assert b.wait(2)
    release_b.set()
    big, release_big = _start(ledger, 40.0)  # more than the card: runs, alone, once the card is empty
    assert big.wait(2)
    release_big.set()
    while len(ledger.spans["0"]) < 4:
        time.sleep(0.05)
    (line,) = ledger.summary()  # a and c at once, then b, then the big one alone; b waited
    assert line.startswith("card 0: 4 trials on 10.0 GiB, at once: max 2,") and "1 waited for memory" in line


def test_a_trial_waiting_to_run_alone_goes_before_newcomers() -> None:
    ledger = CardLedger({"0": 10.0})
    a, release_a = _start(ledger, 2.0)
    assert a.wait(2)
    alone, release_alone = _start(ledger, 0.0, alone=True)
    time.sleep(0.2)
    late, release_late = _start(ledger, 1.0)  # would fit, but the lone trial waits first
    assert not alone.wait(0.3) and not late.wait(0.1)
    release_a.set()
    assert alone.wait(2) and not late.wait(0.3)
    release_alone.set()
    assert late.wait(2)
    release_late.set()


def test_a_trial_waiting_for_memory_keeps_its_heartbeat() -> None:
    """Workers fail a trial whose heartbeat expired as dead: one waiting for the card's memory must beat."""
    ledger = CardLedger({"0": 10.0})
    a, release_a = _start(ledger, 8.0)
    assert a.wait(2)
    beats: list[float] = []
    started = threading.Event()

    def waiting() -> None:
        with ledger.hold(CARD, 5.0, beat=lambda: beats.append(time.monotonic()), every_s=0.2):
            started.set()

    threading.Thread(target=waiting, daemon=True).start()
    deadline = time.monotonic() + 10
    while len(beats) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not started.is_set() and len(beats) >= 2  # waited, beating
    release_a.set()
    assert started.wait(2)


def test_ledger_covers_only_shared_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("src.gpus.total_gib", lambda index: {0: 79.2, 1: 79.2}[index])
    slots = [CARD, OTHER, Slot("cuda1", {"CUDA_VISIBLE_DEVICES": "1"})]
    ledger = CardLedger.for_slots(slots)
    assert ledger is not None and ledger.totals == {"0": pytest.approx(79.2 - RESERVE_GIB)}
    assert CardLedger.for_slots(slots[2:]) is None  # one trial per card: nothing to share
    assert CardLedger.for_slots([Slot("cpu0", {}), Slot("cpu1", {})]) is None
    monkeypatch.setattr("src.gpus.total_gib", lambda index: None)
    assert CardLedger.for_slots(slots) is None  # NVML cannot say: as many at once as the user set


# torch 2.11's CUDACachingAllocator message, as a trial capped at 24 GiB on an 80 GB card sees it
CARD_RAN_OUT = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is "
    "free. Process 4242 has 14.20 GiB memory in use. Process 4243 has 22.90 GiB memory in use. Including "
    "non-PyTorch memory, this process has 12.50 GiB memory in use. 23.40 GiB allowed; Of the allocated memory "
    "11.20 GiB is allocated by PyTorch, and 0.70 GiB is reserved by PyTorch but unallocated."
)


def test_an_oom_of_the_crowded_card_is_told_from_one_of_the_budget() -> None:
    assert failures.oom_card_free_gib(CARD_RAN_OUT) == pytest.approx(1.06)
    assert failures.oom_card_free_gib("GPU 0 has a total capacity of 24.00 GiB of which 0 bytes is free.") == 0.0
    shared = {"oom_request_gib": 2.0, "oom_card_free_gib": 1.06, "peak_vram_reserved_gib": 11.9}
    assert failures.card_ran_out({**shared, "allocator_cap_gib": 23.4})
    # its own budget: what it held plus what it asked reaches the cap, whatever the card had free
    assert not failures.card_ran_out({**shared, "peak_vram_reserved_gib": 21.5, "allocator_cap_gib": 23.4})
    assert not failures.card_ran_out({**shared, "oom_card_free_gib": 30.0, "allocator_cap_gib": 23.4})
    assert not failures.card_ran_out(shared)  # no cap (a trial given the whole card): its OOM is the setting's


class _Runs:
    """A sweep's runs: a real MLflow store's client."""

    def __init__(self, client: object) -> None:
        self.client = client


def test_an_oom_of_the_crowded_card_runs_again_alone(
    tmp_path: Path, mlflow_client: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omegaconf import OmegaConf

    run_id = mlflow_client.create_run(mlflow_client.create_experiment("ledger")).info.run_id
    ran: list[Path] = []
    crowded = {"oom_request_gib": 2.0, "oom_card_free_gib": 1.06, "peak_vram_reserved_gib": 11.9}
    first_metrics = {**crowded, "allocator_cap_gib": 23.4}

    def process(overrides: list[str], log_dir: Path, env: dict, sweeper: object, heartbeat: object) -> Outcome:
        ran.append(log_dir)
        if len(ran) == 1:  # what the trial process records of an OOM
            mlflow_client.set_tag(run_id, record.FAILURE_KIND, "oom")
            mlflow_client.set_tag(run_id, record.FAILURE_MESSAGE, CARD_RAN_OUT[:500])
            failure = {"kind": "oom", "message": CARD_RAN_OUT[:500], "step": 1}
            return Outcome("failed", dict(first_metrics), failure, log_dir=log_dir)
        mlflow_client.set_tag(run_id, record.STATUS, "ok")
        return Outcome("ok", {"peak_vram_reserved_gib": 13.1}, None, log_dir=log_dir)

    monkeypatch.setattr(launch_module, "run_process", process)
    sweeper = OmegaConf.create({"launch_blocking_rerun": True})
    ledger = CardLedger({"0": 78.0})
    outcome = launch_module.launch(_Runs(mlflow_client), sweeper, CARD, "7", [], tmp_path, run_id, 24.0, None, ledger)
    assert outcome.status == "ok" and ran == [tmp_path, tmp_path / "alone"]
    tags = mlflow_client.get_run(run_id).data.tags
    assert not [k for k in tags if k.startswith(record.FAILURE)]  # the second attempt's outcome is the trial's
    assert "1.06 GiB free" in tags[record.RERUN_ALONE] and tags[record.STATUS] == "ok"
    assert ledger.held == {"0": []}

    # An OOM of its own budget is the setting's: recorded as it is, never run again
    ran.clear()
    first_metrics.update(peak_vram_reserved_gib=22.0)
    outcome = launch_module.launch(_Runs(mlflow_client), sweeper, CARD, "8", [], tmp_path, run_id, 24.0, None, ledger)
    assert outcome.failure["kind"] == "oom" and ran == [tmp_path]


def test_a_share_comes_from_a_model_that_may_decide(tmp_path: Path) -> None:
    from src.fit.model import MemoryModel
    from src.sweep.memory import MemoryGate
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["hardware.vram_budget_gib=24"])
    model_file = tmp_path / "model.json"
    MemoryModel(error=0.1, errors={"default": [0.1, 0.05]}).save(model_file)
    fitted = MemoryGate(cfg, str(model_file), None, 24.0)
    prediction = fitted.predict([])
    assert prediction is not None and fitted.decides()
    # its peak reserved, its cache included even on expandable segments (the default): a trial gives its cache back
    # to itself, not to the process beside it
    assert prediction.expandable and prediction.reserved_gib > prediction.needed_gib
    assert fitted.share_of(prediction) == pytest.approx(
        min(24.0, prediction.reserved_gib * 1.1 + prediction.context_gib)
    )
    assert fitted.share_of(prediction) < 24.0  # the tiny model: far less than its budget
    recorded_only = MemoryGate(cfg, "predict", None, 24.0)
    assert not recorded_only.decides() and recorded_only.share_of(recorded_only.predict([])) == 24.0
    assert fitted.share_of(None) == 24.0
