"""The memory model's final judgement is made on settings it never saw: the fresh random set of
benchmarks/memory_random_h200.py repeats no setting measured before (under either allocator) and spans the space."""

from __future__ import annotations

import json

from benchmarks.memory_random_h200 import (
    ATTENTION,
    EXPANDABLE,
    FRESH_DESIGN,
    FRESH_SEED,
    N_FRESH,
    _key,
    draw_fresh,
    measured_before,
)


def test_the_fresh_set_repeats_no_setting_measured_before_and_spans_the_space() -> None:
    seen = measured_before()
    assert len(seen) > 100  # the first design: calibration, held-out and the settings it did not launch
    drawn, refused = draw_fresh(seen, N_FRESH, FRESH_SEED, lambda s: s["data.max_seq_length"] > 3900)
    assert len(drawn) == N_FRESH >= 40 and all(s["data.max_seq_length"] <= 3900 for s in drawn) and refused
    keys = [_key(s) for s in drawn + refused]
    assert len(set(keys)) == len(keys) and not set(keys) & seen  # none twice, none measured before
    assert all(EXPANDABLE not in json.loads(k) for k in keys)  # a setting is the same under either allocator
    values = {k: {s[k] for s in drawn} for k in drawn[0]}
    assert values["model.attn_implementation"] == set(ATTENTION)
    assert values["trainer.per_device_train_batch_size"] == set(range(1, 9))
    assert values["trainer.gradient_accumulation_steps"] == {1, 2, 3, 4}
    for switch in ("trainer.gradient_checkpointing", "trainer.packing", "trainer.group_by_length", EXPANDABLE):
        assert values[switch] == {False, True}, switch
    lengths = sorted(values["data.max_seq_length"])
    assert lengths[0] <= 512 and lengths[-1] >= 3500 and any(n % 256 for n in lengths)  # not only powers of two
    ranks = values["lora.r"]
    assert min(ranks) <= 12 and max(ranks) >= 48


def test_the_committed_fresh_design_is_the_seeded_draw_and_holds_enough_settings() -> None:
    design = json.loads(FRESH_DESIGN.read_text())
    held = design["held_out"]
    assert len(held) == N_FRESH >= 40
    assert not {_key(s) for s in held + design["held_out_not_launched"]} & measured_before()
    # the draw is the seeded one: the committed file's settings in the order the seed draws them
    drawn, refused = draw_fresh(measured_before(), N_FRESH, FRESH_SEED, lambda s: s in design["held_out_not_launched"])
    assert drawn == held and refused == design["held_out_not_launched"]
    assert {s[EXPANDABLE] for s in held} == {False, True}
