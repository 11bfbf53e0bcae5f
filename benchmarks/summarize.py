"""Summarize a study's trials into a committed result file (GPU facts, versions, command, per-trial figures).

python -m benchmarks.summarize STUDY OUT.json --command "the command that produced the study"
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
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
    "model_tflops_per_s",
    "samples_per_s",
    "step_time_s",
    "train_loss",
    "startup_s",
    "first_step_s",
    "cuda_context_gib",
    "allocator_cap_gib",
    "oom_request_gib",
    "data.tokens_max",
    "data.tokens_median",
)


def startup_phases(metrics: dict) -> dict[str, float]:
    """`startup.<phase>_s` metrics (or trial attributes) as {phase: its seconds}. Each phase's own duration (they add
    up to `startup_s`); results from before 2026-12-03 hold offsets from the trial's launch instead."""
    return {k[len("startup.") : -2]: v for k, v in metrics.items() if k.startswith("startup.")}


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
                "skipped_reason": a.get("skipped.reason"),
                "attention_kernel": a.get("attention.kernel"),
                **{k: a[k] for k in FIELDS if k in a},
                "startup_phases_s": startup_phases(a),
                "mlflow_run_id": a.get("mlflow_run_id"),
                "duration_s": (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete else None,
                "started": t.datetime_start.timestamp() if t.datetime_start else None,
                "ended": t.datetime_complete.timestamp() if t.datetime_complete else None,
            }
        )
    return out


def counts(rows: list[dict]) -> dict[str, int]:
    """Trials by outcome: ok, skipped (not launched), and failed by failure.kind."""
    out: dict[str, int] = {}
    for r in rows:
        key = f"failed:{r['failure_kind']}" if r["status"] == "failed" else r["status"]
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def median_phases(rows: list[dict]) -> dict[str, float]:
    """Median seconds of each start-up phase over the rows that have it, the longest first (where start-up goes)."""
    names: dict[str, list[float]] = {}
    for r in rows:
        for name, seconds in (r.get("startup_phases_s") or {}).items():
            names.setdefault(name, []).append(seconds)
    medians = {name: statistics.median(values) for name, values in names.items()}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))


def oom_by_half(rows: list[dict]) -> dict[str, dict[str, int]]:
    """How many of the sampler's proposals fell in the OOM region, in the first and second half of the study.

    A proposal is in the OOM region when it ran out of memory, or was skipped as certain to (it dominates an
    OOM setting on every memory-monotone knob). `launched_oom` counts only the ones that were started.
    """
    ordered = sorted(rows, key=lambda r: r["trial"])
    half = (len(ordered) + 1) // 2
    out = {}
    for name, part in (("first", ordered[:half]), ("second", ordered[half:])):
        oom = [r for r in part if r.get("failure_kind") == "oom"]
        out[name] = {
            "trials": len(part),
            "in_oom_region": len(oom),
            "launched_oom": sum(r["status"] == "failed" for r in oom),
            "skipped_certain_oom": sum(r["status"] == "skipped" for r in oom),
        }
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
        "counts": counts(rows),
        "oom_region_by_half": oom_by_half(rows),
        "trials": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}: {len(rows)} trials, {wall:.0f}s wall, {result['counts']}")
    print(f"  OOM region by half: {result['oom_region_by_half']}")
    for r in rows:
        print(
            f"  #{r['trial']:>2} {json.dumps(r['params'])[:90]:90} {r['status']:7} {r.get('failure_kind') or '':6} "
            f"alloc={r.get('peak_vram_allocated_gib', 0):6.2f} res={r.get('peak_vram_reserved_gib', 0):6.2f} "
            f"dev={r.get('peak_vram_device_gib', 0):6.2f} tok/s={r.get('tokens_per_s', 0):8.1f} "
            f"step={r.get('step_time_s', 0):.3f} attn={r.get('attention_kernel')}"
        )


if __name__ == "__main__":
    main()
