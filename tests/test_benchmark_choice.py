"""How the benchmark chooses the settings it re-measures alone from the map's shared-card readings."""

from __future__ import annotations

from benchmarks.map_h200 import VARIANTS, _applies, pick_candidates


def _row(seq: int, batch: int, packing: bool, attention: str, tokens_per_s: float) -> dict:
    setting = {
        "data.max_seq_length": seq,
        "trainer.per_device_train_batch_size": batch,
        "trainer.packing": packing,
        "model.attn_implementation": attention,
    }
    return {"setting": setting, "tokens_per_s": tokens_per_s}


def test_each_way_of_forming_batches_gets_a_candidate_before_any_gets_two() -> None:
    # v3's map: the padded varlen setting read fastest while sharing the card; alone, packed ran twice as fast
    stable = [
        _row(2048, 8, False, "varlen", 3660),
        _row(2048, 4, True, "varlen", 3420),
        _row(1024, 8, False, "sdpa", 3377),
        _row(4096, 2, True, "varlen", 2718),
        _row(2048, 8, False, "sdpa", 2649),
        _row(4096, 4, True, "sdpa", 2364),
    ]
    picked = pick_candidates(stable, 4)
    assert [(s["trainer.packing"], s["model.attn_implementation"]) for s in picked] == [
        (False, "varlen"),
        (True, "varlen"),
        (False, "sdpa"),
        (True, "sdpa"),
    ]
    assert picked[1]["data.max_seq_length"] == 2048, "within a family, the fastest reading first"
    fifth, sixth = pick_candidates(stable, 6)[4:]
    assert (fifth["trainer.packing"], fifth["data.max_seq_length"]) == (False, 2048), "then a family's largest"
    assert (sixth["trainer.packing"], sixth["data.max_seq_length"]) == (True, 4096), "then runners-up"
    assert pick_candidates(stable, 0) == [] and pick_candidates([], 3) == []


def test_each_family_s_largest_micro_batch_comes_before_runners_up() -> None:
    # v4's map: packed varlen 4096 x 4 read third in its family; alone, compiled, it ran 20% faster than the first
    stable = [
        _row(1024, 4, True, "varlen", 4975),
        _row(2048, 2, True, "varlen", 4755),
        _row(4096, 4, True, "varlen", 4205),
        _row(2048, 8, False, "varlen", 2809),
        _row(2048, 4, False, "varlen", 2000),
    ]
    picked = pick_candidates(stable, 4)
    assert [(s["data.max_seq_length"], s["trainer.per_device_train_batch_size"]) for s in picked] == [
        (1024, 4),
        (2048, 8),
        (4096, 4),
        (2048, 2),
    ], "fastest of each family; each family's largest (padded 2048 x 8 is both: not twice); then runners-up"
    assert len(pick_candidates(stable, 10)) == len(stable), "every stable setting at most once"


def test_a_variant_the_setting_already_has_or_that_cannot_apply_is_not_measured() -> None:
    varlen = {"model.attn_implementation": "varlen", "trainer.packing": True}
    assert not _applies("bf16_rest", varlen, ["model.upcast_non_quantized=false"]), "the map's recipe has it"
    assert not _applies("no_cudnn_attention", varlen, []), "SDPA's backends mean nothing to varlen"
    assert _applies("no_cudnn_attention", {**varlen, "model.attn_implementation": "sdpa"}, [])
    assert _applies("compile_layers", varlen, []) and VARIANTS["compile_layers"][2], "compiling probes longer"
    assert not _applies("compile_layers", {**varlen, "trainer.torch_compile": "layers"}, [])
