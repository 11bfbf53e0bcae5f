"""The memory model: a setting's peak reserved VRAM as a sum of named terms.

Each term is a count from first principles (bytes per weight, per token, per token per layer, per attention
score) times a coefficient. The coefficients of the terms that depend on how the libraries run (which tensors
autograd keeps, how many copies the loss makes) start at first-principles values and are fitted to measured trials
of a stack; the weights' terms are exact counts and are not fitted. Peak reserved is peak allocated (the tensors)
plus what the caching allocator holds beyond them (`allocator_cache`: blocks cached for one micro-batch's shapes that
the next cannot reuse); the allocated terms are fitted to measured peak allocated, the cache to what is left, with a
coefficient for each allocator (expandable segments hold much less). Whether a setting fits is decided on peak
allocated under expandable segments (the cache is given back when the card presses) and on peak reserved on the
default allocator (`Prediction.needed_gib`).

The micro-batch at the peak comes from the user's own data: padded batches are as long as their longest row (a
probe holds the longest rows, group_by_length puts them first), packed batches are one row of `batch x
max_seq_length` tokens laid end to end (trl's padding-free packing), whose SDPA mask is that row squared.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from src.fit.setting import Batch, Setting

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
    "residual_stream",
    "attention",
    "attention_backward",
    "attention_mask",
    "logits_and_loss",
    "allocator_overhead",
    "allocator_cache",
)
# Coefficients fitted to measured peak allocated (multipliers of the first-principles counts; the overhead in GiB)
ALLOCATED = (
    "activations",
    "layer_inputs",
    "residual_stream",
    "attention",
    "attention_backward",
    "attention_mask",
    "logits_and_loss",
    "allocator_overhead",
)
# ... and to what peak reserved holds beyond it (the term `allocator_cache`), per allocator (expandable segments or
# not): GiB per GiB of the tensors made and freed in every layer (eager attention's scores) and once a micro-batch
# (logits, mask) (see `transient`), and GiB held whatever the batch
CACHE_PARTS = ("scores", "tensors", "fixed")
CACHE = {
    False: tuple(f"allocator_cache_{part}" for part in CACHE_PARTS),
    True: tuple(f"expandable_cache_{part}" for part in CACHE_PARTS),
}
FITTED = (*ALLOCATED, *CACHE[False], *CACHE[True])
DEFAULTS = {
    "activations": 1.0,
    "layer_inputs": 1.0,
    "residual_stream": 1.0,
    "attention": 1.0,
    "attention_backward": 1.0,
    "attention_mask": 1.0,
    "logits_and_loss": 0.5,  # x fp32 logits: the bf16 gradient of the logits, alive as the backward starts
    "allocator_overhead": 0.3,  # GiB: cuBLAS workspaces and the allocator's rounding
    # x the transient tensors (see `transient`): the blocks the allocator caches for their shapes; and GiB: the
    # rounding of the weights' and the adapters' blocks into the allocator's segments
    "allocator_cache_scores": 0.3,
    "allocator_cache_tensors": 0.1,
    "allocator_cache_fixed": 0.4,
    "expandable_cache_scores": 0.15,
    "expandable_cache_tensors": 0.05,
    "expandable_cache_fixed": 0.2,
}
DEFAULT_CONTEXT_GIB = 0.6  # the CUDA context of torch 2.11 + CUDA 13 on an H200, as NVML saw it
UNCALIBRATED_ERROR = 0.25  # the relative error assumed before any trial of the stack was measured
RESIDUAL_COPIES = 8  # the embedding's output, the final norm's input and output and lm_head's bf16 copy of it; in the
# backward, the residual's gradient into and out of a layer, its branch's, and the norm's fp32 gradient
NORMED_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # projections fed by an RMSNorm
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED_ATTENTION = ("sdpa", "varlen", "flash_attention_2", "flash_attention_3", "flex_attention")
# NF4/FP4 bytes per quantized weight: half a byte, plus an absmax per 64 weights (fp32, or 8-bit with double
# quantization plus an fp32 per 256 of those).
QUANT_BYTES = {False: 0.5 + 4 / 64, True: 0.5 + 1 / 64 + 4 / (64 * 256)}


def layer_bytes_per_token(s: Setting, mask_on: bool = True) -> float:
    """Bytes one decoder layer keeps for backward per token, counted tensor by tensor (bf16 autocast)."""
    return sum(layer_parts(s, mask_on))


def layer_parts(s: Setting, mask_on: bool = True) -> tuple[float, float]:
    """(attention half, MLP half) of what one decoder layer keeps for backward, bytes per token: each half's RMSNorm,
    projections' inputs and LoRA's. The MLP's backward runs first and frees its half before the attention's backward
    makes the scores' gradients (see `terms`)."""
    a = s.arch
    h, kv, i = a.hidden, a.kv_dim, a.intermediate
    residual = 4 if s.upcast_non_quantized else BF16  # peft's fp32 embeddings keep the residual stream in fp32
    norm = 4 * h + residual * h  # an RMSNorm's fp32 input and its output (one before attention, one before the MLP)
    rope = BF16 * (h + kv)  # q and k before rotation
    attention = BF16 * (2 * h + 2 * kv)  # q, k, v and the output (the fused kernels' logsumexp is small)
    if s.attention == "eager" or (s.attention == "sdpa" and mask_on):
        # k and v repeated to every query head (grouped-query attention): SDPA takes the groups as they are only
        # without a mask
        attention += BF16 * 2 * (h - kv)
    mlp = 3 * BF16 * i  # gate, up and silu(gate)
    lora = {"attention": 0.0, "mlp": 0.0}
    dims = a.projections()
    for name in s.lora_targets:
        d_in = dims.get(name, (h, h))[0]
        # Inputs that come out of an RMSNorm are in the residual dtype (fp32 with peft's upcast): the dropout's
        # output is then fp32 and autocast keeps a bf16 copy for lora_A; o_proj and down_proj take bf16 inputs.
        dtype = residual if name in NORMED_INPUTS else BF16
        cast = BF16 if dtype != BF16 else 0
        kept = (1 + dtype + cast) if s.lora_dropout > 0 else cast  # the dropout's mask and output
        half = "mlp" if name in MLP_PROJECTIONS else "attention"
        lora[half] += kept * d_in + BF16 * s.lora_r  # and lora_A's output, saved by lora_B
    return float(norm + rope + attention + lora["attention"]), float(norm + mlp + lora["mlp"])


