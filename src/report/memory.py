"""The report's memory-model and soak views: predicted against measured peak for every trial (the memory model's
prediction, made before launch, src/sweep/memory.py), and each soaked finalist's memory over its steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from src.report.plots import finish
from src.study import Sweep, TrialRow

PREDICTED = "predicted_peak_vram_reserved_gib"
MEASURED = "peak_vram_reserved_gib"
CPU_NOTE = (
    "These trials ran on a CPU, where the memory model does not describe the device (its terms are fitted to CUDA's "
    "allocator; the stand-in card's peak is the process's memory beyond start-up): it only ranks the settings, which "
    "to run first and which to skip, and the trials decide. These errors say nothing of its error on a GPU."
)


def _rows(sweep: Sweep) -> list[TrialRow]:
    return [r for r in sweep.rows if PREDICTED in r.metrics]


def errors(sweep: Sweep) -> list[tuple[TrialRow, float]]:
    """(trial, relative error of the prediction) for every trial that ran and measured a peak."""
    return [
        (r, r.metrics[PREDICTED] / r.metrics[MEASURED] - 1)
        for r in _rows(sweep)
        if r.verdict in ("stable", "marginal") and r.metrics.get(MEASURED)
    ]


def plot_predicted(sweep: Sweep, path: Path) -> bool:
    """Predicted against measured peak reserved VRAM; OOMs and predicted OOMs at the budget. False: nothing to draw
    (no trial was predicted, or none measured VRAM: a CPU)."""
    import matplotlib.pyplot as plt

    measured = errors(sweep)
    if not measured:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    xs = [r.metrics[PREDICTED] for r, _ in measured]
    ax.scatter(xs, [r.metrics[MEASURED] for r, _ in measured], s=22, c="#2e7d32", label="ran (measured)")
    budget = sweep.budget or max(xs)
    ooms = [r for r in _rows(sweep) if r.verdict == "failed" and r.failure_kind == "oom"]
    if ooms:
        ax.scatter([r.metrics[PREDICTED] for r in ooms], [budget] * len(ooms), marker="x", c="#c62828", label="OOM")
    skipped = [r for r in _rows(sweep) if r.verdict == "skipped" and r.failure_kind == "oom" and r.because_of is None]
    if skipped:
        ax.scatter(
            [r.metrics[PREDICTED] for r in skipped],
            [budget] * len(skipped),
            marker="|",
            c="#757575",
            label="skipped: predicted OOM",
        )
    top = max([*xs, budget, *(r.metrics[PREDICTED] for r in ooms + skipped)]) * 1.05
    ax.plot([0, top], [0, top], color="#9e9e9e", lw=1, label="prediction = measurement")
    ax.axhline(budget, color="#c62828", ls="--", lw=1, label=f"budget {budget:g} GiB")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted peak reserved (GiB)")
    ax.set_ylabel("measured peak reserved (GiB)")
    mean = sum(abs(e) for _, e in measured) / len(measured)
    title = f"{sweep.name}: memory model, mean error {mean:.1%} over {len(measured)} trials"
    if sweep.on_cpu():
        title += "\n(on a CPU the model only ranks: see the report)"
    finish(fig, ax, path, title, size=9, legend=7, where="upper left")
    return True


def plot_soak(sweep: Sweep, path: Path) -> bool:
    """Each soak's memory over its steps, with the probe's peak and the budget: on a GPU the reserved memory at
    each step's end, on a CPU each step's peak as the soak's is judged (src/measure/memory.py HostMemory). A soak
    recorded before the CPU's series was its peak's (the process's memory beyond start-up, which grows with every
    micro-step seen: 0.62 GiB in a soak that passed at 0.14) is drawn labelled for what it is, without the budget
    and the probe's peak it was never judged against."""
    import matplotlib.pyplot as plt

    soaks = {n: s for n, s in sweep.soaks.items() if s.get("vram_reserved_gib")}
    if not soaks:
        return False
    # A series above the peak its soak was judged on is not that peak's (a step's reserved memory never is)
    judged = all(
        s.get("peak_vram_reserved_gib") is None or max(s["vram_reserved_gib"]) <= s["peak_vram_reserved_gib"] * 1.001
        for s in soaks.values()
    )
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    for number, soak in sorted(soaks.items()):
        series = soak["vram_reserved_gib"]
        steps = soak.get("steps") or len(series)
        xs = [i * steps / len(series) for i in range(len(series))]
        line = ax.plot(xs, series, lw=1.2, label=f"trial {number}: soak {soak.get('status')}")[0]
        if judged and soak.get("map_peak_vram_reserved_gib"):
            ax.axhline(soak["map_peak_vram_reserved_gib"], color=line.get_color(), ls=":", lw=1)
    if judged and sweep.budget:
        ax.axhline(sweep.budget, color="#c62828", ls="--", lw=1, label=f"budget {sweep.budget:g} GiB")
    ax.set_xlabel("optimizer step")
    cpu = sweep.on_cpu()
    if not judged:
        ax.set_ylabel("process memory beyond start-up (GiB):\nnot what the soak judged", fontsize=8)
        title = f"{sweep.name}: process memory over the soak (its verdict: the table's peak)"
    else:
        ax.set_ylabel("each step's peak beyond start-up (GiB)" if cpu else "reserved VRAM (GiB)")
        title = f"{sweep.name}: memory over the soak (dotted: the probe's peak)"
    ax.set_ylim(bottom=0)
    finish(fig, ax, path, title, size=9, legend=7, where="lower right")
    return True


