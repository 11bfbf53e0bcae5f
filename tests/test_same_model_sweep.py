"""The best setting, not only a stable one (issue 46, its CPU part): settings that put other rows into an optimizer
step than the recipe are another optimisation, shown apart and ranked only when the user opts in; the half-batch
lever keeps the rows per step; before the soak the sweep checks that each finalist trains the same model as the
reference (src/sweep/faster.py), and one that does not is never ranked, soaked or promoted.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from src import report
from src.report.text import differently
from src.study import Sweep

BATCH, ACC = "trainer.per_device_train_batch_size", "trainer.gradient_accumulation_steps"
SPACE = {BATCH: CategoricalDistribution([1, 2, 4, 8]), ACC: CategoricalDistribution([1, 2])}


def _study(storage: str, trials: list[tuple[int, int, float, list[str]]]) -> None:
    """(batch, accumulation, tokens/s, lever overrides) per trial; the first is the recipe."""
    study = optuna.create_study(study_name="speed", storage=storage, direction="maximize")
    for n, (batch, acc, speed, lever) in enumerate(trials):
        attrs: dict[str, Any] = {
            "trial.status": "ok",
            "vram_budget_gib": 24.0,
            "peak_vram_reserved_gib": 8.0,
            "vram_headroom_frac": 1 - 8.0 / 24,
            "tokens_per_s": speed,
            "truncated_answer_frac": 0.0,
            "tokens_per_optimizer_step": 150.0 * batch * acc,
        }
        if n == 0:
            attrs["sweep.recipe"] = True
        if lever:
            attrs |= {"sweep.lever": json.dumps(lever), "sweep.lever_of": 0}
        study.add_trial(
            optuna.trial.create_trial(
                params={BATCH: batch, ACC: acc},
                distributions=SPACE,
                value=speed,
                state=TrialState.COMPLETE,
                user_attrs=attrs,
            )
        )


def _load(tmp_path: Path) -> Sweep:
    return report.load("speed", tmp_path / "sweeps", storage=f"sqlite:///{tmp_path}/speed.db")


def test_settings_with_other_rows_per_step_are_shown_apart_and_ranked_only_when_asked(tmp_path: Path) -> None:
    _study(
        f"sqlite:///{tmp_path}/speed.db",
        [(1, 2, 1000.0, []), (2, 1, 1500.0, []), (8, 2, 6000.0, []), (1, 1, 800.0, []), (4, 1, 2800.0, [])],
    )
    sweep = _load(tmp_path)
    assert [r.number for r in sweep.ranked()] == [1, 0], "the same 2 rows per optimizer step as the recipe"
    assert sweep.best().number == 1 and sweep.recommended().number == 1
    assert [r.number for r in sweep.trains_differently()] == [2, 4, 3]
    section = "\n".join(differently(sweep))
    assert "## Faster, but trains differently" in section and "promote_different_optimisation=true" in section
    assert "| 2 | batch 8, grad_acc 2 | 6,000 | 6.00× | 16 | 2,400 | 8× fewer |" in section, section
    assert "| 3 | batch 1, grad_acc 1 | 800 | 0.80× | 1 | 150 | 2× more |" in section, section
    sweep.different_optimisation = True  # hydra.sweeper.promote_different_optimisation=true
    assert [r.number for r in sweep.ranked()] == [2, 4, 1, 0, 3]


def test_a_lever_that_keeps_the_rows_per_step_is_the_same_optimisation(tmp_path: Path) -> None:
    """The half-batch lever comes with twice the accumulation (src/fit/recommend.py levers); a recipe's fixed batch
    and accumulation (not among the params) are read from the sweep's config (record.STEP_DEFAULTS)."""
    from src.config import compose
    from src.fit.recommend import levers

    cfg = compose([f"{BATCH}=16", f"{ACC}=1"])
    assert [f"{BATCH}=8", f"{ACC}=2"] in levers(cfg, {})
    assert [f"{BATCH}=8", f"{ACC}=4"] in levers(cfg, {ACC: 2}), "a swept accumulation: the recipe's value, doubled"
    _study(f"sqlite:///{tmp_path}/speed.db", [(1, 2, 1000.0, []), (1, 2, 1200.0, [f"{BATCH}=2", f"{ACC}=1"])])
    sweep = _load(tmp_path)
    assert sweep.same_optimisation(sweep.rows[1]) and sweep.rows_per_step(sweep.rows[1]) == 2
    from src.report.recommendation import same_model_words

    assert same_model_words(sweep, sweep.rows[1]) == "", "a reference to check it against: the sweep checks it"


