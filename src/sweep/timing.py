"""Speed read alone, more than once. A map's trials may share their card (`hydra.sweeper.slots_per_gpu`), and one
reading of a 1 k-token step spreads by up to 30% (the host sets its pace): neither is a figure to choose the
production setting by. So on a GPU, after the same-model check and before the soak, the reference and the finalists
the soak would take train again as their map trial did, each alone on its card (no other trial of the sweep runs
there), until each has `hydra.sweeper.timing_repeats` readings (a second-stage trial ran alone: its own reading is
one), round-robin (a drift of the card meets every setting alike). Their tokens/s, median, min and max, and MFU go
on the study (`sweep.timed.<trial>`); the ranking then reads the median where it exists (src/study.py
`Sweep.score`), and the report quotes it with its spread.

Each run is a trial process launched as every trial is (src/sweep/launch.py), with an MLflow run of its own
(`timed-trial-NNN.k`, `sweep.role=timing`) under the sweep's parent run.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna

from src import record
from src.study import Sweep, TrialRow
from src.sweep import faster
from src.sweep.launch import launch
from src.sweep.ledger import CardLedger
from src.sweep.slots import Slot, devices
from src.sweep.stop import stopping

log = logging.getLogger(__name__)


def to_time(sweep: Sweep, top_k: int) -> list[TrialRow]:
    """The reference and the first `top_k` ranked settings, those not timed yet, the reference first."""
    ref = faster.reference(sweep)
    rows = ([ref] if ref is not None else []) + [
        r for r in sweep.ranked()[:top_k] if ref is None or r.number != ref.number
    ]
    return [r for r in rows if not r.timed]


def finalists(
    study: optuna.Study,
    store: Any,
    classified: Callable[[], Sweep],
    sweeper: Any,
    slots: list[Slot],
    trial_overrides: list[str],
    runs: Any,
    budget: float,
    ledger: CardLedger | None = None,
) -> list[dict[str, Any]]:
    """The last worker out times the reference and the finalists the soak would take (on a GPU; a CPU's speed is
    read alone already, and its figures are the demo's). What was timed."""
    repeats, top_k = int(sweeper.get("timing_repeats", 0)), int(sweeper.soak_top_k)
    if repeats <= 0 or top_k <= 0 or not devices(sweeper):
        return []
    with store.lock():
        if store.others_running(study):
            return []
        sweep = classified()
        rows = to_time(sweep, top_k)
    if not rows or stopping.is_set():
        return []
    names = ", ".join(str(r.number) for r in rows)
    print(f"timing: trial(s) {names} alone on the card, {repeats} readings each, round-robin", flush=True)
    speeds = {r.number: own_reading(r) for r in rows}  # a trial that ran alone (the second stage's) read once
    slot = slots[0]
    for k in range(repeats):
        for row in (r for r in rows if len(speeds[r.number]) < repeats):
            if stopping.is_set():
                return []
            folder = sweep.study_dir / "timing" / f"{row.number:03d}.{k + 1}"
            speeds[row.number].append(time_once(row, k, slot, folder, trial_overrides, runs, sweeper, budget, ledger))
    done = []
    for row in rows:
        timed = summary(speeds[row.number])
        study.set_user_attr(record.timed_key(row.number), timed)
        words = f"median {timed['tokens_per_s']:,.0f} tokens/s" if timed.get("tokens_per_s") else timed["why"]
        print(f"timing: trial {row.number}: {words} over {timed['runs']} run(s) alone", flush=True)
        done.append({"trial": row.number, **timed})
    return done


def time_once(
    row: TrialRow,
    k: int,
    slot: Slot,
    log_dir: Path,
    trial_overrides: list[str],
    runs: Any,
    sweeper: Any,
    budget: float,
    ledger: CardLedger | None,
) -> dict[str, float]:
    """One timing run of `row`, alone on its card: what it measured (tokens/s, MFU, peak), or its failure's kind."""
    label = f"timed-{row.number}.{k + 1}"
    card = slot.name.split("#", 1)[0]  # alone: the card, not one of its shares
    run_id = runs.timed(row.number, k + 1, card)
    started = time.time()
    overrides = [*trial_overrides, *faster.overrides(row)]
    outcome = launch(runs, sweeper, slot, label, overrides, log_dir, run_id, budget, None, ledger, alone=True)
    if outcome.failure:
        return {"failed": outcome.failure["kind"], "seconds": time.time() - started}
    return {k: float(outcome.metrics[k]) for k in READ if outcome.metrics.get(k) is not None}


def own_reading(row: TrialRow) -> list[dict[str, float]]:
    """The trial's own reading where it ran alone on a card (its slot a card, not a share of one): one of its
    timing's readings, taken the same way (the probe's steps)."""
    slot = row.slot or ""
    if not (slot.startswith("cuda") and "#" not in slot and row.metrics.get("tokens_per_s")):
        return []
    return [{k: row.metrics[k] for k in READ if row.metrics.get(k) is not None}]


READ = ("tokens_per_s", "mfu_standard", "peak_vram_reserved_gib")


def summary(readings: list[dict[str, float]]) -> dict[str, Any]:
    """Median, min and max of the runs that finished; how many ran; why none did."""
    rates = [r["tokens_per_s"] for r in readings if r.get("tokens_per_s")]
    out: dict[str, Any] = {"runs": len(readings), "finished": len(rates), "alone": True}
    if not rates:
        return {**out, "why": "no run finished: " + ", ".join(str(r.get("failed")) for r in readings)}
    mfu = [r["mfu_standard"] for r in readings if r.get("mfu_standard")]
    peaks = [r["peak_vram_reserved_gib"] for r in readings if r.get("peak_vram_reserved_gib")]
    return {
        **out,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "readings": rates,
        **({"mfu_standard": statistics.median(mfu)} if mfu else {}),
        **({"peak_vram_reserved_gib": max(peaks)} if peaks else {}),
    }
