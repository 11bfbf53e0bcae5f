"""What to change: hand-made studies of the user's recipe on a 24 GiB card (the figures of issue #16's table) are
answered in sentences that name their trials and quote their figures; lever trials stay off the map; a setting
that cuts more answers than the policy allows is measured and shown, never promoted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from src import promote, report, tracking
from src.config import compose, flatten
from src.promote.experiment import TrialConfig
from src.report.plots import map_cells
from src.report.publish import _TAG_LIMIT, _whole_sentences

BUDGET = 24.0
_SPACE = {
    "data.max_seq_length": CategoricalDistribution([512, 768, 1024]),
    "trainer.gradient_accumulation_steps": CategoricalDistribution([1, 2, 4]),
    "lora.r": CategoricalDistribution([8, 16]),
    "trainer.group_by_length": CategoricalDistribution([False, True]),
}
RECIPE = {
    "data.max_seq_length": 1024,
    "trainer.gradient_accumulation_steps": 2,
    "lora.r": 16,
    "trainer.group_by_length": True,
}
CKPT = "trainer.gradient_checkpointing=true"
BF16 = "model.upcast_non_quantized=false"
SDPA = "model.attn_implementation=sdpa"


def ran(reserved: float, tokens_per_s: float, **more: float) -> dict[str, Any]:
    """A finished trial's record, as the trial and the engine write it."""
    return {
        "trial.status": "ok",
        "vram_budget_gib": BUDGET,
        "peak_vram_reserved_gib": reserved,
        "vram_headroom_frac": 1 - reserved / BUDGET,
        "tokens_per_s": tokens_per_s,
        **more,
    }


def oom(held: float = 23.1, asked: float = 1.8, **more: float) -> dict[str, Any]:
    return {
        "trial.status": "failed",
        "failure.kind": "oom",
        "failure.step": 1,
        "failure.message": "CUDA out of memory",
        "vram_budget_gib": BUDGET,
        "peak_vram_reserved_gib": held,
        "oom_request_gib": asked,
        **more,
    }


def study(storage: str, name: str, trials: list[tuple[dict[str, Any], dict[str, Any]]]) -> optuna.Study:
    """(changes to the recipe's params, record) per trial, in order; `lever` in the record becomes the engine's
    JSON user attr, and the first trial is the recipe."""
    s = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    for n, (changes, record) in enumerate(trials):
        attrs = {"truncated_answer_frac": 0.0, "truncated_row_frac": 0.0, **record}
        if "lever" in attrs:
            attrs |= {"sweep.lever": json.dumps(attrs.pop("lever")), "sweep.lever_of": 0}
        if n == 0:
            attrs["sweep.recipe"] = True
        failed = attrs["trial.status"] == "failed"
        s.add_trial(
            optuna.trial.create_trial(
                params={**RECIPE, **changes},
                distributions=_SPACE,
                value=0.0 if failed else attrs["tokens_per_s"],
                state=TrialState.COMPLETE,
                user_attrs=attrs,
            )
        )
    return s


# The user's recipe OOMs at 1024; shorter rows, levers and a pair of knobs fit.
OOM_RECIPE = [
    ({}, oom()),  # 0: the recipe
    ({"data.max_seq_length": 768}, ran(20.16, 1398.0, truncated_answer_frac=0.04)),  # 1: fits, cuts answers
    ({"data.max_seq_length": 512}, ran(15.53, 1133.0, truncated_answer_frac=0.12)),  # 2: farther than 768
    ({"lora.r": 8}, ran(22.0, 1420.0)),  # 3: marginal (8% headroom): not a fix
    ({"trainer.gradient_accumulation_steps": 4}, oom()),  # 4
    ({}, {**ran(9.55, 712.0), "lever": [CKPT]}),  # 5: checkpointing fits at half the speed
    ({}, {**ran(20.60, 1426.0), "lever": [BF16]}),  # 6: bf16 weights fit at the same speed
    ({}, {**oom(22.9, 2.5), "lever": [SDPA]}),  # 7: SDPA alone does not
    ({"lora.r": 8, "trainer.group_by_length": False}, ran(19.0, 1300.0)),  # 8: a pair, neither alone works
    ({"data.max_seq_length": 768, "lora.r": 8}, ran(19.5, 1380.0, truncated_answer_frac=0.04)),  # 9: 768 suffices
    ({"data.max_seq_length": 768, "trainer.group_by_length": False}, ran(20.2, 1600.0, truncated_answer_frac=0.04)),
]


