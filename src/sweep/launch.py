"""One way to launch a trial's process, for every trial the sweep runs (the map's, the recipe's levers, the
soak's): its slot's environment and its MLflow run handed over, its heartbeat kept while it runs, the same trial
once more with CUDA_LAUNCH_BLOCKING=1 after a sticky CUDA error, its share of a card it shares with other trials
held while it runs (src/sweep/ledger.py) and the same trial once more alone on its card where that card ran out
before the trial's budget did, and its MLflow run ended where the process could not end it (KILLED when the sweep's
stop or a watchdog ended it, FAILED otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from src import record, tracking
from src.failures import STICKY_CUDA, card_ran_out
from src.handoff import RUN_ENV, TRIAL_ENV
from src.record import Outcome
from src.sweep.ledger import CardLedger
from src.sweep.process import run_process, tail
from src.sweep.slots import Slot

log = logging.getLogger(__name__)


def launch(
    runs: Any,
    sweeper: Any,
    slot: Slot,
    label: str,
    overrides: list[str],
    log_dir: Path,
    run_id: str,
    budget: float,
    heartbeat: Callable[[], None] | None = None,
    ledger: CardLedger | None = None,
    share_gib: float | None = None,
    alone: bool = False,
) -> Outcome:
    """Run the trial's process on `slot` for MLflow run `run_id` (`label`: the trial's number, or `soak-<number>`)
    and say how it ended; its run is ended whatever happened to the process. On a card it shares (`ledger`), it
    starts once its share (`share_gib`, GiB; None: its whole budget) fits beside the others' (`alone`: once no
    other trial runs there, and none starts there until it ends: its speed is then its own)."""
    env = {**slot.env, RUN_ENV: run_id, TRIAL_ENV: label}
    every = float(sweeper.get("heartbeat_interval_s", 10))  # a trial waiting for memory beats as a running one does

    def attempt(sub: str = "", extra_env: dict[str, str] | None = None, alone: bool = False) -> Outcome:
        """The trial's process (again: in `log_dir/sub`), once its share of a shared card is held."""
        share = budget if share_gib is None else share_gib
        with ledger.hold(slot, share, alone, heartbeat, every) if ledger else nullcontext():
            return run_process(overrides, log_dir / sub, {**env, **(extra_env or {})}, sweeper, heartbeat)

    outcome = attempt(alone=alone)
    tracking.set_tags(runs.client, run_id, {record.LAUNCHER: outcome.launcher})
    if outcome.failure and outcome.failure["kind"] == "oom" and card_ran_out(outcome.metrics):
        outcome = rerun_alone(runs, run_id, label, slot, outcome, attempt)
    if outcome.failure and outcome.failure["kind"] in STICKY_CUDA and sweeper.launch_blocking_rerun:
        outcome = rerun_launch_blocking(runs, run_id, outcome, attempt)
    if not outcome.recorded:
        tracking.log_text(runs.client, run_id, tail(log_dir / "stderr.log"), "stderr_tail.txt")
        tracking.log_metrics(runs.client, run_id, {**outcome.metrics, "vram_budget_gib": budget})
        status = "KILLED" if outcome.failure["kind"] in record.KILLED_KINDS else "FAILED"
        tracking.close_failed(runs.client, run_id, outcome.failure, status=status)
    return outcome


def rerun_launch_blocking(runs: Any, run_id: str, first: Outcome, attempt: Callable[..., Outcome]) -> Outcome:
    """The seed answer's first step, automated: the same trial once more with CUDA_LAUNCH_BLOCKING=1, so the
    recorded stack points at the kernel that failed. The first attempt's kind stays the trial's."""
    second = attempt("launch_blocking", {"CUDA_LAUNCH_BLOCKING": "1"})
    second_kind = second.failure["kind"] if second.failure else "none (passed)"
    tags = {
        **record.failed_tags({k: first.failure.get(k) for k in ("kind", "message", "step")}),
        record.LAUNCH_BLOCKING_KIND: second_kind,
        record.LAUNCH_BLOCKING_MESSAGE: second.failure["message"] if second.failure else "",
    }
    tracking.set_tags(runs.client, run_id, tags)
    if second.recorded:
        runs.client.set_terminated(run_id, "FAILED")
    first.recorded = first.recorded and second.recorded
    first.failure["launch_blocking_kind"] = second_kind
    return first


def rerun_alone(
    runs: Any, run_id: str, label: str, slot: Slot, first: Outcome, attempt: Callable[..., Outcome]
) -> Outcome:
    """An OOM of the card, not of the trial's budget (other processes held the rest): the same trial once more in
    the same MLflow run, holding its card alone, so the map records what the setting does on the card it stands in
    for. The first attempt's log stays in `log_dir`; its failure tags give way to the second's outcome."""
    m = first.metrics
    why = (
        f"the card had {m['oom_card_free_gib']:.2f} GiB free for an allocation of {m['oom_request_gib']:.2f} GiB, "
        f"the trial held {m['peak_vram_reserved_gib']:.2f} of its {m['allocator_cap_gib']:.2f} GiB"
    )
    log.warning("trial %s: out of memory on a shared card (%s): running it again alone on %s", label, why, slot.name)
    for key in [k for k in runs.client.get_run(run_id).data.tags if k.startswith(record.FAILURE)]:
        runs.client.delete_tag(run_id, key)  # the second attempt's outcome is the trial's
    second = attempt("alone", alone=True)
    tracking.set_tags(runs.client, run_id, {record.RERUN_ALONE: why})
    return second
