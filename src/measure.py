"""Honest measurement of one trial: peak memory three ways, throughput over warm steps only.

- torch's allocator peaks (allocated, reserved) are exact and cover every step, warm-up included: the
  peak is what decides OOM, whenever it happens.
- NVML sees the whole process on the device (CUDA context, cuBLAS workspaces, NCCL buffers); a thread
  samples it, since it has no peak counter.
- tokens/s counts non-padding tokens (the trainer's `num_input_tokens_seen` in "non_padding" mode) over
  the steps after `measure.warmup_steps`, timed between synchronized step ends.
- useful model FLOPs (for MFU) are counted from the real rows of every micro-batch: see `FlopCounter`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

from src.failures import NanLossError

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


@functools.cache
def _nvml_handle() -> Any:
    """This process's device, resolved once (the sampler asks every few milliseconds)."""
    import pynvml

    pynvml.nvmlInit()
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        index = int(visible.split(",")[index])
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def _nvml_process_bytes() -> int | None:
    """Device memory NVML attributes to this process, or None where NVML cannot see it."""
    try:
        import pynvml

        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(_nvml_handle()):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:
        return None
    return None


class NvmlSampler(threading.Thread):
    """Peak device memory of this process as NVML sees it, sampled every `interval` seconds."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            used = _nvml_process_bytes()
            if used is not None:
                self.peak = max(self.peak, used)
            self._halt.wait(self.interval)

    def stop(self) -> float | None:
        self._halt.set()
        self.join(timeout=2)
        return self.peak / GIB if self.peak else None


class FlopCounter:
    """Useful training FLOPs of each micro-batch, from its real (non-padding) row lengths.

    Counted per row of L tokens: 4 x P x L for the matmuls (forward 2PL, backward to the inputs 2PL; the
    frozen 4-bit weights get no weight gradient, LoRA's own weight gradients are under 1% and not counted),
    with P the weights of every Linear the forward runs (the 4-bit projections, LoRA A/B, lm_head); plus
    causal attention 6 x layers x d x L^2 (QK^T and AV cost 2 x L^2 x d over the causal half, backward twice
    the forward). Padding, and the forward that gradient checkpointing recomputes, do not count as work:
    the hook sits on the whole model's forward, which runs once per micro-batch, not per recompute.
    """

    def __init__(self, model: Any) -> None:
        config = model.config
        self.layers = int(config.num_hidden_layers)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.attn_width = int(config.num_attention_heads * head_dim)
        self.params = sum(
            int(m.in_features) * int(m.out_features)
            for m in model.modules()
            if hasattr(m, "in_features") and hasattr(m, "out_features") and isinstance(m, torch.nn.Linear)
        )
        self.pending: list[Any] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        lengths = _row_lengths(kwargs)
        if lengths is not None:
            self.pending.append(lengths)

    def take(self) -> float:
        """FLOPs of the micro-batches since the last call."""
        total = 0.0
        for lengths in self.pending:
            lengths = lengths.double()
            total += 4.0 * self.params * float(lengths.sum()) + 6.0 * self.layers * self.attn_width * float(
                (lengths**2).sum()
            )
        self.pending = []
        return total


def _row_lengths(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Real lengths of the rows in a batch: from the attention mask, else from padding-free position ids."""
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return mask.sum(dim=-1)
    positions = kwargs.get("position_ids")
    if positions is not None:
        flat = positions.reshape(-1)
        starts = torch.nonzero(flat == 0).reshape(-1)
        ends = torch.cat([starts[1:], torch.tensor([flat.numel()], device=flat.device)])
        return ends - starts
    ids = kwargs.get("input_ids")
    if ids is not None:
        return torch.full((ids.shape[0],), ids.shape[-1], device=ids.device)
    return None


def trial_started() -> float:
    """When this trial was launched: the engine's clock at launch (QLORA_TRIAL_STARTED, so a forked trial counts
    its fork too), else this process's start. The kernel's process start time is only as exact as its boot time
    (whole seconds), so it can be up to a second early."""
    from src.launcher import STARTED_ENV

    launched = os.environ.get(STARTED_ENV)
    if launched:
        with contextlib.suppress(ValueError):
            return float(launched)
    return psutil.Process().create_time()


class Measurements(TrainerCallback):
    """Collects per-step time, tokens and memory; writes `progress.json` at every step for the watchdog."""

    def __init__(self, cfg: Any, progress_path: Path, world_size: int = 1) -> None:
        self.warmup = cfg.measure.warmup_steps
        self.samples_per_step = (
            cfg.trainer.per_device_train_batch_size * cfg.trainer.gradient_accumulation_steps * world_size
        )
        self.progress_path = progress_path
        self.cuda = torch.cuda.is_available()
        self.steps: list[dict[str, float]] = []
        self.losses: list[float] = []
        self.step = 0
        self.startup_s: float | None = None
        self._last_t = 0.0
        self._last_tokens = 0
        self.flops: FlopCounter | None = None
        self.nvml = NvmlSampler(cfg.measure.nvml_interval_s) if self.cuda else None
        if self.nvml:
            self.nvml.start()
        self.write_progress("loading")

    def write_progress(self, phase: str) -> None:
        tmp = self.progress_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"phase": phase, "step": self.step, "time": time.time()}))
        tmp.replace(self.progress_path)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self.flops = FlopCounter(model)
        self._sync()
        # The per-trial fixed cost: the trial's launch (imports included) to the first step.
        self.startup_s = time.time() - trial_started()
        self._last_t = time.perf_counter()
        self._last_tokens = state.num_input_tokens_seen
        self.write_progress("training")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        now = time.perf_counter()
        tokens = state.num_input_tokens_seen
        self.step = state.global_step
        record = {"step": self.step, "time_s": now - self._last_t, "tokens": tokens - self._last_tokens}
        if self.flops is not None:
            record["flops"] = self.flops.take()
        if self.cuda:
            record["vram_reserved_gib"] = torch.cuda.memory_reserved() / GIB
            record["vram_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        self.steps.append(record)
        self._last_t, self._last_tokens = now, tokens
        self.write_progress("training")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        self.losses.append(float(loss))
        if not math.isfinite(float(loss)):
            raise NanLossError(f"loss became {loss} at step {state.global_step}")

    def summary(self) -> dict[str, float]:
        """The contract's per-trial metrics from what was measured (partial if the trial failed)."""
        m: dict[str, float] = {"peak_rss_gib": _max_rss_gib()}
        if self.startup_s is not None:
            m["startup_s"] = self.startup_s
        if self.cuda:
            m["peak_vram_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            m["peak_vram_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
            if torch.cuda.device_count() > 1:  # model parallel: each card's peak, the largest is the trial's
                for d in range(torch.cuda.device_count()):
                    m[f"peak_vram_allocated_gib.cuda{d}"] = torch.cuda.max_memory_allocated(d) / GIB
                    m[f"peak_vram_reserved_gib.cuda{d}"] = torch.cuda.max_memory_reserved(d) / GIB
                m["peak_vram_allocated_gib"] = max(
                    m[f"peak_vram_allocated_gib.cuda{d}"] for d in range(torch.cuda.device_count())
                )
                m["peak_vram_reserved_gib"] = max(
                    m[f"peak_vram_reserved_gib.cuda{d}"] for d in range(torch.cuda.device_count())
                )
            stats = torch.cuda.memory_stats()
            m["alloc_retries"] = float(stats.get("num_alloc_retries", 0))
            m["alloc_ooms"] = float(stats.get("num_ooms", 0))
            device = self.nvml.stop() if self.nvml else None
            if device is not None:
                m["peak_vram_device_gib"] = device
        else:
            # No device: the trial held no device memory.
            m["peak_vram_allocated_gib"] = 0.0
            m["peak_vram_reserved_gib"] = 0.0
        measured = self.steps[self.warmup :]
        if measured:
            seconds = sum(s["time_s"] for s in measured)
            m["step_time_s"] = statistics.median(s["time_s"] for s in measured)
            m["tokens_per_s"] = sum(s["tokens"] for s in measured) / seconds
            m["samples_per_s"] = self.samples_per_step * len(measured) / seconds
            m["measured_steps"] = float(len(measured))
            if all("flops" in s for s in measured):
                # Useful model FLOP/s (FlopCounter); MFU is this over the card's measured bf16 matmul rate.
                m["model_tflops_per_s"] = sum(s["flops"] for s in measured) / seconds / 1e12
                m["model_params_matmul"] = float(self.flops.params)
        if self.steps:
            m["first_step_s"] = self.steps[0]["time_s"]
        if self.losses:
            m["train_loss"] = statistics.fmean(self.losses)
        return m


def _max_rss_gib() -> float:
    import resource

    # ru_maxrss is in KiB on Linux: the process's true peak, not a sample.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


class _DispatchedOps(TorchDispatchMode):
    """Names of the aten ops that reach the kernels while active (below autograd and autocast)."""

    def __init__(self, wanted: set[str]) -> None:
        super().__init__()
        self.wanted = wanted
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name in self.wanted:
            self.seen.add(name)
        return func(*args, **(kwargs or {}))


class AttentionProbe(TrainerCallback):
    """Records which scaled-dot-product-attention kernel the model's attention actually dispatched to.

    SDPA silently falls back to its quadratic-memory math path when, e.g., activations are fp32; only the
    dispatched aten op says which path ran. A dispatch mode watches one forward of the first attention module
    at step `at_step` (a warm-up step). It sees the fused kernel's op; the math path decomposes into plain ops,
    and SDPA's own `_safe_softmax` among them names it. (No profiler: torch.profiler's teardown aborted a
    data-parallel rank now and then.)
    """

    OPS = {
        "aten::_scaled_dot_product_flash_attention": "flash",
        "aten::_scaled_dot_product_efficient_attention": "efficient",
        "aten::_scaled_dot_product_cudnn_attention": "cudnn",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
        "aten::_scaled_dot_product_attention_math": "math",
        "aten::_safe_softmax": "math",
        "aten::_efficient_attention_forward": "efficient",
        "aten::_flash_attention_forward": "flash",
        "torch_attn::_varlen_attn": "flash_varlen",  # model.attn_implementation=varlen (src/attention.py)
    }

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step
        self.kernels: set[str] = set()
        self._hooks: list[Any] = []
        self._mode: _DispatchedOps | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step + 1 != self.at_step or model is None:
            return
        attention = next((m for m in model.modules() if type(m).__name__.endswith("Attention")), None)
        if attention is not None:
            self._hooks = [
                attention.register_forward_pre_hook(self._start),
                attention.register_forward_hook(self._stop),
            ]

    def _start(self, *_: Any) -> None:
        self._mode = _DispatchedOps(set(self.OPS))
        self._mode.__enter__()

    def _stop(self, *_: Any) -> None:
        if self._mode is None:
            return
        self._mode.__exit__(None, None, None)
        self.kernels = {self.OPS[op] for op in self._mode.seen} or {"unknown"}
        self._mode = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    @property
    def tag(self) -> str:
        return ",".join(sorted(self.kernels)) or "not_profiled"


# Kernel families of a QLoRA step, matched on the kernel's name (first match wins).
KERNEL_FAMILIES = (
    ("bitsandbytes dequantize", ("dequant", "kDequantize")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "matmul", "addmm", "aten::mm", "aten::bmm")),
    ("optimizer", ("adam", "optimizer")),
    ("copy and cast", ("copy", "cast", "to_copy", "memcpy", "memset", "fill")),
    ("normalization", ("norm", "rsqrt")),
)


def kernel_family(name: str) -> str:
    lowered = name.lower()
    for family, needles in KERNEL_FAMILIES:
        if any(n.lower() in lowered for n in needles):
            return family
    return "other (elementwise, reductions, ...)"


class StepProfiler(TrainerCallback):
    """torch.profiler over one step: where that step's time went, by kernel family and by kernel.

    On a GPU the table is GPU kernel time (self device time per kernel); without one, CPU op time. The first
    line sets that total against the step's wall time: a GPU busy well under 100% of the step is waiting on the
    host (Python, kernel launches, synchronisation), which no faster kernel fixes. The host side follows: the
    ops with the most CPU time of their own. Written to `path` (and logged by the trial as an artifact)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path
        self._prof: Any = None
        self._t0 = 0.0
        self.wall_s = 0.0
        self.text: str | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        self.text = self.summarize(self._prof.key_averages())
        self._prof = None
        self.path.write_text(self.text)

    def summarize(self, events: Any) -> str:
        cuda = torch.cuda.is_available()
        rows = []
        for evt in events:
            if cuda:
                if "CUDA" not in str(getattr(evt, "device_type", "")):
                    continue
                us = float(getattr(evt, "self_device_time_total", 0.0))
            else:
                us = float(evt.self_cpu_time_total)
            if us > 0:
                rows.append((evt.key, us, int(evt.count)))
        if cuda and not rows:  # kernels not listed apart: the ops, with the device time of their kernels
            rows = [
                (evt.key, float(getattr(evt, "self_device_time_total", 0.0)), int(evt.count))
                for evt in events
                if getattr(evt, "self_device_time_total", 0.0) > 0
            ]
        total = sum(us for _, us, _ in rows) or 1.0
        families: dict[str, float] = {}
        for name, us, _ in rows:
            family = kernel_family(name)
            families[family] = families.get(family, 0.0) + us
        what = "GPU kernel time" if cuda else "CPU op time (no GPU)"
        wall_ms = 1e3 * self.wall_s
        head = f"Step {self.step}: {total / 1e3:.1f} ms of {what}"
        if cuda and wall_ms > 0:
            head += f" in {wall_ms:.1f} ms of wall time: the GPU ran kernels {100 * total / 1e3 / wall_ms:.0f}% of it"
        lines = [head, "", "By family:"]
        lines += [
            f"  {f:38} {us / 1e3:10.1f} ms {100 * us / total:5.1f}%"
            for f, us in sorted(families.items(), key=lambda kv: -kv[1])
        ]
        lines += ["", "Heaviest kernels:", f"  {'ms':>9} {'%':>5} {'calls':>6}  name"]
        for name, us, count in sorted(rows, key=lambda r: -r[1])[:30]:
            lines.append(f"  {us / 1e3:9.1f} {100 * us / total:5.1f} {count:6d}  {name[:120]}")
        if cuda:  # the host side: where the CPU time went while it fed the GPU
            host = sorted(
                ((evt.key, float(evt.self_cpu_time_total), int(evt.count)) for evt in events),
                key=lambda r: -r[1],
            )
            cpu_total = sum(us for _, us, _ in host) or 1.0
            lines += ["", f"Host: {cpu_total / 1e3:.1f} ms of CPU time in ops; the heaviest:"]
            lines += [f"  {'ms':>9} {'%':>5} {'calls':>6}  op"]
            for name, us, count in host[:15]:
                lines.append(f"  {us / 1e3:9.1f} {100 * us / cpu_total:5.1f} {count:6d}  {name[:120]}")
        return "\n".join(lines) + "\n"
