"""The experiment file `conf/experiment/production.yaml`: the trial's settings (read from its MLflow run), checked
by composing them, and the header that tells a reviewer where they come from."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from src import redact
from src.config import PROJECT_DIR, compose, flatten
from src.places import store_exists
from src.promote.choosing import NotPromotable
from src.report import fmt
from src.study import Sweep, TrialRow
from src.tracking import ALIAS

DEFAULT_EXPERIMENT_FILE = PROJECT_DIR / "conf" / "experiment" / "production.yaml"
# Groups and key prefixes that say where a run records or how a sweep tests, not what is trained: never
# carried into production (a fault injected by a sweep must not become a setting).
_NOT_SETTINGS = ("hydra", "sweep", "experiment", "fault", "paths", "tracking")
# Composed keys that legitimately differ between a trial and experiment=production (output locations).
_PER_RUN_KEYS = ("trainer.output_dir",)
_MISSING = object()


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


# ---- what the trial ran with ---------------------------------------------------------------------------------------


@dataclass
class TrialConfig:
    """The trial's Hydra files: its composed config (flattened, uninterpolated), overrides and group choices."""

    config: dict[str, Any]
    overrides: list[str]
    choices: dict[str, Any]


def trial_config(sweep: Sweep, row: TrialRow, tracking_uri: str) -> TrialConfig:
    """From the trial's MLflow run (artifacts `config/`, which the trial logs itself), so a study promotes from
    its storage and tracking store alone; else from the trial's `.hydra/` folder on this machine."""
    with tempfile.TemporaryDirectory() as tmp:
        logged = _download_config(row.run_id, tracking_uri, Path(tmp))
        if logged is not None:
            return _read(logged)
    hydra_dir = sweep.trial_dir(row.number) / ".hydra"
    if (hydra_dir / "config.yaml").exists():
        return _read(hydra_dir)
    on_run = f"runs:/{row.run_id}/config/config.yaml" if row.run_id else "no MLflow run recorded"
    raise NotPromotable(
        f"trial {row.number}'s composed config is neither on its MLflow run ({on_run}) nor at "
        f"{hydra_dir / 'config.yaml'} (did it run on another machine?); "
        "the experiment file cannot be written without it"
    )


def _download_config(run_id: str | None, tracking_uri: str, into: Path) -> Path | None:
    """The run's `config/` folder downloaded into `into`; None when the run (or its config) is not there."""
    if not (run_id and store_exists(tracking_uri)):
        return None
    import mlflow.artifacts
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        logged = {Path(a.path).name for a in MlflowClient(tracking_uri).list_artifacts(run_id, "config")}
    except MlflowException:  # not a run of this store
        return None
    if "config.yaml" not in logged:
        return None
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # three small files: no bars
    found = mlflow.artifacts.download_artifacts(
        run_id=run_id, artifact_path="config", dst_path=str(into), tracking_uri=tracking_uri
    )
    return Path(found)


def _read(folder: Path) -> TrialConfig:
    config = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False)
    overrides = OmegaConf.load(folder / "overrides.yaml") if (folder / "overrides.yaml").exists() else []
    choices = {}
    if (folder / "hydra.yaml").exists():
        choices = OmegaConf.to_container(OmegaConf.load(folder / "hydra.yaml").hydra.runtime.choices)
    return TrialConfig(flatten(config), [str(o) for o in overrides], choices)


# ---- the settings, checked ------------------------------------------------------------------------------------------


def _not_setting(key: str) -> bool:
    return key.replace("/", ".").split(".")[0] in _NOT_SETTINGS


def plan(sweep: Sweep, row: TrialRow, trial: TrialConfig) -> Experiment:
    """The experiment for `row`: the sweep's fixed overrides (values, and group choices as defaults
    overrides), the trial's Optuna params over them, and the probe-only overrides left out. Checked by
    composing it: any other key whose default changed in conf/ since the sweep is pinned to the trial's."""
    exp = _settings(sweep, row, trial)
    defaults = OmegaConf.to_container(compose(hydra_config=True).hydra.runtime.choices)
    for group, choice in trial.choices.items():
        if not _not_setting(group) and choice is not None and group not in exp.groups and defaults.get(group) != choice:
            exp.groups[group] = str(choice)
    ignore = {o.split("=", 1)[0].lstrip("+~") for o in exp.probe} | set(_PER_RUN_KEYS)
    for key, (measured, composed) in differences(exp, trial.config, ignore).items():
        if measured is _MISSING:
            exp.added.append(f"{key}={composed!r}")
        elif composed is _MISSING:
            exp.left_out.append(f"{key}={measured!r} (no longer in conf/)")
        else:
            exp.values[key] = measured
            exp.pinned.append(key)
    remaining = {k: v for k, v in differences(exp, trial.config, ignore).items() if _MISSING not in v}
    if remaining:
        shown = "; ".join(f"{k}: measured {m!r}, composed {c!r}" for k, (m, c) in list(remaining.items())[:5])
        raise NotPromotable(f"experiment=production would not compose trial {row.number}'s settings: {shown}")
    return exp


