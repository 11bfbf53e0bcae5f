"""Run-time guards, installed by the trial because they can only act on the loaded model: `guard_device_moves`
(no `.to()` on a 4-bit or dispatched model) and `CheckpointingGuard` (checkpointing really on at the first step)."""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from transformers import TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer

from src.failures import ConfigError


def guard_device_moves(model: Any) -> Any:
    """Make `.to()` / `.cuda()` / `.cpu()` / `.half()` on a 4-bit or dispatched model raise ConfigError
    (naming the config key that places the model) instead of breaking it; returns the model.

    The model is placed by `device_map` at load time, the only safe moment: bitsandbytes' packed weights and
    accelerate's dispatch hooks do not survive a later move or cast. Moves that change nothing (the Trainer
    moving the model to the device it is on) pass. `_apply` is guarded too, so a move through a wrapper
    (the PEFT model around it) is caught as well. A plain model on one device is returned untouched.
    """
    quantized = bool(
        getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "is_loaded_in_8bit", False)
        or getattr(model, "hf_quantizer", None) is not None
    )
    mapped = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    dispatched = len(mapped) > 1
    if not (quantized or dispatched):
        return model
    bits = "8-bit" if getattr(model, "is_loaded_in_8bit", False) else "4-bit"
    what = f"a {bits} quantized model" if quantized else f"a model dispatched across {', '.join(sorted(mapped))}"
    if quantized and dispatched:
        what += f" dispatched across {', '.join(sorted(mapped))}"
    here = {_normal(p.device) for p in model.parameters()}
    probes = {}  # one floating-point dtype per device, to probe what an _apply function would do
    for p in model.parameters():
        if p.is_floating_point():
            probes.setdefault(_normal(p.device), p.dtype)

    def refuse(call: str) -> NoReturn:
        raise ConfigError(
            f"{call} on {what}: bitsandbytes 4-bit weights and accelerate's dispatch hooks are placed once, by "
            "device_map, when the model loads; moving or casting the model afterwards breaks them or leaves "
            "them on the old device. Remove the call and choose the placement in the config: "
            "hardware.parallelism=single (the whole model on one GPU; pick which with CUDA_VISIBLE_DEVICES) or "
            "hardware.parallelism=model_parallel (device_map=auto across the visible GPUs); the compute dtype "
            "is model.quantization.bnb_4bit_compute_dtype"
        )

    def moves(device: Any, dtype: Any) -> bool:
        if device is not None and (len(here) > 1 or _normal(torch.device(device)) not in here):
            return True
        return dtype is not None and quantized

    original_to, original_cuda, original_apply = model.to, model.cuda, model._apply

    def to(*args: Any, **kwargs: Any) -> Any:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if moves(device, dtype):
            shown = ", ".join([*map(str, args), *(f"{k}={v}" for k, v in kwargs.items())])
            refuse(f"model.to({shown})")
        return original_to(*args, **kwargs)

    def cuda(device: Any = None) -> Any:
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if moves(target, None):
            refuse(f"model.cuda({device if device is not None else ''})")
        return original_cuda(device)

    def _apply(fn: Any, *args: Any, **kwargs: Any) -> Any:
        for device, dtype in probes.items():
            probe = torch.empty(0, device=device, dtype=dtype)
            try:
                out = fn(probe)
            except Exception:  # it would move to a device this process cannot even reach
                refuse("moving the model (.to() / .cuda() / .cpu() on it or on a wrapper such as the PEFT model)")
            if _normal(out.device) != _normal(probe.device) or (quantized and out.dtype != probe.dtype):
                refuse("moving or casting the model (.to() / .cuda() / .cpu() / .half() on it or on a wrapper)")
        return original_apply(fn, *args, **kwargs)

    model.to, model.cuda, model._apply = to, cuda, _apply
    return model


def _normal(device: torch.device) -> torch.device:
    """cuda means the current CUDA device, as torch places it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


class CheckpointingGuard(TrainerCallback):
    """Raise ConfigError at the first training forward when the model does not checkpoint the way
    `trainer.gradient_checkpointing` says.

    transformers recomputes a layer's activations only when the layer's `gradient_checkpointing` flag is on
    AND the layer is in training mode; otherwise the step silently keeps every activation (the memory of
    gradient_checkpointing=false) and the trial would record that under the wrong setting. Checked on the
    first forward with gradients enabled (evaluation runs without), then the hook removes itself.
    """

    def __init__(self, gradient_checkpointing: bool) -> None:
        self.wanted = bool(gradient_checkpointing)
        self._handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._handle = model.register_forward_pre_hook(self._check)

    def _check(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._handle.remove()
        # transformers sets the flag on each repeated layer and on the stack that holds them; the layers are
        # what recompute, so they are what is counted.
        # a layer under trainer.checkpoint_above_tokens (src/recompute.py TokenGate) checkpoints only the long
        # micro-batches: the first one may be short
        flagged = [
            m
            for m in module.modules()
            if getattr(m, "gradient_checkpointing", None) is True or getattr(m, "qlora_token_gate", None)
        ]
        layers = [m for m in flagged if isinstance(m, GradientCheckpointingLayer)] or flagged
        idle = [m for m in layers if not m.training]
        if self.wanted and not flagged:
            raise ConfigError(
                "trainer.gradient_checkpointing=true, but no layer of the model being trained checkpoints at the "
                "first step (gradient_checkpointing_enable() was not applied to this model), so the step keeps "
                "every activation. Enable it on this model (prepare_model_for_kbit_training(use_gradient_"
                "checkpointing=True) or SFTConfig(gradient_checkpointing=True)), or set "
                "trainer.gradient_checkpointing=false to measure without it"
            )
        if self.wanted and idle:
            raise ConfigError(
                f"trainer.gradient_checkpointing=true, but {len(idle)} checkpointed layers are in eval mode at "
                "the first training step: transformers only recomputes activations in training mode, so "
                "checkpointing is silently off and the step keeps every activation. Put the model in training "
                "mode (model.train(); remove a model.eval() before the step) or set "
                "trainer.gradient_checkpointing=false to measure without it"
            )
        if not self.wanted and any(m.training for m in layers):
            raise ConfigError(
                f"trainer.gradient_checkpointing=false, but {len(layers)} layers of the model checkpoint: memory "
                "and speed would be recorded under the wrong setting. Set trainer.gradient_checkpointing=true, "
                "or do not enable checkpointing on the model outside the config"
            )