def masked(s: Setting, batch: Batch) -> bool:
    """Whether attention gets a materialized mask: padded rows, or a packed row's block-diagonal causality (the
    varlen and flash kernels take the rows' boundaries instead)."""
    return s.attention in ("sdpa", "eager") and (len(batch.rows) > 1 or s.packing)


def counts(s: Setting, batch: Batch) -> dict[str, float]:
    """Each term at coefficient 1, in GiB (the overhead's unit is 1 GiB; the cache's, the transient tensors')."""
    a = s.arch
    layer_params = sum(i * o for i, o in a.projections().values())
    quantized = a.layers * layer_params * QUANT_BYTES[s.double_quant]
    other_params = a.vocab * a.hidden * (1 if a.tied else 2) + (2 * a.layers + 1) * a.hidden
    residual = 4 if s.upcast_non_quantized else BF16  # peft's fp32 embeddings keep the residual stream in fp32
    other = other_params * residual
    dims = a.projections()
    lora_params = a.layers * sum(s.lora_r * sum(dims.get(n, (a.hidden, a.hidden))) for n in s.lora_targets)
    # bf16 adapters (trl casts them on a 4-bit base) and their gradients; the optimizer's two fp32 moments
    # live in CUDA managed memory for the paged optimizers, outside torch's pool.
    state = 0 if s.optim.startswith("paged") else (2 if "8bit" in s.optim else 8)
    lora = lora_params * (BF16 + BF16 + state)
    tokens = batch.tokens
    mask_on = masked(s, batch)
    attention_half, mlp_half = layer_parts(s, mask_on)
    kept = 1 if s.checkpointing else a.layers  # layers whose activations are alive at once
    activations = kept * tokens * (attention_half + mlp_half)
    # under checkpointing each layer's input is kept (in the residual's dtype) and its activations recomputed
    inputs = a.layers * tokens * a.hidden * residual if s.checkpointing else 0.0
    if s.checkpointing and s.recompute == "selective":
        # selective recompute keeps, in every layer, the products that reduce over the MLP's width: down_proj's bf16
        # output and its LoRA A's (src/recompute.py), alive from the forward to that layer's backward
        inputs += a.layers * tokens * BF16 * (a.hidden + (s.lora_r if "down_proj" in s.lora_targets else 0))
    stream = RESIDUAL_COPIES * tokens * a.hidden * residual
    scores = a.heads * batch.square  # attention scores per layer, every head
    attention = backward = 0.0
    if s.attention == "eager":
        # kept for the backward: the fp32 softmax and the bf16 probabilities, of every layer (one, recomputed, under
        # checkpointing); in one layer's backward: the bf16 gradient of the probabilities and the fp32 gradient
        # through the softmax, on top of what that layer kept
        attention = kept * scores * (4 + BF16)
        backward = scores * (BF16 + 4)
    mask = 0.0
    if mask_on and s.attention == "eager":
        mask = batch.square * BF16  # the additive mask (block-diagonal over a packed row), one per micro-batch
    elif mask_on:
        # SDPA: the boolean mask once, and the additive copy its memory-efficient kernel makes in each layer and keeps
        # for that layer's backward
        mask = batch.square * (1 + BF16 * kept)
    logits = 0.0 if s.fused_loss else tokens * a.vocab * 4
    found = {
        "quantized_weights": quantized / GIB,
        "other_weights": other / GIB,
        "lora_and_optimizer": lora / GIB,
        "activations": activations / GIB,
        "layer_inputs": inputs / GIB,
        "residual_stream": stream / GIB,
        "attention": attention / GIB,
        "attention_backward": backward / GIB,
        "attention_mask": mask / GIB,
        "logits_and_loss": logits / GIB,
        "allocator_overhead": 1.0,
        # not a term: one layer's MLP half of `activations`, freed before that layer's attention backward (`terms`)
        "mlp_activations": tokens * mlp_half / GIB,
    }
    found |= transient(s, found)
    found["allocator_cache"] = found["cache_scores"] + found["cache_tensors"]
    return found


