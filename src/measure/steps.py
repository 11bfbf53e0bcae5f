"""Per-step measurement of one trial: start-up, step time and tokens/s over warm steps only, allocator and NVML
peaks, loss (a NaN fails the trial), and the progress file the engine's watchdog reads.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from src.failures import NanLossError
from src.gpus import bf16_peak_tflops
from src.handoff import trial_started
from src.measure.flops import FlopCounter
from src.measure.memory import GIB, HostMemory, NvmlSampler


class Measurements(TrainerCallback):
    """Collects per-step time, tokens and memory; writes the progress file at every step for the watchdog.

    tokens/s counts non-padding tokens (the trainer's `num_input_tokens_seen` in "non_padding" mode) over the steps
    after `measure.warmup_steps`, timed between synchronized step ends. torch's allocator peaks (allocated,
    reserved) are exact and cover every step, warm-up included: the peak is what decides OOM, whenever it happens.
    Without a GPU the trial's device memory is the process's own, held to the budget by `host` (a HostMemory, set
    when the budget is): `peak_vram_reserved_gib` is then its peak beyond the start-up, the figure the budget
    refuses allocations on; torch keeps no allocated/reserved split on the CPU, so there is no allocated figure.
    """

    def __init__(self, cfg: Any, progress_path: Path, world_size: int = 1) -> None:
        self.warmup = cfg.measure.warmup_steps
        self.world_size = world_size
        self.samples_per_step = (
            cfg.trainer.per_device_train_batch_size * cfg.trainer.gradient_accumulation_steps * world_size
        )
        self.progress_path = progress_path
        self.cuda = torch.cuda.is_available()
        self.steps: list[dict[str, float]] = []
        self.losses: list[float] = []
        self.loss_steps: list[int] = []  # the optimizer step of each loss (a resumed run's first is past 1)
        self.step = 0
        self.startup_s: float | None = None
        self._last_t = 0.0
        self._last_tokens = 0
        self.flops: FlopCounter | None = None
        self.nvml = NvmlSampler(cfg.measure.nvml_interval_s) if self.cuda else None
        self.host: HostMemory | None = None  # the CPU's budget, when the trial runs under one (memory.budget)
        if self.nvml:
            self.nvml.start()
        self.write_progress("loading")

    def write_progress(self, phase: str, epoch: float | None = None) -> None:
        """phase, step and time for the watchdog; the epoch and the peak so far for whoever shows progress (the
        soak's view, src/sweep/soak.py)."""
        progress: dict[str, Any] = {"phase": phase, "step": self.step, "time": time.time()}
        if epoch is not None:
            progress["epoch"] = epoch
        peak = self._peak_so_far()
        if peak is not None:
            progress["peak_gib"] = peak
        tmp = self.progress_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(progress))
        tmp.replace(self.progress_path)

    def _peak_so_far(self) -> float | None:
        if self.cuda:
            return torch.cuda.max_memory_reserved() / GIB
        return self.host.peak_gib() if self.host is not None else None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self.flops = FlopCounter(model)
        if self.host is not None:  # the CPU card holds the model's tensors now, and the optimizer's on a resume
            self.host.begin_training(model, kwargs.get("optimizer"))
        self._sync()
        # The per-trial fixed cost: the trial's launch (imports included) to the first step.
        self.startup_s = time.time() - trial_started()
        self._last_t = time.perf_counter()
        self._last_tokens = state.num_input_tokens_seen
        self.step = state.global_step  # a resumed run begins at its checkpoint's step
        self.write_progress("training")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None:  # a micro-step begins: the CPU budget's peak is per micro-step (HostMemory.sample)
            self.host.sample()

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None:
            self.host.sample()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.host is not None:  # the CPU card's peak is training's: saving the adapter after it is not a step
            self.host.end_training()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        now = time.perf_counter()
        tokens = state.num_input_tokens_seen
        self.step = state.global_step
        record = {"step": self.step, "time_s": now - self._last_t, "tokens": tokens - self._last_tokens}
        if self.flops is not None:
            record["flops"], record["examples"] = self.flops.take()
        if self.cuda:
            record["vram_reserved_gib"] = torch.cuda.memory_reserved() / GIB
            record["vram_allocated_gib"] = torch.cuda.memory_allocated() / GIB
        elif self.host is not None:
            # the step's peak as the trial's is judged (not what the process maps now, which grows with every
            # micro-step seen): the soak's chart draws this series against the budget
            record["vram_reserved_gib"] = self.host.step_peak()
        self.steps.append(record)
        self._last_t, self._last_tokens = now, tokens
        self.write_progress("training", state.epoch)

    def restart_clock(self) -> None:
        """A checkpoint was saved (src/checkpoints.py): its time is not the next step's."""
        self._last_t = time.perf_counter()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        self.losses.append(float(loss))
        self.loss_steps.append(int(state.global_step))
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
            device = self.nvml.stop(oom=bool(stats.get("num_ooms", 0))) if self.nvml else None
            if device is not None:
                m["peak_vram_device_gib"] = device
        elif self.host is not None:
            # The CPU is the device: the process's peak beyond its start-up, against the budget it was held to.
            m["peak_vram_reserved_gib"] = self.host.peak_gib()
        else:
            # No device and no budget on the process (no /proc to hold it to one): no device memory to speak of.
            m["peak_vram_allocated_gib"] = 0.0
            m["peak_vram_reserved_gib"] = 0.0
        measured = self.steps[self.warmup :]
        if measured:
            seconds = sum(s["time_s"] for s in measured)
            m["step_time_s"] = statistics.median(s["time_s"] for s in measured)
            m["tokens_per_s"] = sum(s["tokens"] for s in measured) / seconds
            # Examples, not rows: a packed row holds several (counted by the FlopCounter's hook, on this rank's
            # micro-batches; the other ranks see as many). Without the hook, rows per step.
            examples = (
                sum(s["examples"] for s in measured) * self.world_size
                if all("examples" in s for s in measured)
                else self.samples_per_step * len(measured)
            )
            m["samples_per_s"] = examples / seconds
            # Non-padding tokens each optimizer step trained on: batch, accumulation and packing all change it.
            m["tokens_per_optimizer_step"] = sum(s["tokens"] for s in measured) / len(measured)
            # Examples each optimizer step trained on, all ranks: the same for two settings of one optimisation
            m["rows_per_optimizer_step"] = examples / len(measured)
            m["measured_steps"] = float(len(measured))
            if all("flops" in s for s in measured):
                # Useful model FLOP/s (FlopCounter); MFU is this over the card's measured bf16 matmul rate.
                m["model_tflops_per_s"] = sum(s["flops"] for s in measured) / seconds / 1e12
                m["model_params_matmul"] = float(self.flops.params)
                # The standard definition: (4 x frozen + 6 x trainable weights) a token + causal attention, over
                # the card's spec dense bf16 peak (src/gpus.py); beside the one above, which others do not use
                tokens = sum(s["tokens"] for s in measured) / self.world_size  # this card's: its FLOPs are
                standard = sum(s["flops"] for s in measured) + 2 * self.flops.trainable * tokens
                m["model_tflops_per_s_standard"] = standard / seconds / 1e12
                peak = bf16_peak_tflops(torch.cuda.get_device_name()) if self.cuda else None
                if peak:
                    m["mfu_standard"] = m["model_tflops_per_s_standard"] / peak
        if self.steps:
            m["first_step_s"] = self.steps[0]["time_s"]
        if self.losses:
            m["train_loss"] = statistics.fmean(self.losses)
        return m


def _max_rss_gib() -> float:
    import resource

    # ru_maxrss is in KiB on Linux: the process's true peak, not a sample.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
