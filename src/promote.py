"""Promote the best stable trial of a study to production, reviewably and reproducibly.

    python -m src.promote [study] [--dry-run] [--margin 0.1] [--trial N] [--registered-model llama3-qlora]

The trial is the best *stable* one (src.report's classes) by the study's first objective and direction, or
the stable trial `--trial N`. It becomes a new version of the registered model (`tracking.registered_model`,
`llama3-qlora`) whose source is the trial run's `adapter/` (or the run's artifacts when it saved none), tagged
with the figures and the study/trial, its composed config logged to the run as `config/`; the alias
`production` moves to it and older versions stay. `conf/experiment/production.yaml` then holds the trial's
settings, so that `python -m src.train experiment=production` composes exactly what was measured: the file is
checked by composing it before anything changes. When nothing qualifies the reason is printed, nothing
changes, and the exit status is 1.
"""

from __future__ import annotations

import difflib
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from src import report, tracking
from src.config import PROJECT_DIR
from src.report import Sweep, TrialRow

ALIAS = "production"
DEFAULT_EXPERIMENT_FILE = PROJECT_DIR / "conf" / "experiment" / "production.yaml"
# Groups and key prefixes that say where a run records or how a sweep tests, not what is trained: never
# carried into production (a fault injected by a sweep must not become a setting).
_NOT_SETTINGS = ("hydra", "sweep", "experiment", "fault", "paths", "tracking")
# Composed keys that legitimately differ between a trial and experiment=production (output locations).
_PER_RUN_KEYS = ("trainer.output_dir",)


class NotPromotable(Exception):
    """No trial qualifies (or the one asked for does not); the message says why."""


# ---- choosing ------------------------------------------------------------------------------------------------------


def choose(sweep: Sweep, trial: int | None = None) -> TrialRow:
    """The best stable trial by the study's first objective, or the stable trial asked for."""
    if trial is not None:
        row = sweep.row(trial)
        if row is None:
            raise NotPromotable(f"study {sweep.name} has no trial {trial}")
        if row.verdict != "stable":
            raise NotPromotable(f"trial {trial} is {row.verdict} ({row.detail}), not stable")
        return row
    best = sweep.best()
    if best is not None:
        return best
    stable = [r for r in sweep.rows if r.verdict == "stable"]
    if stable:
        raise NotPromotable(f"{len(stable)} stable trial(s), but none recorded the objective {sweep.objectives[0]}")
    raise NotPromotable(why_none(sweep))


def why_none(sweep: Sweep) -> str:
    """Why no trial is stable, in counts: "all 12 trials failed: 9 oom, 3 timeout"."""
    if not sweep.rows:
        return f"study {sweep.name} has no trials"
    by = Counter(r.verdict for r in sweep.rows)
    kinds = Counter(r.failure_kind or "other" for r in sweep.rows if r.verdict == "failed")
    failed = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
    launched = sum(by[v] for v in ("stable", "marginal", "failed"))
    skipped = f"; {by['skipped']} more skipped (repeats or certain OOMs)" if by["skipped"] else ""
    if by["failed"] and by["failed"] == launched and not by["running"]:
        return f"all {by['failed']} trials failed: {failed}{skipped}"
    reasons: Counter[str] = Counter()
    for r in sweep.rows:
        if r.verdict == "marginal":
            reasons.update(_marginal_reason(part, sweep.margin) for part in r.detail.split("; "))
    parts = []
    if by["marginal"]:
        why = list(reasons) if len(reasons) == 1 else [f"{n} {k}" for k, n in reasons.most_common()]
        parts.append(f"{by['marginal']} marginal ({', '.join(why)})")
    if by["failed"]:
        parts.append(f"{by['failed']} failed ({failed})")
    parts += [f"{by[v]} {v}" for v in ("skipped", "pruned", "running") if by[v]]
    return "no stable trial: " + ", ".join(parts)


def _marginal_reason(detail: str, margin: float) -> str:
    if detail.startswith("headroom"):
        return f"headroom < {margin:.0%}"
    return "allocator retries" if "allocator" in detail else detail


# ---- the experiment file ----------------------------------------------------------------------------------------------


@dataclass
class Experiment:
    """What `conf/experiment/production.yaml` sets: group choices and values, and what it leaves out."""

    groups: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)  # keys whose default changed in conf/ since the sweep
    probe: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)  # keys conf/ has gained since the sweep (the trial had none)

    def body(self) -> str:
        tree: dict[str, Any] = {}
        if self.groups:
            tree["defaults"] = [{f"override /{g}": v} for g, v in self.groups.items()]
        for key, value in self.values.items():
            node = tree
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return yaml.safe_dump(tree, sort_keys=False, default_flow_style=False, width=120)

    def text(self, header: list[str]) -> str:
        return "# @package _global_\n" + "".join(f"# {line}".rstrip() + "\n" for line in header) + self.body()


