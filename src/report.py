"""The stability map of a study: which settings are safe on the card, which are marginal, and why the rest fail.

    python -m src.report [study] [--margin 0.1]     # default: the study whose optuna.db changed last

Every trial is classified from what the sweep engine recorded in the Optuna storage (the same figures MLflow
holds): **stable** (finished, headroom against the VRAM budget at least the margin, the allocator never had to
retry), **marginal** (finished, but under the margin or with allocator retries: one longer batch or a
fragmented cache away from an OOM), **failed** (by kind), **skipped** (not launched: a repeat of a measured
setting, or certain to OOM). The table goes to the terminal; `sweeps/<study>/report.md` and its pictures go
beside the study and onto the sweep's parent MLflow run (artifacts under `report/`), and each trial's run gets
a `report.class` tag so the MLflow UI can filter by it. `src.promote` uses the same classification.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from src import tracking
from src.config import KNOBS, PROJECT_DIR, register_configs
from src.failures import MEMORY, oom_needed_gib

DEFAULT_MARGIN = 0.10
CLASSES = ("stable", "marginal", "failed", "skipped", "pruned", "running")
COLOURS = {"stable": "#2e7d32", "marginal": "#f9a825", "failed": "#c62828", "untested": "#e0e0e0"}
# Short column names for the knobs people sweep; any other knob shows its last segment.
_LABELS = {
    "data.max_seq_length": "seq",
    "trainer.gradient_accumulation_steps": "grad_acc",
    "lora.r": "r",
    "trainer.group_by_length": "group_len",
    "trainer.per_device_train_batch_size": "batch",
    "trainer.gradient_checkpointing": "ckpt",
    "model.attn_implementation": "attn",
    "trainer.padding_free": "pad_free",
    "trainer.packing": "packing",
    "trainer.use_liger_kernel": "liger",
    "trainer.torch_compile": "compile",
    "lora.lora_dropout": "dropout",
    "model.upcast_non_quantized": "fp32_rest",
    "model.sdpa_backends": "sdpa",
    "fault.kind": "fault",
}


class StudyNotFound(LookupError):
    """The study asked for is not in the storage; the message lists those that are."""


# ---- where things are ----------------------------------------------------------------------------------------


def compose(overrides: list[str] | None = None, hydra_config: bool = False) -> DictConfig:
    """The project's config as `python -m src.train` composes it, so the CLIs find sweeps/ and mlruns/ (and
    honour QLORA_ROOT) exactly where the trials put them."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(PROJECT_DIR / "conf"), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=overrides or [], return_hydra_config=hydra_config)
    finally:
        GlobalHydra.instance().clear()


@dataclass(frozen=True)
class Places:
    sweeps_dir: Path
    tracking_uri: str
    registered_model: str


def places(tracking_uri: str | None = None) -> Places:
    cfg = compose()
    return Places(
        sweeps_dir=Path(cfg.paths.sweeps_dir),
        tracking_uri=tracking_uri or str(cfg.tracking.uri),
        registered_model=str(cfg.tracking.registered_model),
    )


def study_storage(sweeps_dir: Path, name: str) -> str:
    """The engine's default storage for a study (see SweepEngine.storage_url)."""
    return f"sqlite:///{(sweeps_dir / name / 'optuna.db').resolve()}"


def find_study(name: str | None, sweeps_dir: Path, storage: str | None = None) -> tuple[str, str]:
    """(study name, storage URL): the named study, or the latest one; StudyNotFound lists what exists."""
    if storage:
        summaries = optuna.get_all_study_summaries(storage, include_best_trial=False)
        names = [s.study_name for s in summaries]
        if name is None:
            if not summaries:
                raise StudyNotFound(f"no study in {storage}")
            latest = max(summaries, key=lambda s: (s.datetime_start is not None, s.datetime_start or 0))
            return latest.study_name, storage
        if name not in names:
            raise StudyNotFound(f"no study '{name}' in {storage}; studies there: {', '.join(sorted(names)) or 'none'}")
        return name, storage
    dbs = sorted(sweeps_dir.glob("*/optuna.db"), key=lambda p: p.stat().st_mtime)
    if name is None:
        if not dbs:
            raise StudyNotFound(
                f"no study under {sweeps_dir} (run a sweep first: python -m src.train -m hydra/sweeper=optuna)"
            )
        return dbs[-1].parent.name, study_storage(sweeps_dir, dbs[-1].parent.name)
    if not (sweeps_dir / name / "optuna.db").exists():
        found = ", ".join(p.parent.name for p in reversed(dbs)) or "none"
        raise StudyNotFound(f"no study '{name}' under {sweeps_dir}; studies there (latest first): {found}")
    return name, study_storage(sweeps_dir, name)


# ---- the trials, classified ------------------------------------------------------------------------------------


