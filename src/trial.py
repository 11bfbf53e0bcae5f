"""One trial: preflight, load the 4-bit model, attach LoRA, train with trl's SFTTrainer, measure, record.

Whatever happens inside, the trial's MLflow run ends (FINISHED or FAILED, never RUNNING) with
`trial.status`, the failure's kind, step and first line, and the full traceback as an artifact; the outcome
is also written to `<output dir>/result.json` for the sweep engine. A failure that kills the process
outright (segfault, SIGKILL, a hang) is recorded by the engine from outside.
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

from src import tracking
from src.config import to_container
from src.failures import ConfigError, DataError, Failure, classify_exception, first_line, oom_request_gib

RESULT_FILE = "result.json"
PROGRESS_FILE = "progress.json"


def _mark(state: dict[str, Any], phase: str) -> None:
    """Seconds from the trial's launch to the end of a start-up phase (metrics `startup.<phase>_s`): where the
    per-trial fixed cost goes."""
    from src.measure import trial_started

    state.setdefault("phases", {})[f"startup.{phase}_s"] = time.time() - trial_started()


def _dataset(cfg: DictConfig, tokenizer: Any, world_size: int) -> tuple[Any, dict[str, float]]:
    """The chat dataset for this trial (a probe gets a subset that holds the longest rows) and length stats."""
    import numpy as np
    from datasets import Dataset

    from src.data import length_stats, load_table, probe_rows, to_messages, token_lengths

    df = load_table(cfg.data)
    chats = to_messages(df, cfg.data)
    lengths, _ = token_lengths(chats, tokenizer)
    truncated = np.minimum(lengths, cfg.data.max_seq_length)
    t = cfg.trainer
    if t.max_steps > 0:
        rows = t.max_steps * t.per_device_train_batch_size * t.gradient_accumulation_steps * world_size
        pack_to = cfg.data.max_seq_length if t.packing else None  # packed rows fill up like a full epoch's
        keep = probe_rows(truncated, rows, t.per_device_train_batch_size, cfg.data.seed, pack_to=pack_to)
        chats = [chats[i] for i in keep]
    stats = {f"data.{k}": v for k, v in length_stats(lengths).items()}
    stats["data.rows"] = float(len(df))
    stats["data.rows_truncated"] = float((lengths > cfg.data.max_seq_length).sum())
    return Dataset.from_dict({"messages": chats}), stats


def _train(cfg: DictConfig, out_dir: Path, state: dict[str, Any]) -> None:
    import torch
    from hydra.utils import instantiate
    from trl import SFTConfig, SFTTrainer

    from src import models, preflight
    from src.config import sft_kwargs
    from src.faults import FaultInjector
    from src.measure import AttentionProbe, Measurements, StepProfiler, cap_to_budget

    _mark(state, "libraries")
    if cfg.measure.profile_startup:  # where the start-up goes, function by function (startup_profile.txt)
        import cProfile

        state["startup_profiler"] = cProfile.Profile()
        state["startup_profiler"].enable()
    client, run_id = state["client"], state["run_id"]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # The watchdog reads the trial's progress file; in a data-parallel trial rank 0 writes it.
    progress = out_dir / PROGRESS_FILE if int(os.environ.get("RANK", "0")) == 0 else state["rank_dir"] / PROGRESS_FILE
    meas = state["meas"] = Measurements(cfg, progress, world_size=world_size)
    try:
        report = preflight.run(cfg)  # raises ConfigError / DataError before any GPU work
    except (ConfigError, DataError) as exc:  # a refused trial still records what preflight found
        found = getattr(exc, "report", None)  # none when the data could not even be read
        if found is not None:
            tracking.log_text(client, run_id, found.to_text(), "preflight.txt")
            tracking.set_tags(client, run_id, found.tags())
        raise
    tracking.log_text(client, run_id, report.to_text(), "preflight.txt")
    tracking.set_tags(client, run_id, report.tags())
    _mark(state, "preflight")

    state["budget"] = cap_to_budget(cfg.hardware.vram_budget_gib)
    _mark(state, "budget_cap")
    model, tokenizer = models.load(cfg)
    _mark(state, "model_load")
    model = preflight.guard_device_moves(model)  # a 4-bit / dispatched model must never be moved with .to()
    model = models.prepare_for_kbit_training(model, cfg)
    _mark(state, "kbit_prepare")
    dataset, stats = _dataset(cfg, tokenizer, world_size=world_size)
    tracking.log_metrics(client, run_id, stats)
    _mark(state, "dataset")
    model = models.attach_lora(model, instantiate(cfg.lora, _convert_="all"))
    trainer = SFTTrainer(  # trl casts the adapters to bf16 on a 4-bit base, as it does with a peft_config
        model=model,
        args=SFTConfig(**sft_kwargs(cfg, use_cpu=not torch.cuda.is_available())),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    probe = state["attention"] = AttentionProbe(at_step=max(1, cfg.measure.warmup_steps))
    guards = preflight.CheckpointingGuard(cfg.trainer.gradient_checkpointing)
    callbacks = [probe, meas, guards, FaultInjector(cfg.fault.kind, cfg.fault.step, cfg.fault.rank)]
    if cfg.measure.profile_step:
        state["profiler"] = StepProfiler(cfg.measure.profile_step, out_dir / "profile.txt")
        callbacks.insert(1, state["profiler"])
    for callback in callbacks:
        trainer.add_callback(callback)
    if cfg.trainer.torch_compile == "layers":
        models.compile_layers(trainer.model)  # compiles in the first steps (first_step_s), not here
    state["trainer"] = trainer
    _mark(state, "trainer_init")
    if state.get("startup_profiler") is not None:
        state["startup_profiler"].disable()
        text = _profile_text(state["startup_profiler"])
        (out_dir / "startup_profile.txt").write_text(text)
        tracking.log_text(client, run_id, text, "startup_profile.txt")
    with models.attention_kernels(cfg):
        trainer.train()
    if state.get("profiler") is not None and state["profiler"].text:
        tracking.log_text(client, run_id, state["profiler"].text, "profile.txt")
    if cfg.trainer.save_adapter:
        adapter = out_dir / "adapter"
        trainer.model.save_pretrained(adapter)
        client.log_artifacts(run_id, str(adapter), "adapter")


def _profile_text(profiler: Any, limit: int = 40) -> str:
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(limit)
    return out.getvalue()


def _open_run(cfg: DictConfig) -> tuple[Any, str]:
    """The run the engine created for this trial (MLFLOW_RUN_ID), or a new one for a single trial."""
    from mlflow.tracking import MlflowClient

    tracking.setup(cfg.tracking.uri)
    client = MlflowClient()
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if run_id:
        client.update_run(run_id, status="RUNNING")
    else:
        exp = tracking.experiment_id(cfg.tracking.experiment, str(Path(cfg.paths.mlruns_dir) / "artifacts"))
        run_id = client.create_run(exp, tags={"mlflow.runName": f"{cfg.model.name}-trial"}).info.run_id
    return client, run_id


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run one trial and record it; returns the outcome (also written to result.json)."""
    state: dict[str, Any] = {}
    _mark(state, "python_and_hydra")  # the interpreter (or the fork) and Hydra's composition of the config
    out_dir.mkdir(parents=True, exist_ok=True)
    client, run_id = _open_run(cfg)
    launch_blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
    state.update(client=client, run_id=run_id)
    _mark(state, "python_and_mlflow")
    failure: Failure | None = None
    try:
        if not client.get_run(run_id).data.params:  # a re-run (CUDA_LAUNCH_BLOCKING) keeps its first params
            tracking.log_params(client, run_id, tracking.flatten(to_container(cfg)))
        _mark(state, "log_params")
        tags = tracking.system_tags()  # imports torch and creates the CUDA context (device properties)
        _mark(state, "torch_and_cuda")
        tracking.set_tags(client, run_id, {**tags, "model.name": cfg.model.name})
        _train(cfg, out_dir, state)
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then the process exits
        failure = _failure_of(exc, state.get("meas"))
        name = "traceback_launch_blocking.txt" if launch_blocking else "traceback.txt"
        tracking.log_text(client, run_id, traceback.format_exc(), name)
    return _record(cfg, out_dir, state, failure)


