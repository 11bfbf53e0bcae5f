"""Checks that depend only on the data or on a swept value, run once for the whole space before any trial is
launched (each trial runs them again): the data set loads as configured, each value of the space passes the config
guards, and what each max_seq_length of the space cuts from the data. A sweep records the shares of rows and answers
cut per setting instead of refusing the settings that cut (trials run with the policy relaxed, and are measured);
a single training run and promotion still refuse past `preflight.max_truncated_answer_frac`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import BaseDistribution, CategoricalDistribution, IntDistribution

from src import knobs
from src.failures import ConfigError, DataError
from src.sweep.space import SpaceError

log = logging.getLogger(__name__)
SEQ = "data.max_seq_length"


class SpaceRefused(SpaceError):
    """No trial of this sweep could run: the message says why, naming the key."""


@dataclass
class SpaceFacts:
    truncation: dict[int, dict[str, float]] = field(default_factory=dict)  # max_seq_length -> shares cut
    refused: dict[str, list[str]] = field(default_factory=dict)  # key -> "value: why" the guards refuse
    lengths: Any = None  # each row's token length (numpy), for the memory model's peak micro-batch
    prompts: Any = None  # each row's prompt length in tokens (what a max_seq_length cuts of an answer)
    defaults: dict[str, Any] = field(default_factory=dict)  # the sweep's value of each knob with facts

    def of(self, setting: dict[str, Any]) -> dict[str, float]:
        """What the data says of a setting (config key -> value; the sweep's value where it has none): each
        registered knob's facts (src/knobs.py Knob.fact), e.g. the shares of answers its max_seq_length cuts."""
        found: dict[str, float] = {}
        for knob in knobs.with_facts():
            value = setting.get(knob.key, self.defaults.get(knob.key))
            if value is not None and knob.fact == "truncation":
                found.update(self.cut(int(value)))
        return found

    def cut(self, length: int) -> dict[str, float]:
        """The shares of rows and answers `length` cuts (computed once per length)."""
        if length not in self.truncation and self.lengths is not None and length > 0:
            from src.data import truncation

            self.truncation[length] = truncation(self.lengths, self.prompts, length)
        return self.truncation.get(length, {})


def check_space(config: DictConfig, distributions: dict[str, BaseDistribution]) -> SpaceFacts:
    """Raise SpaceRefused when the data cannot be read or every value of a knob is refused; else the facts."""
    from src.data import chat_lengths, read_blocks, truncation
    from src.preflight.data import load_tokenizer

    task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    facts = SpaceFacts(refused=_refused_values(task, distributions))
    for key, why in facts.refused.items():
        if len(why) == len(_values(distributions[key])):
            raise SpaceRefused(f"no trial of this sweep could run: every value of {key} is refused: {'; '.join(why)}")
        log.warning("%s: %s (those trials will fail as config_error)", key, "; ".join(why))
    try:
        blocks = read_blocks(task.data)  # the file and its columns checked here; its rows read a block at a time
        full, prompt = chat_lengths(blocks, task.data, load_tokenizer(task))
    except (DataError, ConfigError) as exc:
        raise SpaceRefused(f"no trial of this sweep could run: {exc}") from None
    lengths = _values(distributions[SEQ]) if SEQ in distributions else [task.data.max_seq_length]
    facts.truncation = {int(n): truncation(full, prompt, int(n)) for n in lengths if int(n) > 0}
    facts.lengths, facts.prompts = full, prompt
    facts.defaults = {k.key: OmegaConf.select(task, k.key) for k in knobs.with_facts()}
    return facts


def _values(dist: BaseDistribution) -> list[Any]:
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution) and (dist.high - dist.low) // dist.step < 64:
        return list(range(dist.low, dist.high + 1, dist.step))
    return []  # a continuous range: each trial checks its own value


def _literal(value: Any) -> Any:
    """A list or dict choice kept as its Hydra text (src/sweep/space.py) back as the value a trial gets."""
    if isinstance(value, str) and value[:1] + value[-1:] in ("[]", "{}"):
        return OverridesParser.create().parse_override(f"k={value}").value()
    return value


def _refused_values(task: DictConfig, distributions: dict[str, BaseDistribution]) -> dict[str, list[str]]:
    """For each swept value, the config guards' errors on the sweep's config with that value set."""
    from src.preflight import Report, check_config

    refused: dict[str, list[str]] = {}
    for key, dist in distributions.items():
        for value in _values(dist):
            cfg = task.copy()
            try:
                with open_dict(cfg):
                    OmegaConf.update(cfg, key, _literal(value), merge=False)
            except Exception as exc:  # noqa: BLE001 - a value the schema refuses (a wrong type)
                refused.setdefault(key, []).append(f"{value}: {exc}".splitlines()[0])
                continue
            report = Report()
            check_config(cfg, report)
            errors = [f.message for f in report.errors if key in f.message]
            if errors:
                refused.setdefault(key, []).append(f"{value}: {errors[0]}")
    return refused
