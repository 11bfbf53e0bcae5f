"""A trial in this process: open its MLflow run, train with trl's SFTTrainer, measure, and record the outcome.

Whatever happens inside, the trial's MLflow run ends (FINISHED or FAILED, never RUNNING; an attempt of a single run
leaves that to its supervisor, src/trial/supervised.py) with
`trial.status`, the failure's kind, step and first line, and the full traceback as an artifact; the outcome
is also written to `<output dir>/result.json` for the sweep engine. A failure that kills the process
outright (segfault, SIGKILL, a hang) is recorded by the engine from outside.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from src import record as rec
from src import redact, stores
from src.failures import Failure, classify_exception, first_line, oom_card_free_gib, oom_request_gib
from src.handoff import PROGRESS_FILE, RESULT_FILE
from src.trial.context import TrialContext, check, describe, open_run


def run(cfg: DictConfig, out_dir: Path, attempt: Any = None) -> dict[str, Any]:
    """Run one trial and record it; returns the outcome (also written to result.json). `attempt`: an attempt of a
    single run (src/trial/supervised.py), which checkpoints, resumes and leaves its run open for the supervisor."""
    # A password in tracking.uri, a store that cannot be reached or written: one line, before torch or MLflow.
    stores.require(stores.of_trial(cfg))
    ctx = TrialContext(attempt=attempt)
    ctx.mark("python_and_hydra")  # the interpreter (or the fork) and Hydra's composition of the config
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx.client, ctx.run_id = open_run(cfg)
    launch_blocking = os.environ.get("CUDA_LAUNCH_BLOCKING") == "1"
    ctx.mark("python_and_mlflow")
    failure: Failure | None = None
    try:
        describe(cfg, ctx, out_dir)
        train(cfg, out_dir, ctx)
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then the process exits
        failure = failure_of(exc, ctx.meas)
        if attempt is not None and _save_failed(exc, attempt):
            from src.checkpoints import clean_staging, disk_full

            clean_staging(attempt.folder)  # the partial copy: never committed, and its space is wanted
            failure.message = disk_full(attempt.folder).strerror
            failure.step = ctx.meas.step if ctx.meas is not None else failure.step  # the checkpoint being saved
        name, trace = "traceback_launch_blocking.txt" if launch_blocking else "traceback.txt", traceback.format_exc()
        ctx.log_text(trace, name)
        (out_dir / name).write_text(redact.redact_text(trace))  # beside result.json, for the terminal
    return record(cfg, out_dir, ctx, failure)


def train(cfg: DictConfig, out_dir: Path, ctx: TrialContext) -> None:
    """Preflight, load the 4-bit model, attach LoRA and train it with SFTTrainer within the memory budget, logging
    to `ctx`'s run. What was built (measurements, trainer, probes) stays in `ctx` for the outcome, even when this
    raises."""
    if cfg.measure.profile_startup:  # where the start-up goes, function by function (startup_profile.txt)
        import cProfile

        ctx.startup_profiler = cProfile.Profile()
        ctx.startup_profiler.enable()
    # Refused before the training stack loads: a setting preflight refuses is told in seconds, not after the
    # imports of trl, peft and transformers' trainer (~3 s of a fresh interpreter on a CPU; a fork has them already).
    check(cfg, ctx)
    ctx.mark("preflight")
    from trl import SFTTrainer  # noqa: F401 - imports transformers, peft, accelerate: the `libraries` phase

    from src.measure import Measurements
    from src.measure.memory import budget

    ctx.mark("libraries")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    # The watchdog reads the trial's progress file; in a data-parallel trial rank 0 writes it.
    progress = out_dir / PROGRESS_FILE if int(os.environ.get("RANK", "0")) == 0 else ctx.rank_dir / PROGRESS_FILE
    ctx.meas = Measurements(cfg, progress, world_size=world_size)
    # On a GPU the allocator's cap; on a CPU the process's own memory, lifted when training ends (src/measure/memory.py)
    with budget(cfg.hardware.vram_budget_gib, ctx.meas) as facts:
        ctx.budget = facts
        ctx.mark("budget_cap")
        _train(cfg, out_dir, ctx)


def _train(cfg: DictConfig, out_dir: Path, ctx: TrialContext) -> None:
    """`train` within the memory budget: the model, LoRA, the data, the trainer, training and the adapter."""
    import torch
    from hydra.utils import instantiate
    from trl import SFTConfig, SFTTrainer

    from src import models, preflight, recompute
    from src.config import packed_probe, sft_kwargs
    from src.data import fullest_first
    from src.measure import progress

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model, tokenizer = models.load(cfg)
    ctx.mark("model_load")
    model = preflight.guard_device_moves(model)  # a 4-bit / dispatched model must never be moved with .to()
    model = models.prepare_for_kbit_training(model, cfg)
    ctx.mark("kbit_prepare")
    dataset, stats = _dataset(cfg, tokenizer, world_size=world_size)
    ctx.log_metrics(stats)
    ctx.mark("dataset")
    # The adapter's initialisation from trainer.seed (the Trainer seeds only later, once it is built): two runs of
    # one setting start from the same adapter, so a resumed run can be compared with an uninterrupted one
    from transformers import set_seed

    set_seed(int(cfg.trainer.seed))
    model = models.attach_lora(model, instantiate(cfg.lora, _convert_="all"))
    if cfg.trainer.gradient_checkpointing and cfg.trainer.recompute == "no_down":
        reordered = recompute.base_last(model)  # none without 4-bit LoRA down_proj: then it recomputes as full does
        print(f"trainer.recompute=no_down: {reordered} down_proj products computed after their LoRA terms", flush=True)
        ctx.set_tags({"trial.recompute_reordered": reordered})
    staging = ctx.attempt.checkpoints_staging if ctx.attempt is not None else None
    trainer = SFTTrainer(  # trl casts the adapters to bf16 on a 4-bit base, as it does with a peft_config
        model=model,
        args=SFTConfig(**sft_kwargs(cfg, use_cpu=not torch.cuda.is_available(), staging_dir=staging)),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    if packed_probe(cfg):  # trl packed the rows into bins above: the fullest are trained first
        trainer.train_dataset = fullest_first(trainer.train_dataset)
    for callback in _callbacks(cfg, out_dir, ctx):
        trainer.add_callback(callback)
    progress.install(trainer, ctx.meas)  # one bar on a terminal; the per-step dicts to the log file
    if recompute.compiles_the_checkpoint(cfg):
        trainer.add_callback(recompute.compiled_checkpoints())  # once train() has set the checkpoint functions
    elif cfg.trainer.torch_compile == "layers":
        models.compile_layers(trainer.model)  # compiles in the first steps (first_step_s), not here
    gate = None
    if cfg.trainer.gradient_checkpointing and cfg.trainer.get("checkpoint_above_tokens"):
        gate = recompute.TokenGate(trainer.model, cfg.trainer.checkpoint_above_tokens)
        print(f"trainer.checkpoint_above_tokens={gate.above}: micro-batches of more tokens checkpoint", flush=True)
    ctx.trainer = trainer
    ctx.mark("trainer_init")
    if ctx.startup_profiler is not None:
        ctx.startup_profiler.disable()
        text = _profile_text(ctx.startup_profiler)
        (out_dir / "startup_profile.txt").write_text(text)
        ctx.log_text(text, "startup_profile.txt")
    resume = _checkpointing(cfg, trainer, ctx)
    with models.attention_kernels(cfg):
        trainer.train(resume_from_checkpoint=resume)
    if gate is not None and gate.checkpointed_frac is not None:
        ctx.log_metrics({"checkpointed_micro_batch_frac": gate.checkpointed_frac})
        print(f"checkpointed {gate.gated[0]} of {sum(gate.gated)} micro-batches (the rest kept their activations)")
    if ctx.profiler is not None and ctx.profiler.text:
        ctx.log_text(ctx.profiler.text, "profile.txt")
    if ctx.attempt is not None:  # a single run keeps its adapter: beside its checkpoints, and on its MLflow run
        from src.checkpoints import ADAPTER

        adapter = ctx.attempt.folder / ADAPTER
        trainer.model.save_pretrained(adapter)
        ctx.log_artifacts(adapter, ADAPTER)
    elif cfg.trainer.save_adapter:
        adapter = out_dir / "adapter"
        trainer.model.save_pretrained(adapter)
        ctx.log_artifacts(adapter, "adapter")


def _checkpointing(cfg: DictConfig, trainer: Any, ctx: TrialContext) -> str | None:
    """An attempt's checkpoints (src/checkpoints.py): the data order a resume repeats exactly, the rows seen, the
    saves committed whole; the checkpoint it continues from (None: the start)."""
    attempt = ctx.attempt
    if attempt is None:
        return None
    from src import checkpoints as ck

    ck.seeded_length_sampler(trainer, int(cfg.trainer.seed))
    ck.keep_adapter_dtype(trainer)
    attempt.rows = ck.RowLedger(trainer)
    attempt.rows.load(attempt.resume_from)
    every_s = None if cfg.trainer.save_steps else float(cfg.checkpoint.every_minutes) * 60
    attempt.checkpoints = ck.Checkpoints(
        attempt.folder, every_s, int(cfg.checkpoint.keep), attempt.ledger, attempt.rows, ctx.fault.at_save
    )
    attempt.checkpoints.after_commit = ctx.meas.restart_clock
    trainer.add_callback(attempt.checkpoints.callback)
    return str(attempt.resume_from) if attempt.resume_from is not None else None


def _save_failed(exc: BaseException, attempt: Any) -> bool:
    """A checkpoint's save refused for want of space (src/checkpoints.py full_disk)."""
    from src.checkpoints import full_disk

    saving = attempt.checkpoints is not None and attempt.checkpoints.save_began is not None
    return saving and full_disk(exc, attempt.folder)


