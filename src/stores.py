"""Whether the stores a command records into can be used, checked before anything is sent to them or created in
them: MLflow's (`tracking.uri`, artifacts under `paths.mlruns_dir`), a sweep's Optuna storage
(`hydra.sweeper.storage`; null: `sweeps/<study>/optuna.db` under `paths.sweeps_dir`), and what `python -m src.report`
and `python -m src.promote` are pointed at (`--storage`, `--tracking-uri`). A store is refused in one line that
names the key pointing at it, for the first of:

1. a credential inside its URI: the preflight secrets message (src.redact.refusal), before any store is contacted;
2. a service that does not answer: one probe with a short timeout, where MLflow's HTTP client would retry for
   minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT) and a database driver would end in a
   page of traceback;
3. a local store that cannot be written (a read-only folder, a file where a folder belongs);
4. a SQLite file that is damaged (truncated, overwritten: `sqlite_damage`), or an MLflow SQLite file that is missing
   (or empty) while the study recorded its runs there: where a sweep, the report or the promotion went on, a
   30-86-line traceback, or a new empty store made in its place (#47.17). The line names the file and what to do:
   restore it, or start a new study.
"""

from __future__ import annotations

import re
import sqlite3
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src import record, redact

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
    # What to do when its SQLite file is damaged or lost ("restore it, or ..."); read in full (PRAGMA quick_check)
    # where `scan`: once by a sweep, the report, the promotion; a trial reads the header and the schema only.
    fix: str = ""
    scan: bool = False
    # An empty SQLite file is a store its client makes anew (MLflow's always; a sweep's Optuna storage until trials
    # ran: another worker may be making it this moment), not one cut to nothing
    new_if_empty: bool = False
    # MLflow's: the Optuna storage (None: every study under paths.sweeps_dir) and study (None: any) whose runs it
    # holds, when they named a parent run: its SQLite file missing is then a store lost, not one to make; and what
    # to do then.
    runs_of: tuple[str | None, str | None, str] | None = None

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
    k = 2
    while (study_dir.parent / f"{study_dir.name}-{k}").exists():
        k += 1
    new = f"start a new study: hydra.sweeper.study_name={study_dir.name}-{k}"
    if raw is None:
        url = f"sqlite:///{(study_dir / 'optuna.db').resolve()}"
        storage = Store("hydra.sweeper.storage", OPTUNA_STORAGE, url, via="paths.sweeps_dir")
    else:
        storage = Store("hydra.sweeper.storage", OPTUNA_STORAGE, str(cfg.hydra.sweeper.storage), str(raw))
    mlflow, *rest = of_trial(cfg)
    lost = (storage.url, study_dir.name, f"{_restore(mlflow)}, or {new}")
    found = [
        replace(mlflow, scan=True, fix=f"{_restore(mlflow)}, or move it aside and {new}", runs_of=lost),
        *rest,
        replace(
            storage, scan=True, fix=f"{_restore(storage)}, or {new}", new_if_empty=not (study_dir / "trials").exists()
        ),
    ]
    return found if raw is None else [*found, Store("paths.sweeps_dir", "the study's folder", str(study_dir))]


