"""The memory model judged where it was not fitted (issue "A memory model that holds where it was not fitted").

    python -m benchmarks.memory_random_h200 design             # here: the calibration design and the random held-out set
    WAIT=570 bash benchmarks/memory_random_h200.sh             # on the GPU (carry .whl): every setting of it, measured
    python -m benchmarks.memory_random_h200 summarize RAW.json [RAW_EXPANDABLE.json]   # fit on the design, judge
    # the final, independent judgement: a fresh random set the model never saw, drawn after it was built
    python -m benchmarks.memory_random_h200 design --fresh     # here: memory_model_random_fresh_design.json
    WAIT=570 bash benchmarks/memory_random_h200.sh --design fresh       # on the GPU: memory_random_raw_fresh.json
    python -m benchmarks.memory_random_h200 summarize RAW.json RAW_EXPANDABLE.json --fresh FRESH_RAW.json
    # does the allocator's cache matter for an OOM? the fresh set again, each capped just above its own peak allocated
    WAIT=560 bash benchmarks/memory_random_h200.sh --design pressed     # on the GPU: memory_random_raw_pressed.json
    python -m benchmarks.memory_random_h200 pressed PRESSED_RAW.json    # here: memory_model_pressed_h200.json

The space is every knob the sweeper and the recipe's levers vary: `data.max_seq_length` 256-4096 in steps of 64
(not only powers of two), per-device batch 1-8, gradient checkpointing, eager / SDPA / varlen attention, packing,
LoRA rank 8-64 (log-uniform), the non-quantized weights in fp32 (peft's upcast) or bf16, `group_by_length`,
gradient accumulation 1-4, and (the fresh set) the allocator's expandable segments. The calibration points are a
scrambled Sobol sequence over it (space-filling); the held-out settings are drawn uniformly at random from the same
space with another seed and are never used in the fit. The first runs measured the design twice, once per allocator
(`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` for the second); the model's terms were chosen looking at their
held-out settings, so the final judgement is a fresh set drawn with a third seed, none of it equal to any setting
measured before, each with the allocator of its own draw (`hardware.expandable_segments`). Summarized with
`--fresh`, the model is fitted to everything measured before and judged on the fresh set alone.

Each setting is one fresh trial (`python -m src.train`, forked from a warm interpreter, 5 at a time on one H200,
each capped at 24 GiB) of `llama3_8b_synthetic` on `data=clinical_notes`: 2 optimizer steps, the longest rows in the
probe's sample, peak reserved VRAM from torch's allocator.

A setting the grid-calibrated model puts beyond 1.6x the card (certain OOM even if it overestimated by 37%) is not
launched: the sweep never launches it either (it skips it as a certain OOM). It is listed, not measured, and is not
a held-out point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
SCRIPT = "benchmarks/memory_random_h200.sh"  # what runs `run` on the device (through memory_h200.sh)
DESIGN = RESULTS / "memory_model_random_design.json"
FRESH_DESIGN = RESULTS / "memory_model_random_fresh_design.json"
OLD_MODEL = RESULTS / "memory_model_calibration_h200.json"
BUDGET = 24.0
BASE = ["model=llama3_8b_synthetic", "data=clinical_notes"]
PROBE = ["trainer.max_steps=2", "trainer.warmup_steps=0", "measure.warmup_steps=1"]
ATTENTION = ("eager", "sdpa", "varlen")
CERTAIN_OOM = 1.6  # x the card: not launched (the sweep skips such a setting as a certain OOM)
N_CALIBRATION = 40
N_HELD_OUT = 64  # launched (the sweep would launch them); expect ~1/4 to OOM
N_FRESH = 60  # launched: ~5-6 minutes on the card, within one device call
FRESH_SEED = 20261206  # the Sobol design's was 29, the first held-out set's 20261204
EXPANDABLE = "hardware.expandable_segments"
FRESH_RAW = RESULTS / "memory_model_random_raw_fresh_h100.json"  # the fresh set as measured, at the 24 GiB cap
# The second fresh set: drawn after the decision that the product runs on expandable segments (conf/hardware), every
# setting on them, none equal to any setting measured before; judged by a model fitted to everything measured before.
FRESH2_DESIGN = RESULTS / "memory_model_random_fresh2_design.json"
FRESH2_SEED = 20261207
N_FRESH2 = 64  # launched: ~1/5 OOM at the cap, so >= 40 measured; ~6-7 minutes at 3 trials at once on an H100
# The third: none equal to a setting of the three sets before, measured after the two-phase model (NOTES §17b) was
# committed, judging it fitted to all three sets before
FRESH3_DESIGN = RESULTS / "memory_model_random_fresh3_design.json"
FRESH3_SEED = 20261208
JUDGED_DESIGNS = {"fresh": FRESH_DESIGN, "fresh2": FRESH2_DESIGN, "fresh3": FRESH3_DESIGN}
PRESS = 0.05  # the pressed run's cap: each setting's own peak allocated + 5% (+ its CUDA context)


def setting_from_unit(u: np.ndarray) -> dict[str, Any]:
    """One point of the unit cube as a setting of the space (the same map for the design and the held-out sets; a
    tenth coordinate, the fresh set's, draws the allocator)."""
    found = {
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
    if len(u) > 9:
        found[EXPANDABLE] = bool(u[9] < 0.5)
    return found


def _key(s: dict[str, Any]) -> str:
    """A setting's knobs, the allocator aside: the same setting under either allocator is one setting."""
    return json.dumps({k: v for k, v in s.items() if k != EXPANDABLE}, sort_keys=True)


def overrides(s: dict[str, Any]) -> list[str]:
    from src.config import override_value

    return [f"{k}={override_value(v)}" for k, v in s.items()]


def setting_of(s: dict[str, Any]) -> Any:
    from src.config import compose
    from src.fit.setting import Setting

    return Setting.from_config(compose([*BASE, *overrides(s)]))


def lengths() -> np.ndarray | None:
    from src.config import compose
    from src.fit.calibration import Lengths

    return Lengths().of(compose(BASE))


def certain_oom() -> Callable[[dict[str, Any]], bool]:
    """The rule that keeps a setting out of the trials: the grid-calibrated model puts it beyond CERTAIN_OOM x the
    card (the sweep skips such a setting as a certain OOM)."""
    from src.fit.model import MemoryModel
    from src.fit.setting import peak_batch

    old = MemoryModel.load(OLD_MODEL)
    lens = lengths()

    def beyond(s: dict[str, Any]) -> bool:
        st = setting_of(s)
        pred = old.predict(st, peak_batch(lens, st))
        return pred.reserved_gib + pred.context_gib > CERTAIN_OOM * BUDGET  # its peak reserved, as every design's

    return beyond


def design() -> None:
    """The Sobol calibration design and the random held-out set, with what the current model predicts for each."""
    from scipy.stats import qmc

    beyond = certain_oom()

    sobol = qmc.Sobol(d=9, scramble=True, seed=29).random(128)
    calibration, seen = [], set()
    for u in sobol:  # the first N_CALIBRATION Sobol points that the sweep would launch
        s = setting_from_unit(u)
        if _key(s) in seen or beyond(s):
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
        (not_launched if beyond(s) else held).append(s)
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


def measured_before(*more: Path) -> set[str]:
    """Every setting of the first design (calibration, held-out and not launched) and of the designs `more`, the
    allocator aside."""
    found = set()
    for path in (DESIGN, *more):
        d = json.loads(path.read_text())
        found |= {_key(s) for part in ("calibration", "held_out", "held_out_not_launched") for s in d.get(part, [])}
    return found


def draw_fresh(
    seen: set[str],
    n: int,
    seed: int,
    beyond: Callable[[dict[str, Any]], bool],
    allocator: dict[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(launched, not launched): `n` settings drawn uniformly at random from the space, the allocator included (or
    fixed: `allocator`), none equal to a setting of `seen` (under either allocator) or to one another; those `beyond`
    calls certain OOMs apart."""
    rng = np.random.default_rng(seed)
    seen = set(seen)
    held: list[dict[str, Any]] = []
    not_launched: list[dict[str, Any]] = []
    while len(held) < n:
        s = (
            setting_from_unit(rng.random(10))
            if allocator is None
            else {**setting_from_unit(rng.random(9)), **allocator}
        )
        if _key(s) in seen:
            continue
        seen.add(_key(s))
        (not_launched if beyond(s) else held).append(s)
    return held, not_launched


def design_fresh() -> None:
    """A fresh random set for the final judgement: drawn with a third seed after the model was built, none of it
    measured before."""
    held, not_launched = draw_fresh(measured_before(), N_FRESH, FRESH_SEED, certain_oom())
    out = {
        "design": f"fresh held-out: uniform random draws (numpy default_rng({FRESH_SEED}), 10 coordinates: the "
        "first design's 9 knobs and the allocator) from the same space, none equal to any setting of the first design "
        f"({DESIGN.name}: calibration, held-out or not launched, under either allocator); drawn after the model's "
        "terms were chosen, so no choice of the model saw them",
        "space": setting_from_unit.__doc__,
        "certain_oom_rule": f"not launched when the grid-calibrated model ({OLD_MODEL.name}) predicts > "
        f"{CERTAIN_OOM}x the {BUDGET:g} GiB card",
        "held_out": held,
        "held_out_not_launched": not_launched,
        "command": "python -m benchmarks.memory_random_h200 design --fresh",
    }
    FRESH_DESIGN.write_text(json.dumps(out, indent=1))
    print(f"{FRESH_DESIGN}: {len(held)} fresh held-out, {len(not_launched)} not launched")


def design_fresh2() -> None:
    """The second fresh set: the product's allocator (expandable segments, conf/hardware's default since the pressed
    run), drawn with a fourth seed after that decision and after the model was changed to decide on peak allocated
    there; none of it equal to any setting of the first design or the first fresh set."""
    design_on_expandable(
        "fresh2", FRESH2_SEED, "second", "the model's terms and its decision rule were chosen", FRESH_DESIGN
    )


def design_fresh3() -> None:
    """The third fresh set: as the second, with a fifth seed; none of it equal to any setting of the three sets before.
    Drawn before the model's two-phase layer backward (0.10.2) was chosen, measured only after it was committed."""
    design_on_expandable(
        "fresh3",
        FRESH3_SEED,
        "third",
        "the second set was judged, and measured only after the model's two-phase layer backward (0.10.2) was "
        "committed",
        FRESH_DESIGN,
        FRESH2_DESIGN,
    )


def design_on_expandable(name: str, seed: int, ordinal: str, after: str, *before: Path) -> None:
    """A fresh random set of N_FRESH2 settings on the product's allocator, none equal to a setting of the first design
    or of `before`, written to JUDGED_DESIGNS[name]."""
    held, not_launched = draw_fresh(measured_before(*before), N_FRESH2, seed, certain_oom(), {EXPANDABLE: True})
    names = ", ".join(p.name for p in (DESIGN, *before))
    out = {
        "design": f"{ordinal} fresh held-out: uniform random draws (numpy default_rng({seed}), the first design's "
        "9 knobs) from the same space on the product's allocator (hardware.expandable_segments=true, the default), "
        f"none equal to any setting measured before ({names}: calibration, held-out or not launched, under either "
        f"allocator); drawn after {after}, so no choice of the model saw them",
        "space": setting_from_unit.__doc__,
        "certain_oom_rule": f"not launched when the grid-calibrated model ({OLD_MODEL.name}) predicts a peak reserved "
        f"> {CERTAIN_OOM}x the {BUDGET:g} GiB card",
        "held_out": held,
        "held_out_not_launched": not_launched,
        "command": f"python -m benchmarks.memory_random_h200 design --{name}",
    }
    JUDGED_DESIGNS[name].write_text(json.dumps(out, indent=1))
    print(f"{JUDGED_DESIGNS[name]}: {len(held)} fresh held-out, {len(not_launched)} not launched")


# ---- run (on the GPU) --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    from src.handoff import STARTED_ENV
    from src.sweep import launcher

    root = Path(os.environ.get("QLORA_ROOT", "/tmp/qlora"))
    out = Path(os.environ.get("OUT") or root)
    budgets: dict[int, float] = {}
    if args.design in JUDGED_DESIGNS:  # a judgement's set alone
        held = json.loads(JUDGED_DESIGNS[args.design].read_text())["held_out"][: args.first]  # a prefix: still random
        todo = [(args.design, i, s) for i, s in enumerate(held)]
    elif args.design == "pressed":  # the fresh set's trained settings, each on a card cut to its own allocated peak
        todo, budgets = pressed_design(args.press)
    else:
        d = json.loads(DESIGN.read_text())
        todo = [("calibration", i, s) for i, s in enumerate(d["calibration"])]
        todo += [("held_out", i, s) for i, s in enumerate(d["held_out"])]
        # interleaved, so a run cut short still holds both sets
        todo.sort(key=lambda t: (t[1] / (N_CALIBRATION if t[0] == "calibration" else N_HELD_OUT), t[0]))
    t0 = time.time()
    # The second fresh set's first trial builds the model itself (a fresh machine's empty cache: in a process of its
    # own, src/models.py prepare_apart) and runs again at once, finding it built: the two peaks should be equal
    from src.config import compose
    from src.models import prepared

    base = compose(BASE)
    builds_first = args.design in ("fresh2", "fresh3") and not prepared(
        base.model, base.paths.cache_dir
    )  # the trial's own test
    if not builds_first:
        build = _sh([sys.executable, "-m", "src.models", *BASE], root / "build.log")
        print(f"model built: rc={build} in {time.time() - t0:.0f}s", flush=True)
    # MLflow's SQLite store made once before the trials: five trials creating it at once race on its schema
    # migration (the first 8 trials of the committed run died so, "duplicate column name: step")
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db").search_experiments()
    ctx = launcher.forkserver(list(launcher.DEFAULT_PRELOAD))
    rows: list[dict[str, Any]] = []
    tag = args.tag if args.tag is not None else {"first": ""}.get(args.design, f"_{args.design}")

    def one(item: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
        role, i, s = item
        run_dir = root / "trials" / f"{role}{i}"
        argv = [
            *BASE, f"hardware.vram_budget_gib={budgets.get(i, BUDGET):.3f}", "preflight.max_truncated_answer_frac=1.0",
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
            "budget_gib": budgets.get(i, BUDGET),
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

    check: dict[str, Any] = {}
    if builds_first:  # alone, before the others: they need the model it builds
        rows.append(one(todo[0]))
        log = (root / f"{todo[0][0]}{todo[0][1]}.log").read_text(errors="replace")
        check["first"] = {**rows[0], "built_the_model": "in a process of its own" in log}
        # the same setting again at once, alone on the card as the first was, the model found built
        check["again"] = one((f"{todo[0][0]}_again", todo[0][1], todo[0][2]))
        todo = todo[1:]
    with ThreadPoolExecutor(args.slots) as pool:
        for row in pool.map(one, todo):
            rows.append(row)
            raw = out / f"memory_random_raw{tag}.json"  # whole or not at all: a call cut short may kill it here
            raw.with_suffix(".partial").write_text(json.dumps(_raw(rows, t0, args, check), indent=1))
            os.replace(raw.with_suffix(".partial"), raw)
    print(f"done: {len(rows)} trials in {(time.time() - t0) / 60:.1f} min", flush=True)


KEEP = (
    "peak_vram_reserved_gib",
    "peak_vram_allocated_gib",
    "peak_vram_device_gib",
    "cuda_context_gib",
    "allocator_cap_gib",
    "tokens_per_s",
    "truncated_answer_frac",
    "alloc_retries",  # cudaMalloc failed (or the cap was reached) and the allocator freed its cache to retry
    "alloc_ooms",
)


def pressed_design(press: float) -> tuple[list[tuple[str, int, dict[str, Any]]], dict[int, float]]:
    """The fresh set's settings that trained at the 24 GiB cap, each with a card of its own measured peak allocated
    x (1 + press) plus its CUDA context: what the caching allocator held beyond that (0.1-3.4 GiB on these) it must
    give back (free its cached blocks and retry) or the trial OOMs."""
    todo, budgets = [], {}
    for r in json.loads(FRESH_RAW.read_text())["rows"]:
        if r["status"] != "ok" or not r.get("peak_vram_allocated_gib"):
            continue
        budgets[r["index"]] = r["peak_vram_allocated_gib"] * (1 + press) + r["cuda_context_gib"]
        todo.append(("pressed", r["index"], r["setting"]))
    return todo, budgets


def pressed(raw_file: Path) -> None:
    """What the pressed run showed against the same settings at the 24 GiB cap: how many trained on a card cut to
    their peak allocated + PRESS, how often the allocator gave its cache back (alloc_retries), at what speed, and the
    cache each held unpressed."""
    raw = json.loads(raw_file.read_text())
    before = {r["index"]: r for r in json.loads(FRESH_RAW.read_text())["rows"]}
    rows = []
    for r in raw["rows"]:
        b = before[r["index"]]
        cache = b["peak_vram_reserved_gib"] - b["peak_vram_allocated_gib"]
        rows.append(
            {
                "setting": r["setting"],
                "budget_gib": r["budget_gib"],
                "status": r["status"],
                "failure_kind": r["failure_kind"],
                "unpressed_reserved_gib": b["peak_vram_reserved_gib"],
                "unpressed_allocated_gib": b["peak_vram_allocated_gib"],
                "unpressed_cache_gib": cache,
                "pressed_reserved_gib": r.get("peak_vram_reserved_gib"),
                "pressed_allocated_gib": r.get("peak_vram_allocated_gib"),
                "alloc_retries": r.get("alloc_retries"),
                "speed_vs_unpressed": r["tokens_per_s"] / b["tokens_per_s"]
                if r.get("tokens_per_s") and b.get("tokens_per_s")
                else None,
            }
        )
    ok = [x for x in rows if x["status"] == "ok"]
    press = raw.get("press") or PRESS
    big = [x for x in rows if x["unpressed_cache_gib"] > press * x["unpressed_allocated_gib"]]
    speeds = [x["speed_vs_unpressed"] for x in ok if x["speed_vs_unpressed"]]
    summary = {
        "rule": f"each setting of the fresh set that trained at the {BUDGET:g} GiB cap, run again on a card of its own "
        f"peak allocated x {1 + press:g} + its CUDA context (hardware.vram_budget_gib): what its allocator cached "
        "beyond that must be given back, or the trial OOMs",
        "settings": len(rows),
        "trained": len(ok),
        "oom": [x["setting"] for x in rows if x["failure_kind"] == "oom"],
        "other_failures": [x["setting"] for x in rows if x["status"] != "ok" and x["failure_kind"] != "oom"],
        "cache_beyond_the_cap": len(big),
        "cache_beyond_the_cap_trained": sum(1 for x in big if x["status"] == "ok"),
        "with_alloc_retries": sum(1 for x in ok if (x["alloc_retries"] or 0) > 0),
        "speed_vs_unpressed_median": float(np.median(speeds)) if speeds else None,
        "speed_vs_unpressed_min": min(speeds) if speeds else None,
        "gpu": raw.get("gpu"),
    }
    out = RESULTS / "memory_model_pressed_h200.json"
    head = {k: v for k, v in raw.items() if k != "rows"}  # the rows are the raw file's, committed beside this one
    out.write_text(json.dumps({"command": f"python -m benchmarks.memory_random_h200 pressed {_shown(raw_file)}",
                               "raw_file": _shown(raw_file), "raw": head, "summary": summary, "settings": rows},
                              indent=1, default=str))  # fmt: skip
    print(json.dumps(summary, indent=2, default=str))


def _raw(
    rows: list[dict[str, Any]], t0: float, args: argparse.Namespace, check: dict[str, Any] | None = None
) -> dict[str, Any]:
    from src.tracking import versions

    return {
        # the first trial, which built the model in a process of its own, and the same setting found built
        "built_apart_check": check or None,
        # the script's own variables as the call set them (the raw files before this one say WAIT=570 whatever it was)
        "command": " ".join(
            [*(f"{k}={os.environ[k]}" for k in ("FOREGROUND", "WAIT") if os.environ.get(k)), "bash", SCRIPT]
        )
        + (" " + shlex.join(sys.argv[2:]) if sys.argv[2:] else ""),
        "design": args.design,
        "slots": args.slots,
        "probe": PROBE,
        "budget_gib": BUDGET,
        "press": args.press if args.design == "pressed" else None,
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


def measured_rows(raw_file: Path) -> list[dict[str, Any]]:
    """A run's rows, each setting with its allocator (`hardware.expandable_segments`: the setting's own draw, else
    the run's PYTORCH_CUDA_ALLOC_CONF)."""
    raw = json.loads(raw_file.read_text())
    run_wide = "expandable_segments:true" in str(raw.get("pytorch_cuda_alloc_conf") or "").lower()
    rows = []
    for r in raw["rows"]:
        setting = {**r["setting"], EXPANDABLE: bool(r["setting"].get(EXPANDABLE, run_wide))}
        rows.append({**r, "setting": setting})
    return rows


def point(r: dict[str, Any], s: Any, b: Any) -> Any:
    """The fit's point of a measured row (`measured_rows`) that trained, with its setting and micro-batch."""
    from src.fit.model import Point

    return Point(
        s, b, r["peak_vram_reserved_gib"], r["cuda_context_gib"], _key(r["setting"]), r["peak_vram_allocated_gib"]
    )


def summarize(
    raw_files: list[Path], fresh: Path | None = None, tag: str = "", seen: str = "", form: str = "sum"
) -> None:
    """Fit the model and judge it, the grid-calibrated model and the two outside tools on held-out settings.

    Without `fresh`: fitted on the calibration (Sobol) points of `raw_files`, judged on their held-out settings (which
    were looked at while the model's terms were chosen: not an independent judgement). With `fresh` (a run of
    `--design fresh`): fitted on every setting of `raw_files`, judged on the fresh set alone, which no choice of the
    model saw. Either way the model's stated errors come before the judgement: each fitted setting predicted by a fit
    that left it out (under either allocator), the largest under- and over-prediction, per allocator. Writes
    memory_model_random<tag>_h200.json and the fitted model, memory_model_random<tag>_calibration_h200.json."""
    import importlib.util

    from benchmarks.memory_h200 import comparisons
    from src.fit.calibration import fit
    from src.fit.model import MemoryModel, allocator
    from src.fit.setting import peak_batch

    if importlib.util.find_spec("fitcheck") is None:  # its errors would be written as nulls into the file
        raise SystemExit(
            "summarize sets the model beside fitcheck-llm's estimator, which is not installed here: "
            "pip install -e '.[bench]' (nothing was written)"
        )
    outfile = RESULTS / f"memory_model_random{tag}_h200.json"
    model_file = RESULTS / f"memory_model_random{tag}_calibration_h200.json"
    judged_design, judged_raw = DESIGN, None
    if fresh is not None:
        judged_raw = json.loads(fresh.read_text())
        judged_name = judged_raw.get("design") or "fresh"
        judged_design = JUDGED_DESIGNS[judged_name]
        if fresh.resolve().parent != RESULTS:  # kept beside the others, committed, named by its set and its card
            card = "h200" if "H200" in str(judged_raw.get("gpu")) else "h100"
            kept = RESULTS / f"memory_model_random_raw_{judged_name}_{card}.json"
            kept.write_text(fresh.read_text())
            fresh = kept
    raws = [json.loads(f.read_text()) for f in raw_files]
    lens = lengths()

    def prepared(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any, Any]]:
        return [(r, s, peak_batch(lens, s)) for r in rows for s in [setting_of(r["setting"])]]

    measured = prepared([r for f in raw_files for r in measured_rows(f)])
    if fresh is None:
        fitted = [x for x in measured if x[0]["role"] == "calibration"]
        judged_rows = [x for x in measured if x[0]["role"] == "held_out"]
    else:
        fitted, judged_rows = measured, prepared(measured_rows(fresh))
    points = [point(r, s, b) for r, s, b in fitted if r["status"] == "ok"]
    stack = {f"version.{k}": v for k, v in raws[0]["versions"].items()} | {"gpu.name": raws[0]["gpu"]}
    # a setting left out under both allocators at once; `form`: every term added, or a layer's backward in two phases
    model = fit(points, stack, group=lambda p: p.label, phases=form == "phases")
    files = [_shown(f) for f in raw_files] + ([f"--fresh {_shown(fresh)}"] if fresh else [])
    command = "python -m benchmarks.memory_random_h200 summarize " + " ".join(files) + (f" --tag {tag}" if tag else "")
    command += f" --seen {json.dumps(seen)}" if seen else ""
    command += f" --form {form}"
    model_file.write_text(json.dumps(model.to_dict() | {"command": command}, indent=2))
    old = MemoryModel.load(OLD_MODEL)
    settings, fit_but_oom, said_fits_but_oom = [], [], []
    errors: dict[str, list[float]] = {
        "model": [],
        "grid_model": [],
        "fitcheck_llm": [],
        "accelerate_estimate_memory": [],
    }
    by_allocator: dict[str, list[tuple[float, float]]] = {}
    for r, s, b in judged_rows:
        pred, pred_old = model.predict(s, b), old.predict(s, b)
        got = r["peak_vram_reserved_gib"] if r["status"] == "ok" else None
        # what decides a fit (Prediction.needed_gib): peak allocated under expandable segments, else peak reserved
        need = (r.get("peak_vram_allocated_gib") if pred.expandable else got) if got else None
        row = {
            "role": r["role"],
            "setting": r["setting"],
            "status": r["status"],
            "failure_kind": r["failure_kind"],
            "measured_peak_vram_reserved_gib": got,
            "measured_peak_vram_allocated_gib": r.get("peak_vram_allocated_gib") if got else None,
            "predicted_peak_vram_reserved_gib": pred.reserved_gib,
            "predicted_peak_vram_device_gib": pred.device_gib,
            "predicted_terms_gib": pred.terms,
            "predicted_allocated_gib": pred.allocated_gib,
            "decided_on": "peak allocated" if pred.expandable else "peak reserved",
            "measured_needed_gib": need,
            "predicted_needed_gib": pred.needed_gib,
            "stated_error_pct": 100 * pred.error,
            "error_pct": 100 * (pred.needed_gib / need - 1) if need else None,
            "under_prediction_pct": 100 * (need / pred.needed_gib - 1) if need else None,
            "reserved_error_pct": 100 * (pred.reserved_gib / got - 1) if got else None,
            "grid_model_error_pct": 100 * (pred_old.reserved_gib / got - 1) if got else None,
            **(comparisons(s, pred.reserved_gib) if got else {}),
        }
        settings.append(row)
        if got:
            errors["model"].append(row["error_pct"])
            errors["grid_model"].append(row["grid_model_error_pct"])
            by_allocator.setdefault(allocator(s), []).append((row["error_pct"], row["under_prediction_pct"]))
            for tool in ("fitcheck_llm", "accelerate_estimate_memory"):
                if row.get(f"{tool}_gib"):
                    errors[tool].append(100 * (row[f"{tool}_gib"] / got - 1))
        elif r["failure_kind"] == "oom":
            if pred.device_gib <= 0.9 * BUDGET:
                fit_but_oom.append(r["setting"])
            if pred.device_gib + pred.error * pred.needed_gib <= BUDGET:  # src.fit's verdict "fits"
                said_fits_but_oom.append(r["setting"])
    judged = [x for x in settings if x["measured_peak_vram_reserved_gib"]]
    summary = {
        "design": _design_words(raw_files, judged_design if fresh else None),
        "independent": fresh is not None and not seen,
        "independence": f"NOT independent: {seen}"
        if seen
        else "the fresh set: drawn after the model's terms were chosen, never seen by any choice of the "
        "model nor by its fit"
        if fresh
        else "NOT independent: these held-out settings were looked at while the model's terms were chosen; the final "
        "judgement is a fresh set (design --fresh, summarize --fresh)",
        "calibration_points": len(points),
        "calibration_settings": len({p.label for p in points}),
        "held_out": len(judged),
        **stats(errors["model"], [x["under_prediction_pct"] for x in judged]),
        "judged_on": "what decides whether a setting fits (src/fit/model.py Prediction.needed_gib): peak allocated "
        "under expandable segments, whose cache is given back when the card presses (memory_model_pressed_h200.json: "
        "every such setting trained on a card of its own peak allocated x 1.05), peak reserved on the default "
        "allocator, where it is not (11 of 23 OOMed there); peak reserved itself is judged in `peak_reserved`",
        "max_under_prediction_rule": "the largest amount by which a measured peak exceeded its prediction, "
        "as a share of the prediction (the margin that would have covered it; the stated error's unit); the other "
        "errors are shares of the measured peak",
        "model_own_error_pct": 100 * model.error,
        "model_own_error_over_pct": 100 * (model.error_over or model.error),
        "model_own_error_by_allocator": {
            k: {"under_pct": 100 * v[0], "over_pct": 100 * v[1]} for k, v in model.errors.items()
        },
        "model_own_error_rule": "stated before the judgement: each fitted setting predicted by a fit that left it out "
        "(under both allocators at once), the largest under- and over-prediction, per allocator",
        "held_out_beyond_stated_error": sum(1 for x in judged if x["under_prediction_pct"] > x["stated_error_pct"]),
        "by_allocator": {
            k: {"held_out": len(v), **stats([e for e, _ in v], [u for _, u in v])}
            for k, v in sorted(by_allocator.items())
        },
        "predicted_fit_but_oom": len(fit_but_oom),
        "predicted_fit_but_oom_settings": fit_but_oom,
        "predicted_fit_but_oom_rule": "OOM'd although predicted with >= 10% margin (device <= 90% of the card)",
        "model_said_fits_but_oom": len(said_fits_but_oom),
        "model_said_fits_but_oom_rule": "OOM'd although predicted on the card with its stated error <= the card "
        "(python -m src.fit's verdict FITS)",
        "held_out_oom": sum(1 for x in settings if x["failure_kind"] == "oom"),
        "held_out_not_launched": len(json.loads(judged_design.read_text())["held_out_not_launched"]),
        "not_measured": [
            {"role": x["role"], "setting": x["setting"], "status": x["status"]}
            for x in settings
            if x["status"] not in ("ok", "failed")
        ],
        "grid_model": {
            "file": OLD_MODEL.name,
            "note": "its coefficients; terms added since at first principles",
            **stats(errors["grid_model"]),
        },
        "fitcheck_llm": stats(errors["fitcheck_llm"]),
        "accelerate_estimate_memory": stats(errors["accelerate_estimate_memory"]),
        "held_out_gpu": (judged_raw or raws[0])["gpu"],
        # the two parts of the prediction judged apart: the tensors (peak allocated) and the allocator's cache
        "peak_reserved": stats(
            [x["reserved_error_pct"] for x in judged],
            [100 * (x["measured_peak_vram_reserved_gib"] / x["predicted_peak_vram_reserved_gib"] - 1) for x in judged],
        ),
        "peak_allocated": stats(
            [100 * (x["predicted_allocated_gib"] / x["measured_peak_vram_allocated_gib"] - 1) for x in judged],
            [100 * (x["measured_peak_vram_allocated_gib"] / x["predicted_allocated_gib"] - 1) for x in judged],
        ),
        "allocator_cache_gib": {
            "measured_max": max(
                x["measured_peak_vram_reserved_gib"] - x["measured_peak_vram_allocated_gib"] for x in judged
            ),
            "predicted_max": max(x["predicted_terms_gib"]["allocator_cache"] for x in judged),
        },
    }
    check = judged_raw.get("built_apart_check") if judged_raw else None
    if check and check.get("again"):  # the "the first trial measures the trial", on the card
        first, again = check["first"], check["again"]
        summary["first_trial_builds"] = {
            "rule": "the set's first trial found no model (a fresh machine) and built it in a process of its own; "
            "the same setting ran again right after, alone on the card as the first was, finding it built",
            "built_the_model": first.get("built_the_model"),
            **{
                k: {"building": first.get(k), "built": again.get(k)}
                for k in ("peak_vram_reserved_gib", "peak_vram_allocated_gib")
            },
        }
    runs = [*raws, *([judged_raw] if judged_raw else [])]
    out = {
        "gpu": raws[0]["gpu"],  # the calibration's card; the judged settings' card is summary.held_out_gpu
        "versions": raws[0]["versions"],
        "budget_gib": BUDGET,
        "probe": raws[0]["probe"],
        "slots": raws[0]["slots"],
        "wall_min": [x["wall_min"] for x in runs],
        "commands": [
            "python -m benchmarks.memory_random_h200 design" + (f" --{judged_name}" if fresh else ""),
            "WAIT=560 bash benchmarks/memory_random_h200.sh"
            + (f" --design {judged_name}" if fresh else "")
            + "   (device, carry .whl)",
            command,
        ],
        "raw_files": [f.name for f in raw_files] + ([fresh.name] if fresh else []),
        "model_file": model_file.name,
        "summary": summary,
        "settings": settings,
    }
    outfile.write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))


def _shown(path: Path) -> str:
    """A path as the commands show it: from the repository's root where it lies in it."""
    root = RESULTS.parent.parent
    return str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)


def _design_words(raw_files: list[Path], judged: Path | None) -> str:
    first = json.loads(DESIGN.read_text())["design"]
    if judged is None:
        return first + "; measured once per allocator (default; expandable segments)"
    fitted = "every setting of the first design, measured once per allocator (" + first + ")"
    designs = {json.loads(f.read_text()).get("design") for f in raw_files}
    for name, ordinal in (("fresh", "first"), ("fresh2", "second")):
        if name in designs:
            fitted += (
                f"; and every setting of the {ordinal} fresh set ("
                + json.loads(JUDGED_DESIGNS[name].read_text())["design"]
                + ")"
            )
    return "calibration: " + fitted + "; judged on: " + json.loads(judged.read_text())["design"]


def stats(errors: list[float], under: list[float] | None = None) -> dict[str, float | None]:
    """Mean and largest absolute error (% of the measured peak) and, given the under-predictions (% of the
    prediction), the largest of them (0 when none)."""
    e = np.asarray(errors, dtype=float)
    if not len(e):
        return {"mean_abs_error_pct": None, "max_abs_error_pct": None, "max_under_prediction_pct": None}
    out: dict[str, float | None] = {
        "mean_abs_error_pct": float(np.mean(np.abs(e))),
        "max_abs_error_pct": float(np.max(np.abs(e))),
    }
    if under is None:  # an outside tool: its under-prediction from its errors
        out["max_under_prediction_pct"] = float(max(0.0, 100 * (1 / (1 + e.min() / 100) - 1)))
    else:
        out["max_under_prediction_pct"] = float(max(0.0, max(under)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--slots", type=int, default=5)
    r.add_argument("--trial-timeout-s", type=float, default=240)
    r.add_argument("--tag", default=None, help="suffix of the raw file's name (memory_random_raw<tag>.json)")
    r.add_argument(
        "--design",
        choices=("first", "fresh", "fresh2", "fresh3", "pressed"),
        default="first",
        help="fresh: the final judgement's set; pressed: the fresh set on cards cut to its peak allocated",
    )
    r.add_argument("--first", type=int, default=None, help="a judged set's first N settings only (device time)")
    r.add_argument("--press", type=float, default=PRESS, help="pressed: the cap's share above peak allocated")
    d = sub.add_parser("design")
    d.add_argument("--fresh", action="store_true", help="the first fresh random set")
    d.add_argument("--fresh2", action="store_true", help="the second fresh random set, on expandable segments")
    d.add_argument("--fresh3", action="store_true", help="the third fresh random set, on expandable segments")
    s = sub.add_parser("summarize")
    s.add_argument("raw", type=Path, nargs="+", help="the first design's raw files (default allocator, expandable)")
    s.add_argument("--fresh", type=Path, default=None, help="the fresh set's raw file: judged on it alone")
    s.add_argument("--tag", default="", help="suffix of the result files' names")
    s.add_argument("--seen", default="", help="how the judged set was seen before (a re-judgement): not independent")
    s.add_argument(
        "--form",
        choices=("phases", "sum"),
        default="sum",
        help="the model's form: every term added (the judged form, the product's default), or a layer's backward in "
        "two phases (0.10.2, where a model file says so)",
    )
    pr = sub.add_parser("pressed")
    pr.add_argument("raw", type=Path, help="the pressed run's raw file (memory_random_raw_pressed.json)")
    args = p.parse_args()
    if args.what == "design":
        design_fresh3() if args.fresh3 else design_fresh2() if args.fresh2 else design_fresh() if args.fresh else design()
    elif args.what == "run":
        run(args)
    elif args.what == "pressed":
        pressed(args.raw)
    else:
        summarize(args.raw, args.fresh, args.tag, args.seen, args.form)


if __name__ == "__main__":
    main()
