"""The summaries a benchmark definition names (`summary:`), each `(record, run) -> dict` over the rows its commands
left (benchmarks/harness.py), and what a definition prepares before its commands (`prepare:`).

- study: a sweep's trials as the product reads them (src.study), by class, with the figures that matter here.
- arms: settings run alone (a trials block; repeats pooled) side by side, and src.same_model's verdict.
- journey: the default command from the recipe to a soaked, promoted setting and its production run (issue 28).
- production_resume: a production run with a real fault mid-run, restarted from its checkpoint (issue 45).
- memory_judge: the memory model fitted to earlier random sets and judged on a fresh one it never saw (issue 29).
- same_model_calibration: src.same_model's figures for pairs known to train the same model and one known not to.
- device_peak: a trial's recorded device peak beside nvidia-smi's per-process maximum (issue 47, finding 10).
- same_model_speed: the journey's promotion against its reference, both timed alone in the sweep (issue 46).
- unsloth_fair: the project beside Unsloth at both optimisations, backends recorded, ABBA repeats (issue 46).
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
from pathlib import Path
from typing import Any

from src.config import PROJECT_DIR

JOURNEY = ("peak_vram_reserved_gib", "tokens_per_s", "truncated_answer_frac")  # what the journey's rows keep
FIELDS = ("peak_vram_reserved_gib", "peak_vram_allocated_gib", "peak_vram_device_gib", "vram_headroom_frac",
          "tokens_per_s", "mfu_standard", "model_tflops_per_s", "step_time_s", "startup_s", "first_step_s",
          "cuda_context_gib", "oom_request_gib", "truncated_answer_frac", "predicted_peak_vram_reserved_gib")  # fmt: skip


def _store(run: Any) -> str:
    return f"sqlite:///{run.root / 'mlruns' / 'mlflow.db'}"


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None


def study(record: dict, run: Any) -> dict:
    """The study `${study}` by the product's own classes; its report's files (where a step made them) go beside the
    result file, in <name>_<card>/."""
    from src.study import load

    sweep = load(run.vars["study"], run.root / "sweeps", tracking_uri=_store(run))
    rows = sorted(sweep.rows, key=lambda r: r.number)
    counts: dict[str, int] = {}
    for r in rows:
        key = f"{r.verdict}:{r.failure_kind}" if r.failure_kind else r.verdict
        counts[key] = counts.get(key, 0) + 1
    half = (len(rows) + 1) // 2  # does the sampler leave the OOM region? (NOTES §2)
    oom = [[r.failure_kind == "oom" for r in part] for part in (rows[:half], rows[half:])]
    phases: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.metrics.items():
            if k.startswith("startup.") and k.endswith("_s"):
                phases.setdefault(k[8:-2], []).append(v)
    report = sweep.study_dir / "report.md"
    if report.exists():
        beside = run.out.with_suffix("")
        beside.mkdir(parents=True, exist_ok=True)
        for f in [report, *sweep.study_dir.glob("*.png")]:
            shutil.copy(f, beside)
    return {
        "study": sweep.name,
        "counts": dict(sorted(counts.items())),
        "oom_by_half": {"first": sum(oom[0]), "second": sum(oom[1]), "trials": [len(oom[0]), len(oom[1])]},
        "startup_phases_median_s": {k: statistics.median(v) for k, v in sorted(phases.items())},
        "recommendation": sweep.recommendation,
        "trials": [
            {
                "trial": r.number,
                "class": r.verdict,
                "detail": r.detail,
                "setting": r.setting(),
                "lever": r.lever,
                "slot": r.slot,
                **{k: r.metrics[k] for k in FIELDS if k in r.metrics},
            }
            for r in rows
        ],  # fmt: skip
    }


def _rate(row: dict) -> float | None:
    """A finished run's tokens/s: a trial's own figure, or a peer's tokens over its measured steps' seconds."""
    result = row.get("result") or {}
    if result.get("status") != "ok":
        return None
    if "metrics" in result:
        return result["metrics"].get("tokens_per_s")
    steps = (result.get("steps") or [])[int(result.get("warmup_steps", 0)) :]  # benchmarks.peer_arm's record
    seconds = sum(s["time_s"] for s in steps)
    return sum(s["tokens"] for s in steps) / seconds if seconds > 0 else None


def arms(record: dict, run: Any) -> dict:
    """Each setting (a trials block's names, or a step's `arm`): its runs, tokens/s median/min/max over the repeats
    that finished, peaks, MFU where the trial measured it, rows per optimizer step; `speedup`: each setting's median
    over `${baseline}`'s; `same_model`: src.same_model's verdict, where a row ran it."""
    from src.same_model import rows_per_step

    groups: dict[str, list[dict]] = {}
    for row in record.get("rows", []):
        if row.get("arm"):
            groups.setdefault(row["arm"], []).append(row)
    out: dict[str, Any] = {}
    for name, rows in groups.items():
        done = [r for r in rows if _rate(r)]
        metrics = [(r.get("result") or {}).get("metrics") or r.get("result") or {} for r in done]
        entry = {"repeats": len(rows), "finished": len(done), "overrides": rows[0].get("overrides"),
                 "tokens_per_s": _spread([_rate(r) for r in done])}  # fmt: skip
        for key in ("peak_vram_reserved_gib", "peak_vram_device_gib"):
            found = [m[key] for m in metrics if m.get(key) is not None]
            entry[key] = max(found) if found else None
        entry["mfu_standard"] = _spread([m["mfu_standard"] for m in metrics if m.get("mfu_standard")])
        if rows[0].get("overrides") is not None:  # a trial: its own command, less where it writes
            words = [w for w in shlex.split(rows[0]["command"])[3:] if not w.startswith(("hydra.", "checkpoint.dir="))]
            try:
                entry["rows_per_optimizer_step"] = rows_per_step(words)
            except Exception as exc:  # noqa: BLE001 - composed where the config is at hand; said where not
                entry["rows_per_optimizer_step"] = f"not composed here: {type(exc).__name__}"
        entry["failures"] = [
            {"name": r["name"], **((r.get("result") or {}).get("failure") or {"exit_code": r.get("exit_code")})}
            for r in rows if r not in done
        ]  # fmt: skip
        out[name] = entry
    summary: dict[str, Any] = {"settings": out}
    base = out.get(run.vars.get("baseline", ""), {}).get("tokens_per_s")
    if base:
        summary["speedup"] = {
            n: e["tokens_per_s"]["median"] / base["median"] for n, e in out.items() if e["tokens_per_s"]
        }
    checked = next((r.get("output") for r in record.get("rows", []) if r["name"] == "same_model"), None)
    if checked is not None:
        summary["same_model"] = {
            k: checked.get(k)
            for k in ("passed", "max_loss_diff", "max_loss_rel_diff", "adapter_rel_diff", "tolerance", "why")
        }
    started = [r for r in record.get("rows", []) if "wall_s" in r]
    summary["gpu_minutes"] = sum(r["wall_s"] for r in started) / 60
    return summary


def journey(record: dict, run: Any) -> dict:
    """What each step of the journey printed and measured: the recipe's class, the recommendation, its soak, the
    promotion, the production run (its steps bounded by ${production_steps}: the file records it)."""
    from src.study import load

    rows = {r["name"]: r for r in record.get("rows", [])}
    sweep = load(run.vars["study"], run.root / "sweeps", tracking_uri=_store(run))
    recipe, best = sweep.recipe_row(), sweep.recommended()
    soak = sweep.soaks.get(best.number, {}) if best else {}
    promote = (run.work / "promote" / "output.log").read_text(errors="replace") if "promote" in rows else ""
    production = rows.get("production", {})
    result = production.get("result") or {}
    report = sweep.study_dir / "report.md"
    if report.exists():  # the report beside the result file, as the README shows it
        (run.out.with_suffix("")).mkdir(parents=True, exist_ok=True)
        shutil.copy(report, run.out.with_suffix("") / "report.md")
    version = [line.split(" version ", 1)[1].split(";")[0].strip() for line in promote.splitlines()
               if line.startswith("promoted trial") and " version " in line]  # fmt: skip
    experiment = PROJECT_DIR / "conf" / "experiment" / "production.yaml"
    return {
        "sweep_exit_code": rows.get("sweep", {}).get("exit_code"),
        "gpu_minutes": (rows.get("sweep", {}).get("wall_s", 0) + production.get("wall_s", 0)) / 60,
        "sweep_minutes": rows.get("sweep", {}).get("wall_s", 0) / 60,
        "max_truncated_answer_frac": sweep.max_truncated_answer_frac,
        "recipe": None
        if recipe is None
        else {
            "trial": recipe.number,
            "class": recipe.verdict,
            "detail": recipe.detail,
            "metrics": recipe.metrics,
        },  # fmt: skip
        "search": sweep.recommendation,
        "recommended": None
        if best is None
        else {
            "trial": best.number,
            "overrides": [f"{k}={v}" for k, v in best.params.items()] + best.lever,
            "recommendation_trial": best.recommended,
            **{k: best.metrics.get(k) for k in JOURNEY},
        },  # fmt: skip
        "soak": {
            k: soak.get(k) for k in ("status", "steps", "minutes", "peak_vram_reserved_gib", "peak_vs_map", "detail")
        },
        "promoted": rows.get("promote", {}).get("exit_code") == 0,
        "model_version": version[0] if version else None,
        "promote_output": promote.splitlines()[-3:],
        "production_file": experiment.read_text() if experiment.exists() else None,
        "production_trial": {
            "command": production.get("command"),
            "exit_code": production.get("exit_code"),
            "seconds": production.get("wall_s"),
            "status": result.get("status"),
            "failure": result.get("failure"),
            **{k: (result.get("metrics") or {}).get(k) for k in JOURNEY},
        },  # fmt: skip
        "trials": [
            {
                "trial": r.number,
                "class": r.verdict,
                "detail": r.detail,
                "params": r.params,
                "lever": r.lever,
                "recommended": r.recommended,
                **{k: r.metrics.get(k) for k in JOURNEY},
            }
            for r in sweep.rows
        ],  # fmt: skip
    }


def production_file(run: Any) -> None:
    """conf/experiment/production.yaml as the journey's promotion wrote it (`${journey}`'s production_file), where a
    command trains it and the checkout has none."""
    target = PROJECT_DIR / "conf" / "experiment" / "production.yaml"
    if any("experiment=production" in run.fill(v) for v in run.vars.values()) and not target.exists():
        source = PROJECT_DIR / run.fill(run.vars.get("journey", "benchmarks/results/journey_h100.json"))
        target.write_text(json.loads(source.read_text())["production_file"])


def production_resume(record: dict, run: Any) -> dict:
    """The run's ledger (its checkpoint folder's run.json), MLflow's loss series around the resume, and the bounds
    issue 45 sets: the time lost within one checkpoint interval plus a start-up, saves under 2% of training."""
    from mlflow.tracking import MlflowClient

    row = next(r for r in record["rows"] if r["name"] == "production")
    outcome = row["result"]
    ledger = json.loads((Path(outcome["run_dir"]) / "run.json").read_text())
    m, attempts = ledger.get("metrics", {}), ledger["attempts"]
    history = MlflowClient(_store(run)).get_metric_history(outcome["run_id"], "loss")
    resumed = attempts[-1].get("resumed_from_step", 0)
    failed_at = (attempts[0].get("failure") or {}).get("step") or resumed
    around: dict[str, list[float]] = {}
    for h in sorted(history, key=lambda h: (h.step, h.timestamp)):
        if resumed - 3 <= h.step <= failed_at + 3:
            around.setdefault(str(h.step), []).append(round(h.value, 6))
    redone = [v for s, v in around.items() if resumed < int(s) < failed_at and len(v) > 1]
    last = attempts[-1]
    startup = last["train_began"] - last["launched"] if "train_began" in last else None
    interval = float(run.vars["minutes"]) * 60
    return {
        "completed": bool(ledger.get("completed")) and row["exit_code"] == 0,
        "restarts": int(m.get("restarts", 0)),
        "lost_s": m.get("lost_s"),
        "redone_s": m.get("redone_s"),
        "restart_startup_s": startup,
        "checkpoint_interval_s": interval,
        "lost_within_interval_plus_startup": m.get("lost_s", 1e9) <= interval + (startup or 0.0),
        "checkpoint_overhead_frac": m.get("checkpoint_overhead_frac"),
        "checkpoint_count": int(m.get("checkpoint.count", 0)),
        "checkpoint_save_s_total": m.get("checkpoint.save_s"),
        "checkpoint_size_mib": m.get("checkpoint.size_mib"),
        "training_s": m.get("training_s"),
        "failure": attempts[0].get("failure"),
        "resumed_from_step": resumed,
        "losses_around_resume": around,
        "redone_steps_max_loss_diff": max((max(v) - min(v) for v in redone), default=None),
        "rows": last.get("rows"),
        **{k: outcome["metrics"].get(k) for k in ("tokens_per_s", "peak_vram_reserved_gib")},
        "attempts": attempts,
        "checkpoints": ledger["checkpoints"],
    }


# ---- the memory model judged -----------------------------------------------------------------------------------
EXPANDABLE = "hardware.expandable_segments"


def _measured(row: dict, run_wide: bool) -> dict:
    """A measured setting from a row of this harness or of the raw files before it (memory_random_h200's)."""
    result = row.get("result")
    m = (result or {}).get("metrics") or row
    status = result.get("status", "missing") if result else row.get("status", "not_run")
    kind = ((result or {}).get("failure") or {}).get("kind") if result else row.get("failure_kind")
    setting = {**row["setting"], EXPANDABLE: bool(row["setting"].get(EXPANDABLE, run_wide))}
    return {"setting": setting, "status": status, "failure_kind": kind, "reserved": m.get("peak_vram_reserved_gib"),
            "allocated": m.get("peak_vram_allocated_gib"), "context": m.get("cuda_context_gib")}  # fmt: skip


def memory_judge(record: dict, run: Any) -> dict:
    """The model (form `${form}`: every term added, or a layer's backward in two phases) fitted to every setting of
    the raw files `${fitted_on}` that trained, and judged on this run's settings: what decides a fit
    (Prediction.needed_gib: peak allocated on expandable segments, else peak reserved) against its prediction; its
    own stated error first (each fitted setting predicted by a fit that left it out)."""
    from src.config import compose
    from src.fit.calibration import Lengths, fit
    from src.fit.model import Point
    from src.fit.setting import Setting, peak_batch

    where = [f"model={run.vars['model']}", f"data={run.vars['data']}"]
    lens = Lengths().of(compose(where))  # the data's rows as the model's tokenizer counts them
    budget = float(run.vars["budget_gib"])

    def prepared(m: dict) -> tuple[Any, Any]:
        from src.config import override_value

        s = Setting.from_config(compose([*where, *(f"{k}={override_value(v)}" for k, v in m["setting"].items())]))
        return s, peak_batch(lens, s)

    fitted = []
    for path in run.fill(run.vars["fitted_on"]).split():
        raw = json.loads((PROJECT_DIR / path).read_text())
        wide = "expandable_segments:true" in str(raw.get("pytorch_cuda_alloc_conf") or "").lower()
        fitted += [_measured(r, wide) for r in raw["rows"]]
    points = []
    for m in fitted:
        if m["status"] == "ok":
            s, b = prepared(m)
            label = json.dumps({k: v for k, v in m["setting"].items() if k != EXPANDABLE}, sort_keys=True)
            points.append(Point(s, b, m["reserved"], m["context"], label, m["allocated"]))
    stack = {f"version.{k}": v for k, v in record["versions"].items()} | {"gpu.name": record["gpu"]}
    model = fit(points, stack, group=lambda p: p.label, phases=run.vars["form"] == "phases")
    settings, errors, under, fit_but_oom, said_fits = [], [], [], 0, 0
    for row in record.get("rows", []):
        if "setting" not in row:
            continue
        m = _measured(row, False)
        pred = model.predict(*prepared(m))
        need = (m["allocated"] if pred.expandable else m["reserved"]) if m["status"] == "ok" else None
        entry = {"name": row["name"], "setting": m["setting"], "status": m["status"], "failure_kind": m["failure_kind"],
                 "measured_needed_gib": need, "predicted_needed_gib": pred.needed_gib,
                 "predicted_peak_vram_reserved_gib": pred.reserved_gib, "stated_error_pct": 100 * pred.error,
                 "decided_on": "peak allocated" if pred.expandable else "peak reserved"}  # fmt: skip
        if need:
            entry["error_pct"] = 100 * (pred.needed_gib / need - 1)
            entry["under_prediction_pct"] = 100 * (need / pred.needed_gib - 1)
            errors.append(entry["error_pct"])
            under.append(entry["under_prediction_pct"])
        elif m["failure_kind"] == "oom":
            fit_but_oom += pred.device_gib <= 0.9 * budget
            said_fits += pred.device_gib + pred.error * pred.needed_gib <= budget  # src.fit's verdict FITS
        settings.append(entry)
    return {
        "form": run.vars["form"],
        "fitted_on": run.fill(run.vars["fitted_on"]).split(),
        "calibration_points": len(points),
        "held_out": len(errors),
        "mean_abs_error_pct": statistics.fmean(abs(e) for e in errors) if errors else None,
        "max_abs_error_pct": max((abs(e) for e in errors), default=None),
        "max_under_prediction_pct": max([0.0, *under]) if under else None,
        "model_own_error_pct": 100 * model.error,
        "held_out_beyond_stated_error": sum(
            1 for s in settings if s.get("under_prediction_pct", -1e9) > s["stated_error_pct"]
        ),
        "predicted_fit_but_oom": fit_but_oom,
        "predicted_fit_but_oom_rule": "OOM'd although predicted with >= 10% margin (device <= 90% of the card)",
        "model_said_fits_but_oom": said_fits,
        "held_out_oom": sum(1 for s in settings if s["failure_kind"] == "oom"),
        "not_measured": [s["name"] for s in settings if s["status"] not in ("ok", "failed")],
        "model": model.to_dict(),
        "settings": settings,
    }


def same_model_calibration(record: dict, run: Any) -> dict:
    """Each src.same_model row's figures (whatever the verdict under today's tolerance): the largest per-step loss
    difference, absolute and as a share of the reference's loss, and the adapters' relative difference."""
    out = {}
    for row in record.get("rows", []):
        found = row.get("output") or {}
        losses = found.get("losses") or {}
        ref = losses.get("reference") or []
        cand = losses.get("candidate") or []
        rel = max((abs(a - b) / abs(a) for a, b in zip(ref, cand, strict=False) if a), default=None)
        out[row["name"]] = {
            "passed": found.get("passed"),
            "max_loss_diff": found.get("max_loss_diff"),
            "max_loss_rel_diff": rel,
            "adapter_rel_diff": found.get("adapter_rel_diff"),
            "losses": losses,
            "why": found.get("why"),
            "exit_code": row.get("exit_code"),
            "tail": row.get("tail"),
        }
    return {"pairs": out, "tolerance": next((r["output"].get("tolerance") for r in record.get("rows", [])
                                              if r.get("output")), None)}  # fmt: skip


def device_peak(record: dict, run: Any) -> dict:
    """The trial's device peak (NVML, in the trial) against nvidia-smi's per-process maximum over the same run."""
    row = next((r for r in record.get("rows", []) if r.get("result")), {})
    found = row.get("result") or {}
    trial = found.get("result") or {}
    metrics = trial.get("metrics") or {}
    recorded, seen = metrics.get("peak_vram_device_gib"), found.get("nvidia_smi_max_gib")
    return {
        "status": trial.get("status"),
        "failure_kind": (trial.get("failure") or {}).get("kind"),
        "recorded_device_gib": recorded,
        "recorded_reserved_gib": metrics.get("peak_vram_reserved_gib"),
        "oom_request_gib": metrics.get("oom_request_gib"),
        "nvidia_smi_max_gib": seen,
        "nvidia_smi_max_gib_by_pid": found.get("nvidia_smi_max_gib_by_pid"),
        "recorded_minus_nvidia_smi_gib": None if recorded is None or seen is None else recorded - seen,
    }


def same_model_speed(record: dict, run: Any) -> dict:
    """The sweep's reference (src/sweep/faster.py) and the setting it recommended and promotion took, each as timed
    alone in the sweep (src/sweep/timing.py: median, min, max of its readings), their rows per optimizer step, the
    speed-up, the same-model verdict on the promoted setting and the GPU minutes of the commands."""
    from src.study import load
    from src.sweep import faster

    sweep = load(run.vars["study"], run.root / "sweeps", tracking_uri=_store(run))
    reference, promoted = faster.reference(sweep), sweep.recommended()

    def arm(row: Any) -> dict | None:
        if row is None:
            return None
        timed = row.timed
        return {
            "trial": row.number,
            "overrides": faster.overrides(row),
            "tokens_per_s": None if not timed.get("tokens_per_s") else
            {"median": timed["tokens_per_s"], "min": timed["tokens_per_s_min"], "max": timed["tokens_per_s_max"]},
            "readings": timed.get("readings"),
            "alone": bool(timed.get("alone")),
            "mfu_standard": timed.get("mfu_standard") or row.metrics.get("mfu_standard"),
            "peak_vram_reserved_gib": row.metrics.get("peak_vram_reserved_gib"),
            "rows_per_optimizer_step": sweep.rows_per_step(row),
            "soak": sweep.soaks.get(row.number, {}).get("status"),
        }  # fmt: skip

    ref, best = arm(reference), arm(promoted)
    speedup = None
    if ref and best and ref["tokens_per_s"] and best["tokens_per_s"]:
        speedup = best["tokens_per_s"]["median"] / ref["tokens_per_s"]["median"]
    check = promoted.same_model if promoted is not None else {}
    rows = {r["name"]: r for r in record.get("rows", [])}
    return {
        "reference": ref,
        "promoted": best,
        "speedup": speedup,
        "same_rows_per_optimizer_step": bool(ref and best and ref["rows_per_optimizer_step"] == best["rows_per_optimizer_step"]),
        "same_model": {k: check.get(k) for k in ("max_loss_diff", "max_loss_rel_diff", "adapter_rel_diff", "tolerance",
                                                 "passed", "steps")}
        if check else ("the reference itself" if ref and best and ref["trial"] == best["trial"] else None),
        "promoted_exit_code": rows.get("promote", {}).get("exit_code"),
        "gpu_minutes": sum(r.get("wall_s", 0) for r in record.get("rows", [])) / 60,
    }  # fmt: skip


def unsloth_fair(record: dict, run: Any) -> dict:
    """`arms` at each optimisation (project_<o>, unsloth_<o>), `vs_unsloth` = the project's median tokens/s over
    Unsloth's, and each arm's attention backend as recorded (the project: the kernel its trial saw run; Unsloth:
    transformers' attn_implementation, its fast-kernel flags and the kernel that ran)."""
    pooled = arms(record, run)["settings"]
    backends: dict[str, list] = {}
    for row in record.get("rows", []):
        found = row.get("result") or {}
        said = found.get("attention") if "attention" in found else found.get("attention_kernel")
        if row.get("arm") and said is not None and said not in backends.setdefault(row["arm"], []):
            backends[row["arm"]].append(said)
    out: dict[str, Any] = {"settings": pooled, "attention": backends, "vs_unsloth": {}}
    for optimisation in ("recipe", "packed"):
        mine, theirs = pooled.get(f"project_{optimisation}", {}), pooled.get(f"unsloth_{optimisation}", {})
        if mine.get("tokens_per_s") and theirs.get("tokens_per_s"):
            out["vs_unsloth"][optimisation] = mine["tokens_per_s"]["median"] / theirs["tokens_per_s"]["median"]
    out["gpu_minutes"] = sum(r.get("wall_s", 0) for r in record.get("rows", [])) / 60
    return out