def _failure_of(exc: BaseException, meas: Any, rank: int | None = None) -> Failure:
    """The failure, with the step that was running once training had begun (a NaN loss is seen after its step)."""
    kind = "killed" if isinstance(exc, KeyboardInterrupt) else classify_exception(exc)
    step = None
    if meas is not None and meas.startup_s is not None:
        step = meas.step if kind == "nan_loss" else meas.step + 1
    return Failure(kind, first_line(f"{type(exc).__name__}: {exc}"), step, rank)


def _log_series(client: Any, run_id: str, meas: Any) -> None:
    """Per-step series: reserved VRAM (the contract's), step seconds and loss."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    series = [Metric("step_seconds", s["time_s"], now, int(s["step"])) for s in meas.steps]
    series += [
        Metric("vram_reserved_gib", s["vram_reserved_gib"], now, int(s["step"]))
        for s in meas.steps
        if "vram_reserved_gib" in s
    ]
    series += [Metric("loss", loss, now, i + 1) for i, loss in enumerate(meas.losses)]
    for i in range(0, len(series), 500):
        client.log_batch(run_id, metrics=series[i : i + 500])


def _record(cfg: DictConfig, out_dir: Path, state: dict[str, Any], failure: Failure | None) -> dict[str, Any]:
    client, run_id = state["client"], state["run_id"]
    meas = state.get("meas")
    budget = float(cfg.hardware.vram_budget_gib)
    try:
        metrics: dict[str, float] = meas.summary() if meas else dict(state.get("metrics", {}))
    except Exception as exc:  # a measurement bug must not lose the trial's outcome
        tracking.log_text(client, run_id, traceback.format_exc(), "measurement_error.txt")
        metrics = {}
        if failure is None:
            failure = Failure("other", first_line(f"measurement failed: {type(exc).__name__}: {exc}"))
    metrics["vram_budget_gib"] = budget
    if "peak_vram_reserved_gib" in metrics:
        metrics["vram_headroom_frac"] = 1.0 - metrics["peak_vram_reserved_gib"] / budget
    metrics.update(state.get("budget", {}))
    metrics.update(state.get("phases", {}))
    if failure and failure.kind == "oom":
        requested = oom_request_gib(failure.message)
        if requested is not None:
            metrics["oom_request_gib"] = requested
    tracking.log_metrics(client, run_id, metrics)
    if meas:
        _log_series(client, run_id, meas)
    tags: dict[str, Any] = {"trial.status": "failed" if failure else "ok"}
    if "attention" in state:
        tags["attention.kernel"] = state["attention"].tag
    elif state.get("attention_tag"):
        tags["attention.kernel"] = state["attention_tag"]
    if failure:
        tags.update({"failure.kind": failure.kind, "failure.message": failure.message, "failure.step": failure.step})
        if failure.rank is not None:
            tags["failure.rank"] = failure.rank
    tracking.set_tags(client, run_id, tags)
    result = {
        "status": "failed" if failure else "ok",
        "run_id": run_id,
        "metrics": metrics,
        "failure": failure.as_dict() if failure else None,
        "attention_kernel": tags.get("attention.kernel"),
    }
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    client.set_terminated(run_id, "FAILED" if failure else "FINISHED")
    return result


# ---- data-parallel trials: one process per card, launched by torch's own launcher ------------------------


class _NoTracking:
    """A rank's stand-in for the MLflow client: in a data-parallel trial only the parent process records."""

    def get_run(self, run_id: str) -> Any:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


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
    state: dict[str, Any] = {"client": _NoTracking(), "run_id": "", "rank_dir": rank_dir}
    failure: Failure | None = None
    try:
        _train(cfg, out_dir, state)
    except BaseException as exc:  # noqa: BLE001 - recorded by the parent from this rank's file
        failure = _failure_of(exc, state.get("meas"), rank)
        (rank_dir / "traceback.txt").write_text(tracking.redact_text(traceback.format_exc()))
    meas = state.get("meas")
    result = {
        "status": "failed" if failure else "ok",
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", rank)),
        "metrics": meas.summary() if meas else {},
        "failure": failure.as_dict() if failure else None,
        "failed_at": time.time() if failure else None,
        "attention_kernel": state["attention"].tag if "attention" in state else None,
    }
    (rank_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    # Leave without tearing the interpreter down, while `state` still holds the trainer. Freeing DDP's reducer
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

    from src import preflight
    from src.failures import classify_exit

    out_dir.mkdir(parents=True, exist_ok=True)
    client, run_id = _open_run(cfg)
    state: dict[str, Any] = {"client": client, "run_id": run_id}
    nproc = cfg.hardware.processes or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    try:
        tracking.log_params(client, run_id, tracking.flatten(to_container(cfg)))
        tracking.set_tags(client, run_id, {**tracking.system_tags(), "model.name": cfg.model.name, "ranks": nproc})
        report = preflight.run(cfg)  # refuse before any process or card is taken
        tracking.log_text(client, run_id, report.to_text(), "preflight.txt")
    except BaseException as exc:  # noqa: BLE001
        tracking.log_text(client, run_id, traceback.format_exc(), "traceback.txt")
        return _record(
            cfg, out_dir, state, Failure(classify_exception(exc), first_line(f"{type(exc).__name__}: {exc}"))
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "src.train", *argv, f"hydra.run.dir={out_dir}"]
    with (out_dir / "ranks.log").open("wb") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    ranks = [_read_result(out_dir / f"rank{r}" / RESULT_FILE) for r in range(nproc)]
    metrics: dict[str, float] = {}
    for r in ranks:
        device = f"cuda{r['local_rank']}" if torch.cuda.is_available() else f"rank{r['rank']}"
        for key in _PER_DEVICE:
            if key in r["metrics"]:
                metrics[f"{key}.{device}"] = r["metrics"][key]
                metrics[key] = max(metrics.get(key, 0.0), r["metrics"][key])
    rank0 = next((r for r in ranks if r["rank"] == 0), None)
    if rank0 and rank0["status"] == "ok":
        # The trainer gathers the token count over all ranks: rank 0's tokens/s is the whole trial's.
        metrics.update({k: v for k, v in rank0["metrics"].items() if k not in _PER_DEVICE})
    state["attention_tag"] = rank0 and rank0.get("attention_kernel")
    failure = None
    if done.returncode != 0:
        log_text = (out_dir / "ranks.log").read_text(errors="replace")
        root, code = _root_cause(log_text, ranks)
        first = next((r for r in ranks if r["rank"] == root and r["failure"]), None)
        if first is not None:
            failure = Failure(**first["failure"])
            text = (out_dir / f"rank{root}" / "traceback.txt").read_text()
            tracking.log_text(client, run_id, text, f"traceback_rank{root}.txt")
        else:  # it died without a word (signal, segfault): its exit code says how
            failure = Failure(classify_exit(code, log_text), first_line(f"rank {root} exited with {code}"), rank=root)
            tracking.log_text(client, run_id, log_text[-20000:], "ranks_log_tail.txt")
    state["metrics"] = metrics
    return _record(cfg, out_dir, state, failure)


def _read_result(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        rank = int(path.parent.name.removeprefix("rank"))
        return {"status": "missing", "rank": rank, "local_rank": rank, "metrics": {}, "failure": None}


def _root_cause(log_text: str, ranks: list[dict[str, Any]]) -> tuple[int | None, int]:
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