def _callbacks(cfg: DictConfig, out_dir: Path, ctx: TrialContext) -> list[Any]:
    """The trainer's callbacks, in the order the trainer calls them; the probes are also kept in `ctx`."""
    from src import preflight
    from src.faults import FaultInjector
    from src.measure import AttentionProbe, StepProfiler

    probe = ctx.attention = AttentionProbe(at_step=max(1, cfg.measure.warmup_steps))
    guards = preflight.CheckpointingGuard(cfg.trainer.gradient_checkpointing)
    # A single run's fault fires on its first `fault.times` attempts, as a transient fault would; a probe's always.
    fires = ctx.attempt is None or ctx.attempt.index < cfg.fault.times
    ctx.fault = FaultInjector(cfg.fault.kind, cfg.fault.step, cfg.fault.rank, during=cfg.fault.during, fires=fires)
    callbacks = [probe, ctx.meas, guards, ctx.fault]
    if cfg.measure.get("soak_minutes") is not None:  # a soak (src/sweep/soak.py): an epoch and the minutes, then stop
        from src.measure.soak import SoakStop

        callbacks.append(SoakStop(float(cfg.measure.soak_minutes)))
    if cfg.measure.profile_step:
        ctx.profiler = StepProfiler(cfg.measure.profile_step, out_dir / "profile.txt")
        callbacks.insert(1, ctx.profiler)
    return callbacks


