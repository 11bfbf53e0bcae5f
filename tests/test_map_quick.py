"""The cheaper speed map (issue 31, benchmarks/map_quick_h200.py): the sweep it runs is the full map's space with a
shorter probe, and its judgement against the full map counts a changed verdict, the same rule for both maps."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks import map_quick_h200 as quick
from src.config import compose


def test_the_quick_map_sweeps_the_full_map_s_space_with_a_third_of_its_micro_steps() -> None:
    full = compose(["sweep=speed_map", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    fast = compose(["sweep=speed_map_quick", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    assert dict(fast.params) == dict(full.params) and fast.n_trials == full.n_trials == 96
    assert fast.sampler._target_ == full.sampler._target_ == "optuna.samplers.GridSampler"

    def micro_steps(sweeper) -> int:
        o = dict(x.split("=", 1) for x in sweeper.trial_overrides)
        acc = int(o.get("trainer.gradient_accumulation_steps", 2))  # the seed's accumulation: 2
        return int(o["trainer.max_steps"]) * acc

    assert micro_steps(full) == 6 and micro_steps(fast) == 2
    assert fast.study_name != full.study_name  # a quick map never resumes a full map's study


def _raw_from_full_map() -> dict:
    full = json.loads(quick.FULL_MAP.read_text())
    trials = [copy.deepcopy(r) for r in [*full["configs"], *full["skipped"]]]
    return {"machine": {"gpu.name": "test card"}, "slots": 5, "map_wall_s": 150.0, "map_command": "x", "trials": trials}


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    v6 = json.loads(quick.SPEED_V6.read_text())
    monkeypatch.setattr(quick, "SPEED_V6", tmp_path / "speed_v6.json")
    (tmp_path / "speed_v6.json").write_text(json.dumps(v6))
    monkeypatch.setattr(quick, "OUT_FILE", tmp_path / "quick.json")
    return tmp_path


def test_the_full_map_judged_against_itself_agrees_everywhere_and_fills_speed_v6(results: Path) -> None:
    raw = results / "raw.json"
    raw.write_text(json.dumps(_raw_from_full_map()))
    s = quick.summarize(raw)
    assert s["map_settings"] == 96 and s["map_verdict_agreement"] == 1.0 and s["disagreements"] == []
    assert s["map_gpu_minutes"] == 2.5 and s["targets"]["map_gpu_minutes"]["met"]
    v6 = json.loads((results / "speed_v6.json").read_text())["summary"]
    assert v6["map_settings"] == 96 and v6["map_verdict_agreement"] == 1.0 and "quick" in v6["map_source"]
    assert v6["targets"]["map_gpu_minutes"]["met"] and "not_measured" not in v6


def test_a_changed_verdict_is_a_disagreement_by_the_headroom_rule(results: Path) -> None:
    data = _raw_from_full_map()
    stable = [t for t in data["trials"] if t["status"] == "ok" and t["vram_headroom_frac"] >= 0.2][:2]
    for t in stable:
        t["vram_headroom_frac"] = 0.05  # the same setting, now inside the 10% margin: marginal
    oom = next(t for t in data["trials"] if t["status"] == "failed" and t["failure_kind"] == "oom")
    oom.update(
        status="skipped", failure_kind="oom", skipped_reason="predicted oom: 30.1 GiB on the card"
    )  # same verdict
    raw = results / "raw.json"
    raw.write_text(json.dumps(data))
    s = quick.summarize(raw)
    assert s["same_verdict"] == 94 and s["map_verdict_agreement"] == pytest.approx(94 / 96)
    assert [(d["verdict"], d["full_map_verdict"]) for d in s["disagreements"]] == [("marginal", "stable")] * 2
    assert not s["targets"]["map_verdict_agreement"]["met"]  # 97.9% < 98%: one changed verdict in 96 is allowed
    assert s["skipped"]["predicted"] == 1


def test_the_verdict_map_runs_one_micro_step_of_the_same_space_and_keeps_its_own_file() -> None:
    quick_map = compose(["sweep=speed_map_quick", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    verdict = compose(["sweep=speed_map_verdict", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    assert dict(verdict.params) == dict(quick_map.params) and verdict.study_name != quick_map.study_name
    o = dict(x.split("=", 1) for x in verdict.trial_overrides)
    assert (o["trainer.max_steps"], o["trainer.gradient_accumulation_steps"], o["measure.warmup_steps"]) == (
        "1",
        "1",
        "0",
    )
    assert quick.out_file({"sweep": "speed_map_verdict"}).name == "speed_map_verdict_h200.json"
    assert quick.out_file({}) == quick.out_file({"sweep": "speed_map_quick"}) == quick.OUT_FILE
