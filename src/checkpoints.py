"""A single run's checkpoints: where they live, the run's ledger of attempts, and saving them so that a kill or a
full disk never leaves a half-written checkpoint in use.

transformers' Trainer writes what a resume needs (the adapter, optimizer, LR scheduler, scaler, RNG states and the
trainer state with its step) and skips the batches already trained when it resumes. What it does not promise, and
this module adds:
- **atomic saves**: the Trainer writes into `<run dir>/.staging/checkpoint-N`; only a whole checkpoint is moved
  (one rename) to `<run dir>/checkpoint-N`, and only then is the oldest beyond `checkpoint.keep` removed. A kill or
  a full disk during a save leaves the previous checkpoint whole and in use.
- **a time interval**: `checkpoint.every_minutes` of training (transformers saves by steps or epochs only).
- **the exact data position under group_by_length**: transformers' LengthGroupedSampler draws its order from the
  global RNG when an epoch's iterator is made, so an epoch resumed in a fresh process is ordered differently from
  the one that was interrupted (rows trained twice, others skipped). `seeded_length_sampler` draws each epoch's
  order from `seed + epoch`, as accelerate's seedable sampler does for random order.
- **rows seen per epoch** (`RowLedger`): a fingerprint of every row trained, kept in each checkpoint, so a run
  says how many rows each epoch trained, and whether a resume repeated or skipped any.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

LEDGER = "run.json"  # the run's MLflow run id, settings fingerprint, attempts and checkpoints
STAGING = ".staging"  # where the Trainer writes a checkpoint before it is committed
ADAPTER = "adapter"  # the final adapter, beside the checkpoints (and the run's MLflow artifact of that name)
ROWS_FILE = "rows_seen.json"  # in each checkpoint: the rows trained so far, per epoch
PREFIX = "checkpoint-"
# The settings that make two commands the same run: what is trained and on what (not where it is recorded, how it
# is measured or which fault is injected).
_FINGERPRINTED = ("model", "lora", "data", "trainer")
_PER_RUN = ("trainer.output_dir",)


class DiskFull(OSError):
    """A checkpoint could not be written: the disk is full. The previous checkpoint is kept."""


# ---- where a run lives ------------------------------------------------------------------------------------------------


def fingerprint(cfg: DictConfig) -> str:
    """The run's settings as a short hash: the same command (the same settings) finds the same checkpoints."""
    from src.config import flatten, to_container

    settings = {k: v for k, v in to_container(cfg).items() if k in _FINGERPRINTED}
    flat = {k: v for k, v in flatten(settings).items() if k not in _PER_RUN}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:10]


def run_dir(cfg: DictConfig) -> Path:
    """`checkpoint.dir`, else sweeps/runs/<model>-<fingerprint>/."""
    if cfg.checkpoint.dir:
        return Path(cfg.checkpoint.dir)
    return Path(cfg.paths.sweeps_dir) / "runs" / f"{cfg.model.name}-{fingerprint(cfg)}"


def committed(folder: Path) -> list[Path]:
    """The committed checkpoints, oldest first (by step)."""
    found = [p for p in folder.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX) :].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def last_checkpoint(folder: Path) -> Path | None:
    done = committed(folder)
    return done[-1] if done else None


def step_of(checkpoint: Path | None) -> int:
    return int(checkpoint.name[len(PREFIX) :]) if checkpoint is not None else 0


def size_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def problems(cfg: DictConfig) -> list[str]:
    """What in checkpoint.*, trainer.save_steps and fault.{times,during} cannot work, each with the key and a value
    that would (checked before a run creates anything)."""
    c, found = cfg.checkpoint, []
    if not c.every_minutes > 0:
        found.append(f"checkpoint.every_minutes={c.every_minutes}: minutes of training between saves, e.g. 10")
    if c.keep < 1:
        found.append(f"checkpoint.keep={c.keep}: the checkpoints kept, at least 1 (the one a resume continues from)")
    if c.max_restarts < 0:
        found.append(f"checkpoint.max_restarts={c.max_restarts}: restarts allowed, 0 or more, e.g. 3")
    if not c.stall_timeout_s > 0:
        found.append(f"checkpoint.stall_timeout_s={c.stall_timeout_s}: seconds without progress, e.g. 900")
    if cfg.trainer.save_steps is not None and cfg.trainer.save_steps < 1:
        found.append(f"trainer.save_steps={cfg.trainer.save_steps}: optimizer steps between saves, or null")
    if cfg.fault.times < 1:
        found.append(f"fault.times={cfg.fault.times}: the attempts the fault fires on, at least 1")
    if cfg.fault.during not in ("step", "save"):
        found.append(f"fault.during={cfg.fault.during}: step (when fault.step begins) or save (while it is saved)")
    return found


# ---- the ledger ----------------------------------------------------------------------------------------------------------