@dataclass
class TrialRow:
    number: int
    params: dict[str, Any]
    distributions: dict[str, BaseDistribution]
    verdict: str  # one of CLASSES
    detail: str  # why: "oom at step 3", "headroom 6% < 10%", "same setting as trial 2"
    metrics: dict[str, float]
    failure_kind: str | None = None
    failure_message: str | None = None
    run_id: str | None = None
    because_of: int | None = None  # skipped: the trial whose outcome stands for this one
    slot: str | None = None  # the engine's slot: "cuda0", "cuda0#2" (third of the trials sharing card 0), "cpu1"


def classify(trial: FrozenTrial, margin: float) -> tuple[str, str]:
    """(class, detail) of one trial. Headroom is the contract's: 1 - peak reserved / budget."""
    a = trial.user_attrs
    status = a.get("trial.status")
    if status == "skipped":
        origin = a.get("skipped.because_of", a.get("skipped.duplicate_of"))
        detail = a.get("skipped.reason") or (f"repeat of trial {origin}" if origin is not None else "not launched")
        return "skipped", str(detail)
    if trial.state in (TrialState.RUNNING, TrialState.WAITING):
        return "running", trial.state.name.lower()
    if status == "pruned" or trial.state == TrialState.PRUNED:
        return "pruned", "pruned"
    if status == "ok":
        headroom = a.get("vram_headroom_frac")
        if headroom is None and a.get("peak_vram_reserved_gib") is not None and a.get("vram_budget_gib"):
            headroom = 1.0 - a["peak_vram_reserved_gib"] / a["vram_budget_gib"]
        notes = []
        if headroom is None:
            notes.append("no VRAM measurement")
        elif headroom < margin:
            notes.append(f"headroom {headroom:.0%} < {margin:.0%}")
        if a.get("alloc_retries"):
            notes.append(f"{a['alloc_retries']:g} allocator retries")
        return ("marginal", "; ".join(notes)) if notes else ("stable", f"headroom {headroom:.0%}")
    kind = a.get("failure.kind", "other")
    step = a.get("failure.step")
    detail = f"{kind} at step {step}" if step is not None else str(kind)
    return "failed", detail + (" (retried)" if a.get("retried") else "")


@dataclass
class Sweep:
    """A study as the report and the promotion see it."""

    name: str
    storage: str
    study_dir: Path
    objectives: list[str]
    directions: list[str]
    margin: float
    budget: float | None
    knobs: list[str]
    rows: list[TrialRow]
    parent_run_id: str | None
    probe_overrides: list[str]  # hydra.sweeper.trial_overrides: what made each trial a short probe

    def trial_dir(self, number: int) -> Path:
        return self.study_dir / "trials" / f"{number:03d}"

    def row(self, number: int) -> TrialRow | None:
        return next((r for r in self.rows if r.number == number), None)

    def counts(self) -> Counter[str]:
        return Counter(r.verdict for r in self.rows)

    def card_shared_by(self) -> int:
        """The most trials that ran on one card at once (`hydra.sweeper.slots_per_gpu`), from the slots the
        trials ran on; 1 when each trial had its card to itself (or ran on a CPU)."""
        copies: dict[str, set[str]] = {}
        for r in self.rows:
            if r.slot and r.slot.startswith("cuda") and "#" in r.slot:
                card, copy = r.slot.split("#", 1)
                copies.setdefault(card, set()).add(copy)
        return max((len(c) for c in copies.values()), default=1)

    def shared_card_caption(self) -> str | None:
        """Under tokens/s wherever the figures show (picture, terminal table), when trials shared a card."""
        shared = self.card_shared_by()
        return (
            f"tokens/s read with up to {shared} trials sharing a card: a ranking, not solo speeds"
            if shared > 1
            else None
        )

    def varying_knobs(self) -> list[str]:
        """Knobs that took more than one value: the ones worth a column, an axis or a label."""
        return [k for k in self.knobs if len({_key(r.params.get(k)) for r in self.rows if k in r.params}) > 1]

    def effective(self, row: TrialRow) -> str:
        """A skipped trial's class on the map: its origin's (a repeat, or a certain OOM), else skipped."""
        if row.verdict != "skipped":
            return row.verdict
        origin = self.row(row.because_of) if row.because_of is not None else None
        if origin is not None and origin.verdict != "skipped":
            return origin.verdict
        return "failed" if row.failure_kind else "skipped"

    def best(self) -> TrialRow | None:
        """The best stable trial by the first objective (ties: the earlier trial)."""
        objective, maximize = self.objectives[0], self.directions[0] == "maximize"
        ranked = [r for r in self.rows if r.verdict == "stable" and objective in r.metrics]
        if not ranked:
            return None
        return max(ranked, key=lambda r: ((1 if maximize else -1) * r.metrics[objective], -r.number))