def of_results(storage: str | None, tracking_uri: str, tracking_key: str, write: bool) -> list[Store]:
    """What `python -m src.report` and `src.promote` read (and write to MLflow, unless `write` is False)."""
    found = [Store(tracking_key, MLFLOW_STORE, tracking_uri, write=write, scan=True)]
    fix = f"{_restore(found[0])}, or point {tracking_key} at the store that holds the study's runs"
    lost = (storage, None, f"{fix} (the report without them: --no-mlflow)") if write else None
    found[0] = replace(found[0], fix=fix, runs_of=lost)
    if storage:
        found.insert(0, Store("--storage", OPTUNA_STORAGE, storage, write=False, scan=True))
        found[0] = replace(found[0], fix=f"{_restore(found[0])}, or point --storage at a sound copy")
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
    for store in stores:  # once every store answered: what the Optuna storage says was recorded in MLflow
        problem = _lost(store)
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
    path = sqlite_file(url) if scheme == "sqlite" else None
    # an empty MLflow file is made anew (`_lost` tells whether a study's runs were lost with it)
    empty = not (store.new_if_empty or store.what == MLFLOW_STORE)
    if path is not None and (why := sqlite_damage(path, store.scan, empty=empty)):
        return f"{shown} is damaged: {why}; nothing was read or recorded: {store.fix or _restore(store)}"
    if not store.write:
        return None
    if path is not None:
        why = _unwritable(path.parent) or _unwritable_file(path)
    elif scheme is None:
        why = _unwritable(Path(url))
    else:  # another kind of store (databricks, a plugin's): its own client says what is wrong
        return None
    return why and f"cannot be written: {why}; nothing was recorded: make it writable or point {store.key} elsewhere"


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL (`sqlite:////abs/path.db`, `sqlite:///relative.db`); None for an in-memory one."""
    import sqlalchemy

    try:
        database = sqlalchemy.engine.make_url(url).database
    except Exception:  # noqa: BLE001 - a malformed URL is _not_a_database's to say
        return None
    return Path(database) if database and database != ":memory:" else None


def sqlite_damage(path: Path, scan: bool = True, empty: bool = True) -> str | None:
    """Why the SQLite file at `path` is damaged, in a few words ("it is truncated: 57,344 of 114,688 bytes"), or
    None: it reads, it is not there, or what stops it is not the file (locked, no permission: its client says so).
    `scan`: every page read (PRAGMA quick_check: ~0.7 s a 200 MB file), not only its header and schema. `empty`:
    a file of 0 bytes is damaged (a copy cut to nothing); SQLite would take it for a new, empty database."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(100)
    except OSError:
        return None
    if size == 0:
        return "it is empty (0 bytes)" if empty else None
    if not head.startswith(b"SQLite format 3\x00"):
        return "it is not a SQLite database"
    page = int.from_bytes(head[16:18], "big")
    page = 65536 if page == 1 else page
    pages = int.from_bytes(head[28:32], "big")
    # The header's page count holds where it was written with the current change counter (SQLite's own rule); a
    # write-ahead log beside it may hold pages the file does not have yet, and a journal a write cut short that the
    # next writer rolls back.
    counted = len(head) == 100 and pages and head[24:28] == head[92:96]
    pending = any(path.with_name(path.name + end).exists() for end in ("-wal", "-journal"))
    if counted and size < pages * page and not pending:
        return f"it is truncated: {size:,} of {pages * page:,} bytes"
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=PROBE_TIMEOUT_S)
        try:
            rows = conn.execute("PRAGMA quick_check(1)" if scan else "SELECT count(*) FROM sqlite_master").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:  # OperationalError too: locked, unreadable
        text = str(exc)
        return f"{text}" if any(w in text.lower() for w in ("malformed", "not a database", "corrupt")) else None
    if scan and rows and rows[0][0] != "ok":  # "*** in database main ***\nPage 3: btreeInitPage() returns ..."
        found = " ".join(re.sub(r"\*\*\*[^*]*\*\*\*", "", str(rows[0][0])).split())[:200]
        return f"SQLite's check fails ({found or 'no reason given'})"
    return None


def _restore(store: Store) -> str:
    path = sqlite_file(store.url)
    return f"restore {path} from a backup" if path else f"restore it, or correct {store.key}"


def _lost(store: Store) -> str | None:
    """An MLflow SQLite file missing (or empty) while a study it is the store of recorded its runs there: MLflow
    would make a new, empty store in its place and the sweep, the report or the promotion go on without the runs."""
    path = sqlite_file(store.url) if store.runs_of and store.url.startswith("sqlite") else None
    if path is None or (path.exists() and path.stat().st_size > 0):
        return None
    storage, study, fix = store.runs_of
    names = _recorded(storage, study)
    if not names:
        return None
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    state = "missing" if not path.exists() else "empty (0 bytes)"
    return f"{path} is {state}, and study {shown} recorded its runs there; nothing was read or recorded: {fix}"


def _recorded(storage: str | None, study: str | None) -> list[str]:
    """The studies of `storage` (None: every sweeps/<study>/optuna.db of the project) that name an MLflow parent run;
    only `study` where given. What cannot be read says nothing here (its own check, or its client, says why)."""
    import optuna

    if storage is None:
        from src.config import compose

        urls = [f"sqlite:///{p.resolve()}" for p in sorted(Path(compose().paths.sweeps_dir).glob("*/optuna.db"))]
    else:
        urls = [storage]
    found = []
    for url in urls:
        path = sqlite_file(url) if url.startswith("sqlite") else None
        if path is not None and (not path.exists() or sqlite_damage(path, scan=False)):
            continue
        try:
            studies = optuna.storages.RDBStorage(url, skip_table_creation=True).get_all_studies()
        except Exception:  # noqa: BLE001 - not an Optuna storage, or one that does not answer
            continue
        found += [
            s.study_name
            for s in studies
            if record.PARENT_RUN_ID in s.user_attrs and (study is None or s.study_name == study)
        ]
    return found


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