class Ledger:
    """`<run dir>/run.json`: one run across its attempts and the commands that continued it. Written whole (redacted)
    and replaced at once; the supervisor's threads and the attempt it launched change it under one file lock
    (`changing`), each reading it afresh first."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LEDGER
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.data.setdefault("attempts", [])
        self.data.setdefault("checkpoints", [])

    @property
    def attempts(self) -> list[dict[str, Any]]:
        return self.data["attempts"]

    @property
    def checkpoints(self) -> list[dict[str, Any]]:
        return self.data["checkpoints"]

    def reload(self) -> Ledger:
        self.__init__(self.path.parent)  # type: ignore[misc]
        return self

    def save(self) -> None:
        from src.redact import redact_text

        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{LEDGER}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(redact_text(json.dumps(self.data, indent=2)))  # failure messages may quote a value
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def changing(self) -> Any:
        """Read afresh, change, save: one writer at a time (the attempt, the supervisor's watch and its record)."""
        from filelock import FileLock

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path.with_name(f".{LEDGER}.lock"))):
            self.reload()
            yield self
            self.save()

    def open_attempt(self) -> dict[str, Any] | None:
        """The last attempt, if it never recorded its end (its process, or the machine, died)."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and "ended" not in last else None


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def start_over(folder: Path) -> Path | None:
    """checkpoint.resume=false: the run's folder moved aside to <folder>.<time> (nothing is deleted); its path."""
    if not folder.exists():
        return None
    aside = folder.with_name(f"{folder.name}.{datetime.now(UTC):%Y%m%d-%H%M%S}")
    folder.rename(aside)
    return aside


# ---- the data position -----------------------------------------------------------------------------------------------


