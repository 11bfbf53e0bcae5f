"""Checks that depend only on the data or on a swept value, run once for the whole space before any trial is
launched (each trial runs them again): the data set loads as configured, each value of the space passes the config
guards, what each max_seq_length of the space cuts from the data, and the config the first trial would get passes
the trial's own preflight (a fixed setting every trial would refuse refuses the sweep, as it does a single run). A
sweep records the shares of rows and answers cut per setting instead of refusing the settings that cut (trials run
with the policy relaxed, and are measured); a single training run and promotion still refuse past
`preflight.max_truncated_answer_frac`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from src import knobs, redact
from src.config import override_value
from src.failures import ConfigError, DataError
from src.sweep.space import SpaceError, outside_space

log = logging.getLogger(__name__)
SEQ = "data.max_seq_length"


class SpaceRefused(SpaceError):
    """No trial of this sweep could run: the message says why, naming the key."""


class TrialRefused(SpaceRefused):
    """Every trial of this sweep would be refused by its own preflight: the trial's message, exit 2 as a single run."""

    exit_code = 2


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


def check_space(
    config: DictConfig, distributions: dict[str, BaseDistribution], overrides: list[str] | None = None
) -> SpaceFacts:
    """Raise SpaceRefused when the data cannot be read or every value of a knob is refused, TrialRefused when the
    first trial's config (`overrides`: the probe's and the fixed ones, given) fails its preflight; else the facts."""
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
    if overrides is not None:
        check_first_trial(config, overrides, distributions, facts)
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


def check_first_trial(
    config: DictConfig, overrides: list[str], distributions: dict[str, BaseDistribution], facts: SpaceFacts
) -> None:
    """Raise TrialRefused when the config the first trial would get (`overrides`: the probe's and the fixed ones,
    then a setting of the space: the first queued one, else each knob's first value the guards accept) fails the
    preflight every trial runs first (credentials, config guards, the data's lint) for a reason that names no
    swept key: every trial would fail the same way, and the sweep's map would be one config error per trial. The
    machine's own checks are left to the trials: they need the training stack, which the engine does not load."""
    from src.preflight import Report, check_config, check_data, check_secrets
    from src.preflight.report import rows_text

    cfg = _first_config(config, overrides, _first_setting(config.hydra.sweeper, distributions, facts), distributions)
    report = Report()
    try:
        check_secrets(cfg, report)
        check_config(cfg, report)
        check_data(cfg, report)
    except (ConfigError, DataError) as exc:  # the data as each trial would read it
        raise TrialRefused(redact.redact_text(f"every trial of this sweep would fail: {_one_line(exc)}")) from None
    refused = report.errors or (report.warnings if cfg.preflight.fail_on_warnings else [])
    fixed = [f for f in refused if not _names_a_key(f.message, distributions)]
    if fixed:
        why = "; ".join(f.message + (f" (rows {rows_text(f.rows)})" if f.rows else "") for f in fixed)
        raise TrialRefused(
            redact.redact_text(
                f"every trial of this sweep would be refused (preflight refused training: {_one_line(why)}); change "
                "the setting (python -m src.preflight <the same overrides> shows the whole report). Nothing was run "
                "or recorded"
            )
        )


def _first_config(
    config: DictConfig, overrides: list[str], setting: dict[str, Any], distributions: dict[str, BaseDistribution]
) -> DictConfig:
    """The config the first trial composes; without the setting when the composition refuses one of its values (that
    is the value's trial's failure, not every trial's: interval(4,8) gives lora.r floats)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    swept = [f"{k}={override_value(v)}" for k, v in setting.items()]
    try:
        return _composed(str(config.hydra.job.config_name), [*overrides, *swept])
    except (HydraException, OmegaConfBaseException) as exc:  # a key or value Hydra refuses, as each trial would
        if swept and _names_a_key(str(exc), distributions):
            return _first_config(config, overrides, {}, distributions)
        raise TrialRefused(redact.redact_text(f"every trial of this sweep would fail: {_one_line(exc)}")) from None


def _names_a_key(message: str, distributions: dict[str, BaseDistribution]) -> bool:
    """Whether a refusal names a swept key: then it is that value's, not the fixed settings'."""
    return any(key in message for key in distributions)


def _one_line(text: Any) -> str:
    return " ".join(str(text).split()) or type(text).__name__


def _first_setting(sweeper: Any, distributions: dict[str, BaseDistribution], facts: SpaceFacts) -> dict[str, Any]:
    """A setting of the space as the first trial gets it: the first queued setting (hydra.sweeper.enqueue_trials)
    where the space holds it, each other knob at its first value the config guards accept (its low bound where the
    values are not listed)."""
    queued = list(sweeper.enqueue_trials or [])
    first = OmegaConf.to_container(queued[0], resolve=True) if queued and OmegaConf.is_config(queued[0]) else {}
    first = first if isinstance(first, dict) and not outside_space(first, distributions) else {}
    setting = {}
    for key, dist in distributions.items():
        refused = {why.partition(": ")[0] for why in facts.refused.get(key, [])}  # "value: why" (_refused_values)
        values = _values(dist)
        accepted = [v for v in values if str(v) not in refused] or values
        if key in first:
            setting[key] = first[key]
        elif accepted:
            setting[key] = accepted[0]
        elif isinstance(dist, IntDistribution | FloatDistribution):
            setting[key] = dist.low
    return setting


def _composed(config_name: str, overrides: list[str]) -> DictConfig:
    """The config a trial composes from `overrides`: inside the sweep's own Hydra app (python -m src.train -m), by
    the app's own loader, which the compose API reaches without clearing it (Hydra still needs it once the sweep
    returns); elsewhere (tests, src.cluster's workers) by src.config.compose."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        from src.config import compose

        return compose(overrides, config_name=config_name)
    from hydra import compose as hydra_compose

    return hydra_compose(config_name=config_name, overrides=overrides)
