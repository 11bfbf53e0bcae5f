"""Where trials run: one slot per GPU group (`gpus_per_trial` whole cards, `slots_per_gpu` trials per card), or
CPU slots where there is no GPU; each slot is the environment its trial process gets. The counts that decide
how many trials run (`n_trials`, `n_jobs`) are checked here too, with the slots: before anything is recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from src import gpus


class SlotsError(ValueError):
    """A sweeper setting that would run nothing or cannot be met here; the message names the key."""


@dataclass(frozen=True)
class Slot:
    name: str
    env: dict[str, str]


def discover_slots(sweeper: DictConfig) -> list[Slot]:
    for key in ("gpus_per_trial", "slots_per_gpu", "cpu_slots", "n_trials"):
        if int(sweeper[key]) < 1:
            raise SlotsError(f"hydra.sweeper.{key}={sweeper[key]}: must be at least 1")
    if sweeper.n_jobs is not None and int(sweeper.n_jobs) < 1:  # 0 and -1 mean "all" elsewhere: refused, not guessed
        raise SlotsError(f"hydra.sweeper.n_jobs={sweeper.n_jobs}: must be at least 1 (or null: one trial per slot)")
    devices = list(sweeper.devices) if sweeper.devices is not None else gpus.indices()
    if devices and sweeper.gpus_per_trial > len(devices):
        raise SlotsError(
            f"hydra.sweeper.gpus_per_trial={sweeper.gpus_per_trial} but this machine shows {len(devices)} GPU(s) "
            f"({devices}); lower gpus_per_trial or set hydra.sweeper.devices"
        )
    if not devices:  # each CPU slot its share of the cores, unless the user set OMP_NUM_THREADS
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // max(1, sweeper.cpu_slots)))
        return [Slot(f"cpu{i}", {"OMP_NUM_THREADS": threads}) for i in range(sweeper.cpu_slots)]
    per = sweeper.gpus_per_trial
    groups = [devices[i : i + per] for i in range(0, len(devices) - per + 1, per)]
    copies = sweeper.slots_per_gpu if per == 1 else 1
    # Trials at once share the machine's cores: each gets its share of CPU threads (as torchrun does), so that
    # five trials starting together do not run 5 x all-cores thread pools (tokenizing, collating, torch's own).
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // max(1, len(groups) * copies)))
    return [
        Slot(
            f"cuda{','.join(map(str, g))}" + (f"#{c}" if copies > 1 else ""),
            {"CUDA_VISIBLE_DEVICES": ",".join(map(str, g)), "OMP_NUM_THREADS": threads},
        )
        for g in groups
        for c in range(copies)
    ]