def _settings(sweep: Sweep, row: TrialRow, trial: TrialConfig) -> Experiment:
    """The trial's overrides and params sorted into group choices, values, probe-only and left-out ones."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    exp = Experiment()
    overrides = list(trial.overrides)
    for probe in sweep.probe_overrides:
        if probe in overrides:
            overrides.remove(probe)
            exp.probe.append(probe)
    # A lever trial's overrides are on its command line (so in `overrides`) and in its Optuna record: the record
    # is the authority, so a lever is carried even from a trial whose logged overrides lack it.
    overrides += [o for o in row.lever if o not in overrides]
    parser = OverridesParser.create()
    items = [(o.key_or_group, o.value(), o) for o in parser.parse_overrides(overrides)]
    items += [(k, v, None) for k, v in row.params.items()]
    left_out: dict[str, str] = {}  # by key: a param repeats the fixed override it replaces
    for key, value, override in items:
        if override is not None and override.is_delete():
            left_out[key] = f"{override.input_line} (a deletion cannot be written as a setting)"
        elif _not_setting(key):
            if not key.startswith("hydra"):
                left_out[key] = f"{key}={fmt(value)}"
        elif redact.redact_text(str(value)) != str(value):
            left_out[key] = f"{key} (looks like a secret: pass it on the command line)"
        elif key in trial.choices:
            exp.groups[key] = str(value)
        else:
            exp.values[key] = value
    exp.left_out = list(left_out.values())
    return exp


def differences(exp: Experiment, trial_cfg: dict[str, Any], ignore: set[str]) -> dict[str, tuple[Any, Any]]:
    """Keys where `experiment=<exp>` composes something else than the trial ran with (uninterpolated, so
    QLORA_ROOT and the like do not count), outside the groups that are not settings."""
    with tempfile.TemporaryDirectory() as tmp:
        name = "_promote_candidate"
        (Path(tmp) / "experiment").mkdir()
        (Path(tmp) / "experiment" / f"{name}.yaml").write_text(exp.text([]))
        cfg = compose([f"experiment={name}", f"hydra.searchpath=[file://{tmp}]"])
    composed = flatten(OmegaConf.to_container(cfg, resolve=False))
    out = {}
    for key in sorted(set(trial_cfg) | set(composed)):
        if _not_setting(key) or key in ignore:
            continue
        measured, now = trial_cfg.get(key, _MISSING), composed.get(key, _MISSING)
        if measured != now:
            out[key] = (measured, now)
    return out


# ---- the header ------------------------------------------------------------------------------------------------------


def header(
    sweep: Sweep,
    row: TrialRow,
    exp: Experiment,
    model: str,
    version: str,
    argv: list[str],
    by_hand: bool,
    path: Path = DEFAULT_EXPERIMENT_FILE,
) -> list[str]:
    """The file's comment (the file: `path`): where the settings come from and what they measured, for the
    reviewer."""
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
        f"on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC. The file it replaced, if any, is kept beside it as",
        f"{path.name}.prev (python -m src.promote --dry-run shows a change first). Train it with:",
        f"  python -m src.train experiment={path.stem}",
        "",
        f"study:      {sweep.name} (storage {sweep.storage})",
        f"trial:      {row.number}, {how}, margin {sweep.margin:.0%}",
        f"MLflow run: {row.run_id}",
        f"registered: {model} version {version} (alias {ALIAS})",
        f"figures:    tokens_per_s {m.get('tokens_per_s', float('nan')):.1f}, step_time_s "
        f"{m.get('step_time_s', float('nan')):.3f}, peak_vram_reserved_gib {m.get('peak_vram_reserved_gib', float('nan')):.2f} "
        f"of {budget:g} (headroom {m.get('vram_headroom_frac', float('nan')):.0%})",
        _soak_line(sweep, row),
        *_notes(sweep, row, exp),
    ]
    # The file is meant to be committed: a storage URL or an argument may carry a password.
    return [redact.redact_text(line) for line in lines]


def _soak_line(sweep: Sweep, row: TrialRow) -> str:
    """The long run behind "stable", or that there was none (promoted with --allow-unsoaked)."""
    soak = sweep.soaks.get(row.number)
    if soak is None:
        return "soak:       NOT SOAKED - promoted with --allow-unsoaked; stable only over its short probe"
    if soak.get("status") != "passed":
        return f"soak:       FAILED ({soak.get('detail')}) - promoted with --allow-unsoaked"
    return f"soak:       passed: {soak.get('detail')}" + (
        f"; MLflow run {soak['run_id']}" if soak.get("run_id") else ""
    )


def _notes(sweep: Sweep, row: TrialRow, exp: Experiment) -> list[str]:
    """What the reviewer should know beyond the figures: shared cards, and keys not carried as measured."""
    m = row.metrics
    lines = []
    shared = sweep.card_shared_by()
    if shared > 1:  # the figures line is the trial's own reading
        lines.append(
            f"            tokens_per_s and step_time_s read with up to {shared} trials sharing a card: not solo"
        )
    timed = row.timed
    if timed.get("tokens_per_s"):  # src/sweep/timing.py: the speed the ranking and the report quote
        lines.append(
            f"            tokens_per_s alone on its card: {timed['tokens_per_s']:.1f}, the median of "
            f"{timed['finished']} runs ({timed['tokens_per_s_min']:.1f}-{timed['tokens_per_s_max']:.1f})"
        )
    if "peak_vram_device_gib" in m:
        lines.append(
            f"            peak_vram_device_gib {m['peak_vram_device_gib']:.2f} (whole process, CUDA context incl.)"
        )
    if row.lever:
        lines.append(f"lever:      {' '.join(row.lever)} on top of the recipe's knobs (carried below)")
    if exp.probe:
        lines.append(
            f"not carried: how the sweep ran each trial ({' '.join(exp.probe)}); add it to re-measure the trial"
        )
    if exp.left_out:
        lines.append(f"left out:   {'; '.join(exp.left_out)}")
    if exp.added:
        lines.append(f"new keys:   {'; '.join(exp.added)} (added to conf/ since the sweep: today's defaults)")
    if exp.pinned:
        lines.append(
            f"pinned:     {', '.join(exp.pinned)} (today's conf/ composes them otherwise: pinned to the measured values)"
        )
    return lines
