"""The search space: Optuna distributions from hydra-optuna-sweeper's grammar (choice, range, interval,
tag(log, ...)), which command-line overrides are swept, whether a setting lies inside the space, what a space
may not hold (a credential), and whether a resumed study can be swept in it (Optuna cannot change a choice's values).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import OmegaConf
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    check_distribution_compatibility,
    json_to_distribution,
)

from src import redact
from src.config import override_value


class SpaceError(ValueError):
    """A search space that cannot be swept; the message names the key (and never repeats a credential)."""

    exit_code = 1  # the sweep command's exit status when it refuses one (hydra_plugins/qlora_optuna_sweeper)


def distribution(override: Override) -> BaseDistribution | Any:
    """An Optuna distribution from a sweep override; a plain override's value as it is."""
    if not override.is_sweep_override():
        return override.value()
    value = override.value()
    if override.is_choice_sweep():
        # A list or dict choice (model.sdpa_backends=choice([flash,efficient],[math])) is kept as its Hydra text,
        # which Optuna can store and override_value passes through as a literal.
        choices = [c if isinstance(c, str | int | float | bool) or c is None else override_value(c) for c in value.list]
        return CategoricalDistribution(choices)
    if override.is_range_sweep():
        ints = all(isinstance(x, int) for x in (value.start, value.stop, value.step))
        if ints:
            return IntDistribution(int(value.start), int(value.stop) - int(value.step), step=int(value.step))
        return FloatDistribution(value.start, value.stop - value.step, step=value.step)
    if override.is_interval_sweep():
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(value.start, value.end, log=log_scale)
    raise ValueError(f"hydra.sweeper.params: cannot turn '{override.input_line}' into a search space")


def contains(dist: BaseDistribution, value: Any) -> bool:
    """Whether `dist` can take `value` (a categorical's choices; a numeric range's bounds and step)."""
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if isinstance(dist, IntDistribution | FloatDistribution):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(dist, IntDistribution) and value != int(value):
            return False
        if not dist.low <= value <= dist.high:
            return False
        return dist.step is None or abs((value - dist.low) / dist.step - round((value - dist.low) / dist.step)) < 1e-8
    return False


def outside_space(params: dict[str, Any], distributions: dict[str, BaseDistribution]) -> list[str]:
    """'key=value (space)' for each of `params` the space holds but whose value it cannot take."""
    return [
        f"{key}={value} ({distributions[key]})"
        for key, value in params.items()
        if key in distributions and not contains(distributions[key], value)  # a key not swept: Optuna ignores it
    ]


def sweep_space(sweeper: Any, arguments: list[str]) -> tuple[list[str], dict[str, BaseDistribution]]:
    """(overrides every trial gets, the space's distributions) from the sweeper's config and the command line; a
    space value that is one value (not a distribution) joins the fixed overrides. Credentials in the space are
    refused: Optuna would store them in clear."""
    params = OmegaConf.to_container(sweeper.params, resolve=True) or {}
    defaults = OmegaConf.to_container(sweeper.default_params, resolve=True) or {}
    fixed, space = split_arguments(list(arguments), params, defaults, bool(sweeper.custom_search_space))
    refuse_credentials(space, sweeper.enqueue_trials)
    distributions = {k: v for k, v in space.items() if isinstance(v, BaseDistribution)}
    fixed += [f"{k}={override_value(v)}" for k, v in space.items() if not isinstance(v, BaseDistribution)]
    return fixed, distributions


def custom_space(name: str | None) -> Any:
    """`hydra.sweeper.custom_search_space`: the function it names, or None."""
    if not name:
        return None
    from hydra.utils import get_method

    try:
        return get_method(name)
    except Exception as exc:  # an ImportError or a name that is not a function: Hydra's own words, in one line
        why = " ".join(str(exc).split())
        raise SpaceError(
            f"hydra.sweeper.custom_search_space={name}: {why} (a function module.function(cfg, trial) that Python can "
            "import from the project folder)"
        ) from None


def split_arguments(
    arguments: list[str], params: dict[str, Any], default_params: dict[str, Any], custom: bool = False
) -> tuple[list[str], dict[str, Any]]:
    """Command-line overrides: plain ones go to every trial, sweep ones join (and win over) `params`.
    `default_params` is the space only when neither `params`, the command line nor a custom space defines one."""
    parser = OverridesParser.create()
    fixed: list[str] = []
    cli_space: dict[str, Any] = {}
    for line in arguments:
        override = _parsed(parser, line, f"the sweep's argument {line!r}")
        if override.is_sweep_override():
            cli_space[override.get_key_element()] = _distribution(override, f"the sweep's argument {line!r}")
        else:
            fixed.append(override.input_line)
    base = params if (params or cli_space or custom) else default_params
    where = "hydra.sweeper.params" if base is params else "hydra.sweeper.default_params"
    space = {}
    for key, value in base.items():
        override = _parsed(parser, f"{key}={value}", f"{where}.{key}={value}")
        space[key] = _distribution(override, f"{where}.{key}={value}")
    return fixed, {**space, **cli_space}


def _parsed(parser: OverridesParser, line: str, where: str) -> Override:
    """One override; one the grammar refuses (`choice()`, an unclosed parenthesis) is a SpaceError naming it."""
    try:
        return parser.parse_override(line)
    except Exception as exc:  # Hydra's OverrideParseException, a page of traceback at the command line
        grammar = "choice(a,b), range(a,b,step), interval(a,b), tag(log,interval(a,b))"
        raise SpaceError(f"{redact.redact_text(where)}: {_first(exc)} (the grammar: {grammar})") from None


