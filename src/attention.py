"""`model.attn_implementation=varlen`: padding-free attention on torch's own flash kernel.

With packing (`trainer.packing=true`), trl flattens a micro-batch into one row of sequences laid end to end and
hands their boundaries to the model (`cu_seq_lens_q`, `max_length_q`). SDPA cannot take boundaries: transformers
builds a block-diagonal mask over the whole row, and the masked kernel computes every block of it, so a
micro-batch of n tokens costs n^2 in attention whatever its sequences (on the H200, 39% of a 4k-token step's
GPU time, and more as the micro-batch grows). `torch.nn.attention.varlen.varlen_attn` (FlashAttention's
variable-length kernel, shipped with torch on CUDA) takes the boundaries and costs the sum of each sequence's
own square. flash-attn (`flash_attention_2`) does the same but is not on PyPI as a wheel.

Without boundaries (no packing) the padded batch is unpadded with its attention mask, as FlashAttention-2 does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

NAME = "varlen"


def available() -> str | None:
    """None if the kernel can run here, else why not."""
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU (torch's flash kernels)"
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (it came with torch 2.9)"
    return None


@functools.cache
def _kernel() -> tuple[Any, set[str]]:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float | None):
    """q (T, H, D), k/v (T, Hkv, D) -> (T, H, D), causal within each sequence of `cu`."""
    fn, params = _kernel()
    kwargs: dict[str, Any] = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:  # older torch: one KV head per query head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if "scale" in params and scale is not None:
        kwargs["scale"] = scale
    cu = cu.to(device=q.device, dtype=torch.int32)
    return fn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query (B, H, S, D), key/value (B, Hkv, S, D) -> (B, S, H, D)."""
    if dropout:
        raise ValueError("model.attn_implementation=varlen: attention dropout is not supported; set it to 0")
    batch, heads, seq, dim = query.shape
    dtype = query.dtype
    half = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16  # flash kernels: 16-bit only
    q, k, v = (t.transpose(1, 2).to(half) for t in (query, key, value))  # (B, S, H, D)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # padding-free: one row, sequences laid end to end
        if batch != 1:
            raise ValueError(f"cu_seq_lens_q is given with a batch of {batch} rows; padding-free batches have one")
        out = _run(q[0], k[0], v[0], cu, int(kwargs.get("max_length_q") or seq), scaling)
        return out.unsqueeze(0).to(dtype), None
    if attention_mask is None:
        attention_mask = torch.ones(batch, seq, dtype=torch.bool, device=query.device)
    if attention_mask.dim() != 2:
        raise ValueError("model.attn_implementation=varlen expects a 2-D padding mask (transformers' flash format)")
    keep = attention_mask[:, -seq:].bool()
    lengths = keep.sum(dim=1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    index = keep.flatten().nonzero().squeeze(1)
    flat = [t.reshape(batch * seq, *t.shape[2:]).index_select(0, index) for t in (q, k, v)]
    # The padded length bounds every sequence: no device-to-host read of the longest (a sync per layer).
    out = _run(*flat, cu, seq, scaling)
    padded = out.new_zeros(batch * seq, heads, dim).index_copy(0, index, out)
    return padded.view(batch, seq, heads, dim).to(dtype), None


def register() -> None:
    """Make `attn_implementation="varlen"` known to transformers (attention and mask interfaces)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, flash_attention_mask)  # None or the 2-D padding mask
