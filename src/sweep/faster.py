"""The fastest setting that trains the same model. On a GPU, after the map and the search, a second stage measures
the reference with the levers that keep what is trained (SPEED_LEVERS, and the same rows in fewer micro-batches),
those the memory model predicts to fit (`search`). Then, before the soak, each finalist that trains on the recipe's rows
per optimizer step in another way than the reference (another micro-batch split, attention kernel, compiled
layers...) is checked to train the same model (src/same_model.py): from the same adapter initialisation and the same
rows in the same order, both train `hydra.sweeper.same_model_steps` optimizer steps; their per-step losses and the
adapters they end with must agree within the stated tolerance. A finalist that fails is never ranked, soaked or
promoted (src/study.py `Sweep.ranked`), and the next one is checked in its place.

The reference is the stable setting at the recipe's optimisation with the recipe's own micro-batch split: the recipe
itself when it is good, else the best good setting with its batch and accumulation (the recipe with the levers that
made it fit). Settings with other rows per optimizer step are another optimisation: shown apart by the report, and
ranked only with `hydra.sweeper.promote_different_optimisation=true`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import optuna
from omegaconf import OmegaConf

from src import record, same_model
from src.config import override_value
from src.fit import recommend
from src.fit.recommend import fits_with_margin
from src.knobs import with_overrides
from src.redact import redact_text
from src.study import PACKING, STEP_KEYS, Sweep, TrialRow, overridden
from src.sweep.slots import devices

log = logging.getLogger(__name__)


# The levers that keep what is trained (the same rows per optimizer step, in the same order, the same loss and
# schedule) and may spend the card better: (key, the value that may be faster, only on a CUDA device, only where
# the reference checkpoints). bf16 non-quantized weights change the numerics slightly: allowed, and the report says
# so through the same-model check's figures.
SPEED_LEVERS = (
    ("model.attn_implementation", "sdpa", False, False),  # fused attention kernels instead of eager's L x L scores
    ("trainer.recompute", "no_down", False, True),  # the checkpoint's recompute skips the frozen down_proj product
    ("trainer.torch_compile", "layers", True, False),  # each decoder layer compiled (norms, RoPE, SwiGLU, LoRA fused)
    ("model.upcast_non_quantized", False, False, False),  # bf16 embeddings, norms and lm_head: fewer casts
    # only the micro-batches too long for the card checkpoint (src/recompute.py TokenGate); the number of tokens is
    # the memory model's, per combination (`kept_tokens`): AUTO until then
    ("trainer.checkpoint_above_tokens", "auto", True, True),
)
AUTO = "trainer.checkpoint_above_tokens='auto'"
TOKEN_STEP = 128  # the kept micro-batch's tokens, a multiple of this


def speed_levers(setting: dict[str, Any], cuda: bool) -> list[list[str]]:
    """The reference's same-model levers (SPEED_LEVERS), then the same rows in fewer, larger micro-batches (batch x 2,
    accumulation / 2: no padding added where group_by_length groups rows of a length), each a list of overrides."""
    found = []
    for key, value, cuda_only, with_checkpointing in SPEED_LEVERS:
        if (cuda_only and not cuda) or (with_checkpointing and not setting.get("trainer.gradient_checkpointing")):
            continue
        if setting.get(key) != value:
            found.append([f"{key}={override_value(value)}"])
    batch, accumulation = (setting.get(k) for k in STEP_KEYS)
    if isinstance(batch, int) and isinstance(accumulation, int) and accumulation % 2 == 0:
        found.append([f"{STEP_KEYS[0]}={batch * 2}", f"{STEP_KEYS[1]}={accumulation // 2}"])
    return found


def search_once(
    study: optuna.Study,
    store: Any,
    classified: Callable[[], Sweep],
    config: Any,
    memory: Any,
    facts: Any,
    fixed: list[str],
    distributions: dict[str, Any],
    budget: float,
) -> list[list[str]]:
    """The last worker out makes the second stage's search (under the study's lock), as journey.search_once; only
    where the trials run on a GPU: the levers spend a card better, and a CPU has none to spend."""
    if not devices(OmegaConf.select(config, "hydra.sweeper")):
        return []
    with store.lock():
        if store.others_running(study):
            return []
        return search(study, classified(), config, memory, fixed, distributions, budget, cuda=True)


def search(
    study: optuna.Study,
    sweep: Sweep,
    config: Any,
    memory: Any,
    fixed: list[str],
    distributions: dict[str, Any],
    budget: float,
    cuda: bool,
) -> list[list[str]]:
    """The second stage, once per study: on the reference, the combinations of its same-model levers the memory
    model predicts to fit with the margin (all of them where it does not describe the device), the most levers first
    (the fastest guess), then each alone; `hydra.sweeper.speed_trials` of those not measured yet are queued as trials
    of the reference (beyond n_trials, as the recipe's levers are). What was queued (each trial's lever overrides)."""
    k = int(config.hydra.sweeper.speed_trials)
    ref = reference(sweep)
    if k <= 0 or ref is None or record.FASTER in study.user_attrs or memory is None:
        return []
    levers = speed_levers({**_composed(config), **sweep.step_defaults, **overridden(ref)}, cuda)
    combos = [c for c in recommend.combinations(levers) if c]  # the fewest levers first
    seen = {json.dumps(sorted(overridden(r).items()), default=str) for r in sweep.rows}
    queued: list[list[str]] = []
    for combo in combos[-1:] + combos[:-1]:  # every lever (the fastest guess), then one, two...
        if len(queued) >= k:
            break
        combo = kept_tokens(memory, [*fixed, *overrides(ref)], list(combo), budget, sweep.margin)
        if not combo:
            continue
        trial_params, lever = _as_trial(ref, list(combo), distributions)
        effective = {**ref.setting(), **trial_params, **with_overrides({}, lever)}
        key = json.dumps(sorted(effective.items()), default=str)
        if key in seen:
            continue
        prediction = memory.predict([*fixed, *overrides(ref), *combo])
        if memory.describes_device() and (prediction is None or not fits_with_margin(prediction, budget, sweep.margin)):
            continue
        study.enqueue_trial(
            trial_params, user_attrs={record.LEVER: json.dumps(lever), record.LEVER_OF: ref.number, record.FASTER: True}
        )
        queued.append(lever)
        seen.add(key)
    study.set_user_attr(record.FASTER, {"reference": ref.number, "queued": queued})
    if queued:
        print(f"faster: measuring {len(queued)} setting(s) that train trial {ref.number}'s model, beyond n_trials")
    return queued


def pending(study: optuna.Study, sweep: Sweep) -> bool:
    """Whether the second stage is still to run: never run on this study, and a reference to run it on."""
    return record.FASTER not in study.user_attrs and reference(sweep) is not None


def kept_tokens(memory: Any, base: list[str], combo: list[str], budget: float, margin: float) -> list[str]:
    """`combo` with its AUTO lever set to the most tokens a micro-batch may hold and keep its activations: the
    largest multiple of TOKEN_STEP, up to the setting's longest micro-batch, whose predicted peak (the checkpointed
    longest micro-batch's or the kept one's, src/fit/model.py) fits the budget with the margin. Without it where
    none does or where the memory model does not describe the device (a CPU: no card to fit)."""
    if AUTO not in combo:
        return combo
    rest = [o for o in combo if o != AUTO]
    setting = memory.setting([*base, *rest])
    if setting is None or not memory.describes_device():
        return rest
    from src.fit.setting import peak_batch

    longest = peak_batch(memory.lengths, setting).tokens

    def fits(tokens: int) -> bool:
        prediction = memory.predict([*base, *rest, f"trainer.checkpoint_above_tokens={tokens}"])
        return prediction is not None and fits_with_margin(prediction, budget, margin)

    low, high = 0, longest // TOKEN_STEP  # in steps: the most that fits, by bisection (the peak grows with it)
    if fits(longest):
        return [*rest, f"trainer.checkpoint_above_tokens={longest}"]
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * TOKEN_STEP) else (low, mid - 1)
    return [*rest, f"trainer.checkpoint_above_tokens={low * TOKEN_STEP}"] if low else rest


def _composed(config: Any) -> dict[str, Any]:
    """The lever keys' values in the sweep's config (a trial's params and levers set theirs on top)."""
    keys = [key for key, *_ in SPEED_LEVERS] + ["trainer.gradient_checkpointing"]
    return {key: OmegaConf.select(config, key) for key in keys}


def _as_trial(ref: TrialRow, combo: list[str], distributions: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(params, lever overrides): a value of a knob the space holds goes into the params (the map then places it),
    the rest on top of the reference's own levers."""
    params, lever = dict(ref.params), list(ref.lever)
    for override in combo:
        key = override.partition("=")[0]
        value = with_overrides({}, [override])[key]
        dist = distributions.get(key)
        if key in params and getattr(dist, "choices", None) is not None and value in dist.choices:
            params[key] = value
        else:
            lever.append(override)
    return params, lever


def record_step(study: optuna.Study, config: Any) -> None:
    """The sweep's fixed batch, accumulation and packing on the study (record.STEP_DEFAULTS): a trial's rows per
    optimizer step where its params and levers do not set them (src/study.py `Sweep.rows_per_step`)."""
    study.set_user_attr(record.STEP_DEFAULTS, {k: OmegaConf.select(config, k) for k in (*STEP_KEYS, PACKING)})


def reference(sweep: Sweep) -> TrialRow | None:
    """The setting every finalist is checked against (module docstring); None where nothing is good."""
    recipe = sweep.recipe_row()
    ranked = sweep.ranked()
    if recipe is None:
        return ranked[0] if ranked else None
    if sweep.good(recipe):
        return recipe
    split = sweep.step(recipe)  # its batch and accumulation, whatever else the levers changed
    return next((r for r in ranked if split is not None and sweep.step(r) == split), None)


def overrides(row: TrialRow) -> list[str]:
    """A trial's own setting as overrides: its params, then its levers (a lever's value wins)."""
    return [*(f"{k}={override_value(v)}" for k, v in row.setting().items()), *row.lever]


def to_check(sweep: Sweep, top_k: int) -> tuple[TrialRow | None, list[TrialRow]]:
    """(the reference, the finalists among the first `top_k` ranked that still need the check)."""
    ref = reference(sweep)
    if ref is None:
        return None, []
    return ref, [r for r in sweep.ranked()[:top_k] if r.number != ref.number and not r.same_model]


def check_finalists(
    study: optuna.Study,
    store: Any,
    classified: Callable[[], Sweep],
    sweeper: Any,
    fixed: list[str],
    env: dict[str, str],
) -> list[dict[str, Any]]:
    """The last worker out checks the finalists the soak would take, each against the reference, until the first
    `soak_top_k` ranked settings are the reference or passed; each verdict is kept on the study (record.SAME_MODEL;
    a finished trial's own attributes are closed). No soak, no check: an unsoaked setting is promoted only when
    asked by number. What was checked."""
    steps, top_k = int(sweeper.same_model_steps), int(sweeper.soak_top_k)
    if steps <= 0 or top_k <= 0:
        return []
    checked: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}  # the reference, trained once for every finalist checked against it
    while True:
        with store.lock():
            if store.others_running(study):
                return checked
            ref, rows = to_check(classified(), top_k)
        if ref is None or not rows or len(checked) >= 2 * top_k + 2:
            return checked
        row = rows[0]
        print(
            f"same model: checking trial {row.number} against trial {ref.number} ({steps} optimizer steps each, "
            "the same rows from the same adapter)",
            flush=True,
        )
        started = time.time()
        try:
            verdict = same_model.check(overrides(ref), overrides(row), steps, fixed, env, traces)
        except RuntimeError as exc:  # a run of the check failed: the candidate is not shown to train the same model
            verdict = {"passed": False, "why": redact_text(str(exc)).splitlines()[0][:300]}
        verdict = {**verdict, "reference": ref.number, "seconds": round(time.time() - started, 1)}
        verdict.pop("candidate", None)  # the trial's own setting; the reference's is kept beside its number
        study.set_user_attr(record.same_model_key(row.number), verdict)
        words = "passed" if verdict["passed"] else f"failed ({verdict.get('why') or _diffs(verdict)})"
        print(f"same model: trial {row.number} {words}: {_diffs(verdict)}", flush=True)
        checked.append({"trial": row.number, **verdict})


def _diffs(verdict: dict[str, Any]) -> str:
    if "max_loss_diff" not in verdict:
        return verdict.get("why", "")
    tol = verdict["tolerance"]
    return (
        f"largest loss difference {verdict['max_loss_diff']:.2e}, {verdict['max_loss_rel_diff']:.2%} of the loss "
        f"(tolerance {tol['max_loss_rel_diff']:.0%}), adapter "
        f"difference {verdict['adapter_rel_diff']:.2%} (tolerance {tol['adapter_rel_diff']:.0%})"
    )
