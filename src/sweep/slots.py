"""Where trials run: one slot per GPU group (`gpus_per_trial` whole cards, `slots_per_gpu` trials per card), or
CPU slots where there is no GPU; each slot is the environment its trial process gets. The counts that decide
how many trials run (`n_trials`, `n_jobs`) are checked here too, with the slots: before anything is recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from src import gpus


class SlotsError(ValueError):
    """A sweeper setting that would run nothing or cannot be met here; the message names the key."""


@dataclass(frozen=True)
class Slot:
    name: str
    env: dict[str, str]


# Slots per core beyond which a CPU sweep only thrashes: each slot is a trial process with its own interpreter.
CPU_SLOTS_PER_CORE = 4


def check_values(sweeper: DictConfig) -> None:
    """Every sweeper value checked by range, naming the key, before anything is recorded (#30.20: a timeout <= 0
    killed every trial as a timeout; cpu_slots=100000 never finished a one-trial sweep)."""
    ranges = {  # key: (allowed, what it must be)
        "trial_timeout_s": (lambda v: v > 0, "seconds, more than 0"),
        "stall_timeout_s": (lambda v: v > 0, "seconds, more than 0"),
        "startup_timeout_s": (lambda v: v > 0, "seconds, more than 0"),
        "heartbeat_interval_s": (lambda v: v >= 1, "seconds, at least 1"),
        "headroom_margin": (lambda v: 0 <= v <= 1, "a share of the budget, from 0 to 1, e.g. 0.10"),
        "soak_top_k": (lambda v: v >= 0, "at least 0 (0: no soak)"),
        "soak_minutes": (lambda v: v >= 0, "minutes, at least 0"),
        "recommend_trials": (lambda v: v >= 0, "at least 0 (0: the sweep does not search for a setting)"),
        "speed_trials": (lambda v: v >= 0, "at least 0 (0: no search for the same model faster)"),
        "same_model_steps": (lambda v: v >= 0, "optimizer steps, at least 0 (0: no same-model check)"),
        "timing_repeats": (lambda v: v >= 0, "runs, at least 0 (0: the speeds are the map's)"),
    }
    for key, (ok, what) in ranges.items():
        value = sweeper.get(key)
        if value is not None and not ok(float(value)):
            raise SlotsError(f"hydra.sweeper.{key}={float(value):g}: must be {what}")
    beat, grace = sweeper.get("heartbeat_interval_s"), sweeper.get("grace_period_s")
    if beat is not None and grace is not None and not grace > beat:
        raise SlotsError(
            f"hydra.sweeper.grace_period_s={grace}: must be more than hydra.sweeper.heartbeat_interval_s={beat} "
            "(a live trial would be taken as dead between two heartbeats)"
        )
    cores = os.cpu_count() or 1
    most = max(2, cores) * CPU_SLOTS_PER_CORE
    if sweeper.get("cpu_slots") is not None and int(sweeper.cpu_slots) > most:
        raise SlotsError(
            f"hydra.sweeper.cpu_slots={sweeper.cpu_slots}: at most {most} on this machine ({cores} cores): each slot "
            "is a trial process of its own"
        )


def devices(sweeper: DictConfig | None) -> list[int]:
    """The GPUs the sweep's trials run on: `hydra.sweeper.devices`, else every GPU this machine shows ([]: the CPU).
    A sweeper config without the key (Hydra's basic sweeper, a test's) runs on what the machine shows."""
    chosen = OmegaConf.select(sweeper, "devices") if sweeper is not None else None
    return list(chosen) if chosen is not None else gpus.indices()


def discover_slots(sweeper: DictConfig) -> list[Slot]:
    check_values(sweeper)
    for key in ("gpus_per_trial", "slots_per_gpu", "cpu_slots", "n_trials"):
        if int(sweeper[key]) < 1:
            raise SlotsError(f"hydra.sweeper.{key}={sweeper[key]}: must be at least 1")
    if sweeper.n_jobs is not None and int(sweeper.n_jobs) < 1:  # 0 and -1 mean "all" elsewhere: refused, not guessed
        raise SlotsError(f"hydra.sweeper.n_jobs={sweeper.n_jobs}: must be at least 1 (or null: one trial per slot)")
    cards = devices(sweeper)
    if cards and sweeper.gpus_per_trial > len(cards):
        raise SlotsError(
            f"hydra.sweeper.gpus_per_trial={sweeper.gpus_per_trial} but this machine shows {len(cards)} GPU(s) "
            f"({cards}); lower gpus_per_trial or set hydra.sweeper.devices"
        )
    if not cards:
        threads = _threads(sweeper.cpu_slots)
        return [Slot(f"cpu{i}", {"OMP_NUM_THREADS": threads}) for i in range(sweeper.cpu_slots)]
    per = sweeper.gpus_per_trial
    groups = [cards[i : i + per] for i in range(0, len(cards) - per + 1, per)]
    copies = sweeper.slots_per_gpu if per == 1 else 1
    threads = _threads(len(groups) * copies)
    return [
        Slot(
            f"cuda{','.join(map(str, g))}" + (f"#{c}" if copies > 1 else ""),
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, g)), "OMP_NUM_THREADS": threads},
        )
        for g in groups
        for c in range(copies)
    ]


def _threads(at_once: int) -> str:
    """Each slot's OMP_NUM_THREADS: the user's own setting, else its share of the machine's cores. Trials at once
    share the cores (as torchrun's ranks do), so that five trials starting together do not run 5 x all-cores thread
    pools (tokenizing, collating, torch's own)."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // max(1, at_once)))
