"""What preflight found: a `Finding` per problem, and the `Report` a trial prints, records and turns into tags."""

from __future__ import annotations

from dataclasses import dataclass, field

from src import redact

ROWS_SHOWN = 10


@dataclass
class Finding:
    check: str
    severity: str  # "error" | "warning" | "info"
    message: str
    rows: list[int] = field(default_factory=list)


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def add(self, check: str, severity: str, message: str, rows: list[int] | None = None) -> None:
        self.findings.append(Finding(check, severity, message, [int(r) for r in rows or []]))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def to_text(self) -> str:
        lines = ["# Preflight", ""]
        for f in self.findings:
            rows = f" rows {rows_text(f.rows)}" if f.rows else ""
            lines.append(f"[{f.severity.upper():7}] {f.check}: {f.message}{rows}")
        if not self.findings:
            lines.append("no findings")
        if self.environment:
            lines += ["", "Environment:"] + [f"  {k}: {v}" for k, v in self.environment.items()]
        # Whatever a message quotes (a path, a prompt) passes the same redaction as everything MLflow gets.
        return redact.redact_text("\n".join(lines))

    def tags(self) -> dict[str, str]:
        """What a trial records as MLflow tags: counts, the failed checks, and the environment's verdicts."""
        tags = {
            "preflight.errors": str(len(self.errors)),
            "preflight.warnings": str(len(self.warnings)),
        }
        failed = sorted({f.check for f in self.findings if f.severity in ("error", "warning")})
        if failed:
            tags["preflight.checks"] = ",".join(failed)
        for key in ("bitsandbytes.native", "bf16.supported", "known_bad", "cuda.driver_max", "torch.cuda_build"):
            if key in self.environment:
                tags[key if "." in key else f"preflight.{key}"] = self.environment[key]
        return tags


def rows_text(rows: list[int]) -> str:
    """The first ROWS_SHOWN row numbers, and how many more there are."""
    shown = ", ".join(map(str, rows[:ROWS_SHOWN]))
    return shown + (f" (+{len(rows) - ROWS_SHOWN} more)" if len(rows) > ROWS_SHOWN else "")
