"""trainer.recompute=selective (src/recompute.py): the same adapter as full recompute, step for step, with the down
projection's product kept from the forward instead of computed again in the backward; and the trainer's own path
(SFTConfig -> activation_checkpointing_enable -> the checkpoint call) carries the policy to every layer."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode

from src import models
from src import recompute as recompute_path
from src.trial import context, single
from tests.conftest import compose_cfg

# fp32 throughout (weights, 4-bit compute, no autocast): both paths then run the same kernels on the same values.
FP32 = ["model=tiny_llama", "model.dtype=float32", "model.quantization.bnb_4bit_compute_dtype=float32"]
# eager's, and a compiled graph's extern kernels (Inductor calls aten's out= variants)
MATMULS = ("aten.mm.default", "aten.mm.out", "bitsandbytes.gemm_4bit.default")
ADDMM = ("aten.addmm.default", "aten.addmm.out")


class _Matmuls(TorchDispatchMode):
    """Counts the matmuls that run, by reduction width (the last dimension of the left operand). Higher-order ops
    (a compiled backward replays dropout's RNG through one) pass through uncounted."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.by_reduction: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if str(func) in MATMULS + ADDMM:
            width = int(args[1 if str(func) in ADDMM else 0].shape[-1])
            self.by_reduction[width] = self.by_reduction.get(width, 0) + 1
        return func(*args, **(kwargs or {}))


@functools.cache
def _train_steps(recompute: str, compiled: bool = False, steps: int = 3, early_stop: bool = True) -> dict[str, Any]:
    """A few AdamW steps of the tiny 4-bit Llama with LoRA (dropout on) on one fixed batch: the losses, the LoRA
    gradients of the last step, the LoRA weights after it, and the matmuls each backward ran. Seeded throughout, so
    the same arguments train the same steps: once per process (full recompute is every test's reference; compiled,
    ~10 s of compiling), read and never changed by the tests."""
    import torch._dynamo

    attention = "sdpa" if compiled else "eager"  # the compiled setting's, as in tests/test_trial.py
    cfg = compose_cfg(
        [*FP32, f"model.attn_implementation={attention}", "trainer.gradient_checkpointing=true"]
        + [f"trainer.recompute={recompute}"]
    )
    model, _ = models.load(cfg)
    model = models.prepare_for_kbit_training(model, cfg)
    torch.manual_seed(0)
    model = models.attach_lora(model, instantiate(cfg.lora, _convert_="all"))
    reordered = recompute_path.base_last(model) if recompute == "no_down" else 0
    torch._dynamo.reset()
    if compiled and recompute == "selective":
        recompute_path.compile_checkpoints(model)  # the checkpoint call compiled with the layer in it
    elif compiled:
        models.compile_layers(model)
    model.train()
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(lora.values(), lr=1e-3)
    ids = torch.randint(10, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    losses, backward_matmuls = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)  # LoRA's dropout draws the same masks on both paths
        optimizer.zero_grad()
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):  # read by each checkpoint as it runs
            loss = model(input_ids=ids, labels=ids).loss
        with _Matmuls() as counter:
            loss.backward()
        backward_matmuls.append(counter.by_reduction)
        losses.append(loss.item())
        grads = {n: p.grad.detach().clone() for n, p in lora.items()}
        optimizer.step()
    weights = {n: p.detach().clone() for n, p in lora.items()}
    return {
        "cfg": cfg,
        "losses": losses,
        "grads": grads,
        "weights": weights,
        "matmuls": backward_matmuls,
        "reordered": reordered,
    }


# The compiled tests share one worker (xdist_group "inductor", with tests/test_trial.py's), one after another: with a
# fresh inductor cache (a fresh clone, CI) the first builds the precompiled header and the kernels the next reuse.
# On a fresh cache: the trainer's two compiled tests ~70 s each alone; the three on one worker 74 s, 43 s and 22 s.
COMPILED = pytest.param(True, marks=pytest.mark.xdist_group("inductor"))


