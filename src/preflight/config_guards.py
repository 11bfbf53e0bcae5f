"""Configuration guards: combinations of settings that cannot work (or waste the run), each refused or warned
about with the key to change and to what."""

from __future__ import annotations

import importlib.util
import os

from omegaconf import DictConfig, OmegaConf

from src import checkpoints, gpus
from src.failures import FAULT_KINDS
from src.models import SDPA_BACKENDS, context_length
from src.preflight.report import Report
from src.recompute import RECOMPUTE, checkpoint_inside_forward

# device_map values that spread a model over every visible GPU.
_SPREADING_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_config(cfg: DictConfig, report: Report) -> None:
    """Every configuration guard, in the order the report lists their findings."""
    _check_sizes(cfg, report)
    if cfg.trainer.torch_empty_cache_steps:
        report.add(
            "empty_cache",
            "error",
            f"trainer.torch_empty_cache_steps={cfg.trainer.torch_empty_cache_steps} empties the CUDA cache every "
            "few steps: it fragments memory and slows every step without lowering the peak; "
            "set trainer.torch_empty_cache_steps=null",
        )
    _check_parallelism(cfg, report)
    _check_trainer_features(cfg, report)
    _check_attention(cfg, report)
    if cfg.fault.kind not in FAULT_KINDS:
        report.add("fault", "error", f"fault.kind={cfg.fault.kind} is not one of {', '.join(FAULT_KINDS)}")
    for problem in checkpoints.problems(cfg):
        report.add("checkpoint", "error", problem)


def _check_sizes(cfg: DictConfig, report: Report) -> None:
    """Sizes that cannot train, a run too short to measure, and a sequence longer than the model's context."""
    for key, value in (
        ("data.max_seq_length", cfg.data.max_seq_length),
        ("trainer.per_device_train_batch_size", cfg.trainer.per_device_train_batch_size),
        ("trainer.gradient_accumulation_steps", cfg.trainer.gradient_accumulation_steps),
        ("lora.r", cfg.lora.r),
    ):
        if value < 1:
            report.add("positive", "error", f"{key}={value}: must be at least 1")
    if not cfg.trainer.learning_rate > 0:  # trl fails it only after the model is loaded, as a ValueError
        report.add(
            "learning_rate",
            "error",
            f"trainer.learning_rate={cfg.trainer.learning_rate}: must be more than 0, e.g. 2e-5",
        )
    if not cfg.hardware.vram_budget_gib > 0:
        report.add(
            "vram_budget",
            "error",
            f"hardware.vram_budget_gib={cfg.hardware.vram_budget_gib}: the card's memory in GiB, e.g. 24",
        )
    if 0 < cfg.trainer.max_steps <= cfg.measure.warmup_steps:
        # A warning: a two-step smoke test is fine alone; in a sweep the trial gets no throughput to tell Optuna.
        report.add(
            "measured_steps",
            "warning",
            f"trainer.max_steps={cfg.trainer.max_steps} leaves no step to measure: the first "
            f"measure.warmup_steps={cfg.measure.warmup_steps} are left out of tokens/s and step time, so the trial "
            "records no throughput; raise trainer.max_steps or lower measure.warmup_steps",
        )
    context = context_length(cfg)
    if context and cfg.data.max_seq_length > context:
        report.add(
            "max_seq_length",
            "error",
            f"data.max_seq_length={cfg.data.max_seq_length} exceeds the model's context of {context} tokens "
            f"(positions past it were never trained); set data.max_seq_length<={context}",
        )


