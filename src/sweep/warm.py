"""Import the training stack (bitsandbytes, peft, trl) without initializing CUDA, for the forkserver to preload.

bitsandbytes asks torch for every GPU's compute capability as it loads (to pick its CUDA library), and that
question initializes CUDA; a process forked after that cannot use the GPU. peft, trl and `transformers.Trainer`
import bitsandbytes, so without this module all four load in every trial: 3-4 s of each trial's start-up on the
H200 (benchmarks/NOTES.md §4). Here the capability is read from NVML (the driver's management library, which
opens no CUDA context) for the duration of those imports, and torch's own function is put back afterwards.

`src.sweep.launcher.DEFAULT_PRELOAD` lists this module; the forkserver's probe child checks that CUDA still works after
the fork, and falls back to fresh interpreters if it does not.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from src import gpus

log = logging.getLogger(__name__)

STACK = ("bitsandbytes", "peft", "trl", "transformers.trainer")


def nvml_capability(device: Any = None) -> tuple[int, int]:
    """torch.cuda.get_device_capability, answered by NVML (no CUDA context). `device` as torch takes it."""
    if isinstance(device, torch.cuda.device):
        index = device.idx
    elif isinstance(device, torch.device):
        index = device.index or 0
    elif isinstance(device, str):
        index = torch.device(device).index or 0
    else:
        index = 0 if device is None else int(device)
    return gpus.capability(index)


@contextlib.contextmanager
def capability_from_nvml() -> Iterator[None]:
    """Within: torch.cuda.get_device_capability reads NVML instead of initializing CUDA (where CUDA is not
    initialized yet and NVML answers); torch's own function afterwards."""
    original = torch.cuda.get_device_capability
    if torch.cuda.is_initialized() or not torch.cuda.is_available():
        yield
        return
    try:
        nvml_capability(0)
    except Exception as exc:  # no NVML: leave torch alone (and the import then initializes CUDA)
        log.debug("NVML cannot answer the device capability (%s)", exc)
        yield
        return
    torch.cuda.get_device_capability = nvml_capability
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original


def import_stack() -> list[str]:
    """Import STACK without creating a CUDA context; the modules that imported."""
    import importlib

    done = []
    with capability_from_nvml():
        for name in STACK:
            try:
                importlib.import_module(name)
            except ImportError as exc:
                log.debug("not preloaded: %s (%s)", name, exc)
                continue
            done.append(name)
    return done


import_stack()  # the forkserver preloads by importing this module