@pytest.mark.parametrize(
    "compiled", [pytest.param(False, marks=pytest.mark.slow(seconds=10)), COMPILED], ids=["eager", "compiled_layers"]
)
def test_selective_recompute_trains_the_same_adapter_and_skips_the_down_projection(root: Path, compiled: bool) -> None:
    """Eager: torch's selective checkpoint caches the kept outputs and replays the rest. Compiled layers
    (trainer.torch_compile=layers, ~20 s here): each layer's checkpoint call is compiled with the layer in it
    (src/recompute.py compile_checkpoints, on every transformers version), so AOTAutograd's partitioner saves what
    the policy tags; full recompute compiles the layer alone (src/models.py compile_layers)."""
    full, selective = _train_steps("full", compiled), _train_steps("selective", compiled)
    assert len(full["grads"]) == len(selective["grads"]) > 0
    # The kept products are the very tensors the recompute would make again (same kernels, same inputs, the
    # checkpoint restores the RNG for dropout): equal to fp32 rounding, in practice bit for bit.
    torch.testing.assert_close(selective["losses"], full["losses"], rtol=1e-6, atol=1e-6)
    for name, grad in full["grads"].items():
        torch.testing.assert_close(selective["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=name)
    for name, weight in full["weights"].items():
        torch.testing.assert_close(selective["weights"][name], weight, rtol=1e-6, atol=1e-6, msg=name)
    assert full["losses"][-1] < full["losses"][0], "the adapter learned on the batch"

    # The backward's matmuls that reduce over the MLP's width: the recompute's down_proj and its LoRA A (one each a
    # layer), plus the backward's own. Eager selective runs the latter only: 2 fewer a layer. Compiled, the
    # partitioner already keeps LoRA A's r-wide output under full recompute; selective skips down_proj's product.
    mlp = int(full["cfg"].model.build.intermediate_size)
    layers = int(full["cfg"].model.build.num_hidden_layers)
    for f, s in zip(full["matmuls"], selective["matmuls"], strict=True):
        assert f.get(mlp, 0) - s.get(mlp, 0) == (1 if compiled else 2) * layers, (f, s)
        # everything reducing over the hidden width is recomputed as before
        assert {k: v for k, v in f.items() if k != mlp} == {k: v for k, v in s.items() if k != mlp}, (f, s)


@pytest.mark.parametrize("compiled", [False, COMPILED], ids=["eager", "compiled_layers"])
def test_the_trainer_s_checkpoint_call_carries_the_policy_to_every_layer(
    root: Path, tmp_path: Path, compiled: bool
) -> None:
    """The trial's own path: trl's SFTConfig gets the kwargs from sft_kwargs, transformers' Trainer enables
    checkpointing with them in train() (after src.models did) and every decoder layer's checkpoint call runs the
    policy, which kept down_proj's products in real training steps. Compiled, the checkpoint call compiled at the
    start of training is the one the layers run (the Trainer's re-enabling did not undo it)."""
    import torch._dynamo
    from transformers.modeling_layers import GradientCheckpointingLayer

    cfg = compose_cfg(
        ["trainer=probe", "trainer.max_steps=2", "measure.warmup_steps=1", f"trainer.output_dir={tmp_path / 't'}"]
        + ["trainer.gradient_checkpointing=true", "trainer.recompute=selective", "model.attn_implementation=sdpa"]
        + [f"trainer.torch_compile={'layers' if compiled else 'false'}", "trainer.packing=true"]
    )
    ctx = context.TrialContext(*context.open_run(cfg))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    single.train(cfg, tmp_path, ctx)
    layers = [m for m in ctx.trainer.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    if compiled:
        assert all(layer._gradient_checkpointing_func is layer.qlora_checkpoint[0] for layer in layers)
        assert all(layer._compiled_call_impl is None for layer in layers), "the layer is compiled inside its checkpoint"
        # one graph for every layer (AttentionProbe's dispatch mode breaks it at its one warm-up step: run eagerly)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    funcs = [layer.qlora_checkpoint[1] if compiled else layer._gradient_checkpointing_func for layer in layers]
    policies = {id(f.keywords["context_fn"].args[0]) for f in funcs}
    policy = funcs[0].keywords["context_fn"].args[0]
    assert len(policies) == 1 and policy.min_reduction == cfg.model.build.intermediate_size
    # eager: two kept products (down_proj's and its LoRA A's) a layer a micro-step, over the probe's micro-steps;
    # compiled: the policy tags the traced graph, once a graph (packed lengths may trace it again)
    assert policy.saved >= (2 if compiled else 2 * len(layers) * cfg.trainer.max_steps)


@pytest.mark.parametrize(
    "early_stop", [pytest.param(True, marks=pytest.mark.slow(seconds=10)), False], ids=["early_stop", "to_the_end"]
)
def test_no_down_trains_the_same_adapter_and_recomputes_no_frozen_down_product(root: Path, early_stop: bool) -> None:
    """trainer.recompute=no_down (src/recompute.py base_last): LoRA's term before the frozen 4-bit product in every
    down_proj, so the checkpoint's recompute, which stops once the tensors the backward saved are back, ends before
    the product: one matmul over the MLP's width fewer a layer in each backward, nothing else changed. Where the
    recompute runs to the layer's end (early stop off) it computes the product again, as full does. Either way the
    same adapter as full recompute, bit for bit (the same sum of the same operands)."""
    full, no_down = _train_steps("full", early_stop=early_stop), _train_steps("no_down", early_stop=early_stop)
    layers = int(full["cfg"].model.build.num_hidden_layers)
    assert no_down["reordered"] == layers, "every layer's down_proj"
    assert no_down["losses"] == full["losses"]
    for name, grad in full["grads"].items():
        assert torch.equal(no_down["grads"][name], grad), name
    for name, weight in full["weights"].items():
        assert torch.equal(no_down["weights"][name], weight), name
    assert full["losses"][-1] < full["losses"][0], "the adapter learned on the batch"
    mlp = int(full["cfg"].model.build.intermediate_size)
    for f, n in zip(full["matmuls"], no_down["matmuls"], strict=True):
        # the frozen product's recompute, once a layer, where the recompute stops early
        assert f.get(mlp, 0) - n.get(mlp, 0) == (layers if early_stop else 0), (f, n)
        assert {k: v for k, v in f.items() if k != mlp} == {k: v for k, v in n.items() if k != mlp}, (f, n)


@pytest.mark.xdist_group("inductor")
def test_no_down_with_compiled_layers_keeps_one_graph_where_the_checkpoint_is_inside_it(root: Path) -> None:
    """transformers 5.23 on checkpoints inside the compiled layer: there no_down leaves the product in the graph (a
    break would run the checkpoint eagerly), so the compiled layer is one graph, full's: the same adapter, the same
    backward matmuls. (5.17-5.22, the GPU image's, put the product between compiled pieces: benchmarks/NOTES.md §16.)"""
    import torch._dynamo

    if not recompute_path.checkpoint_inside_forward():
        pytest.skip("this transformers checkpoints around the compiled layer")
    full = _train_steps("full", compiled=True)
    torch._dynamo.utils.counters.clear()
    no_down = _train_steps("no_down", compiled=True)
    assert (
        torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1 and not torch._dynamo.utils.counters["graph_break"]
    )
    torch.testing.assert_close(no_down["losses"], full["losses"], rtol=1e-6, atol=1e-6)
    for name, grad in full["grads"].items():
        torch.testing.assert_close(no_down["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=name)
    assert no_down["matmuls"] == full["matmuls"]


def test_no_down_reorders_only_4bit_down_projections_with_one_plain_adapter(root: Path) -> None:
    """What base_last leaves alone keeps peft's own forward: projections other than down_proj, and a down_proj whose
    adapters are switched off (the sum would then be the product alone)."""
    cfg = compose_cfg([*FP32, "trainer.gradient_checkpointing=true", "trainer.recompute=no_down"])
    model, _ = models.load(cfg)
    model = models.attach_lora(models.prepare_for_kbit_training(model, cfg), instantiate(cfg.lora, _convert_="all"))
    assert recompute_path.base_last(model) == cfg.model.build.num_hidden_layers
    patched = {n for n, m in model.named_modules() if "forward" in vars(m)}
    assert patched and all(n.endswith(".mlp.down_proj") for n in patched), patched
    model.eval()  # LoRA dropout off: two calls see the same input
    down = next(m for n, m in model.named_modules() if n in patched)
    x = torch.randn(3, down.in_features)
    with torch.no_grad():
        mixed = down(x)
        with model.disable_adapter():
            assert torch.equal(down(x), down.base_layer(x)), "adapters off: the frozen product alone"
        assert torch.equal(mixed, type(down).forward(down, x)), "the same sum as peft's own forward"


def test_a_no_down_trial_reorders_every_layer_and_says_so(root: Path, tmp_path: Path, capsys: Any) -> None:
    """The trial's own path (src/trial/single.py): after LoRA is attached, every layer's down_proj is reordered, the
    trial prints how many and tags its MLflow run with the count, and trains."""
    cfg = compose_cfg(
        ["trainer=probe", "trainer.max_steps=2", "measure.warmup_steps=1", f"trainer.output_dir={tmp_path / 't'}"]
        + ["trainer.gradient_checkpointing=true", "trainer.recompute=no_down", "model.attn_implementation=sdpa"]
    )
    ctx = context.TrialContext(*context.open_run(cfg))
    single.train(cfg, tmp_path, ctx)
    layers = int(cfg.model.build.num_hidden_layers)
    assert (
        f"trainer.recompute=no_down: {layers} down_proj products computed after their LoRA terms"
        in capsys.readouterr().out
    )
    assert ctx.client.get_run(ctx.run_id).data.tags["trial.recompute_reordered"] == str(layers)
    assert ctx.trainer.state.global_step == cfg.trainer.max_steps


def test_the_sweeper_knows_selective_needs_at_least_full_s_memory() -> None:
    """The registry's direction for `trainer.recompute=choice(full,selective)`: the certain-OOM rule compares the
    words, so a full recompute that ran out of memory makes selective at the same setting a certain OOM, and not
    the other way round."""
    from src import knobs
    from src.sweep.rules import at_least

    direction = knobs.memory_directions()["trainer.recompute"]
    assert at_least("selective", "full", direction) and not at_least("full", "selective", direction)
    # no_down holds what full holds: an OOM at full is one at no_down, and one at no_down is one at selective
    assert at_least("no_down", "full", direction) and at_least("selective", "no_down", direction)
    assert not at_least("no_down", "selective", direction)
    assert knobs.BY_KEY["trainer.recompute"].lever is None, "not a memory lever: it costs memory"
