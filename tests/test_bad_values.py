"""Bad values are refused by range before any work, each naming its key or flag (#30.20): the sweeper's keys, the
data's row limit, `src.fit`'s cards and model file, and the margin of `src.report` and `src.promote`; and values
that ended in a raw traceback end in one line naming the key (#30.21)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from src.failures import DataError
from tests.conftest import compose_cfg


@pytest.mark.parametrize(
    "override,message",
    [
        ("trial_timeout_s=0", "hydra.sweeper.trial_timeout_s=0: must be seconds, more than 0"),
        ("stall_timeout_s=-5", "hydra.sweeper.stall_timeout_s=-5: must be seconds, more than 0"),
        ("cpu_slots=100000", "hydra.sweeper.cpu_slots=100000: at most"),
        ("headroom_margin=1.5", "hydra.sweeper.headroom_margin=1.5: must be a share of the budget"),
        ("headroom_margin=-0.1", "hydra.sweeper.headroom_margin=-0.1: must be a share of the budget"),
        ("soak_top_k=-1", "hydra.sweeper.soak_top_k=-1: must be at least 0"),
        ("soak_minutes=-1", "hydra.sweeper.soak_minutes=-1: must be minutes, at least 0"),
        ("grace_period_s=5", "hydra.sweeper.grace_period_s=5: must be more than hydra.sweeper.heartbeat_interval_s"),
    ],
)
def test_out_of_range_sweeper_values_are_refused_before_the_sweep_records_anything(
    root: Path, override: str, message: str
) -> None:
    from src.sweep.engine import SweepEngine

    cfg = compose_cfg(
        [
            "hydra/sweeper=optuna",
            "hydra.sweeper.study_name=values",
            "hydra.sweeper.devices=[]",
            f"hydra.sweeper.{override}",
        ]
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        SweepEngine(cfg, []).run()
    assert not (root / "sweeps" / "values").exists() and not (root / "mlruns" / "mlflow.db").exists()


@pytest.mark.parametrize(
    "overrides,arguments,message",
    [
        (["hydra.sweeper.direction=[up]"], [], "hydra.sweeper.direction=['up']: 'up' is not maximize or minimize"),
        (["hydra.sweeper.direction=[maximize,minimize]"], [], "hydra.sweeper.direction has 2 entries for 1 objectives"),
        (["hydra.sweeper.custom_search_space=nowhere.space"], [], "hydra.sweeper.custom_search_space=nowhere.space: "),
        (["hydra.sweeper.memory_monotone={lora.r:up}"], [], "hydra.sweeper.memory_monotone.lora.r='up': use one of"),
        ([], ["lora.r=choice()"], "the sweep's argument 'lora.r=choice()': ValueError while evaluating 'choice()'"),
        ([], ["lora.r=interval(8,4)"], "the sweep's argument 'lora.r=interval(8,4)': `low <= high` must hold"),
        (["+hydra.sweeper.params={lora.r:'choice()'}"], [], "hydra.sweeper.params.lora.r=choice(): "),
        (
            ["hydra.sweeper.storage=bogus://x"],
            [],
            "hydra.sweeper.storage: the Optuna storage bogus://x is not a database",
        ),
        (["tracking.uri=bogus://x"], [], "tracking.uri: the MLflow tracking store bogus://x: MLflow knows no store"),
        (["hydra.sweeper.sampler.seed=-1"], [], "hydra.sweeper.sampler (optuna.samplers.TPESampler): Seed must be"),
        (["hydra/sweeper/sampler=grid"], ["lora.r=interval(4,8)"], "hydra.sweeper.sampler is a grid, but lora.r is"),
    ],
)
def test_bad_sweep_values_that_ended_in_a_traceback_are_refused_in_one_line_naming_the_key(
    root: Path, overrides: list[str], arguments: list[str], message: str
) -> None:
    """#30.21: each of these ended in a raw traceback of 22-129 lines (Optuna's, Hydra's or SQLAlchemy's own error,
    or the grid sampler's at the first trial after the study and its parent run were made). Each is now one of the
    errors the sweeper prints as one line (hydra_plugins: SpaceError, StoreError), naming the key, before anything is
    recorded."""
    from src.stores import StoreError
    from src.sweep.engine import SweepEngine
    from src.sweep.space import SpaceError

    cfg = compose_cfg(
        ["hydra/sweeper=optuna", "hydra.sweeper.study_name=values", "hydra.sweeper.preload=false", *overrides]
    )
    with pytest.raises((SpaceError, StoreError)) as refused:
        SweepEngine(cfg, arguments or ["lora.r=choice(8,16)"]).run()
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value), str(refused.value)
    assert not (root / "sweeps" / "values").exists() and not (root / "mlruns" / "mlflow.db").exists()


@pytest.mark.parametrize("rows", [0, -1])
def test_a_row_limit_below_one_is_refused_naming_the_key(root: Path, rows: int) -> None:
    from src.data import load_table

    with pytest.raises(DataError, match=re.escape(f"data.max_rows={rows}: must be at least 1")):
        load_table(compose_cfg([f"data.max_rows={rows}"]).data)
    assert len(load_table(compose_cfg(["data.max_rows=3"]).data)) == 3


def test_fit_refuses_a_card_below_zero_and_a_model_file_without_the_models_keys(
    root: Path, capsys: pytest.CaptureFixture
) -> None:
    from src.fit.__main__ import main
    from src.fit.model import MemoryModel

    with pytest.raises(SystemExit) as exit_:
        main(["--card", "-1"])
    assert exit_.value.code == 2 and "--card -1: a card's memory in GiB" in capsys.readouterr().err
    bad = root / "bad.json"
    bad.write_text(json.dumps({"a": 1}))
    assert main(["--model-file", str(bad)]) == 2
    out = capsys.readouterr()
    assert "--model-file" in out.err and "not a fitted model" in out.err and "FITS" not in out.out
    bad.write_text(json.dumps({**MemoryModel().to_dict(), "error": -0.5}))
    assert main(["--model-file", str(bad)]) == 2
    assert "error=-0.5: must be a number, at least 0" in capsys.readouterr().err
    good = root / "good.json"
    MemoryModel().save(good)  # what --save writes is read back
    assert main(["--model-file", str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == f"fitted model from {good}"


@pytest.mark.parametrize("command", ["src.report", "src.promote"])
@pytest.mark.parametrize("margin", ["-1", "1.01"])
def test_report_and_promote_refuse_a_margin_outside_zero_to_one(
    root: Path, capsys: pytest.CaptureFixture, command: str, margin: str
) -> None:
    import importlib

    main = importlib.import_module(f"{command}.__main__").main
    with pytest.raises(SystemExit) as exit_:
        main(["--margin", margin])
    assert exit_.value.code == 2 and f"--margin {float(margin):g}: a share of the budget" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["a/../../../escape", "my study", "../up", ".hidden"])
def test_a_study_name_that_is_not_one_plain_word_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    """`hydra.sweeper.study_name=a/../../../escape` made a lock file outside the project and a name with a space
    failed every trial as "other" (#30.17): refused in one line naming the key, nothing written anywhere."""
    from tests.conftest import run_cli, sweep_argv

    root = tmp_path / "project" / "root"
    root.mkdir(parents=True)
    done = run_cli(*sweep_argv(study=name), root=root)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: hydra.sweeper.study_name={name!r}: a study's name is one word"), done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["project", "project/root"]


def test_report_and_promote_refuse_a_study_name_that_leaves_the_sweeps_folder(
    root: Path, capsys: pytest.CaptureFixture
) -> None:
    from src.promote.__main__ import main as promote
    from src.report.__main__ import main as report

    for main in (report, promote):
        with pytest.raises(SystemExit) as exit_:
            main(["../../etc"])
        assert exit_.value.code == 2 and "study='../../etc': a study's name is one word" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argument,message",
    [
        ("cluster.workers=0", "error: cluster.workers=0: must be at least 1"),
        ("cluster.executor=bogus", "error: cluster.executor=bogus: must be one of slurm, local, debug"),
        ("cluster.workers=abc", "error: cluster.workers=abc: Value 'abc' of type 'str' could not be converted"),
        ("lora.r=abc", "error: lora.r=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_bad_cluster_values_are_refused_in_one_line_before_anything_is_submitted(
    root: Path, argument: str, message: str
) -> None:
    """`python -m src.cluster`: workers=0 submitted nothing and said so as a success; an unknown executor, a value of
    the wrong type (of the cluster or of the sweep) ended in submitit's or Hydra's traceback (#30.21)."""
    from src.cluster import main

    with pytest.raises(SystemExit) as refused:
        main(["cluster=local", argument, "hydra.sweeper.study_name=values"])
    assert str(refused.value.code).startswith(message) and "\n" not in str(refused.value.code)
    assert not (root / "sweeps").exists()
