"""Speed read alone, more than once (issue 46, src/sweep/timing.py): on a GPU, before the soak, the reference and the
finalists the soak would take train again alone on the card, round-robin, `timing_repeats` times; the ranking reads
their medians and the report quotes each with its spread and its speed against the reference. The second stage's
settings run alone on their card too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from omegaconf import OmegaConf

from src.readings import best_line, read_how
from src.record import Outcome, timed_key
from src.report.recommendation import same_model_words
from src.report.text import _opening
from src.sweep import timing
from src.sweep.slots import Slot
from tests.test_same_model_sweep import SPACE, _load, _Store, _study


class _Runs:
    def __init__(self) -> None:
        self.made: list[tuple[int, int, str]] = []

    def timed(self, number: int, repeat: int, slot: str) -> str:
        self.made.append((number, repeat, slot))
        return f"run-{number}-{repeat}"


def test_the_reference_and_the_finalists_are_timed_alone_round_robin_and_ranked_by_their_medians(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    storage = f"sqlite:///{tmp_path}/speed.db"
    # the recipe (the reference) and a finalist at its 2 rows per step read on a shared card; a second-stage trial
    # read alone (its own reading is one of its three)
    _study(storage, [(1, 2, 1000.0, []), (2, 1, 1500.0, [])])
    study = optuna.load_study(study_name="speed", storage=storage)
    _add(study, 1400.0, "cuda0", ["model.attn_implementation=sdpa"])
    # alone, trial 2 is the faster one: 1,900 against trial 1's 1,700 (the map's shared card had them the other way)
    readings = {0: [1100.0, 1000.0, 1050.0], 1: [1700.0, 1650.0, 1750.0], 2: [2000.0, 1850.0]}
    seen: list[tuple[str, bool, list[str]]] = []

    def launch(runs: Any, sweeper: Any, slot: Slot, label: str, overrides: list[str], *args: Any, **kw: Any) -> Any:
        seen.append((label, kw.get("alone", False), overrides))
        number, repeat = (int(x) for x in label.removeprefix("timed-").split("."))
        return Outcome("ok", {"tokens_per_s": readings[number][repeat - 1], "peak_vram_reserved_gib": 8.0})

    monkeypatch.setattr(timing, "launch", launch)
    monkeypatch.setattr(timing, "devices", lambda sweeper: [0])
    sweeper = OmegaConf.create({"timing_repeats": 3, "soak_top_k": 2})
    slots = [Slot("cuda0#0", {"CUDA_VISIBLE_DEVICES": "0"}), Slot("cuda0#1", {"CUDA_VISIBLE_DEVICES": "0"})]
    runs = _Runs()
    done = timing.finalists(study, _Store(), lambda: _load(tmp_path), sweeper, slots, ["trainer=probe"], runs, 24.0)

    order = [label for label, *_ in seen]
    assert order == ["timed-0.1", "timed-1.1", "timed-2.1", "timed-0.2", "timed-1.2", "timed-2.2",
                     "timed-0.3", "timed-1.3"], "round-robin, the reference first; trial 2 read alone once already"  # fmt: skip
    assert all(alone for _, alone, _ in seen), "each run holds the card alone"
    assert seen[2][2][0] == "trainer=probe" and "model.attn_implementation=sdpa" in seen[2][2], "as its trial ran"
    assert {slot for *_, slot in runs.made} == {"cuda0"}, "recorded on the card, not on a share of it"
    assert [d["trial"] for d in done] == [0, 1, 2]
    timed = study.user_attrs[timed_key(2)]
    assert timed["readings"] == [1400.0, 2000.0, 1850.0], "its own reading alone, then two runs"
    assert (timed["tokens_per_s"], timed["tokens_per_s_min"], timed["tokens_per_s_max"]) == (1850.0, 1400.0, 2000.0)
    assert timed["runs"] == timed["finished"] == 3 and timed["alone"]

    sweep = _load(tmp_path)
    assert [r.number for r in sweep.ranked()] == [2, 1, 0], "ranked by the medians read alone"
    row = sweep.rows[2]
    assert read_how(sweep, row) == " (the median of 3 runs alone on its card: 1,400-2,000)"
    row.same_model = {"passed": True, "max_loss_diff": 1e-3, "max_loss_rel_diff": 5e-4, "adapter_rel_diff": 0.01,
                      "steps": 4, "reference": 0, "tolerance": {"max_loss_rel_diff": 0.01, "adapter_rel_diff": 0.05}}  # fmt: skip
    assert "at 1.76× its speed (medians of runs alone: 1,850 against 1,050 tokens/s)" in same_model_words(sweep, row)
    assert "timing: trial 2: median 1,850 tokens/s over 3 run(s) alone" in capsys.readouterr().out
    # the report's headline and the sweep's closing line quote the median too, not the trial's own first reading
    how = "(the median of 3 runs alone on its card: 1,400-2,000)"
    assert f"model.attn_implementation=sdpa): 1,850 tokens_per_s {how}, peak" in _opening(sweep)[4]
    assert best_line(sweep) == f"best stable tokens_per_s within the policies: 1,850 {how} (trial 2)"
    # and promotion: its words, the production file's header and the registry's tags
    from src import promote
    from src.promote.__main__ import _figures
    from src.promote.registry import _version_tags

    assert _figures(sweep, row).startswith(f"tokens_per_s 1850 {how} (maximize)"), _figures(sweep, row)
    target = tmp_path / "fast.yaml"
    sweep.rows[0].slot, sweep.rows[1].slot = "cuda0#0", "cuda0#1"  # the map's trials shared the card
    header = promote.header(sweep, row, promote.Experiment(), "llama3-qlora", "1", [], False, target)
    assert "tokens_per_s alone on its card: 1850.0, the median of 3 runs (1400.0-2000.0)" in "\n".join(header)
    assert any("2 trials sharing a card: not solo" in line for line in header), (
        "its figures line: the trial's own reading"
    )
    assert "fast.yaml.prev" in header[2] and header[3] == "  python -m src.train experiment=fast", header
    tags = _version_tags(sweep, row, adapter=True)
    assert (tags["tokens_per_s_alone"], tags["tokens_per_s_alone_range"], tags["tokens_per_s_alone_runs"]) == (
        "1850",
        "1400-2000",
        "3",
    )
    assert tags["tokens_per_s"] == "1400", "the trial's own reading stays as it was measured"
    assert timing.finalists(study, _Store(), lambda: _load(tmp_path), sweeper, slots, [], runs, 24.0) == [], "once"


def _add(study: optuna.Study, speed: float, slot: str, lever: list[str]) -> None:
    """A second-stage trial of the recipe (trial 0) at batch 1 x accumulation 2, read on `slot`."""
    attrs = {"trial.status": "ok", "vram_budget_gib": 24.0, "peak_vram_reserved_gib": 8.0, "tokens_per_s": speed,
             "vram_headroom_frac": 2 / 3, "truncated_answer_frac": 0.0, "tokens_per_optimizer_step": 300.0,
             "sweep.slot": slot, "sweep.lever": json.dumps(lever), "sweep.lever_of": 0, "sweep.faster": True}  # fmt: skip
    params = {"trainer.per_device_train_batch_size": 1, "trainer.gradient_accumulation_steps": 2}
    trial = optuna.trial.create_trial(params=params, distributions=SPACE, value=speed, user_attrs=attrs)
    study.add_trial(trial)


def test_no_timing_on_a_cpu_or_when_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = f"sqlite:///{tmp_path}/speed.db"
    _study(storage, [(1, 2, 1000.0, []), (2, 1, 1500.0, [])])
    study = optuna.load_study(study_name="speed", storage=storage)
    monkeypatch.setattr(timing, "launch", lambda *a, **k: pytest.fail("launched"))
    args = (study, _Store(), lambda: _load(tmp_path))
    cpu = OmegaConf.create({"timing_repeats": 3, "soak_top_k": 2, "devices": []})
    assert timing.finalists(*args, cpu, [Slot("cpu0", {})], [], _Runs(), 24.0) == []
    monkeypatch.setattr(timing, "devices", lambda sweeper: [0])
    off = OmegaConf.create({"timing_repeats": 0, "soak_top_k": 2})
    assert timing.finalists(*args, off, [Slot("cuda0", {})], [], _Runs(), 24.0) == []


def test_a_setting_whose_runs_all_fail_says_why_and_keeps_its_map_reading() -> None:
    timed = timing.summary([{"failed": "oom"}, {"failed": "oom"}])
    assert timed["finished"] == 0 and timed["why"] == "no run finished: oom, oom" and "tokens_per_s" not in timed
    one = timing.summary([{"tokens_per_s": 10.0, "mfu_standard": 0.1}, {"failed": "oom"}])
    assert (one["tokens_per_s"], one["finished"], one["runs"], one["mfu_standard"]) == (10.0, 1, 2, 0.1)


def test_the_benchmark_quotes_the_promotion_against_its_reference_both_timed_alone(tmp_path: Path) -> None:
    """benchmarks/suites/same_model_speed.yaml's summary, from a study as the sweep leaves it: the reference (the
    stable setting at the recipe's split), the recommended setting, each with its readings alone, the speed-up at
    equal rows per optimizer step and the check's verdict."""
    from benchmarks import summaries
    from benchmarks.harness import Run

    folder = tmp_path / "sweeps" / "speed"
    folder.mkdir(parents=True)
    storage = f"sqlite:///{folder}/optuna.db"
    _study(storage, [(1, 2, 1000.0, []), (2, 1, 1500.0, [])])
    study = optuna.load_study(study_name="speed", storage=storage)
    check = {"passed": True, "max_loss_diff": 2e-3, "adapter_rel_diff": 0.03, "steps": 4, "reference": 0,
             "tolerance": {"max_loss_diff": 0.01, "adapter_rel_diff": 0.1}}  # fmt: skip
    study.set_user_attr("sweep.same_model.1", check)
    for n, rates in ((0, [990.0, 1000.0, 1010.0]), (1, [2400.0, 2500.0, 2600.0])):
        study.set_user_attr(timed_key(n), timing.summary([{"tokens_per_s": r} for r in rates]))
    run = Run("same_model_speed", {}, {"study": "speed"}, tmp_path, tmp_path / "out.json")
    record = {"rows": [{"name": "sweep", "wall_s": 900.0}, {"name": "promote", "exit_code": 0, "wall_s": 12.0}]}
    s = summaries.same_model_speed(record, run)
    assert (s["reference"]["trial"], s["promoted"]["trial"]) == (0, 1)
    assert s["promoted"]["tokens_per_s"] == {"median": 2500.0, "min": 2400.0, "max": 2600.0}
    assert s["reference"]["readings"] == [990.0, 1000.0, 1010.0] and s["promoted"]["alone"]
    assert s["speedup"] == pytest.approx(2.5) and s["same_rows_per_optimizer_step"]
    assert s["same_model"]["passed"] and s["same_model"]["adapter_rel_diff"] == 0.03
    assert s["gpu_minutes"] == pytest.approx(15.2)