@pytest.fixture
def oom_sweep(tmp_path: Path) -> report.Sweep:
    storage = f"sqlite:///{tmp_path}/advice.db"
    study(storage, "recipe", OOM_RECIPE)
    return report.load("recipe", tmp_path / "sweeps", storage=storage)


def test_an_oom_recipe_is_answered_with_its_smallest_measured_fixes(oom_sweep: report.Sweep) -> None:
    assert oom_sweep.max_truncated_answer_frac == 0.0  # no parent run: the composed preflight default
    assert [r.number for r in oom_sweep.rows if r.recipe] == [0]
    assert [r.change() for r in oom_sweep.rows[5:8]] == [
        "gradient_checkpointing=true",
        "upcast_non_quantized=false",
        "attn_implementation=sdpa",
    ]
    said = report.what_to_change(oom_sweep)
    assert said[0] == (
        "Your recipe (trial 0: max_seq_length 1024, gradient_accumulation_steps 2, r 16, group_by_length true) "
        "fails: oom at step 1 — it needed at least 24.90 GiB of the 24 GiB budget."
    )
    # one knob (the nearest length that fits, not 512), then the levers that worked, then the pair
    assert said[1].startswith("Trial 1 (max_seq_length 768 instead of 1024) makes it stable: 20.16 GiB peak reserved")
    assert "1,398 tokens/s" in said[1] and "0.98× the speed of trial 6" in said[1]
    assert "cuts 4% of answers at data.max_seq_length=768, more than preflight.max_truncated_answer_frac=0" in said[1]
    assert said[2].startswith("Trial 5 (your recipe with gradient_checkpointing=true) makes it stable: 9.55 GiB")
    assert "712 tokens/s, 0.50× the speed of trial 6" in said[2]
    assert said[3].startswith("Trial 6 (your recipe with upcast_non_quantized=false) makes it stable: 20.60 GiB")
    assert "1,426 tokens/s, the fastest of these options" in said[3]
    assert said[4].startswith("Trial 8 (r 8 and group_by_length false instead of 16 and true) makes it stable")
    assert not any("trial 2)" in s or "trial 3)" in s or "trial 7)" in s or "trial 9)" in s for s in said[1:5])
    # the fastest within the policy is the bf16 lever; a faster setting that cuts answers is named, not chosen
    assert said[5].startswith("The fastest stable setting measured is trial 6 (") and "upcast_non_quantized" in said[5]
    assert said[6].startswith("Trial 10 (") and "faster at 1,600 tokens/s, but it cuts 4% of answers" in said[6]
    # and ends with one recommendation: the setting, its figures against the recipe, its soak, the command
    assert said[7].startswith(
        "Recommended: trial 6 (recipe + upcast_non_quantized=false): 20.60 GiB peak reserved of the 24 GiB budget, "
        "1,426 tokens/s (your recipe: failed, oom at step 1); not soaked yet"
    )
    assert said[7].endswith(
        "it keeps 100.0% of answers whole. Train it: `python -m src.promote recipe --allow-unsoaked`, then "
        "`python -m src.train experiment=production`."
    )
    assert len(said) == 8


def test_a_setting_that_cuts_too_many_answers_is_shown_but_never_promoted(oom_sweep: report.Sweep) -> None:
    assert oom_sweep.cuts_too_much(oom_sweep.rows[10]) and oom_sweep.rows[10].verdict == "stable"  # class: memory's
    assert (
        oom_sweep.best().number == 6 == promote.choose(oom_sweep, allow_unsoaked=True).number
    )  # a lever trial can be promoted
    with pytest.raises(promote.NotPromotable) as refused:
        promote.choose(oom_sweep, trial=10, allow_unsoaked=True)
    message = str(refused.value)
    assert "trial 10 cuts 4% of the assistant answers at data.max_seq_length=768" in message
    assert "refused above preflight.max_truncated_answer_frac=0" in message

    every_fit_cuts = [OOM_RECIPE[0], OOM_RECIPE[1], OOM_RECIPE[2]]
    storage = f"sqlite:///{oom_sweep.study_dir.parent.parent}/cutting.db"
    study(storage, "cutting", every_fit_cuts)
    cutting = report.load("cutting", oom_sweep.study_dir.parent, storage=storage)
    assert cutting.best() is None
    with pytest.raises(promote.NotPromotable, match=r"each cuts more answers .* \(trial 1 4%, trial 2 12%\)"):
        promote.choose(cutting, allow_unsoaked=True)


