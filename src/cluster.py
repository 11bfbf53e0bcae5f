"""Sweep workers on a cluster: K jobs submitted through submitit, each running the same sweep command, all of
them workers of one study (a shared PostgreSQL `hydra.sweeper.storage`) recording to one MLflow server.

    export PGPASSWORD=...                      # the study's database; MLflow's: MLFLOW_TRACKING_USERNAME/PASSWORD
    python -m src.cluster cluster=slurm cluster.workers=4 cluster.gpus_per_node=8 cluster.slurm_partition=gpu \\
        sweep=seed_knobs hydra.sweeper.study_name=llama3-24gib hydra.sweeper.n_trials=64 \\
        hydra.sweeper.storage=postgresql://sweeper@db-host:5432/optuna tracking.uri=http://mlflow-host:5000

Arguments `cluster=NAME` (a file in conf/cluster/) and `cluster.KEY=VALUE` set the submission; every other
argument is the sweep's, passed unchanged to `python -m src.train -m hydra/sweeper=optuna` in each job. The
scheduling is SLURM's and the work sharing is Optuna's: each job only runs the sweep engine, whose slots are
the GPUs the job was given (CUDA_VISIBLE_DEVICES), so K jobs on K nodes run K x gpus_per_node trials at once
and stop together at exactly n_trials. Credentials travel in the jobs' environment (sbatch exports it), never
in the command line or the pickles submitit writes, which this refuses to do.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from src import gpus, redact
from src.config import PROJECT_DIR, compose, study_name_problem

log = logging.getLogger(__name__)

CLUSTER_DIR = PROJECT_DIR / "conf" / "cluster"
SWEEP_COMMAND = ["-m", "src.train", "-m", "hydra/sweeper=optuna"]


@dataclass
class ClusterConfig:
    """conf/cluster/*.yaml: where the sweep workers run and what each job asks for (submitit's own names)."""

    executor: str = "slurm"  # submitit cluster: slurm | local (processes on this machine) | debug (in-process)
    workers: int = 2
    timeout_min: int = 24 * 60
    gpus_per_node: int = 0
    cpus_per_task: int = 8
    mem_gb: float | None = None
    name: str = "qlora-sweep"
    slurm_partition: str | None = None
    slurm_additional_parameters: dict[str, Any] = field(default_factory=dict)
    folder: str | None = None  # submitit's logs and pickles; null: sweeps/<study>/cluster/
    wait: bool = False  # block until every worker ends and print how each ended


def split_arguments(argv: list[str]) -> tuple[str, list[str], list[str]]:
    """(cluster option, cluster.* overrides without the prefix, the sweep's own arguments)."""
    name, cluster, sweep = "slurm", [], []
    for arg in argv:
        if arg.startswith("cluster="):
            name = arg.split("=", 1)[1]
        elif arg.startswith("cluster."):
            cluster.append(arg.removeprefix("cluster."))
        elif arg not in ("-m", "--multirun", "hydra/sweeper=optuna"):  # every job adds these itself
            sweep.append(arg)
    return name, cluster, sweep


def load_cluster(name: str, overrides: list[str]) -> ClusterConfig:
    """conf/cluster/<name>.yaml with `overrides`, composed by Hydra over the ClusterConfig schema (a typo or a
    wrong type fails naming the key)."""
    from hydra.core.config_store import ConfigStore

    if not (CLUSTER_DIR / f"{name}.yaml").exists():
        options = ", ".join(sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml")))
        raise SystemExit(f"cluster={name}: no conf/cluster/{name}.yaml; options: {options}")
    ConfigStore.instance().store(name="cluster_schema", node=ClusterConfig)
    try:
        cluster = OmegaConf.to_object(compose(overrides, config_dir=CLUSTER_DIR, config_name=name))
    except Exception as exc:  # Hydra's ConfigCompositionException: a page of traceback, the key without `cluster.`
        raise SystemExit(f"error: {_composition_error(exc, 'cluster')}") from None
    check_cluster(cluster)
    return cluster


# What submitit runs the workers on: SLURM, processes on this machine, or in this process (debugging)
EXECUTORS = ("slurm", "local", "debug")


def check_cluster(cluster: ClusterConfig) -> None:
    """Every cluster value checked by range, naming the key, before anything is submitted (workers=0 submitted
    nothing and said so as a success; an unknown executor was submitit's traceback)."""
    ranges = {
        "workers": (cluster.workers >= 1, "at least 1"),
        "timeout_min": (cluster.timeout_min >= 1, "minutes, at least 1"),
        "gpus_per_node": (cluster.gpus_per_node >= 0, "at least 0"),
        "cpus_per_task": (cluster.cpus_per_task >= 1, "at least 1"),
        "mem_gb": (cluster.mem_gb is None or cluster.mem_gb > 0, "GB, more than 0 (or null: the scheduler's default)"),
        "executor": (cluster.executor in EXECUTORS, f"one of {', '.join(EXECUTORS)}"),
    }
    for key, (ok, what) in ranges.items():
        if not ok:
            raise SystemExit(f"error: cluster.{key}={getattr(cluster, key)}: must be {what}")


def _composition_error(exc: BaseException, group: str = "") -> str:
    """Hydra's composition error in one line, what its cause says (the value and the type) included; `group`
    ("cluster") is the prefix of the keys the overrides set."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = exc.__cause__
    why = [line.strip() for line in str(cause).splitlines() if line.strip()][:1] if cause else []
    if lines and lines[0].startswith("Error merging override "):
        override = lines[0].removeprefix("Error merging override ")
        text = f"{group}.{override}" if group else override
        return redact.redact_text(f"{text}: {'; '.join(why)}")
    return redact.redact_text((f"{group}: " if group else "") + " ".join([*lines[:2], *why]))


def sweep_config(sweep_args: list[str]) -> Any:
    """The sweep's config as each worker will compose it (sweep ranges left out): the study, its storage, the
    tracking URI, checked here before anything is submitted."""
    try:
        parser = OverridesParser.create()
        plain = [o.input_line for o in parser.parse_overrides(sweep_args) if not o.is_sweep_override()]
        return compose(["hydra/sweeper=optuna", *plain], hydra_config=True)
    except Exception as exc:  # a sweep argument Hydra refuses: one line, as `python -m src.train` prints it
        raise SystemExit(f"error: {_composition_error(exc)}") from None


class SweepWorker(submitit.helpers.Checkpointable):
    """One job: the sweep command, run until the study is full. Checkpointable: a preempted or timed-out job
    is requeued by submitit and simply joins the study again (its interrupted trial is failed as `killed` by
    whichever worker notices first)."""

    def __init__(self, sweep_args: list[str]) -> None:
        self.sweep_args = sweep_args

    def __call__(self) -> dict[str, Any]:
        cmd = [sys.executable, *SWEEP_COMMAND, *self.sweep_args]
        print(f"worker on {socket.gethostname()}: {redact.redact_text(' '.join(cmd))}", flush=True)
        # Output goes to the job's own log (submitit's <folder>/<job>_0_log.out), redacted by the sweep's logging.
        done = subprocess.run(cmd, cwd=PROJECT_DIR, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the sweep worker exited with {done.returncode}")
        return {"host": socket.gethostname(), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def submit(cluster: ClusterConfig, sweep_args: list[str]) -> list[Any]:
    """Submit `cluster.workers` sweep workers; returns submitit's jobs."""
    leaks = [a for a in sweep_args if redact.redact_text(a) != a]
    if leaks:
        # submitit pickles the arguments into its folder, and the scheduler shows command lines to everyone
        raise SystemExit(
            "refusing to submit credentials: "
            + ", ".join(redact.redact_text(a) for a in leaks)
            + " (put the password in PGPASSWORD / MLFLOW_TRACKING_PASSWORD; jobs inherit the environment)"
        )
    cfg = sweep_config(sweep_args)
    storage = cfg.hydra.sweeper.storage or ""
    if cluster.executor == "slurm" and not storage.startswith("postgresql"):
        raise SystemExit(
            "cluster=slurm needs a storage every node reaches with a cross-host lock: "
            "hydra.sweeper.storage=postgresql://USER@HOST:5432/DB (password in PGPASSWORD)"
        )
    if cluster.executor == "slurm" and not str(cfg.tracking.uri).startswith("http"):
        log.warning(
            "tracking.uri %s: workers on several nodes should share an MLflow server (http://...)", cfg.tracking.uri
        )
    study = str(cfg.hydra.sweeper.study_name)
    if why := study_name_problem(study):
        raise SystemExit(f"error: {why}")
    folder = Path(cluster.folder or Path(cfg.paths.sweeps_dir) / study / "cluster")
    if cluster.executor == "slurm":
        folder /= "%j"  # one folder per job (the local executor would also make a literal `%j` folder)
    executor = submitit.AutoExecutor(folder=folder, cluster=cluster.executor)
    params: dict[str, Any] = {
        "timeout_min": cluster.timeout_min,
        "gpus_per_node": cluster.gpus_per_node,
        "cpus_per_task": cluster.cpus_per_task,
        "tasks_per_node": 1,  # one sweep engine per job; it runs one trial process per slot itself
        "name": cluster.name,
    }
    if cluster.mem_gb is not None:
        params["mem_gb"] = cluster.mem_gb
    if cluster.executor == "slurm":
        params["slurm_partition"] = cluster.slurm_partition
        params["slurm_additional_parameters"] = dict(cluster.slurm_additional_parameters)
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    if cluster.executor == "slurm":
        with executor.batch():  # one job array: squeue shows the K workers as one sweep
            jobs = [executor.submit(SweepWorker(sweep_args)) for _ in range(cluster.workers)]
        return jobs
    if cluster.executor == "local" and cluster.gpus_per_node:
        # Local jobs all get GPUs 0..n-1 unless told otherwise: give each worker its own cards.
        cards = gpus.indices()
        per = cluster.gpus_per_node
        if len(cards) < per * cluster.workers:
            raise SystemExit(f"{cluster.workers} workers x {per} GPUs, but this machine shows {len(cards)}")
        jobs = []
        for i in range(cluster.workers):
            executor.update_parameters(local_visible_gpus=cards[i * per : (i + 1) * per])
            jobs.append(executor.submit(SweepWorker(sweep_args)))
    else:
        jobs = [executor.submit(SweepWorker(sweep_args)) for _ in range(cluster.workers)]
    return jobs


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    redact.redact_logging()
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    name, overrides, sweep_args = split_arguments(argv)
    cluster = load_cluster(name, overrides)
    jobs = submit(cluster, sweep_args)
    print(f"submitted {len(jobs)} sweep workers ({cluster.executor}); their logs:")
    for job in jobs:
        print(f"  {job.job_id}: {job.paths.stdout}")
    if not cluster.wait:
        return 0
    failed = 0
    for job in jobs:
        try:
            result = job.result()
            print(f"worker {job.job_id}: done on {result['host']} (GPUs: {result['gpus'] or 'none'})")
        except Exception as exc:  # submitit re-raises the job's error with its log's tail
            failed += 1
            print(f"worker {job.job_id}: failed: {redact.redact_text(str(exc))[-2000:]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    # Through the module's own name, so submitit pickles SweepWorker by reference (src.cluster), not __main__.
    from src.cluster import main as cluster_main

    sys.exit(cluster_main())
