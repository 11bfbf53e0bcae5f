"""Stores and files (issue 47, findings 15 and 17): a disk that fills up during a sweep ends it with its one line even
where the sweep's own log cannot be closed, and the resume leaves nothing RUNNING; the report replaces a link planted
in place of one of its files and never writes through it; a damaged or missing store (a truncated optuna.db, a lost
mlflow.db) ends the report, the promotion and a resumed sweep with one line that names the file and what to do.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient
from optuna.trial import TrialState

from src import promote, quiet, report, stores
from src.config import PROJECT_DIR
from tests.conftest import new_store, run_cli, run_main

STUDY = "kept"
FILLER = "filler"  # the file that fills the small disk of the full-disk test


# ---- finding 15: a disk that fills up during a sweep ---------------------------------------------------------------


def test_a_log_file_that_cannot_be_written_closes_without_an_error() -> None:
    """sweep.log on a full disk: its records are dropped, and closing it (the end of every sweep, after the stop's
    line was decided) raised the buffered write's `OSError: [Errno 28]` as a 38-line traceback instead of the line."""
    full = Path("/dev/full")  # every write: ENOSPC, as on a full disk
    if not full.exists():
        pytest.skip("no /dev/full here")
    with quiet.to_file(full) as handler:
        logging.getLogger("mlflow").error("a write the full disk refused", exc_info=RuntimeError("disk full"))
        logging.getLogger("mlflow").error("and another")
    assert handler.error_records == 0, "nothing was written"
    assert handler.stream is None


def _sweep_on_a_disk_that_fills(argv: list[str]) -> None:
    """tests/fake_sweep.py's sweep, whose trial 1 fills the real disk under QLORA_ROOT once it recorded itself. The
    root logger at INFO, as Hydra's logging sets it for `python -m src.train -m`: sweep.log is open (and buffers)
    before the disk fills. Run by `python -c` (the test below)."""
    from src.handoff import TRIAL_ENV
    from src.sweep import launch, prepare
    from tests import fake_sweep

    logging.getLogger().setLevel(logging.INFO)

    def trial(overrides: list[str], log_dir: Path, env: dict, sweeper: Any, heartbeat: Any = None) -> Any:
        outcome = fake_sweep.trial(overrides, log_dir, env, sweeper, heartbeat)
        if env[TRIAL_ENV] == "1":
            try:
                with open(Path(os.environ["QLORA_ROOT"]) / FILLER, "wb") as filler:
                    while True:
                        filler.write(b"\0" * 65536)
            except OSError:
                pass  # the disk is full
        return outcome

    launch.run_process = trial
    prepare.build_model = lambda *a: None
    fake_sweep.engine(argv).run()


