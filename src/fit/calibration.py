"""Calibration: the memory model's coefficients fitted to the measured trials of one stack, from MLflow history.

The allocated terms are fitted to each point's peak allocated, the allocator's cache to what its peak reserved holds
beyond (one coefficient per allocator); the model's errors are what a fit that left a point out missed it by,
under- and over-prediction apart, per allocator, on the figure that decides a fit there (`Prediction.needed_gib`:
peak allocated under expandable segments, peak reserved on the default allocator).

A point is a finished trial (`trial.status` ok) that measured a peak reserved VRAM; its setting is rebuilt from
its params (the composed config, flattened) and its peak micro-batch from its data's token lengths. Points are
grouped by stack (GPU model and the versions of torch, transformers, peft, bitsandbytes, trl): allocations
differ between versions, so a model is fitted to one stack's points only.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from src.fit.model import (
    ALLOCATED,
    CACHE,
    DEFAULT_CONTEXT_GIB,
    DEFAULTS,
    TERMS,
    MemoryModel,
    Point,
    allocator,
    attention_excess,
    counts,
    terms,
)
from src.fit.setting import Setting, peak_batch

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


def configured(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A copy of `cfg` with dotted overrides applied (`key=value`, the value read as YAML; a config group choice is
    left out: it is already composed)."""
    import copy

    out = copy.deepcopy(cfg)  # DictConfig.copy() is shallow: an update would reach the original
    with open_dict(out):
        for override in overrides:
            key, equals, text = override.partition("=")
            key = key.lstrip("+~")
            if "." not in key or not equals:
                continue
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                value = text
            OmegaConf.update(out, key, value, force_add=True)
    return out