def _dataset(cfg: DictConfig, tokenizer: Any, world_size: int) -> tuple[Any, dict[str, float]]:
    """The chat dataset for this trial (a probe gets a subset that holds the longest rows) and length stats."""
    import numpy as np
    from datasets import Dataset

    from src.data import length_stats, load_table, probe_rows, to_messages, token_lengths, truncation

    df = load_table(cfg.data)
    chats = to_messages(df, cfg.data)
    lengths, prompts = token_lengths(chats, tokenizer)
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
    stats.update(truncation(lengths, prompts, cfg.data.max_seq_length))
    return Dataset.from_dict({"messages": chats}), stats


def _profile_text(profiler: Any, limit: int = 40) -> str:
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(limit)
    return out.getvalue()


def failure_of(exc: BaseException, meas: Any, rank: int | None = None) -> Failure:
    """The failure, with the step that was running once training had begun (a NaN loss is seen after its step).
    A trial held to its budget on the CPU (`meas.host`) trains in host memory: an allocation that budget refused is
    the setting's `oom`, as one past a card's memory is."""
    kind = "killed" if isinstance(exc, KeyboardInterrupt) else classify_exception(exc)
    host = getattr(meas, "host", None)
    if host is not None:
        host.sample()  # what it held when it failed: the exception's frames still hold their tensors
        if kind == "host_oom":
            kind = "oom"
    step = None
    if meas is not None and meas.startup_s is not None:
        step = meas.step if kind == "nan_loss" else meas.step + 1
    return Failure(kind, failure_message(f"{type(exc).__name__}: {exc}"), step, rank)