def test_lever_trials_stay_off_the_map_and_the_importances_but_show_in_the_table(oom_sweep: report.Sweep) -> None:
    x, y = "data.max_seq_length", "lora.r"
    grid, text = map_cells(oom_sweep, x, y)
    column, row = [512, 768, 1024].index(1024), [8, 16].index(16)
    assert text[row][column] == "2 oom"  # the recipe and trial 4; its levers (two stable) are not at these knobs
    assert grid[row][column] == 1  # failed's colour
    imp = report.importance(oom_sweep, "tokens_per_s", "maximize")
    assert imp.n_trials == 6  # trials 1, 2, 3, 8, 9, 10: the levers 5 and 6 finished too but are left out

    written = report.write(oom_sweep)
    md = written.files[0].read_text()
    assert md.index("## What to change") < md.index("## Map") and md.index("## What to change") > md.index("trials,")
    assert f"- {written.advice[0]}" in md
    assert "| group_len | change | class |" in md and "| gradient_checkpointing=true |" in md
    assert "| 4% > 0% |" in md and "cut answers" in md
    headers = [c.header for c in report.table(oom_sweep).columns]
    assert "change" in headers and "cut answers" in headers


# The recipe is marginal; doubling gradient accumulation makes it stable but is a different optimisation.
STEP_CHANGE = [
    ({}, ran(22.5, 1400.0, tokens_per_optimizer_step=2048.0, **{"sweep.slot": "cuda0#0"})),
    (
        {"trainer.gradient_accumulation_steps": 4},
        ran(20.0, 1456.0, tokens_per_optimizer_step=4096.0, **{"sweep.slot": "cuda0#1"}),
    ),
]


