"""Which GPUs this process may use and what the driver says about them, through NVML (the driver's management
library, which opens no CUDA context): one home for `CUDA_VISIBLE_DEVICES` and for NVML's set-up, read by the
sweep's slots and its card ledger, the trial's memory sampler, the forkserver's warm imports, preflight and the run's tags.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any


def visible() -> list[int] | None:
    """The physical indices `CUDA_VISIBLE_DEVICES` names, in its order; None when it is unset or empty of
    numbers (every GPU is visible). An empty string means no GPU: []."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [int(x) for x in value.split(",") if x.strip().isdigit()]


def physical_index(index: int) -> int:
    """The physical (NVML) index of the `index`-th device this process sees."""
    shown = visible()
    return shown[index] if shown else index


@functools.cache
def nvml() -> Any:
    """pynvml, initialized once per process; raises where there is no driver or library."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def handle(index: int = 0) -> Any:
    """NVML's handle of the `index`-th device this process sees."""
    return nvml().nvmlDeviceGetHandleByIndex(physical_index(index))


def indices() -> list[int]:
    """The GPUs a sweep may give its trials: `CUDA_VISIBLE_DEVICES`, else every GPU NVML shows ([] on a CPU)."""
    shown = visible()
    if shown is not None:
        return shown
    try:
        return list(range(nvml().nvmlDeviceGetCount()))
    except Exception:  # no driver, no library: no GPU
        return []


@contextlib.contextmanager
def nvml_once() -> Iterator[Any]:
    """pynvml, opened for one question and closed after it: the forkserver asks (src/sweep/warm.py) and then forks
    every trial, and the sweep's engine asks once, so neither keeps NVML open."""
    import pynvml

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def capability(index: int = 0) -> tuple[int, int]:
    """A visible device's compute capability, from NVML (no CUDA context)."""
    with nvml_once() as nv:
        major, minor = nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(physical_index(index)))
    return int(major), int(minor)


def total_gib(physical: int) -> float | None:
    """A card's memory in GiB by its physical (NVML) index, from NVML (no CUDA context); None where NVML cannot
    say (no driver, no library)."""
    try:
        with nvml_once() as nv:
            return nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(physical)).total / 1024**3
    except Exception:
        return None


def process_bytes(index: int, pid: int) -> int | None:
    """Device memory NVML attributes to process `pid` on a visible device, or None where NVML cannot see it."""
    try:
        for proc in nvml().nvmlDeviceGetComputeRunningProcesses(handle(index)):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:
        return None
    return None


def driver() -> dict[str, Any]:
    """What the driver says, independently of torch: `count` of GPUs, `version`, and `cuda_max` (the newest CUDA
    it supports); {} without a driver."""
    try:
        lib = nvml()
        cuda = lib.nvmlSystemGetCudaDriverVersion_v2()
        return {
            "count": lib.nvmlDeviceGetCount(),
            "version": str(lib.nvmlSystemGetDriverVersion()),
            "cuda_max": f"{cuda // 1000}.{cuda % 1000 // 10}",
        }
    except Exception:
        return {}


# Dense bf16 tensor-core peak, TFLOP/s (no sparsity; fp32 accumulate where the vendor quotes both), from each card's
# NVIDIA datasheet or architecture whitepaper: the denominator of the standard MFU. Longest names first, so
# "H100 PCIe" is not read as an H100 SXM.
BF16_DENSE_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM5 (NVIDIA H100 80GB HBM3)
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.05),
    ("L4", 121.0),
    ("RTX 6000 Ada", 364.2),
    ("RTX 4090", 165.2),
    ("RTX A6000", 154.8),
    ("RTX 3090", 71.0),
    ("A10", 125.0),
)


def bf16_peak_tflops(name: str) -> float | None:
    """The card's spec dense bf16 peak by its CUDA name ("NVIDIA H100 80GB HBM3" -> 989.4); None when unknown."""
    for key, peak in BF16_DENSE_TFLOPS:
        if key in name:
            return peak
    return None
