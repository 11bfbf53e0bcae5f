"""The memory model: a setting's peak reserved VRAM as a sum of named terms.

Each term is a count from first principles (bytes per weight, per token, per token per layer, per attention
score) times a coefficient. The coefficients of the terms that depend on how the libraries run (which tensors
autograd keeps, how many copies the loss makes, what the allocator holds back) start at first-principles values
and are fitted to measured trials of a stack (src/fit/calibration.py); the weights' terms are exact counts and
are not fitted.

The micro-batch at the peak comes from the user's own data: padded batches are as long as their longest row (a
probe holds the longest rows, group_by_length puts them first), packed batches are one row of `batch x
max_seq_length` tokens laid end to end (trl's padding-free packing), whose SDPA mask is that row squared.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1024**3
BF16 = 2  # bytes of the compute dtype under bf16 autocast
# Named terms, in the order a report prints them. `cuda_context` is not in torch's pool (peak reserved) but is on
# the card: it decides whether the pool's peak fits.
TERMS = (
    "quantized_weights",
    "other_weights",
    "lora_and_optimizer",
    "activations",
    "layer_inputs",
    "attention",
    "attention_mask",
    "logits_and_loss",
    "allocator_overhead",
)
# Coefficients fitted from measured trials (multipliers of the first-principles counts; the overhead in GiB).
FITTED = ("activations", "layer_inputs", "attention", "attention_mask", "logits_and_loss", "allocator_overhead")
DEFAULTS = {
    "activations": 1.0,
    "layer_inputs": 1.0,
    "attention": 1.0,
    "attention_mask": 1.0,
    "logits_and_loss": 0.5,  # x fp32 logits: the bf16 gradient of the logits, alive as the backward starts
    "allocator_overhead": 0.35,  # GiB: cuBLAS workspaces, the allocator's rounding and cached blocks
}
DEFAULT_CONTEXT_GIB = 0.6  # the CUDA context of torch 2.11 + CUDA 13 on an H200, as NVML saw it
UNCALIBRATED_ERROR = 0.25  # the relative error assumed before any trial of the stack was measured
NORMED_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # projections fed by an RMSNorm
FUSED_ATTENTION = ("sdpa", "varlen", "flash_attention_2", "flash_attention_3", "flex_attention")
# NF4/FP4 bytes per quantized weight: half a byte, plus an absmax per 64 weights (fp32, or 8-bit with double
# quantization plus an fp32 per 256 of those).
QUANT_BYTES = {False: 0.5 + 4 / 64, True: 0.5 + 1 / 64 + 4 / (64 * 256)}


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
    the dtype of the non-quantized weights and the knobs."""

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


def _targets(value: Any) -> list[str]:
    if isinstance(value, str):
        if value == "all-linear":
            return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return [value]
    return [str(v) for v in value]


def layer_bytes_per_token(s: Setting) -> float:
    """Bytes one decoder layer keeps for backward per token, counted tensor by tensor (bf16 autocast)."""
    a = s.arch
    h, kv, i = a.hidden, a.kv_dim, a.intermediate
    residual = 4 if s.upcast_non_quantized else BF16  # peft's fp32 embeddings keep the residual stream in fp32
    norms = 2 * (4 * h + residual * h)  # RMSNorm's fp32 input and its output, twice a layer
    rope = BF16 * (h + kv)  # q and k before rotation
    attention = BF16 * (2 * h + 2 * kv)  # q, k, v and the output (the fused kernels' logsumexp is small)
    if s.attention not in ("varlen", "flash_attention_2", "flash_attention_3"):
        attention += BF16 * 2 * (h - kv)  # k and v repeated to every query head (grouped-query attention)
    mlp = 3 * BF16 * i  # gate, up and silu(gate)
    lora = 0.0
    dims = a.projections()
    for name in s.lora_targets:
        d_in = dims.get(name, (h, h))[0]
        # Inputs that come out of an RMSNorm are in the residual dtype (fp32 with peft's upcast): the dropout's
        # output is then fp32 and autocast keeps a bf16 copy for lora_A; o_proj and down_proj take bf16 inputs.
        dtype = residual if name in NORMED_INPUTS else BF16
        cast = BF16 if dtype != BF16 else 0
        kept = (1 + dtype + cast) if s.lora_dropout > 0 else cast  # the dropout's mask and output
        lora += kept * d_in + BF16 * s.lora_r  # and lora_A's output, saved by lora_B
    return float(norms + rope + attention + mlp + lora)


