"""A study as the report and the promotion read it, from the Optuna storage and the MLflow tracking URI alone:
read the sweep's settings, classify every trial (finding it: src/places.py).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from omegaconf import OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from src import knobs, record
from src.config import compose
from src.places import DEFAULT_MARGIN, find_study, store_exists
from src.record import STALE_KIND, STALE_MESSAGE, failure_kind, retried_numbers

# What one optimizer step trains on, per device: the micro-batch's rows and how many micro-batches are summed.
STEP_KEYS = ("trainer.per_device_train_batch_size", "trainer.gradient_accumulation_steps")
PACKING = "trainer.packing"
CLASSES = ("stable", "marginal", "failed", "skipped", "pruned", "running")
# What the engine records on the sweep's parent run as `sweep.<key>` tags (JSON values).
_SETTINGS = ("objectives", "headroom_margin", "trial_overrides", "promote_different_optimisation")
# Also a parent tag: the truncation policy the trials would have had outside the sweep (a sweep measures settings
# that cut answers instead of refusing them; promotion still refuses them).
_POLICY = "max_truncated_answer_frac"


__all__ = ["STALE_KIND", "STALE_MESSAGE", "failure_kind", "retried_numbers"]  # from src/record.py, read here too


# ---- the trials, classified ------------------------------------------------------------------------------------


@dataclass
class TrialRow:
    number: int
    params: dict[str, Any]
    distributions: dict[str, BaseDistribution]
    verdict: str  # one of CLASSES
    detail: str  # why: "oom at step 3", "headroom 6% < 10%", "same setting as trial 2"
    metrics: dict[str, float]
    failure_kind: str | None = None
    failure_message: str | None = None
    run_id: str | None = None
    because_of: int | None = None  # skipped: the trial whose outcome stands for this one
    slot: str | None = None  # the engine's slot: "cuda0", "cuda0#2" (third of the trials sharing card 0), "cpu1"
    recipe: bool = False  # the user's recipe (the sweep's first enqueued trial)
    # A lever trial: the recipe's params plus these overrides ("trainer.gradient_checkpointing=true"); it shares
    # its params with the recipe, so whatever groups trials by params leaves it out (see Sweep.plain_rows)
    lever: list[str] = field(default_factory=list)
    recommended: bool = False  # a recommendation trial (src/sweep/journey.py): levers combined with a length
    # The config keys and values it ran with, where they are not its params (a custom search space's labels)
    settings: dict[str, Any] | None = None
    same_model: dict[str, Any] = field(default_factory=dict)  # the check against the reference (record.SAME_MODEL)
    timed: dict[str, Any] = field(default_factory=dict)  # its speed read alone, several times (record.TIMED)

    def speed(self) -> float | None:  # tokens/s: the median of its runs alone where timed (src/sweep/timing.py)
        return self.timed.get("tokens_per_s") or self.metrics.get("tokens_per_s")

    def setting(self) -> dict[str, Any]:
        """Config key -> value as the trial ran (its params, or what a custom space's labels stood for)."""
        return self.params if self.settings is None else self.settings

    def change(self) -> str:
        """A lever's overrides as the report's "change" column shows them: "gradient_checkpointing=true"."""
        return ", ".join(short_override(o) for o in self.lever)


def classify(trial: FrozenTrial, margin: float, retried: bool = False) -> tuple[str, str]:
    """(class, detail) of one trial. Headroom is the contract's: 1 - peak reserved / budget. `retried`: the
    sweep queued its setting again (see retried_numbers); an older engine marked the trial itself."""
    a = trial.user_attrs
    status = record.status(a)
    if status == "skipped":
        origin = record.origin(a)
        detail = a.get(record.SKIPPED_REASON) or (f"repeat of trial {origin}" if origin is not None else "not launched")
        return "skipped", str(detail)
    if trial.state in (TrialState.RUNNING, TrialState.WAITING):
        return "running", trial.state.name.lower()
    if status == "ok":
        return _finished(a, margin)
    # The engine tells a setting's own failure (an OOM, a refused setting) PRUNED: it is a failure, by its status.
    if status == "pruned" or (trial.state == TrialState.PRUNED and status != "failed"):
        return "pruned", "pruned"
    kind = failure_kind(trial) or "other"
    step = a.get(record.FAILURE_STEP)
    detail = f"{kind} at step {step}" if step is not None else str(kind)
    return "failed", detail + (" (retried)" if retried or a.get(record.RETRIED) else "")


def _below(value: float, limit: float) -> str:
    """ "6% < 10%": two shares with as many decimals as it takes to tell them apart (24.96% < 25.00%, never
    25% < 25%)."""
    for digits in range(4):
        shown, bound = f"{value:.{digits}%}", f"{limit:.{digits}%}"
        if shown != bound:
            break
    return f"{shown} < {bound}"


def headroom_of(a: dict[str, Any], budget: float | None = None) -> float | None:
    """A finished trial's headroom (the contract's: 1 - peak reserved / budget) from its metrics or attributes;
    `budget` where the trial did not record its own; None when nothing measured its peak. The report's classes and
    the sweep's constraint record (src/sweep/rules.py) both read it here."""
    headroom = a.get("vram_headroom_frac")
    budget = a.get("vram_budget_gib") or budget
    if headroom is None and a.get("peak_vram_reserved_gib") is not None and budget:
        headroom = 1.0 - a["peak_vram_reserved_gib"] / budget
    return headroom


def _finished(a: dict[str, Any], margin: float) -> tuple[str, str]:
    """A trial that ran to the end: stable, or marginal with the reasons."""
    headroom = headroom_of(a)
    notes = []
    if headroom is None:
        notes.append("no VRAM measurement")
    elif headroom < margin:
        notes.append(f"headroom {_below(headroom, margin)}")
    if a.get("alloc_retries"):
        notes.append(f"{a['alloc_retries']:g} allocator retries")
    return ("marginal", "; ".join(notes)) if notes else ("stable", f"headroom {headroom:.0%}")


@dataclass
class Sweep:
    """A study as the report and the promotion see it."""

    name: str
    storage: str
    study_dir: Path
    objectives: list[str]
    directions: list[str]
    margin: float
    budget: float | None
    knobs: list[str]
    rows: list[TrialRow]
    parent_run_id: str | None
    probe_overrides: list[str]  # hydra.sweeper.trial_overrides: what made each trial a short probe
    # preflight.max_truncated_answer_frac as the trials would have composed it without the sweep's relaxation:
    # a setting that cuts more answers keeps its class (about memory) but is never the best or promoted
    max_truncated_answer_frac: float | None = None
    # The soak of the finalists (src/sweep/soak.py): trial number -> what its long run measured and its verdict
    soaks: dict[int, dict[str, Any]] = field(default_factory=dict)
    # What the sweep searched for when the recipe was not stable within the policies (src/sweep/journey.py):
    # {"why", "queued": [[overrides]], "closest": {...} or None, "note"}; None when it did not search
    recommendation: dict[str, Any] | None = None
    # hydra.sweeper.promote_different_optimisation: other rows per optimizer step than the recipe's are ranked too
    different_optimisation: bool = False
    step_defaults: dict[str, Any] = field(default_factory=dict)  # the sweep's fixed config's (record.STEP_DEFAULTS)

    def trial_dir(self, number: int) -> Path:
        return self.study_dir / "trials" / f"{number:03d}"

    def row(self, number: int) -> TrialRow | None:
        return next((r for r in self.rows if r.number == number), None)

    def counts(self) -> Counter[str]:
        return Counter(r.verdict for r in self.rows)

    def on_cpu(self) -> bool:
        """Every trial that ran ran on a CPU slot (the stand-in card: src/measure/memory.py), none on a GPU."""
        slots = [r.slot for r in self.rows if r.slot]
        return bool(slots) and all(s.startswith("cpu") for s in slots)

    def card_shared_by(self) -> int:
        """The most trials that ran on one card at once (`hydra.sweeper.slots_per_gpu`), from the slots the
        trials ran on; 1 when each trial had its card to itself (or ran on a CPU)."""
        copies: dict[str, set[str]] = {}
        for r in self.rows:
            if r.slot and r.slot.startswith("cuda") and "#" in r.slot:
                card, copy = r.slot.split("#", 1)
                copies.setdefault(card, set()).add(copy)
        return max((len(c) for c in copies.values()), default=1)

    def shared_card_caption(self) -> str | None:
        """Under tokens/s wherever the figures show (picture, terminal table), when trials shared a card."""
        shared = self.card_shared_by()
        return (
            f"tokens/s read with up to {shared} trials sharing a card: a ranking, not solo speeds"
            if shared > 1
            else None
        )

    def memory_words(self) -> tuple[str, str]:
        """(axis label, title) for the peak memory the trials measured: reserved VRAM on a GPU; on a machine without
        one, the trial process's own memory beyond its start-up, which the budget held (src/measure/memory.py)."""
        if any("host_limit_gib" in r.metrics for r in self.rows):
            return (
                "peak memory beyond start-up (GiB)",
                "peak memory of each trial process beyond its start-up (no GPU: the budget held that memory)",
            )
        return "peak reserved VRAM (GiB)", "peak reserved VRAM"

    def plain_rows(self) -> list[TrialRow]:
        """The trials of the map: lever trials left out (their params are the recipe's, their setting is not)."""
        return [r for r in self.rows if not r.lever]

    def varying_knobs(self) -> list[str]:
        """Knobs that took more than one value: the ones worth a column, an axis or a label."""
        rows = self.plain_rows()
        return [k for k in self.knobs if len({sort_key(r.params.get(k)) for r in rows if k in r.params}) > 1]

    def cut_answers(self, row: TrialRow) -> float | None:
        """The share of answers the trial's max_seq_length cuts (`truncated_answer_frac`), where recorded."""
        return row.metrics.get("truncated_answer_frac")

    def cuts_too_much(self, row: TrialRow) -> bool:
        """The trial cuts more answers than the sweep's truncation policy allows: never best, never promoted."""
        cut, allowed = self.cut_answers(row), self.max_truncated_answer_frac
        return cut is not None and allowed is not None and cut > allowed

    def effective(self, row: TrialRow) -> str:
        """A skipped trial's class on the map: its origin's (a repeat, or a certain OOM), else skipped."""
        if row.verdict != "skipped":
            return row.verdict
        origin = self.row(row.because_of) if row.because_of is not None else None
        if origin is not None and origin.verdict != "skipped":
            return origin.verdict
        return "failed" if row.failure_kind else "skipped"

    def recipe_row(self) -> TrialRow | None:
        """The user's recipe: the trial the sweep marked as it (`sweep.recipe`); None when the sweep had none."""
        return next((r for r in self.rows if r.recipe), None)

    def good(self, row: TrialRow) -> bool:
        """Needs no change: stable, and cuts no more answers than the policy allows."""
        return row.verdict == "stable" and not self.cuts_too_much(row)

    def recommended(self) -> TrialRow | None:
        """The setting to train: the best ranked trial that passed its soak, else the best ranked (not soaked yet);
        what `python -m src.promote` takes without flags (src/promote/choosing.py)."""
        ranked = self.ranked()
        soaked = [r for r in ranked if self.soaks.get(r.number, {}).get("status") == "passed"]
        return (soaked or ranked or [None])[0]

    def best(self) -> TrialRow | None:
        """The first of `ranked`."""
        return next(iter(self.ranked()), None)

    def ranked(self) -> list[TrialRow]:
        """stable_ranked's trials that train the recipe's model (its rows per optimizer step, or any with
        `different_optimisation`; none the same-model check failed): the soak's finalists are the first of them."""
        either = self.different_optimisation
        return [
            r for r in self.stable_ranked() if (either or self.same_optimisation(r)) and r.same_model.get("passed", 1)
        ]

    def stable_ranked(self) -> list[TrialRow]:
        """Every stable trial within the truncation policy, best first by the first objective (ties: the earlier)."""
        objective, maximize = self.objectives[0], self.directions[0] == "maximize"
        stable = [
            r for r in self.rows if r.verdict == "stable" and objective in r.metrics and not self.cuts_too_much(r)
        ]
        return sorted(stable, key=lambda r: ((1 if maximize else -1) * self.score(r), -r.number), reverse=True)

    def score(self, row: TrialRow) -> float:
        """A stable trial's first objective; tokens/s: the median of its runs alone where the sweep timed it."""
        return row.speed() if self.objectives[0] == "tokens_per_s" else row.metrics[self.objectives[0]]

    def trains_differently(self) -> list[TrialRow]:
        """The stable trials that put other rows into an optimizer step than the recipe, best first."""
        return [r for r in self.stable_ranked() if not self.same_optimisation(r)]

    def step(self, row: TrialRow) -> tuple[Any, Any] | None:
        """(batch, accumulation) of one optimizer step as the trial set them (else the recipe, then the sweep's fixed
        config; None where nothing says); None when packed: a packed micro-batch holds as many rows as fit."""
        recipe = self.recipe_row()
        setting = {**self.step_defaults, **(overridden(recipe) if recipe else {}), **overridden(row)}
        return None if setting.get(PACKING) is True else (setting.get(STEP_KEYS[0]), setting.get(STEP_KEYS[1]))

    def rows_per_step(self, row: TrialRow) -> int | None:
        """Rows per optimizer step per device: batch x accumulation, else as measured; None when packed or unknown."""
        step = self.step(row)
        if step is not None and all(isinstance(v, int) for v in step):
            return step[0] * step[1]
        measured = row.metrics.get("rows_per_optimizer_step")
        return int(measured) if measured and step is not None else None

    def same_optimisation(self, row: TrialRow) -> bool:
        """Trains on the recipe's rows per optimizer step, unpacked (True where the sweep marked no recipe)."""
        recipe = self.recipe_row()
        if recipe is None or row is recipe:
            return True
        mine, theirs = self.step(row), self.step(recipe)
        if mine is None or theirs is None:
            return False
        return mine == theirs or (self.rows_per_step(row) or -1) == self.rows_per_step(recipe)


# ---- reading a study ---------------------------------------------------------------------------------------------


def sweep_settings(study: optuna.Study, tracking_uri: str | None) -> dict[str, Any]:
    """The sweep's objectives, headroom margin, per-trial probe overrides and truncation policy. The engine's
    parent run is the authority (it records what the sweep ran with, command-line overrides included); the
    project's defaults fill in what it does not hold (no store here, or a run the engine no longer reaches)."""
    found: dict[str, Any] = {}
    tags = _parent_tags(study, tracking_uri)
    for key in (*_SETTINGS, _POLICY):
        if f"sweep.{key}" in tags:
            found[key] = json.loads(tags[f"sweep.{key}"])
    if isinstance(found.get("objectives"), dict):
        found["objectives"] = list(found["objectives"])  # {metric: direction}, in the study's order
    if {*_SETTINGS, _POLICY} - set(found):
        cfg = compose(["hydra/sweeper=optuna"], hydra_config=True)
        for key in _SETTINGS:
            value = cfg.hydra.sweeper.get(key)
            found.setdefault(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
        found.setdefault(_POLICY, cfg.preflight.get(_POLICY))
    return found


def _parent_tags(study: optuna.Study, tracking_uri: str | None) -> dict[str, str]:
    parent = study.user_attrs.get(record.PARENT_RUN_ID)
    if not (parent and tracking_uri and store_exists(tracking_uri)):
        return {}
    try:
        from mlflow.tracking import MlflowClient

        return dict(MlflowClient(tracking_uri).get_run(parent).data.tags)
    except Exception:  # noqa: BLE001 - the store is elsewhere or the run gone: the defaults remain
        return {}


def load(
    name: str | None,
    sweeps_dir: Path,
    storage: str | None = None,
    margin: float | None = None,
    tracking_uri: str | None = None,
) -> Sweep:
    """Read a study and classify every trial. `margin` None: the sweep's own `headroom_margin` (or 10%)."""
    name, url = find_study(name, sweeps_dir, storage)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=url)
    settings = sweep_settings(study, tracking_uri)
    objectives = settings.get("objectives") or ["tokens_per_s"]
    objectives = [objectives] if isinstance(objectives, str) else list(objectives)
    if margin is None:
        margin = float(settings.get("headroom_margin") or DEFAULT_MARGIN)
    trials = study.get_trials(deepcopy=False)
    retried = retried_numbers(trials)
    rows = [_row(t, margin, t.number in retried) for t in trials]
    for row in rows:
        row.same_model = study.user_attrs.get(record.same_model_key(row.number)) or {}
        row.timed = study.user_attrs.get(record.timed_key(row.number)) or {}
    budgets = [float(t.user_attrs["vram_budget_gib"]) for t in trials if t.user_attrs.get("vram_budget_gib")]
    return Sweep(
        name=name,
        storage=url,
        study_dir=sweeps_dir / name,
        objectives=objectives,
        directions=[d.name.lower() for d in study.directions],
        margin=margin,
        budget=max(budgets) if budgets else None,
        knobs=knobs.ordered({k for r in rows for k in r.params}),
        rows=rows,
        parent_run_id=study.user_attrs.get(record.PARENT_RUN_ID),
        probe_overrides=[str(o) for o in settings.get("trial_overrides") or []],
        max_truncated_answer_frac=None if settings.get(_POLICY) is None else float(settings[_POLICY]),
        soaks={int(k.split(".", 1)[1]): v for k, v in study.user_attrs.items() if record.is_soak_key(k, v)},
        recommendation=study.user_attrs.get(record.RECOMMENDATION),
        different_optimisation=bool(settings.get("promote_different_optimisation")),
        step_defaults=study.user_attrs.get(record.STEP_DEFAULTS) or {},
    )


# Optuna params that are not knobs: a lever or recommendation trial's change (read from LEVER instead)
_NOT_KNOBS = record.STAGE_PARAMS


def _row(t: FrozenTrial, margin: float, retried: bool) -> TrialRow:
    verdict, detail = classify(t, margin, retried)
    a = t.user_attrs
    origin = record.origin(a)
    kind = failure_kind(t)
    stale = kind == STALE_KIND and record.recorded_kind(a) is None
    params, lever = effective({k: v for k, v in t.params.items() if k not in _NOT_KNOBS}, _lever(a.get(record.LEVER)))
    return TrialRow(
        number=t.number,
        # A lever trial's lever param is its lever (below), not a knob
        params=params,
        distributions={k: v for k, v in t.distributions.items() if k not in _NOT_KNOBS},
        verdict=verdict,
        detail=detail,
        metrics={k: float(v) for k, v in a.items() if _is_metric(k, v)},
        failure_kind=kind,
        failure_message=STALE_MESSAGE if stale else a.get(record.FAILURE_MESSAGE),
        run_id=a.get(record.RUN_ID),
        because_of=origin,
        slot=a.get(record.SLOT),
        recipe=str(a.get(record.RECIPE, "")).lower() == "true" and not retried,  # its retry is the recipe
        lever=lever,
        recommended=bool(a.get(record.RECOMMENDED)),
        settings=a.get(record.SETTINGS),
    )


def overridden(row: TrialRow) -> dict[str, Any]:
    """A trial's setting as it ran, config key -> value: its params, with its lever's overrides on top."""
    return knobs.with_overrides(row.setting(), row.lever)


def effective(params: dict[str, Any], lever: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A trial's setting as it ran: a lever override of a knob among its params (a recommendation's length outside
    the space) replaces the param's value; the other overrides stay its lever."""
    params, rest = dict(params), []
    for override in lever:
        if override.partition("=")[0].lstrip("+~") in params:
            params.update(knobs.with_overrides({}, [override]))
        else:
            rest.append(override)
    return params, rest


def _lever(value: Any) -> list[str]:
    """`sweep.lever`: a JSON list of override strings (a list where a storage kept it as one); [] when absent."""
    if isinstance(value, str):
        value = json.loads(value)
    return [str(o) for o in value or []]


def _is_metric(key: str, value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and "." not in key
        and key not in (record.RUN_ID, record.RETRY_OF)
    )


def short_override(override: str) -> str:
    """An override as users write the library's field: the key's last part and the value (`+`/`~` dropped)."""
    key, eq, value = override.partition("=")
    return f"{key.lstrip('+~').rsplit('.', 1)[-1]}{eq}{value}"


def sort_key(value: Any) -> tuple[int, float | str]:
    """A sort key over mixed knob values: numbers (bools too) by value, then the rest as text."""
    if isinstance(value, int | float):
        return (0, float(value))
    return (1, str(value))
