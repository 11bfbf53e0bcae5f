"""The report's words at their edges: a headroom just under the margin, a table on a 100-column terminal."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from src.report.text import table
from src.study import Sweep, TrialRow, _finished

KNOBS = [
    "trainer.per_device_train_batch_size",
    "trainer.gradient_accumulation_steps",
    "data.max_seq_length",
    "lora.r",
    "model.attn_implementation",
    "trainer.gradient_checkpointing",
]


def test_a_headroom_just_under_the_margin_is_never_told_as_equal_to_it() -> None:
    verdict, detail = _finished({"vram_headroom_frac": 0.2496}, 0.25)
    assert verdict == "marginal" and detail == "headroom 24.96% < 25.00%"
    assert _finished({"vram_headroom_frac": 0.06}, 0.10) == ("marginal", "headroom 6% < 10%")


def test_the_class_column_is_never_the_one_cut_at_100_columns() -> None:
    verdicts = [("stable", "headroom 62%"), ("marginal", "headroom 6% < 25%"), ("failed", "oom at step 1")]
    rows = [
        TrialRow(
            number=n,
            params={
                "trainer.per_device_train_batch_size": 16,
                "trainer.gradient_accumulation_steps": 2,
                "data.max_seq_length": 2048,
                "lora.r": 64,
                "model.attn_implementation": "sdpa",
                "trainer.gradient_checkpointing": True,
            },
            distributions={},
            verdict=verdict,
            detail=detail,
            metrics={
                "tokens_per_s": 8232.5,
                "peak_vram_reserved_gib": 0.12,
                "vram_headroom_frac": 0.62,
                "step_time_s": 0.41,
                "peak_rss_gib": 0.75,
                "startup_s": 9.3,
            },
        )
        for n, (verdict, detail) in enumerate(verdicts * 3)
    ]
    sweep = Sweep(
        "demo", "sqlite:///x", Path("/nowhere"), ["tokens_per_s"], ["maximize"], 0.25, 0.32, KNOBS, rows, None, []
    )
    console = Console(width=100, record=True, color_system=None)
    console.print(table(sweep))
    shown = console.export_text()
    for verdict, _ in verdicts:
        assert f" {verdict} " in shown or f"│ {verdict}" in shown, shown
    assert "mar…" not in shown and "fai…" not in shown and "sta…" not in shown, shown


def test_a_cpu_sweep_s_table_fits_100_columns_with_whole_headers_grouped_numbers_and_no_oom_headroom() -> None:
    """Issue 47 #5: ~182 columns, headers squeezed to `res…`, alloc and device columns always empty on a CPU,
    `1.098e+04` beside `10,983`, and "headroom -49%" on an OOM row."""
    from src.report.text import _opening

    def row(n: int, verdict: str, detail: str, tokens: float, peak: float) -> TrialRow:
        metrics = {"tokens_per_s": tokens, "peak_vram_reserved_gib": peak, "vram_headroom_frac": 1 - peak / 0.32}
        metrics |= {"step_time_s": 0.263, "tokens_per_optimizer_step": 2430.0}
        params = {"trainer.gradient_accumulation_steps": 2, "trainer.per_device_train_batch_size": 2**n}
        return TrialRow(n, params, {}, verdict, detail, metrics, failure_kind="oom" if verdict == "failed" else None)

    rows = [row(0, "stable", "headroom 76%", 2388.0, 0.08), row(1, "failed", "oom at step 1", 0.0, 0.48)]
    rows += [row(n, "stable", f"headroom {n}%", 10983.0, 0.14) for n in range(2, 6)]
    knobs = ["trainer.gradient_accumulation_steps", "trainer.per_device_train_batch_size"]
    sweep = Sweep(
        "demo", "sqlite:///x", Path("/nowhere"), ["tokens_per_s"], ["maximize"], 0.1, 0.32, knobs, rows, None, []
    )
    console = Console(width=100, record=True, color_system=None)
    console.print(table(sweep))
    shown = console.export_text()
    assert max(len(line) for line in shown.splitlines()) <= 100
    assert "…" not in shown, shown
    assert "alloc" not in shown and "device" not in shown, "no column without a figure in it"
    assert "10,983" in shown and "e+0" not in shown and "-" not in shown.replace("─", ""), shown
    opening = "\n".join(_opening(sweep))
    assert "10,983 tokens_per_s" in opening and "e+0" not in opening


def test_a_cpu_sweep_s_memory_model_section_says_the_model_only_ranks_there() -> None:
    """Issue 47 #2: "mean error 464.9%" on a CPU with no word that the model only ranks there."""
    from src.report.memory import CPU_NOTE, section

    def sweep(slot: str) -> Sweep:
        rows = [
            TrialRow(
                number=n,
                params={},
                distributions={},
                verdict="stable",
                detail="headroom 60%",
                metrics={"peak_vram_reserved_gib": 0.1, "predicted_peak_vram_reserved_gib": 0.5 + n / 10},
                slot=f"{slot}{n}",
            )
            for n in range(3)
        ]
        return Sweep(
            "demo", "sqlite:///x", Path("/nowhere"), ["tokens_per_s"], ["maximize"], 0.1, 0.32, [], rows, None, []
        )

    on_cpu = "\n".join(section(sweep("cpu"), False, False))
    assert "mean error is 500.0%" in on_cpu and CPU_NOTE in on_cpu and "only ranks" in CPU_NOTE
    assert CPU_NOTE not in "\n".join(section(sweep("cuda"), False, False)), "on a GPU its error is its error"
