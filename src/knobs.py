"""The knobs a sweep varies, in one registry: each one's config key, its short label, and how peak memory moves
as it grows. The sweeper (default `memory_monotone`, the certain-OOM rule), the report (columns, axes) and the
benchmarks read it here; nothing else lists knobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml


@dataclass(frozen=True)
class Knob:
    key: str  # the config key, dotted (data.max_seq_length)
    label: str  # a report column
    # How peak memory moves as the value grows: increasing | decreasing (true needs less than false) | neutral
    # (does not move the peak of one micro-step) | None (no rule: the certain-OOM rule needs the value equal).
    memory: str | None = None
    # The value that saves memory on a recipe that does not fit (a "lever" the sweep tries on the user's recipe);
    # None: not a lever. "half" halves a number (a batch).
    lever: Any = None
    # A lever that only moves a CUDA device's memory (the caching allocator's settings): not tried where the trials
    # run on a CPU, where it would measure nothing.
    cuda_only: bool = False
    # What the data says of a value, recorded on every trial before it runs (src/sweep/checks.py SpaceFacts):
    # "truncation" (the shares of rows and answers a max_seq_length cuts); None: nothing.
    fact: str | None = None


MEMORY_DIRECTIONS = ("increasing", "decreasing", "neutral")

# In report order; the first four are the seed's (the default search space).
KNOBS: tuple[Knob, ...] = (
    Knob("data.max_seq_length", "seq", "increasing", fact="truncation"),
    Knob("trainer.gradient_accumulation_steps", "grad_acc", "neutral"),  # each micro-step is the same size
    Knob("lora.r", "r", "increasing"),
    # only orders batches: a probe holds the longest rows either way, padded (or packed) to the same shape
    Knob("trainer.group_by_length", "group_len", "neutral"),
    Knob("trainer.per_device_train_batch_size", "batch", "increasing", lever="half"),
    # false (off) needs more than true: recomputing activations keeps one layer's instead of all of them
    Knob("trainer.gradient_checkpointing", "ckpt", "decreasing", lever=True),
    # selective needs more than full: it keeps down_proj's product of every layer from the forward (src/recompute.py);
    # no_down needs what full needs. "increasing" compares the words: full < no_down < selective, so an OOM at full
    # makes the other two certain OOMs, one at no_down selective's. Only with checkpointing (preflight).
    Knob("trainer.recompute", "recompute", "increasing"),
    # with checkpointing, micro-batches of at most this many tokens keep their activations: more needs more (null
    # checkpoints every one: no rule, the certain-OOM rule needs the value equal)
    Knob("trainer.checkpoint_above_tokens", "ckpt_above"),
    Knob("model.attn_implementation", "attn", lever="sdpa"),  # fused kernels keep no L x L scores
    Knob("trainer.padding_free", "pad_free"),
    Knob("trainer.packing", "packing"),
    Knob("trainer.use_liger_kernel", "liger"),
    Knob("trainer.torch_compile", "compile"),
    Knob("lora.lora_dropout", "dropout"),
    Knob("model.upcast_non_quantized", "fp32_rest", lever=False),  # bf16 embeddings, norms and lm_head
    Knob("model.sdpa_backends", "sdpa"),
    # true needs no more than false: segments grown in place leave fewer cached blocks unusable (fragmentation)
    Knob("hardware.expandable_segments", "expandable", "decreasing", lever=True, cuda_only=True),
    Knob("fault.kind", "fault"),
)
BY_KEY: dict[str, Knob] = {k.key: k for k in KNOBS}
# The seed's four knobs: the default search space.
SEED_KNOBS = tuple(k.key for k in KNOBS[:4])


def keys() -> list[str]:
    """Every registered knob's key, in report order."""
    return [k.key for k in KNOBS]


def fmt(value: Any) -> str:
    """A knob's value as the report shows it (booleans and null in YAML's words)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "-" if value is None else str(value)


def figure(value: float) -> str:
    """A measured figure as every table and summary line shows it: thousands grouped ("10,983"), never in exponent
    form; smaller ones to four significant digits ("657.8", "0.263")."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def with_overrides(params: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Config key -> value: `params` with Hydra-style overrides on top (a lever's: `trainer.packing=true`)."""
    found = dict(params)
    for override in overrides:
        key, _, text = override.partition("=")
        try:
            found[key.lstrip("+~")] = yaml.safe_load(text)
        except yaml.YAMLError:
            found[key.lstrip("+~")] = text
    return found


def label(key: str) -> str:
    """A knob's short column name; an unregistered key shows its last segment."""
    knob = BY_KEY.get(key)
    return knob.label if knob else key.rsplit(".", 1)[-1]


def with_facts() -> list[Knob]:
    """The knobs whose values the data says something of (Knob.fact)."""
    return [k for k in KNOBS if k.fact is not None]


def levers() -> list[Knob]:
    """The knobs with a memory-saving value to try on a recipe that does not fit, in registry order."""
    return [k for k in KNOBS if k.lever is not None]


def memory_directions() -> dict[str, Any]:
    """`hydra.sweeper.memory_monotone`'s default: every knob with a memory rule."""
    return {k.key: k.memory for k in KNOBS if k.memory is not None}


def ordered(found: set[str]) -> list[str]:
    """`found` keys, registered knobs first in registry order, then the rest sorted."""
    return [k for k in keys() if k in found] + sorted(found - set(BY_KEY))
