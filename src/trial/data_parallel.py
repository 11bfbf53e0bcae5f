"""A data-parallel trial: the parent opens and records the run and launches one process per card with torch's own
launcher (torch.distributed.run); each rank trains and leaves its outcome in `rank<N>/result.json`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig

from src import redact
from src.failures import Failure, first_line
from src.handoff import RESULT_FILE
from src.trial.context import TrialContext, check, describe, open_run
from src.trial.single import failure_of, record, train


def run_rank(cfg: DictConfig, out_dir: Path) -> NoReturn:
    """One rank of a data-parallel trial: train, leave the outcome in rank<N>/result.json, and exit (0: ok)."""
    rank = int(os.environ["RANK"])
    import torch

    if torch.cuda.is_available():
        # torch.distributed.run shows every rank all the cards: each takes its own before anything touches CUDA
        # (the model's device_map, the budget cap and the NVML sampler all use the current device).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    rank_dir = out_dir / f"rank{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    ctx = TrialContext(rank_dir=rank_dir)  # no run: only the parent records
    failure: Failure | None = None
    try:
        train(cfg, out_dir, ctx)
    except BaseException as exc:  # noqa: BLE001 - recorded by the parent from this rank's file
        failure = failure_of(exc, ctx.meas, rank)
        (rank_dir / "traceback.txt").write_text(redact.redact_text(traceback.format_exc()))
    meas = ctx.meas
    result = {
        "status": "failed" if failure else "ok",
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "metrics": meas.summary() if meas else {},
        "failure": failure.as_dict() if failure else None,
        "failed_at": time.time() if failure else None,
        "attention_kernel": ctx.kernel(),
    }
    (rank_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    # Leave without tearing the interpreter down, while `ctx` still holds the trainer. Freeing DDP's reducer
    # destroys the gloo group, whose destructor joins worker threads that may wait on a peer that has already
    # left: seen in CI as a finished rank hanging at exit for good, and as an abort ("terminate called without an
    # active exception"). The launcher reaps the rank; the driver frees its memory.
    _leave(0 if failure is None else 1)


def _leave(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_PER_DEVICE = ("peak_vram_allocated_gib", "peak_vram_reserved_gib", "peak_vram_device_gib", "peak_rss_gib")


def run_data_parallel(cfg: DictConfig, out_dir: Path, argv: list[str]) -> dict[str, Any]:
    """The parent of a data-parallel trial: open the run, check, launch the ranks with torch.distributed.run,
    then record per-device peaks (the max is the trial's), throughput over all ranks, and the first failure
    with its rank. When one rank fails the launcher stops the others, so every card is free afterwards."""
    import subprocess

    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = TrialContext(*open_run(cfg))
    nproc = cfg.hardware.processes or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    refused: Failure | None = None
    try:
        describe(cfg, ctx, out_dir, ranks=nproc)
        check(cfg, ctx)  # refuse before any process or card is taken
    except BaseException as exc:  # noqa: BLE001
        ctx.log_text(traceback.format_exc(), "traceback.txt")
        refused = failure_of(exc, None)
    ctx.phases.clear()  # the trial's start-up is its ranks' (rank 0's figures), not the parent's
    if refused is not None:
        return record(cfg, out_dir, ctx, refused)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "src.train", *argv, f"hydra.run.dir={out_dir}"]
    with (out_dir / "ranks.log").open("wb") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    ranks = [_read_result(out_dir / f"rank{r}" / RESULT_FILE) for r in range(nproc)]
    rank0 = next((r for r in ranks if r["rank"] == 0), None)
    ctx.metrics = _merge_metrics(ranks, rank0, cuda=torch.cuda.is_available())
    ctx.attention_tag = rank0.get("attention_kernel") if rank0 else None
    failure = None if done.returncode == 0 else _first_failure(ctx, out_dir, ranks)
    return record(cfg, out_dir, ctx, failure)


def _merge_metrics(ranks: list[dict[str, Any]], rank0: dict[str, Any] | None, cuda: bool) -> dict[str, float]:
    """Each device's peaks under its own name, the largest as the trial's; the rest from rank 0."""
    metrics: dict[str, float] = {}
    for r in ranks:
        device = f"cuda{r['local_rank']}" if cuda else f"rank{r['rank']}"
        for key in _PER_DEVICE:
            if key in r["metrics"]:
                metrics[f"{key}.{device}"] = r["metrics"][key]
                metrics[key] = max(metrics.get(key, 0.0), r["metrics"][key])
    if rank0 and rank0["status"] == "ok":
        # The trainer gathers the token count over all ranks: rank 0's tokens/s is the whole trial's.
        metrics.update({k: v for k, v in rank0["metrics"].items() if k not in _PER_DEVICE})
    return metrics


def _first_failure(ctx: TrialContext, out_dir: Path, ranks: list[dict[str, Any]]) -> Failure:
    """The failure of the rank that caused the others' (root_cause), with its traceback or the launcher's log."""
    from src.failures import classify_exit

    log_text = (out_dir / "ranks.log").read_text(errors="replace")
    root, code = root_cause(log_text, ranks)
    first = next((r for r in ranks if r["rank"] == root and r["failure"]), None)
    if first is not None:
        text = (out_dir / f"rank{root}" / "traceback.txt").read_text()
        ctx.log_text(text, f"traceback_rank{root}.txt")
        return Failure(**first["failure"])
    # it died without a word (signal, segfault): its exit code says how
    ctx.log_text(log_text[-20000:], "ranks_log_tail.txt")
    return Failure(classify_exit(code, log_text), first_line(f"rank {root} exited with {code}"), rank=root)


def _read_result(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        rank = int(path.parent.name.removeprefix("rank"))
        return {"status": "missing", "rank": rank, "local_rank": rank, "metrics": {}, "failure": None}


def root_cause(log_text: str, ranks: list[dict[str, Any]]) -> tuple[int | None, int]:
    """The rank whose failure caused the others', and its exit code. torch.distributed.run lists the ranks it saw
    fail, and names as root cause the first it observed; but a rank whose peer died fails too, and may exit first.
    So: a rank that died without a word (a signal, a segfault), not stopped by the launcher's own SIGTERM, is the
    cause; else the rank that recorded the earliest failure; else the launcher's choice."""
    import re

    report = log_text[log_text.rfind("Failures:") :]  # the launcher's summary, the last thing it printed
    entry = r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)"
    failed = {int(m.group(1)): int(m.group(2)) for m in re.finditer(entry, report, re.S | re.M)}
    named = re.search(r"^\s*rank\s*:\s*(\d+)", report.split("Root Cause", 1)[-1], re.M)
    launcher_root = int(named.group(1)) if named else None
    by_rank = {r["rank"]: r for r in ranks}
    silent = [k for k, code in failed.items() if code != -15 and not by_rank.get(k, {}).get("failure")]
    recorded = sorted((r["failed_at"] or 0.0, r["rank"]) for r in ranks if r.get("failure"))
    if silent:
        root = launcher_root if launcher_root in silent else min(silent)
    elif recorded:
        root = recorded[0][1]
    else:
        root = launcher_root
    return root, failed.get(root, 1) if root is not None else 1
