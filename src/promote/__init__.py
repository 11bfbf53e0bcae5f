"""Promote the best stable trial of a study to production, reviewably and reproducibly.

    python -m src.promote [study] [--dry-run] [--margin 0.1] [--trial N] [--registered-model llama3-qlora]

The trial is the best *stable* one (src.study's classes, as the report shows them) by the study's first objective
and direction, or the stable trial `--trial N`. It becomes a new version of the registered model
(`tracking.registered_model`, `llama3-qlora`) whose source is the trial run's `adapter/` (or the run's artifacts
when it saved none), tagged with the figures and the study/trial; the alias `production` moves to it and older
versions stay. `conf/experiment/production.yaml` then holds the trial's settings, read from the composed config
the trial logged to its run (`config/`), so that `python -m src.train experiment=production` composes exactly
what was measured: the file is checked by composing it before anything changes. When nothing qualifies the
reason is printed, nothing changes, and the exit status is 1.
"""

from __future__ import annotations

from src.promote.choosing import NotPromotable, choose, why_none
from src.promote.experiment import DEFAULT_EXPERIMENT_FILE, Experiment, differences, header, plan, trial_config
from src.promote.registry import register, registry_state
from src.tracking import ALIAS

__all__ = [
    "ALIAS",
    "DEFAULT_EXPERIMENT_FILE",
    "Experiment",
    "NotPromotable",
    "choose",
    "differences",
    "header",
    "main",
    "plan",
    "register",
    "registry_state",
    "trial_config",
    "why_none",
]


def main(argv: list[str] | None = None) -> int:
    """`python -m src.promote` (src/promote/__main__.py). Imported when called: `python -m` runs __main__.py
    itself, and warns when the package has imported it already."""
    from src.promote.__main__ import main as run

    return run(argv)
