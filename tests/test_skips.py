"""Issue 30, findings 13, 14 and 6: what the sweep skips, when it stops skipping, and how it says so."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import optuna
from optuna.distributions import CategoricalDistribution

from src.sweep.engine import SweepEngine
from tests.conftest import compose_cfg

BATCH, ACC = "trainer.per_device_train_batch_size", "trainer.gradient_accumulation_steps"
SPACE = {BATCH: CategoricalDistribution([1, 2, 4]), ACC: CategoricalDistribution([1, 2, 8])}


def _told(study: optuna.Study, batch: int, acc: int, status: str, kind: str | None = None) -> None:
    attrs = {"trial.status": status, **({"failure.kind": kind} if kind else {})}
    study.add_trial(
        optuna.trial.create_trial(params={BATCH: batch, ACC: acc}, distributions=SPACE, value=0.0, user_attrs=attrs)
    )


def test_a_setting_measured_ok_is_never_a_certain_oom(root: Path) -> None:
    """One OOM at batch 1 x accumulation 8 while batch 1 x accumulation 2 ran ok: accumulation is neutral, so the
    OOM contradicts a measurement and makes no other setting a certain OOM (it made every one, once)."""
    cfg = compose_cfg(["hydra/sweeper=optuna", "hydra.sweeper.study_name=okfits", "trainer.output_dir=/tmp/unused"])
    rules = SweepEngine(cfg, []).rules
    assert rules.monotone[ACC] == "neutral"

    def certain(study: optuna.Study, batch: int, acc: int) -> bool:
        return rules.certain_oom(study, SimpleNamespace(params={BATCH: batch, ACC: acc})) is not None

    lone = optuna.create_study()
    _told(lone, 1, 8, "failed", "oom")
    assert certain(lone, 1, 2) and certain(lone, 2, 1), "an uncontradicted OOM at batch 1 still rules"
    study = optuna.create_study()
    _told(study, 1, 8, "failed", "oom")
    _told(study, 1, 2, "ok")
    assert not certain(study, 1, 2), "measured ok"
    assert not certain(study, 1, 1) and not certain(study, 2, 2) and not certain(study, 4, 8)
    _told(study, 4, 1, "failed", "oom")  # an OOM nothing contradicts still rules beyond itself
    assert certain(study, 4, 2) and not certain(study, 2, 8)


def test_levers_launch_only_on_a_recipe_that_failed_for_memory(root: Path) -> None:
    """A config or data error in the recipe is the same with every lever: none is queued (13 config_error trials
    once); an OOM, or a recipe that ran too near the budget, gets its levers."""
    from src.sweep import recipe

    cfg = compose_cfg(["trainer.per_device_train_batch_size=4", "trainer.output_dir=/tmp/unused"])
    assert recipe.levers(cfg, {}), "the seed's recipe has levers to try"
    for kind, expected in [("config_error", 0), ("data_error", 0), ("nan_loss", 0), ("oom", None), (None, None)]:
        study = optuna.create_study()
        attrs = {"trial.status": "failed" if kind else "ok", "sweep.recipe": True}
        attrs |= {"failure.kind": kind} if kind else {"peak_vram_reserved_gib": 23.9}
        _told(study, 1, 2, "ok")
        frozen = study.trials[0]
        frozen.user_attrs.clear()
        frozen.user_attrs.update(attrs)
        queued = recipe.queue_levers(study, cfg, frozen)
        assert len(queued) == (expected if expected is not None else len(recipe.levers(cfg, frozen.params))), kind
        assert expected is not None or queued, kind


def _marginal_process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None):
    """Every setting runs, a hair under the budget: the recipe is marginal and gets its levers."""
    from src.sweep.process import Outcome

    budget = float(next(o.split("=", 1)[1] for o in overrides if o.startswith("hardware.vram_budget_gib=")))
    metrics = {"tokens_per_s": 100.0, "peak_vram_reserved_gib": 0.99 * budget, "vram_budget_gib": budget}
    return Outcome("ok", metrics=metrics)


def test_n_trials_bounds_the_maps_trials_with_queued_settings(root: Path, monkeypatch) -> None:
    """`sweep=demo hydra.sweeper.n_trials=2` ran 13 trials: the demo queues its 10 settings, the marginal recipe
    queues 3 levers, and a waiting lever kept the study from full while each queued setting was popped before it.
    Now the map holds n_trials trials and the levers run beyond them, counted apart (the bar grows by them)."""
    from tests.test_sweep import _fake_sweep

    budget = "hardware.vram_budget_gib=0.32"
    _fake_sweep(monkeypatch, "bounded", 2, [budget], "sweep=demo", budget, queue_seed=True, process=_marginal_process)
    trials = optuna.load_study(study_name="bounded", storage=f"sqlite:///{root}/sweeps/bounded/optuna.db").trials
    levers = [t for t in trials if "sweep.lever" in t.user_attrs]
    mapped = [t for t in trials if "sweep.lever" not in t.user_attrs]
    assert len(mapped) == 2 and levers, [t.params for t in trials]
    assert all(t.state.is_finished() for t in trials), "nothing left waiting"


def test_a_sweep_that_can_launch_nothing_new_stops_and_says_why(root: Path, monkeypatch, capsys) -> None:
    """n_trials=10000 on a space measured out ran 1,355 skipped trials in 3 minutes: a finite space once every
    setting is told, or any space after hydra.sweeper.max_skips_in_a_row skipped proposals in a row, ends the sweep with one line."""
    from src.sweep import gate
    from tests.test_sweep import _fake_sweep, _ok_process

    _fake_sweep(monkeypatch, "measured_out", 60, ["lora.r=choice(4,8)"], process=_ok_process)
    out = capsys.readouterr().out
    trials = optuna.load_study(study_name="measured_out", storage=f"sqlite:///{root}/sweeps/measured_out/optuna.db")
    assert len(trials.trials) == 2, "both settings measured, nothing skipped"
    assert "sweep ended early: all 2 settings of the space are on the map after 2 trials" in out
    assert "n_trials=60" in out

    monkeypatch.setattr(gate, "space_size", lambda distributions: None)  # as a space with a continuous knob
    space = ["lora.r=choice(4,8)"]
    _fake_sweep(monkeypatch, "repeats", 60, space, "hydra.sweeper.max_skips_in_a_row=5", process=_ok_process)
    out = capsys.readouterr().out
    trials = optuna.load_study(study_name="repeats", storage=f"sqlite:///{root}/sweeps/repeats/optuna.db").trials
    assert len(trials) == 7 and [t.user_attrs["trial.status"] for t in trials[2:]] == ["skipped"] * 5
    assert "sweep ended early: the last 5 proposals were all skipped" in out


def test_the_summary_words_skips_by_reason_and_the_bar_counts_lever_trials(capsys) -> None:
    """ "skipped as repeats" was said of certain-OOM skips; the bar ran past its total ("13trial" of 3) as the
    recipe's lever trials ran beyond n_trials: its total grows by them."""
    from omegaconf import OmegaConf

    from src.sweep.tally import Tally

    study = optuna.create_study()
    _told(study, 1, 2, "ok")
    for reason in ("certain_oom", "certain_oom", "repeat"):
        study.add_trial(
            optuna.trial.create_trial(
                params={BATCH: 4, ACC: 1},
                distributions=SPACE,
                state=optuna.trial.TrialState.PRUNED,
                user_attrs={"trial.status": "skipped", "skip.reason": reason},
            )
        )
    tally = Tally("words", "tokens_per_s", True)
    tally.refresh(study)
    summary = tally.summary("sqlite:///x", "sqlite:///y", "trials", "python -m src.report words")
    assert "4 trials finished, 1 ok, 3 skipped (2 certain OOMs, 1 repeat)" in summary
    assert "as repeats" not in summary

    tally.start_bar(OmegaConf.create({"n_trials": 3, "progress": True}))
    assert tally.bar.total == 3
    for lever in ("a", "b"):
        study.enqueue_trial({BATCH: 1, ACC: 2}, user_attrs={"sweep.lever": f'["{lever}"]'})
    tally.refresh(study)
    tally.show(finished=1)
    assert tally.bar.total == 5 and tally.bar.n <= tally.bar.total
    tally.close_bar()