def transient(s: Setting, c: dict[str, float]) -> dict[str, float]:
    """The tensors allocated and freed again within a step (GiB, from the counts `c`): in every layer, eager attention's
    scores and their gradients (`cache_scores`); once a micro-batch, the mask and the logits (`cache_tensors`). The
    caching allocator keeps blocks cut to their shapes; a later tensor reuses those it fits in, and one of other
    shapes (random order with group_by_length off, a packed row's changing length) needs new blocks beside them: the
    cache grows with these tensors, by how much the order decides."""
    one_layer = c["attention"] / (1 if s.checkpointing else s.arch.layers)
    return {
        "cache_scores": one_layer + c["attention_backward"],
        "cache_tensors": c["attention_mask"] + c["logits_and_loss"],
    }


@dataclass
class Prediction:
    """A setting's predicted peak. `needed_gib` decides whether it fits: under expandable segments peak allocated (the
    allocator gives its cache back when the card presses: every such setting trained on a card of its own peak
    allocated x 1.05, benchmarks/NOTES.md §12b), on the default allocator peak reserved (blocks split by live tensors
    are memory it needs: 11 of 23 OOMed there). The errors are the needed figure's."""

    terms: dict[str, float]  # GiB per named term (peak reserved is their sum)
    context_gib: float
    error: float  # the most the model under-predicts `needed_gib`, as a share of it (measured <= (1 + error) x it)
    error_over: float | None = None  # the most it over-predicts (measured >= it / (1 + error_over)); None: `error`
    expandable: bool = False  # the allocator's expandable segments (`Setting.expandable_segments`)

    @property
    def reserved_gib(self) -> float:  # the tensors and the allocator's cache: what torch's pool holds unpressed
        return sum(self.terms.values())

    @property
    def allocated_gib(self) -> float:  # the tensors alone
        return self.reserved_gib - self.terms["allocator_cache"]

    @property
    def needed_gib(self) -> float:  # what the pool must be able to hold for the setting to train (see the class)
        return self.allocated_gib if self.expandable else self.reserved_gib

    @property
    def device_gib(self) -> float:  # what the card must hold: the needed pool and the CUDA context
        return self.needed_gib + self.context_gib

    @property
    def bound_gib(self) -> float:  # the needed pool if the model under-predicts it by its stated error
        return self.needed_gib * (1 + self.error)

    def fits(self, card_gib: float) -> bool:
        return self.device_gib <= card_gib

    def certainly_over(self, card_gib: float) -> bool:
        """Beyond the card even if the model over-predicts by the most it was seen to."""
        over = self.error if self.error_over is None else self.error_over
        return self.needed_gib / (1 + over) + self.context_gib > card_gib


