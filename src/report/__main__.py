"""`python -m src.report [study]`: the stability map in the terminal, report.md beside the study, both on MLflow."""

from __future__ import annotations

import sys

from src import redact, stores
from src.config import study_name_problem
from src.places import StudyNotFound, cli_parser
from src.report import load, log_to_mlflow, places, table, write
from src.report.text import promote_command

# What to install for a package the report imports when it draws (pyproject.toml's pins)
INSTALL = {"plotly": "pip install 'plotly>=6,<8'", "matplotlib": "pip install 'matplotlib>=3.8'"}


def main(argv: list[str] | None = None) -> int:
    """The command; a package it needs but cannot import is one line naming it and how to install it."""
    try:
        return _report(argv)
    except ModuleNotFoundError as exc:
        package = (exc.name or str(exc)).split(".")[0]
        how = INSTALL.get(package, f"pip install {package}")
        print(f"error: the report needs the Python package '{package}', not installed here: {how}", file=sys.stderr)
        return 2


def _report(argv: list[str] | None) -> int:
    from rich.console import Console

    p = cli_parser("python -m src.report", "The stability map of a study: terminal table, sweeps/<study>/report.md.")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the report to the sweep's parent run")
    args = p.parse_args(argv)
    if args.study is not None and (why := study_name_problem(args.study, "study")):
        p.error(why)
    if args.margin is not None and not 0 <= args.margin <= 1:
        p.error(f"--margin {args.margin:g}: a share of the budget, from 0 to 1, e.g. 0.10")
    where = places(args.tracking_uri)
    tracking_key = "--tracking-uri" if args.tracking_uri else "tracking.uri"
    try:
        stores.check(stores.of_results(args.storage, where.tracking_uri, tracking_key, write=not args.no_mlflow))
        sweep = load(args.study, where.sweeps_dir, args.storage, args.margin, where.tracking_uri)
    except (stores.StoreError, StudyNotFound) as exc:
        print(f"error: {redact.redact_text(str(exc))}", file=sys.stderr)
        return 2
    report = write(sweep)
    if not args.no_mlflow:
        report.logged_to = log_to_mlflow(report, where.tracking_uri)
    console = Console() if sys.stdout.isatty() else Console(width=180)
    console.print(table(sweep))
    print("what to change:")
    for sentence in report.advice:
        print(f"- {redact.redact_text(sentence)}")
    for imp in report.importances:
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(imp.values.items())[:3])
        print(f"what moves {imp.target}: {top or imp.note}")
    best = sweep.best()
    print(f"report: {report.files[0]}" + (f" (also on MLflow run {report.logged_to})" if report.logged_to else ""))
    on_run = " (and in that run's Artifacts: report/report.html)" if report.logged_to else ""
    print(f"page:   {next(p for p in report.files if p.name == 'report.html')}{on_run}")
    if report.mlflow_view:
        print(f"trials by knobs and metrics in MLflow (a local store: make ui first): {report.mlflow_view}")
    if best:
        print(f"best stable: trial {best.number}; promote it: {promote_command(sweep, best)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
