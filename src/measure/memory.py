"""Memory of one trial: the allocator cap that makes a large card fail where the budget's card would, and NVML's view
of the whole process on the device (CUDA context, cuBLAS workspaces, NCCL buffers), which torch's allocator misses.
"""

from __future__ import annotations

import os
import threading

import torch

from src import gpus

GIB = 1024**3


def cap_to_budget(budget_gib: float) -> dict[str, float]:
    """Cap this process's caching allocator so it can hold at most what a `budget_gib` card leaves after the
    CUDA context; torch then raises a real OutOfMemoryError where the smaller card would."""
    if not torch.cuda.is_available():
        return {}
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # create the context so NVML can see what it costs
    total = torch.cuda.get_device_properties(0).total_memory
    context = _nvml_process_bytes() or 0
    usable = budget_gib * GIB - context
    if usable >= total:
        return {"cuda_context_gib": context / GIB, "device_total_gib": total / GIB}
    # Every card the trial sees is the budget's size (a model-parallel trial spans several).
    for device in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(max(usable, 0) / total, device=device)
    return {"cuda_context_gib": context / GIB, "device_total_gib": total / GIB, "allocator_cap_gib": usable / GIB}


def _nvml_process_bytes() -> int | None:
    """Device memory NVML attributes to this process on its current device, or None where NVML cannot see it."""
    return gpus.process_bytes(torch.cuda.current_device(), os.getpid())


class NvmlSampler(threading.Thread):
    """Peak device memory of this process as NVML sees it, sampled every `interval` seconds (NVML keeps no peak)."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        # CUDA's current device is per thread: the sampler's own thread would see device 0, not the rank's card.
        self.device = torch.cuda.current_device()
        self.peak = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            used = gpus.process_bytes(self.device, os.getpid())
            if used is not None:
                self.peak = max(self.peak, used)
            self._halt.wait(self.interval)

    def stop(self) -> float | None:
        self._halt.set()
        self.join(timeout=2)
        return self.peak / GIB if self.peak else None
