"""What the memory model reads from a composed config: a Llama-family decoder's shape (`Arch`), the setting it
trains under (`Setting`: quantization, LoRA, optimizer, allocator and the knobs) and the micro-batch at the peak
(`Batch`, from the user's own data by `peak_batch`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Arch:
    """A Llama-family decoder's shape."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False
    max_positions: int = 8192

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's Linear layers: (in, out) features."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @classmethod
    def from_config(cls, cfg: Any, vocab_fallback: int | None = None) -> Arch:
        """From `model.build` (a random model) or the checkpoint's config.json (`model.path`)."""
        build = cfg.model.get("build") if hasattr(cfg.model, "get") else None
        if build is not None:
            raw = dict(build)
        else:
            path = Path(str(cfg.model.path)) / "config.json"
            if not path.exists():
                raise FileNotFoundError(
                    f"model.path: no config.json in {path.parent}; the memory model needs the architecture "
                    "(point model.path at the local model directory)"
                )
            raw = json.loads(path.read_text())
        vocab = raw.get("vocab_size") or vocab_fallback
        if vocab is None:
            raise ValueError("model.build.vocab_size is null: pass the tokenizer's size")
        heads = int(raw["num_attention_heads"])
        return cls(
            layers=int(raw["num_hidden_layers"]),
            hidden=int(raw["hidden_size"]),
            intermediate=int(raw["intermediate_size"]),
            heads=heads,
            kv_heads=int(raw.get("num_key_value_heads") or heads),
            vocab=int(vocab),
            tied=bool(raw.get("tie_word_embeddings", False)),
            max_positions=int(raw.get("max_position_embeddings") or 8192),
        )


@dataclass(frozen=True)
class Setting:
    """What the model reads from a composed config: the architecture, the quantization, LoRA, the optimizer,
    the dtype of the non-quantized weights, the allocator and the knobs."""

    arch: Arch
    max_seq_length: int
    batch: int = 1
    checkpointing: bool = False
    attention: str = "sdpa"
    packing: bool = False
    lora_r: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora_dropout: float = 0.05
    double_quant: bool = True
    upcast_non_quantized: bool = True
    optim: str = "paged_adamw_32bit"
    fused_loss: bool = False  # Liger's fused linear cross-entropy: the logits are never whole
    world_size: int = 1
    expandable_segments: bool = False  # the caching allocator's expandable segments (hardware.expandable_segments)
    recompute: str = "full"  # under checkpointing, what the backward redoes (trainer.recompute; src/recompute.py)
    # under checkpointing, micro-batches of at most this many tokens keep their activations (src/recompute.py TokenGate)
    checkpoint_above_tokens: int | None = None

    @classmethod
    def from_config(cls, cfg: Any, vocab_fallback: int | None = None) -> Setting:
        t, m, lora = cfg.trainer, cfg.model, cfg.lora
        return cls(
            arch=Arch.from_config(cfg, vocab_fallback),
            max_seq_length=int(cfg.data.max_seq_length),
            batch=int(t.per_device_train_batch_size),
            checkpointing=bool(t.gradient_checkpointing),
            attention=str(m.attn_implementation),
            packing=bool(t.packing or t.get("padding_free", False)),
            lora_r=int(lora.r),
            lora_targets=tuple(_targets(lora.target_modules)),
            lora_dropout=float(lora.lora_dropout),
            double_quant=bool(m.quantization.get("bnb_4bit_use_double_quant", False)),
            upcast_non_quantized=bool(m.get("upcast_non_quantized", True)),
            optim=str(t.optim),
            fused_loss=bool(t.get("use_liger_kernel", False)),
            expandable_segments=bool((cfg.get("hardware") or {}).get("expandable_segments") or False),
            recompute=str(t.get("recompute", "full")),
            checkpoint_above_tokens=_tokens(t.get("checkpoint_above_tokens")),
        )

    def with_knobs(self, **knobs: Any) -> Setting:
        return replace(self, **knobs)


@dataclass(frozen=True)
class Batch:
    """The micro-batch at the peak: rows as the model sees them (padded, or one packed row) and the tokens."""

    rows: tuple[int, ...]  # each row's length as computed (padding included)

    @property
    def tokens(self) -> int:
        return sum(self.rows)

    @property
    def square(self) -> int:
        return sum(r * r for r in self.rows)


def peak_batch(lengths: np.ndarray | None, setting: Setting) -> Batch:
    """The largest micro-batch a run of `setting` meets on data of these token lengths (None: every row at least
    `max_seq_length` long, the worst case)."""
    seq, batch = setting.max_seq_length, setting.batch
    if lengths is None or len(lengths) == 0:
        cut = np.full(batch, seq)
    else:
        cut = np.sort(np.minimum(np.asarray(lengths), seq))[::-1]
    if setting.packing:
        # Rows laid end to end into bins of max_seq_length; `batch` bins make one padding-free row.
        return Batch((int(min(batch * seq, cut.sum())),))
    longest = cut[:batch]
    return Batch((int(longest.max()),) * len(longest))


def _tokens(value: Any) -> int | None:
    return None if value in (None, "None", "null") else int(value)


def _targets(value: Any) -> list[str]:
    if isinstance(value, str):
        if value == "all-linear":
            return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return [value]
    return [str(v) for v in value]