def _check_parallelism(cfg: DictConfig, report: Report) -> None:
    """A model spread over GPUs by a device map cannot also be trained data-parallel: every data-parallel
    rank needs a whole copy on its own GPU (accelerate refuses a 4-bit model on several devices in any
    distributed mode)."""
    parallelism = cfg.hardware.parallelism
    if parallelism not in ("single", "model_parallel", "data_parallel"):
        report.add(
            "parallelism",
            "error",
            f"hardware.parallelism={parallelism} is not one of single, model_parallel, data_parallel",
        )
        return
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    # model.device_map is not in the schema today; a config (or `+model.device_map=...`) that sets it is read.
    device_map = OmegaConf.select(cfg, "model.device_map", default=None)
    if isinstance(device_map, DictConfig):
        device_map = OmegaConf.to_container(device_map)
    spread_by = None
    if parallelism == "model_parallel":
        spread_by = "hardware.parallelism=model_parallel (device_map=auto)"
    elif device_map in _SPREADING_MAPS or (isinstance(device_map, dict) and len(set(device_map.values())) > 1):
        spread_by = f"model.device_map={device_map}"
    data_parallel = "hardware.parallelism=data_parallel" if parallelism == "data_parallel" else None
    # The visible GPUs from NVML (src/gpus.py), as the sweep's slots count them: the sweep's checks need no torch.
    visible = len(gpus.indices())
    if world > 1:
        data_parallel = f"a distributed launch (WORLD_SIZE={world}, torchrun / accelerate launch)"
    if spread_by and data_parallel:
        report.add(
            "device_map",
            "error",
            f"a device map across GPUs ({spread_by}) together with data-parallel training ({data_parallel}): "
            "each data-parallel rank must hold a whole 4-bit copy on its own GPU. Set hardware.parallelism="
            "data_parallel and remove model.device_map (one copy per GPU), or set hardware.parallelism="
            "model_parallel and launch one process (python -m src.train, not torchrun) to split the model",
        )
    # data_parallel with WORLD_SIZE unset is the trial's parent, which launches the ranks itself
    # (trial.run_data_parallel through torch.distributed.run): nothing to warn about.
    elif parallelism == "single" and visible > 1:
        report.add(
            "parallelism",
            "warning",
            f"hardware.parallelism=single with {visible} visible GPUs: only one is used; set "
            "hardware.parallelism=model_parallel to split the model, or make one GPU visible (CUDA_VISIBLE_DEVICES)",
        )
    elif parallelism == "model_parallel" and visible == 1:
        report.add(
            "parallelism",
            "warning",
            "hardware.parallelism=model_parallel with 1 visible GPU: nothing to "
            "split; set hardware.parallelism=single (or make more GPUs visible: CUDA_VISIBLE_DEVICES)",
        )


