"""Everything that can be checked before training, checked before training.

    python -m src.preflight [overrides]      # alone: prints the report, exits 1 if training would be refused

`run` finds errors (training is refused) and warnings, by the policy in `conf/preflight/`: credentials in the
config (secrets.py), settings that cannot work together (config_guards.py), the machine (machine.py) and its
package versions against known-bad ones (versions.py), and the data as the tokenizer renders it (data.py);
report.py holds what they find. `src.train` runs the same checks first in every trial and records the report
with the run; two guards can only act on the loaded model and are installed by the trial (runtime_guards.py).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from src import redact
from src.failures import ConfigError, DataError
from src.preflight.config_guards import check_config
from src.preflight.data import DATA_CHECKS, check_data
from src.preflight.machine import environment
from src.preflight.report import Finding, Report, rows_text
from src.preflight.secrets import check_secrets
from src.preflight.versions import STACK, check_versions, load_known_bad

__all__ = [
    "DATA_CHECKS",
    "STACK",
    "CheckpointingGuard",
    "Finding",
    "Report",
    "check_config",
    "check_data",
    "check_secrets",
    "check_versions",
    "environment",
    "guard_device_moves",
    "load_known_bad",
    "run",
]


def __getattr__(name: str) -> Any:
    """The run-time guards import transformers' trainer (peft, bitsandbytes: ~10 s on a small CPU): loaded when a
    trial first asks for them, so the sweep engine's checks of the space stay light."""
    if name in ("CheckpointingGuard", "guard_device_moves"):
        from src.preflight import runtime_guards

        return getattr(runtime_guards, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run(cfg: DictConfig, *, data: bool = True) -> Report:
    """All checks; raises ConfigError / DataError (whose message lists the errors) if training is refused."""
    report = Report()
    check_secrets(cfg, report)
    check_config(cfg, report)
    environment(cfg, report)
    # A credential in the config is told first, and alone of the data: a data.input_column holding a token would
    # otherwise be refused as a column the file does not have, and the data read (and quoted) for nothing.
    if data and not any(f.check == "secrets" for f in report.errors):
        check_data(cfg, report)
    errors = report.errors
    if errors or (cfg.preflight.fail_on_warnings and report.warnings):
        refused = errors or report.warnings
        summary = "; ".join(f"{f.message}" + (f" (rows {rows_text(f.rows)})" if f.rows else "") for f in refused)
        error_type = DataError if all(f.check in DATA_CHECKS for f in refused) else ConfigError
        exc = error_type(redact.redact_text(f"preflight refused training: {summary}\n\n{report.to_text()}"))
        exc.report = report  # type: ignore[attr-defined]  # the trial records it even when refused
        raise exc
    return report
