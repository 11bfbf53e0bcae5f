"""Whether the stores a command records into can be used, checked before anything is sent to them or created in
them: MLflow's (`tracking.uri`, artifacts under `paths.mlruns_dir`), a sweep's Optuna storage
(`hydra.sweeper.storage`; null: `sweeps/<study>/optuna.db` under `paths.sweeps_dir`), and what `python -m src.report`
and `python -m src.promote` are pointed at (`--storage`, `--tracking-uri`). A store is refused in one line that
names the key pointing at it, for the first of:

1. a credential inside its URI: the preflight secrets message (src.redact.refusal), before any store is contacted;
2. a service that does not answer: one probe with a short timeout, where MLflow's HTTP client would retry for
   minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT) and a database driver would end in a
   page of traceback;
3. a local store that cannot be written (a read-only folder, a file where a folder belongs).
"""

from __future__ import annotations

import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src import redact

PROBE_TIMEOUT_S = 5
OPTUNA_STORAGE = "the Optuna storage"
MLFLOW_STORE = "the MLflow tracking store"
# Database URLs probed with a connection of their own (MLflow's and Optuna's SQL stores); SQLite is a local file.
_DATABASES = ("postgresql", "mysql", "mssql", "oracle")
_TAKE_CONNECT_TIMEOUT = ("psycopg", "psycopg2", "pymysql", "mysqldb")  # drivers whose connect() takes the argument


class StoreError(Exception):
    """A store that cannot be used; the message is one line that names its key and never a credential."""


@dataclass(frozen=True)
class Store:
    key: str  # what points at it, as the user writes it: "tracking.uri", "--storage"
    what: str  # MLFLOW_STORE, OPTUNA_STORAGE, "the MLflow artifacts folder"...
    url: str  # a database or http(s) URL, or a local folder
    raw: str | None = None  # the value as written, before interpolation (what the credential check reads)
    via: str | None = None  # the key it follows when not set itself: "paths.mlruns_dir"
    write: bool = True  # False: only read (`python -m src.report --no-mlflow`)

    @property
    def label(self) -> str:
        return f"{self.key} (from {self.via})" if self.via else self.key


def of_trial(cfg: DictConfig) -> list[Store]:
    """What a trial records into: the MLflow tracking store, and the artifacts folder beside a local one."""
    raw = str(OmegaConf.to_container(cfg.tracking, resolve=False)["uri"])
    via = "paths.mlruns_dir" if "paths.mlruns_dir" in raw else None
    found = [Store("tracking.uri", MLFLOW_STORE, str(cfg.tracking.uri), raw, via)]
    if not found[0].url.startswith(("http://", "https://")):  # a server keeps the artifacts itself
        artifacts = str(Path(cfg.paths.mlruns_dir) / "artifacts")
        found.append(Store("paths.mlruns_dir", "the MLflow artifacts folder", artifacts))
    return found


def of_sweep(cfg: DictConfig, study_dir: Path) -> list[Store]:
    """What a sweep records into: the trials' stores, the Optuna storage and the study's folder (trial logs)."""
    raw = OmegaConf.to_container(cfg.hydra.sweeper, resolve=False)["storage"]
    if raw is None:
        default = f"sqlite:///{(study_dir / 'optuna.db').resolve()}"
        return [*of_trial(cfg), Store("hydra.sweeper.storage", OPTUNA_STORAGE, default, via="paths.sweeps_dir")]
    storage = Store("hydra.sweeper.storage", OPTUNA_STORAGE, str(cfg.hydra.sweeper.storage), str(raw))
    return [*of_trial(cfg), storage, Store("paths.sweeps_dir", "the study's folder", str(study_dir))]


def of_results(storage: str | None, tracking_uri: str, tracking_key: str, write: bool) -> list[Store]:
    """What `python -m src.report` and `src.promote` read (and write to MLflow, unless `write` is False)."""
    found = [Store(tracking_key, MLFLOW_STORE, tracking_uri, write=write)]
    if storage:
        found.insert(0, Store("--storage", OPTUNA_STORAGE, storage, write=False))
    return found


def check(stores: list[Store]) -> None:
    """Raise StoreError for the first store that cannot be used; every credential is looked for before any store
    is contacted."""
    held = redact.secret_values()
    for store in stores:
        refused = redact.refusal(store.key, store.url if store.raw is None else store.raw, held)
        if refused:
            raise StoreError(refused)
    for store in stores:
        problem = _problem(store)
        if problem:
            raise StoreError(f"{store.label}: {store.what} {problem}")


