"""Where a study lives and how the report and the promotion are asked for one: the project's folders and stores,
a study found by name (or the latest), the command-line arguments they share."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import optuna

from src import stores
from src.config import compose

DEFAULT_MARGIN = 0.10


class StudyNotFound(LookupError):
    """The study asked for is not in the storage; the message lists those that are."""


class StudyUnreadable(StudyNotFound):
    """The study's sweeps/<study>/optuna.db is there but damaged (truncated, overwritten): where StudyNotFound is
    caught, the commands end with this one line instead of a page of SQLAlchemy's traceback (#47.17)."""


@dataclass(frozen=True)
class Places:
    sweeps_dir: Path
    tracking_uri: str
    registered_model: str


def places(tracking_uri: str | None = None) -> Places:
    """Where the trials put sweeps/ and mlruns/, as `python -m src.train` composes it (QLORA_ROOT honoured)."""
    cfg = compose()
    return Places(
        sweeps_dir=Path(cfg.paths.sweeps_dir),
        tracking_uri=tracking_uri or str(cfg.tracking.uri),
        registered_model=str(cfg.tracking.registered_model),
    )


def study_storage(sweeps_dir: Path, name: str) -> str:
    """A study's default storage (`hydra.sweeper.storage: null`): sweeps/<study>/optuna.db."""
    return f"sqlite:///{(sweeps_dir / name / 'optuna.db').resolve()}"


def find_study(name: str | None, sweeps_dir: Path, storage: str | None = None) -> tuple[str, str]:
    """(study name, storage URL): the named study, or the latest one; StudyNotFound lists what exists."""
    if storage:
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
        names = [s.study_name for s in summaries]
        if name is None:
            if not summaries:
                raise StudyNotFound(f"no study in {storage}")
            latest = max(summaries, key=lambda s: (s.datetime_start is not None, s.datetime_start or 0))
            return latest.study_name, storage
        if name not in names:
            raise StudyNotFound(f"no study '{name}' in {storage}; studies there: {', '.join(sorted(names)) or 'none'}")
        return name, storage
    dbs = sorted(sweeps_dir.glob("*/optuna.db"), key=lambda p: p.stat().st_mtime)
    if name is None:
        if not dbs:
            raise StudyNotFound(
                f"no study under {sweeps_dir} (run a sweep first: python -m src.train -m hydra/sweeper=optuna)"
            )
        name = dbs[-1].parent.name
    elif not (sweeps_dir / name / "optuna.db").exists():
        found = ", ".join(p.parent.name for p in reversed(dbs)) or "none"
        raise StudyNotFound(f"no study '{name}' under {sweeps_dir}; studies there (latest first): {found}")
    db = sweeps_dir / name / "optuna.db"
    if why := stores.sqlite_damage(db):
        raise StudyUnreadable(
            f"study '{name}': its Optuna storage {db} is damaged: {why}; nothing was read: restore {db} from a "
            "backup, or sweep again under a new study name"
        )
    return name, study_storage(sweeps_dir, name)


def store_exists(tracking_uri: str) -> bool:
    """False for a SQLite store not made yet: opening it would create it."""
    return not tracking_uri.startswith("sqlite:///") or Path(tracking_uri.removeprefix("sqlite:///")).exists()


def cli_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments `python -m src.report` and `python -m src.promote` share: which study, where, what margin."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("study", nargs="?", help="study name (a folder of sweeps/); default: the latest")
    p.add_argument(
        "--margin",
        type=float,
        default=None,
        help="headroom share below which a setting is marginal "
        f"(default: the sweep's hydra.sweeper.headroom_margin, else {DEFAULT_MARGIN})",
    )
    p.add_argument("--storage", help="Optuna storage URL when not sweeps/<study>/optuna.db (e.g. postgresql://...)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: tracking.uri of the project's config)")
    return p
