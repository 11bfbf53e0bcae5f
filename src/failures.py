"""What went wrong, in the contract's words: classify a failure by exception type and message (inside the
trial) or by exit code, signal and the tail of stderr (from outside, when the process died).

CUDA errors surface far from their kernel and with messages that change between releases (a sticky error
is often re-raised by the next synchronize or allocation as torch.AcceleratorError), so the patterns are
matched on the whole message, most specific first, and anything unknown is `other`, never a guess.
"""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass

KINDS = (
    "oom",
    "host_oom",
    "launch_failure",
    "illegal_memory_access",
    "device_assert",
    "cublas",
    "nccl",
    "segfault",
    "killed",
    "timeout",
    "nan_loss",
    "data_error",
    "config_error",
    "other",
)
# The faults src.faults injects (`fault.kind`); here, without torch, so the config guards check the key cheaply.
FAULT_KINDS = (
    "none",
    "oom",
    "launch_failure",
    "illegal_memory_access",
    "device_assert",
    "cublas",
    "nccl",
    "segfault",
    "hang",
    "nan_loss",
    "kill",
)
# Errors after which the CUDA context is poisoned: worth one re-run with CUDA_LAUNCH_BLOCKING=1.
STICKY_CUDA = ("launch_failure", "illegal_memory_access", "device_assert", "cublas")
# The process's faults, not the setting's: a fresh process from the last checkpoint may well get past them (a single
# run restarts on them, src/trial/attempts.py).
PROCESS_FAULTS = (
    "launch_failure",
    "illegal_memory_access",
    "device_assert",
    "cublas",
    "nccl",
    "segfault",
    "killed",
    "timeout",
    "host_oom",
)
# Failures caused by the setting's memory: the sampler should learn to avoid them (constraint violation). The
# card's memory only: `host_oom` (the machine's RAM ran out, or its OOM killer struck) says nothing about how much
# VRAM a setting needs, so it is the process's failure, like a segfault or a kill.
MEMORY = ("oom",)


class DataError(ValueError):
    """The data set cannot be used as configured (missing file or column, refused by preflight)."""


class ConfigError(ValueError):
    """The configuration cannot work (a guard refused it before any GPU time was spent)."""


class NanLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


@dataclass
class Failure:
    kind: str
    message: str
    step: int | None = None
    rank: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# The device's allocators name their device; an allocation failure that names none is the host's.
_DEVICE_OOM = (
    r"(CUDA|HIP|XPU|MPS backend) out of memory|CUDA (error|driver error|failure):? '?out of memory|"
    r"torch\.(cuda\.)?OutOfMemoryError|"
    r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|"
    r"out of memory at line \d+ in file \S+\.cu\b"  # bitsandbytes' CUDA check: the driver's words, then its file
)
# The host: torch's CPU allocator, Python, libc's ENOMEM, the kernel's OOM killer (dmesg) and SLURM's cgroup.
_HOST_OOM = (
    r"DefaultCPUAllocator|can't allocate memory|Cannot allocate memory|\bMemoryError\b|std::bad_alloc|"
    r"Out of memory: Kill(ed)? process|oom[-_]kill|out-of-memory handler|out of memory"
)

# (kind, pattern) in order: the first match wins.
_PATTERNS = [
    ("oom", _DEVICE_OOM),
    ("host_oom", _HOST_OOM),
    ("launch_failure", r"unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED|launch timed out"),
    (
        "illegal_memory_access",
        r"illegal memory access|illegal address|misaligned address|"
        r"operation not supported on global/shared address space|CUDA_ERROR_ILLEGAL_ADDRESS",
    ),
    ("device_assert", r"device-side assert|CUDA_ERROR_ASSERT"),
    ("cublas", r"CUBLAS_STATUS|cublas"),
    ("nccl", r"\bNCCL\b|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|ProcessGroupNCCL"),
    ("nan_loss", r"NanLossError|loss (is|became) (nan|inf)"),
    ("segfault", r"Segmentation fault|SIGSEGV|Fatal Python error: (Segmentation|Bus error)"),
    # Hydra/OmegaConf refusing the composed config (a trial process that died before it could record)
    (
        "config_error",
        r"Could not override|Error merging override|ConfigCompositionException|ValidationError|"
        r"MissingMandatoryValue|is not in struct|Could not find '|Could not append to config",
    ),
    ("data_error", r"DataError"),
]
_COMPILED = [(kind, re.compile(pat, re.IGNORECASE)) for kind, pat in _PATTERNS]