def test_a_fix_that_changes_tokens_per_optimizer_step_is_called_a_different_optimisation(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/step.db"
    study(storage, "step", STEP_CHANGE)
    said = report.what_to_change(report.load("step", tmp_path / "sweeps", storage=storage))
    assert said[0].startswith("Your recipe (trial 0: ") and "is marginal (headroom 6% < 10%): 22.50 GiB" in said[0]
    assert said[1] == (
        "Trial 1 (gradient_accumulation_steps 4 instead of 2) makes it stable: 20.00 GiB peak reserved of the 24 GiB "
        "budget (headroom 17%), 1,456 tokens/s (read on a card shared by up to 2 trials), 1.04× your recipe's speed; "
        "a different optimisation: 4,096 tokens per optimizer step instead of 2,048."
    )
    assert said[2].startswith("The fastest stable setting measured is trial 1 (")
    assert "a different optimisation" in said[2]
    assert said[3].startswith("Trials shared a card (up to 2 at once)")


def test_when_nothing_measured_fixes_the_recipe_it_says_what_was_tried(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/none.db"
    study(storage, "none", [OOM_RECIPE[0], OOM_RECIPE[4], OOM_RECIPE[7]])
    said = report.what_to_change(report.load("none", tmp_path / "sweeps", storage=storage))
    assert said[1] == (
        "Nothing measured makes your recipe stable; tried: trial 1 (gradient_accumulation_steps 4 instead of 2: "
        "failed, oom at step 1); trial 2 (your recipe with attn_implementation=sdpa: failed, oom at step 1)."
    )
    assert said[2] == "No setting to recommend: no measured setting ran within the budget."


def test_the_policy_comes_from_the_sweep_and_the_advice_reaches_its_parent_run(
    root: Path, capsys: pytest.CaptureFixture
) -> None:
    """A sweep run with preflight.max_truncated_answer_frac=0.05 allows 768's 4%: it may be promoted. The report's
    terminal output and the parent run's tag carry the same sentences as report.md."""
    uri = f"sqlite:///{root}/mlruns/mlflow.db"
    tracking.setup(uri)
    client = MlflowClient(uri)
    experiment = client.create_experiment("recipe", artifact_location=(root / "mlruns" / "artifacts").as_uri())
    parent = client.create_run(experiment).info.run_id
    client.set_tag(parent, "sweep.max_truncated_answer_frac", json.dumps(0.05))
    storage = f"sqlite:///{root}/advice.db"
    study(storage, "recipe", OOM_RECIPE).set_user_attr("mlflow_parent_run_id", parent)

    sweep = report.load("recipe", root / "sweeps", storage=storage, tracking_uri=uri)
    assert sweep.max_truncated_answer_frac == 0.05
    assert promote.choose(sweep, allow_unsoaked=True).number == 10  # 1,600 tokens/s, 4% cut, within this sweep's policy
    said = report.what_to_change(sweep)
    assert "; it cuts 4% of answers" in said[1] and "more than" not in said[1]

    assert report.main(["recipe", "--storage", storage, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "what to change:" in out and f"- {said[0]}" in out
    assert client.get_run(parent).data.tags["report.what_to_change"] == "\n".join(said)


def test_a_promoted_lever_trial_carries_its_lever_into_the_experiment(oom_sweep: report.Sweep) -> None:
    """The lever is on the trial's logged command line; the Optuna record carries it even where that is lost."""
    default = compose().trainer.gradient_checkpointing
    lever = f"trainer.gradient_checkpointing={'false' if default else 'true'}"
    row = oom_sweep.rows[5]
    row.lever = [lever]
    knobs = [f"{k}={json.dumps(v)}" for k, v in row.params.items()]
    composed = compose([*knobs, lever], hydra_config=True)
    choices = OmegaConf.to_container(composed.hydra.runtime.choices)
    config = flatten(OmegaConf.to_container(compose([*knobs, lever]), resolve=False))
    for logged in ([*knobs, lever], knobs):
        exp = promote.plan(oom_sweep, row, TrialConfig(config, logged, choices))
        assert exp.values["trainer.gradient_checkpointing"] is (not default), logged
        assert "trainer.gradient_checkpointing" not in exp.pinned
    header = promote.header(oom_sweep, row, exp, "llama3-qlora", "1", [], False)
    assert any(line.startswith(f"lever:      {lever}") for line in header)


def test_a_recipe_that_fits_but_cuts_answers_is_fixed_only_by_settings_that_keep_them(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/cut.db"
    study(
        storage,
        "cut",
        [
            ({"data.max_seq_length": 768}, ran(20.16, 1398.0, truncated_answer_frac=0.04)),  # the user's own length
            ({"data.max_seq_length": 768, "lora.r": 8}, ran(19.5, 1420.0, truncated_answer_frac=0.04)),  # cuts too
            ({}, ran(21.0, 1380.0)),  # 1024 keeps every answer
        ],
    )
    sweep = report.load("cut", tmp_path / "sweeps", storage=storage)
    said = report.what_to_change(sweep)
    assert (
        said[0].startswith("Your recipe (trial 0: max_seq_length 768,")
        and (
            "is stable: 20.16 GiB peak reserved of the 24 GiB budget (headroom 16%), 1,398 tokens/s, but it cuts 4% of "
            "answers at data.max_seq_length=768, more than preflight.max_truncated_answer_frac=0 allows (never promoted)."
        )
        in said[0]
    )
    assert said[1].startswith(
        "Trial 2 (max_seq_length 1024 instead of 768) makes it stable within the truncation policy: 21.00 GiB"
    )
    assert "0.99× your recipe's speed" in said[1]
    assert promote.choose(sweep, allow_unsoaked=True).number == 2


def test_the_advice_tag_keeps_whole_sentences_within_mlflows_limit() -> None:
    sentences = [f"Trial {n} ({'x' * 300}) makes it stable." for n in range(40)]
    tag = _whole_sentences(sentences)
    assert len(tag) <= _TAG_LIMIT and tag.endswith("\n(more in report.md: What to change)")
    kept = tag.splitlines()[:-1]
    assert kept == sentences[: len(kept)] and len(kept) > 10
