"""Calibration: the memory model's coefficients fitted to the measured trials of one stack, from MLflow history.

A point is a finished trial (`trial.status` ok) that measured a peak reserved VRAM; its setting is rebuilt from
its params (the composed config, flattened) and its peak micro-batch from its data's token lengths. Points are
grouped by stack (GPU model and the versions of torch, transformers, peft, bitsandbytes, trl): allocations
differ between versions, so a model is fitted to one stack's points only.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf

from src.fit.model import MemoryModel, Point, Setting, fit, peak_batch

log = logging.getLogger(__name__)
STACK_TAGS = (
    "gpu.name",
    "version.torch",
    "version.transformers",
    "version.peft",
    "version.bitsandbytes",
    "version.trl",
)
MIN_POINTS = 8  # fewer measured trials than this: the sweep predicts but never skips on a prediction


def stack_of(tags: dict[str, str]) -> dict[str, str]:
    return {k: tags.get(k, "?") for k in STACK_TAGS}


def stack_label(stack: dict[str, str]) -> str:
    if not stack:
        return "no stack"
    return f"{stack.get('gpu.name', '?')} · torch {stack.get('version.torch', '?')} · " + " · ".join(
        f"{k.removeprefix('version.')} {v}"
        for k, v in stack.items()
        if k.startswith("version.") and k != "version.torch"
    )


def current_stack() -> dict[str, str] | None:
    """This machine's stack where it has a GPU (a CPU measures no VRAM: no stack to match). From NVML and the
    installed packages: no CUDA context in the asking process (a sweep's engine holds none)."""
    from src import gpus, tracking

    if not gpus.indices():
        return None
    try:
        name = gpus.handle(0) and gpus.nvml().nvmlDeviceGetName(gpus.handle(0))
    except Exception:  # noqa: BLE001 - no driver after all
        return None
    tags = {f"version.{k}": v for k, v in tracking.versions().items()}
    tags["gpu.name"] = name.decode() if isinstance(name, bytes) else str(name)
    return stack_of(tags)


def vocab_fallback(cfg: Any) -> int | None:
    """A random model sized to its tokenizer (`model.build.vocab_size: null`): the tokenizer's size."""
    build = cfg.model.get("build")
    if build is not None and build.get("vocab_size") is None:
        from src.preflight.data import load_tokenizer

        return len(load_tokenizer(cfg))
    return None


def config_of(params: dict[str, str]) -> DictConfig:
    """A run's params (dotted keys, string values) as a nested config."""
    nested: dict[str, Any] = {}
    for key, text in params.items():
        try:
            value = None if text == "None" else yaml.safe_load(text)  # tracking.params writes None as "None"
        except yaml.YAMLError:
            value = text
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node.get(p, {}), dict) else {}
        node[leaf] = value
    return OmegaConf.create(nested)


class Lengths:
    """Token lengths of each data set the trials trained on, tokenized once per (data, tokenizer)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, ...], np.ndarray | None] = {}

    def of(self, cfg: DictConfig) -> np.ndarray | None:
        from src.data import load_table, to_messages, token_lengths
        from src.preflight.data import load_tokenizer

        data = cfg.get("data", {})
        key = tuple(str(data.get(k)) for k in ("path", "input_column", "output_column", "system_prompt"))
        key += (str(cfg.model.get("path")),)
        if key not in self.cache:
            try:
                full, _ = token_lengths(to_messages(load_table(cfg.data), cfg.data), load_tokenizer(cfg))
                self.cache[key] = np.asarray(full)
            except Exception as exc:  # data moved or unreadable here: the worst case (every row full length)
                log.info("data of %s not readable here (%s): its rows taken at max_seq_length", key[0], exc)
                self.cache[key] = None
        return self.cache[key]


@dataclass
class History:
    points: dict[tuple[tuple[str, str], ...], list[Point]]  # stack -> points
    cpu_trials: int = 0  # measured trials of the model that ran on a CPU: not a card's memory, not used

    def best_stack(self, wanted: dict[str, str] | None) -> tuple[dict[str, str], list[Point]]:
        """The wanted stack's points, else the stack with most points (a CPU asks for a GPU's map)."""
        if not self.points:
            return {}, []
        if wanted is not None:
            key = tuple(sorted(wanted.items()))
            return dict(key), self.points.get(key, [])
        key = max(self.points, key=lambda k: len(self.points[k]))
        return dict(key), self.points[key]


def history(tracking_uri: str, model_name: str, lengths: Lengths | None = None) -> History:
    """Every finished trial of `model_name` in the MLflow store that measured its peak reserved VRAM."""
    from mlflow.tracking import MlflowClient

    from src import tracking

    tracking.setup(tracking_uri)
    client = MlflowClient()
    lengths = lengths or Lengths()
    experiments = [e.experiment_id for e in client.search_experiments()]
    points: dict[tuple[tuple[str, str], ...], list[Point]] = {}
    cpu_trials = 0
    if not experiments:
        return History(points)
    runs = client.search_runs(
        experiments,
        filter_string=f"tags.`model.name` = '{model_name}' and tags.`trial.status` = 'ok' "
        "and metrics.peak_vram_reserved_gib > 0",
        max_results=5000,
    )
    for run in runs:
        if run.data.tags.get("gpu.name", "none").lower().startswith("none"):
            cpu_trials += 1
            continue  # a CPU trial: its "VRAM" is the process's memory under the budget (src/measure/memory.py)
        point = point_of(run.data.params, run.data.metrics, lengths, label=run.info.run_id)
        if point is not None:
            key = tuple(sorted(stack_of(run.data.tags).items()))
            points.setdefault(key, []).append(point)
    return History(points, cpu_trials)


def point_of(params: dict[str, str], metrics: dict[str, float], lengths: Lengths, label: str = "") -> Point | None:
    cfg = config_of(params)
    try:
        setting = Setting.from_config(cfg, vocab_fallback=vocab_fallback(cfg))
    except Exception as exc:  # a run from another project layout, or a model without config.json here
        log.debug("run %s: no setting (%s)", label, exc)
        return None
    if int(cfg.get("hardware", {}).get("processes") or 1) > 1:
        return None
    return Point(
        setting,
        peak_batch(lengths.of(cfg), setting),
        float(metrics["peak_vram_reserved_gib"]),
        metrics.get("cuda_context_gib"),
        label,
    )


def calibrated(tracking_uri: str, model_name: str, stack: dict[str, str] | None = None) -> tuple[MemoryModel, str]:
    """The model fitted to this stack's history (first principles where there is none), and a line saying so."""
    found = history(tracking_uri, model_name)
    chosen, points = found.best_stack(stack if stack is not None else current_stack())
    if not points:
        if found.cpu_trials:
            return MemoryModel(), (
                f"first principles, not calibrated: the {found.cpu_trials} measured trial(s) of this model ran on a "
                "CPU, whose memory is the process's, not a card's; no GPU trial of it on this stack yet"
            )
        return MemoryModel(), "first principles, not calibrated: no measured trial of this model on this stack yet"
    model = fit(points, chosen)
    others = Counter({k: len(v) for k, v in found.points.items() if dict(k) != chosen})
    note = f"calibrated on {len(points)} measured trials ({stack_label(chosen)})"
    if others:
        note += f"; {sum(others.values())} trials of other stacks not used"
    return model, note