def section(sweep: Sweep, predicted_png: bool, soak_png: bool) -> list[str]:
    """report.md's "Memory model" and "Soak" sections."""
    out: list[str] = []
    rows = _rows(sweep)
    if rows:
        measured = errors(sweep)
        out += ["## Memory model: predicted against measured", ""]
        if predicted_png:
            out += ["![predicted against measured](predicted_vs_measured.png)", ""]
        if measured:
            mean = sum(abs(e) for _, e in measured) / len(measured)
            worst = max(measured, key=lambda x: abs(x[1]))
            out += [
                f"The memory model (`python -m src.fit`) predicted each trial's peak before it was launched; over the "
                f"{len(measured)} that ran, its mean error is {mean:.1%} and its worst {worst[1]:+.1%} (trial "
                f"{worst[0].number}).",
                "",
            ]
            if sweep.on_cpu():
                out += [CPU_NOTE, ""]
        out += ["| trial | class | predicted GiB | measured GiB | error |", "|---|---|---|---|---|"]
        for r in rows:
            m = r.metrics.get(MEASURED) if r.verdict in ("stable", "marginal") else None
            err = f"{r.metrics[PREDICTED] / m - 1:+.1%}" if m else ""
            what = r.verdict + (f" ({r.detail})" if r.verdict in ("failed", "skipped") else "")
            out.append(f"| {r.number} | {what} | {r.metrics[PREDICTED]:.2f} | {f'{m:.2f}' if m else ''} | {err} |")
        out.append("")
    if sweep.soaks:
        out += ["## Soak", ""]
        if soak_png:
            out += ["![memory over the soak](soak_memory.png)", ""]
        out += [
            "The best stable settings trained at least one whole epoch, in the data's real order, and at least "
            "`hydra.sweeper.soak_minutes`; promotion takes only the ones that passed.",
            "",
            "| trial | soak | steps | minutes | peak GiB | probe's peak GiB | change | fragmentation | step-time drift |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for number, s in sorted(sweep.soaks.items()):
            out.append(
                f"| {number} | {s.get('status')}: {s.get('detail', '')} | {s.get('steps', '')} | "
                f"{_num(s.get('minutes'), '.1f')} | {_num(s.get('peak_vram_reserved_gib'), '.2f')} | "
                f"{_num(s.get('map_peak_vram_reserved_gib'), '.2f')} | {_num(s.get('peak_vs_map'), '+.1%')} | "
                f"{_num(s.get('fragmentation_frac'), '.1%')} | {_num(s.get('step_time_drift'), '+.1%')} |"
            )
        out.append("")
    return out


def _num(value: Any, form: str) -> str:
    return "" if value is None else format(value, form)
