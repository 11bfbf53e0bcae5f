"""Fault injection: make a trial fail at `fault.step` the way real trials fail, to check that the pipeline
catches, classifies and records it (tests, and users checking their own set-up).

Where the platform allows, the fault is the real thing: an allocation past the allocator's cap (a real
torch.OutOfMemoryError), a CUDA kernel that traps or writes out of bounds (CuPy, on a GPU), a real
SIGSEGV, a SIGKILL sent by another process, a NaN that flows through the weights into the loss, a hang.
On a CPU the CUDA errors are raised as the RuntimeError torch raises for them, with the driver's words.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import time
from typing import Any

import torch
from transformers import TrainerCallback

from src.failures import FAULT_KINDS

_CUDA_MESSAGES = {
    "launch_failure": "CUDA error: unspecified launch failure",
    "illegal_memory_access": "CUDA error: an illegal memory access was encountered",
    "device_assert": "CUDA error: device-side assert triggered",
    "cublas": "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, ...)`",
    "nccl": "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.27.3",
}
_HINT = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)

_TRAP_KERNEL = r"""extern "C" __global__ void trap() { asm("trap;"); }"""
_OOB_KERNEL = r"""extern "C" __global__ void oob(float* p) { p[(1ull << 40) + threadIdx.x] = 1.0f; }"""


def _cuda_fault(kind: str) -> None:
    if torch.cuda.is_available():
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None and kind in ("launch_failure", "illegal_memory_access"):
            source, name = (_TRAP_KERNEL, "trap") if kind == "launch_failure" else (_OOB_KERNEL, "oob")
            kernel = cupy.RawKernel(source, name)
            args = () if name == "trap" else (cupy.zeros(1, dtype=cupy.float32),)
            kernel((1,), (1,), args)
            torch.cuda.synchronize()  # the sticky error surfaces here, as torch.AcceleratorError
        if kind == "device_assert":
            torch.arange(4, device="cuda")[torch.tensor([10], device="cuda")]
            torch.cuda.synchronize()
    error = getattr(torch, "AcceleratorError", RuntimeError)
    raise error(_CUDA_MESSAGES[kind] + _HINT)


def _oom() -> None:
    if torch.cuda.is_available():
        # Past the budget cap: the caching allocator raises the real torch.OutOfMemoryError.
        free, total = torch.cuda.mem_get_info()
        torch.empty(int(total * 2), dtype=torch.uint8, device="cuda")
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 64.00 GiB. GPU 0 has a total capacity of 24.00 GiB of which "
        "0 bytes is free. (injected on a CPU)"
    )


def _nan(model: Any) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_B" in name:
                param.fill_(float("nan"))
                return


class FaultInjector(TrainerCallback):
    """`kind` at optimizer step `step`: when it begins (`during="step"`), or while its checkpoint is being written,
    before it is committed (`during="save"`, src/checkpoints.py calls `at_save`). `fires=False`: a single run's
    attempt past the first `fault.times` (a transient fault does not come back)."""

    def __init__(self, kind: str, step: int, rank: int | None = None, during: str = "step", fires: bool = True) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault.kind: unknown '{kind}'; one of {', '.join(FAULT_KINDS)}")
        self.kind, self.step, self.during = kind, step, during
        # In a data-parallel trial only the chosen rank fails (RANK is set by the launcher).
        self.armed = fires and (rank is None or int(os.environ.get("RANK", "0")) == rank)

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.during == "step" and state.global_step + 1 == self.step:
            self._fire(model)

    def at_save(self, step: int) -> None:
        if self.during == "save" and step == self.step:
            self._fire(None)

    def _fire(self, model: Any) -> None:
        if self.kind == "none" or not self.armed:
            return
        if self.kind == "oom":
            _oom()
        elif self.kind in _CUDA_MESSAGES:
            _cuda_fault(self.kind)
        elif self.kind == "segfault":
            ctypes.string_at(0)  # a real SIGSEGV: reads address 0
        elif self.kind == "hang":
            while True:  # stops making progress; only the watchdog ends it
                time.sleep(60)
        elif self.kind == "nan_loss":
            _nan(model)
        elif self.kind == "kill":
            # SIGKILL from another process, as the kernel's OOM killer or an operator would send it.
            subprocess.run(["kill", "-9", str(os.getpid())], check=False)
            time.sleep(60)