@pytest.mark.slow(seconds=20)
def test_a_disk_that_fills_up_during_a_sweep_ends_it_with_one_line_and_the_resume_leaves_nothing_running(
    tmp_path: Path, empty_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 15: a real full disk (a small tmpfs) under the study's stores and sweep.log."""
    from tests.test_resilience import _resume

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills up) needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], check=False).returncode:
        pytest.skip("tmpfs could not be mounted here")
    try:
        new_store(disk, empty_store)
        args = ["hydra.sweeper.study_name=full", "hydra.sweeper.n_trials=3", "hydra.sweeper.cpu_slots=2"]
        code = f"import sys; from tests.test_stores_and_files import _sweep_on_a_disk_that_fills as s; s({args!r})"
        first = subprocess.run(
            [sys.executable, "-c", code], cwd=PROJECT_DIR, env={**os.environ, "QLORA_ROOT": str(disk)},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert first.returncode == 1, first.stderr[-3000:]
        assert "Traceback" not in first.stderr, first.stderr[-3000:]
        lines = [line for line in first.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("sweep stopped: disk full: "), lines
        assert lines[0].endswith("free space, then run the same command again to resume"), lines

        (disk / FILLER).unlink()  # space freed: the same command again
        assert _resume(disk, monkeypatch, "full", "hydra.sweeper.cpu_slots=2") == 0
        study = optuna.load_study(study_name="full", storage=f"sqlite:///{disk}/sweeps/full/optuna.db")
        assert not [t.number for t in study.get_trials() if t.state == TrialState.RUNNING]
        client = MlflowClient(f"sqlite:///{disk}/mlruns/mlflow.db")
        runs = client.search_runs([client.get_experiment_by_name("full").experiment_id])
        assert runs and not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---- finding 17: a link planted in place of a report file ----------------------------------------------------------


@pytest.fixture(scope="module")
def study_root(tmp_path_factory: pytest.TempPathFactory, empty_store: Path) -> Path:
    """A QLORA_ROOT holding study `kept` (two stand-in trials) in both its stores, made by tests/fake_sweep.py."""
    root = tmp_path_factory.mktemp("stores")
    new_store(root, empty_store)
    done = run_cli("tests.fake_sweep", f"hydra.sweeper.study_name={STUDY}", "hydra.sweeper.n_trials=2", root=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.fixture
def kept(study_root: Path, tmp_path: Path) -> Path:
    """A copy of `study_root` of this test's own, to damage."""
    root = tmp_path / "root"
    shutil.copytree(study_root, root, symlinks=True)
    return root


REPORT_FILES = ("report.md", "report.html", "stability_map.png", "peak_vram.png", "tokens_per_s.png")


def test_the_report_replaces_a_link_planted_in_place_of_its_files_and_never_writes_through_it(
    kept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    outside = tmp_path / "outside"  # files outside the project, say ~/.bashrc
    outside.mkdir()
    study_dir = kept / "sweeps" / STUDY
    for name in (*REPORT_FILES, "predicted_vs_measured.png", "soak_memory.png"):
        (outside / name).write_text("not the report's\n")
        (study_dir / name).symlink_to(outside / name)
    (study_dir / "report.md").unlink()
    (study_dir / "report.md").symlink_to(outside / "new.md")  # a link to a file not there yet: never made

    code, _, err = run_main(report.main, [STUDY, "--no-mlflow"], kept, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert sorted(p.name for p in outside.iterdir()) == sorted([*REPORT_FILES[1:], "predicted_vs_measured.png",
                                                                "soak_memory.png", "report.md"])  # fmt: skip
    assert all(p.read_text() == "not the report's\n" for p in outside.iterdir())
    for name in REPORT_FILES:
        assert not (study_dir / name).is_symlink() and (study_dir / name).stat().st_size > 100, name
    assert (study_dir / "report.md").read_text().startswith("#")
    said = [line for line in err.splitlines() if "link" in line]
    assert len(said) == 1 and "report.md" in said[0] and "untouched" in said[0], err


# ---- finding 17: a damaged or missing store ------------------------------------------------------------------------

DAMAGES = (
    "optuna.db truncated",
    "optuna.db emptied",
    "optuna.db corrupt",
    "mlflow.db missing",
    "mlflow.db truncated",
    "mlflow.db corrupt",
)


def _damage(root: Path, damage: str) -> Path:
    """The store file `damage` names, damaged as it says; its path."""
    name, how = damage.split()
    path = root / "sweeps" / STUDY / name if name == "optuna.db" else root / "mlruns" / name
    if how == "missing":
        path.unlink()
    elif how == "truncated":  # a copy cut short, a disk that filled while it was written
        os.truncate(path, path.stat().st_size // 2)
    elif how == "emptied":  # cut to nothing: SQLite would take it for a new database, Optuna for a new study
        os.truncate(path, 0)
    else:  # pages past the first overwritten: the header reads, the tables do not
        with path.open("r+b") as f:
            f.seek(4096)
            f.write(b"\xff" * 4096 * 8)
    return path


def _stores(root: Path) -> dict[str, bytes | None]:
    files = {"optuna": root / "sweeps" / STUDY / "optuna.db", "mlflow": root / "mlruns" / "mlflow.db"}
    return {k: p.read_bytes() if p.exists() else None for k, p in files.items()}


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("damage", DAMAGES)
def test_the_report_and_the_promotion_end_with_one_line_naming_a_damaged_or_missing_store(
    kept: Path, tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    path = _damage(kept, damage)
    before = _stores(kept)
    target = tmp_path / "production.yaml"
    for main, argv in (
        (report.main, [STUDY]),
        (promote.main, [STUDY, "--allow-unsoaked", "--experiment-file", str(target)]),
    ):
        code, _, err = run_main(main, argv, kept, monkeypatch, capsys)
        line = _one_line(err)
        assert code != 0 and str(path) in line and "restore" in line, line
    assert _stores(kept) == before, "nothing written, no store made"
    assert not target.exists() and not (kept / "sweeps" / STUDY / "report.md").exists()
    if damage == "mlflow.db missing":  # the report from the Optuna storage alone, when asked: no store made
        code, _, err = run_main(report.main, [STUDY, "--no-mlflow"], kept, monkeypatch, capsys)
        assert code == 0, err[-3000:]
        assert not path.exists()


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_resumed_sweep_refuses_a_damaged_or_missing_store_before_anything_is_recorded(
    kept: Path, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep engine (tests/fake_sweep.py's, in this process): refused with the store's one line (the sweeper
    prints it as `error: <line>`), the stores as they were."""
    from tests import fake_sweep

    path = _damage(kept, damage)
    before = _stores(kept)
    monkeypatch.setenv("QLORA_ROOT", str(kept))
    monkeypatch.setattr("src.sweep.launch.run_process", fake_sweep.trial)
    monkeypatch.setattr("src.sweep.prepare.build_model", lambda *a: None)
    with pytest.raises(stores.StoreError) as refused:
        fake_sweep.engine([f"hydra.sweeper.study_name={STUDY}", "hydra.sweeper.n_trials=3"]).run()
    line = str(refused.value)
    assert "\n" not in line and str(path) in line and "restore" in line, line
    assert f"hydra.sweeper.study_name={STUDY}-2" in line, "or a new study"
    assert _stores(kept) == before


@pytest.mark.slow(seconds=16)
@pytest.mark.parametrize("damage", ["optuna.db truncated", "mlflow.db missing"])
def test_the_resume_command_says_one_line_for_a_damaged_or_missing_store(kept: Path, damage: str) -> None:
    """The issue's command as a user types it, on the study's own space (`sweep=demo`'s would be a changed space, a
    refusal of its own), and with nothing left to run in case the stores were taken."""
    path = _damage(kept, damage)
    args = ["-m", "hydra/sweeper=optuna", f"hydra.sweeper.study_name={STUDY}", "lora.r=choice(4,8,16)"]
    args += ["hydra.sweeper.n_trials=2", "hydra.sweeper.soak_top_k=0", "hydra.sweeper.recommend_trials=0"]
    args += ["hydra.sweeper.enqueue_trials=[]", "hydra.sweeper.progress=false", "hydra.sweeper.preload=false"]
    done = run_cli("src.train", *args, root=kept, timeout=300)
    assert done.returncode != 0
    line = _one_line(done.stderr)
    assert line.startswith("error: ") and str(path) in line and "restore" in line, line
    assert not (kept / "sweeps" / STUDY / "trials" / "002").exists(), "no trial ran"


def test_an_empty_optuna_db_of_a_study_without_trials_is_one_being_made_not_a_damaged_one(root: Path) -> None:
    """A worker joining a new study while another one makes its optuna.db (0 bytes for that moment) is not refused;
    a study that ran trials is never in that state."""
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["hydra/sweeper=optuna", "hydra.sweeper.study_name=new"])
    study_dir = root / "sweeps" / "new"
    study_dir.mkdir(parents=True)
    (study_dir / "optuna.db").touch()
    stores.check(stores.of_sweep(cfg, study_dir))
    (study_dir / "trials").mkdir()
    with pytest.raises(stores.StoreError, match="optuna.db is damaged: it is empty"):
        stores.check(stores.of_sweep(cfg, study_dir))
