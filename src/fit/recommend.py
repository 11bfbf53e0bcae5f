"""The recommendation rule, from the memory model alone: the settings to try instead of a recipe that does not fit
(or that cuts answers the truncation policy keeps), best first. The sweep measures the first of them as trials and
soaks the best it measured (src/sweep/journey.py); `python -m src.fit --card` names the first for each card, marked
predicted. One rule for both.

A candidate is the recipe with a combination of the memory levers (src/knobs.py `lever`: gradient checkpointing, a
fused attention kernel, bf16 non-quantized weights, half the batch, the allocator's expandable segments) and a
max_seq_length within the truncation policy. Candidates are ordered by:
1. the answers they keep: the shortest length that cuts none first (a longer one costs memory and keeps nothing
   more), then the lengths the policy allows, the longest first;
2. only those predicted to fit the budget with the headroom margin, even if the model under-predicts by its stated
   error;
3. the fewest levers (each changes the recipe, and some cost speed: which is fastest is measured, not guessed);
4. the least predicted memory.
The first is the recommendation from the model alone. A sweep measures a hedged few (`pick`): the first, the one
with every lever (the least memory: it still fits if the model under-predicts the others) and some between.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from src import knobs
from src.config import override_value
from src.fit.model import Prediction

SEQ = "data.max_seq_length"
# The lengths tried besides the space's own: powers of two from here up to the model's context.
SHORTEST = 256
ROUND_TO = 256  # the data's longest row, rounded up to this: the length that cuts nothing


@dataclass(frozen=True)
class Candidate:
    levers: tuple[str, ...]  # the lever overrides on top of the recipe
    length: int  # its max_seq_length
    cut: float  # the share of answers cut at `length`
    predicted_gib: float  # the pool it is predicted to need (Prediction.needed_gib)
    bound_gib: float  # the same, if the model under-predicts by its stated error

    @property
    def changes(self) -> list[str]:
        """Every override on top of the recipe: its levers, then its length."""
        return [*self.levers, f"{SEQ}={self.length}"]

    def words(self, recipe_length: int | None = None) -> str:
        """`recipe + gradient_checkpointing + attn_implementation=sdpa + max_seq_length=4096`."""
        parts = [lever_words(o) for o in self.levers]
        if self.length != recipe_length:
            parts.append(f"max_seq_length={self.length}")
        return " + ".join(["recipe", *parts])


ACCUMULATION = "trainer.gradient_accumulation_steps"


def levers(config: DictConfig, recipe_params: dict[str, Any], cuda: bool = True) -> list[list[str]]:
    """The overrides of each registered lever that would change the recipe; knobs the sweep varies are left to the
    map, and a CUDA allocator's lever to CUDA devices (`cuda`: the trials run on one). Half the batch comes with
    twice the accumulation: the same rows per optimizer step, in smaller micro-batches (the same optimisation)."""
    found = []
    for knob in knobs.levers():
        if knob.key in recipe_params or (knob.cuda_only and not cuda):
            continue
        current = OmegaConf.select(config, knob.key)
        if knob.lever == "half":
            accumulation = recipe_params.get(ACCUMULATION, OmegaConf.select(config, ACCUMULATION))
            if not isinstance(current, int) or current < 2 or current % 2 or not isinstance(accumulation, int):
                continue
            found.append([f"{knob.key}={current // 2}", f"{ACCUMULATION}={accumulation * 2}"])
        elif knob.lever != current:
            found.append([f"{knob.key}={override_value(knob.lever)}"])
    return found


def lever_words(override: str) -> str:
    """A lever as a name: `gradient_checkpointing` for a switch turned on, else `key=value` (last key part)."""
    key, _, value = override.partition("=")
    name, value = key.lstrip("+~").rsplit(".", 1)[-1], value.strip("'\"")  # sdpa, not Hydra's quoted 'sdpa'
    return name if value == "true" else f"{name}={value}"


def ladder(choices: Iterable[int], longest_row: int | None, max_positions: int) -> list[int]:
    """The lengths to consider: the space's, powers of two up to the model's context, and the data's longest row
    rounded up (the length that cuts nothing)."""
    found = {int(c) for c in choices if int(c) > 0}
    n = SHORTEST
    while n <= max_positions:
        found.add(n)
        n *= 2
    if longest_row:
        found.add(min(-(-int(longest_row) // ROUND_TO) * ROUND_TO, max_positions))
    return sorted(found)


def lengths_to_try(lengths: list[int], cut: Callable[[int], float], policy: float) -> list[int]:
    """The lengths the policy allows, best first: the shortest that cuts nothing, then the others that cut no more
    than `policy`, the longest (fewest answers cut) first."""
    whole = [n for n in lengths if cut(n) == 0]
    allowed = sorted((n for n in lengths if 0 < cut(n) <= policy), reverse=True)
    return whole[:1] + allowed


def combinations(levers: list[list[str]]) -> list[tuple[str, ...]]:
    """Every combination of the levers (each a list of overrides, taken whole), the fewest first; none first of all;
    each combination as its overrides."""
    return [
        tuple(o for lever in combo for o in lever)
        for size in range(len(levers) + 1)
        for combo in itertools.combinations(levers, size)
    ]


def fits_with_margin(prediction: Prediction, budget: float, margin: float) -> bool:
    """Predicted to keep the headroom margin (the rule that calls a measured setting stable) even if the model
    under-predicts by its stated error."""
    return under_bound(prediction) <= budget * (1 - margin)


def under_bound(prediction: Prediction) -> float:
    """The pool the setting needs if the model under-predicts by its stated error."""
    return prediction.bound_gib


def candidates(
    predict: Callable[[list[str]], Prediction | None],
    levers: list[list[str]],
    lengths: list[int],
    cut: Callable[[int], float],
    budget: float,
    margin: float,
    filtered: bool = True,
) -> list[Candidate]:
    """Every combination of `levers` at each of `lengths` (best first, see lengths_to_try) that the model predicts
    to fit with the margin, in the module's order. `predict(changes)`: the model's prediction of the recipe with
    those overrides on top (None: it cannot say, and the combination is left out). `filtered=False`: where the
    model does not describe the device (a CPU), every combination, in the same order: measurement decides."""
    found = []
    for rank, length in enumerate(lengths):
        for combo in combinations(levers):
            prediction = predict([*combo, f"{SEQ}={length}"])
            if prediction is None or (filtered and not fits_with_margin(prediction, budget, margin)):
                continue
            found.append(
                (
                    (rank, len(combo), prediction.needed_gib),
                    Candidate(combo, length, cut(length), prediction.needed_gib, under_bound(prediction)),
                )
            )
    return [c for _, c in sorted(found, key=lambda pair: pair[0])]


def pick(found: list[Candidate], k: int) -> list[Candidate]:
    """`k` candidates to measure, from those at the best length: the first (fewest levers), the last (the most
    levers, the least memory), then evenly between; the next lengths' first ones if the best has too few."""
    if k <= 0 or not found:
        return []
    best = [c for c in found if c.length == found[0].length]
    if len(best) <= k:
        rest = [c for c in found if c.length != found[0].length]
        return best + rest[: k - len(best)]
    chosen = [0, len(best) - 1]
    for i in range(1, k - 1):
        chosen.append(round(i * (len(best) - 1) / (k - 1)))
    picked: list[Candidate] = []
    for i in sorted(dict.fromkeys(chosen)):
        picked.append(best[i])
    return picked[:k]


def closest(
    predict: Callable[[list[str]], Prediction | None], levers: list[list[str]], lengths: list[int], cut: Any
) -> Candidate | None:
    """When nothing fits with the margin: the candidate predicted to need the least memory at the best length (every
    lever on), to name what came closest."""
    if not lengths:
        return None
    everything = tuple(o for lever in levers for o in lever)
    prediction = predict([*everything, f"{SEQ}={lengths[0]}"])
    if prediction is None:
        return None
    return Candidate(everything, lengths[0], cut(lengths[0]), prediction.needed_gib, under_bound(prediction))