def test_the_readmes_tab_completion_completes_python_m_src_train(root: Path, tmp_path: Path) -> None:
    """Hydra's `--shell-completion install=bash` completes nothing for `python -m src.train`: the README's function
    does, as bash calls it (COMP_LINE, COMP_WORDS, COMP_CWORD), with the venv's python."""
    import re
    import subprocess
    import sys

    from src.config import PROJECT_DIR

    readme = (PROJECT_DIR / "docs" / "sweeps.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "_qlora_train_complete" in b)
    (tmp_path / "complete.sh").write_text(block)
    script = f"""
source {tmp_path / "complete.sh"}
for COMP_LINE in "python -m src.train trainer.per_device" "python -m src.train lora.r=16 sweep=de"; do
  read -ra COMP_WORDS <<< "$COMP_LINE"; COMP_CWORD=$((${{#COMP_WORDS[@]}}-1)); COMP_POINT=${{#COMP_LINE}}
  _qlora_train_complete; echo "${{COMPREPLY[*]}}"
done
"""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "QLORA_ROOT": str(root)}
    done = subprocess.run(["bash", "-c", script], cwd=PROJECT_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["trainer.per_device_train_batch_size=", "sweep=demo"], done.stderr


def test_a_negative_max_skips_in_a_row_is_refused_naming_the_key(root: Path) -> None:
    import pytest

    from src.sweep.space import SpaceError

    cfg = compose_cfg(["hydra/sweeper=optuna", "hydra.sweeper.max_skips_in_a_row=-1", "trainer.output_dir=/tmp/unused"])
    with pytest.raises(SpaceError, match=r"hydra.sweeper.max_skips_in_a_row=-1: must be at least 0"):
        SweepEngine(cfg, [])


def test_a_fresh_grid_is_queued_edge_first_once_each_within_n_trials() -> None:
    """seeds.edge_first on a fresh grid: the memory model's order, each setting once (the user's recipe, queued
    before, is not queued again), no more than n_trials leaves room for."""
    from optuna.trial import TrialState

    from src import record
    from src.sweep import seeds

    space = {"a": [1, 2, 3], "b": [True, False]}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(space))
    study.enqueue_trial({"a": 2, "b": True}, user_attrs={record.RECIPE: True})

    class Memory:
        active = True

        def refresh(self, n: int) -> None:
            pass

        def edge_order(self, grid: list[dict], fixed: list[str]) -> list[dict]:
            return sorted(grid, key=lambda p: (-p["a"], p["b"]))

    class Store:
        def occupied(self, study: optuna.Study) -> int:
            return 0

    distributions = {k: CategoricalDistribution(v) for k, v in space.items()}
    seeds.edge_first(study, Store(), SimpleNamespace(n_trials=4), distributions, Memory(), [])
    waiting = [t.system_attrs["fixed_params"] for t in study.get_trials(states=(TrialState.WAITING,))]
    assert waiting == [{"a": 2, "b": True}, {"a": 3, "b": False}, {"a": 3, "b": True}, {"a": 2, "b": False}]
