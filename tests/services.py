"""Real services for the scale-out tests, started by the tests themselves and stopped at the end, pass or fail:
a throwaway PostgreSQL cluster, an `mlflow server` on it (optionally with basic auth), a single-node SLURM.

Everything listens on 127.0.0.1 on a free port; every password is made up here and handed over in the
environment (PGPASSWORD, MLFLOW_TRACKING_PASSWORD, ...), never on a command line or in a file a test keeps.
The helpers are plain functions too, so a script can reuse them (the scale-out figures, benchmarks/results/
scale_out_cpu.json, come from tests/test_scale_out.py with QLORA_SCALE_OUT_FIGURES).
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from src.sweep.process import stop_process_group  # a service in its own session: stopped with all it spawned

PG_USER = "qlora"
# Room for every pool the scale-out tests open at once (CONNECTION_BUDGET) with a margin for a loaded machine,
# where a closed connection's backend lingers until it has run its exit.
MAX_CONNECTIONS = 300
# The most client connections the tests may hold at once: half the default max_connections (100), so the suite
# would pass on a stock server too. What holds them: each sweep worker's Optuna pool (QueuePool, busy threads
# only: main, slot, heartbeat) and its advisory-lock connection (NullPool); the MLflow server's two pools
# (runs, users) in its launcher and its one worker (MLFLOW_SQLALCHEMYSTORE_POOL_SIZE); the test process's one
# storage per database (`rdb()` in test_scale_out.py); report and promote while they run.
CONNECTION_BUDGET = 50


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"service exited with {proc.returncode} before listening on {port}:\n{tail}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f}s")


# ---- PostgreSQL -----------------------------------------------------------------------------------------------


def postgres_bin() -> Path | None:
    """The newest PostgreSQL server binaries on the machine (Debian keeps them off PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@dataclass
class Postgres:
    bin: Path
    folder: Path  # data/, socket/, log; owned by the server's user
    port: int
    password: str
    user: str = PG_USER
    host: str = "127.0.0.1"
    watch: ConnectionWatch | None = None  # what the server held at its busiest (the `postgres` fixture's)

    def url(self, db: str, driver: str = "postgresql") -> str:
        """A URL without the password: libpq reads it from PGPASSWORD (see `env`)."""
        return f"{driver}://{self.user}@{self.host}:{self.port}/{db}"

    @property
    def env(self) -> dict[str, str]:
        return {"PGPASSWORD": self.password}

    def _client(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin / tool), "-h", self.host, "-p", str(self.port), "-U", self.user, *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            check=check,
        )

    def create_db(self, name: str) -> str:
        self._client("createdb", name)
        return self.url(name)

    def dump(self, db: str) -> str:
        """The whole database as SQL text (schema and every row): what a leak check reads."""
        return self._client("pg_dump", "--no-owner", db).stdout

    def stop(self) -> None:
        if self.watch:
            self.watch.stop()
        _as_owner(self.folder, [str(self.bin / "pg_ctl"), "-D", str(self.folder / "data"), "stop", "-m", "immediate"])


class ConnectionWatch:
    """The most client connections the server held at once, sampled every `every_s` from pg_stat_activity on a
    connection of the watch's own (not counted), with their databases at that moment."""

    def __init__(self, pg: Postgres, every_s: float = 0.2) -> None:
        import psycopg

        self.conn = psycopg.connect(
            host=pg.host, port=pg.port, user=pg.user, password=pg.password, dbname="postgres", autocommit=True
        )
        self.max_connections = int(self.conn.execute("SHOW max_connections").fetchone()[0])
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self, every_s: float) -> None:
        query = (
            "SELECT coalesce(datname, '-'), count(*) FROM pg_stat_activity "
            "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() GROUP BY 1"
        )
        while not self._stop.wait(every_s):
            by_db = dict(self.conn.execute(query).fetchall())
            if sum(by_db.values()) > self.peak:
                self.peak, self.at_peak = sum(by_db.values()), by_db

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.conn.close()


