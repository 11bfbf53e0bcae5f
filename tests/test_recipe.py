"""The default is the user's recipe, field by field, as their script ran it: `python -m src.train` with no overrides
composes exactly this, and the library objects built from it carry these values. A drift of any field fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from src.config import sft_kwargs
from tests.conftest import compose_cfg

# The user's script: BitsAndBytesConfig, from_pretrained, LoraConfig, TrainingArguments (everything else at its
# default) and SFTTrainer, with the chat template applied to system / user / assistant messages.
RECIPE = {
    # BitsAndBytesConfig(load_in_4bit, nf4, double quant, bf16 compute)
    "model.quantization.load_in_4bit": True,
    "model.quantization.bnb_4bit_quant_type": "nf4",
    "model.quantization.bnb_4bit_use_double_quant": True,
    "model.quantization.bnb_4bit_compute_dtype": "bfloat16",
    # from_pretrained(attn_implementation="eager", device_map="auto"); prepare_model_for_kbit_training's fp32 upcast
    "model.attn_implementation": "eager",
    "model.device_map": "auto",
    "model.upcast_non_quantized": True,
    # LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, bias="none", task_type="CAUSAL_LM", seven projections)
    "lora.r": 16,
    "lora.lora_alpha": 32,
    "lora.lora_dropout": 0.05,
    "lora.bias": "none",
    "lora.task_type": "CAUSAL_LM",
    "lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # TrainingArguments(...)
    "trainer.per_device_train_batch_size": 1,
    "trainer.gradient_accumulation_steps": 2,
    "trainer.optim": "paged_adamw_32bit",
    "trainer.num_train_epochs": 5,
    "trainer.learning_rate": 2e-5,
    "trainer.warmup_steps": 100,
    "trainer.bf16": True,
    "trainer.group_by_length": True,
    "trainer.gradient_checkpointing": False,  # TrainingArguments' default
    "trainer.max_grad_norm": 1.0,  # TrainingArguments' default
    "trainer.lr_scheduler_type": "linear",  # TrainingArguments' default
    "trainer.weight_decay": 0.0,  # TrainingArguments' default
    # SFTTrainer(max_seq_length=1024, packing=False)
    "data.max_seq_length": 1024,
    "trainer.packing": False,
    "trainer.padding_free": False,
}


@pytest.mark.parametrize("key", list(RECIPE))
def test_the_default_config_is_the_users_recipe(key: str, root: Path) -> None:
    cfg = compose_cfg(["trainer.output_dir=/tmp/unused"])
    value = OmegaConf.select(cfg, key)
    value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    assert value == RECIPE[key], f"{key} drifted from the user's recipe"


def test_the_library_objects_carry_the_recipe(root: Path) -> None:
    from hydra.utils import instantiate
    from trl import SFTConfig

    cfg = compose_cfg(["trainer.output_dir=/tmp/unused"])
    args = SFTConfig(**sft_kwargs(cfg, use_cpu=True))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 2)
    assert (args.optim, args.learning_rate, args.warmup_steps, args.num_train_epochs) == (
        "paged_adamw_32bit",
        2e-5,
        100,
        5,
    )
    assert (args.max_grad_norm, args.lr_scheduler_type, args.weight_decay) == (1.0, "linear", 0.0)
    assert args.bf16 and not args.gradient_checkpointing and not args.packing
    assert args.max_length == 1024 and args.train_sampling_strategy == "group_by_length"
    lora = instantiate(cfg.lora, _convert_="all")
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.bias) == (16, 32, 0.05, "none")
    assert str(lora.task_type.value if hasattr(lora.task_type, "value") else lora.task_type) == "CAUSAL_LM"
    assert set(lora.target_modules) == set(RECIPE["lora.target_modules"])


def test_the_old_faster_settings_are_named_options_not_the_default(root: Path) -> None:
    cfg = compose_cfg(["experiment=checkpointed_sdpa", "trainer.output_dir=/tmp/unused"])
    assert cfg.trainer.gradient_checkpointing and cfg.model.attn_implementation == "sdpa"
    assert compose_cfg(["trainer=checkpointed", "trainer.output_dir=/tmp/unused"]).trainer.gradient_checkpointing


# ---- the user's recipe in a sweep -----------------------------------------------------------------------------


def _fake_sweep(monkeypatch: pytest.MonkeyPatch, study: str, process, space: list[str], *overrides: str) -> DictConfig:
    """The engine in this process, over `space` (command-line sweeps), with `process` standing in for each trial's
    process (no model is built)."""
    from src.sweep.engine import SweepEngine

    monkeypatch.setattr("src.sweep.launch.run_process", process)
    monkeypatch.setattr("src.sweep.prepare.build_model", lambda *a: None)
    cfg = compose_cfg(
        ["hydra/sweeper=optuna", f"hydra.sweeper.study_name={study}", "hydra.sweeper.cpu_slots=1"]
        + ["hydra.sweeper.progress=false", "hydra.sweeper.preload=false", "trainer.output_dir=/tmp/unused", *overrides]
    )
    SweepEngine(cfg, space).run()
    return cfg


def test_a_recipe_that_does_not_fit_gets_its_memory_levers_measured(root: Path, monkeypatch) -> None:
    """The recipe (the first queued setting) OOMs; the sweep then runs it once per memory lever of src/knobs.py
    (checkpointing, SDPA, bf16 non-quantized weights, the allocator's expandable segments), beyond n_trials, each recorded with its overrides."""
    import json

    import optuna

    from src.sweep.process import Outcome

    seen: dict[int, list[str]] = {}
    # the stand-in trials are a card's: the allocator's lever is tried (a CPU sweep leaves it out, test below)
    monkeypatch.setattr("src.sweep.recipe.devices", lambda sweeper: [0])

    def process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        seen[int(env["QLORA_OPTUNA_TRIAL"])] = overrides
        need = {"data.max_seq_length=512": 26.0, "data.max_seq_length=256": 14.0}
        peak = next(v for k, v in need.items() if k in overrides)
        if "trainer.gradient_checkpointing=true" in overrides:
            peak = 9.5
        elif "model.attn_implementation='sdpa'" in overrides:
            peak -= 5.0
        if peak > 24.0:
            return Outcome("failed", failure={"kind": "oom", "message": "CUDA out of memory", "step": 1})
        return Outcome("ok", metrics={"tokens_per_s": 1000.0 / peak, "peak_vram_reserved_gib": peak})

    _fake_sweep(
        monkeypatch,
        "levers",
        process,
        ["data.max_seq_length=choice(256,512)"],
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.enqueue_trials=[{data.max_seq_length:512}]",
        "hydra.sweeper.recommend_trials=0",  # the levers alone (the search: tests/test_journey.py)
        "hardware.expandable_segments=false",  # the default allocator, as a plain script runs: its lever is tried
    )
    study = optuna.load_study(study_name="levers", storage=f"sqlite:///{root}/sweeps/levers/optuna.db")
    trials = study.get_trials()
    recipe = trials[0]
    assert recipe.user_attrs["sweep.recipe"] is True and recipe.user_attrs["failure.kind"] == "oom"
    levers = {tuple(json.loads(t.user_attrs["sweep.lever"])): t for t in trials if "sweep.lever" in t.user_attrs}
    assert set(levers) == {
        ("trainer.gradient_checkpointing=true",),
        ("model.attn_implementation='sdpa'",),
        ("model.upcast_non_quantized=false",),
        ("hardware.expandable_segments=true",),
    }
    assert len(trials) == 2 + 4, "levers run beyond n_trials"
    for overrides, t in levers.items():
        assert t.user_attrs["sweep.lever_of"] == recipe.number
        # Optuna's params: the recipe's and the lever's own param, so outside tools see a setting of its own
        assert t.params == {**recipe.params, "lever": ", ".join(overrides)}
        assert set(overrides) <= set(seen[t.number]), "the lever's overrides reach the trial"
    assert levers[("trainer.gradient_checkpointing=true",)].user_attrs["trial.status"] == "ok"
    assert levers[("model.upcast_non_quantized=false",)].user_attrs["failure.kind"] == "oom"
    # not skipped as a repeat or a certain OOM of the recipe: a lever changes what the params do not show
    assert all(t.user_attrs["trial.status"] != "skipped" for t in levers.values())


def test_the_allocators_lever_is_tried_only_where_the_trials_run_on_a_card() -> None:
    """`hardware.expandable_segments` moves only a CUDA device's memory: a sweep on the CPU does not spend a trial on
    it; with a card (here `hydra.sweeper.devices=[0]`) it is one of the levers of a recipe on the default allocator,
    and none where the recipe already runs on expandable segments (the default)."""
    from src.sweep import recipe

    expandable = ["hardware.expandable_segments=true"]
    plain = ["hydra/sweeper=optuna", "hardware.expandable_segments=false"]
    on_cpu = recipe.levers(compose_cfg([*plain, "hydra.sweeper.devices=[]"]), {})
    on_card = recipe.levers(compose_cfg([*plain, "hydra.sweeper.devices=[0]"]), {})
    assert ["trainer.gradient_checkpointing=true"] in on_cpu and expandable not in on_cpu
    assert on_card == [*on_cpu, expandable]
    assert recipe.levers(compose_cfg(["hydra/sweeper=optuna", "hydra.sweeper.devices=[0]"]), {}) == on_cpu


def test_a_sweep_measures_what_each_length_cuts_instead_of_refusing_it(root: Path, monkeypatch) -> None:
    """The data's truncation is checked once for the whole space; every trial carries its setting's shares and runs
    with the policy relaxed; the parent run records the policy and the table."""
    import json

    import optuna
    from mlflow.tracking import MlflowClient

    from src.sweep.process import Outcome

    seen: list[list[str]] = []

    def process(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        seen.append(overrides)
        return Outcome("ok", metrics={"tokens_per_s": 100.0, "peak_vram_reserved_gib": 1.0})

    cfg = _fake_sweep(
        monkeypatch,
        "cut",
        process,
        ["data.max_seq_length=choice(32,2048)"],
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.enqueue_trials=[{data.max_seq_length:32},{data.max_seq_length:2048}]",
        "hydra.sweeper.recommend_trials=0",  # what each length cuts, alone (the search: tests/test_journey.py)
    )
    assert all("preflight.max_truncated_answer_frac=1.0" in o for o in seen)
    trials = optuna.load_study(study_name="cut", storage=f"sqlite:///{root}/sweeps/cut/optuna.db").get_trials()
    shares = {t.params["data.max_seq_length"]: t.user_attrs["truncated_answer_frac"] for t in trials}
    assert shares[32] == 1.0 and shares[2048] == 0.0, "every sample chat is longer than 32 tokens, none than 2048"
    client = MlflowClient(str(cfg.tracking.uri).replace("${paths.mlruns_dir}", f"{root}/mlruns"))
    parent = client.get_run(trials[0].user_attrs["mlflow_run_id"]).data.tags["mlflow.parentRunId"]
    tags = client.get_run(parent).data.tags
    assert json.loads(tags["sweep.max_truncated_answer_frac"]) == 0.0
    assert json.loads(tags["sweep.truncation"])["32"]["truncated_row_frac"] == 1.0
    assert "preflight.max_truncated_answer_frac=1.0" in json.loads(tags["sweep.trial_overrides"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.path=/nowhere/notes.xlsx"], "no trial of this sweep could run: data.path: file not found"),
        (["data.max_seq_length=choice(0,-5)"], "every value of data.max_seq_length"),
    ],
)
def test_a_sweep_no_trial_could_run_is_refused_before_anything_is_recorded(
    root: Path, monkeypatch, overrides: list[str], message: str
) -> None:
    from src.sweep.checks import SpaceRefused
    from src.sweep.process import Outcome

    def process(*args, **kwargs) -> Outcome:
        raise AssertionError("no trial may be launched")

    with pytest.raises(SpaceRefused, match=message):
        space = [o for o in overrides if "choice(" in o] or ["lora.r=choice(8,16)"]
        fixed = [o for o in overrides if "choice(" not in o]
        _fake_sweep(monkeypatch, "refused", process, space, "hydra.sweeper.n_trials=2", *fixed)
    assert not (root / "sweeps" / "refused").exists() and not (root / "mlruns" / "mlflow.db").exists()
