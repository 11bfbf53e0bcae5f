"""A cheaper speed map (issue 31): `sweep=speed_map_quick` on the GPU, judged verdict by verdict against the full map.

    device (carry .whl):  WAIT=560 bash benchmarks/map_quick_h200.sh [--slots N] [--sweep speed_map_verdict]
                          then at once: ... collect
    here, after:          python -m benchmarks.map_quick_h200 summarize <files_at>/map_quick_raw.json

`run` (the GPU machine) builds the synthetic 8B in a process of its own first (the map's first trials must not
count it), then runs the 96-setting map through the sweep engine as a user would: `sweep=speed_map_quick` (two
optimizer steps of one micro-batch a trial instead of three of two), the memory model fitted on the random design
skipping predicted OOMs, no soak, no search (`--sweep speed_map_verdict`: one step a trial, the
verdict's; its summary goes to speed_map_verdict_h200.json); it writes the map's trials as `benchmarks.summarize` reads them, and
the map command's wall.

`summarize` (here) gives each setting a verdict, `stable` (trained, peak reserved within the budget less the
headroom margin, 10%), `marginal` (trained, inside the margin), `oom` (failed as an OOM, or not launched as a
certain or predicted one) or `failed:<kind>`, the same rule for both maps, and sets them against the full map's
(`results/map_llama3_8b_24gib.json`: `sweep=speed_map`, 3 steps of accumulation 2, every setting launched but the
certain OOMs, on the H200 at the same 24 GiB cap and stack). It writes `results/speed_map_quick_h200.json` and
fills speed v6's map keys (`results/speed_v6_h200.json`'s summary, naming this file as their source).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
FULL_MAP = RESULTS / "map_llama3_8b_24gib.json"
MODEL_FILE = RESULTS / "memory_model_random_calibration_h200.json"
SPEED_V6 = RESULTS / "speed_v6_h200.json"
OUT_FILE = RESULTS / "speed_map_quick_h200.json"
BUDGET = 24
MARGIN = 0.10  # hydra.sweeper.headroom_margin's default: a trained setting inside it is marginal
BASE = ["model=llama3_8b_synthetic", "data=clinical_notes", "model.upcast_non_quantized=false"]  # as the full map
TARGETS = {"map_gpu_minutes": 3.0, "map_verdict_agreement": 0.98, "fixed_cost_s": 5.0}


def run(args: argparse.Namespace) -> None:
    from benchmarks.map_h200 import map_trials, sh
    from src.tracking import system_tags

    root = Path(os.environ.get("QLORA_ROOT", "/tmp/qlora"))
    out = Path(os.environ.get("OUT", root))
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = {"machine": system_tags(), "slots": args.slots, "sweep": args.sweep}
    rc, raw["build_s"] = sh([sys.executable, "-m", "src.models", BASE[0]], logs / "build.log")
    print(f"model built in {raw['build_s']:.0f} s (rc {rc})", flush=True)
    study = f"{args.sweep.replace('_', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [
        sys.executable, "-m", "src.train", "-m", f"sweep={args.sweep}", *BASE,
        f"hardware.vram_budget_gib={BUDGET}", "preflight.max_truncated_answer_frac=1.0",
        f"hydra.sweeper.slots_per_gpu={args.slots}", "hydra.sweeper.launch_blocking_rerun=false",
        f"hydra.sweeper.study_name={study}", "hydra.sweeper.progress=false",
        f"hydra.sweeper.memory_model={MODEL_FILE}",
        "hydra.sweeper.soak_top_k=0", "hydra.sweeper.recommend_trials=0",
    ]  # fmt: skip
    raw["map_command"] = "python -m src.train " + " ".join(cmd[3:])
    print(raw["map_command"], flush=True)
    raw["map_exit_code"], raw["map_wall_s"] = sh(cmd, logs / "map.log", timeout=args.map_timeout_s)
    raw["trials"] = map_trials(f"sqlite:///{root / 'sweeps' / study / 'optuna.db'}", study)
    log_text = (logs / "map.log").read_text(errors="replace") if (logs / "map.log").exists() else ""
    raw["rerun_alone"] = log_text.count("running it again alone")  # OOMs of the crowded card (src/sweep/ledger.py)
    raw["ledger"] = sorted(set(re.findall(r"card \d+: \d+ trials on .*", log_text)))  # how many ran at once
    (out / "map_quick_raw.json").write_text(json.dumps(raw, indent=2, default=str))
    print(f"map: {len(raw['trials'])} settings in {raw['map_wall_s']:.0f} s (rc {raw['map_exit_code']})", flush=True)


def verdict(row: dict[str, Any]) -> str:
    """stable / marginal / oom / failed:<kind>, the same rule for both maps."""
    if row["status"] == "ok":
        headroom = row.get("vram_headroom_frac")
        return "stable" if headroom is not None and headroom >= MARGIN else "marginal"
    if row.get("failure_kind") == "oom" or "oom" in str(row.get("skipped_reason") or ""):
        return "oom"
    return f"{row['status']}:{row.get('failure_kind')}"


def key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def summarize(raw_file: Path) -> dict[str, Any]:
    from scipy.stats import spearmanr

    raw = json.loads(raw_file.read_text())
    full = json.loads(FULL_MAP.read_text())
    reference = {key(r["setting"]): r for r in [*full["configs"], *full["skipped"]]}
    rows, agree = [], 0
    for t in raw["trials"]:
        ref = reference.get(key(t["setting"]))
        row = {
            "setting": t["setting"],
            "verdict": verdict(t),
            "full_map_verdict": verdict(ref) if ref else None,
            "peak_vram_reserved_gib": t.get("peak_vram_reserved_gib"),
            "full_map_peak_vram_reserved_gib": (ref or {}).get("peak_vram_reserved_gib"),
            "tokens_per_s": t.get("tokens_per_s"),
            "full_map_tokens_per_s": (ref or {}).get("tokens_per_s"),
            "skipped_reason": t.get("skipped_reason"),
            "startup_s": t.get("startup_s"),
            "duration_s": t.get("duration_s"),
        }
        agree += row["verdict"] == row["full_map_verdict"]
        rows.append(row)
    launched = [t for t in raw["trials"] if t["status"] in ("ok", "failed")]
    starts = [t["startup_s"] for t in launched if t.get("startup_s") is not None]
    both = [r for r in rows if r["tokens_per_s"] and r["full_map_tokens_per_s"]]
    peaks = [r for r in rows if r["peak_vram_reserved_gib"] and r["full_map_peak_vram_reserved_gib"]]
    span = max(t["ended"] for t in launched) - min(t["started"] for t in launched) if launched else None
    summary = {
        "map_settings": len(rows),
        "map_gpu_minutes": raw["map_wall_s"] / 60,
        "map_gpu_minutes_rule": "the map command's wall on its one card, start to exit (engine start-up, every trial "
        "and skip), as the full map's gpu_minutes counts it",
        "map_trials_span_minutes": span / 60 if span else None,
        "full_map_gpu_minutes": full["gpu_minutes"],
        "map_verdict_agreement": agree / len(rows) if rows else None,
        "same_verdict": agree,
        "disagreements": [
            {
                k: r[k]
                for k in (
                    "setting",
                    "verdict",
                    "full_map_verdict",
                    "peak_vram_reserved_gib",
                    "full_map_peak_vram_reserved_gib",
                )
            }
            for r in rows
            if r["verdict"] != r["full_map_verdict"]
        ],  # fmt: skip
        "launched": len(launched),
        "full_map_launched": full["launched"],
        "skipped": {
            reason: sum(1 for t in raw["trials"] if str(t.get("skipped_reason") or "").startswith(reason))
            for reason in ("certain oom", "predicted")
        },
        "fixed_cost_s": statistics.median(starts) if starts else None,
        "fixed_cost_rule": f"median start-up (the engine's launch of a trial to the start of its first step, forked) "
        f"of the map's launched trials, up to {raw['slots']} trials at once on the card (ledger: how many ran at "
        "once, as the card's memory let them)",
        "slots": raw["slots"],
        "ledger": raw.get("ledger"),  # the engine's own count of trials at once (the card's memory ledger)
        "rerun_alone": raw.get("rerun_alone"),
        "peak_vs_full_map_max_abs_pct": max(
            (abs(r["peak_vram_reserved_gib"] / r["full_map_peak_vram_reserved_gib"] - 1) * 100 for r in peaks),
            default=None,
        ),
        "tokens_per_s_spearman_vs_full_map": float(
            spearmanr([r["tokens_per_s"] for r in both], [r["full_map_tokens_per_s"] for r in both]).statistic
        )
        if len(both) > 2
        else None,  # fmt: skip
        "gpu": raw["machine"].get("gpu.name"),
        "sweep": raw.get("sweep") or "speed_map_quick",
        "full_map_gpu": full["machine"].get("gpu.name"),
        "build_s": raw.get("build_s"),
    }
    summary["targets"] = {
        k: {"target": v, "met": summary[k] is not None and (summary[k] >= v if k.endswith("agreement") else summary[k] <= v)}
        for k, v in TARGETS.items()
    }  # fmt: skip
    result = {
        "command": raw["map_command"],
        "commands": [
            "WAIT=560 bash benchmarks/map_quick_h200.sh --slots N   (device, carry .whl; N trials at most on the card, "
            "each capped at 24 GiB; as many start as the card's memory holds); then at once: WAIT=560 bash "
            "benchmarks/map_quick_h200.sh collect",
            f"python -m benchmarks.map_quick_h200 summarize <files_at>/{raw_file.name}",
        ],
        "reference": str(FULL_MAP.relative_to(RESULTS.parent.parent)),
        "summary": summary,
        "settings": rows,
        "machine": raw["machine"],
    }
    out = out_file(raw)
    result["summary"]["file"] = out.name
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    fill_speed_v6(summary)
    return summary


def out_file(raw: dict[str, Any]) -> Path:
    """speed_map_quick_h200.json for the quick map, <sweep>_h200.json for another sweep of the same space."""
    sweep = raw.get("sweep") or "speed_map_quick"
    return OUT_FILE if sweep == "speed_map_quick" else OUT_FILE.with_name(f"{sweep}_h200.json")


def fill_speed_v6(summary: dict[str, Any]) -> None:
    """speed v6's map keys from this run, naming it (issue 31's done-when reads them there)."""
    from benchmarks.speed_v6_h200 import targets

    if not SPEED_V6.exists():
        return
    v6 = json.loads(SPEED_V6.read_text())
    for k in ("map_settings", "map_gpu_minutes", "map_verdict_agreement", "fixed_cost_s"):
        v6["summary"][k] = summary[k]
    v6["summary"]["map_source"] = (
        f"benchmarks/results/{summary['file']}: sweep={summary['sweep']} on the {summary['gpu']}, "
        f"up to {summary['slots']} trials at once, against the full map on the {summary['full_map_gpu']}"
    )
    v6["summary"].pop("not_measured", None)
    v6["summary"]["targets"] = targets(v6["summary"])
    SPEED_V6.write_text(json.dumps(v6, indent=2, default=str) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="on the GPU machine: build the model, run the quick map")
    r.add_argument(
        "--slots",
        type=int,
        default=6,
        help="trials at most at once on the card (each capped at 24 GiB; "
        "as many start as its memory holds: src/sweep/ledger.py)",
    )
    r.add_argument(
        "--sweep",
        default="speed_map_quick",
        choices=["speed_map_quick", "speed_map_verdict"],
        help="the quick map (2 steps a trial) or the verdict map (1 step: the verdict, a rough speed)",
    )
    r.add_argument("--map-timeout-s", type=float, default=480)
    s = sub.add_parser("summarize", help="here: verdicts against the full map")
    s.add_argument("raw", type=Path)
    args = p.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        print(json.dumps(summarize(args.raw), indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