def _trial_files(sweep: Sweep, row: TrialRow) -> tuple[Path, list[str], dict[str, Any]]:
    """The trial's composed config, its overrides and its config group choices."""
    hydra_dir = sweep.trial_dir(row.number) / ".hydra"
    config = hydra_dir / "config.yaml"
    if not config.exists():
        raise NotPromotable(
            f"trial {row.number}'s composed config {config} is missing (did it run on another machine?); "
            "the experiment file cannot be written without it"
        )
    overrides = list(OmegaConf.load(hydra_dir / "overrides.yaml")) if (hydra_dir / "overrides.yaml").exists() else []
    choices = {}
    if (hydra_dir / "hydra.yaml").exists():
        choices = OmegaConf.to_container(OmegaConf.load(hydra_dir / "hydra.yaml").hydra.runtime.choices)
    return config, [str(o) for o in overrides], choices


def _not_setting(key: str) -> bool:
    return key.replace("/", ".").split(".")[0] in _NOT_SETTINGS


def plan(sweep: Sweep, row: TrialRow) -> Experiment:
    """The experiment for `row`: the sweep's fixed overrides (values, and group choices as defaults
    overrides), the trial's Optuna params over them, and the probe-only overrides left out. Checked by
    composing it: any other key whose default changed in conf/ since the sweep is pinned to the trial's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    config, overrides, choices = _trial_files(sweep, row)
    exp = Experiment()
    for probe in sweep.probe_overrides:
        if probe in overrides:
            overrides.remove(probe)
            exp.probe.append(probe)
    parser = OverridesParser.create()
    items = [(o.key_or_group, o.value(), o) for o in parser.parse_overrides(overrides)]
    items += [(k, v, None) for k, v in row.params.items()]
    left_out: dict[str, str] = {}  # by key: a param repeats the fixed override it replaces
    for key, value, override in items:
        if override is not None and override.is_delete():
            left_out[key] = f"{override.input_line} (a deletion cannot be written as a setting)"
        elif _not_setting(key):
            if not key.startswith("hydra"):
                left_out[key] = f"{key}={report.fmt(value)}"
        elif tracking.redact_text(str(value)) != str(value):
            left_out[key] = f"{key} (looks like a secret: pass it on the command line)"
        elif key in choices:
            exp.groups[key] = str(value)
        else:
            exp.values[key] = value
    exp.left_out = list(left_out.values())
    defaults = OmegaConf.to_container(report.compose(hydra_config=True).hydra.runtime.choices)
    for group, choice in choices.items():
        if not _not_setting(group) and choice is not None and group not in exp.groups and defaults.get(group) != choice:
            exp.groups[group] = str(choice)
    trial_cfg = _flat(OmegaConf.to_container(OmegaConf.load(config), resolve=False))
    ignore = {o.split("=", 1)[0].lstrip("+~") for o in exp.probe} | set(_PER_RUN_KEYS)
    for key, (measured, composed) in differences(exp, trial_cfg, ignore).items():
        if measured is _MISSING:
            exp.added.append(f"{key}={composed!r}")
        elif composed is _MISSING:
            exp.left_out.append(f"{key}={measured!r} (no longer in conf/)")
        else:
            exp.values[key] = measured
            exp.pinned.append(key)
    remaining = {k: v for k, v in differences(exp, trial_cfg, ignore).items() if _MISSING not in v}
    if remaining:
        shown = "; ".join(f"{k}: measured {m!r}, composed {c!r}" for k, (m, c) in list(remaining.items())[:5])
        raise NotPromotable(f"experiment=production would not compose trial {row.number}'s settings: {shown}")
    return exp


_MISSING = object()


def differences(exp: Experiment, trial_cfg: dict[str, Any], ignore: set[str]) -> dict[str, tuple[Any, Any]]:
    """Keys where `experiment=<exp>` composes something else than the trial ran with (uninterpolated, so
    QLORA_ROOT and the like do not count), outside the groups that are not settings."""
    with tempfile.TemporaryDirectory() as tmp:
        name = "_promote_candidate"
        (Path(tmp) / "experiment").mkdir()
        (Path(tmp) / "experiment" / f"{name}.yaml").write_text(exp.text([]))
        cfg = report.compose([f"experiment={name}", f"hydra.searchpath=[file://{tmp}]"])
    composed = _flat(OmegaConf.to_container(cfg, resolve=False))
    out = {}
    for key in sorted(set(trial_cfg) | set(composed)):
        if _not_setting(key) or key in ignore:
            continue
        measured, now = trial_cfg.get(key, _MISSING), composed.get(key, _MISSING)
        if measured != now:
            out[key] = (measured, now)
    return out


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values (lists are leaves), values kept as they are: the comparison is typed."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node}


def header(
    sweep: Sweep, row: TrialRow, exp: Experiment, model: str, version: str, argv: list[str], by_hand: bool
) -> list[str]:
    """The file's comment: where the settings come from and what they measured, for the reviewer."""
    m = row.metrics
    objective = f"{sweep.objectives[0]} ({sweep.directions[0]})"
    budget = m.get("vram_budget_gib", sweep.budget or float("nan"))
    best = sweep.best()
    how = f"best stable by {objective}"
    if by_hand:
        how = "chosen with --trial among the stable trials" + (
            f"; the best by {objective} is {best.number}" if best else ""
        )
    lines = [
        f"Production settings, written by: python -m src.promote {' '.join(argv)}".rstrip(),
        f"on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. Review the diff; train with:",
        "  python -m src.train experiment=production",
        "",
        f"study:      {sweep.name} (storage {sweep.storage})",
        f"trial:      {row.number}, {how}, margin {sweep.margin:.0%}",
        f"MLflow run: {row.run_id}",
        f"registered: {model} version {version} (alias {ALIAS})",
        f"figures:    tokens_per_s {m.get('tokens_per_s', float('nan')):.1f}, step_time_s "
        f"{m.get('step_time_s', float('nan')):.3f}, peak_vram_reserved_gib {m.get('peak_vram_reserved_gib', float('nan')):.2f} "
        f"of {budget:g} (headroom {m.get('vram_headroom_frac', float('nan')):.0%})",
    ]
    shared = sweep.card_shared_by()
    if shared > 1:
        lines.append(
            f"            tokens_per_s and step_time_s read with up to {shared} trials sharing a card: not solo"
        )
    if "peak_vram_device_gib" in m:
        lines.append(
            f"            peak_vram_device_gib {m['peak_vram_device_gib']:.2f} (whole process, CUDA context incl.)"
        )
    if exp.probe:
        lines.append(f"not carried: the sweep's probe length ({' '.join(exp.probe)}); add it to re-measure the trial")
    if exp.left_out:
        lines.append(f"left out:   {'; '.join(exp.left_out)}")
    if exp.added:
        lines.append(f"new keys:   {'; '.join(exp.added)} (added to conf/ since the sweep: today's defaults)")
    if exp.pinned:
        lines.append(
            f"pinned:     {', '.join(exp.pinned)} (today's conf/ composes them otherwise: pinned to the measured values)"
        )
    # The file is meant to be committed: a storage URL or an argument may carry a password.
    return [tracking.redact_text(line) for line in lines]