def terms(c: dict[str, float], coef: dict[str, float], expandable: bool, phases: bool = False) -> dict[str, float]:
    """Each term in GiB from its count (`counts`) and the coefficients; the cache by its allocator's.

    A layer's backward peaks in one of two phases: its MLP's backward, with all of the layer's activations alive, or
    its attention's backward, after the MLP's half was freed, with the scores' gradients made (eager attention). The
    peak is the larger, so `attention_backward` is what the attention's phase holds beyond the MLP's: its gradients
    less the MLP's half of one layer's activations, and 0 where that is negative (0.10.2, where a model file says so).
    `phases=False`, the default: every term added, the form the fresh sets judged (NOTES §17c)."""
    scores, tensors, fixed = CACHE[expandable]
    found = {n: c[n] * coef.get(n, 1.0) for n in TERMS}
    if phases:
        found["attention_backward"] = attention_excess(c, coef)
    found["allocator_cache"] = c["cache_scores"] * coef[scores] + c["cache_tensors"] * coef[tensors] + coef[fixed]
    return found


def attention_excess(c: dict[str, float], coef: dict[str, float]) -> float:
    """What a layer's attention backward holds beyond its MLP backward (GiB, >= 0; see `terms`)."""
    return max(0.0, c["attention_backward"] * coef.get("attention_backward", 1.0) - mlp_freed(c, coef))


def mlp_freed(c: dict[str, float], coef: dict[str, float]) -> float:
    return c["mlp_activations"] * coef.get("activations", 1.0)


def allocator(s: Setting) -> str:
    """The caching allocator a setting runs on, as the model's errors are keyed."""
    return "expandable_segments" if s.expandable_segments else "default"


@dataclass
class MemoryModel:
    coefficients: dict[str, float] = field(default_factory=lambda: dict(DEFAULTS))
    context_gib: float = DEFAULT_CONTEXT_GIB
    # The most it under-predicts, as a share of its prediction (the margin a "fits" needs), measured on settings it
    # was not fitted to; `errors` per allocator where the points told them apart (the default allocator's cache
    # depends on the order of the batch shapes, expandable segments' much less).
    error: float = UNCALIBRATED_ERROR
    error_over: float | None = None  # the most it over-predicts (None: `error`): what a predicted OOM must clear
    errors: dict[str, list[float]] = field(default_factory=dict)  # allocator -> [error, error_over]
    points: int = 0
    stack: dict[str, str] = field(default_factory=dict)  # what the points were measured on
    # a layer's backward in two phases (`terms`, 0.10.2), where a model file says so; otherwise (and in a file without
    # the key) every term added, the form a fresh set judged: the default until one judges the two-phase form (#29)
    phases: bool = False

    def terms(self, s: Setting, batch: Batch) -> dict[str, float]:
        return terms(counts(s, batch), {**DEFAULTS, **self.coefficients}, s.expandable_segments, self.phases)

    def bounds(self, s: Setting) -> tuple[float, float | None]:
        """(error, error_over) for a setting: its allocator's where known."""
        under, over = self.errors.get(allocator(s)) or (self.error, self.error_over)
        return under, over

    def predict(self, s: Setting, batch: Batch) -> Prediction:
        """The peak of `s` at its largest micro-batch. Under `checkpoint_above_tokens` two micro-batches may hold it:
        the largest, checkpointed, and the largest that keeps its activations, bounded by `batch`'s rows each cut to
        an equal share of that many tokens; the higher of the two."""
        above = s.checkpoint_above_tokens if s.checkpointing else None
        plain = replace(s, checkpoint_above_tokens=None)
        if above is None:
            return self._predict(plain, batch)
        kept = Batch(tuple(min(r, max(1, above // len(batch.rows))) for r in batch.rows))
        unchecked = self._predict(replace(plain, checkpointing=False), kept)
        if batch.tokens <= above:  # no micro-batch is long enough to checkpoint
            return unchecked
        checked = self._predict(plain, batch)
        return max(checked, unchecked, key=lambda p: p.needed_gib)

    def _predict(self, s: Setting, batch: Batch) -> Prediction:
        return Prediction(self.terms(s, batch), self.context_gib, *self.bounds(s), expandable=s.expandable_segments)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryModel:
        keys = ("coefficients", "context_gib", "error", "error_over", "errors", "points", "stack")
        return cls(**{k: d[k] for k in keys if k in d}, phases=bool(d.get("phases", False)))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: Path) -> MemoryModel:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Point:
    """A measured trial: its setting, the micro-batch at its peak, what it reserved (and allocated, where known) and
    its CUDA context."""

    setting: Setting
    batch: Batch
    reserved_gib: float
    context_gib: float | None = None
    label: str = ""
    allocated_gib: float | None = None
