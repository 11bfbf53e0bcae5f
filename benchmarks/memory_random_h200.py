"""The memory model judged where it was not fitted (issue "A memory model that holds where it was not fitted").

    python -m benchmarks.memory_random_h200 design     # here: the calibration design and the random held-out set
    WAIT=570 bash benchmarks/memory_random_h200.sh     # on the GPU (carry .whl): every setting of the design, measured
    python -m benchmarks.memory_random_h200 summarize RAW.json   # here: fit on the design, judge on the held-out set

The space is every knob the sweeper and the recipe's levers vary: `data.max_seq_length` 256-4096 in steps of 64
(not only powers of two), per-device batch 1-8, gradient checkpointing, eager / SDPA / varlen attention, packing,
LoRA rank 8-64 (log-uniform), the non-quantized weights in fp32 (peft's upcast) or bf16, `group_by_length`, and
gradient accumulation 1-4. The calibration points are a scrambled Sobol sequence over it (space-filling); the
held-out settings are drawn uniformly at random from the same space with another seed and are never used in the
fit. Each setting is one fresh trial (`python -m src.train`, forked from a warm interpreter, 5 at a time on one
H200, each capped at 24 GiB) of `llama3_8b_synthetic` on `data=clinical_notes`: 2 optimizer steps, the longest
rows in the probe's sample, peak reserved VRAM from torch's allocator.

A setting the current model puts beyond 1.6x the card (certain OOM even if it overestimated by 37%) is not launched:
the sweep never launches it either (it skips it as a certain OOM). It is listed, not measured, and is not a held-out
point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
DESIGN = RESULTS / "memory_model_random_design.json"
OLD_MODEL = RESULTS / "memory_model_calibration_h200.json"
BUDGET = 24.0
BASE = ["model=llama3_8b_synthetic", "data=clinical_notes"]
PROBE = ["trainer.max_steps=2", "trainer.warmup_steps=0", "measure.warmup_steps=1"]
ATTENTION = ("eager", "sdpa", "varlen")
CERTAIN_OOM = 1.6  # x the card: not launched (the sweep skips such a setting as a certain OOM)
N_CALIBRATION = 40
N_HELD_OUT = 64  # launched (the sweep would launch them); expect ~1/4 to OOM


def setting_from_unit(u: np.ndarray) -> dict[str, Any]:
    """One point of the unit cube as a setting of the space (the same map for the design and the held-out set)."""
    return {
        "data.max_seq_length": int(256 + 64 * min(math.floor(u[0] * 61), 60)),  # 256 ... 4096
        "trainer.per_device_train_batch_size": int(1 + min(math.floor(u[1] * 8), 7)),
        "trainer.gradient_checkpointing": bool(u[2] < 0.5),
        "model.attn_implementation": ATTENTION[min(math.floor(u[3] * 3), 2)],
        "trainer.packing": bool(u[4] < 0.5),
        "lora.r": int(round(math.exp(math.log(8) + u[5] * (math.log(64) - math.log(8))))),
        "model.upcast_non_quantized": bool(u[6] < 0.5),
        "trainer.group_by_length": bool(u[7] < 0.5),
        "trainer.gradient_accumulation_steps": int(1 + min(math.floor(u[8] * 4), 3)),
    }


def _key(s: dict[str, Any]) -> str:
    return json.dumps(s, sort_keys=True)


def overrides(s: dict[str, Any]) -> list[str]:
    from src.config import override_value

    return [f"{k}={override_value(v)}" for k, v in s.items()]


def setting_of(s: dict[str, Any]) -> Any:
    from src.config import compose
    from src.fit.model import Setting

    return Setting.from_config(compose([*BASE, *overrides(s)]))


def lengths() -> np.ndarray | None:
    from src.config import compose
    from src.fit.calibration import Lengths

    return Lengths().of(compose(BASE))


def design() -> None:
    """The Sobol calibration design and the random held-out set, with what the current model predicts for each."""
    from scipy.stats import qmc

    from src.fit.model import MemoryModel, peak_batch

    old = MemoryModel.load(OLD_MODEL)
    lens = lengths()

    def predicted(s: dict[str, Any]) -> float:
        st = setting_of(s)
        return old.predict(st, peak_batch(lens, st)).device_gib

    sobol = qmc.Sobol(d=9, scramble=True, seed=29).random(128)
    calibration, seen = [], set()
    for u in sobol:  # the first N_CALIBRATION Sobol points that the sweep would launch
        s = setting_from_unit(u)
        if _key(s) in seen or predicted(s) > CERTAIN_OOM * BUDGET:
            continue
        seen.add(_key(s))
        calibration.append(s)
        if len(calibration) == N_CALIBRATION:
            break
    rng = np.random.default_rng(20261204)
    held, not_launched = [], []
    while len(held) < N_HELD_OUT:
        s = setting_from_unit(rng.random(9))
        if _key(s) in seen:
            continue
        seen.add(_key(s))
        (not_launched if predicted(s) > CERTAIN_OOM * BUDGET else held).append(s)
    out = {
        "design": "calibration: the first points of a scrambled Sobol sequence (scipy.stats.qmc.Sobol, d=9, seed 29) "
        "mapped onto the space, keeping those the sweep would launch; held-out: uniform random draws "
        "(numpy default_rng(20261204)) from the same space, none equal to a calibration point",
        "space": setting_from_unit.__doc__,
        "certain_oom_rule": f"not launched when the previous model ({OLD_MODEL.name}) predicts > {CERTAIN_OOM}x "
        f"the {BUDGET:g} GiB card",
        "calibration": calibration,
        "held_out": held,
        "held_out_not_launched": not_launched,
        "command": "python -m benchmarks.memory_random_h200 design",
    }
    DESIGN.write_text(json.dumps(out, indent=1))
    print(f"{DESIGN}: {len(calibration)} calibration, {len(held)} held-out, {len(not_launched)} not launched")


# ---- run (on the GPU) --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    from src.handoff import STARTED_ENV
    from src.sweep import launcher

    root = Path(os.environ.get("QLORA_ROOT", "/tmp/qlora"))
    out = Path(os.environ.get("OUT") or root)
    d = json.loads(DESIGN.read_text())
    todo = [("calibration", i, s) for i, s in enumerate(d["calibration"])]
    todo += [("held_out", i, s) for i, s in enumerate(d["held_out"])]
    # interleaved, so a run cut short still holds both sets
    todo.sort(key=lambda t: (t[1] / (N_CALIBRATION if t[0] == "calibration" else N_HELD_OUT), t[0]))
    t0 = time.time()
    build = _sh([sys.executable, "-m", "src.models", *BASE], root / "build.log")
    print(f"model built: rc={build} in {time.time() - t0:.0f}s", flush=True)
    # MLflow's SQLite store made once before the trials: five trials creating it at once race on its schema
    # migration (the first 8 trials of the committed run died so, "duplicate column name: step")
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db").search_experiments()
    ctx = launcher.forkserver(list(launcher.DEFAULT_PRELOAD))
    rows: list[dict[str, Any]] = []

    def one(item: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
        role, i, s = item
        run_dir = root / "trials" / f"{role}{i}"
        argv = [
            *BASE, f"hardware.vram_budget_gib={BUDGET:g}", "preflight.max_truncated_answer_frac=1.0",
            *PROBE, *overrides(s),
            f"hydra.run.dir={run_dir}",
        ]  # fmt: skip
        start = time.time()
        log, env = root / f"{role}{i}.log", {STARTED_ENV: repr(start)}
        if ctx is None:  # no safe warm interpreter here: a fresh one
            with open(log, "w") as f:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "src.train", *argv],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env},
                    start_new_session=True,
                )
        else:
            proc = launcher.start(ctx, argv, log, log, env)
        try:
            rc = proc.wait(args.trial_timeout_s)
        except subprocess.TimeoutExpired:  # a hang: killed, recorded
            os.killpg(proc.pid, 9)
            proc.wait(60)
            rc = 124
        result_file = run_dir / "result.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        m = result.get("metrics", {})
        failure = result.get("failure") or {}
        row = {
            "role": role,
            "index": i,
            "setting": s,
            "status": result.get("status", "missing"),
            "failure_kind": failure.get("kind") if isinstance(failure, dict) else None,
            "failure_step": failure.get("step") if isinstance(failure, dict) else None,
            "exit_code": rc,
            "wall_s": time.time() - start,
            **{k: m.get(k) for k in KEEP},
        }
        print(
            f"{role}{i}: {row['status']} {row['failure_kind'] or ''} {row['peak_vram_reserved_gib']} GiB "
            f"{row['wall_s']:.0f}s",
            flush=True,
        )
        return row

    with ThreadPoolExecutor(args.slots) as pool:
        for row in pool.map(one, todo):
            rows.append(row)
            (out / f"memory_random_raw{args.tag}.json").write_text(json.dumps(_raw(rows, t0, args), indent=1))
    print(f"done: {len(rows)} trials in {(time.time() - t0) / 60:.1f} min", flush=True)


KEEP = (
    "peak_vram_reserved_gib",
    "peak_vram_allocated_gib",
    "peak_vram_device_gib",
    "cuda_context_gib",
    "allocator_cap_gib",
    "tokens_per_s",
    "truncated_answer_frac",
)


def _raw(rows: list[dict[str, Any]], t0: float, args: argparse.Namespace) -> dict[str, Any]:
    from src.tracking import versions

    return {
        "command": "WAIT=570 bash benchmarks/memory_random_h200.sh " + " ".join(sys.argv[2:]),
        "slots": args.slots,
        "probe": PROBE,
        "budget_gib": BUDGET,
        # the caching allocator's settings the trials ran under (expandable_segments changes fragmentation)
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "versions": versions(),
        "gpu": _gpu(),
        "wall_min": (time.time() - t0) / 60,
        "rows": rows,
    }


def _gpu() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return "?"


def _sh(cmd: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


# ---- summarize (here, on the CPU) -------------------------------------------------------------------------------


def summarize(raw_file: Path, tag: str = "") -> None:
    """Fit the model on the measured calibration points; judge it, the grid-calibrated model and the two outside
    tools on the held-out settings. `tag`: the run's (its files are memory_model_random<tag>_h200.json and
    memory_model_random<tag>_calibration_h200.json)."""
    outfile = RESULTS / f"memory_model_random{tag}_h200.json"
    model_file = RESULTS / f"memory_model_random{tag}_calibration_h200.json"
    from benchmarks.memory_h200 import comparisons
    from src.fit.model import MemoryModel, Point, fit, peak_batch

    raw = json.loads(raw_file.read_text())
    lens = lengths()
    rows = []
    for r in raw["rows"]:
        s = setting_of(r["setting"])
        rows.append((r, s, peak_batch(lens, s)))
    points = [
        Point(s, b, r["peak_vram_reserved_gib"], r["cuda_context_gib"], f"calibration{r['index']}")
        for r, s, b in rows
        if r["role"] == "calibration" and r["status"] == "ok"
    ]
    stack = {f"version.{k}": v for k, v in raw["versions"].items()} | {"gpu.name": raw["gpu"]}
    model = fit(points, stack)
    # the same cross-validation on the space-filling design, each direction apart: what a setting the fit did not
    # see can expect (under: the model said less than the card used)
    under, over = [], []
    for k, p in enumerate(points):
        held = fit(points[:k] + points[k + 1 :])
        e = held.predict(p.setting, p.batch).reserved_gib / p.reserved_gib - 1
        (under if e < 0 else over).append(abs(e))
    out_model = model.to_dict() | {
        "error_under": max(under, default=0.0),
        "error_over": max(over, default=0.0),
        "calibrated_on": [r["setting"] for r, _, _ in rows if r["role"] == "calibration" and r["status"] == "ok"],
        "command": f"python -m benchmarks.memory_random_h200 summarize {raw_file}",
    }
    model_file.write_text(json.dumps(out_model, indent=2))
    old = MemoryModel.load(OLD_MODEL)
    settings, judged = [], {"new": [], "old": [], "fitcheck_llm": [], "accelerate_estimate_memory": []}
    fit_but_oom = []
    for r, s, b in rows:
        pred, pred_old = model.predict(s, b), old.predict(s, b)
        measured = r["peak_vram_reserved_gib"] if r["status"] == "ok" else None
        row = {
            "role": r["role"],
            "setting": r["setting"],
            "status": r["status"],
            "failure_kind": r["failure_kind"],
            "measured_peak_vram_reserved_gib": measured,
            "measured_peak_vram_allocated_gib": r.get("peak_vram_allocated_gib") if measured else None,
            "predicted_peak_vram_reserved_gib": pred.reserved_gib,
            "predicted_peak_vram_device_gib": pred.device_gib,
            "predicted_terms_gib": pred.terms,
            "error_pct": 100 * (pred.reserved_gib / measured - 1) if measured else None,
            "grid_model_error_pct": 100 * (pred_old.reserved_gib / measured - 1) if measured else None,
            **(comparisons(s, pred.reserved_gib) if r["role"] == "held_out" and measured else {}),
        }
        settings.append(row)
        if r["role"] != "held_out":
            continue
        if measured:
            judged["new"].append(row["error_pct"])
            judged["old"].append(row["grid_model_error_pct"])
            for tool in ("fitcheck_llm", "accelerate_estimate_memory"):
                if row.get(f"{tool}_gib"):
                    judged[tool].append(100 * (row[f"{tool}_gib"] / measured - 1))
        elif r["failure_kind"] == "oom" and pred.device_gib <= 0.9 * BUDGET:
            fit_but_oom.append(r["setting"])

    def stats(errors: list[float]) -> dict[str, float | None]:
        e = np.asarray(errors)
        if not len(e):
            return {"mean_abs_error_pct": None, "max_abs_error_pct": None, "max_under_prediction_pct": None}
        return {
            "mean_abs_error_pct": float(np.mean(np.abs(e))),
            "max_abs_error_pct": float(np.max(np.abs(e))),
            "max_under_prediction_pct": float(max(0.0, -e.min())),
        }

    summary = {
        "design": json.loads(DESIGN.read_text())["design"],
        "calibration_points": len(points),
        "held_out": len(judged["new"]),
        **stats(judged["new"]),
        "model_own_error_pct": 100 * out_model["error_under"],
        "model_own_error_over_pct": 100 * out_model["error_over"],
        "model_own_error_rule": "the largest leave-one-out under-prediction over the space-filling calibration "
        "design (over-predictions apart)",
        "predicted_fit_but_oom": len(fit_but_oom),
        "predicted_fit_but_oom_settings": fit_but_oom,
        "predicted_fit_but_oom_rule": "OOM'd although predicted with >= 10% margin (device <= 90% of the card)",
        "held_out_oom": sum(1 for r, _, _ in rows if r["role"] == "held_out" and r["failure_kind"] == "oom"),
        "not_measured": [
            {"role": r["role"], "setting": r["setting"], "why": "the trial died creating MLflow's store (a race)"}
            for r, _, _ in rows
            if r["status"] == "missing"
        ],
        "grid_model": {"file": OLD_MODEL.name, **stats(judged["old"])},
        "fitcheck_llm": stats(judged["fitcheck_llm"]),
        "accelerate_estimate_memory": stats(judged["accelerate_estimate_memory"]),
    }
    out = {
        "gpu": raw["gpu"],
        "versions": raw["versions"],
        "budget_gib": BUDGET,
        "probe": raw["probe"],
        "slots": raw["slots"],
        "wall_min": raw["wall_min"],
        "commands": [
            "python -m benchmarks.memory_random_h200 design",
            "WAIT=570 bash benchmarks/memory_random_h200.sh --slots 5   (device, carry .whl)",
            f"python -m benchmarks.memory_random_h200 summarize {raw_file}" + (f" --tag {tag}" if tag else ""),
        ],
        "model_file": model_file.name,
        "pytorch_cuda_alloc_conf": raw.get("pytorch_cuda_alloc_conf"),
        "summary": summary,
        "settings": settings,
    }
    outfile.write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("design")
    r = sub.add_parser("run")
    r.add_argument("--slots", type=int, default=5)
    r.add_argument("--trial-timeout-s", type=float, default=240)
    r.add_argument("--tag", default="", help="suffix of the raw file's name (memory_random_raw<tag>.json)")
    s = sub.add_parser("summarize")
    s.add_argument("raw", type=Path)
    s.add_argument("--tag", default="", help="the run's tag (_expandable): its own result files")
    args = p.parse_args()
    if args.what == "design":
        design()
    elif args.what == "run":
        run(args)
    else:
        summarize(args.raw, args.tag)


if __name__ == "__main__":
    main()
