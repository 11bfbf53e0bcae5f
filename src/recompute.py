"""What the backward recomputes under activation checkpointing (`trainer.recompute`), and the one place that builds
the checkpoint call's arguments: the trainer's (src/config.py sft_kwargs) and the model's own switch
(src/models.py enable_checkpointing) both take them from `checkpoint_kwargs`.

`full` (the default): each checkpointed decoder layer runs its whole forward again in the backward, so a micro-batch
executes 6P matmul FLOPs a token for 4P useful (benchmarks/NOTES.md §5a). `selective`: torch's selective activation
checkpointing keeps, from the first forward, the outputs of the matmuls whose reduction runs over the MLP's
intermediate width (the frozen down_proj's product, and its LoRA A's), and recomputes everything else. `no_down`:
full's recompute without the frozen down_proj's product, at full's memory (`base_last`, below).

Why those. Holding a matmul's output saves 2·K FLOPs a value for the 2 bytes a bf16 value takes: the FLOPs saved per
byte held is the reduction width K, whatever the output's width. down_proj reduces over the intermediate width
(14,336 on Llama-3-8B), every other projection over the hidden width (4,096): its output (4,096 values a token a
layer, 4 GiB for a 16 k-token micro-batch over 32 layers) skips 27% of the layer's recompute matmuls, 3.5 times what
the same bytes buy anywhere else. Saving q/k/v/o/gate/up too would hold 84 KB a token a layer (~42 GiB at 16 k
tokens): more than the 24 GiB card. The elementwise work (norms, RoPE, SiLU, LoRA's dropout and scale) is cheap to
redo and is recomputed; so is attention, whose forward is a small share of the step on packed rows.

torch is imported inside the functions: the sweep's checks import the config without it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from src.failures import ConfigError

# trainer.recompute's words (preflight refuses any other). Their string order is their memory's (the sweep's
# certain-OOM rule compares the words, src/knobs.py): full = no_down < selective.
RECOMPUTE = ("full", "no_down", "selective")
# The projection whose product ends a decoder layer (Llama's MLP): nothing after it in the layer saves a tensor
LAST_PROJECTION = "down_proj"


def checkpoint_kwargs(cfg: Any) -> dict[str, Any]:
    """torch.utils.checkpoint.checkpoint's keyword arguments for `trainer.recompute`: non-re-entrant autograd (so the
    frozen 4-bit inputs need no requires_grad hook) and, for `selective`, the policy's context (a callable, so it is
    built here from the config's word, never held in the config)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if cfg.trainer.get("recompute", "full") == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        policy = SavePolicy(min_reduction=mlp_width(cfg))
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    return kwargs