class _Store:
    """The engine's store, as far as the check asks: its lock, and no other worker running."""

    def lock(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def others_running(self, study: optuna.Study) -> bool:
        return False


@pytest.mark.slow(seconds=60)
def test_the_sweep_checks_its_finalists_against_the_reference_and_drops_one_that_trains_another_model(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fastest finalist doubles the learning rate (the same rows per step, another model): the check trains it
    and the reference from the same adapter on the same rows, finds them apart and drops it; the next, batch 2 x
    accumulation 1 against the recipe's 1 x 2, trains the same model and is the one ranked first. (The check's
    verdicts that need no training: tests/test_production.py.)"""
    from src.same_model import TOLERANCE
    from src.sweep import faster

    storage = f"sqlite:///{tmp_path}/speed.db"
    _study(storage, [(1, 2, 1000.0, []), (2, 1, 1500.0, []), (1, 2, 2000.0, ["trainer.learning_rate=4e-5"])])
    study = optuna.load_study(study_name="speed", storage=storage)
    sweeper = OmegaConf.create({"same_model_steps": 2, "soak_top_k": 1})
    checked = faster.check_finalists(study, _Store(), lambda: _load(tmp_path), sweeper, ["trainer.bf16=false"], {})
    assert [(c["trial"], c["passed"], c["reference"]) for c in checked] == [(2, False, 0), (1, True, 0)], checked
    assert checked[1]["max_loss_diff"] <= 1e-4 and checked[1]["adapter_rel_diff"] <= 0.02
    assert checked[0]["adapter_rel_diff"] > TOLERANCE["adapter_rel_diff"], "twice the seed's 2e-5"
    sweep = _load(tmp_path)
    assert [r.number for r in sweep.ranked()] == [1, 0], "the one that trains another model is never ranked"
    assert sweep.rows[1].same_model["passed"] and not sweep.rows[2].same_model["passed"]
    out = capsys.readouterr().out
    assert "same model: trial 2 failed" in out and "same model: trial 1 passed" in out
    assert faster.check_finalists(study, _Store(), lambda: _load(tmp_path), sweeper, [], {}) == [], "checked once"


def test_every_speed_in_the_words_says_how_it_was_read(tmp_path: Path) -> None:
    """Issue 46: each tokens/s the report quotes says whether it was read alone on its card or on a shared one."""
    from src.readings import read_how
    from src.report.advice import what_to_change

    _study(f"sqlite:///{tmp_path}/speed.db", [(1, 2, 1000.0, []), (2, 1, 1500.0, [])])
    sweep = _load(tmp_path)
    sweep.rows[0].slot, sweep.rows[1].slot = "cuda0#0", "cuda0#1"
    assert read_how(sweep, sweep.rows[1]) == " (read on a card shared by up to 2 trials)"
    said = " ".join(what_to_change(sweep))
    assert "1,500 tokens/s (read on a card shared by up to 2 trials)" in said, said
    sweep.rows[1].slot = "cuda1"
    assert read_how(sweep, sweep.rows[1]) == " (read alone on its card)"
    sweep.rows[1].slot = "cpu0"
    assert read_how(sweep, sweep.rows[1]) == " (read on a CPU)"


def test_on_a_gpu_the_second_stage_queues_the_reference_with_the_levers_that_keep_the_model(tmp_path: Path) -> None:
    """Issue 46's second stage: on the reference (the recipe, stable), every same-model lever together first (the
    fastest guess), then each alone; the same rows in fewer micro-batches is a setting the map already measured
    (trial 1: batch 2 x accumulation 1), so it is not queued again; queued once per study, beyond n_trials."""
    from src.config import compose
    from src.sweep import faster
    from src.sweep.memory import MemoryGate

    storage = f"sqlite:///{tmp_path}/speed.db"
    _study(storage, [(1, 2, 1000.0, []), (2, 1, 1500.0, []), (8, 2, 6000.0, [])])
    study = optuna.load_study(study_name="speed", storage=storage)
    config = compose(["hydra/sweeper=optuna", "model=llama3_8b_synthetic"], hydra_config=True)
    memory = MemoryGate(config, "predict", None, 24.0)
    args = (config, memory, ["model=llama3_8b_synthetic"], SPACE, 24.0)
    queued = faster.search(study, _load(tmp_path), *args, cuda=True)
    every = ["model.attn_implementation='sdpa'", "trainer.torch_compile='layers'", "model.upcast_non_quantized=false"]
    assert queued == [every, every[:1], every[1:2]], queued
    waiting = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.WAITING]
    assert [json.loads(t.user_attrs["sweep.lever"]) for t in waiting] == queued
    fixed = [t.system_attrs["fixed_params"] for t in waiting]  # what Optuna will ask them with
    assert fixed == [{BATCH: 2, ACC: 1}, {BATCH: 1, ACC: 2}, {BATCH: 1, ACC: 2}], "a knob of the space: in the map"
    assert all(t.user_attrs["sweep.lever_of"] == 0 and t.user_attrs["sweep.faster"] for t in waiting)
    assert study.user_attrs["sweep.faster"] == {"reference": 0, "queued": queued}
    assert faster.search(study, _load(tmp_path), *args, cuda=True) == [], "once per study"
    assert "trainer.recompute=no_down" not in str(queued), "the recompute variant only where the reference checkpoints"


def test_the_standard_mfu_divides_by_the_cards_spec_dense_bf16_peak() -> None:
    from src.gpus import bf16_peak_tflops

    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4 and bf16_peak_tflops("NVIDIA H200") == 989.4
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0 and bf16_peak_tflops("NVIDIA L40S") == 362.05
    assert bf16_peak_tflops("NVIDIA GeForce RTX 4090") == 165.2 and bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312
    assert bf16_peak_tflops("none (cpu)") is None


def test_where_the_recipe_fails_the_reference_is_the_stable_setting_with_its_split(tmp_path: Path) -> None:
    """The recipe ran out of memory: the reference is the best stable setting at its batch x accumulation (the recipe
    with the lever that made it fit), not a faster one that splits the same rows otherwise."""
    from src.sweep import faster

    storage = f"sqlite:///{tmp_path}/speed.db"
    _study(storage, [(1, 2, 0.0, []), (1, 2, 900.0, ["trainer.gradient_checkpointing=true"]), (2, 1, 1500.0, [])])
    study = optuna.load_study(study_name="speed", storage=storage)
    study.set_user_attr("sweep.step_defaults", {BATCH: 1, ACC: 2, "trainer.packing": False})
    sweep = _load(tmp_path)
    sweep.rows[0].verdict = "failed"
    assert faster.reference(sweep).number == 1
    assert [r.number for r in faster.to_check(sweep, 2)[1]] == [2], "the faster split is checked against it"


def test_each_second_stage_trial_is_a_setting_of_its_own_for_optunas_tools(
    root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The second stage's trials run the reference's params with levers on top: each carries its levers as an Optuna
    param (record.FASTER_PARAM, one distribution over what the stage queued), so `optuna best-trials` and the
    dashboard never read them as the reference's setting. (The stage's second trial used to be refused that param:
    "CategoricalDistribution does not support dynamic value space", seen in a rehearsal of the GPU journey.)"""
    from src import record
    from src.sweep.process import Outcome
    from tests.test_recipe import _fake_sweep

    monkeypatch.setattr("src.sweep.faster.devices", lambda sweeper: [0])  # the stand-in trials are a card's
    monkeypatch.setattr("src.sweep.engine.devices", lambda sweeper: [0])

    def process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        speed = 1000.0 + 100.0 * sum("sdpa" in o or "no_down" in o or "=2" in o for o in overrides)
        return Outcome("ok", metrics={"tokens_per_s": speed, "peak_vram_reserved_gib": 8.0, "vram_budget_gib": 24.0})

    _fake_sweep(
        monkeypatch,
        "faster",
        process,
        ["data.max_seq_length=choice(256,512)"],
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.enqueue_trials=[{data.max_seq_length:512}]",
        "trainer.gradient_checkpointing=true",
        f"{BATCH}=1",
        f"{ACC}=2",
        "hydra.sweeper.speed_trials=3",
        "hydra.sweeper.same_model_steps=0",  # trained for real above
        "hydra.sweeper.timing_repeats=0",
        "hydra.sweeper.soak_top_k=0",
    )
    study = optuna.load_study(study_name="faster", storage=f"sqlite:///{root}/sweeps/faster/optuna.db")
    stage = [t for t in study.get_trials() if t.user_attrs.get(record.FASTER)]
    assert len(stage) == 3, [t.user_attrs for t in study.get_trials()]
    reference = study.trials[study.user_attrs[record.FASTER]["reference"]]
    for t in stage:
        lever = json.loads(t.user_attrs[record.LEVER])
        assert t.params == {**reference.params, record.FASTER_PARAM: ", ".join(lever)}
    assert len({json.dumps(t.params, sort_keys=True) for t in [reference, *stage]}) == 4, "four settings"
    assert "dynamic value space" not in caplog.text
    sweep = _load_named(root, "faster")
    assert all(not {record.FASTER_PARAM} & set(sweep.row(t.number).params) for t in stage), "not a knob"