# ---- the registry -------------------------------------------------------------------------------------------------


@dataclass
class RegistryState:
    versions: list[Any]
    production: Any | None  # the version the alias points at now

    @property
    def next_version(self) -> int:
        return max((int(v.version) for v in self.versions), default=0) + 1


def registry_state(client: Any, name: str, uri: str) -> RegistryState:
    from mlflow.exceptions import MlflowException

    if not report.store_exists(uri):
        return RegistryState([], None)  # no store yet: reading it would create one
    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        versions = []
    try:
        production = client.get_model_version_by_alias(name, ALIAS)
    except MlflowException:
        production = None
    return RegistryState(list(versions), production)


def register(client: Any, name: str, sweep: Sweep, row: TrialRow, description: str) -> Any:
    """A new version of `name` from the trial's run, tagged with its figures; the alias moves to it."""
    from mlflow.exceptions import MlflowException

    artifacts = {a.path for a in client.list_artifacts(row.run_id)}
    if "config" not in artifacts:
        hydra_dir = sweep.trial_dir(row.number) / ".hydra"
        for f in ("config.yaml", "overrides.yaml"):
            if (hydra_dir / f).exists():
                client.log_artifact(row.run_id, str(hydra_dir / f), "config")
    source = f"runs:/{row.run_id}/adapter" if "adapter" in artifacts else f"runs:/{row.run_id}"
    try:
        client.create_registered_model(name, description="QLoRA fine-tunes promoted from stability sweeps")
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    m = row.metrics
    tags: dict[str, Any] = {
        "study": sweep.name,
        "trial": row.number,
        "mlflow_run_id": row.run_id,
        "objective": f"{sweep.objectives[0]} ({sweep.directions[0]})",
        "margin": sweep.margin,
        "adapter": "yes" if "adapter" in artifacts else "no (the trial saved none: trainer.save_adapter=false)",
        "config": f"runs:/{row.run_id}/config/config.yaml",
    }
    for key in (
        "tokens_per_s",
        "step_time_s",
        "peak_vram_reserved_gib",
        "peak_vram_allocated_gib",
        "peak_vram_device_gib",
        "vram_headroom_frac",
        "vram_budget_gib",
    ):
        if key in m:
            tags[key] = f"{m[key]:.4g}"
    shared = sweep.card_shared_by()
    if shared > 1:  # its throughput is a shared-card reading, not the setting's solo speed
        tags["card_shared_by"] = shared
    tags.update({f"knob.{k}": report.fmt(v) for k, v in row.params.items()})
    version = client.create_model_version(
        name, source, run_id=row.run_id, tags={k: str(v) for k, v in tags.items()}, description=description
    )
    client.set_registered_model_alias(name, ALIAS, version.version)
    tracking.set_tags(client, row.run_id, {"registry.model": name, "registry.version": version.version})
    return version


