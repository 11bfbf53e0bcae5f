"""`python -m src.preflight [overrides]`: the checks alone; prints the report, exits 1 if training would be refused."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from src import redact
from src.config import register_configs
from src.failures import ConfigError, DataError
from src.preflight import run


@hydra.main(version_base="1.3", config_path="../../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        report = run(cfg)
    except (ConfigError, DataError) as exc:
        report = getattr(exc, "report", None)
        print(report.to_text() if report else redact.redact_text(str(exc)))
        print(f"\nREFUSED: {redact.redact_text(str(exc)).splitlines()[0]}")
        raise SystemExit(1) from None
    print(report.to_text())
    print("\nOK: training would start.")


if __name__ == "__main__":
    register_configs()
    main()
