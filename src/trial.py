"""One trial: preflight, load the 4-bit model, attach LoRA, train with trl's SFTTrainer, measure, record.

Whatever happens inside, the trial's MLflow run ends (FINISHED or FAILED, never RUNNING) with
`trial.status`, the failure's kind, step and first line, and the full traceback as an artifact; the outcome
is also written to `<output dir>/result.json` for the sweep engine. A failure that kills the process
outright (segfault, SIGKILL, a hang) is recorded by the engine from outside.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from src import tracking
from src.config import to_container
from src.failures import Failure, classify_exception, first_line, oom_request_gib

RESULT_FILE = "result.json"
PROGRESS_FILE = "progress.json"


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
        keep = probe_rows(truncated, rows, t.per_device_train_batch_size, cfg.data.seed)
        chats = [chats[i] for i in keep]
    stats = {f"data.{k}": v for k, v in length_stats(lengths).items()}
    stats["data.rows"] = float(len(df))
    stats["data.rows_truncated"] = float((lengths > cfg.data.max_seq_length).sum())
    return Dataset.from_dict({"messages": chats}), stats


def _train(cfg: DictConfig, out_dir: Path, state: dict[str, Any]) -> None:
    import torch
    from hydra.utils import instantiate
    from peft import prepare_model_for_kbit_training
    from trl import SFTConfig, SFTTrainer

    from src import models, preflight
    from src.config import sft_kwargs
    from src.faults import FaultInjector
    from src.measure import AttentionProbe, Measurements, cap_to_budget

    client, run_id = state["client"], state["run_id"]
    meas = state["meas"] = Measurements(cfg, out_dir / PROGRESS_FILE)
    report = preflight.run(cfg)  # raises ConfigError / DataError before any GPU work
    tracking.log_text(client, run_id, report.to_text(), "preflight.txt")
    tracking.set_tags(client, run_id, report.tags())

    state["budget"] = cap_to_budget(cfg.hardware.vram_budget_gib)
    model, tokenizer = models.load(cfg)
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=cfg.trainer.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    dataset, stats = _dataset(cfg, tokenizer, world_size=1)
    tracking.log_metrics(client, run_id, stats)
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**sft_kwargs(cfg, use_cpu=not torch.cuda.is_available())),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=instantiate(cfg.lora, _convert_="all"),
    )
    probe = state["attention"] = AttentionProbe(at_step=max(1, cfg.measure.warmup_steps))
    # The probe first: its profiler teardown then falls inside its own (warm-up) step, not the next one.
    for callback in (probe, meas, FaultInjector(cfg.fault.kind, cfg.fault.step)):
        trainer.add_callback(callback)
    state["trainer"] = trainer
    trainer.train()
    if cfg.trainer.save_adapter:
        adapter = out_dir / "adapter"
        trainer.model.save_pretrained(adapter)
        client.log_artifacts(run_id, str(adapter), "adapter")


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
    out_dir.mkdir(parents=True, exist_ok=True)
    client, run_id = _open_run(cfg)
    launch_blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
    state: dict[str, Any] = {"client": client, "run_id": run_id}
    failure: Failure | None = None
    try:
        if not client.get_run(run_id).data.params:  # a re-run (CUDA_LAUNCH_BLOCKING) keeps its first params
            tracking.log_params(client, run_id, tracking.flatten(to_container(cfg)))
        tracking.set_tags(client, run_id, {**tracking.system_tags(), "model.name": cfg.model.name})
        _train(cfg, out_dir, state)
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then the process exits
        meas = state.get("meas")
        failure = Failure(
            kind=classify_exception(exc),
            message=first_line(f"{type(exc).__name__}: {exc}"),
            # the step that was running: one past the last completed, once training had begun
            step=meas.step + 1 if meas and _phase(out_dir) == "training" else None,
        )
        if failure.kind == "nan_loss" and meas:
            failure.step = meas.step  # the loss is checked after its step completed
        name = "traceback_launch_blocking.txt" if launch_blocking else "traceback.txt"
        tracking.log_text(client, run_id, traceback.format_exc(), name)
        if isinstance(exc, KeyboardInterrupt):
            failure.kind = "killed"
    return _record(cfg, out_dir, state, failure)


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


def _phase(out_dir: Path) -> str:
    try:
        return json.loads((out_dir / PROGRESS_FILE).read_text()).get("phase", "")
    except (OSError, ValueError):
        return ""


def _record(cfg: DictConfig, out_dir: Path, state: dict[str, Any], failure: Failure | None) -> dict[str, Any]:
    client, run_id = state["client"], state["run_id"]
    meas = state.get("meas")
    budget = float(cfg.hardware.vram_budget_gib)
    try:
        metrics: dict[str, float] = meas.summary() if meas else {}
    except Exception as exc:  # a measurement bug must not lose the trial's outcome
        tracking.log_text(client, run_id, traceback.format_exc(), "measurement_error.txt")
        metrics = {}
        if failure is None:
            failure = Failure("other", first_line(f"measurement failed: {type(exc).__name__}: {exc}"))
    metrics["vram_budget_gib"] = budget
    if "peak_vram_reserved_gib" in metrics:
        metrics["vram_headroom_frac"] = 1.0 - metrics["peak_vram_reserved_gib"] / budget
    metrics.update(state.get("budget", {}))
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
    if failure:
        tags.update({"failure.kind": failure.kind, "failure.message": failure.message, "failure.step": failure.step})
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
