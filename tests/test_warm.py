"""The forkserver's preload of bitsandbytes, peft and trl (src/sweep/warm.py): bitsandbytes' question about the GPU is
answered by NVML while they import, so no CUDA context exists before trials are forked, and torch's own
function is back afterwards."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from src.config import PROJECT_DIR
from src.sweep import launcher, warm


def _fake_nvml(capabilities: dict[int, tuple[int, int]]) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetCudaComputeCapability = lambda handle: capabilities[handle]
    return nvml


def test_capability_comes_from_nvml_for_the_visible_device_and_torch_gets_its_function_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml({0: (8, 0), 1: (9, 0)}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # torch's device 0 is NVML's device 1
    original = torch.cuda.get_device_capability
    with warm.capability_from_nvml():
        assert torch.cuda.get_device_capability() == (9, 0)
        assert torch.cuda.get_device_capability(torch.cuda.device(0)) == (9, 0)  # as bitsandbytes asks
        assert torch.cuda.get_device_capability("cuda:0") == (9, 0)
    assert torch.cuda.get_device_capability is original


def test_torch_is_left_alone_where_nvml_cannot_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = types.ModuleType("pynvml")
    broken.nvmlInit = lambda: (_ for _ in ()).throw(OSError("libnvidia-ml.so.1 not found"))
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    original = torch.cuda.get_device_capability
    with warm.capability_from_nvml():
        assert torch.cuda.get_device_capability is original


def test_the_preload_imports_the_stack_without_a_cuda_context() -> None:
    assert "src.sweep.warm" in launcher.DEFAULT_PRELOAD
    code = (
        "import sys, torch, src.sweep.warm; "
        "print(sorted(m for m in src.sweep.warm.STACK if m in sys.modules), torch.cuda.is_initialized())"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"{sorted(warm.STACK)} False"


def test_a_preload_that_leaves_children_unable_to_use_cuda_makes_trials_start_fresh(tmp_path) -> None:
    # What initializing CUDA in the forkserver does to its children, where no GPU can show it: torch reports the
    # child as forked from a process with a CUDA context. The probe child must see it, and the engine falls back.
    (tmp_path / "cuda_before_fork.py").write_text("import torch\ntorch.cuda._is_in_bad_fork = lambda: True\n")
    code = "from src.sweep import launcher; print('context:', launcher.forkserver(['torch', 'cuda_before_fork']))"
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{PROJECT_DIR}"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "context: None"
    assert "cannot use CUDA" in done.stderr and "fresh interpreters" in done.stderr


def test_the_forkserver_silences_the_libraries_harmless_lines_before_it_preloads_them() -> None:
    """The forkserver is a fresh interpreter that imports src.sweep.tether first, then the stack: bitsandbytes on an
    AVX512-BF16 CPU logged "Failed to load CPU gemm_4bit_forward from kernels-community" to the sweep's terminal at
    every `make demo`. Its first import quiets what src/quiet.py quiets, as a trial's entry point does."""
    code = (
        "import logging, warnings, src.sweep.tether; "
        "print(logging.getLogger('bitsandbytes.backends.cpu.ops').level == logging.ERROR, "
        "any('Paged optimizers' in str(f[1].pattern) for f in warnings.filters if f[1] is not None))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
