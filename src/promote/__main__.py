"""`python -m src.promote [study]`: the chosen trial registered, the alias moved, its settings written (or, with
--dry-run, what would change)."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from src import redact, stores, tracking
from src.config import study_name_problem
from src.places import StudyNotFound, cli_parser, places
from src.promote.choosing import ALLOW_UNSOAKED, NotPromotable, choose
from src.promote.experiment import DEFAULT_EXPERIMENT_FILE, header, plan, trial_config
from src.promote.registry import register, registry_state
from src.study import Sweep, TrialRow, load
from src.tracking import ALIAS, setting_version

PROMOTE_LOCK_TIMEOUT_S = 300


def _parser() -> argparse.ArgumentParser:
    p = cli_parser("python -m src.promote", "Promote the best stable trial of a study to production.")
    p.add_argument("--dry-run", action="store_true", help="print what would change; change nothing")
    p.add_argument("--trial", type=int, help="promote this (stable) trial instead of the best")
    p.add_argument("--registered-model", help="registry name (default: tracking.registered_model, llama3-qlora)")
    p.add_argument(
        ALLOW_UNSOAKED,
        action="store_true",
        help="promote a stable trial that was not soaked (or whose soak failed); the file's header says so",
    )
    p.add_argument(
        "--experiment-file",
        type=Path,
        default=DEFAULT_EXPERIMENT_FILE,
        help="where to write the settings (default: conf/experiment/production.yaml)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from mlflow.tracking import MlflowClient

    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    args = p.parse_args(argv)
    if args.study is not None and (why := study_name_problem(args.study, "study")):
        p.error(why)
    if args.margin is not None and not 0 <= args.margin <= 1:
        p.error(f"--margin {args.margin:g}: a share of the budget, from 0 to 1, e.g. 0.10")
    where = places(args.tracking_uri)
    model = args.registered_model or where.registered_model
    if why := redact.refusal("--registered-model", model):  # a registry name is shown to everyone who reads it
        p.error(why)
    if why := not_ours(args.experiment_file):
        p.error(why)
    tracking_key = "--tracking-uri" if args.tracking_uri else "tracking.uri"
    try:
        stores.check(stores.of_results(args.storage, where.tracking_uri, tracking_key, write=not args.dry_run))
    except stores.StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        sweep = load(args.study, where.sweeps_dir, args.storage, args.margin, where.tracking_uri)
        row = choose(sweep, args.trial, allow_unsoaked=args.allow_unsoaked)
        exp = plan(sweep, row, trial_config(sweep, row, where.tracking_uri))
    except (StudyNotFound, NotPromotable) as exc:
        print(f"nothing promoted: {redact.redact_text(str(exc))}", file=sys.stderr)
        return 1
    if not row.run_id:
        print(f"nothing promoted: trial {row.number} names no MLflow run", file=sys.stderr)
        return 1
    if not args.dry_run:
        tracking.setup(where.tracking_uri)
    client = MlflowClient(where.tracking_uri)
    if args.dry_run:
        return _promote(args, argv, client, model, sweep, row, exp, where.tracking_uri)
    # One promotion at a time in this project: the registry's state read, the version registered, the alias moved
    # and the experiment file written as one step (#30.16: two at once registered one run as two versions).
    lock = Path(where.sweeps_dir) / ".promote.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    held = FileLock(str(lock))
    try:
        held.acquire(timeout=PROMOTE_LOCK_TIMEOUT_S)
    except Timeout:
        print(
            f"nothing promoted: another promotion held {lock} for {PROMOTE_LOCK_TIMEOUT_S} s; run this again "
            "when it has finished",
            file=sys.stderr,
        )
        return 1
    try:
        return _promote(args, argv, client, model, sweep, row, exp, where.tracking_uri)
    finally:
        held.release()


def _promote(
    args: argparse.Namespace,
    argv: list[str],
    client: Any,
    model: str,
    sweep: Sweep,
    row: TrialRow,
    exp: Any,
    tracking_uri: str,
) -> int:
    """Register the trial (unless the alias already points at its run) and write its experiment file."""
    state = registry_state(client, model, tracking_uri)
    current = state.production
    # the alias may point at the adapter a production run trained from this trial's setting (its tags are the trial's)
    already = current is not None and current.tags.get("mlflow_run_id", current.run_id) == row.run_id
    version = setting_version(current) if already else str(state.next_version)
    path = args.experiment_file
    old = path.read_text() if path.exists() else ""
    argv = [a for a in argv if a != "--dry-run"]
    by_hand = args.trial is not None
    # a production run registers the adapter it trains as a version of this model, beside this one
    exp.values.update({"tracking.registered_model": model, "tracking.registered_version": int(version)})
    text = exp.text(header(sweep, row, exp, model, version, argv, by_hand, path))
    # the header's time stamp alone is not a change
    unchanged = bool(old) and _body(old) == _body(text) and _model_line(old) == _model_line(text)
    moving = f"alias {ALIAS}: " + (
        f"version {current.version} -> {version}" if current else f"new -> version {version}"
    )
    if args.dry_run:
        print(f"dry run: would promote trial {row.number} of study {sweep.name}: {_figures(sweep, row)}")
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
            f"Trial {row.number} of study {sweep.name}: {_figures(sweep, row)}. Settings: "
            "conf/experiment/production.yaml (python -m src.train experiment=production); composed config: "
            f"runs:/{row.run_id}/config/config.yaml."
        )
        version = str(register(client, model, sweep, row, description).version)
        exp.values["tracking.registered_version"] = int(version)
        text = exp.text(header(sweep, row, exp, model, version, argv, by_hand, path))
        print(
            f"promoted trial {row.number} of study {sweep.name} ({_figures(sweep, row)}) -> {model} version "
            f"{version}; {moving}"
        )
    if not (already and unchanged):
        _write(path, text)
    return 0


HEADER = "# Production settings, written by: python -m src.promote"


def not_ours(path: Path) -> str | None:
    """Why promotion must not write `path`: a link, or a file it did not write (its header). A new file is fine."""
    if path.is_symlink():
        return f"--experiment-file {path} is a symbolic link: promotion writes only files of its own; name the file"
    lines = path.read_text(errors="replace").splitlines()[:2] if path.is_file() else []
    if path.exists() and not (len(lines) == 2 and lines[1].startswith(HEADER)):
        return (
            f"--experiment-file {path} exists and was not written by python -m src.promote (no '{HEADER}' header): "
            "promotion replaces only its own files; name a new file, e.g. conf/experiment/production.yaml"
        )
    return None


def _figures(sweep: Sweep, row: TrialRow) -> str:
    """Its objective (tokens/s: the median of its runs alone where the sweep timed it, as the report quotes it), peak
    and headroom."""
    from src.readings import timed_how

    m, objective = row.metrics, sweep.objectives[0]
    value = sweep.score(row) if objective in m else float("nan")
    return (
        f"{objective} {value:.4g}{timed_how(sweep, row)} ({sweep.directions[0]}), "
        f"peak reserved {m.get('peak_vram_reserved_gib', float('nan')):.2f} GiB, "
        f"headroom {m.get('vram_headroom_frac', float('nan')):.0%}"
    )


def _diff(old: str, new: str, path: Path) -> str:
    lines = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{path} (now)", f"{path} (promoted)")
    return "".join(lines) or "(no change)\n"


def _write(path: Path, text: str) -> None:
    """The experiment file, replaced at once (a reader never sees half of it), the one it replaces kept beside it
    (`<name>.prev`, for review: the file is not committed, so there is no diff to read), and how to use it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and _body(path.read_text()) != _body(text):
        os.replace(path, path.with_name(f"{path.name}.prev"))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    use = (
        f"python -m src.train experiment={path.stem}"
        if path.parent.resolve() == DEFAULT_EXPERIMENT_FILE.parent
        else f"copy it to {DEFAULT_EXPERIMENT_FILE.parent}/ for experiment={path.stem}"
    )
    print(f"wrote {path}; train it: {use}")


def _body(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


def _model_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.startswith("# registered:")), "")


if __name__ == "__main__":
    sys.exit(main())