def _check_trainer_features(cfg: DictConfig, report: Report) -> None:
    """Padding-free batches, Liger kernels, selective recompute and torch.compile: each only in the form that
    runs."""
    # Padding-free batches are correct with sdpa and eager too: transformers 5 turns the collator's restarting
    # position_ids into a block-diagonal mask (masking_utils.find_packed_sequence_indices).
    if cfg.trainer.padding_free and not cfg.trainer.packing:
        report.add(
            "padding_free",
            "error",
            "trainer.padding_free=true without packing: trl 1.16 cannot enforce data.max_seq_length on unpacked "
            "padding-free batches and refuses them. Set trainer.packing=true (best-fit packing, padding-free, "
            "rows kept apart by their position ids) or trainer.padding_free=false",
        )
    if cfg.trainer.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        report.add(
            "liger_kernel",
            "error",
            "trainer.use_liger_kernel=true, but the liger-kernel package is not installed: "
            "pip install 'liger-kernel>=0.8' (needs a CUDA GPU with Triton), or set trainer.use_liger_kernel=false",
        )
    recompute = cfg.trainer.recompute
    if recompute not in RECOMPUTE:
        report.add("recompute", "error", f"trainer.recompute={recompute} is not one of {', '.join(RECOMPUTE)}")
    elif recompute != "full" and not cfg.trainer.gradient_checkpointing:
        report.add(
            "recompute",
            "error",
            f"trainer.recompute={recompute} chooses what checkpointing recomputes, but "
            "trainer.gradient_checkpointing=false recomputes nothing; set trainer.gradient_checkpointing=true "
            "or trainer.recompute=full",
        )
    elif recompute == "no_down" and cfg.trainer.torch_compile == "layers" and checkpoint_inside_forward():
        report.add(
            "recompute",
            "warning",
            "trainer.recompute=no_down with trainer.torch_compile=layers: this transformers checkpoints inside the "
            "compiled layer, which then compiles to the same graph as under trainer.recompute=full, so no_down gains "
            "nothing here (it does with eager layers, and with compiled layers on transformers 5.17-5.22, where the "
            "checkpoint sits around the compiled layer)",
        )
    above = cfg.trainer.get("checkpoint_above_tokens")
    if above is not None and (isinstance(above, bool) or not isinstance(above, int) or above < 1):
        report.add(
            "checkpoint_above_tokens",
            "error",
            f"trainer.checkpoint_above_tokens={above}: use a number of tokens >= 1 (micro-batches of at most that "
            "many keep their activations) or null (every micro-batch checkpoints)",
        )
    elif above is not None and not cfg.trainer.gradient_checkpointing:
        report.add(
            "checkpoint_above_tokens",
            "error",
            f"trainer.checkpoint_above_tokens={above} chooses which micro-batches checkpoint, but "
            "trainer.gradient_checkpointing=false checkpoints none; set trainer.gradient_checkpointing=true or "
            "trainer.checkpoint_above_tokens=null",
        )
    if (
        cfg.trainer.torch_compile == "layers"
        and cfg.trainer.gradient_checkpointing
        and recompute != "selective"  # selective compiles the checkpoint itself (src/recompute.py)
        and _compiled_layer_inside_checkpoint_breaks()
    ):
        report.add(
            "torch_compile",
            "warning",
            "trainer.torch_compile=layers with checkpointing on torch>=2.13 and transformers<5.23: the compiled layer "
            "runs inside an eager checkpoint, and on the CPU that pairing fails its first backward with "
            "CheckpointError (recomputed tensors' metadata differ; benchmarks/NOTES.md §16; on torch 2.11 it trains). "
            "If it does, pip install 'transformers>=5.23' (it checkpoints inside the compiled layer) or set "
            "trainer.torch_compile=false",
        )
    if cfg.trainer.torch_compile not in (False, True, "layers"):
        report.add(
            "torch_compile",
            "error",
            f"trainer.torch_compile={cfg.trainer.torch_compile} is not one of false, true (the whole model) or "
            "layers (each decoder layer, compiled once for all of them)",
        )


def _check_attention(cfg: DictConfig, report: Report) -> None:
    """model.sdpa_backends names known SDPA kernels and only with SDPA; varlen only where its kernel runs."""
    backends = cfg.model.sdpa_backends
    if backends is not None:
        unknown = [b for b in backends if b not in SDPA_BACKENDS]
        if unknown or not backends:
            report.add(
                "sdpa_backends",
                "error",
                f"model.sdpa_backends={list(backends)}: "
                + (f"unknown {', '.join(map(str, unknown))}; " if unknown else "empty; ")
                + f"list some of {', '.join(SDPA_BACKENDS)} in order of preference, or set model.sdpa_backends=null",
            )
        elif cfg.model.attn_implementation != "sdpa":
            report.add(
                "sdpa_backends",
                "error",
                f"model.sdpa_backends is set but model.attn_implementation={cfg.model.attn_implementation} does not "
                "use SDPA; set model.attn_implementation=sdpa or model.sdpa_backends=null",
            )
    if cfg.model.attn_implementation == "varlen":
        from src import attention

        why = attention.available()
        if why:
            report.add(
                "attn_implementation",
                "error",
                f"model.attn_implementation=varlen: {why}; use model.attn_implementation=sdpa on this machine",
            )


def _compiled_layer_inside_checkpoint_breaks() -> bool:
    """torch 2.13 on with transformers 5.17-5.22 (the checkpoint around the compiled layer), read from the installed
    packages' metadata: nothing is imported."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        torch, transformers = Version(version("torch")), Version(version("transformers"))
    except PackageNotFoundError:
        return False
    return torch.release[:2] >= (2, 13) and transformers.release[:2] < (5, 23)
