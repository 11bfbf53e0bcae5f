"""trainer.checkpoint_above_tokens (src/recompute.py TokenGate): with checkpointing on, only the micro-batches longer
than the threshold checkpoint; the shorter keep their activations. The gradients are checkpointing's, bit for bit (a
fast path earns its place by computing what the plain path computes); the memory model predicts the higher of the
two regimes' peaks; the sweep's second stage sets the threshold to the most tokens the card can keep; preflight
refuses what cannot work."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hydra.utils import instantiate

from src import models
from src.fit.model import MemoryModel
from src.fit.setting import Arch, Batch, Setting
from src.preflight.config_guards import check_config
from src.preflight.report import Report
from src.recompute import TokenGate
from src.sweep import faster
from tests.conftest import compose_cfg

FP32 = ["model=tiny_llama", "model.dtype=float32", "model.quantization.bnb_4bit_compute_dtype=float32"]
SHORT, LONG = (2, 12), (2, 40)  # rows x length: 24 and 80 tokens


def _gradients(checkpointing: bool, above: int | None) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """The LoRA gradients of a short and a long micro-batch of the tiny 4-bit Llama, and how many decoder layers
    checkpointed in each."""
    cfg = compose_cfg([*FP32, "model.attn_implementation=eager", f"trainer.gradient_checkpointing={checkpointing}"])
    model, _ = models.load(cfg)
    model = models.prepare_for_kbit_training(model, cfg)
    torch.manual_seed(0)
    model = models.attach_lora(model, instantiate(cfg.lora, _convert_="all"))
    model.train()
    gate = TokenGate(model, above) if above is not None else None
    calls = [0]
    for layer in gate.layers if gate else []:
        func = layer._gradient_checkpointing_func

        def counted(*args: Any, _func: Any = func, **kwargs: Any) -> Any:
            calls[0] += 1
            return _func(*args, **kwargs)

        layer._gradient_checkpointing_func = counted
    grads, checkpointed = [], []
    for rows, length in (SHORT, LONG):
        ids = torch.randint(10, 200, (rows, length), generator=torch.Generator().manual_seed(length))
        model.zero_grad()
        before = calls[0]
        model(input_ids=ids, labels=ids).loss.backward()
        checkpointed.append(calls[0] - before)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    if gate is not None:
        assert gate.gated == [1, 1] and gate.checkpointed_frac == 0.5
    return grads, checkpointed


def test_only_the_long_micro_batch_checkpoints_and_the_gradients_are_checkpointings() -> None:
    full, _ = _gradients(True, None)
    none, _ = _gradients(False, None)
    gated, checkpointed = _gradients(True, 48)
    layers = compose_cfg(["model=tiny_llama"]).model.build.num_hidden_layers
    assert checkpointed == [0, layers], "24 tokens keep their activations; 80 > 48 checkpoint every layer"
    for mine, theirs in ((gated, full), (gated, none)):
        for short_or_long in (0, 1):
            assert mine[short_or_long].keys() == theirs[short_or_long].keys()
            for name, grad in mine[short_or_long].items():
                torch.testing.assert_close(grad, theirs[short_or_long][name], rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["trainer.checkpoint_above_tokens=512"], "trainer.gradient_checkpointing=false checkpoints none"),
        (["trainer.gradient_checkpointing=true", "trainer.checkpoint_above_tokens=0"], "a number of tokens >= 1"),
        (["trainer.gradient_checkpointing=true", "trainer.checkpoint_above_tokens=-5"], "a number of tokens >= 1"),
    ],
)
def test_preflight_refuses_a_gate_that_cannot_work(overrides: list[str], says: str) -> None:
    report = Report()
    check_config(compose_cfg(["model=tiny_llama", *overrides]), report)
    errors = [f.message for f in report.findings if f.severity == "error" and f.check == "checkpoint_above_tokens"]
    assert errors and says in errors[0], report.findings


def _arch() -> Arch:
    return Arch.from_config(compose_cfg(["model=llama3_8b_synthetic"]))


def test_the_memory_model_predicts_the_higher_of_the_two_regimes() -> None:
    model = MemoryModel()
    checked = Setting(_arch(), 4096, batch=2, checkpointing=True)
    longest = Batch((4096, 4096))
    plain = model.predict(checked, longest)
    never = model.predict(Setting(_arch(), 4096, batch=2), longest)
    gated = [model.predict(Setting(_arch(), 4096, 2, True, checkpoint_above_tokens=t), longest) for t in (256, 4096)]
    kept = model.predict(Setting(_arch(), 4096, batch=2), Batch((2048, 2048)))
    assert gated[0].needed_gib == pytest.approx(plain.needed_gib), "256 kept tokens: the checkpointed batch's peak"
    assert kept.needed_gib > plain.needed_gib, "4,096 tokens' activations kept: more than checkpointed 8,192"
    assert gated[1].needed_gib == pytest.approx(kept.needed_gib)
    everything = model.predict(Setting(_arch(), 4096, 2, True, checkpoint_above_tokens=8192), longest)
    assert everything.needed_gib == pytest.approx(never.needed_gib), "no micro-batch long enough to checkpoint"


class _Memory:
    """A memory gate on a card: the first-principles model over the 8B at 4096 tokens a row."""

    lengths = None

    def __init__(self, card: bool = True) -> None:
        self.card = card

    def describes_device(self) -> bool:
        return self.card

    def setting(self, overrides: list[str]) -> Setting:
        return Setting.from_config(compose_cfg(overrides))

    def predict(self, overrides: list[str]) -> Any:
        from src.fit.setting import peak_batch

        s = self.setting(overrides)
        return MemoryModel().predict(s, peak_batch(None, s))


def test_the_second_stage_keeps_the_most_tokens_the_card_can_hold() -> None:
    from src.fit.recommend import fits_with_margin

    base = ["model=llama3_8b_synthetic", "data.max_seq_length=4096", "trainer.gradient_checkpointing=true"]
    combo = faster.kept_tokens(_Memory(), base, ["model.attn_implementation=sdpa", faster.AUTO], 24.0, 0.1)
    assert combo[0] == "model.attn_implementation=sdpa" and combo[1].startswith("trainer.checkpoint_above_tokens=")
    tokens = int(combo[1].partition("=")[2])
    assert 0 < tokens < 4096 and tokens % faster.TOKEN_STEP == 0
    fits = [fits_with_margin(_Memory().predict([*base, combo[0], f"{combo[1][:-len(str(tokens))]}{t}"]), 24.0, 0.1)
            for t in (tokens, tokens + faster.TOKEN_STEP)]  # fmt: skip
    assert fits == [True, False], "the most that fits, not less"
    assert faster.kept_tokens(_Memory(card=False), base, [faster.AUTO], 24.0, 0.1) == [], "no card: no threshold"
    assert faster.kept_tokens(_Memory(), base, [faster.AUTO], 2.0, 0.1) == [], "nothing kept fits: the lever goes"