def failure_message(text: str) -> str:
    """A failure's message as every record shows it (result.json, tags, the terminal): its first line, redacted
    before it is cut, so that a token the cut falls in is still known by its shape (a data error quotes the data)."""
    return first_line(redact.redact_text(text[:65536]))


def record(cfg: DictConfig, out_dir: Path, ctx: TrialContext, failure: Failure | None) -> dict[str, Any]:
    """Log what was measured and the outcome's tags, write result.json, and end the run FINISHED or FAILED."""
    meas = ctx.meas
    budget = float(cfg.hardware.vram_budget_gib)
    try:
        metrics: dict[str, float] = meas.summary() if meas else dict(ctx.metrics)
    except Exception as exc:  # a measurement bug must not lose the trial's outcome
        ctx.log_text(traceback.format_exc(), "measurement_error.txt")
        metrics = {}
        if failure is None:
            failure = Failure("other", failure_message(f"measurement failed: {type(exc).__name__}: {exc}"))
    metrics["vram_budget_gib"] = budget
    metrics.update(ctx.budget)
    metrics.update(ctx.phases)
    if meas is not None and meas.startup_s is not None and ctx.phases_end_s is not None:
        metrics["startup.train_begin_s"] = meas.startup_s - ctx.phases_end_s  # optimizer, dataloader, hooks
    if failure and failure.kind == "oom":
        requested, free = oom_request_gib(failure.message), oom_card_free_gib(failure.message)
        if requested is not None:
            metrics["oom_request_gib"] = requested
        if free is not None:  # the whole card's: with others on it, it may have run out before this trial's budget
            metrics["oom_card_free_gib"] = free
    if "peak_vram_reserved_gib" in metrics:
        # An OOM's headroom is from what it needed at least (held at the failure plus the allocation refused): < 0
        needed = metrics["peak_vram_reserved_gib"] + metrics.get("oom_request_gib", 0.0)
        metrics["vram_headroom_frac"] = 1.0 - needed / budget
    ctx.log_metrics(metrics)
    if meas:
        _log_series(ctx.client, ctx.run_id, meas)
    status = "failed" if failure else "ok"
    if failure:  # whoever made it: result.json is read back by the supervisor and shown on the terminal
        failure.message = redact.redact_text(failure.message)
    tags: dict[str, Any] = rec.outcome_tags(status, failure.as_dict() if failure else None)
    if ctx.kernel():
        tags[rec.ATTENTION_KERNEL] = ctx.kernel()
    ctx.set_tags(tags)
    result = rec.result_of(status, ctx.run_id, metrics, failure, tags.get(rec.ATTENTION_KERNEL))
    if ctx.attempt is not None:  # for the supervisor: where the attempt got to, and the rows it trained
        result["last_step"] = meas.step if meas else 0
        if ctx.attempt.rows is not None and ctx.trainer is not None:
            state = ctx.trainer.state
            result["rows"] = ctx.attempt.rows.summary(len(ctx.trainer.train_dataset), math.floor(state.epoch or 0))
    (out_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    if ctx.attempt is None:  # an attempt's run stays open: the supervisor ends it once the run is over
        ctx.client.set_terminated(ctx.run_id, "FAILED" if failure else "FINISHED")
    return result


def _log_series(client: Any, run_id: str, meas: Any) -> None:
    """Per-step series: reserved VRAM (the contract's), step seconds and loss."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    series = [Metric("step_seconds", s["time_s"], now, int(s["step"])) for s in meas.steps]
    series += [
        Metric(key, s[key], now, int(s["step"]))
        for s in meas.steps
        for key in ("vram_reserved_gib", "vram_allocated_gib")
        if key in s
    ]
    series += [Metric("loss", loss, now, step) for step, loss in zip(meas.loss_steps, meas.losses, strict=True)]
    for i in range(0, len(series), 500):
        client.log_batch(run_id, metrics=series[i : i + 500])
