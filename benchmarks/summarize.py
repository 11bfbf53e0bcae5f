"""Summarize a study's trials into a committed result file (GPU facts, versions, command, per-trial figures).

python -m benchmarks.summarize STUDY OUT.json --command "the command that produced the study"
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import optuna

from src.tracking import system_tags

FIELDS = (
    "peak_vram_allocated_gib",
    "peak_vram_reserved_gib",
    "peak_vram_device_gib",
    "vram_budget_gib",
    "vram_headroom_frac",
    "tokens_per_s",
    "samples_per_s",
    "step_time_s",
    "train_loss",
    "startup_s",
    "cuda_context_gib",
    "allocator_cap_gib",
    "oom_request_gib",
    "data.tokens_max",
    "data.tokens_median",
)


def trials(storage: str, study: str) -> list[dict]:
    out = []
    for t in optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False):
        a = t.user_attrs
        out.append(
            {
                "trial": t.number,
                "params": t.params,
                "status": a.get("trial.status", t.state.name.lower()),
                "failure_kind": a.get("failure.kind"),
                "failure_step": a.get("failure.step"),
                "failure_message": a.get("failure.message"),
                "failure_launch_blocking_kind": a.get("failure.launch_blocking_kind"),
                "attention_kernel": a.get("attention.kernel"),
                **{k: a[k] for k in FIELDS if k in a},
                "mlflow_run_id": a.get("mlflow_run_id"),
                "duration_s": (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete else None,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("study")
    parser.add_argument("out")
    parser.add_argument("--storage", default=None)
    parser.add_argument("--command", default="")
    parser.add_argument("--sweeps-dir", default="sweeps")
    args = parser.parse_args()
    storage = args.storage or f"sqlite:///{Path(args.sweeps_dir).resolve() / args.study / 'optuna.db'}"
    rows = trials(storage, args.study)
    started = [t for t in optuna.load_study(study_name=args.study, storage=storage).get_trials() if t.datetime_start]
    wall = (
        max(t.datetime_complete for t in started if t.datetime_complete) - min(t.datetime_start for t in started)
    ).total_seconds()
    result = {
        "study": args.study,
        "command": args.command,
        "machine": {**system_tags(), "platform": platform.platform()},
        "wall_time_s": wall,
        "trials": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}: {len(rows)} trials, {wall:.0f}s wall")
    for r in rows:
        print(
            f"  #{r['trial']:>2} {json.dumps(r['params'])[:90]:90} {r['status']:7} {r.get('failure_kind') or '':6} "
            f"alloc={r.get('peak_vram_allocated_gib', 0):6.2f} res={r.get('peak_vram_reserved_gib', 0):6.2f} "
            f"dev={r.get('peak_vram_device_gib', 0):6.2f} tok/s={r.get('tokens_per_s', 0):8.1f} "
            f"step={r.get('step_time_s', 0):.3f} attn={r.get('attention_kernel')}"
        )


if __name__ == "__main__":
    main()