def test_a_finalist_a_median_moves_into_the_soaks_places_is_checked_and_timed_before_it_is_soaked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in a CPU rehearsal of the GPU journey (benchmarks/suites/journey_rehearsal.yaml): the recipe, the
    reference, read 3,577 tokens/s in the map and ranked first, so nothing was checked and only it was timed; its
    median alone (3,305) then put the second stage's SDPA trial (its one reading alone: 3,510) first, and the soak
    took that trial, never checked nor timed. The check and the timing now go round until neither has work."""
    from src import same_model
    from src.sweep import faster
    from src.sweep.engine import settle

    storage = f"sqlite:///{tmp_path}/speed.db"
    _study(storage, [(1, 2, 3577.0, [])])
    study = optuna.load_study(study_name="speed", storage=storage)
    _add(study, 3510.0, "cuda0", ["model.attn_implementation=sdpa"])
    readings = {0: [3577.0, 3305.0, 3100.0], 1: [3450.0, 3400.0]}  # trial 1's own reading alone is its first

    def launch(runs: Any, sweeper: Any, slot: Slot, label: str, overrides: list[str], *args: Any, **kw: Any) -> Any:
        number, repeat = (int(x) for x in label.removeprefix("timed-").split("."))
        return Outcome("ok", {"tokens_per_s": readings[number][repeat - 1], "peak_vram_reserved_gib": 8.0})

    checked: list[list[str]] = []

    def check(reference: list[str], candidate: list[str], *args: Any, **kw: Any) -> dict:
        checked.append(candidate)
        return {"passed": True, "max_loss_diff": 0.0, "max_loss_rel_diff": 0.0, "adapter_rel_diff": 0.01, "steps": 4,
                "tolerance": same_model.TOLERANCE}  # fmt: skip

    monkeypatch.setattr(timing, "launch", launch)
    monkeypatch.setattr(timing, "devices", lambda sweeper: [0])
    monkeypatch.setattr(same_model, "check", check)
    sweeper = OmegaConf.create({"timing_repeats": 3, "soak_top_k": 1, "same_model_steps": 4})
    classified, slots = (lambda: _load(tmp_path)), [Slot("cuda0", {"CUDA_VISIBLE_DEVICES": "0"})]
    settle(
        lambda: faster.check_finalists(study, _Store(), classified, sweeper, [], {}),
        lambda: timing.finalists(study, _Store(), classified, sweeper, slots, [], _Runs(), 24.0),
    )
    sweep = classified()
    first = sweep.ranked()[0]
    assert first.number == 1 and first.same_model["passed"] and first.timed["tokens_per_s"] == 3450.0
    assert len(checked) == 1 and sweep.rows[0].timed["tokens_per_s"] == 3305.0
