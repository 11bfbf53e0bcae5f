"""How fast the system maps a card, and how fast the settings it finds train (issue: benchmark).

    python -m benchmarks.map_h200 [--slots 5] [--model llama3_8b_synthetic] [--budget-gib 24]

On a GPU machine, in one run:
1. the card's bf16 matmul rate (`benchmarks.matmul_rate`), the denominator of MFU;
2. the model built and quantized once (`python -m src.models`; timed apart: once per machine, not per map);
3. the speed map (`conf/sweep/speed_map.yaml`, 96 settings) through the sweep engine, `--slots` trials at once
   on the card, each capped at the budget; settings certain to OOM are recorded as skipped, not launched;
4. the seed's setting and the map's fastest stable settings re-measured alone (the card to themselves, longer
   probes): the map's own throughput is from a shared card and only ranks settings;
5. the fastest of those with each speed variant (`VARIANTS`: bf16 instead of peft's fp32 copies, SDPA without
   cuDNN, Liger's kernels, no LoRA dropout), then with the variants that each gained, together;
6. `benchmarks/results/map_<model>_<budget>gib.json`.

Solo trials are forked from a warm interpreter (`src/sweep/launcher.py`, as the map's are with `preload`) unless
`--no-solo-preload`.

"Best stable" only considers settings that train what the seed trains: the same rank and max_seq_length at
least the seed's (a shorter max_seq_length would be faster by truncating the data).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import summarize
from src.config import override_value
from src.handoff import STARTED_ENV
from src.sweep import launcher
from src.tracking import system_tags

ROOT = Path(__file__).resolve().parent.parent
SEED = {
    "data.max_seq_length": 1024,
    "trainer.per_device_train_batch_size": 1,
    "trainer.gradient_checkpointing": True,
    "trainer.group_by_length": True,
    "trainer.packing": False,
    "model.attn_implementation": "sdpa",
}
SOLO_OVERRIDES = ["trainer.max_steps=6", "trainer.warmup_steps=0", "measure.warmup_steps=2"]
PROBE_KEYS = {o.split("=", 1)[0] for o in SOLO_OVERRIDES}
# Speed variants tried on the fastest stable setting: (its knobs, whether it trains the same recipe, more
# overrides for its probe). A variant that changes the recipe (dropout is regularisation) is measured and
# reported, but never made the best stable. One the setting already has (by its knobs or the map's --extra), or
# one that does not apply to it (SDPA's backends without SDPA), is not measured.
# A compiled trial compiles in its first steps (and again when packed lengths first change): measure later ones.
COMPILED_PROBE = ["trainer.max_steps=9", "measure.warmup_steps=4"]
VARIANTS: dict[str, tuple[dict, bool, list[str]]] = {
    "bf16_rest": ({"model.upcast_non_quantized": False}, True, []),  # embeddings, norms, lm_head stay bf16
    "no_cudnn_attention": ({"model.sdpa_backends": ["flash", "efficient"]}, True, []),
    "liger": ({"trainer.use_liger_kernel": True}, True, []),
    "compile_layers": ({"trainer.torch_compile": "layers"}, True, COMPILED_PROBE),
    "no_lora_dropout": ({"lora.lora_dropout": 0.0}, False, []),
}
MFU_COUNTING = (
    "MFU = useful model FLOP/s / the card's bf16 dense matmul rate measured in this run (8192^3 products). "
    "Useful FLOPs per row of L real tokens: 4 x P x L (P = in x out summed over every Linear the forward runs: "
    "the 4-bit projections, LoRA A/B and lm_head; forward 2PL + backward to the inputs 2PL, no weight "
    "gradients for frozen weights; LoRA's own weight gradients, <1%, not counted) + causal attention "
    "6 x layers x d x L^2. Padding tokens and the forward recomputed by gradient checkpointing are not counted: "
    "lengths come from each micro-batch's attention mask (or padding-free position ids), read by a hook on the "
    "model's forward, which runs once per micro-batch (src/measure/ FlopCounter)."
)


def sh(cmd: list[str], log: Path, timeout: float | None = None, env: dict | None = None) -> tuple[int, float]:
    """Run a command, its output to `log`; (exit code, seconds)."""
    import psutil

    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Ctrl-C first: the engine closes its runs; then end every descendant (trials have sessions of their
            # own) and wait until they are gone, so that nothing else holds the card afterwards.
            family = []
            with contextlib.suppress(psutil.NoSuchProcess):
                engine = psutil.Process(proc.pid)
                family = [engine, *engine.children(recursive=True)]
            proc.send_signal(signal.SIGINT)
            _, alive = psutil.wait_procs(family, timeout=10)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(alive, timeout=30)
            rc = 124
    return rc, time.time() - start


def params_of(attrs_params: dict) -> dict:
    return {k: attrs_params[k] for k in SEED if k in attrs_params}


def overrides(setting: dict) -> list[str]:
    return [f"{k}={override_value(v)}" for k, v in setting.items()]


def map_trials(storage: str, study: str) -> list[dict]:
    """The study's trials as `benchmarks.summarize` reads them, each with its setting of the speed knobs."""
    return [{**row, "setting": params_of(row["params"])} for row in summarize.trials(storage, study)]


