"""Which kernels a step ran: the attention kernel SDPA dispatched to (AttentionProbe), and where one step's time
went by kernel family (StepProfiler).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback


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
        # eager attention (transformers' eager_attention_forward): a plain softmax over the L x L scores, which
        # are kept for the backward. SDPA's math path has a softmax of its own, so this counts only without SDPA.
        "aten::_softmax": "eager",
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
        if len(self.kernels) > 1:
            self.kernels.discard("eager")
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