def _as_owner(folder: Path, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a server command as the folder's owner: `postgres` when we are root (initdb refuses root)."""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


def start_postgres(prefix: str = "qlora-pg-") -> Postgres:
    """initdb + pg_ctl start in a fresh folder under /tmp, password auth on 127.0.0.1, a random free port."""
    bindir = postgres_bin()
    if bindir is None:
        raise FileNotFoundError("no PostgreSQL server binaries (initdb) on this machine")
    # Not under pytest's tmp dir: that is root-only (0700) and the server runs as `postgres`.
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    password = secrets.token_urlsafe(18)
    pwfile = folder / "pw"
    pwfile.write_text(password + "\n")
    (folder / "socket").mkdir()
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres", "postgres")
        for p in (pwfile, folder / "socket"):
            shutil.chown(p, "postgres", "postgres")
    os.chmod(pwfile, 0o600)
    done = _as_owner(
        folder,
        [
            str(bindir / "initdb"),
            "-D",
            str(folder / "data"),
            "-U",
            PG_USER,
            f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256",  # TCP needs the password, as on a real database host
            "--auth-local=peer",
            "--encoding=UTF8",
            "--no-instructions",
        ],
    )
    pwfile.unlink()
    if done.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"initdb failed: {done.stderr[-2000:]}")
    for _attempt in range(3):  # a free port can be taken between asking and binding
        port = free_port()
        options = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={folder / 'socket'}"
        options += f" -c max_connections={MAX_CONNECTIONS}"
        done = _as_owner(
            folder,
            [str(bindir / "pg_ctl"), "-D", str(folder / "data"), "-l", str(folder / "log"), "-o", options, "-w"]
            + ["start"],
        )
        if done.returncode == 0:
            return Postgres(bindir, folder, port, password)
    log = (folder / "log").read_text(errors="replace")[-2000:] if (folder / "log").exists() else ""
    shutil.rmtree(folder, ignore_errors=True)
    raise RuntimeError(f"pg_ctl start failed: {done.stderr[-1000:]}\n{log}")


# ---- MLflow server -------------------------------------------------------------------------------------------


@dataclass
class MlflowServer:
    url: str
    proc: subprocess.Popen
    folder: Path  # artifacts/, server.log, basic_auth.ini
    env: dict[str, str] = field(default_factory=dict)  # what a client needs (credentials, when auth is on)

    @property
    def artifacts(self) -> Path:
        return self.folder / "artifacts"

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    def stop(self) -> None:
        stop_process_group(self.proc)