def counts(s: Setting, batch: Batch) -> dict[str, float]:
    """Each term at coefficient 1, in GiB (the overhead's unit is 1 GiB)."""
    a = s.arch
    layer_params = sum(i * o for i, o in a.projections().values())
    quantized = a.layers * layer_params * QUANT_BYTES[s.double_quant]
    other_params = a.vocab * a.hidden * (1 if a.tied else 2) + (2 * a.layers + 1) * a.hidden
    other = other_params * (4 if s.upcast_non_quantized else BF16)
    dims = a.projections()
    lora_params = a.layers * sum(s.lora_r * sum(dims.get(n, (a.hidden, a.hidden))) for n in s.lora_targets)
    # bf16 adapters (trl casts them on a 4-bit base) and their gradients; the optimizer's two fp32 moments
    # live in CUDA managed memory for the paged optimizers, outside torch's pool.
    state = 0 if s.optim.startswith("paged") else (2 if "8bit" in s.optim else 8)
    lora = lora_params * (BF16 + BF16 + state)
    tokens = batch.tokens
    per_layer = layer_bytes_per_token(s)
    if s.checkpointing:  # each layer's input kept; one layer's activations at a time, recomputed in backward
        activations = tokens * per_layer
        inputs = a.layers * tokens * a.hidden * (4 if s.upcast_non_quantized else BF16)
    else:
        activations = a.layers * tokens * per_layer
        inputs = 0.0
    if s.attention == "eager":
        # per head and layer: the bf16 scores, their fp32 softmax (kept for its backward) and the bf16 probabilities
        kept = a.layers if not s.checkpointing else 1
        attention = a.heads * batch.square * (BF16 + 4 + BF16) * kept
    else:
        attention = 0.0
    mask = 0.0
    if s.attention in ("sdpa", "eager") and (len(batch.rows) > 1 or s.packing):
        mask = batch.square * BF16  # the additive mask (block-diagonal over a packed row), one per micro-batch
    logits = 0.0 if s.fused_loss else tokens * a.vocab * 4
    return {
        "quantized_weights": quantized / GIB,
        "other_weights": other / GIB,
        "lora_and_optimizer": lora / GIB,
        "activations": activations / GIB,
        "layer_inputs": inputs / GIB,
        "attention": attention / GIB,
        "attention_mask": mask / GIB,
        "logits_and_loss": logits / GIB,
        "allocator_overhead": 1.0,
    }


@dataclass
class Prediction:
    terms: dict[str, float]  # GiB per named term (peak reserved is their sum)
    context_gib: float
    error: float  # the model's own relative error

    @property
    def reserved_gib(self) -> float:
        return sum(self.terms.values())

    @property
    def device_gib(self) -> float:
        return self.reserved_gib + self.context_gib

    def fits(self, card_gib: float) -> bool:
        return self.device_gib <= card_gib

    def certainly_over(self, card_gib: float) -> bool:
        """Beyond the card even if the model overestimates by its whole error."""
        return self.reserved_gib * (1 - self.error) + self.context_gib > card_gib


@dataclass
class MemoryModel:
    coefficients: dict[str, float] = field(default_factory=lambda: dict(DEFAULTS))
    context_gib: float = DEFAULT_CONTEXT_GIB
    error: float = UNCALIBRATED_ERROR  # relative: max leave-one-out error on the calibration points
    points: int = 0
    stack: dict[str, str] = field(default_factory=dict)  # what the points were measured on

    def terms(self, s: Setting, batch: Batch) -> dict[str, float]:
        c = counts(s, batch)
        return {name: c[name] * self.coefficients.get(name, 1.0) for name in TERMS}

    def predict(self, s: Setting, batch: Batch) -> Prediction:
        return Prediction(self.terms(s, batch), self.context_gib, self.error)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryModel:
        return cls(**{k: d[k] for k in ("coefficients", "context_gib", "error", "points", "stack") if k in d})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: Path) -> MemoryModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Point:
    """A measured trial: its setting, the micro-batch at its peak, what it reserved and its CUDA context."""

    setting: Setting
    batch: Batch
    reserved_gib: float
    context_gib: float | None = None
    label: str = ""


# The pull toward first principles, against the squared relative errors: a prior of about +-60% on each coefficient
# for points measured to about 2% (a coefficient the points do not tell, eager attention in a map without it,
# stays at its first-principles value; one they tell moves freely).
RIDGE = 1e-3


def fit(points: list[Point], stack: dict[str, str] | None = None) -> MemoryModel:
    """Coefficients that minimise the squared relative error over `points` (with a light pull toward the
    first-principles values), the CUDA context as the points measured it, and the model's own error: the largest
    leave-one-out relative error (so the error is what a setting the fit did not see can expect)."""
    if not points:
        return MemoryModel(stack=dict(stack or {}))
    coef = _solve(points)
    contexts = [p.context_gib for p in points if p.context_gib]
    model = MemoryModel(
        coefficients=coef,
        context_gib=float(np.median(contexts)) if contexts else DEFAULT_CONTEXT_GIB,
        points=len(points),
        stack=dict(stack or {}),
    )
    if len(points) >= 3:
        errors = []
        for k in range(len(points)):
            rest = points[:k] + points[k + 1 :]
            held = MemoryModel(coefficients=_solve(rest))
            p = points[k]
            errors.append(abs(held.predict(p.setting, p.batch).reserved_gib / p.reserved_gib - 1))
        model.error = max(max(errors), 0.02)
    return model


def _solve(points: list[Point]) -> dict[str, float]:
    fixed = [n for n in TERMS if n not in FITTED]
    rows, target = [], []
    for p in points:
        c = counts(p.setting, p.batch)
        known = sum(c[n] for n in fixed)
        rows.append([c[n] * DEFAULTS[n] / p.reserved_gib for n in FITTED])
        target.append((p.reserved_gib - known) / p.reserved_gib)
    # theta: each fitted coefficient relative to its default (1 = first principles)
    x = np.asarray(rows)
    y = np.asarray(target)
    ridge = math.sqrt(RIDGE * len(points))
    free = list(range(len(FITTED)))
    theta = np.ones(len(FITTED))
    for _ in range(len(FITTED)):  # non-negative: a coefficient that goes below 0 is pinned at 0 and the rest refit
        a = np.vstack([x[:, free], ridge * np.eye(len(free))])
        b = np.concatenate([y, ridge * np.ones(len(free))])
        solved, *_ = np.linalg.lstsq(a, b, rcond=None)
        theta[free] = solved
        negative = [f for f, v in zip(free, solved, strict=True) if v < 0]
        if not negative:
            break
        theta[negative] = 0.0
        free = [f for f in free if f not in negative]
    return {n: float(DEFAULTS[n] * t) for n, t in zip(FITTED, theta, strict=True)}