def _load_named(root: Path, study: str) -> Sweep:
    return report.load(study, root / "sweeps")


def test_a_split_never_checked_because_the_recipe_s_split_never_fit_says_so(tmp_path: Path) -> None:
    """The recipe (batch 4 x accumulation 1) ran out of memory and only the half batch (2 x 2) fit: the same rows per
    optimizer step in other micro-batches, with nothing at the recipe's split to check it against. The
    recommendation says it was not checked (seen in a CPU rehearsal of the journey, where it said nothing)."""
    from src.report.recommendation import same_model_words

    storage = f"sqlite:///{tmp_path}/speed.db"
    study = optuna.create_study(study_name="speed", storage=storage, direction="maximize")
    oom = {"trial.status": "failed", "failure.kind": "oom", "failure.step": 1, "sweep.recipe": True}
    study.add_trial(
        optuna.trial.create_trial(
            params={BATCH: 4, ACC: 1}, distributions=SPACE, state=TrialState.PRUNED, user_attrs=oom
        )
    )
    _study_add = {"trial.status": "ok", "vram_budget_gib": 24.0, "peak_vram_reserved_gib": 8.0,
                  "vram_headroom_frac": 2 / 3, "tokens_per_s": 900.0, "truncated_answer_frac": 0.0,
                  "tokens_per_optimizer_step": 600.0, "sweep.lever_of": 0,
                  "sweep.lever": json.dumps([f"{BATCH}=2", f"{ACC}=2"])}  # fmt: skip
    study.add_trial(
        optuna.trial.create_trial(params={BATCH: 4, ACC: 1}, distributions=SPACE, value=900.0, user_attrs=_study_add)
    )
    sweep = _load(tmp_path)
    half = sweep.rows[1]
    assert sweep.recommended() is half and sweep.same_optimisation(half)
    said = same_model_words(sweep, half)
    assert "not checked to train your recipe's model" in said and "batch 4 x accumulation 1" in said, said
    assert same_model_words(sweep, sweep.rows[0]) == "", "the recipe itself"