def mlp_width(cfg: Any) -> int:
    """The model's MLP intermediate width, read without loading weights: the config's `model.build` (a random
    model), else the checkpoint's config.json."""
    build = cfg.model.build
    if build is not None and build.get("intermediate_size"):
        return int(build.intermediate_size)
    config = Path(cfg.model.path) / "config.json"
    try:
        return int(json.loads(config.read_text())["intermediate_size"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"trainer.recompute=selective: no intermediate_size in {config} ({e}); use trainer.recompute=full"
        ) from e


class SavePolicy:
    """torch's selective-checkpoint policy: MUST_SAVE a matmul's output when its reduction width is at least
    `min_reduction`, PREFER_RECOMPUTE everything else. Matmuls as they reach the dispatcher:
    `bitsandbytes.gemm_4bit` (bitsandbytes 0.50's 4-bit product on every device, its dequantization inside it, so
    a kept product skips that too), `aten.mm` (LoRA's A and B; a bf16 weight) and `aten.addmm` (with a bias).
    `saved` counts its MUST_SAVE answers: torch 2.13 asks it in the forward only (the recompute replays the answers),
    a compiled layer when it is traced; a test reads it to see that the policy reached the checkpoint. A
    module-level class: picklable, as the trainer's arguments may be copied."""

    def __init__(self, min_reduction: int) -> None:
        self.min_reduction = min_reduction
        self.saved = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        name = str(op)
        if name in ("aten.mm.default", "bitsandbytes.gemm_4bit.default"):
            reduction = args[0].shape[-1]
        elif name == "aten.addmm.default":
            reduction = args[1].shape[-1]
        else:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if reduction < self.min_reduction:
            return CheckpointPolicy.PREFER_RECOMPUTE
        self.saved += 1
        return CheckpointPolicy.MUST_SAVE


class TokenGate:
    """`trainer.checkpoint_above_tokens`: checkpoint only the micro-batches that need it. Before each forward of the
    model, every checkpointing decoder layer is told whether to recompute: yes where the micro-batch holds more than
    `above` tokens (rows x padded length, or a packed row's length), no where it holds fewer, whose activations
    the card can keep. The sum is the same either way (a checkpointed layer's backward recomputes the same forward),
    so the adapter is checkpointing's; only the time differs: a short micro-batch skips its recompute (a quarter of
    a checkpointed step's matmul work). The threshold is the memory model's to choose (src/sweep/faster.py): the
    most tokens whose activations fit the card without checkpointing; the longest micro-batches still checkpoint.
    `gated` counts the micro-batches (checkpointed, kept)."""

    def __init__(self, model: Any, above: int) -> None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.above = int(above)
        self.layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer in self.layers:
            layer.qlora_token_gate = self.above  # the checkpointing guard's sign that a layer is gated
        self.gated = [0, 0]
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            return
        tokens = int(ids.shape[0]) * int(ids.shape[1]) if ids.dim() > 1 else int(ids.numel())
        on = tokens > self.above
        for layer in self.layers:
            layer.gradient_checkpointing = on
        self.gated[0 if on else 1] += 1

    @property
    def checkpointed_frac(self) -> float | None:
        total = sum(self.gated)
        return self.gated[0] / total if total else None


def compiles_the_checkpoint(cfg: Any) -> bool:
    """Whether `trainer.torch_compile=layers` compiles each layer's checkpoint call with the layer inside it
    (`compiled_checkpoints`) instead of the layer alone (src/models.py compile_layers): with selective recompute.

    The policy must see the layer's ops, so the checkpoint has to be traced by Dynamo (AOTAutograd's partitioner then
    keeps what the policy tags). transformers 5.23 checkpoints inside the layer's `forward`, which compile_layers
    compiles; 5.17 (the GPU machine's) checkpoints around the compiled call, where torch's selective checkpoint sees
    only the compiled graph's kernels and its backward fails (CheckpointError: recomputed values differ). Compiling
    the checkpoint call works on both; full recompute keeps compile_layers' path (benchmarks measured it)."""
    return cfg.trainer.torch_compile == "layers" and cfg.trainer.recompute == "selective"


def checkpoint_inside_forward() -> bool:
    """Whether this transformers checkpoints a decoder layer inside its `forward` (5.23 on, which `compile_layers`
    then compiles with the checkpoint in it) rather than around the layer's call (5.17-5.22)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return "__init_subclass__" in vars(GradientCheckpointingLayer)


def compiled_checkpoints() -> Any:
    """A trainer callback that compiles every decoder layer's checkpoint call with the layer inside it at the start of
    training: the Trainer enables checkpointing again in `train()` (setting each layer's checkpoint function), after
    the trial built it, so compiling earlier would be undone. One compiled graph serves every layer (Dynamo keys it
    by code; the layers' parameters are its inputs), as compile_layers' does."""
    from transformers import TrainerCallback

    class CompiledCheckpoints(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            compile_checkpoints(model)

    return CompiledCheckpoints()


def compile_checkpoints(model: Any) -> int:
    """torch.compile each decoder layer's checkpoint call (its `_gradient_checkpointing_func`, transformers' name
    since 4.35, with no public way to read or set it) around the layer; `layer.qlora_checkpoint` keeps (the compiled
    call, the function it wraps). Returns how many layers."""
    import torch
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        func = layer._gradient_checkpointing_func
        ours = getattr(layer, "qlora_checkpoint", None)
        if ours is None or func is not ours[0]:  # the Trainer's, not already ours
            compiled = torch.compile(functools.partial(_checkpoint, func))
            layer.qlora_checkpoint = (compiled, func)
            layer._gradient_checkpointing_func = compiled
    return len(layers)


def _checkpoint(checkpoint: Any, function: Any, *args: Any) -> Any:
    return checkpoint(function, *args)


def base_last(model: Any) -> int:
    """`trainer.recompute=no_down`: every LoRA-adapted down_proj computes its LoRA term first and the frozen 4-bit
    product last. Returns how many projections.

    Why it skips a matmul. Non-re-entrant checkpointing recomputes a layer's forward only until every tensor its
    backward saved is back (torch's early stop, on by default), then stops. In peft's order the frozen product comes
    first and LoRA's term after it, so the recompute runs the product to reach what LoRA saved. Nothing in the
    backward needs that product: the base is frozen, bitsandbytes' 4-bit matmul saves no tensor for its backward (it
    keeps the packed weight on its context), and what follows it in the layer, two additions, saves none either. With
    LoRA's term first the recompute stops before the product: 8.5% of the matmul work of a 16 k-token micro-batch on
    the 8B (benchmarks/NOTES.md §13's count), at no memory. The sum is the same: `product + lora`, the same operands,
    the same casts, bit for bit (tests/test_recompute.py).

    The product runs outside torch.compile (`_frozen`) where transformers checkpoints around the compiled layer
    (5.17-5.22, the GPU image's): a layer compiled as one graph would recompute as one graph; the break leaves the
    product between the compiled pieces, where the early stop can fall (whether torch stops there is measured, not
    assumed: benchmarks/NOTES.md §16). From 5.23 the checkpoint is inside the compiled layer, where a break would
    run the whole layer eagerly: there compiled layers keep the product in their graph, the same graph as under full
    (its partitioner chooses what to recompute); eager layers still skip it. Where the
    recompute runs to the layer's end, the product is computed again, as under full: never a different value, so
    the adapter is full's whatever the early stop does. Only 4-bit projections: a frozen bf16 or fp32 matmul saves
    its weight for the backward, so the recompute has to run it anyway. Forms this does not cover (several adapters
    at once, merged or disabled adapters, variants such as DoRA, extra arguments) take peft's own forward."""
    import types

    from peft.tuners.lora.bnb import Linear4bit

    # Where transformers checkpoints inside the compiled layer (5.23 on), a graph break in it makes torch.compile run
    # the whole checkpoint eagerly: there the product stays in the compiled graph, which is then full's graph.
    frozen = _call if checkpoint_inside_forward() else _frozen()
    patched = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == LAST_PROJECTION and isinstance(module, Linear4bit):
            module.forward = types.MethodType(_lora_then_base, module)
            # the function itself, chosen here: Dynamo must meet a disabled one as a call to skip, not trace its making
            module.qlora_frozen = frozen
            patched += 1
    return patched


def _lora_then_base(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """peft's 4-bit LoRA forward (peft/tuners/lora/bnb.py Linear4bit.forward) for one vanilla adapter, with the frozen
    product computed after LoRA's term instead of before it (peft's defensive clone of the product is left out: the
    sum is a new tensor)."""
    import torch

    adapters = [a for a in self.active_adapters if a in self.lora_A]
    variants = getattr(self, "lora_variant", {})  # DoRA and the like (peft 0.17 on)
    if args or kwargs or self.disable_adapters or self.merged or len(adapters) != 1 or adapters[0] in variants:
        return type(self).forward(self, x, *args, **kwargs)
    adapter = adapters[0]
    lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
    conversion = not torch.is_autocast_enabled()
    lora_x = self._cast_input_dtype(x, lora_a.weight.dtype) if conversion else x
    lora = lora_b(lora_a(self.lora_dropout[adapter](lora_x))) * self.scaling[adapter]
    result = self.qlora_frozen(self.base_layer, x)
    if conversion:
        lora = lora.to(result.dtype)
    return result + lora


def _call(base_layer: Any, x: Any) -> Any:
    return base_layer(x)


@functools.cache
def _frozen() -> Any:
    """`_call`, never traced by torch.compile: a graph break where it stands, so that under compiled layers the
    product sits between compiled pieces, where the recompute's early stop can fall."""
    import torch

    return torch.compiler.disable(_call)
