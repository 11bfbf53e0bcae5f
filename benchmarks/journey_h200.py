"""Issue 28's evidence: the default command on the lent H200 at the 24 GiB cap, from a failing recipe to a soaked,
promoted setting and a production trial, with nothing added by hand.

    device run (carry .whl, see gpu_wheels.sh):
      MODULE=benchmarks.journey_h200 COPY=/tmp/journey COLLECT="journey_h200.json journey_report.md" \
        LOGS=sweeps WAIT=570 bash benchmarks/memory_h200.sh          (then `... collect` until done)
    here, after: copy journey_h200.json to benchmarks/results/, journey_report.md to
      benchmarks/results/journey_h200/report.md

Steps, each a plain command a user would type: the sweep (`COMMAND`), `python -m src.promote` (no flags), `python
-m src.train experiment=production` (its training bounded by PRODUCTION_STEPS: the file records it), `python -m
src.report`. What each step printed and measured goes into journey_h200.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

COMMAND = [
    "-m",
    "hydra/sweeper=optuna",
    "model=llama3_8b_synthetic",
    "data=clinical_notes",
    "hydra.sweeper.n_trials=6",
    "hydra.sweeper.slots_per_gpu=4",
]
STUDY = "llama3_8b_synthetic-24gib"  # the default study name: ${model.name}-${hardware.vram_budget_gib}gib
# The production trial trains the promoted file as written; its epochs over clinical_notes would take hours, so
# this run bounds its steps (recorded), enough for its peak (the longest batches come by then: group_by_length).
PRODUCTION_STEPS = 60


def step(name: str, argv: list[str], out: Path) -> tuple[int, float, str]:
    started = time.time()
    with (out / f"journey_{name}.log").open("w") as log:
        done = subprocess.run(
            [sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT, check=False, env=os.environ
        )
    text = (out / f"journey_{name}.log").read_text(errors="replace")
    print(f"{name}: exit {done.returncode} in {time.time() - started:.0f} s", flush=True)
    return done.returncode, time.time() - started, text


def main() -> None:
    root = Path(os.environ["QLORA_ROOT"])
    out = Path(os.environ.get("OUT") or root)
    out.mkdir(parents=True, exist_ok=True)
    rc, sweep_s, sweep_log = step("sweep", ["src.train", *COMMAND], out)
    prc, _, promote_log = step("promote", ["src.promote"], out)
    production: dict = {"command": f"python -m src.train experiment=production trainer.max_steps={PRODUCTION_STEPS}"}
    if prc == 0:
        qrc, q_s, q_log = step(
            "production", ["src.train", "experiment=production", f"trainer.max_steps={PRODUCTION_STEPS}"], out
        )
        production.update(exit_code=qrc, seconds=q_s, tail=q_log.splitlines()[-4:])
        result = sorted((root / "sweeps" / "single").glob("*/result.json"))
        if result:
            r = json.loads(result[-1].read_text())
            production.update(
                status=r.get("status"),
                peak_vram_reserved_gib=r.get("metrics", {}).get("peak_vram_reserved_gib"),
                tokens_per_s=r.get("metrics", {}).get("tokens_per_s"),
                failure=r.get("failure"),
            )
    step("report", ["src.report", STUDY], out)
    report = root / "sweeps" / STUDY / "report.md"
    if report.exists():
        (out / "journey_report.md").write_text(report.read_text())
    sys.path.insert(0, str(Path.cwd()))
    from src.study import load

    sweep = load(STUDY, root / "sweeps", tracking_uri=f"sqlite:///{root}/mlruns/mlflow.db")
    recipe, best = sweep.recipe_row(), sweep.recommended()
    soak = sweep.soaks.get(best.number, {}) if best else {}
    experiment = Path("conf/experiment/production.yaml")
    summary = {
        "command": "python -m src.train " + " ".join(COMMAND),
        "sweep_exit_code": rc,
        "gpu_minutes": (sweep_s + production.get("seconds", 0.0)) / 60,  # the card's wall time: sweep + production
        "sweep_minutes": sweep_s / 60,
        "max_truncated_answer_frac": sweep.max_truncated_answer_frac,
        "recipe": None
        if recipe is None
        else {"trial": recipe.number, "class": recipe.verdict, "detail": recipe.detail, "metrics": recipe.metrics},
        "search": sweep.recommendation,
        "recommended": None
        if best is None
        else {
            "trial": best.number,
            "overrides": [f"{k}={v}" for k, v in best.params.items()] + best.lever,
            "recommendation_trial": best.recommended,
            "peak_vram_reserved_gib": best.metrics.get("peak_vram_reserved_gib"),
            "tokens_per_s": best.metrics.get("tokens_per_s"),
            "truncated_answer_frac": best.metrics.get("truncated_answer_frac"),
        },
        "soak": {
            k: soak.get(k) for k in ("status", "steps", "minutes", "peak_vram_reserved_gib", "peak_vs_map", "detail")
        },
        "promoted": prc == 0,
        "model_version": next(
            (
                line.split(" version ", 1)[1].split(";")[0].strip()
                for line in promote_log.splitlines()
                if line.startswith("promoted trial") and " version " in line
            ),
            None,
        ),  # fmt: skip
        "promote_output": promote_log.splitlines()[-3:],
        "production_file": experiment.read_text() if experiment.exists() else None,
        "production_trial": production,
        "trials": [
            {
                "trial": r.number,
                "class": r.verdict,
                "detail": r.detail,
                "params": r.params,
                "lever": r.lever,
                "recommended": r.recommended,
                "peak_vram_reserved_gib": r.metrics.get("peak_vram_reserved_gib"),
                "tokens_per_s": r.metrics.get("tokens_per_s"),
                "truncated_answer_frac": r.metrics.get("truncated_answer_frac"),
            }
            for r in sweep.rows
        ],  # fmt: skip
        "sweep_output_tail": sweep_log.splitlines()[-25:],
        "gpu": subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip(),
    }
    (out / "journey_h200.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps({k: summary[k] for k in ("recommended", "soak", "promoted")}, default=str))


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"]:
        main()
    else:
        print(__doc__)