def _distribution(override: Override, where: str) -> BaseDistribution | Any:
    try:
        return distribution(override)
    except ValueError as exc:  # interval(8,4): Optuna's own check of its bounds
        raise SpaceError(f"{redact.redact_text(where)}: {_first(exc)}") from None


def _first(exc: BaseException) -> str:
    """The message's telling line: Hydra's first is "Error parsing override '...'", its second says why."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("See https")]
    return lines[1] if len(lines) > 1 and lines[0].startswith("Error parsing override") else (lines or [""])[0]


def refuse_credentials(space: dict[str, Any], enqueue_trials: Any) -> None:
    """Optuna keeps every choice of a space (trial_params.distribution_json) and every enqueued value in clear, and
    the report prints them: a credential among them is refused, naming its key, before anything is stored."""
    if OmegaConf.is_config(enqueue_trials):
        enqueue_trials = OmegaConf.to_container(enqueue_trials, resolve=True)
    values = [(key, v) for key, dist in space.items() for v in _values(dist)]
    for i, trial in enumerate(enqueue_trials or []):
        values += [(f"{key} (hydra.sweeper.enqueue_trials[{i}])", v) for key, v in trial.items()]
    held = redact.secret_values()
    for key, value in values:
        what = redact.credential_in(str(value), held)
        if what:
            raise SpaceError(
                f"{key} holds {what}: Optuna keeps a sweep's choices and enqueued values in clear (in its storage, "
                "and the report prints them). Take it out of the sweep; credentials go in the environment (HF_TOKEN, "
                "MLFLOW_TRACKING_PASSWORD, PGPASSWORD), never in a config or an override."
            )


def _values(dist: BaseDistribution | Any) -> list[Any]:
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    return [] if isinstance(dist, BaseDistribution) else [dist]  # a numeric range holds no text


def refuse_changed(url: str, study_name: str, distributions: dict[str, BaseDistribution], sweeps_dir: Path) -> None:
    """A resumed study is swept on in a space Optuna takes in its place (a numeric range moved or widened: the gate
    counts the new space's settings), never in one it refuses: a choice whose values changed, a knob of another
    kind or scale. Those are refused here, before the study is opened, with the new study's name to give: Optuna's
    ask failed with a traceback at the first trial, leaving it and the sweep's parent run RUNNING."""
    recorded, taken = recorded_space(url, study_name)
    changed = {}  # key -> (the study's distribution, this command's)
    for key, new in distributions.items():
        for old in recorded.get(key, []):
            try:
                check_distribution_compatibility(old, new)
            except ValueError:
                changed[key] = (old, new)
                break
    if not changed:
        return
    fresh = next(
        f"{study_name}-{k}"
        for k in itertools.count(2)
        if f"{study_name}-{k}" not in taken and not (sweeps_dir / f"{study_name}-{k}").exists()
    )
    there = " ".join(f"{key}={grammar(old)}" for key, (old, _) in changed.items())
    here = " ".join(f"{key}={grammar(new)}" for key, (_, new) in changed.items())
    raise SpaceError(
        redact.redact_text(
            f"study {study_name} was swept with {there}, this command sweeps {here}, and Optuna cannot change a "
            f"choice's values or a knob's kind within a study: sweep this space as a new study with "
            f"hydra.sweeper.study_name={fresh}, or give {there} to continue this one. Nothing was run or recorded"
        )
    )


def recorded_space(url: str, study_name: str) -> tuple[dict[str, list[BaseDistribution]], set[str]]:
    """Each knob's distributions the study `study_name` recorded in its storage, and the storage's study names;
    nothing for a storage or study not made yet. Read with SQL on Optuna's tables (studies, trials, trial_params:
    its schema since Optuna 2.0, checked against 5.1), not through RDBStorage, which writes its version rows into
    the database it opens and would race the worker that creates the tables there; this writes nothing."""
    import sqlalchemy

    address = sqlalchemy.engine.make_url(url)
    if address.get_backend_name() == "sqlite" and not (address.database and Path(address.database).exists()):
        return {}, set()
    engine = sqlalchemy.create_engine(address, poolclass=sqlalchemy.pool.NullPool)
    try:
        if not sqlalchemy.inspect(engine).has_table("trial_params"):
            return {}, set()
        with engine.connect() as conn:
            taken = {name for (name,) in conn.execute(sqlalchemy.text("SELECT study_name FROM studies"))}
            rows = conn.execute(
                sqlalchemy.text(
                    "SELECT DISTINCT p.param_name, p.distribution_json FROM trial_params p "
                    "JOIN trials t ON p.trial_id = t.trial_id JOIN studies s ON t.study_id = s.study_id "
                    "WHERE s.study_name = :name"
                ),
                {"name": study_name},
            ).all()
    finally:
        engine.dispose()
    recorded: dict[str, list[BaseDistribution]] = {}
    for key, text in rows:
        recorded.setdefault(key, []).append(json_to_distribution(text))
    return recorded, taken


def grammar(dist: BaseDistribution) -> str:
    """A distribution in the sweep's grammar (choice, range, interval, tag(log, ...)), as the user wrote it."""
    if isinstance(dist, CategoricalDistribution):
        return f"choice({','.join(map(str, dist.choices))})"
    if isinstance(dist, IntDistribution | FloatDistribution):
        if dist.log:
            return f"tag(log,interval({dist.low:g},{dist.high:g}))"
        if dist.step is not None and not (isinstance(dist, IntDistribution) and dist.step == 1):
            return f"range({dist.low:g},{dist.high + dist.step:g},{dist.step:g})"
        return f"interval({dist.low:g},{dist.high:g})"
    return str(dist)