def require(stores: list[Store]) -> None:
    """check(), for an entry point: a store that cannot be used ends the process with its one line (status 1)."""
    try:
        check(stores)
    except StoreError as exc:
        sys.exit(f"error: {exc}")


def _problem(store: Store) -> str | None:
    """What is wrong with one store ("at <url> cannot be reached (Connection refused)..."), or None."""
    url, shown = store.url, redact.redact_text(store.url)
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in url else None
    if store.what == OPTUNA_STORAGE and (why := _not_a_database(url)):
        return f"{shown} is not a database URL: {why}; use sqlite:///path/optuna.db or postgresql://user@host/db"
    if store.what == MLFLOW_STORE and scheme is not None and scheme not in _mlflow_schemes():
        return (
            f"{shown}: MLflow knows no store '{scheme}://' (it knows {', '.join(sorted(_mlflow_schemes()))}); "
            f"use a folder, sqlite:///path/mlflow.db or http://host:5000 for {store.key}"
        )
    if scheme in ("http", "https") or scheme in _DATABASES:
        why = _unreachable_http(url) if scheme.startswith("http") else _unreachable_database(url)
        return why and f"at {shown} cannot be reached ({why}); nothing was recorded: start it or correct {store.key}"
    if not store.write:
        return None
    if scheme == "sqlite":
        path = Path(url.removeprefix("sqlite:///"))
        why = _unwritable(path.parent) or _unwritable_file(path)
    elif scheme is None:
        why = _unwritable(Path(url))
    else:  # another kind of store (databricks, a plugin's): its own client says what is wrong
        return None
    return why and f"cannot be written: {why}; nothing was recorded: make it writable or point {store.key} elsewhere"


def _mlflow_schemes() -> set[str]:
    """The URI schemes MLflow 3 opens a tracking store for (its own, and those of installed plugins' entry points);
    another one failed the first MLflow call with a page of traceback."""
    from importlib.metadata import entry_points

    own = {"file", "http", "https", "databricks", "databricks-uc", "uc", "sqlite", *_DATABASES}
    return own | {e.name for e in entry_points(group="mlflow.tracking_store")}


def _not_a_database(url: str) -> str | None:
    """Why SQLAlchemy (Optuna's RDB storage) cannot open `url`: a malformed URL, an unknown database or driver."""
    import sqlalchemy

    try:
        sqlalchemy.engine.make_url(url).get_dialect()
    except Exception as exc:  # noqa: BLE001 - ArgumentError, NoSuchModuleError: a page of traceback from Optuna
        return _reason(exc)
    return None


def _unreachable_http(url: str) -> str | None:
    """One request with a short timeout; any answer, even 401 or 404, means a server is there."""
    import requests

    try:
        requests.get(url.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S)
    except requests.exceptions.SSLError:
        return None  # something answered; TLS settings are MLflow's to report
    except requests.exceptions.Timeout:
        return f"no answer within {PROBE_TIMEOUT_S} s"
    except requests.exceptions.RequestException as exc:
        return _reason(exc)
    return None


def _unreachable_database(url: str) -> str | None:
    """One connection (password from the environment: PGPASSWORD, ~/.pgpass) with a short connect timeout."""
    import sqlalchemy

    try:
        driver = sqlalchemy.engine.make_url(url).get_driver_name()
        args = {"connect_timeout": PROBE_TIMEOUT_S} if driver in _TAKE_CONNECT_TIMEOUT else {}
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=args)
    except Exception as exc:  # noqa: BLE001 - a malformed URL, a driver not installed
        return _reason(exc)
    try:
        with engine.connect():
            return None
    except Exception as exc:  # noqa: BLE001 - any reason the database refuses is the answer
        return _reason(getattr(exc, "orig", None) or exc)
    finally:
        engine.dispose()


def _unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` (or in the folder it would be made in), or None. A real write, not a
    permission check: root passes every permission check but not a read-only or immutable file system."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".write-check-"):
            return None
    except OSError as exc:
        return f"{existing}: {exc.strerror or exc}"


def _unwritable_file(path: Path) -> str | None:
    if not path.exists():
        return None
    try:
        with path.open("r+b"):  # opened for writing, nothing written
            return None
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"


def _reason(exc: BaseException) -> str:
    """The cause in a few words: the system's "[Errno 111] Connection refused" where there is one, else the first
    line of the message; redacted."""
    text = str(exc)
    errno = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    reason = errno.group(1) if errno else (text.strip().splitlines() or [type(exc).__name__])[0]
    return redact.redact_text(reason.strip())[:300]
