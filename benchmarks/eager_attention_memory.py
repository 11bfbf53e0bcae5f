"""Bytes per attention score that transformers' eager attention holds at its peak, forward and backward, on the GPU.

The memory model (src/fit/model.py) counts eager attention as 6 bytes a score kept for the backward (the fp32
softmax and the bf16 probabilities) plus 6 in one layer's backward. The random sets under-predict eager attention
under checkpointing on long rows by ~2.3 bytes a score (benchmarks/NOTES.md §12, §17), and not on short ones. This
measures one Llama-3-8B attention block (`LlamaAttention`, eager, bf16, the stack's own code) alone: peak allocated
during forward + backward beyond what was allocated before, divided by the scores (heads x batch x length²), at
lengths across the range, with and without non-reentrant checkpointing, under bf16 autocast as the trainer runs it,
with the residual stream (the block's input, the mask, the rotary tables) in bf16 or, as peft's upcast of the
non-quantized weights leaves it, fp32; plus the softmax alone.
    source benchmarks/gpu_stack.sh && python -m benchmarks run eager_attention_memory   (carry .whl)
    -> $OUT/eager_attention_memory_<card>.json (commit it under benchmarks/results/)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

LENGTHS = (512, 1024, 1025, 1536, 2048, 2049, 2560, 3072, 4096)
BATCHES = (1, 2)
GIB = 1024**3


def block(device: str) -> tuple[Any, Any]:
    """Llama-3-8B's attention with eager attention in bf16, and its rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        num_hidden_layers=1, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    attn = LlamaAttention(cfg, layer_idx=0).to(device=device, dtype=torch.bfloat16)
    for p in attn.parameters():
        p.requires_grad_(False)  # frozen, as the 4-bit base is: only the input's gradient flows
    return attn, LlamaRotaryEmbedding(cfg).to(device)


def _mark(device: str) -> int | None:
    """Peak counting restarted; what is allocated now (None off CUDA: nothing is measured there)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_since(before: int) -> int:
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure(
    attn: Any, rope: Any, batch: int, length: int, checkpointed: bool, rest: torch.dtype, device: str
) -> dict[str, Any]:
    x = torch.randn(batch, length, 4096, device=device, dtype=rest, requires_grad=True)
    pos = torch.arange(length, device=device).unsqueeze(0).expand(batch, -1)
    cos_sin = rope(x, pos)  # in the residual's dtype, as the model makes them
    mask = torch.full((length, length), float("-inf"), device=device).triu(1)
    mask = mask.to(rest)[None, None].expand(batch, 1, length, length)

    def run(h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            return attn(h, position_embeddings=cos_sin, attention_mask=mask)[0]

    scores = 32 * batch * length * length
    before = _mark(device)
    out = checkpoint(run, x, use_reentrant=False) if checkpointed else run(x)
    if before is not None:
        forward_peak = _peak_since(before)
        kept = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()  # the backward's peak, still counted from `before`
    out.backward(torch.ones_like(out))
    row: dict[str, Any] = {
        "batch": batch, "length": length, "checkpointed": checkpointed, "rest": str(rest).removeprefix("torch."),
        "scores": scores,
    }  # fmt: skip
    if before is not None:
        backward_peak = _peak_since(before)
        row |= {
            "forward_peak_bytes_per_score": forward_peak / scores,
            "kept_bytes_per_score": kept / scores,
            "backward_peak_bytes_per_score": backward_peak / scores,
            "backward_peak_gib": backward_peak / GIB,
        }
    del out, x  # the mask and rotary tables go with this frame
    return row


def softmax_alone(batch: int, length: int, device: str) -> dict[str, float]:
    """transformers' eager softmax step alone: softmax(dtype=float32).to(bf16), forward and backward."""
    s = torch.randn(batch, 32, length, length, device=device, dtype=torch.bfloat16, requires_grad=True)
    scores = s.numel()
    before = _mark(device)
    p = torch.nn.functional.softmax(s, dim=-1, dtype=torch.float32).to(torch.bfloat16)
    p.backward(torch.ones_like(p))
    row: dict[str, float] = {"batch": batch, "length": length, "scores": scores}
    if before is not None:
        row["peak_bytes_per_score_beyond_input"] = _peak_since(before) / scores
    del s, p
    return row


def main() -> None:
    import argparse

    argparse.ArgumentParser(prog="python -m benchmarks.eager_attention_memory", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = LENGTHS if device == "cuda" else (64, 96)
    attn, rope = block(device)
    rows, soft = [], []
    for batch in BATCHES:
        for length in lengths:
            for rest in (torch.bfloat16, torch.float32):
                for checkpointed in (False, True):
                    rows.append(measure(attn, rope, batch, length, checkpointed, rest, device))
                    print(json.dumps(rows[-1]), flush=True)
            soft.append(softmax_alone(batch, length, device))
            print(json.dumps(soft[-1]), flush=True)
    import transformers

    result = {
        "command": "python -m benchmarks run eager_attention_memory",
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "rule": "peak allocated beyond what was allocated before the block's forward (its input, mask and rotary "
        "tables included in `before`), per attention score (32 heads x batch x length^2); frozen bf16 weights, the "
        "input's gradient flows, bf16 autocast; `rest`: the dtype of the input, mask and rotary tables; the "
        "backward's peak is measured from the forward's end",
        "attention": rows,
        "softmax_alone": soft,
    }
    out = Path(os.environ.get("OUT", ".")) / "eager_attention_memory.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
