"""Typed config schemas, and the one place where the users' words become today's library names.

Each group's schema is stored in Hydra's ConfigStore and merged under the YAML options in `conf/`, so a
misspelled key or a wrong type fails at compose time with the key's full name. A schema gives types; each value's
default has one home: the group's YAML where an option sets it (MISSING here), else the schema. Field names equal the
library's own (peft.LoraConfig, transformers.BitsAndBytesConfig, trl.SFTConfig) so that each object is
built in one call; the exceptions are the words users know from older versions, mapped in `sft_kwargs`.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from src import recompute


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    sweeps_dir: str = MISSING
    mlruns_dir: str = MISSING
    cache_dir: str = MISSING


@dataclass
class QuantizationConfig:
    _target_: str = "transformers.BitsAndBytesConfig"
    load_in_4bit: bool = MISSING
    bnb_4bit_quant_type: str = MISSING
    bnb_4bit_use_double_quant: bool = MISSING
    bnb_4bit_compute_dtype: str = MISSING
    bnb_4bit_quant_storage: str = "uint8"


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING
    dtype: str = MISSING
    attn_implementation: str = MISSING
    # With sdpa: the kernels torch may pick, in order of preference (flash, efficient, cudnn, math); null: torch's own
    # choice. The attention.kernel tag says which one ran.
    sdpa_backends: list[str] | None = MISSING
    # peft's prepare_model_for_kbit_training casts every weight that is not 4-bit (embeddings, norms, lm_head) to
    # fp32. false keeps them in model.dtype, as axolotl's skip_prepare_model_for_kbit_training does.
    upcast_non_quantized: bool = MISSING
    # null: chosen by hardware.parallelism (one card, or "auto" across the trial's cards for model_parallel)
    device_map: Any = MISSING
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    # Save the 4-bit weights once and load those afterwards (a trial then skips quantizing 16 GB).
    cache_quantized: bool = MISSING
    # A random model of this architecture is built at `path` when `path` does not exist (tiny / synthetic).
    build: dict[str, Any] | None = None


@dataclass
class LoraConfig:
    _target_: str = "peft.LoraConfig"
    r: int = MISSING
    lora_alpha: int = MISSING
    lora_dropout: float = MISSING
    target_modules: list[str] = MISSING
    bias: str = MISSING
    task_type: str = MISSING


@dataclass
class DataConfig:
    path: str = MISSING
    input_column: str = MISSING
    output_column: str = MISSING
    system_prompt: str = MISSING
    sheet: str | None = None
    # The user's word; trl now calls it `max_length` (mapped in `sft_kwargs`).
    max_seq_length: int = MISSING
    max_rows: int | None = MISSING
    seed: int = 0


@dataclass
class TrainerConfig:
    per_device_train_batch_size: int = MISSING
    gradient_accumulation_steps: int = MISSING
    learning_rate: float = MISSING
    lr_scheduler_type: str = MISSING
    warmup_steps: float = MISSING  # < 1: a fraction of the run (transformers 5 merged warmup_ratio in)
    weight_decay: float = 0.0
    max_grad_norm: float = MISSING
    num_train_epochs: float = MISSING
    max_steps: int = MISSING
    optim: str = MISSING
    bf16: bool = MISSING
    gradient_checkpointing: bool = MISSING
    # With gradient_checkpointing: full | no_down | selective (src/recompute.py: what the backward redoes)
    recompute: str = MISSING
    # With gradient_checkpointing: micro-batches of at most this many tokens keep their activations (no
    # recompute); longer ones checkpoint. null: every micro-batch checkpoints (src/recompute.py TokenGate)
    checkpoint_above_tokens: int | None = MISSING
    # The user's word; transformers now says train_sampling_strategy="group_by_length".
    group_by_length: bool = MISSING
    padding_free: bool = MISSING
    packing: bool = MISSING
    use_liger_kernel: bool = MISSING
    # false | true (the whole model, by transformers' Trainer) | layers (each decoder layer: one compiled graph
    # serves all of them, so it compiles in seconds, not minutes; src/models.py compile_layers)
    torch_compile: Any = MISSING
    assistant_only_loss: bool = MISSING
    torch_empty_cache_steps: int | None = MISSING
    logging_steps: int = MISSING
    seed: int = MISSING
    dataloader_num_workers: int = 0
    output_dir: str = MISSING
    save_adapter: bool = MISSING
    # A single run's checkpoint interval in optimizer steps (transformers' own name); null: every
    # checkpoint.every_minutes of training instead. Probes a sweep launches never checkpoint.
    save_steps: int | None = MISSING


@dataclass
class MeasureConfig:
    warmup_steps: int = MISSING
    nvml_interval_s: float = MISSING
    profile_attention: bool = MISSING
    profile_step: int | None = MISSING
    profile_startup: bool = MISSING
    soak_minutes: float | None = MISSING


@dataclass
class HardwareConfig:
    # The memory being mapped: the card's (on a larger GPU the trial caps its own allocator to it) or, on a machine
    # without a GPU, the trial process's own beyond its start-up (src/measure/memory.py). An int where whole, so
    # that names built from it read `tiny_llama-24gib`, not `-24.0gib`.
    vram_budget_gib: int | float = MISSING
    parallelism: str = MISSING
    # data_parallel: processes (ranks) per trial; null = the trial's GPUs (2 on a CPU, over gloo).
    processes: int | None = MISSING
    # PyTorch's caching allocator grows segments in place instead of caching fixed blocks
    # (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set by the trial before CUDA starts): less fragmentation.
    expandable_segments: bool = MISSING


@dataclass
class TrackingConfig:
    uri: str = MISSING
    experiment: str = MISSING
    registered_model: str = MISSING
    # The registered version whose setting this run trains (src.promote writes it into production.yaml): a run
    # that finishes registers its adapter as a new version of registered_model and moves the alias to it.
    registered_version: int | None = None


@dataclass
class FaultConfig:
    kind: str = MISSING
    step: int = MISSING
    rank: int | None = None  # data_parallel: only this rank fails (null: every rank)
    # A single run: the fault fires on this many attempts (1: the first only, as a transient fault would; a
    # setting's own failure recurs on every attempt). A sweep's probe has one attempt: it always fires.
    times: int = 1
    # step: when optimizer step `step` begins; save: while checkpoint `step` is being written (before it is
    # committed), to show that a kill during a save leaves the previous checkpoint in use.
    during: str = "step"


@dataclass
class CheckpointConfig:
    """A single run's checkpoints and restarts (src/checkpoints.py, src/trial/supervised.py); a sweep's probes
    have none."""

    every_minutes: float = MISSING
    keep: int = MISSING
    dir: str | None = MISSING
    resume: bool = MISSING
    max_restarts: int = MISSING
    stall_timeout_s: float = MISSING


@dataclass
class PreflightConfig:
    # Share of rows whose assistant answer would be cut by max_seq_length above which training is refused.
    max_truncated_answer_frac: float = MISSING
    max_empty_frac: float = MISSING
    max_duplicate_frac: float = MISSING
    max_invalid_json_frac: float = MISSING
    require_json_output: str = MISSING
    fail_on_warnings: bool = MISSING


@dataclass
class TrainConfig:
    paths: PathsConfig = field(default_factory=PathsConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)


PROJECT_DIR = Path(__file__).resolve().parent.parent

# A study's name is a folder of sweeps/, an Optuna study, an MLflow experiment and part of Hydra overrides
# (hydra.run.dir=sweeps/<study>/...): one plain word, so that it stays inside sweeps/ and needs no quoting.
_STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,119}")


def study_name_problem(name: str, key: str = "hydra.sweeper.study_name") -> str | None:
    """Why `name` cannot be a study's name (naming `key`), or None: letters, digits, `.`, `_` and `-`, starting
    with a letter or digit, up to 120 characters (#30.17: `a/../../../escape` wrote outside the project, and a
    name with a space failed every trial as "other")."""
    if _STUDY_NAME.fullmatch(name):
        return None
    return (
        f"{key}={name!r}: a study's name is one word of letters, digits, '.', '_' and '-' starting with a letter "
        f"or digit, up to 120 characters (it names the folder sweeps/<study>/); e.g. "
        f"{key}={re.sub(r'[^A-Za-z0-9_]+', '-', name).strip('-_')[:120] or 'my-study'}"
    )


def register_configs() -> None:
    # ${project_dir:} is the checkout (for shipped files such as the sample data), wherever outputs go.
    if not OmegaConf.has_resolver("project_dir"):
        OmegaConf.register_new_resolver("project_dir", lambda: str(PROJECT_DIR))
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)


# trl.SFTConfig fields that take the trainer group's values unchanged.
_SFT_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "num_train_epochs",
    "max_steps",
    "optim",
    "bf16",
    "padding_free",
    "packing",
    "use_liger_kernel",
    "torch_compile",
    "assistant_only_loss",
    "torch_empty_cache_steps",
    "logging_steps",
    "seed",
    "dataloader_num_workers",
    "output_dir",
)


def checkpointing_name() -> str:
    """The library's word for activation (gradient) checkpointing: transformers 5.23 renamed `gradient_checkpointing`
    to `activation_checkpointing` in TrainingArguments and on the model (the old names warn until v6); 5.17-5.22
    know only the old one."""
    import dataclasses

    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def packed_probe(cfg: DictConfig) -> bool:
    """A short run (`trainer.max_steps`) on packed rows: its first step must hold its fullest batch (src/data.py
    fullest_first)."""
    return cfg.trainer.max_steps > 0 and bool(cfg.trainer.packing)


def sft_kwargs(cfg: DictConfig, use_cpu: bool, staging_dir: Path | None = None) -> dict[str, Any]:
    """trl.SFTConfig keyword arguments from our config: the users' older names mapped to today's. `staging_dir`:
    where a single run's Trainer writes its checkpoints (src/checkpoints.py commits each whole, asks for the saves by
    the minute and keeps the last checkpoint.keep); None: a probe, which saves nothing."""
    t = cfg.trainer
    kwargs: dict[str, Any] = {name: t[name] for name in _SFT_FIELDS}
    kwargs["torch_compile"] = t.torch_compile is True  # "layers" is ours (src/models.py compile_layers)
    checkpointing = checkpointing_name()
    kwargs.update(
        # trl <0.20 `max_seq_length` -> `max_length`
        max_length=cfg.data.max_seq_length,
        # transformers <5 `group_by_length=True` -> `train_sampling_strategy="group_by_length"`; a packed probe
        # trains its bins in the order src/data.py fullest_first gives them (its first step holds the peak)
        train_sampling_strategy="sequential"
        if packed_probe(cfg)
        else "group_by_length"
        if t.group_by_length
        else "random",
        # transformers 5.23 `gradient_checkpointing` -> `activation_checkpointing` (and its _kwargs)
        # (trainer.recompute: what the backward recomputes, src/recompute.py)
        **{checkpointing: t.gradient_checkpointing, f"{checkpointing}_kwargs": recompute.checkpoint_kwargs(cfg)},
        # Non-padding tokens seen, so tokens/s does not count padding as work.
        include_num_input_tokens_seen="non_padding",
        # A NaN loss must reach the log (and our nan_loss check), not be averaged away.
        logging_nan_inf_filter=False,
        report_to="none",
        disable_tqdm=True,
        use_cpu=use_cpu,
    )
    if staging_dir is None:
        kwargs["save_strategy"] = "no"
    else:
        kwargs.update(
            output_dir=str(staging_dir),
            # transformers' own interval in steps; without it src/checkpoints.py asks for each save by the minute
            save_strategy="steps" if t.save_steps else "no",
            save_steps=t.save_steps or 500,
            save_total_limit=None,  # rotated once the new checkpoint is committed, not before
            save_only_model=False,  # the optimizer, scheduler and RNG states too: an exact resume
        )
    return kwargs


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]


_COMPOSING = threading.Lock()


def compose(
    overrides: list[str] | None = None,
    hydra_config: bool = False,
    config_dir: Path | None = None,
    config_name: str = "train",
) -> DictConfig:
    """A config as `python -m src.train` composes it (Hydra's compose API), so tools outside a Hydra app (the
    report, promotion, the cluster submitter, tests) find sweeps/ and mlruns/ where the trials put them."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    # Hydra's compose API holds one GlobalHydra per process: two threads composing at once (two promotions in one
    # process) cleared and initialized it under each other ("GlobalHydra is already initialized"), one at a time
    with _COMPOSING:
        GlobalHydra.instance().clear()
        try:
            with initialize_config_dir(config_dir=str(config_dir or PROJECT_DIR / "conf"), version_base="1.3"):
                return hydra_compose(
                    config_name=config_name, overrides=overrides or [], return_hydra_config=hydra_config
                )
        finally:
            GlobalHydra.instance().clear()


def flatten(node: Any, prefix: str = "", into_lists: bool = False) -> dict[str, Any]:
    """A nested container as dotted keys to leaf values, kept as they are. Lists are leaves, or with
    `into_lists` are descended into as `key[i]`; an empty dict or list is a leaf."""
    if isinstance(node, dict) and node:
        items = [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in node.items()]
    elif isinstance(node, list | tuple) and node and into_lists:
        items = [(f"{prefix}[{i}]", v) for i, v in enumerate(node)]
    else:
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(flatten(value, key, into_lists))
    return out


def override_value(value: Any) -> str:
    """A Python value as Hydra override text (`key=<this>`): booleans and null in YAML's words, strings quoted,
    lists and dicts in Hydra's own brackets. A string that already is bracketed Hydra text passes through."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and value[:1] + value[-1:] in ("[]", "{}"):
        return value  # a list or dict choice of a search space, kept as its Hydra text (src/sweep/space.py)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)