def start_mlflow_server(
    folder: Path,
    backend_uri: str,
    server_env: dict[str, str],
    auth_db_uri: str | None = None,
    users: dict[str, str] | None = None,
    auth_cache_ttl_s: int = 0,
) -> MlflowServer:
    """`mlflow server` on 127.0.0.1 with `backend_uri` as its store and artifacts served from `folder/artifacts`.

    With `auth_db_uri`, the basic-auth app: its config file names only the users' database; the admin's
    password comes from MLFLOW_AUTH_ADMIN_PASSWORD, and each of `users` (name -> password) is created through
    the admin API. The returned `env` is the first user's MLFLOW_TRACKING_USERNAME/PASSWORD. MLflow checks
    the password's scrypt hash on every request unless `auth_cache_ttl_s` caches a success that long.
    """
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **server_env,
        "PYTHONUNBUFFERED": "1",
        # Each of its processes (the launcher, which migrates the database, and the worker) keeps two pools, runs
        # and users: a test's load needs a few connections each, not SQLAlchemy's default 5 + 10 overflow.
        "MLFLOW_SQLALCHEMYSTORE_POOL_SIZE": "2",
        "MLFLOW_SQLALCHEMYSTORE_MAX_OVERFLOW": "4",
        # No GenAI jobs here: without this the server starts a job runner and a huey consumer with five
        # workers, more processes and connections competing for a loaded machine's cores.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        backend_uri,
        "--artifacts-destination",
        str(folder / "artifacts"),  # --serve-artifacts (the default): clients upload through the server
        "--host",
        "127.0.0.1",
        "--workers",
        "1",  # a test's load; a real server: one per core
    ]
    admin = ("admin", secrets.token_urlsafe(18))
    if auth_db_uri:
        ini = folder / "basic_auth.ini"
        ini.write_text(
            "[mlflow]\n"
            "default_permission = READ\n"
            f"database_uri = {auth_db_uri}\n"
            "admin_username = admin\n"
            "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            f"auth_cache_ttl_seconds = {auth_cache_ttl_s}\n"
        )
        env.update(
            MLFLOW_AUTH_CONFIG_PATH=str(ini),
            MLFLOW_AUTH_ADMIN_PASSWORD=admin[1],
            MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16),
        )
        cmd += ["--app-name", "basic-auth"]
    for attempt in range(3):
        port = free_port()
        with (folder / "server.log").open("ab") as log:
            proc = subprocess.Popen(
                [*cmd, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            _wait_port(port, proc, timeout=120, log=folder / "server.log")
            break
        except RuntimeError:
            # only a port taken between asking and binding is worth another try
            if attempt == 2 or "address already in use" not in (folder / "server.log").read_text().lower():
                raise
    server = MlflowServer(f"http://127.0.0.1:{port}", proc, folder)
    _wait_http(server, admin if auth_db_uri else None)
    if auth_db_uri and users:
        from mlflow.server.auth.client import AuthServiceClient

        old = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
        os.environ.update(MLFLOW_TRACKING_USERNAME=admin[0], MLFLOW_TRACKING_PASSWORD=admin[1])
        try:
            for name, password in users.items():
                AuthServiceClient(server.url).create_user(name, password)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        name, password = next(iter(users.items()))
        server.env = {"MLFLOW_TRACKING_USERNAME": name, "MLFLOW_TRACKING_PASSWORD": password}
    return server


def _wait_http(server: MlflowServer, auth: tuple[str, str] | None, timeout: float = 120) -> None:
    """Listening is not serving: wait until the REST API answers (the server migrates its database first)."""
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited: {server.log.read_text()[-3000:]}")
        try:
            r = requests.get(f"{server.url}/api/2.0/mlflow/experiments/search?max_results=1", auth=auth, timeout=5)
            if r.status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {server.url} never answered: {server.log.read_text()[-3000:]}")


# ---- SLURM (single node) -------------------------------------------------------------------------------------

SLURM_DAEMONS = ("munged", "slurmctld", "slurmd")


def slurm_missing() -> str | None:
    """Why a local SLURM cannot be started here (None: it can)."""
    missing = [d for d in SLURM_DAEMONS if not (shutil.which(d) or Path(f"/usr/sbin/{d}").exists())]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install slurmctld slurmd slurm-client munge; .ci/run does)"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return None


@dataclass
class Slurm:
    folder: Path
    conf: Path
    procs: list[subprocess.Popen]

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env={**os.environ, **self.env}, capture_output=True)
        for proc in reversed(self.procs):
            stop_process_group(proc)


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def start_slurm() -> Slurm:
    """munged, slurmctld and slurmd in the foreground (-D), on this host only, with state in a fresh folder.

    No cgroups (proctrack/linuxproc, task/none): this runs inside containers too. munged gets its own
    socket, so a munged the machine may already run is left alone.
    """
    folder = Path(tempfile.mkdtemp(prefix="qlora-slurm-"))
    for sub in ("spool", "state", "munge"):
        (folder / sub).mkdir()
    shutil.chown(folder / "munge", "munge", "munge")
    os.chmod(folder / "munge", 0o755)  # munged insists that everyone can reach its socket
    os.chmod(folder, 0o755)
    socket_path = folder / "munge" / "munge.socket"
    procs = [
        subprocess.Popen(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                _daemon("munged"),
                "-F",
                f"--socket={socket_path}",
                f"--pid-file={folder / 'munge' / 'munged.pid'}",
                f"--seed-file={folder / 'munge' / 'munged.seed'}",
                f"--log-file={folder / 'munge' / 'munged.log'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(folder / "munged.err").open("wb"),
            start_new_session=True,
        )
    ]
    deadline = time.time() + 20
    while not socket_path.exists():
        if procs[0].poll() is not None or time.time() > deadline:
            raise RuntimeError(f"munged did not start: {(folder / 'munged.err').read_text()}")
        time.sleep(0.1)
    host = socket.gethostname()
    ctld_port, d_port = free_port(), free_port()
    cpus = os.cpu_count() or 1
    mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
    conf = folder / "slurm.conf"
    conf.write_text(
        f"""ClusterName=qlora-test
SlurmctldHost={host}
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
StateSaveLocation={folder / "state"}
SlurmdSpoolDir={folder / "spool"}
SlurmctldPidFile={folder / "slurmctld.pid"}
SlurmdPidFile={folder / "slurmd.pid"}
SlurmctldLogFile={folder / "slurmctld.log"}
SlurmdLogFile={folder / "slurmd.log"}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core  # memory is checked against the node, not consumed: jobs share it
ReturnToService=2
MpiDefault=none
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for daemon in ("slurmctld", "slurmd"):
        procs.append(
            subprocess.Popen(
                [_daemon(daemon), "-D", "-f", str(conf)],
                env=env,
                stdout=(folder / f"{daemon}.out").open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    slurm = Slurm(folder, conf, procs)
    deadline = time.time() + 60
    while time.time() < deadline:
        for p in procs:
            if p.poll() is not None:
                slurm.stop()
                raise RuntimeError(f"{p.args[0]} exited: {_slurm_logs(folder)}")
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        if state.stdout.strip() == "idle":
            return slurm
        time.sleep(0.5)
    slurm.stop()
    raise TimeoutError(f"the SLURM node never became idle: {_slurm_logs(folder)}")


def _slurm_logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(folder.glob("*.log")))


Service = TypeVar("Service", "Postgres", "Slurm")


# ---- fixtures --------------------------------------------------------------------------------------------------


def _running(service: Service) -> Iterator[Service]:
    """A started service for a fixture's lifetime; then stopped and its folder removed."""
    try:
        yield service
    finally:
        service.stop()
        shutil.rmtree(service.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    if postgres_bin() is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
    pg = start_postgres()
    try:
        pg.watch = ConnectionWatch(pg)  # read by the last scale-out test
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(pg.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Slurm | None]:
    """A real single-node SLURM when its daemons are installed (.ci/run installs them); None otherwise, and the
    cluster test submits through submitit's local executor instead (the same jobs without a scheduler)."""
    why = slurm_missing()
    if why:
        warnings.warn(f"no SLURM here ({why}): the cluster test uses submitit's local executor", stacklevel=1)
        yield None
        return
    yield from _running(start_slurm())


@pytest.fixture(scope="session")
def tracking_server(postgres: Postgres) -> Iterator[MlflowServer]:
    """`mlflow server --app-name basic-auth` on PostgreSQL (runs and users in two databases), artifacts served
    through it; `.env` holds the credentials of a non-admin user, `sweeper`, with a made-up password."""
    folder = Path(tempfile.mkdtemp(prefix="qlora-mlflow-"))
    server = start_mlflow_server(
        folder,
        postgres.create_db("mlflow"),
        postgres.env,
        auth_db_uri=postgres.create_db("mlflow_auth"),
        users={"sweeper": secrets.token_urlsafe(18)},
        auth_cache_ttl_s=60,  # as the README recommends: one scrypt check per minute, not one per request
    )
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
