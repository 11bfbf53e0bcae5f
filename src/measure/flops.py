"""Useful model FLOPs of each micro-batch (for MFU), counted from its real rows: padding is not work."""

from __future__ import annotations

from typing import Any

import torch


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
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "in_features")]
        self.params = sum(int(m.in_features) * int(m.out_features) for m in linears)
        # LoRA's A and B (the weights training updates): the standard MFU counts 6 FLOPs a token for each, 4 for a
        # frozen one (no weight gradient)
        self.trainable = sum(
            int(m.in_features) * int(m.out_features)
            for m in linears
            if getattr(m, "weight", None) is not None and m.weight.requires_grad
        )
        self.pending: list[Any] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return
        lengths = _row_lengths(kwargs)
        if lengths is not None:
            self.pending.append(lengths)

    def take(self) -> tuple[float, int]:
        """FLOPs of the micro-batches since the last call, and how many examples they held (a packed row holds
        several: each sequence counts)."""
        total, examples = 0.0, 0
        for lengths in self.pending:
            examples += int((lengths > 0).sum())
            lengths = lengths.double()
            total += 4.0 * self.params * float(lengths.sum()) + 6.0 * self.layers * self.attn_width * float(
                (lengths**2).sum()
            )
        self.pending = []
        return total, examples


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
