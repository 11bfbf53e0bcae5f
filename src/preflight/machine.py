"""The machine preflight runs on: versions, GPUs, driver and CUDA, the bitsandbytes native library and bf16,
recorded in the report's environment (the tags every trial carries) and checked."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig

from src import gpus, tracking
from src.preflight.report import Report
from src.preflight.versions import check_versions


def environment(cfg: DictConfig, report: Report) -> None:
    """The machine's facts (the tags every trial carries, and more) and the checks that depend on them."""
    import torch  # here, not at the top: the sweep's own checks import this package without the training stack

    env = report.environment
    env.update(tracking.system_tags())
    env["torch.cuda_build"] = str(torch.version.cuda or "none (CPU build)")
    driver = gpus.driver()  # independently of torch
    count, driver_cuda = driver.get("count", 0), driver.get("cuda_max")
    if driver_cuda:
        env["cuda.driver_max"] = driver_cuda
    if count and not torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        report.add(
            "cuda",
            "error",
            f"the driver shows {count} GPU(s) but torch cannot use them: torch {torch.__version__} is built for "
            f"CUDA {torch.version.cuda or 'none (a CPU build)'} and the driver supports CUDA up to "
            f"{driver_cuda or 'unknown'}. Install a torch build for CUDA <= {driver_cuda or 'the driver'} "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu<version>) or update the driver",
        )
    wants_bf16 = cfg.trainer.bf16 or "bfloat16" in (cfg.model.quantization.bnb_4bit_compute_dtype, cfg.model.dtype)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        names = sorted({torch.cuda.get_device_properties(i).name for i in range(torch.cuda.device_count())})
        if len(names) > 1:
            env["gpu.names"] = ", ".join(names)
        env["bf16.supported"] = str(torch.cuda.is_bf16_supported()).lower()
        if wants_bf16 and not torch.cuda.is_bf16_supported():
            report.add(
                "bf16",
                "error",
                f"{props.name} (compute capability {props.major}.{props.minor}) has no bf16; set trainer.bf16=false "
                "model.quantization.bnb_4bit_compute_dtype=float16 model.dtype=float16",
            )
    else:
        env["bf16.supported"] = "cpu"  # CPU autocast runs bf16 everywhere torch does
    env["bitsandbytes.native"] = _bnb_native(report)
    check_versions(_version_facts(), report)


def _bnb_native(report: Report) -> str:
    """Which native bitsandbytes library serves this process (a CPU-only or missing library silently breaks
    4-bit on a GPU: bitsandbytes only warns and falls back)."""
    import torch

    try:
        from bitsandbytes import cextension
    except Exception as exc:
        report.add("bitsandbytes", "error", f"bitsandbytes failed to import: {type(exc).__name__}: {exc}")
        return "missing"
    lib = cextension.lib
    mock = getattr(cextension, "ErrorHandlerMockBNBNativeLibrary", None)
    if mock is not None and isinstance(lib, mock):
        name, with_cuda = "none (failed to load)", False
    else:
        name = Path(str(getattr(getattr(lib, "_lib", None), "_name", "") or "")).name or "unknown"
        with_cuda = bool(getattr(lib, "compiled_with_cuda", "cuda" in name))
    if torch.cuda.is_available() and not with_cuda:
        report.add(
            "bitsandbytes",
            "error",
            f"bitsandbytes {_installed('bitsandbytes')} loaded '{name}' on a CUDA {torch.version.cuda} machine: "
            "4-bit layers would fail or run on the CPU. Install a bitsandbytes build that ships a library for "
            f"CUDA {torch.version.cuda} (see the known-bad table), or set BNB_CUDA_VERSION to one it has",
        )
    elif torch.cuda.is_available() and os.environ.get("BNB_CUDA_VERSION"):
        report.add(
            "bitsandbytes",
            "warning",
            f"BNB_CUDA_VERSION={os.environ['BNB_CUDA_VERSION']} makes bitsandbytes load '{name}' although torch "
            f"runs CUDA {torch.version.cuda}; unset BNB_CUDA_VERSION unless that mismatch is intended",
        )
    return name


def _installed(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _version_facts() -> dict[str, str]:
    """Installed versions, plus `python` and (where a GPU is usable) the `cuda` runtime torch uses."""
    import torch

    facts = dict(tracking.versions())
    facts["python"] = platform.python_version()
    if torch.cuda.is_available() and torch.version.cuda:
        facts["cuda"] = str(torch.version.cuda)
    return facts