_CONFIG_TYPES = (
    "ConfigError",
    "ConfigCompositionException",
    "ConfigKeyError",
    "ConfigAttributeError",
    "ValidationError",
    "MissingMandatoryValue",
    "InterpolationResolutionError",
    "OverrideParseException",
)


def first_line(text: str) -> str:
    """The message's first line with content; where it ends in a colon and the cause follows on the next line (torch
    compile's "BackendCompilerFailed: backend='inductor' raised:"), that line too: a first line that only says
    something raised tells nothing."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"[:500]
    return lines[0][:500]


def classify_text(text: str) -> str | None:
    for kind, pattern in _COMPILED:
        if pattern.search(text):
            return kind
    return None


def classify_exception(exc: BaseException) -> str:
    """The kind of an exception caught inside the trial process."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "MemoryError" in names:
        return "host_oom"
    if "OutOfMemoryError" in names:  # torch's, raised by a device allocator (the CPU one raises RuntimeError)
        return "host_oom" if classify_text(str(exc)) == "host_oom" else "oom"
    if "NanLossError" in names:
        return "nan_loss"
    if "DataError" in names:
        return "data_error"
    if names & set(_CONFIG_TYPES):
        return "config_error"
    text = f"{type(exc).__name__}: {exc}"
    kind = classify_text(text)
    if kind:
        return kind
    if "DistBackendError" in names:
        return "nccl"
    return "other"


def classify_exit(returncode: int, stderr_tail: str = "", *, timed_out: bool = False) -> str:
    """The kind of a trial process that ended without recording its own failure."""
    if timed_out:
        return "timeout"
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and classify_text(stderr_tail) == "host_oom":
        return "host_oom"  # the kernel's OOM killer (or SLURM's cgroup) said so; a bare SIGKILL stays `killed`
    if returncode < 0:
        sig = -returncode
        if sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE):
            return "segfault"
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            return "killed"
        if sig == signal.SIGABRT:
            return classify_text(stderr_tail) or "segfault"
    # Python's faulthandler prints the fault and exits with the signal's status; shells report 128+N.
    if returncode in (128 + signal.SIGSEGV, 128 + signal.SIGBUS):
        return "segfault"
    if returncode in (128 + signal.SIGKILL, 128 + signal.SIGTERM):
        return "killed"
    return classify_text(stderr_tail) or "other"


_GIB = 1024**3
_UNITS = {"B": 1, "K": 1024, "M": 1024**2, "G": _GIB, "T": 1024**4}
_SIZE = r"([\d.]+) ?([KMGT]i?B|bytes|B)"  # a size as torch prints it (format_size): "2.00 GiB", "20.00 MiB", "0 bytes"


def _size_gib(pattern: str, message: str) -> float | None:
    """The size torch printed where `pattern`'s {size} stands, in GiB; None where the message does not say."""
    m = re.search(pattern.format(size=_SIZE), message, re.IGNORECASE)
    return float(m.group(1)) * _UNITS[m.group(2)[0].upper()] / _GIB if m else None


def oom_request_gib(message: str) -> float | None:
    """The size of the allocation an OOM message says failed ("Tried to allocate 2.00 GiB"), in GiB."""
    return _size_gib("Tried to allocate {size}", message)


def oom_card_free_gib(message: str) -> float | None:
    """What an OOM message says was free on the whole card ("... of which 20.00 MiB is free"), in GiB."""
    return _size_gib("of which {size} is free", message)


# Slack for the allocator's rounding (2 MiB blocks) and the message's two decimals
_CAP_SLACK_GIB = 0.1


def card_ran_out(metrics: dict[str, float]) -> bool:
    """Whether an OOM was the card's, not the trial's budget: the card had less free than the allocation asked,
    while what the trial held (its peak) plus the allocation stayed under its allocator's cap (`allocator_cap_gib`:
    the budget less the CUDA context). Only a trial capped below its card can tell; on a card it shares with other
    processes, such an OOM says nothing of the setting."""
    free, asked = metrics.get("oom_card_free_gib"), metrics.get("oom_request_gib")
    held, cap = metrics.get("peak_vram_reserved_gib"), metrics.get("allocator_cap_gib")
    if free is None or asked is None or held is None or cap is None:
        return False
    return free < asked and held + asked < cap - _CAP_SLACK_GIB


def oom_needed_gib(metrics: dict[str, float], budget_gib: float) -> float:
    """What an OOM trial needed, as measured: what its allocator held at the failure plus the allocation that
    failed (the budget stands in for a peak that was not recorded)."""
    return metrics.get("peak_vram_reserved_gib", budget_gib) + metrics.get("oom_request_gib", 0.0)
