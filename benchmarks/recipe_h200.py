"""The user's own recipe on the H200 standing in for a 24 GiB card: where it sits on the map, what to change, and the
speeds the README quotes, each measured alone on the card against that recipe.

    python -m benchmarks.recipe_h200 run [--slots 4] [--trials 16] [--repeats 3] [--deadline-s 1080]   # on the GPU
    python -m benchmarks.recipe_h200 summarize STORES.tgz SPEED.json                                   # here, after

`run`, in one process on the GPU machine:
1. the default sweep (`python -m src.train -m hydra/sweeper=optuna`: the seed's four knobs over the user's exact
   recipe, trial 0 the recipe itself) of `llama3_8b_synthetic` on `data=clinical_notes`, each trial capped at 24 GiB,
   `--slots` trials sharing the card (memory is each process's own; speeds there only rank settings), with the memory
   levers the sweep measures when the recipe does not fit; the study and the MLflow store are packed for `summarize`;
2. each SOLO setting alone on the card, `--repeats` times, round-robin (so drift hits each alike), >= 20 measured
   steps each, forked from a warm interpreter as the sweep's trials are; results/recipe_speed_h200.json.
`summarize` reads the packed stores with the project's own report (src.report, src.study): the report's files go to
results/recipe_map_h200/, the per-setting figures and the "What to change" sentences to results/recipe_map_h200.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.map_h200 import run_trial, sh
from benchmarks.speed_v6_h200 import BEST  # the map v5's best, the setting speed v6 puts beside the peers
from src.sweep import launcher
from src.tracking import system_tags

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODEL = ["model=llama3_8b_synthetic", "data=clinical_notes", "hardware.vram_budget_gib=24"]
# The long notes cut some answers at 1024 tokens: measured and said, not refused (a sweep records the share itself).
SOLO_BASE = [*MODEL, "preflight.max_truncated_answer_frac=1.0", "trainer.max_steps=22", "measure.warmup_steps=2"]
COMPILED = ["trainer.max_steps=24", "measure.warmup_steps=4"]  # compiles in its first steps: measure later ones
# name -> (overrides over the user's recipe, whether it is the user's recipe, repeats: None = --repeats)
SOLO: dict[str, tuple[list[str], bool, int | None]] = {
    "recipe_1024": ([], True, 1),  # expected to OOM at step 1: once is enough to show it
    "recipe_768": (["data.max_seq_length=768"], True, None),
    "recipe_bf16_rest_1024": (["model.upcast_non_quantized=false"], True, None),
    "recipe_checkpointing_1024": (["trainer.gradient_checkpointing=true"], True, None),
    "checkpointed_sdpa_1024": (["experiment=checkpointed_sdpa"], False, None),  # the benchmarks' former "seed"
    # the map v5's best: a different optimisation (packing: 16k tokens per micro-batch, not one padded row)
    "packed_4096x4_varlen_compiled": ([*BEST, *COMPILED], False, None),
}
FIELDS = (
    "tokens_per_s",
    "samples_per_s",
    "tokens_per_optimizer_step",
    "step_time_s",
    "peak_vram_reserved_gib",
    "peak_vram_allocated_gib",
    "peak_vram_device_gib",
    "model_tflops_per_s",
    "measured_steps",
    "truncated_answer_frac",
    "startup_s",
)


def run(args: argparse.Namespace) -> int:
    start = time.time()
    root = Path(os.environ.get("QLORA_ROOT", "/tmp/qlora"))
    logs = root / "recipe_logs"
    logs.mkdir(parents=True, exist_ok=True)
    out: dict = {"gpu": system_tags(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    study = f"recipe-map-{time.strftime('%Y%m%d-%H%M%S')}"
    command = [sys.executable, "-m", "src.train", "-m", "hydra/sweeper=optuna", *MODEL]
    command += [f"hydra.sweeper.study_name={study}", f"hydra.sweeper.n_trials={args.trials}"]
    command += [f"hydra.sweeper.slots_per_gpu={args.slots}", "hydra.sweeper.preload=true"]
    command += ["hydra.sweeper.launch_blocking_rerun=false", "hydra.sweeper.progress=false"]
    rc, seconds = sh(command, logs / "map.log", timeout=args.map_timeout_s)
    out["map"] = {"study": study, "command": " ".join(command[1:]), "exit_code": rc, "seconds": seconds}
    with tarfile.open(RESULTS / "recipe_map_h200_stores.tgz", "w:gz") as tar:
        tar.add(root / "sweeps" / study / "optuna.db", arcname="optuna.db")
        tar.add(root / "mlruns" / "mlflow.db", arcname="mlflow.db")
    print(f"map: exit {rc} in {seconds:.0f}s", flush=True)

    ctx = launcher.forkserver(list(launcher.DEFAULT_PRELOAD))
    runs = out["solo_runs"] = []
    for repeat in range(args.repeats):
        for name, (extra, _, repeats) in SOLO.items():
            if repeat >= (repeats or args.repeats):
                continue
            if time.time() - start > args.deadline_s:
                print(f"deadline: {name} repeat {repeat} not run", flush=True)
                continue
            runs.append(solo(name, extra, repeat, root, ctx, args.solo_timeout_s))
            r = runs[-1]
            print(f"{name}#{repeat}: {r['status']} {r.get('tokens_per_s', 0):.0f} tok/s", flush=True)
            (RESULTS / "recipe_speed_h200.json").write_text(json.dumps(out, indent=2))  # after every run
    out["solo_command"] = "python -m src.train " + " ".join(SOLO_BASE) + " <setting's overrides>"
    out["seconds"] = time.time() - start
    (RESULTS / "recipe_speed_h200.json").write_text(json.dumps(out, indent=2))
    return 0


def solo(name: str, extra: list[str], repeat: int, root: Path, ctx: object, timeout_s: float) -> dict:
    run_dir = root / "recipe_solo" / f"{name}-{repeat}"
    argv = [*SOLO_BASE, *extra, f"hydra.run.dir={run_dir}"]
    rc, seconds = run_trial(argv, root / "recipe_logs" / f"{name}-{repeat}.log", timeout_s, ctx)
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {"status": "failed", "metrics": {}}
    m = result.get("metrics", {})
    return {
        "setting": name,
        "repeat": repeat,
        "overrides": extra,
        "status": result.get("status"),
        "failure": result.get("failure"),
        "exit_code": rc,
        "wall_s": seconds,
        "attention_kernel": result.get("attention_kernel"),
        **{k: m[k] for k in FIELDS if k in m},
    }


def speed_table(speed: dict) -> dict:
    """Per setting: runs, median and range of tokens/s and peak, and the ratios against the user's recipe at the
    largest length that fits (recipe_768) and against its bf16-weights variant at 1024, median over runs."""
    by: dict[str, list[dict]] = {}
    for r in speed["solo_runs"]:
        by.setdefault(r["setting"], []).append(r)
    table = {}
    for name, runs in by.items():
        ok = [r for r in runs if r["status"] == "ok" and "tokens_per_s" in r]
        entry = {"runs": len(runs), "ok": len(ok), "same_recipe": SOLO[name][1], "overrides": SOLO[name][0]}
        entry["failures"] = sorted({(r.get("failure") or {}).get("kind", "?") for r in runs if r not in ok})
        if ok:
            for key in ("tokens_per_s", "peak_vram_reserved_gib", "tokens_per_optimizer_step", "samples_per_s"):
                values = [r[key] for r in ok if key in r]
                if values:
                    entry[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        table[name] = entry
    for base in ("recipe_768", "recipe_bf16_rest_1024"):
        ref = table.get(base, {}).get("tokens_per_s")
        for entry in table.values():
            if ref and "tokens_per_s" in entry:
                entry[f"x_{base}"] = entry["tokens_per_s"]["median"] / ref["median"]
    return table


def summarize(args: argparse.Namespace) -> int:
    from src import report as reporting
    from src.report.advice import what_to_change
    from src.study import load

    speed = json.loads(Path(args.speed).read_text())
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.stores) as tar:
        tar.extractall(work, filter="data")
    storage, uri = f"sqlite:///{work / 'optuna.db'}", f"sqlite:///{work / 'mlflow.db'}"
    sweep = load(speed["map"]["study"], work, storage, None, uri)
    sweep.study_dir = RESULTS / "recipe_map_h200"
    written = reporting.write(sweep)
    rows = [
        {
            "trial": r.number,
            "params": r.params,
            "lever": r.lever,
            "recipe": r.recipe,
            "class": r.verdict,
            "detail": r.detail,
            "failure_kind": r.failure_kind,
            **{k: r.metrics[k] for k in (*FIELDS, "truncated_row_frac", "oom_request_gib") if k in r.metrics},
        }
        for r in sweep.rows
    ]
    out = {
        "gpu": speed["gpu"],
        "command": speed["map"]["command"],
        "map_seconds": speed["map"]["seconds"],
        "budget_gib": sweep.budget,
        "card_shared_by": sweep.card_shared_by(),
        "configs_throughput_note": "tokens/s in `trials` were read with trials sharing the card: a ranking only; "
        "solo speeds are in recipe_speed_h200.json and `speed`",
        "max_truncated_answer_frac": sweep.max_truncated_answer_frac,
        "what_to_change": what_to_change(sweep),
        "report": [str(p.relative_to(ROOT)) for p in written.files],
        "trials": rows,
        "speed": speed_table(speed),
        "speed_command": speed.get("solo_command"),
    }
    (RESULTS / "recipe_map_h200.json").write_text(json.dumps(out, indent=2))
    print("\n".join(out["what_to_change"]))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recipe_h200")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--slots", type=int, default=4)
    r.add_argument("--trials", type=int, default=16)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--deadline-s", type=float, default=1080)
    r.add_argument("--map-timeout-s", type=float, default=420)
    r.add_argument("--solo-timeout-s", type=float, default=150)
    s = sub.add_parser("summarize")
    s.add_argument("stores")
    s.add_argument("speed")
    s.add_argument("--workdir", default="/tmp/recipe_map_h200")
    args = p.parse_args()
    return run(args) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
