"""Installed versions against what is known to break: the cited known-bad combinations in `known_bad.csv`, what
each package of the stack declares it needs, and the PEFT version transformers' integration asks for."""

from __future__ import annotations

import csv
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from src.preflight.report import Report

KNOWN_BAD = Path(__file__).with_name("known_bad.csv")
# The stack whose versions must agree with each other (what versions() reports, minus the tracking tools).
STACK = ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "datasets")


def load_known_bad(path: Path = KNOWN_BAD) -> list[dict[str, str]]:
    """The table of known-bad combinations: one row per combination, each with the source that shows it."""
    with path.open(newline="") as f:
        lines = [line for line in f if not line.startswith("#")]  # the file's header explains the columns
    return [row for row in csv.DictReader(lines, skipinitialspace=True) if row.get("id", "").strip()]


def _matches(when: str, facts: dict[str, str]) -> bool:
    """Whether every clause (`peft<0.18.0; transformers>=5.0.0`) holds for the installed versions; a clause
    about something not installed (or no GPU for `cuda`) does not hold."""
    for clause in when.split(";"):
        req = Requirement(clause.strip())
        have = facts.get(req.name.lower())
        if have is None:
            return False
        try:
            if not req.specifier.contains(Version(have), prereleases=True):
                return False
        except InvalidVersion:
            return False
    return True


def check_versions(facts: dict[str, str], report: Report) -> None:
    """The installed versions against the known-bad table, the stack's own declared requirements, and the
    PEFT version transformers' integration asks for."""
    matched = []
    for row in load_known_bad():
        if not _matches(row["when"], facts):
            continue
        matched.append(row["id"])
        names = [Requirement(clause.strip()).name.lower() for clause in row["when"].split(";")]
        have = ", ".join(f"{name} {facts[name]}" for name in names)
        report.add(
            "known_bad",
            row["severity"].strip(),
            f"{row['id']} ({have}): {row['problem']} Fix: {row['fix']} Source: {row['source']}",
        )
    report.environment["known_bad"] = ",".join(matched) or "none"
    _check_declared_requirements(facts, report)
    _check_transformers_peft(facts, report)


def _check_declared_requirements(facts: dict[str, str], report: Report) -> None:
    """What each package of the stack declares it needs from the others (pip would enforce it, but GPU images
    are often assembled with --no-deps or a torch wheel installed on its own)."""
    for dist in STACK:
        if dist not in facts:
            continue
        try:
            declared = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for text in declared:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            name = req.name.lower()
            if name not in STACK or name not in facts or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            try:
                ok = req.specifier.contains(Version(facts[name]), prereleases=True)
            except InvalidVersion:
                continue
            if not ok:
                report.add(
                    "requirements",
                    "error",
                    f"{dist} {facts[dist]} requires {name}{req.specifier} but {name} {facts[name]} is installed; "
                    f"pip install '{name}{req.specifier}' (or a {dist} release made for {name} {facts[name]})",
                )


def _check_transformers_peft(facts: dict[str, str], report: Report) -> None:
    """transformers' PEFT integration (model.load_adapter / add_adapter, used to load a trained adapter back)
    checks its own minimum PEFT version at call time, long after training; say so now."""
    try:
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except Exception:
        return
    if "peft" in facts and Version(facts["peft"]) < Version(MIN_PEFT_VERSION):
        report.add(
            "requirements",
            "warning",
            f"transformers {facts.get('transformers')} asks for peft>={MIN_PEFT_VERSION} in its PEFT integration "
            f"(transformers.integrations.peft.MIN_PEFT_VERSION); peft {facts['peft']} is installed. Training "
            "(trl + peft) works, but loading the saved adapter with model.load_adapter() will refuse: "
            f"pip install 'peft>={MIN_PEFT_VERSION}' when that is allowed by pyproject's pin",
        )