def sweep_settings(study: optuna.Study, study_dir: Path, tracking_uri: str | None) -> dict[str, Any]:
    """The sweep's objectives, headroom margin and per-trial probe overrides. The engine's parent run is the
    authority (it records what the sweep ran with, command-line overrides included); a trial's hydra.yaml
    holds our sweeper's node only when a `sweep=...` file selected it; the project's defaults come last."""
    found: dict[str, Any] = {}
    tags = _parent_tags(study, tracking_uri)
    for key in ("objectives", "headroom_margin", "trial_overrides"):
        if f"sweep.{key}" in tags:
            found[key] = json.loads(tags[f"sweep.{key}"])
    if isinstance(found.get("objectives"), dict):
        found["objectives"] = list(found["objectives"])  # {metric: direction}, in the study's order
    sources = [
        OmegaConf.load(p).hydra.get("sweeper", {}) for p in sorted(study_dir.glob("trials/*/.hydra/hydra.yaml"))[:1]
    ]
    sources.append(compose(["hydra/sweeper=optuna"], hydra_config=True).hydra.sweeper)
    for node in sources:
        if "trial_overrides" not in node:  # Hydra's basic sweeper: the trial was not told ours
            continue
        for key in ("objectives", "headroom_margin", "trial_overrides"):
            value = node.get(key)
            found.setdefault(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
    return found


def store_exists(tracking_uri: str) -> bool:
    """False for a SQLite store not made yet: opening it would create it."""
    return not tracking_uri.startswith("sqlite:///") or Path(tracking_uri.removeprefix("sqlite:///")).exists()


def _parent_tags(study: optuna.Study, tracking_uri: str | None) -> dict[str, str]:
    parent = study.user_attrs.get("mlflow_parent_run_id")
    if not (parent and tracking_uri and store_exists(tracking_uri)):
        return {}
    try:
        from mlflow.tracking import MlflowClient

        return dict(MlflowClient(tracking_uri).get_run(parent).data.tags)
    except Exception:  # noqa: BLE001 - the store is elsewhere or the run gone: the other sources remain
        return {}


def load(
    name: str | None,
    sweeps_dir: Path,
    storage: str | None = None,
    margin: float | None = None,
    tracking_uri: str | None = None,
) -> Sweep:
    """Read a study and classify every trial. `margin` None: the sweep's own `headroom_margin` (or 10%)."""
    name, url = find_study(name, sweeps_dir, storage)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=url)
    study_dir = sweeps_dir / name
    settings = sweep_settings(study, study_dir, tracking_uri)
    objectives = settings.get("objectives") or ["tokens_per_s"]
    objectives = [objectives] if isinstance(objectives, str) else list(objectives)
    directions = [d.name.lower() for d in study.directions]
    if margin is None:
        margin = float(settings.get("headroom_margin") or DEFAULT_MARGIN)
    rows, budgets = [], []
    for t in study.get_trials(deepcopy=False):
        verdict, detail = classify(t, margin)
        a = t.user_attrs
        origin = a.get("skipped.because_of", a.get("skipped.duplicate_of"))
        rows.append(
            TrialRow(
                number=t.number,
                params=dict(t.params),
                distributions=dict(t.distributions),
                verdict=verdict,
                detail=detail,
                metrics={k: float(v) for k, v in a.items() if _is_metric(k, v)},
                failure_kind=a.get("failure.kind"),
                failure_message=a.get("failure.message"),
                run_id=a.get("mlflow_run_id"),
                because_of=int(origin) if origin is not None else None,
                slot=a.get("sweep.slot"),
            )
        )
        if a.get("vram_budget_gib"):
            budgets.append(float(a["vram_budget_gib"]))
    seen = {k for r in rows for k in r.params}
    knobs = [k for k in KNOBS if k in seen] + sorted(seen - set(KNOBS))
    return Sweep(
        name=name,
        storage=url,
        study_dir=study_dir,
        objectives=objectives,
        directions=directions,
        margin=margin,
        budget=max(budgets) if budgets else None,
        knobs=knobs,
        rows=rows,
        parent_run_id=study.user_attrs.get("mlflow_parent_run_id"),
        probe_overrides=[str(o) for o in settings.get("trial_overrides") or []],
    )


def _is_metric(key: str, value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and "." not in key
        and key not in ("mlflow_run_id", "retry_of")
    )


def _key(value: Any) -> tuple[int, float | str]:
    """A sort key over mixed knob values: numbers (bools too) by value, then the rest as text."""
    if isinstance(value, int | float):
        return (0, float(value))
    return (1, str(value))


# ---- which knobs matter ------------------------------------------------------------------------------------------


@dataclass
class Importance:
    target: str
    values: dict[str, float]  # knob -> share of the explained variance; empty when not computed
    method: str
    note: str
    n_trials: int


