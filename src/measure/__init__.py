"""Honest measurement of one trial: peak memory three ways (allocator, NVML, RSS), throughput over warm steps only,
useful FLOPs, and which kernels ran. What the trial uses is re-exported here."""

from src.measure.kernels import AttentionProbe, StepProfiler
from src.measure.memory import cap_to_budget
from src.measure.steps import Measurements

__all__ = ["AttentionProbe", "Measurements", "StepProfiler", "cap_to_budget"]
