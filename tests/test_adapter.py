"""A saved LoRA adapter loads back onto the 4-bit base and computes what it computed when it was saved: through
peft (`PeftModel.from_pretrained`) and through transformers' own integration (`load_adapter`, which refuses a peft
older than it asks for), with the pinned transformers and peft."""

from __future__ import annotations

from pathlib import Path

import torch
from packaging.version import Version

from tests.conftest import compose_cfg


def _one_kernel(model):
    """The model's 4-bit layers on bitsandbytes' generic CPU path, on every machine.

    On a CPU with AVX512-BF16 (AMD EPYC, recent Xeons), bitsandbytes repacks a 4-bit layer's weight for its own
    kernel at the first eval-mode, no-grad forward, and every `state_dict()` (so every `save_pretrained`, and
    peft's loading of an adapter) unpacks it again, re-quantizing the double-quantized scales from their bf16 copy:
    the base's weights change a little at each of those calls (up to 0.01 in this model's logits), and the same
    adapter on the same base computed differently before and after it was saved. On other CPUs nothing is repacked.
    The claim here is the adapter's, so the base stays on the one path that no call changes."""
    from bitsandbytes.nn import Linear4bit

    for module in model.modules():
        if isinstance(module, Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()  # LoRA dropout off: the same input gives the same output
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_the_pinned_peft_is_one_transformers_loads_adapters_with() -> None:
    import peft
    from transformers.integrations.peft import MIN_PEFT_VERSION

    assert Version(peft.__version__) >= Version(MIN_PEFT_VERSION), (peft.__version__, MIN_PEFT_VERSION)


def test_a_saved_adapter_loads_back_on_the_4bit_base_with_the_same_outputs(root: Path) -> None:
    from bitsandbytes.nn import Linear4bit
    from hydra.utils import instantiate
    from peft import PeftModel

    from src import models

    cfg = compose_cfg(["trainer.output_dir=/tmp/unused"])
    torch.manual_seed(0)  # LoRA A's initialization too: the same adapter whatever ran before in this process
    model, tokenizer = models.load(cfg)
    model = models.attach_lora(_one_kernel(model), instantiate(cfg.lora, _convert_="all"))
    with torch.no_grad():  # LoRA B starts at zero: give the adapter something of its own to carry
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    ids = tokenizer("chest pain radiating to the left arm, no fever", return_tensors="pt").input_ids
    trained = _logits(model, ids)
    model.save_pretrained(root / "adapter")

    base, _ = models.load(cfg)
    _one_kernel(base)
    assert any(isinstance(m, Linear4bit) for m in base.modules()), "the adapter goes back onto the 4-bit base"
    plain = _logits(base, ids)
    effect = trained - plain
    assert effect.abs().max() > 0.1, "the adapter changes the outputs"
    loaded = PeftModel.from_pretrained(base, root / "adapter")
    torch.testing.assert_close(_logits(loaded, ids), trained, rtol=1e-4, atol=1e-4)
    # the tolerance tells adapters apart: another adapter of the same shape is far outside it
    with torch.no_grad():
        for name, param in loaded.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    assert (_logits(loaded, ids) - trained).abs().max() > 100 * 1e-4

    again, _ = models.load(cfg)
    _one_kernel(again)
    again.load_adapter(str(root / "adapter"))  # transformers' integration: checks its minimum peft first
    # it keeps the adapter in the model's dtype (bf16; peft upcasts it to fp32): equal up to bf16's rounding, which
    # a random tiny model amplifies in a few logits, so the whole effect is compared (~1% off here, any seed)
    assert {p.dtype for n, p in again.named_parameters() if "lora_" in n} == {torch.bfloat16}
    assert (_logits(again, ids) - trained).norm() < 0.05 * effect.norm()
