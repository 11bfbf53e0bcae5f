"""Every shipped config composes; typos and wrong types fail at compose time naming the key; the users' old
knob names reach today's library fields through the one mapping."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, OmegaConf

from src import knobs
from src.config import sft_kwargs
from src.sweep.space import split_arguments
from tests.conftest import CONF, compose_cfg, run_cli

GROUPS = ["model", "lora", "data", "trainer", "measure", "hardware", "tracking", "fault", "preflight", "paths"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)], ids=lambda x: str(x))
def test_every_option_composes(group: str, option: str, root: Path) -> None:
    cfg = compose_cfg([f"{group}={option}", "trainer.output_dir=/tmp/unused"])
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # hydra.* holds run-time values
    resolved = OmegaConf.to_container(task, resolve=True, throw_on_missing=True)
    assert resolved[group]


def test_defaults_reproduce_the_seed_recipe(root: Path) -> None:
    cfg = compose_cfg(["trainer.output_dir=/tmp/unused"])
    q = cfg.model.quantization
    assert (q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant, q.bnb_4bit_compute_dtype) == ("nf4", True, "bfloat16")
    assert (cfg.lora.r, cfg.lora.lora_alpha, cfg.lora.lora_dropout) == (16, 32, 0.05)
    assert len(cfg.lora.target_modules) == 7
    t = cfg.trainer
    assert (t.optim, t.learning_rate, t.per_device_train_batch_size, t.gradient_accumulation_steps) == (
        "paged_adamw_32bit",
        2e-5,
        1,
        2,
    )
    assert t.warmup_steps > 0 and t.group_by_length and cfg.data.max_seq_length == 1024


@pytest.mark.parametrize("space", _options("sweep"))
def test_every_search_space_composes_and_parses(space: str, root: Path) -> None:
    cfg = compose_cfg(["hydra/sweeper=optuna", f"sweep={space}", "trainer.output_dir=/tmp/unused"])
    sweeper = cfg.hydra.sweeper
    params = OmegaConf.to_container(sweeper.params, resolve=True)
    _, distributions = split_arguments([], params, OmegaConf.to_container(sweeper.default_params))
    assert len(distributions) >= 2
    assert set(distributions) <= set(knobs.keys()), "a knob the report and the certain-OOM rule do not know"
    for queued in OmegaConf.to_container(sweeper.enqueue_trials):  # each queued setting is a point of the space
        assert all(queued[k] in distributions[k].choices for k in queued if k in distributions), queued


def test_the_demo_queues_its_whole_space_recipe_first_on_a_budget_the_cpu_can_hold(root: Path) -> None:
    import itertools

    cfg = compose_cfg(["hydra/sweeper=optuna", "sweep=demo", "trainer.output_dir=/tmp/unused"])
    sweeper = cfg.hydra.sweeper
    _, space = split_arguments([], OmegaConf.to_container(sweeper.params), {})
    queued = [tuple(q[k] for k in space) for q in OmegaConf.to_container(sweeper.enqueue_trials)]
    assert sorted(queued) == sorted(itertools.product(*(space[k].choices for k in space)))
    assert queued[0] == (1, 2), "the seed's batch 1 x accumulation 2 is the recipe"
    assert sweeper.n_trials == len(queued) and cfg.hardware.vram_budget_gib < 1


def test_a_study_is_named_after_the_budget_as_written(root: Path) -> None:
    def name(*overrides: str) -> str:
        return compose_cfg(
            ["hydra/sweeper=optuna", "trainer.output_dir=/tmp/unused", *overrides]
        ).hydra.sweeper.study_name

    assert name() == "tiny_llama-24gib"
    assert name("hardware.vram_budget_gib=0.75") == "tiny_llama-0.75gib"
    with pytest.raises(ConfigCompositionException) as err:
        name("hardware.vram_budget_gib=lots")
    assert "vram_budget_gib" in str(err.value) + str(err.value.__cause__)


def test_bare_optuna_sweeper_sweeps_the_seed_knobs(root: Path) -> None:
    cfg = compose_cfg(["hydra/sweeper=optuna", "trainer.output_dir=/tmp/unused"])
    s = cfg.hydra.sweeper
    _, space = split_arguments([], OmegaConf.to_container(s.params), OmegaConf.to_container(s.default_params))
    assert set(space) == {
        "data.max_seq_length",
        "trainer.gradient_accumulation_steps",
        "lora.r",
        "trainer.group_by_length",
    }
    # Command-line sweep overrides define the space on their own, and plain ones go to every trial.
    fixed, space = split_arguments(
        ["lora.r=choice(4,8)", "model=tiny_llama"], {}, OmegaConf.to_container(s.default_params)
    )
    assert set(space) == {"lora.r"} and fixed == ["model=tiny_llama"]
    assert list(space["lora.r"].choices) == [4, 8]


def test_misspelled_key_fails_at_compose_naming_it(root: Path) -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(["lora.rnak=8"])
    assert "lora.rnak" in str(err.value) or "rnak" in str(err.value.__cause__)


def test_wrong_type_fails_naming_the_key_on_the_cli(root: Path) -> None:
    done = run_cli("src.train", "lora.r=sixteen", root=root, timeout=60)
    assert done.returncode != 0
    assert "lora.r" in done.stderr and "sixteen" in done.stderr


def test_users_words_map_to_todays_library_fields(root: Path) -> None:
    from trl import SFTConfig

    cfg = compose_cfg(["data.max_seq_length=777", "trainer.group_by_length=true", "trainer.output_dir=/tmp/x"])
    kwargs = sft_kwargs(cfg, use_cpu=True)
    assert kwargs["max_length"] == 777 and kwargs["train_sampling_strategy"] == "group_by_length"
    assert "max_seq_length" not in kwargs and "group_by_length" not in kwargs
    args = SFTConfig(**kwargs)  # the library accepts every field we pass
    assert args.max_length == 777 and args.include_num_input_tokens_seen == "non_padding"
    cfg = compose_cfg(["trainer.group_by_length=false", "trainer.output_dir=/tmp/x"])
    assert sft_kwargs(cfg, use_cpu=True)["train_sampling_strategy"] == "random"


def _schema_defaults(schema: type) -> set[str]:
    """The fields of a schema dataclass that carry a default of their own (not MISSING), nested ones dotted."""
    types = typing.get_type_hints(schema)
    found = set()
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(types[f.name]):
            found |= {f"{f.name}.{k}" for k in _schema_defaults(types[f.name])}
        elif f.default_factory is not dataclasses.MISSING or f.default is not MISSING:
            found.add(f.name)
    return found


def test_each_default_has_one_home(root: Path) -> None:
    """A value the group's YAML sets has no default in its schema, so the two can never disagree (a schema default
    that a YAML option repeats, or contradicts, is a second home for one fact)."""
    from hydra_plugins.qlora_optuna_sweeper.optuna_sweeper import OptunaSweeperConf
    from src import config

    schemas = typing.get_type_hints(config.TrainConfig)
    for group in GROUPS:
        for option in _options(group):
            raw = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml"))
            repeated = {k for k in config.flatten(raw) if k != "defaults"} & _schema_defaults(schemas[group])
            assert not repeated, f"{group}/{option}.yaml repeats the schema's default for {repeated}"
    sweeper = OmegaConf.to_container(OmegaConf.load(CONF / "hydra" / "sweeper" / "optuna.yaml"))
    repeated = set(sweeper) & _schema_defaults(OptunaSweeperConf)
    assert not repeated, f"conf/hydra/sweeper/optuna.yaml repeats {repeated}"
    assert "memory_monotone" not in sweeper, "memory rules live in src/knobs.py"


@pytest.mark.parametrize("checkpointing", [True, False])
def test_checkpointing_reaches_the_library_under_todays_name_without_a_warning(checkpointing: bool, root: Path) -> None:
    """The user's `trainer.gradient_checkpointing` is passed under the name this transformers knows (since 5.23:
    activation_checkpointing), so building the arguments warns of nothing deprecated."""
    import warnings

    from trl import SFTConfig

    from src.config import checkpointing_name

    cfg = compose_cfg([f"trainer.gradient_checkpointing={checkpointing}", "trainer.output_dir=/tmp/x"])
    kwargs = sft_kwargs(cfg, use_cpu=True)
    name = checkpointing_name()
    assert kwargs[name] is checkpointing and kwargs[f"{name}_kwargs"] == {"use_reentrant": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = SFTConfig(**kwargs)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    assert args.gradient_checkpointing is checkpointing  # the old name still reads the same


def test_threads_compose_one_at_a_time() -> None:
    """Hydra's compose API keeps one GlobalHydra per process: two promotions in one process's threads composed under
    each other and one died with "GlobalHydra is already initialized" (CI, test_two_promotions_at_once...)."""
    import threading

    from src.config import compose

    errors: list[str] = []

    def compose_a_few() -> None:
        try:
            for _ in range(3):
                compose(["trainer.output_dir=/tmp/unused"], hydra_config=True)
        except Exception as exc:  # said in the assertion
            errors.append(repr(exc))

    threads = [threading.Thread(target=compose_a_few) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
