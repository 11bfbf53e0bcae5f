"""Typed config schemas, and the one place where the users' words become today's library names.

Each group's schema is stored in Hydra's ConfigStore and merged under the YAML options in `conf/`, so a
misspelled key or a wrong type fails at compose time with the key's full name. Field names equal the
library's own (peft.LoraConfig, transformers.BitsAndBytesConfig, trl.SFTConfig) so that each object is
built in one call; the exceptions are the words users know from older versions, mapped in `sft_kwargs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class PathsConfig:
    root_dir: str = "."
    sweeps_dir: str = MISSING
    mlruns_dir: str = MISSING
    cache_dir: str = MISSING


@dataclass
class QuantizationConfig:
    _target_: str = "transformers.BitsAndBytesConfig"
    load_in_4bit: bool = True
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_use_double_quant: bool = True
    bnb_4bit_compute_dtype: str = "bfloat16"
    bnb_4bit_quant_storage: str = "uint8"


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING
    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    # With sdpa: the kernels torch may pick, in order of preference (flash, efficient, cudnn, math); null: torch's own
    # choice. The attention.kernel tag says which one ran.
    sdpa_backends: list[str] | None = None
    # peft's prepare_model_for_kbit_training casts every weight that is not 4-bit (embeddings, norms, lm_head) to
    # fp32. false keeps them in model.dtype, as axolotl's skip_prepare_model_for_kbit_training does.
    upcast_non_quantized: bool = True
    # null: chosen by hardware.parallelism (one card, or "auto" across the trial's cards for model_parallel)
    device_map: Any = None
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    # Save the 4-bit weights once and load those afterwards (a trial then skips quantizing 16 GB).
    cache_quantized: bool = False
    # A random model of this architecture is built at `path` when `path` does not exist (tiny / synthetic).
    build: dict[str, Any] | None = None


@dataclass
class LoraConfig:
    _target_: str = "peft.LoraConfig"
    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: list[str] = field(default_factory=list)
    bias: str = "none"
    task_type: str = "CAUSAL_LM"


@dataclass
class DataConfig:
    path: str = MISSING
    input_column: str = "Sentence"
    output_column: str = "Description"
    system_prompt: str = ""
    sheet: str | None = None
    # The user's word; trl now calls it `max_length` (mapped in `sft_kwargs`).
    max_seq_length: int = 1024
    max_rows: int | None = None
    seed: int = 0


@dataclass
class TrainerConfig:
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 2
    learning_rate: float = 2e-5
    lr_scheduler_type: str = "linear"
    warmup_steps: float = 0.03  # < 1: a fraction of the run (transformers 5 merged warmup_ratio in)
    weight_decay: float = 0.0
    max_grad_norm: float = 0.3
    num_train_epochs: float = 1.0
    max_steps: int = -1
    optim: str = "paged_adamw_32bit"
    bf16: bool = True
    gradient_checkpointing: bool = True
    # The user's word; transformers now says train_sampling_strategy="group_by_length".
    group_by_length: bool = True
    padding_free: bool = False
    packing: bool = False
    use_liger_kernel: bool = False
    # false | true (the whole model, by transformers' Trainer) | layers (each decoder layer: one compiled graph
    # serves all of them, so it compiles in seconds, not minutes; src/models.py compile_layers)
    torch_compile: Any = False
    assistant_only_loss: bool = False
    torch_empty_cache_steps: int | None = None
    logging_steps: int = 1
    seed: int = 42
    dataloader_num_workers: int = 0
    output_dir: str = MISSING
    save_adapter: bool = False


@dataclass
class MeasureConfig:
    warmup_steps: int = 2
    nvml_interval_s: float = 0.05
    profile_attention: bool = True
    profile_step: int | None = None  # profile this step's kernels (profile.txt): where a step's time goes
    profile_startup: bool = False  # profile the start-up's Python calls (startup_profile.txt)


@dataclass
class HardwareConfig:
    # The card being mapped. On a larger GPU the trial caps its own allocator to this.
    vram_budget_gib: float = 24.0
    parallelism: str = "single"
    # data_parallel: processes (ranks) per trial; null = the trial's GPUs (2 on a CPU, over gloo).
    processes: int | None = None


@dataclass
class TrackingConfig:
    uri: str = MISSING
    experiment: str = "qlora-trials"
    registered_model: str = "llama3-qlora"


@dataclass
class FaultConfig:
    kind: str = "none"
    step: int = 1
    rank: int | None = None  # data_parallel: only this rank fails (null: every rank)


@dataclass
class PreflightConfig:
    # Share of rows whose assistant answer would be cut by max_seq_length above which training is refused.
    max_truncated_answer_frac: float = 0.0
    max_empty_frac: float = 0.0
    max_duplicate_frac: float = 1.0
    max_invalid_json_frac: float = 1.0
    require_json_output: str = "auto"
    fail_on_warnings: bool = False


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
    preflight: PreflightConfig = field(default_factory=PreflightConfig)


PROJECT_DIR = Path(__file__).resolve().parent.parent


def register_configs() -> None:
    # ${project_dir:} is the checkout (for shipped files such as the sample data), wherever outputs go.
    if not OmegaConf.has_resolver("project_dir"):
        OmegaConf.register_new_resolver("project_dir", lambda: str(PROJECT_DIR))
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)


# Knobs a sweep varies and a report shows; the first four are the seed's.
KNOBS = (
    "data.max_seq_length",
    "trainer.gradient_accumulation_steps",
    "lora.r",
    "trainer.group_by_length",
    "trainer.per_device_train_batch_size",
    "trainer.gradient_checkpointing",
    "model.attn_implementation",
    "trainer.padding_free",
    "trainer.packing",
    "trainer.use_liger_kernel",
    "trainer.torch_compile",
    "lora.lora_dropout",
    "model.upcast_non_quantized",
    "model.sdpa_backends",
)

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
    "gradient_checkpointing",
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


def sft_kwargs(cfg: DictConfig, use_cpu: bool) -> dict[str, Any]:
    """trl.SFTConfig keyword arguments from our config: the users' older names mapped to today's."""
    t = cfg.trainer
    kwargs: dict[str, Any] = {name: t[name] for name in _SFT_FIELDS}
    kwargs["torch_compile"] = t.torch_compile is True  # "layers" is ours (src/models.py compile_layers)
    kwargs.update(
        # trl <0.20 `max_seq_length` -> `max_length`
        max_length=cfg.data.max_seq_length,
        # transformers <5 `group_by_length=True` -> `train_sampling_strategy="group_by_length"`
        train_sampling_strategy="group_by_length" if t.group_by_length else "random",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        # Non-padding tokens seen, so tokens/s does not count padding as work.
        include_num_input_tokens_seen="non_padding",
        # A NaN loss must reach the log (and our nan_loss check), not be averaged away.
        logging_nan_inf_filter=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=use_cpu,
    )
    return kwargs


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # type: ignore[return-value]
