"""Forked trials on a GPU, as the sweep now starts them by default (hydra.sweeper.preload=true): CUDA works in every
forked trial, each trial's torch runs on its slot's share of the cores, and a trial dies with its SIGKILLed sweep.
Beside it, the same sweep with fresh interpreters (preload=false), for the start-up each pays.

    python -m benchmarks.preload_h200 [--out benchmarks/results/preload_h200.json]     # on the GPU machine

The tiny Llama (4-bit, bitsandbytes on CUDA) is enough: what is measured is how a trial's process starts and ends,
not the model. Two slots on the card (slots_per_gpu=2), so two trials start together, as in a sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil

SWEEP = [
    "hydra/sweeper=optuna",
    "model=tiny_llama",
    "hydra.sweeper.enqueue_trials=[]",
    "hydra.sweeper.slots_per_gpu=2",
    "hydra.sweeper.progress=false",
    "hydra.sweeper.soak_top_k=0",
    "hydra.sweeper.skip_duplicates=false",
    "trainer.per_device_train_batch_size=choice(1,2)",
    "hydra.sweeper.trial_overrides=['trainer.max_steps=6','trainer.warmup_steps=0']",
]


def _sweep(root: Path, study: str, *extra: str, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "src.train", "-m", *SWEEP, f"hydra.sweeper.study_name={study}", *extra]
    env = {**os.environ, "QLORA_ROOT": str(root)}
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _trials(root: Path, study: str) -> list[dict]:
    """Each trial's run: its tags and start-up, read from the MLflow store."""
    db = sqlite3.connect(root / "mlruns" / "mlflow.db")
    rows = db.execute(
        "select r.run_uuid from runs r join experiments e on e.experiment_id = r.experiment_id "
        "join tags t on t.run_uuid = r.run_uuid and t.key = 'optuna.trial' where e.name = ?",
        (study,),
    ).fetchall()
    out = []
    for (run,) in rows:
        tags = dict(db.execute("select key, value from tags where run_uuid = ?", (run,)).fetchall())
        metrics = dict(db.execute("select key, value from latest_metrics where run_uuid = ?", (run,)).fetchall())
        out.append(
            {
                "trial": int(tags["optuna.trial"]),
                "status": tags.get("trial.status"),
                "launcher": tags.get("trial.launcher"),
                "torch.num_threads": tags.get("torch.num_threads"),
                "gpu.name": tags.get("gpu.name"),
                "startup_s": round(metrics.get("startup_s", float("nan")), 2),
                "tokens_per_s": round(metrics.get("tokens_per_s", float("nan")), 1),
            }
        )
    return sorted(out, key=lambda t: t["trial"])


def _killed(root: Path) -> dict:
    """A sweep whose trial hangs in training is SIGKILLed: how long until its trial and forkserver are gone."""
    sweep = _sweep(
        root,
        "kill",
        "hydra.sweeper.n_trials=1",
        "fault=hang",
        "fault.step=1",
        "hydra.sweeper.stall_timeout_s=3600",
        wait=False,
    )
    progress = root / "sweeps" / "kill" / "trials" / "000" / "progress.json"
    deadline = time.time() + 300
    while time.time() < deadline and '"training"' not in (progress.read_text() if progress.exists() else ""):
        time.sleep(0.5)
    family = psutil.Process(sweep.pid).children(recursive=True)
    trial = [p for p in family if os.getsid(p.pid) == p.pid]
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    killed_at = time.time()
    gone, alive = psutil.wait_procs(family, timeout=60)
    return {
        "processes_under_the_sweep": len(family),
        "trials": len(trial),
        "all_gone": not alive,
        "seconds_until_all_gone": round(time.time() - killed_at, 2) if not alive else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/preload_h200.json")
    args = parser.parse_args()
    import torch

    from src import tracking

    root = Path(os.environ.get("QLORA_ROOT", "/tmp/qlora-preload"))
    result: dict = {
        "command": "python -m benchmarks.preload_h200",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host_cores": os.cpu_count(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "versions": {k: v for k, v in tracking.system_tags().items() if k.startswith("version.")},
        "expected": "every trial ok, forked (launcher forkserver) with torch.num_threads = cores / 2 slots; fresh "
        "interpreters pay the imports in startup_s; the hung trial gone within seconds of the SIGKILL",
    }
    for preload in ("true", "false"):
        study = f"preload-{preload}"
        started = time.time()
        done = _sweep(root, study, "hydra.sweeper.n_trials=4", f"hydra.sweeper.preload={preload}")
        result[study] = {
            "returncode": done.returncode,
            "wall_s": round(time.time() - started, 1),
            "trials": _trials(root, study),
            "stderr_tail": done.stderr[-1500:] if done.returncode else "",
        }
        print(study, json.dumps(result[study], indent=1), flush=True)
    result["sigkill"] = _killed(root)
    print(json.dumps(result["sigkill"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