def seeded_length_sampler(trainer: Any, seed: int) -> None:
    """Make `trainer`'s group_by_length order a function of (seed, epoch): the same in a resumed process as in the
    one that was interrupted. transformers 5.17-5.23 build LengthGroupedSampler with no generator."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    build = trainer._get_train_sampler  # private (checked against transformers 5.17-5.23)

    def _get_train_sampler(*args: Any, **kwargs: Any) -> Any:
        sampler = build(*args, **kwargs)
        if isinstance(sampler, LengthGroupedSampler):
            return EpochSeeded(sampler, seed)
        return sampler

    trainer._get_train_sampler = _get_train_sampler


def keep_adapter_dtype(trainer: Any) -> None:
    """A resume trains the adapter in the dtype it had, as the uninterrupted run did. transformers' resume loads a
    PEFT adapter with peft's `load_adapter(..., is_trainable=True)`, whose autocast_adapter_dtype upcasts bf16 adapter
    weights to fp32; on a 4-bit base trl has cast them to bf16, so a resumed run would go on in another precision
    (checked against transformers 5.17-5.23, peft 0.21: `Trainer._load_from_checkpoint` is private)."""
    load = trainer._load_from_checkpoint

    def _load_from_checkpoint(resume_from_checkpoint: str, model: Any = None) -> Any:
        target = model if model is not None else trainer.model
        dtypes = {n: p.dtype for n, p in target.named_parameters() if p.requires_grad}
        out = load(resume_from_checkpoint, model)
        for name, param in target.named_parameters():
            if name in dtypes and param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])
        return out

    trainer._load_from_checkpoint = _load_from_checkpoint


class EpochSeeded:
    """A LengthGroupedSampler whose order each epoch is drawn from `seed + epoch` (set_epoch, which the Trainer
    calls on the sampler before each epoch's iterator)."""

    def __init__(self, sampler: Any, seed: int) -> None:
        import torch

        self.sampler, self.seed, self.epoch = sampler, seed, 0
        self.sampler.generator = torch.Generator()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        self.sampler.generator.manual_seed(self.seed + self.epoch)
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class RowLedger:
    """Every row a run trains, as a fingerprint of its tokens, per epoch: kept in each checkpoint and restored on
    resume, so that the run can say how many rows each epoch trained and whether any was trained twice or skipped.
    Wraps the trainer's `training_step` (one call per micro-batch)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.seen: dict[str, list[str]] = {}
        step = trainer.training_step

        def training_step(model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            self.add(inputs)
            return step(model, inputs, *args, **kwargs)

        trainer.training_step = training_step

    def add(self, inputs: dict[str, Any]) -> None:
        ids = inputs["input_ids"].detach().cpu()
        mask = inputs.get("attention_mask")
        mask = mask.detach().cpu().bool() if mask is not None and mask.shape == ids.shape else None
        epoch = str(math.floor(self.trainer.state.epoch or 0))
        rows = self.seen.setdefault(epoch, [])
        for i in range(ids.shape[0]):
            row = ids[i][mask[i]] if mask is not None else ids[i]
            rows.append(hashlib.blake2b(row.numpy().tobytes(), digest_size=8).hexdigest())

    def save(self, checkpoint: Path) -> None:
        (checkpoint / ROWS_FILE).write_text(json.dumps(self.seen))

    def load(self, checkpoint: Path | None) -> None:
        path = checkpoint / ROWS_FILE if checkpoint is not None else None
        self.seen = json.loads(path.read_text()) if path is not None and path.exists() else {}

    def summary(self, dataset_rows: int, epochs_done: int) -> dict[str, Any]:
        """Per epoch: rows trained and distinct rows; over the run: rows repeated within an epoch, and rows of the
        epochs that finished that were never trained."""
        per_epoch = {e: {"rows": len(r), "distinct": len(set(r))} for e, r in sorted(self.seen.items(), key=_num)}
        repeated = sum(c - 1 for r in self.seen.values() for c in Counter(r).values() if c > 1)
        skipped = sum(max(0, dataset_rows - per_epoch.get(str(e), {}).get("distinct", 0)) for e in range(epochs_done))
        return {"per_epoch": per_epoch, "repeated": repeated, "skipped": skipped, "dataset_rows": dataset_rows}


def _num(item: tuple[str, Any]) -> int:
    return int(item[0])


# ---- saving -------------------------------------------------------------------------------------------------------------


class Checkpoints:
    """The Trainer's callback that asks for a save every `every_s` seconds of training (unless transformers' own
    save_steps does) and at the last step, and commits each save whole (`on_save`). `before_commit(step)` is called
    with the staged checkpoint written but not yet committed (the injected fault `fault.during=save`)."""

    def __init__(
        self,
        folder: Path,
        every_s: float | None,
        keep: int,
        ledger: Ledger,
        rows: RowLedger | None = None,
        before_commit: Any = None,
    ) -> None:
        from transformers import TrainerCallback

        self.folder, self.every_s, self.keep, self.ledger, self.rows = folder, every_s, keep, ledger, rows
        self.before_commit = before_commit
        self.after_commit: Any = None  # e.g. the step timer's restart: a save is not a step's time
        self.clock = time.perf_counter()  # training time since the last save (set at train begin)
        self.save_began: float | None = None
        self.saved: list[dict[str, Any]] = []  # this attempt's saves
        self.callback = type("CheckpointCallback", (TrainerCallback,), {})()
        for name in ("on_train_begin", "on_step_end", "on_save"):
            setattr(self.callback, name, getattr(self, name))

    @property
    def staging(self) -> Path:
        return self.folder / STAGING

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.clock = time.perf_counter()
        with self.ledger.changing() as ledger:  # when this attempt's training began: what a failure throws away
            ledger.attempts[-1]["train_began"] = time.time()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.every_s is not None and time.perf_counter() - self.clock >= self.every_s:
            control.should_save = True
        if state.global_step >= state.max_steps:
            control.should_save = True  # the end: what the final adapter came from
        if control.should_save:
            self.save_began = time.perf_counter()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        staged = self.staging / f"{PREFIX}{step}"
        target = self.folder / f"{PREFIX}{step}"
        # A full disk here (or in the Trainer's writes before) is the attempt's to tell: src/trial/single.py removes
        # the staged copy and says what was kept (disk_full)
        if self.rows is not None:
            self.rows.save(staged)
        if self.before_commit is not None:
            self.before_commit(step)
        _fsync_tree(staged)
        if target.exists():  # this step was committed by an attempt before (it resumed from it): same state
            shutil.rmtree(staged)
        else:
            os.replace(staged, target)
            _fsync_dir(self.folder)
        self._rotate()
        seconds = time.perf_counter() - (self.save_began or time.perf_counter())
        entry = {
            "step": step,
            "at": now_iso(),
            "at_s": time.time(),
            "save_s": seconds,
            "size_bytes": size_bytes(target),
        }
        self.saved.append(entry)
        with self.ledger.changing() as ledger:
            ledger.checkpoints.append(entry)
        self.save_began = None
        self.clock = time.perf_counter()
        if self.after_commit is not None:
            self.after_commit()

    def _rotate(self) -> None:
        for old in committed(self.folder)[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


_FULL_DISK = ("No space left on device", "StorageFull", "file write failed", "Disk quota exceeded")


def full_disk(exc: BaseException, folder: Path | None = None) -> bool:
    """Whether `exc`, raised while saving into `folder`, is a write refused for want of space: an OSError's ENOSPC,
    the words safetensors (SafetensorError "StorageFull") or torch's zip writer ("file write failed") use for it, or
    any error with less room left there than the last checkpoint took (torch's zip writer may only say "unexpected
    pos 130560 vs 130448")."""
    if isinstance(exc, DiskFull) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return True
    if any(words in str(exc) for words in _FULL_DISK):
        return True
    if folder is None or not folder.exists():
        return False
    last = last_checkpoint(folder)
    needed = size_bytes(last) if last is not None else 2**20
    return shutil.disk_usage(folder).free < needed


def disk_full(folder: Path) -> DiskFull:
    kept = last_checkpoint(folder)
    free = shutil.disk_usage(folder).free / 2**20 if folder.exists() else 0.0
    return DiskFull(
        errno.ENOSPC,
        f"no space left on the device of {folder} to save a checkpoint ({free:.0f} MiB free); "
        + (f"{kept.name} is kept and the same command continues from it" if kept else "no checkpoint was committed")
        + ": free space there, or set checkpoint.dir to a disk with room, then run the same command again",
    )


def clean_staging(folder: Path) -> None:
    """A save a kill interrupted: never committed, removed before an attempt starts."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(folder / STAGING)


def _fsync_tree(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
