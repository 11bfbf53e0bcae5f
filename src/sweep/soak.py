"""The soak: after the map, the best stable settings (`hydra.sweeper.soak_top_k`, default 2) each train much longer,
at least one whole epoch in the real order of the user's data (no probe subset: every batch, the longest ones
included) and at least `hydra.sweeper.soak_minutes`, under the same cap. A probe of a few steps says a setting fits;
the soak says it still fits after an epoch of the data's real batches, with the allocator's fragmentation.

Each soak is a trial process like the map's (isolated, classified, its own MLflow run `soak-trial-NNN` under the
sweep's parent run, `sweep.role=soak`). What it measured is kept on the study (`soak.<trial>` user attr) and on the
finalist's own run (`soak.status` passed | failed); promotion takes only soaked settings.

A soak passes when it ends without a failure and its peak reserved keeps the map's headroom margin (the same rule
that called the probe stable). It also records how the peak moved against the probe's, allocated vs reserved
(fragmentation), the allocator's retries and the drift of step time from the first quarter to the last.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from omegaconf import OmegaConf

from src import record, tracking
from src.config import override_value
from src.handoff import PROGRESS_FILE
from src.record import Outcome
from src.study import Sweep, TrialRow
from src.sweep.launch import launch
from src.sweep.ledger import CardLedger
from src.sweep.process import read_json
from src.sweep.slots import Slot
from src.sweep.stop import stopping

log = logging.getLogger(__name__)
KEY = record.SOAK
# A soak the sweep's stop ended: its record says so, and the next run of the sweep soaks that finalist again.
STOPPED = "stopped"
# The soak trains until both: one epoch and the minutes; the epoch count only bounds it (the learning-rate
# schedule then stretches over it, which moves no memory).
EPOCHS_BOUND = 1000


def overrides(row: TrialRow, fixed: list[str], minutes: float) -> list[str]:
    """The finalist's own setting, trained for real: the sweep's fixed overrides, its params and levers, no probe."""
    return [
        *fixed,
        *(f"{k}={override_value(v)}" for k, v in row.setting().items()),
        *row.lever,
        "trainer.max_steps=-1",
        f"trainer.num_train_epochs={EPOCHS_BOUND}",
        f"measure.soak_minutes={minutes}",
    ]


def pending(study: optuna.Study, sweep: Sweep, top_k: int) -> list[TrialRow]:
    """The finalists not soaked (or being soaked) yet: never soaked, or soaked until the sweep was stopped."""
    return [
        r
        for r in sweep.ranked()[:top_k]
        if study.user_attrs.get(KEY.format(r.number), {"status": STOPPED}).get("status") == STOPPED
    ]


def finalists(
    study: optuna.Study,
    store: Any,
    classified: Callable[[], Sweep],
    sweeper: Any,
    slots: list[Slot],
    fixed: list[str],
    runs: Any,
    budget: float,
    ledger: CardLedger | None = None,
) -> None:
    """The last worker out soaks the finalists not soaked yet (claimed under the study's lock, so another worker
    finishing now does not soak them too); a re-run of a complete study soaks what was left."""
    top_k = int(sweeper.soak_top_k)
    if top_k <= 0:
        return
    with store.lock():
        if store.others_running(study):
            return
        sweep = classified()
        rows = pending(study, sweep, top_k)
        if not sweep.ranked():
            print("soak: no setting to soak (none is stable within the truncation policy)", flush=True)
        for row in rows:
            study.set_user_attr(KEY.format(row.number), {"status": "running"})
    if not rows:
        return
    print(
        f"soak: trial(s) {', '.join(str(r.number) for r in rows)} train at least one epoch and "
        f"{float(sweeper.soak_minutes):g} min each (logs: {sweep.study_dir / 'soak'})",
        flush=True,
    )
    with stopping.workers_running():  # a signal ends the soaks' processes and records them (like the trials)
        done = run(study, sweep, rows, slots, fixed, runs, sweeper, budget, ledger)
    for soaked in done:
        if soaked["status"] != STOPPED:
            print(f"soak: trial {soaked['trial']} {soaked['status']}: {soaked['detail']}", flush=True)


def run(
    study: optuna.Study,
    sweep: Sweep,
    rows: list[TrialRow],
    slots: list[Slot],
    fixed: list[str],
    runs: Any,
    sweeper: Any,
    budget: float,
    ledger: CardLedger | None = None,
) -> list[dict[str, Any]]:
    """Soak `rows`, one per slot at a time; returns their records (also on the study and the runs). Called while
    the sweep's stop waits for its workers (`stopping.workers_running`): a signal ends the soaks' processes, which
    are recorded as stopped (their runs KILLED) and soaked again by the next run."""
    minutes = float(sweeper.soak_minutes)
    # Generous: the soak stops itself at one epoch and `minutes`; the timeout only catches a hang's slow cousin.
    limits = OmegaConf.merge(sweeper, {"trial_timeout_s": max(float(sweeper.trial_timeout_s), minutes * 180 + 1800)})
    queue = list(rows)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def work(slot: Slot) -> None:
        while not stopping.is_set():
            with lock:
                if not queue:
                    return
                row = queue.pop(0)
            where = slots.index(slot)
            record = soak_one(study, sweep, row, slot, fixed, runs, limits, budget, minutes, where, ledger)
            with lock:
                results.append(record)

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in slots[: max(1, len(rows))]]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(timeout=0.5)  # short waits: a signal's handler runs in this thread between them
    return results


def soak_one(
    study: optuna.Study,
    sweep: Sweep,
    row: TrialRow,
    slot: Slot,
    fixed: list[str],
    runs: Any,
    limits: Any,
    budget: float,
    minutes: float,
    position: int = 0,
    ledger: CardLedger | None = None,
) -> dict[str, Any]:
    """One finalist's soak, launched as every trial is (src/sweep/launch.py), its run made by the sweep's runs;
    its progress shown as it runs (`Progress`)."""
    study.set_user_attr(KEY.format(row.number), {"status": "running", "slot": slot.name, "started": time.time()})
    run_id = runs.soak(row.number, slot.name)
    log_dir = log_dir_of(sweep, row.number)
    log.info("soaking trial %d on %s: at least one epoch and %g minutes (%s)", row.number, slot.name, minutes, log_dir)
    started = time.time()
    view = Progress(row.number, minutes, log_dir, runs, bool(limits.get("progress", False)), position)
    try:
        # a soak's share of a shared card: its whole budget (hours of data, not a probe's batches)
        args = (runs, limits, slot, f"soak-{row.number}", overrides(row, fixed, minutes), log_dir, run_id, budget)
        outcome = launch(*args, view.beat, ledger)
    finally:
        view.close()
    if stopping.is_set() and outcome.failure and outcome.failure["kind"] == "killed":
        # ended by the sweep's stop: it says nothing of the setting, and the next run soaks it again
        stopped = {"trial": row.number, "run_id": run_id, "status": STOPPED, "detail": outcome.failure["message"]}
        study.set_user_attr(KEY.format(row.number), stopped)
        return stopped
    soaked = judge(outcome, row, runs.client, run_id, budget, sweep.margin, time.time() - started)
    study.set_user_attr(KEY.format(row.number), soaked)
    tracking.set_tags(runs.client, run_id, {record.SOAK_STATUS: soaked["status"]})
    if row.run_id:
        tracking.set_tags(runs.client, row.run_id, {record.SOAK_STATUS: soaked["status"], record.SOAK_RUN_ID: run_id})
    log.info("soak of trial %d: %s (%s)", row.number, soaked["status"], soaked["detail"])
    return soaked


class Progress:
    """A soak's progress while it runs, read from the trial's progress file at each heartbeat: which setting, its
    steps and epoch, the elapsed share of its minutes and the peak reserved so far; a bar in the terminal (one per
    slot, when hydra.sweeper.progress is on) and metrics on the sweep's parent run (`soak.<trial>.steps`,
    `.epoch`, `.elapsed_min`, `.peak_vram_reserved_gib`, at the elapsed second), for a dashboard."""

    def __init__(self, number: int, minutes: float, log_dir: Path, runs: Any, show: bool, position: int) -> None:
        self.number, self.minutes, self.log_dir, self.runs = number, minutes, log_dir, runs
        self.started = time.time()
        self.bar = None
        if show:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=round(minutes * 60),
                desc=f"soak trial {number}",
                unit="s",
                position=position,
                leave=True,
                dynamic_ncols=True,
                file=sys.stderr,
                bar_format="{desc}: {percentage:3.0f}% of its {total}s |{bar}| {elapsed} {postfix}",
            )

    def beat(self) -> None:
        progress = read_json(self.log_dir / PROGRESS_FILE)
        elapsed = time.time() - self.started
        if progress.get("phase") != "training":
            if self.bar is not None:
                self.bar.set_postfix_str("loading", refresh=True)
            return
        shown = {"steps": float(progress.get("step", 0)), "elapsed_min": elapsed / 60}
        if progress.get("epoch") is not None:
            shown["epoch"] = float(progress["epoch"])
        if progress.get("peak_gib") is not None:
            shown["peak_vram_reserved_gib"] = float(progress["peak_gib"])
        if self.bar is not None:
            self.bar.n = min(round(elapsed), self.bar.total)
            words = f"step {int(shown['steps'])}"
            if "epoch" in shown:
                words += f", epoch {shown['epoch']:.2f}"
            if "peak_vram_reserved_gib" in shown:
                words += f", peak {shown['peak_vram_reserved_gib']:.2f} GiB"
            self.bar.set_postfix_str(words, refresh=True)
        metrics = {f"soak.{self.number}.{k}": v for k, v in shown.items()}
        try:
            tracking.log_metrics(self.runs.client, self.runs.parent, metrics, step=round(elapsed))
        except Exception as exc:  # noqa: BLE001 - a view: a store that fails here never ends the soak
            log.warning("soak trial %d: progress not logged to the parent run (%s)", self.number, exc)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def judge(
    outcome: Outcome, row: TrialRow, client: Any, run_id: str, budget: float, margin: float, wall_s: float
) -> dict[str, Any]:
    """The soak's record: passed when it ended without a failure and kept the map's headroom margin."""
    m = outcome.metrics
    reserved = _series(client, run_id, "vram_reserved_gib")
    allocated = _series(client, run_id, "vram_allocated_gib")
    seconds = _series(client, run_id, "step_seconds")
    peak = m.get("peak_vram_reserved_gib")
    probe_peak = row.metrics.get("peak_vram_reserved_gib")
    record: dict[str, Any] = {
        "trial": row.number,
        "run_id": run_id,
        "steps": len(seconds),
        "minutes": sum(seconds) / 60 if seconds else wall_s / 60,
        "peak_vram_reserved_gib": peak,
        "peak_vram_allocated_gib": m.get("peak_vram_allocated_gib"),
        "map_peak_vram_reserved_gib": probe_peak,
        "alloc_retries": m.get("alloc_retries"),
        "tokens_per_s": m.get("tokens_per_s"),
        "budget_gib": budget,
    }
    if peak and probe_peak:
        record["peak_vs_map"] = peak / probe_peak - 1
    if peak and m.get("peak_vram_allocated_gib"):  # reserved but never allocated at the peak: fragmentation
        record["fragmentation_frac"] = 1 - m["peak_vram_allocated_gib"] / peak
    if allocated:  # at step ends (activations freed): what the allocator keeps cached between steps
        record["vram_allocated_gib"] = _thinned(allocated)
    if len(seconds) >= 8:
        q = len(seconds) // 4
        first, last = statistics.median(seconds[1 : q + 1]), statistics.median(seconds[-q:])
        record["step_time_drift"] = last / first - 1
    record["vram_reserved_gib"] = _thinned(reserved)  # for the picture
    if outcome.failure:
        kind = outcome.failure["kind"]
        step = outcome.failure.get("step")
        record.update(status="failed", failure_kind=kind, detail=f"{kind} at step {step}" if step else kind)
    elif peak is not None and budget and peak > budget * (1 - margin):
        record.update(status="failed", detail=f"headroom {1 - peak / budget:.0%} < {margin:.0%} after the soak")
    else:
        detail = f"{record['steps']} steps in {record['minutes']:.1f} min"
        if peak is not None and budget:
            detail += f", peak {peak:.2f} GiB (headroom {1 - peak / budget:.0%})"
        record.update(status="passed", detail=detail)
    return record


def _thinned(series: list[float], points: int = 400) -> list[float]:
    """At most `points` points of a long series, each the largest of its stretch: the step that peaked stays in the
    picture, whose largest point is then the peak the soak was judged on."""
    size = max(1, -(-len(series) // points))  # ceil: a stretch of at least one point
    return [max(series[i : i + size]) for i in range(0, len(series), size)]


def _series(client: Any, run_id: str, key: str) -> list[float]:
    try:
        history = client.get_metric_history(run_id, key)
    except Exception:  # noqa: BLE001 - a run that logged nothing
        return []
    return [h.value for h in sorted(history, key=lambda h: h.step)]


def log_dir_of(sweep: Sweep, number: int) -> Path:
    return sweep.study_dir / "soak" / f"{number:03d}"