def importance(sweep: Sweep, target: str, direction: str) -> Importance:
    """Optuna's fANOVA importances of the knobs for `target`, over the trials that finished (skipped repeats
    excluded: they add no measurement). PED-ANOVA when fANOVA cannot fit; a reason when neither can run."""
    rows = [r for r in sweep.rows if r.verdict in ("stable", "marginal") and target in r.metrics]
    n = len(rows)
    if n < 2:
        return Importance(target, {}, "", f"not computed: {n} finished trial(s) with {target}; 2 or more needed", n)
    knobs = [k for k in sweep.knobs if all(k in r.params for r in rows) and len({_key(r.params[k]) for r in rows}) > 1]
    if not knobs:
        return Importance(target, {}, "", "not computed: no knob took two values among the finished trials", n)
    values = [r.metrics[target] for r in rows]
    if max(values) - min(values) <= 1e-9 * max(1.0, abs(max(values))):
        return Importance(
            target,
            {},
            "",
            f"not computed: {target} was {values[0]:.4g} in all {n} finished trials (no knob moved it)",
            n,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = optuna.create_study(direction=direction)
        for r in rows:
            probe.add_trial(
                optuna.trial.create_trial(
                    params={k: r.params[k] for k in knobs},
                    distributions={k: r.distributions[k] for k in knobs},
                    value=r.metrics[target],
                )
            )
        from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator, get_param_importances

        tried = []
        for method, evaluator in (
            (
                "fANOVA (optuna.importance.FanovaImportanceEvaluator, 64 trees, seed 0)",
                FanovaImportanceEvaluator(seed=0),
            ),
            ("PED-ANOVA (optuna.importance.PedAnovaImportanceEvaluator)", PedAnovaImportanceEvaluator()),
        ):
            try:
                found = get_param_importances(probe, evaluator=evaluator)
                note = f"fANOVA could not fit ({tried[0]}); " if tried else ""
                if n < 10:
                    note += f"only {n} finished trials: a hint, not a measurement"
                return Importance(target, {k: float(v) for k, v in found.items()}, method, note, n)
            except Exception as exc:  # noqa: BLE001 - too few or degenerate trials: say so, try the next
                tried.append(f"{type(exc).__name__}: {exc}")
    return Importance(target, {}, "", "not computed: " + "; ".join(tried), n)


# ---- pictures --------------------------------------------------------------------------------------------------------


def label(knob: str) -> str:
    return _LABELS.get(knob, knob.rsplit(".", 1)[-1])


def map_axes(sweep: Sweep, ranking: dict[str, float]) -> tuple[str | None, str | None]:
    """The two knobs of the map: max_seq_length (what users change first) against the knob that moves
    memory most (importance `ranking`), or else the one with most values, in the KNOBS order."""
    varying = sweep.varying_knobs()
    if not varying:
        return None, None
    x = "data.max_seq_length" if "data.max_seq_length" in varying else max(varying, key=lambda k: ranking.get(k, -1))
    rest = [k for k in varying if k != x]
    if not rest:
        return x, None
    values = {k: len({_key(r.params.get(k)) for r in sweep.rows}) for k in rest}
    return x, max(rest, key=lambda k: (ranking.get(k, -1.0), values[k], -rest.index(k)))


def _values(sweep: Sweep, knob: str | None) -> list[Any]:
    if knob is None:
        return [None]
    return sorted({_key(r.params[knob]): r.params[knob] for r in sweep.rows if knob in r.params}.values(), key=_key)


def _outcome(sweep: Sweep, row: TrialRow) -> str:
    verdict = sweep.effective(row)
    if verdict == "failed":
        verdict = row.failure_kind or "failed"
    return f"{verdict} (inferred)" if row.verdict == "skipped" else verdict


def _repeat(sweep: Sweep, row: TrialRow) -> bool:
    """A skipped trial with exactly its origin's setting: the map counts that setting once."""
    origin = sweep.row(row.because_of) if row.because_of is not None else None
    return row.verdict == "skipped" and origin is not None and origin.params == row.params


def plot_map(sweep: Sweep, x: str | None, y: str | None, path: Path) -> None:
    """Stable / marginal / failed over two knobs. A cell holds every trial at that pair (other knobs may
    differ): its colour is the best outcome there, its text lists them all."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    xs, ys = _values(sweep, x), _values(sweep, y)
    order = ["untested", "failed", "marginal", "stable"]
    grid = [[0] * len(xs) for _ in ys]
    text = [[""] * len(xs) for _ in ys]
    for j, yv in enumerate(ys):
        for i, xv in enumerate(xs):
            cell = [
                r
                for r in sweep.rows
                if (x is None or _key(r.params.get(x)) == _key(xv))
                and (y is None or _key(r.params.get(y)) == _key(yv))
                and sweep.effective(r) in ("stable", "marginal", "failed")
                and not _repeat(sweep, r)
            ]
            if not cell:
                text[j][i] = "not run"
                continue
            grid[j][i] = max(order.index(sweep.effective(r)) for r in cell)
            counts = Counter(_outcome(sweep, r) for r in cell)
            lines = [f"{n} {o}" if n > 1 else o for o, n in counts.most_common()]
            text[j][i] = "\n".join(lines[:3] + ([f"+{len(lines) - 3} more"] if len(lines) > 3 else []))
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 * len(xs) + 1.5), max(2.5, 1.0 * len(ys) + 1.5)))
    ax.imshow(grid, cmap=ListedColormap([COLOURS[o] for o in order]), vmin=0, vmax=3, aspect="auto")
    for j in range(len(ys)):
        for i in range(len(xs)):
            dark = grid[j][i] in (1, 3)
            ax.text(i, j, text[j][i], ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(xs)), [fmt(v) for v in xs])
    ax.set_yticks(range(len(ys)), [fmt(v) for v in ys] if y else [""])
    ax.set_xlabel(x or "")
    ax.set_ylabel(y or "")
    budget = f"{sweep.budget:g} GiB budget, " if sweep.budget else ""
    ax.set_title(f"{sweep.name}: stability ({budget}margin {sweep.margin:.0%})", fontsize=10)
    ax.legend(
        handles=[Patch(color=COLOURS[o], label=o) for o in ("stable", "marginal", "failed", "untested")],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_memory(sweep: Sweep, x: str | None, series: str | None, path: Path) -> str:
    """Peak reserved VRAM against `x` (max_seq_length), one line per value of `series`, budget as a line.
    Returns the metric drawn: host RSS when the study ran without a GPU (VRAM all zero)."""
    import matplotlib.pyplot as plt

    finished = [r for r in sweep.rows if r.verdict in ("stable", "marginal")]
    metric = "peak_vram_reserved_gib"
    if not any(r.metrics.get(metric) for r in finished):
        metric = "peak_rss_gib"
    xs = _values(sweep, x)
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in xs)
    pos = (lambda v: float(v)) if numeric else (lambda v: float(xs.index(v)) if v in xs else 0.0)  # noqa: E731
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    cmap = plt.get_cmap("viridis")
    svals = _values(sweep, series)
    for n, sv in enumerate(svals):
        colour = cmap(n / max(1, len(svals) - 1)) if len(svals) > 1 else "#1565c0"
        mine = [r for r in finished if series is None or _key(r.params.get(series)) == _key(sv)]
        points = sorted(
            ((pos(r.params.get(x)), r.metrics[metric], r) for r in mine if metric in r.metrics), key=lambda p: p[0]
        )
        if not points:
            continue
        peak: dict[float, float] = {}
        for px, py, _ in points:
            peak[px] = max(py, peak.get(px, py))
        name = f"{label(series)}={fmt(sv)}" if series else "finished"
        ax.plot(list(peak), list(peak.values()), "-", color=colour, label=name, alpha=0.8)
        for px, py, r in points:
            ax.plot(
                px,
                py,
                "o" if r.verdict == "stable" else "D",
                color=colour,
                mfc="white" if r.verdict != "stable" else colour,
            )
    if metric.startswith("peak_vram") and sweep.budget:
        ax.axhline(sweep.budget, color=COLOURS["failed"], ls="--", lw=1.2, label=f"budget {sweep.budget:g} GiB")
        ax.axhline(
            sweep.budget * (1 - sweep.margin),
            color=COLOURS["marginal"],
            ls=":",
            lw=1.0,
            label=f"margin {sweep.margin:.0%}",
        )
        ooms = [r for r in sweep.rows if r.verdict == "failed" and r.failure_kind in MEMORY and x in r.params]
        for r in ooms:
            needed = oom_needed_gib(r.metrics, sweep.budget)
            ax.plot(
                pos(r.params[x]),
                min(max(needed, sweep.budget), 1.15 * sweep.budget),
                "x",
                color=COLOURS["failed"],
                ms=9,
            )
        if ooms:
            ax.plot([], [], "x", color=COLOURS["failed"], label="OOM (needed more)")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("peak reserved VRAM (GiB)")
        title = "peak VRAM"
    else:
        ax.set_ylabel("peak host RSS (GiB)")
        title = "peak host memory (no GPU in this study: VRAM was 0)"
    if not numeric:
        ax.set_xticks(range(len(xs)), [fmt(v) for v in xs])
    elif xs and xs != [None]:
        ax.set_xticks([float(v) for v in xs], [fmt(v) for v in xs])
    ax.set_xlabel(x or "")
    ax.set_title(f"{sweep.name}: {title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return metric


def plot_throughput(sweep: Sweep, path: Path, limit: int = 40) -> None:
    """tokens/s of the settings that finished: stable first in colour, marginal in amber (best at the top)."""
    import matplotlib.pyplot as plt

    rows = [r for r in sweep.rows if r.verdict in ("stable", "marginal") and "tokens_per_s" in r.metrics]
    rows = sorted(rows, key=lambda r: r.metrics["tokens_per_s"], reverse=True)[:limit]
    fig, ax = plt.subplots(figsize=(7.0, max(2.5, 0.4 * len(rows) + 1.2)))
    if not rows:
        ax.text(0.5, 0.5, "no trial finished: nothing to compare", ha="center", va="center", fontsize=12)
        ax.set_axis_off()
    else:
        # label each bar by the knobs that differ among the bars shown
        knobs = [k for k in sweep.knobs if len({_key(r.params.get(k)) for r in rows}) > 1]
        names = [f"#{r.number}  " + " ".join(f"{label(k)}={fmt(r.params.get(k))}" for k in knobs) for r in rows]
        speeds = [r.metrics["tokens_per_s"] for r in rows]
        bars = ax.barh(range(len(rows)), speeds, color=[COLOURS[r.verdict] for r in rows])
        ax.set_yticks(range(len(rows)), names, fontsize=8)
        ax.invert_yaxis()
        ax.bar_label(bars, [f"{s:,.0f}" for s in speeds], padding=3, fontsize=8)
        caption = sweep.shared_card_caption()
        ax.set_xlabel("tokens/s (non-padding, warm-up excluded)" + (f"\n{caption}" if caption else ""))
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{sweep.name}: throughput of the settings that finished (amber: marginal)", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "-" if value is None else str(value)


# ---- the table and report.md -----------------------------------------------------------------------------------

# Metrics a trial reads slower when other trials share its card (memory figures are each process's own).
SPEED_METRICS = ("tokens_per_s", "samples_per_s", "step_time_s", "model_tflops_per_s")

_FIGURES = (
    ("peak_vram_allocated_gib", "alloc GiB", "{:.2f}"),
    ("peak_vram_reserved_gib", "reserved GiB", "{:.2f}"),
    ("peak_vram_device_gib", "device GiB", "{:.2f}"),
    ("vram_headroom_frac", "headroom", "{:.0%}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("step_time_s", "step s", "{:.3f}"),
)


def _cells(sweep: Sweep, row: TrialRow) -> list[str]:
    figures = [fmt.format(row.metrics[m]) if m in row.metrics else "" for m, _, fmt in _FIGURES]
    if row.verdict in ("failed", "skipped") and row.metrics.get("peak_vram_reserved_gib", 0) == 0:
        figures = ["" for _ in figures]  # a failed trial's zeros are "not measured", not "used nothing"
    return [str(row.number), *(fmt(row.params.get(k)) for k in sweep.knobs), row.verdict, row.detail, *figures]


def _headers(sweep: Sweep) -> list[str]:
    return ["#", *(label(k) for k in sweep.knobs), "class", "detail", *(h for _, h, _ in _FIGURES)]


def table(sweep: Sweep) -> Any:
    from rich.table import Table

    styles = {"stable": "green", "marginal": "yellow", "failed": "red", "skipped": "dim", "pruned": "dim"}
    t = Table(
        title=f"{sweep.name}: {summary(sweep)}",
        title_justify="left",
        caption=sweep.shared_card_caption(),
        caption_justify="left",
    )
    for h in _headers(sweep):
        t.add_column(h, justify="right" if h not in ("class", "detail") else "left")
    for row in sweep.rows:
        t.add_row(*_cells(sweep, row), style=styles.get(row.verdict))
    return t


def summary(sweep: Sweep) -> str:
    c = sweep.counts()
    kinds = Counter(r.failure_kind or "other" for r in sweep.rows if r.verdict == "failed")
    failed = f"{c['failed']} failed" + (f" ({', '.join(f'{n} {k}' for k, n in kinds.most_common())})" if kinds else "")
    parts = [f"{len(sweep.rows)} trials", f"{c['stable']} stable", f"{c['marginal']} marginal", failed]
    parts += [f"{c[k]} {k}" for k in ("skipped", "pruned", "running") if c[k]]
    return ", ".join(parts)


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def markdown(sweep: Sweep, imps: list[Importance], axes: tuple[str | None, str | None], memory_metric: str) -> str:
    """report.md, with every credential redacted (it names the storage, quotes failure messages, and is
    uploaded to MLflow as an artifact)."""
    return tracking.redact_text(_markdown(sweep, imps, axes, memory_metric))


def _markdown(sweep: Sweep, imps: list[Importance], axes: tuple[str | None, str | None], memory_metric: str) -> str:
    objective, direction = sweep.objectives[0], sweep.directions[0]
    best = sweep.best()
    shared = sweep.card_shared_by()
    shared_note = (
        f"Throughput here was read with up to {shared} trials sharing each card (`hydra.sweeper.slots_per_gpu`): "
        "each ran slower than it would alone, by an amount that depends on what ran beside it, so these figures "
        "rank settings roughly and are not speeds to quote. Run the settings you care about alone "
        "(`python -m src.train` with the setting's overrides) before comparing them or quoting one."
        if shared > 1
        else ""
    )
    out = [
        f"# Stability map: {sweep.name}",
        "",
        f"{summary(sweep)}. Budget {sweep.budget:g} GiB, margin {sweep.margin:.0%}."
        if sweep.budget
        else f"{summary(sweep)}. Margin {sweep.margin:.0%}.",
        "",
    ]
    if best:
        m = best.metrics
        out += [
            f"Best stable setting by the study's objective ({objective}, {direction}): **trial {best.number}** "
            f"({', '.join(f'{k}={fmt(best.params[k])}' for k in sweep.knobs if k in best.params)}): "
            f"{m.get(objective, float('nan')):.4g} {objective}, peak reserved {m.get('peak_vram_reserved_gib', 0):.2f} GiB, "
            f"headroom {m.get('vram_headroom_frac', float('nan')):.0%}"
            + (
                f" ({objective} read on a card shared by up to {shared} trials: see Throughput)"
                if shared > 1 and objective in SPEED_METRICS
                else ""
            )
            + f". Promote it: `python -m src.promote {sweep.name}`.",
            "",
        ]
    else:
        out += ["No stable setting: nothing to promote.", ""]
    x, y = axes
    out += [
        "## Map",
        "",
        "![stability map](stability_map.png)",
        "",
        f"Each cell is a pair of {x or 'settings'}{' × ' + y if y else ''}; other knobs may differ within a cell. Its "
        "colour is the best outcome among the trials there, its text lists every outcome (failures by kind). "
        "A repeated setting counts once; a setting skipped as a certain OOM shows as an inferred OOM.",
        "",
        "## Memory",
        "",
        "![peak memory](peak_vram.png)",
        "",
        "Peak reserved VRAM (what the allocator held, the figure headroom is measured on) per finished trial; "
        "filled: stable, hollow: marginal; the line joins the highest peak at each value. Dashed: the budget; "
        "dotted: the margin below it; crosses: OOMs, drawn at what they held plus what they asked for (capped)."
        if memory_metric.startswith("peak_vram")
        else "This study ran without a GPU (peak VRAM 0), so the picture shows peak host RSS instead.",
        "",
        "## Throughput",
        "",
        "![tokens per second](tokens_per_s.png)",
        "",
        *([shared_note, ""] if shared_note else []),
        "## Which knobs matter",
        "",
    ]
    for imp in imps:
        out.append(f"**{imp.target}** ({imp.n_trials} finished trials)")
        out.append("")
        if imp.values:
            out.append(_md_table(["knob", "importance"], [[k, f"{v:.2f}"] for k, v in imp.values.items()]))
            out += ["", f"Method: {imp.method}." + (f" Note: {imp.note}." if imp.note else "")]
        else:
            out.append(f"{imp.note[0].upper()}{imp.note[1:]}.")
        out.append("")
    out += [
        "How these were computed: Optuna's parameter importances (`optuna.importance.get_param_importances`) over "
        "the trials that finished (stable and marginal; failed and skipped trials have no full measurement), "
        "with each knob the sweep varied as a parameter and the metric as the value. fANOVA fits a random forest "
        "and attributes the variance of the metric to each knob (shares sum to 1); PED-ANOVA is used when fANOVA "
        "cannot fit. Knobs that never changed among those trials are left out.",
        "",
        "## Trials",
        "",
        _md_table(_headers(sweep), [_cells(sweep, r) for r in sweep.rows]),
        "",
    ]
    failures: dict[str, list[TrialRow]] = {}
    for r in sweep.rows:
        if r.verdict == "failed":
            failures.setdefault(r.failure_kind or "other", []).append(r)
    if failures:
        out += ["## Failures", ""]
        for kind, rows in sorted(failures.items(), key=lambda kv: -len(kv[1])):
            messages = Counter(r.failure_message or "" for r in rows)
            out.append(f"- **{kind}** ({len(rows)}: trials {', '.join(str(r.number) for r in rows)})")
            out += [f"  - `{m[:200]}`" + (f" ×{n}" if n > 1 else "") for m, n in messages.most_common(3) if m]
        out.append("")
    out += [
        "## Classes",
        "",
        f"- **stable**: finished, peak reserved VRAM leaves at least {sweep.margin:.0%} of the budget free, and the "
        "allocator never had to retry (`alloc_retries` 0).",
        "- **marginal**: finished, but under the margin or with allocator retries: a longer batch or a fragmented "
        "cache away from an OOM.",
        "- **failed**: by `failure.kind` (oom, data_error and config_error are the setting's own; the others are "
        "the process's: segfault, timeout, ...).",
        "- **skipped**: not launched; the trial it follows from tells its outcome.",
        "",
        f"Storage: `{sweep.storage}`. Trial logs: `{sweep.study_dir / 'trials'}`.",
        "",
    ]
    return "\n".join(out)


# ---- the whole report ---------------------------------------------------------------------------------------------


@dataclass
class Report:
    sweep: Sweep
    files: list[Path]
    importances: list[Importance]
    logged_to: str | None


def write(sweep: Sweep) -> Report:
    """report.md and its pictures in the study's folder."""
    import matplotlib

    matplotlib.use("Agg")
    sweep.study_dir.mkdir(parents=True, exist_ok=True)
    imps = [importance(sweep, "peak_vram_reserved_gib", "minimize"), importance(sweep, "tokens_per_s", "maximize")]
    axes = map_axes(sweep, imps[0].values or imps[1].values)
    files = [sweep.study_dir / n for n in ("report.md", "stability_map.png", "peak_vram.png", "tokens_per_s.png")]
    plot_map(sweep, *axes, files[1])
    metric = plot_memory(sweep, *axes, files[2])
    plot_throughput(sweep, files[3])
    files[0].write_text(markdown(sweep, imps, axes, metric))
    return Report(sweep, files, imps, None)


def log_to_mlflow(report: Report, tracking_uri: str) -> str | None:
    """The report onto the sweep's parent run (artifacts `report/`, counts as tags); each trial's run gets
    its class as the tag `report.class`. Returns the parent run id, or None (with a warning) when unreachable."""
    from mlflow.tracking import MlflowClient

    sweep = report.sweep
    if not sweep.parent_run_id:
        print(f"warning: study {sweep.name} names no MLflow parent run; report not logged", file=sys.stderr)
        return None
    tracking.setup(tracking_uri)
    client = MlflowClient(tracking_uri)
    try:
        client.get_run(sweep.parent_run_id)
    except Exception as exc:  # noqa: BLE001 - the files on disk are the report; MLflow is a copy
        where = tracking.redact_text(f"{tracking_uri} ({exc})")
        print(f"warning: parent run {sweep.parent_run_id} not found in {where}", file=sys.stderr)
        return None
    for path in report.files:
        client.log_artifact(sweep.parent_run_id, str(path), "report")
    counts = sweep.counts()
    best = sweep.best()
    tags: dict[str, Any] = {f"report.{k}": counts[k] for k in ("stable", "marginal", "failed", "skipped")}
    tags["report.margin"] = sweep.margin
    tags["report.best_trial"] = best.number if best else "none"
    for imp in report.importances:
        if imp.values:
            tags[f"report.importance.{imp.target}"] = json.dumps({k: round(v, 3) for k, v in imp.values.items()})
    tracking.set_tags(client, sweep.parent_run_id, tags)
    for row in sweep.rows:
        if row.run_id:
            tracking.set_tags(client, row.run_id, {"report.class": row.verdict, "report.detail": row.detail})
    return sweep.parent_run_id


def cli_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("study", nargs="?", help="study name (a folder of sweeps/); default: the latest")
    p.add_argument(
        "--margin",
        type=float,
        default=None,
        help="headroom share below which a setting is marginal "
        f"(default: the sweep's hydra.sweeper.headroom_margin, else {DEFAULT_MARGIN})",
    )
    p.add_argument("--storage", help="Optuna storage URL when not sweeps/<study>/optuna.db (e.g. postgresql://...)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: tracking.uri of the project's config)")
    return p


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    p = cli_parser("python -m src.report", "The stability map of a study: terminal table, sweeps/<study>/report.md.")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the report to the sweep's parent run")
    args = p.parse_args(argv)
    where = places(args.tracking_uri)
    try:
        sweep = load(args.study, where.sweeps_dir, args.storage, args.margin, where.tracking_uri)
    except StudyNotFound as exc:
        print(f"error: {tracking.redact_text(str(exc))}", file=sys.stderr)
        return 2
    report = write(sweep)
    if not args.no_mlflow:
        report.logged_to = log_to_mlflow(report, where.tracking_uri)
    console = Console() if sys.stdout.isatty() else Console(width=180)
    console.print(table(sweep))
    for imp in report.importances:
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(imp.values.items())[:3])
        print(f"what moves {imp.target}: {top or imp.note}")
    best = sweep.best()
    print(f"report: {report.files[0]}" + (f" (also on MLflow run {report.logged_to})" if report.logged_to else ""))
    if best:
        print(f"best stable: trial {best.number}; promote it: python -m src.promote {sweep.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