# ---- the command ----------------------------------------------------------------------------------------------------


def _diff(old: str, new: str, path: Path) -> str:
    lines = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{path} (now)", f"{path} (promoted)")
    return "".join(lines) or "(no change)\n"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    from mlflow.tracking import MlflowClient

    argv = list(sys.argv[1:] if argv is None else argv)
    p = report.cli_parser("python -m src.promote", "Promote the best stable trial of a study to production.")
    p.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    p.add_argument("--trial", type=int, help="promote this (stable) trial instead of the best")
    p.add_argument("--registered-model", help="registry name (default: tracking.registered_model, llama3-qlora)")
    p.add_argument(
        "--experiment-file",
        type=Path,
        default=DEFAULT_EXPERIMENT_FILE,
        help="where to write the settings (default: conf/experiment/production.yaml)",
    )
    args = p.parse_args(argv)
    where = report.places(args.tracking_uri)
    model = args.registered_model or where.registered_model
    try:
        sweep = report.load(args.study, where.sweeps_dir, args.storage, args.margin, where.tracking_uri)
        row = choose(sweep, args.trial)
        exp = plan(sweep, row)
    except (report.StudyNotFound, NotPromotable) as exc:
        print(f"nothing promoted: {tracking.redact_text(str(exc))}", file=sys.stderr)
        return 1
    if not row.run_id:
        print(f"nothing promoted: trial {row.number} names no MLflow run", file=sys.stderr)
        return 1
    if not args.dry_run:
        tracking.setup(where.tracking_uri)
    client = MlflowClient(where.tracking_uri)
    state = registry_state(client, model, where.tracking_uri)
    current = state.production
    already = current is not None and current.run_id == row.run_id
    version = str(current.version) if already else str(state.next_version)
    path = args.experiment_file
    old = path.read_text() if path.exists() else ""
    m = row.metrics
    figures = (
        f"{sweep.objectives[0]} {m.get(sweep.objectives[0], float('nan')):.4g} ({sweep.directions[0]}), "
        f"peak reserved {m.get('peak_vram_reserved_gib', float('nan')):.2f} GiB, "
        f"headroom {m.get('vram_headroom_frac', float('nan')):.0%}"
    )
    moving = f"alias {ALIAS}: " + (
        f"version {current.version} -> {version}" if current else f"new -> version {version}"
    )
    argv = [a for a in argv if a != "--dry-run"]
    text = exp.text(header(sweep, row, exp, model, version, argv, args.trial is not None))
    # the header's time stamp alone is not a change
    unchanged = bool(old) and _body(old) == _body(text) and _model_line(old) == _model_line(text)
    if args.dry_run:
        print(f"dry run: would promote trial {row.number} of study {sweep.name}: {figures}")
        if already:
            print(f"{model} version {version} (alias {ALIAS}) already is this trial's run: registry unchanged")
        else:
            print(f"would register {model} version {version} from run {row.run_id}; {moving}")
        print(f"would write {path}:" if not unchanged else f"{path} already holds these settings")
        if not unchanged:
            print(_diff(old, text, path), end="")
        return 0
    if already:
        print(f"trial {row.number} of study {sweep.name} already is {model} version {version} (alias {ALIAS})")
    else:
        description = (
            f"Trial {row.number} of study {sweep.name}: {figures}. Settings: conf/experiment/production.yaml "
            f"(python -m src.train experiment=production); composed config: runs:/{row.run_id}/config/config.yaml."
        )
        mv = register(client, model, sweep, row, description)
        version = str(mv.version)
        text = exp.text(header(sweep, row, exp, model, version, argv, args.trial is not None))
        print(f"promoted trial {row.number} of study {sweep.name} ({figures}) -> {model} version {version}; {moving}")
    if not (already and unchanged):
        _write(path, text)
        use = (
            f"python -m src.train experiment={path.stem}"
            if path.parent.resolve() == DEFAULT_EXPERIMENT_FILE.parent
            else f"copy it to {DEFAULT_EXPERIMENT_FILE.parent}/ for experiment={path.stem}"
        )
        print(f"wrote {path}; train it: {use}")
    return 0


def _body(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def _model_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.startswith("# registered:")), "")


if __name__ == "__main__":
    sys.exit(main())
