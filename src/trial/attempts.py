"""One attempt of a single run (the worker's side of src/trial/supervised.py): it continues from the run's last
checkpoint, records its outcome in the run's ledger, and decides (`stop_reason`) whether its failure is the
process's (worth a fresh process: exit 1, and the elastic agent restarts it) or the setting's (exit 0 with the
failure recorded, so that nothing is restarted)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from src import checkpoints as ck
from src.failures import PROCESS_FAULTS
from src.handoff import PROGRESS_FILE, trial_started
from src.trial import single

RUN_DIR_ENV = "QLORA_RUN_DIR"  # set by the supervisor: this process is an attempt of the run in that folder
# The elastic agent's variables for a worker of a distributed job; an attempt is one process and trains as a plain
# single-process run, so it drops them before transformers reads them (transformers would set up a process group).
_ELASTIC_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
# Failures that may be the process's once (fragmentation, a transient fault) but are the setting's when they come
# back at the same step.
_TWICE = ("oom", "other")
_ADVICE = {
    "oom": (
        "the setting needs more memory than the card has: lower data.max_seq_length or "
        "trainer.per_device_train_batch_size, or set trainer.gradient_checkpointing=true (python -m src.fit shows "
        "what fits)"
    ),
    "nan_loss": "a restart would replay the same steps: lower trainer.learning_rate or raise trainer.warmup_steps",
    "other": "a restart does not get past it: see the attempt's traceback",
}


def stop_reason(failure: dict[str, Any], before: list[dict[str, Any]]) -> str | None:
    """None: restart from the last checkpoint. Else the line that says why not, and what to change."""
    kind, step, message = failure["kind"], failure.get("step"), str(failure.get("message", ""))
    if "no space left" in message.lower():
        return message  # src.checkpoints.disk_full: what was kept and what to do
    if kind in PROCESS_FAULTS:
        return None
    if kind in _TWICE:
        again = [a for a in before if (a.get("failure") or {}).get("kind") == kind and a["failure"].get("step") == step]
        if not again:
            return None
        return f"{kind} at step {step} on two attempts: {_ADVICE[kind]}"
    return f"{kind}: {_ADVICE.get(kind, 'change what the message names, then run the same command again')}"


def drop_elastic_env() -> int:
    """In an attempt, first thing: the agent's restart count (0 for its first process), and the agent's variables
    dropped."""
    restarts = int(os.environ.pop("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    for name in [*_ELASTIC_VARS, *(k for k in os.environ if k.startswith("TORCHELASTIC_"))]:
        os.environ.pop(name, None)
    return restarts


# ---- an attempt (the worker's side) ----------------------------------------------------------------------------------


@dataclass
class Attempt:
    """One attempt of a run, as the trial that trains it sees it (TrialContext.attempt)."""

    folder: Path
    ledger: ck.Ledger
    index: int  # 0 for the run's first attempt, across every command that continued it
    resume_from: Path | None
    checkpoints: ck.Checkpoints | None = None  # set once the trainer is built
    rows: ck.RowLedger | None = None

    @property
    def checkpoints_staging(self) -> Path:
        """Where the Trainer writes a checkpoint before it is committed."""
        return self.folder / ck.STAGING


def run_attempt(cfg: DictConfig, out_dir: Path) -> tuple[dict[str, Any], int]:
    """Train one attempt of the run in RUN_DIR_ENV: continue from its last checkpoint, record the outcome in the
    ledger, and say how to exit: 1 to be restarted by the agent, 0 when done (finished, or stopped for good)."""

    folder = Path(os.environ[RUN_DIR_ENV])
    ledger = ck.Ledger(folder)
    ck.clean_staging(folder)
    (out_dir / PROGRESS_FILE).unlink(missing_ok=True)  # the attempt before's: its step is not this one's
    last = ck.last_checkpoint(folder)
    entry: dict[str, Any] = {
        "attempt": len(ledger.attempts) + 1,
        "pid": os.getpid(),
        "launched": trial_started(),
        "resumed_from_step": ck.step_of(last),
        "out_dir": str(out_dir),
    }
    with ledger.changing():
        before = list(ledger.attempts)
        entry["attempt"] = len(before) + 1
        ledger.attempts.append(entry)
    attempt = Attempt(folder, ledger, len(before), last)
    if last is not None:
        print(f"attempt {entry['attempt']}: continuing from {last}", flush=True)
    result = single.run(cfg, out_dir, attempt=attempt)
    ck.clean_staging(folder)  # what the Trainer writes beside its checkpoints (a model card), or a save cut short
    with ledger.changing():
        entry = ledger.attempts[-1]
        entry.update(_ended(result, attempt))
        if result["status"] == "ok":
            ledger.data["completed"] = ck.now_iso()
            ledger.data["adapter"] = str(folder / ck.ADAPTER)
        else:
            entry["stop"] = stop_reason(result["failure"], before)
    restart = result["status"] != "ok" and entry["stop"] is None
    if restart:  # a stop is said by the supervisor, once the run is recorded
        f = result["failure"]
        print(
            f"attempt {entry['attempt']} failed ({f['kind']} at step {f['step']}): {f['message']}; a fresh process "
            "continues from the last checkpoint (checkpoint.max_restarts allowing)",
            flush=True,
        )
    return result, 1 if restart else 0


def _ended(result: dict[str, Any], attempt: Attempt) -> dict[str, Any]:
    """What the attempt's end adds to its entry (its training's start is written when it begins: a process that
    dies without a word leaves that much)."""
    out: dict[str, Any] = {"ended": time.time(), "status": result["status"], "failure": result.get("failure")}
    out["last_step"] = result.get("last_step")
    if attempt.rows is not None:
        out["rows"] = result.get("rows")
    return out