class Lengths:
    """Token lengths of each data set the trials trained on, tokenized once per (data, tokenizer)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray] | None] = {}

    def of(self, cfg: DictConfig) -> np.ndarray | None:
        """Each row's length in tokens (None: the data is not readable here)."""
        rows = self.rows(cfg)
        return None if rows is None else rows[0]

    def rows(self, cfg: DictConfig) -> tuple[np.ndarray, np.ndarray] | None:
        """(each row's length, its prompt's length) in tokens; None where the data is not readable here."""
        from src.data import load_table, to_messages, token_lengths
        from src.preflight.data import load_tokenizer

        data = cfg.get("data", {})
        key = tuple(str(data.get(k)) for k in ("path", "input_column", "output_column", "system_prompt"))
        key += (str(cfg.model.get("path")),)
        if key not in self.cache:
            try:
                full, prompts = token_lengths(to_messages(load_table(cfg.data), cfg.data), load_tokenizer(cfg))
                self.cache[key] = (np.asarray(full), np.asarray(prompts))
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
    if setting.checkpointing and setting.checkpoint_above_tokens is not None:
        return None  # its peak is a checkpointed micro-batch's or a kept one's: not one form's point to fit
    return Point(
        setting,
        peak_batch(lengths.of(cfg), setting),
        float(metrics["peak_vram_reserved_gib"]),
        metrics.get("cuda_context_gib"),
        label,
        metrics.get("peak_vram_allocated_gib"),
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


# The pull toward first principles, against the squared relative errors: a prior of about +-200% on each coefficient
# for points measured to about 2% (a coefficient the points do not tell, eager attention in a map without it,
# stays at its first-principles value; one they tell moves freely). 1e-3 (+-60%) held the allocated terms away from
# what the random design's peak allocated told them (mean held-out error 3.1% against 2.5% with expandable segments).
RIDGE = 1e-4
ERROR_FLOOR = 0.02  # the least error stated: run-to-run differences of the same setting


def fit(
    points: list[Point],
    stack: dict[str, str] | None = None,
    group: Callable[[Point], Hashable] | None = None,
    phases: bool = False,
) -> MemoryModel:
    """Coefficients that minimise the squared relative error over `points` (with a light pull toward the
    first-principles values), the CUDA context as the points measured it, and the model's errors: each point predicted
    by a fit that left out its group (`group`: points that are one setting, e.g. measured under both allocators;
    default each point alone), the largest under- and over-prediction, per allocator. `phases`: a layer's backward
    in two phases (`model.terms`, 0.10.2), not yet judged on a set it never saw; by default every term added."""
    if not points:
        return MemoryModel(stack=dict(stack or {}), phases=phases)
    table = [counts(p.setting, p.batch) for p in points]
    contexts = [p.context_gib for p in points if p.context_gib]
    model = MemoryModel(
        coefficients=solve(points, table, phases),
        context_gib=float(np.median(contexts)) if contexts else DEFAULT_CONTEXT_GIB,
        points=len(points),
        stack=dict(stack or {}),
        phases=phases,
    )
    if len(points) >= 3:
        keys = [group(p) if group else k for k, p in enumerate(points)]
        ratios = []
        for k, p in enumerate(points):
            rest = [i for i, key in enumerate(keys) if key != keys[k]]
            held = MemoryModel(solve([points[i] for i in rest], [table[i] for i in rest], phases), phases=phases)
            ratios.append(ratio(held, p))
        model.error, model.error_over = bounds(ratios)
        for name in sorted({allocator(p.setting) for p in points}):  # the same order every run (the file it writes)
            mine = [r for r, p in zip(ratios, points, strict=True) if allocator(p.setting) == name]
            if len(mine) >= 3:
                model.errors[name] = list(bounds(mine))
    return model


def ratio(model: MemoryModel, p: Point) -> float:
    """Measured over predicted of what decides a fit (`Prediction.needed_gib`): peak allocated under expandable
    segments (where the point measured it), else peak reserved. Above 1, the model under-predicted."""
    pred = model.predict(p.setting, p.batch)
    if pred.expandable and p.allocated_gib:
        return p.allocated_gib / pred.allocated_gib
    return p.reserved_gib / pred.reserved_gib


def bounds(ratios: list[float]) -> tuple[float, float]:
    """(error, error_over) from measured/predicted ratios: the least margins that cover every one of them."""
    r = np.asarray(ratios)
    return max(float(r.max()) - 1, ERROR_FLOOR), max(float(1 / r.min()) - 1, ERROR_FLOOR)


def solve(points: list[Point], table: list[dict[str, float]] | None = None, phases: bool = False) -> dict[str, float]:
    """The fitted coefficients: the allocated terms to each point's peak allocated (its reserved where that is not
    known, the cache taken at first principles), then the cache's, per allocator, to the peak reserved left beyond the
    allocated terms' prediction, robustly (`_robust`). `table`: the points' counts, where already made."""
    table = table or [counts(p.setting, p.batch) for p in points]
    known = [n for n in TERMS if n not in ALLOCATED and n != "allocator_cache"]
    target = []
    for p, c in zip(points, table, strict=True):
        measured = p.allocated_gib or p.reserved_gib
        cache = 0.0 if p.allocated_gib else terms(c, DEFAULTS, p.setting.expandable_segments)["allocator_cache"]
        target.append((measured - sum(c[n] for n in known) - cache) / measured)
    # Each point's peak is in one of a layer's two backward phases (model.terms): linear in the coefficients once the
    # phase is known, so the phases and the coefficients are found in turn until the phases hold still
    coef = dict(DEFAULTS)
    phase = [attention_excess(c, coef) > 0 if phases else None for c in table]
    for _ in range(PHASE_ROUNDS):
        rows = [_allocated_row(p, c, attention) for p, c, attention in zip(points, table, phase, strict=True)]
        coef = dict(DEFAULTS) | _ridge(np.asarray(rows), np.asarray(target), ALLOCATED)
        found = [attention_excess(c, coef) > 0 if phases else None for c in table]
        if found == phase:
            break
        phase = found
    for expandable, names in CACHE.items():
        mine = [(p, c) for p, c in zip(points, table, strict=True) if p.setting.expandable_segments == expandable]
        mine = [(p, c) for p, c in mine if p.allocated_gib]
        if not mine:
            continue
        scores, tensors, fixed = names
        x = [
            [c["cache_scores"] * DEFAULTS[scores], c["cache_tensors"] * DEFAULTS[tensors], DEFAULTS[fixed]]
            for _, c in mine
        ]
        x = [[v / p.reserved_gib for v in row] for row, (p, _) in zip(x, mine, strict=True)]
        allocated = [
            sum(v for n, v in terms(c, coef, expandable, phases).items() if n != "allocator_cache") for _, c in mine
        ]
        y = [(p.reserved_gib - a) / p.reserved_gib for (p, _), a in zip(mine, allocated, strict=True)]
        coef |= _robust(np.asarray(x), np.asarray(y), names)
    return coef


PHASE_ROUNDS = 20  # the phases settle in 2-4 on the committed points


def _allocated_row(p: Point, c: dict[str, float], attention_phase: bool | None) -> list[float]:
    """A point's row of the allocated terms' least squares (relative to its measured peak), in its phase: in the
    attention's backward the MLP's half of one layer's activations is gone and the scores' gradients are there
    (None: the sum form, every term)."""
    x = {n: c[n] * DEFAULTS[n] for n in ALLOCATED}
    if attention_phase:
        x["activations"] -= c["mlp_activations"] * DEFAULTS["activations"]
    elif attention_phase is not None:
        x["attention_backward"] = 0.0
    measured = p.allocated_gib or p.reserved_gib
    return [x[n] / measured for n in ALLOCATED]


HUBER = 0.06  # relative miss beyond which a point counts linearly, not squared, in the cache's fit


def _robust(x: np.ndarray, y: np.ndarray, names: tuple[str, ...]) -> dict[str, float]:
    """`_ridge` with Huber's weights (iterated): the default allocator's cache has a heavy tail (what it holds depends
    on the order the batch shapes come in: 9.6 GiB on one random setting against 0.1-1.5 on most), so a setting whose
    order happened to leave it large moves the typical cache little; it shows in the stated error instead."""
    w = np.ones(len(y))
    for _ in range(10):
        solved = _ridge(x * w[:, None], y * w, names)
        theta = np.array([solved[n] / DEFAULTS[n] for n in names])
        miss = np.abs(x @ theta - y)
        w = np.sqrt(np.where(miss <= HUBER, 1.0, HUBER / np.maximum(miss, 1e-12)))
    return solved


def _ridge(x: np.ndarray, y: np.ndarray, names: tuple[str, ...]) -> dict[str, float]:
    """Non-negative ridge least squares of each coefficient relative to its default (1 = first principles)."""
    ridge = math.sqrt(RIDGE * len(y))
    free = list(range(len(names)))
    theta = np.ones(len(names))
    for _ in range(len(names)):  # non-negative: a coefficient that goes below 0 is pinned at 0 and the rest refit
        a = np.vstack([x[:, free], ridge * np.eye(len(free))])
        b = np.concatenate([y, ridge * np.ones(len(free))])
        solved, *_ = np.linalg.lstsq(a, b, rcond=None)
        theta[free] = solved
        negative = [f for f, v in zip(free, solved, strict=True) if v < 0]
        if not negative:
            break
        theta[negative] = 0.0
        free = [f for f in free if f not in negative]
    return {n: float(DEFAULTS[n] * v) for n, v in zip(names, theta, strict=True)}
