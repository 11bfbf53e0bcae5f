"""A package the report needs but cannot import (plotly on a machine that lacks it): one line naming it and the
install command, no traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from src.report import __main__ as report_cli
from src.study import Sweep, TrialRow


def _sweep(where: Path) -> Sweep:
    row = TrialRow(
        number=0,
        params={"trainer.per_device_train_batch_size": 4},
        distributions={},
        verdict="stable",
        detail="headroom 62%",
        metrics={"tokens_per_s": 8000.0, "peak_vram_reserved_gib": 0.12, "vram_headroom_frac": 0.62},
    )
    knobs = ["trainer.per_device_train_batch_size"]
    return Sweep("demo", "sqlite:///x", where, ["tokens_per_s"], ["maximize"], 0.25, 0.32, knobs, [row], None, [])


def test_a_missing_plotly_is_one_line_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("QLORA_ROOT", str(tmp_path))
    monkeypatch.setattr(report_cli.stores, "check", lambda *a, **k: None)
    monkeypatch.setattr(report_cli, "load", lambda *a, **k: _sweep(tmp_path / "sweeps" / "demo"))
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)  # as if not installed: `import plotly...` fails
    code = report_cli.main(["demo", "--no-mlflow"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip() == (
        "error: the report needs the Python package 'plotly', not installed here: pip install 'plotly>=6,<8'"
    ), err
    assert "Traceback" not in err + out
