"""`hardware.vram_budget_gib` on a larger card: the allocator cap that makes an H200 fail where a 24 GB card
would. The cap's arithmetic with the card and NVML stood in for (the GPU benchmarks show it on a real card)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from src.measure import memory

GIB = 1024**3


def _card(monkeypatch: pytest.MonkeyPatch, total_gib: float, devices: int, context_bytes: int | None) -> dict:
    calls: dict = {"fractions": {}, "context_created": False}
    cuda = SimpleNamespace(
        is_available=lambda: True,
        init=lambda: None,
        get_device_properties=lambda index: SimpleNamespace(total_memory=int(total_gib * GIB)),
        device_count=lambda: devices,
        set_per_process_memory_fraction=lambda fraction, device: calls["fractions"].__setitem__(device, fraction),
    )

    def zeros(*args, device=None, **kwargs):
        calls["context_created"] = device == "cuda"

    monkeypatch.setattr(memory, "torch", SimpleNamespace(cuda=cuda, zeros=zeros))
    monkeypatch.setattr(memory, "_nvml_process_bytes", lambda: context_bytes)
    return calls


def test_every_card_is_capped_to_the_budget_less_the_cuda_context(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _card(monkeypatch, total_gib=140.0, devices=2, context_bytes=int(0.6 * GIB))
    facts = memory.cap_to_budget(24.0)
    assert calls["context_created"], "the context exists before NVML is asked what it costs"
    assert calls["fractions"] == {0: pytest.approx(23.4 / 140.0), 1: pytest.approx(23.4 / 140.0)}
    assert facts == pytest.approx({"cuda_context_gib": 0.6, "device_total_gib": 140.0, "allocator_cap_gib": 23.4})


def test_a_budget_the_card_already_meets_is_not_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _card(monkeypatch, total_gib=22.0, devices=1, context_bytes=int(0.5 * GIB))
    facts = memory.cap_to_budget(24.0)  # a 24 GB card's budget on a 22 GiB card: the card itself is the limit
    assert calls["fractions"] == {} and "allocator_cap_gib" not in facts
    assert facts == pytest.approx({"cuda_context_gib": 0.5, "device_total_gib": 22.0})


def test_where_nvml_cannot_see_the_context_the_whole_budget_goes_to_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _card(monkeypatch, total_gib=80.0, devices=1, context_bytes=None)
    assert memory.cap_to_budget(24.0)["allocator_cap_gib"] == pytest.approx(24.0)
    assert calls["fractions"] == {0: pytest.approx(24.0 / 80.0)}


def test_no_gpu_no_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "torch", SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: False)))
    assert memory.cap_to_budget(24.0) == {}