def solo(
    setting: dict,
    args: argparse.Namespace,
    out: Path,
    name: str,
    extra: list[str] | None = None,
    map_recipe: bool = True,
    timeout_s: float | None = None,
) -> dict:
    """One trial alone on the card (the engine is idle): its result.json, and its step profile if it wrote one.
    `map_recipe`: with the overrides the map's trials had (`--extra`), under the setting's own knobs; the seed
    is measured without them. `timeout_s`: default `--solo-timeout-s`."""
    recipe = list(args.extra) if map_recipe else []
    run_dir = out / "solo" / name
    out.mkdir(parents=True, exist_ok=True)
    (run_dir / "result.json").unlink(missing_ok=True)  # a stale one must not pass for this run's
    argv = [
        f"model={args.model}", "data=clinical_notes",
        f"hardware.vram_budget_gib={args.budget_gib}", "preflight.max_truncated_answer_frac=1.0",
        *SOLO_OVERRIDES, *recipe, *overrides(setting), *(extra or []), f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    timeout_s = args.solo_timeout_s if timeout_s is None else timeout_s
    rc, seconds = run_trial(argv, out / f"solo_{name}.log", timeout_s, args.forkserver)
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {"status": "failed", "metrics": {}}
    m = result.get("metrics", {})
    profile = run_dir / "profile.txt"
    return {
        "setting": setting,
        "status": result.get("status"),
        "failure": result.get("failure"),
        "exit_code": rc,
        "wall_s": seconds,
        "attention_kernel": result.get("attention_kernel"),
        **{k: v for k, v in m.items() if not k.startswith("startup.")},
        "startup_phases_s": summarize.startup_phases(m),
        "probe": SOLO_OVERRIDES + [e for e in extra or [] if e.split("=", 1)[0] in PROBE_KEYS],
        "recipe": recipe,
        **({"profile": profile.read_text()} if profile.exists() else {}),
    }


def run_trial(argv: list[str], log: Path, timeout: float, ctx: object) -> tuple[int, float]:
    """`python -m src.train argv`, forked from the warm interpreter `ctx` (None: a fresh one); (exit code, s)."""
    env = {STARTED_ENV: repr(time.time())}  # start-up counts from the launch (src/measure/)
    if ctx is None:
        return sh([sys.executable, "-m", "src.train", *argv], log, timeout=timeout, env={**os.environ, **env})
    start = time.time()
    log.unlink(missing_ok=True)
    proc = launcher.start(ctx, argv, log, log, env)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the trial leads its own session: this ends all of it
        proc.wait(60)
        rc = 124
    return rc, time.time() - start


def card_rate(logs: Path) -> dict:
    """The card's bf16 matmul rate (`benchmarks.matmul_rate` in a process of its own), or the error it gave."""
    sh([sys.executable, "-m", "benchmarks.matmul_rate"], logs / "matmul.log")
    lines = (logs / "matmul.log").read_text().strip().splitlines()
    found = next((json.loads(x) for x in reversed(lines) if x.startswith('{"bf16_tflops"')), None)
    return found or {"error": "\n".join(lines[-5:])}


def compiles(setting: dict) -> bool:
    """Whether a setting torch.compiles: its first steps compile, so it needs COMPILED_PROBE and more time."""
    return setting.get("trainer.torch_compile") not in (None, False)


def with_mfu(entry: dict, peak_tflops: float | None) -> dict:
    if peak_tflops and entry.get("model_tflops_per_s"):
        entry["mfu"] = entry["model_tflops_per_s"] / peak_tflops
    return entry


# Settings of one family form their batches the same way; the map's readings are comparable within a family,
# less across (trials share the card with whatever else ran then).
FAMILY_KNOBS = ("trainer.packing", "model.attn_implementation")


def micro_batch_tokens(setting: dict) -> int:
    return setting["data.max_seq_length"] * setting["trainer.per_device_train_batch_size"]


def pick_candidates(stable: list[dict], n: int) -> list[dict]:
    """The settings to re-measure alone, until n: the fastest reading of each family first (families in the
    order of their fastest), then each family's largest micro-batch, then each family's runners-up.

    A throughput read while five trials share the card ranks settings roughly. v3 put a padded setting first
    that ran at half a packed one's speed alone: hence one candidate per family. v4 ranked packed 1024 x 4
    above packed 4096 x 4, which alone runs ~20% faster (a 16 k-token micro-batch makes larger GEMMs and
    dequantizes each weight once per 16 k tokens instead of per 4 k): hence each family's largest stable
    micro-batch next, the setting that uses the card best when it has it to itself."""
    families: dict[tuple, list[dict]] = {}
    for row in sorted(stable, key=lambda r: -r["tokens_per_s"]):
        families.setdefault(tuple(row["setting"].get(k) for k in FAMILY_KNOBS), []).append(row)
    largest = [max(rows, key=lambda r: micro_batch_tokens(r["setting"])) for rows in families.values()]
    order = [rows[0] for rows in families.values()] + largest
    for rank in range(1, max((len(rows) for rows in families.values()), default=0)):
        order += [rows[rank] for rows in families.values() if rank < len(rows)]
    picked: list[dict] = []
    for row in order:
        if len(picked) < n and row["setting"] not in picked:
            picked.append(row["setting"])
    return picked


def trains_what_the_seed_trains(setting: dict) -> bool:
    return setting["data.max_seq_length"] >= SEED["data.max_seq_length"]


def _applies(name: str, setting: dict, recipe: list[str]) -> bool:
    knobs = VARIANTS[name][0]
    has = {**dict(o.split("=", 1) for o in recipe), **{k: str(v).lower() for k, v in setting.items()}}
    if all(has.get(k) == str(v).lower() for k, v in knobs.items()):
        return False  # already part of the setting or of the map's recipe
    return not ("model.sdpa_backends" in knobs and has.get("model.attn_implementation", "sdpa") != "sdpa")


def _probe_of(names: list[str]) -> list[str]:
    return [o for name in names for o in VARIANTS[name][2]]


def measure_variants(fastest: dict, args: argparse.Namespace, out: Path, peak: float | None, in_time) -> list:
    """The fastest setting alone with each speed variant, then with those that each gained, together (and with
    the recipe changes that gained on top of that, reported apart)."""
    base = fastest["tokens_per_s"]
    entries = []

    def measure(names: list[str], run_name: str, same_recipe: bool) -> dict | None:
        knobs = {k: v for name in names for k, v in VARIANTS[name][0].items()}
        timeout = args.compile_timeout_s if compiles(knobs) else args.solo_timeout_s
        if not in_time(timeout):
            return None
        extra = _probe_of(names)
        entry = with_mfu(solo({**fastest["setting"], **knobs}, args, out, run_name, extra, timeout_s=timeout), peak)
        entry.update(variant="+".join(names), same_recipe=same_recipe, gain=(entry.get("tokens_per_s") or 0) / base)
        entries.append(entry)
        print(f"variant {entry['variant']}: {entry.get('tokens_per_s')} tokens/s ({entry['gain']:.2f}x)", flush=True)
        return entry

    for name in args.variants:
        if _applies(name, fastest["setting"], fastest.get("recipe", [])):
            measure([name], f"variant_{name}", VARIANTS[name][1])
    # Within noise (2%) is no gain; a recipe change joins only the recipe-changing combination.
    singles = [e for e in entries if e["status"] == "ok" and e["gain"] > 1.02]
    gained = [e["variant"] for e in singles if e["same_recipe"]]
    if len(gained) >= 2:
        measure(gained, "variant_combined", True)
    recipe_changes = [e["variant"] for e in singles if not e["same_recipe"]]
    if gained and recipe_changes:
        measure(gained + recipe_changes, "variant_combined_recipe_change", False)
    return entries


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_8b_synthetic")
    p.add_argument("--budget-gib", type=float, default=24)
    p.add_argument("--slots", type=int, default=5, help="trials at once on the card during the map")
    p.add_argument("--map-timeout-s", type=float, default=420)
    p.add_argument("--solo-timeout-s", type=float, default=120)
    p.add_argument("--compile-timeout-s", type=float, default=200, help="for a solo trial that compiles")
    p.add_argument(
        "--candidates", type=int, default=8, help="stable settings re-measured alone (pick_candidates: by family)"
    )
    p.add_argument(
        "--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), help="speed variants of the fastest"
    )
    p.add_argument(
        "--solo-preload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork solo trials from a warm interpreter (src/sweep/launcher.py); --no-solo-preload starts each as a fresh one",
    )
    p.add_argument("--profile", action="store_true", help="also profile one step of the best stable (kernels)")
    p.add_argument("--deadline-s", type=float, default=None, help="no solo trial starts past this (from start)")
    p.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="more overrides for every map trial and the settings re-measured alone (not the seed)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.time()

    def in_time(need_s: float = args.solo_timeout_s) -> bool:
        return args.deadline_s is None or time.time() - t0 + need_s <= args.deadline_s

    budget = f"{args.budget_gib:g}"
    out_file = Path(
        args.out or ROOT / "benchmarks" / "results" / f"map_{args.model.replace('_synthetic', '')}_{budget}gib.json"
    )
    root = Path(os.environ.get("QLORA_ROOT", ROOT))
    logs = root / "benchmark_logs"
    logs.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": "python -m benchmarks.map_h200 " + " ".join(sys.argv[1:]),
        "model": args.model,
        "vram_budget_gib": args.budget_gib,
    }

    def save() -> None:
        """Written after every phase, so a run cut short by the device's time limit still leaves its figures."""
        result["total_wall_s"] = time.time() - t0
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(result, indent=2, default=str))

    result["matmul"] = card_rate(logs)
    peak = result["matmul"].get("bf16_tflops")
    print(f"bf16 matmul: {peak} TFLOP/s", flush=True)

    rc, result["build_s"] = sh([sys.executable, "-m", "src.models", f"model={args.model}"], logs / "build.log")
    print(f"model built and quantized in {result['build_s']:.0f}s (rc {rc})", flush=True)

    study = f"speed-map-{args.model}-{budget}gib-{time.strftime('%Y%m%d-%H%M%S')}"  # a new study per run
    cmd = [
        sys.executable, "-m", "src.train", "-m", "sweep=speed_map", f"model={args.model}", "data=clinical_notes",
        f"hardware.vram_budget_gib={budget}", "preflight.max_truncated_answer_frac=1.0",
        f"hydra.sweeper.slots_per_gpu={args.slots}", "hydra.sweeper.launch_blocking_rerun=false",
        f"hydra.sweeper.study_name={study}",
        "hydra.sweeper.progress=false", *args.extra,
    ]  # fmt: skip
    result["map_command"] = "python -m src.train " + " ".join(cmd[3:])
    print(result["map_command"], flush=True)
    rc, map_s = sh(cmd, logs / "map.log", timeout=args.map_timeout_s)
    storage = f"sqlite:///{root / 'sweeps' / study / 'optuna.db'}"
    try:
        rows = map_trials(storage, study)
    except KeyError:  # the engine died before it created the study: keep what was measured
        rows = []
        result["map_error"] = (logs / "map.log").read_text()[-4000:]
    launched = [r for r in rows if r["status"] in ("ok", "failed")]
    result.update(
        {
            "map_exit_code": rc,
            "map_wall_s": map_s,
            "gpu_minutes": map_s / 60,  # one card, held for the whole map
            "slots": args.slots,
            "settings": len(rows),
            "launched": len(launched),
            "configs": [r for r in rows if r["status"] in ("ok", "failed")],
            "configs_throughput_note": f"tokens_per_s and step_time_s of `configs` were read with {args.slots} "
            "trials sharing the card: they rank settings roughly and are not solo speeds; solo figures are in "
            "seed_config, candidates_alone, variants_alone and best_stable",
            "skipped": [r for r in rows if r["status"] == "skipped"],
            "per_trial_fixed_s": statistics.median(r["startup_s"] for r in launched if "startup_s" in r)
            if any("startup_s" in r for r in launched)
            else None,
            "per_trial_fixed_s_note": f"median start-up (the engine's launch of the trial to the start of its "
            f"first step) of the map's launched trials, {args.slots} trials at once on one machine",
            "startup_phases_median_s": summarize.median_phases(launched),
        }
    )
    result["counts"] = counts = summarize.counts(rows)
    print(f"map: {len(rows)} settings in {map_s:.0f}s ({counts}), fixed cost {result['per_trial_fixed_s']}", flush=True)
    save()

    stable = [
        r
        for r in rows
        if r["status"] == "ok"
        and r.get("tokens_per_s")
        and r.get("peak_vram_reserved_gib", 0) <= args.budget_gib * 0.9
        and trains_what_the_seed_trains(r["setting"])
    ]
    candidates = pick_candidates(stable, args.candidates)
    args.forkserver = launcher.forkserver(list(launcher.DEFAULT_PRELOAD)) if args.solo_preload else None
    result["solo_launcher"] = "forkserver" if args.forkserver else "interpreter"
    result["seed_config"] = with_mfu(solo(SEED, args, root / "benchmark", "seed", map_recipe=False), peak)
    print(f"seed alone: {result['seed_config'].get('tokens_per_s')} tokens/s", flush=True)
    save()
    alone = []
    for i, setting in enumerate(candidates):
        if not in_time():
            result.setdefault("not_measured_alone", []).append({"setting": setting, "why": "out of time"})
            continue
        entry = with_mfu(solo(setting, args, root / "benchmark", f"candidate{i}"), peak)
        alone.append(entry)
        print(f"candidate {setting} alone: {entry.get('tokens_per_s')} tokens/s", flush=True)
        result["candidates_alone"] = alone
        save()
    ok = [e for e in alone if e["status"] == "ok" and e.get("tokens_per_s")]
    fastest = max(ok, key=lambda e: e["tokens_per_s"], default=None)
    variants = measure_variants(fastest, args, root / "benchmark", peak, in_time) if fastest else []
    result["variants_alone"] = variants
    result["candidates_alone"] = alone
    save()
    fits = [
        e
        for e in [*ok, *variants]
        if e["status"] == "ok"
        and e.get("tokens_per_s")
        and e.get("same_recipe", True)
        and e.get("peak_vram_reserved_gib", 0) <= args.budget_gib * 0.9
    ]
    result["best_stable"] = max(fits, key=lambda e: e["tokens_per_s"]) if fits else None
    if args.profile:
        # Runs of their own: a profiled step is slower, so its figures stay out of the measured ones.
        for key in ("seed_config", "best_stable"):
            compiled = bool(result[key]) and compiles(result[key]["setting"])
            timeout = args.compile_timeout_s if compiled else args.solo_timeout_s
            if result[key] and in_time(timeout):
                name = f"{key}_profile"
                recipe = key != "seed_config"
                extra = [*COMPILED_PROBE, "measure.profile_step=6"] if compiled else ["measure.profile_step=4"]
                done = solo(
                    result[key]["setting"], args, root / "benchmark", name, extra, map_recipe=recipe, timeout_s=timeout
                )
                result[name] = done.get("profile") or done.get("failure")
                print(result[name], flush=True)
                save()
    if result["best_stable"] and result["seed_config"].get("tokens_per_s"):
        result["speedup_vs_seed"] = result["best_stable"]["tokens_per_s"] / result["seed_config"]["tokens_per_s"]
    result["solo_fixed_s"] = [e.get("startup_s") for e in [result["seed_config"], *alone, *variants]]
    # Last: it imports torch and opens a CUDA context, which must not sit on the card during the map.
    result["machine"] = system_tags()
    result["mfu_counting"] = MFU_COUNTING
    result["best_stable_rule"] = (
        "fastest re-measured-alone setting among the map's stable ones (peak reserved <= 90% of the budget, "
        "no OOM) with max_seq_length >= the seed's, rank and accumulation as the seed's (fixed in the map), "
        "or one of its speed variants that trains the same recipe (same_recipe) and stayed within the budget"
    )
    # The map's report (src.report: table, pictures) beside the result file.
    report_dir = out_file.with_suffix("")
    rc, _ = sh([sys.executable, "-m", "src.report", study, "--storage", storage], logs / "report.log", timeout=300)
    if rc == 0:
        report_dir.mkdir(parents=True, exist_ok=True)
        for f in [root / "sweeps" / study / "report.md", *(root / "sweeps" / study).glob("*.png")]:
            if f.exists():
                shutil.copy(f, report_dir / f.name)
        result["report"] = str(report_dir.relative_to(ROOT)) if report_dir.is_relative_to(ROOT) else str(report_dir)
    save()
    print(f"wrote {out_file}", flush=True)
    for key in ("seed_config", "best_stable"):
        e = result.get(key) or {}
        print(
            f"{key}: {e.get('setting')} tokens/s={e.get('tokens_per_s')} "
            f"reserved={e.get('peak_vram_reserved_gib')} mfu={e.get('mfu')}"
        )
    print(f"speedup {result.get('speedup_vs_seed')}; gpu minutes {result['gpu_minutes']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
