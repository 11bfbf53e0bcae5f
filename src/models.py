"""Model and tokenizer: built locally when the config asks for a random model, always loaded through the
same 4-bit `from_pretrained` path a real checkpoint takes, and never moved with `.to()` afterwards
(a quantized or dispatched model is placed by `device_map` at load time, the only safe moment).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

from filelock import FileLock
from hydra.utils import instantiate
from omegaconf import OmegaConf

from src.failures import ConfigError

# torch is imported inside the functions that use it: the sweep's checks read this module's names
# (SDPA_BACKENDS, context_length, prepared) without loading torch (~1.8 s of every sweep's start on a CPU).

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
]
# Meta-Llama-3-Instruct's chat format, with the {% generation %} markers trl uses for assistant-only loss.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def build_tokenizer(vocab_size: int = 2048) -> Any:
    """A byte-level BPE trained on the sample data's vocabulary, with Llama-3's special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from src.data import make_notes, make_sample

    sample, notes = make_sample(), make_notes(n=60)
    corpus = [*sample["Sentence"], *sample["Description"], *notes["note"], *notes["answer"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        chat_template=LLAMA3_CHAT_TEMPLATE,
        model_max_length=1_000_000,
    )


# The classes AutoTokenizer loads from a tokenizer.json alone (transformers 5 names PreTrainedTokenizerFast
# TokenizersBackend; Llama 3's own files still say PreTrainedTokenizerFast).
FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_class(path: Path) -> Any:
    """The class AutoTokenizer would load `path` with. Where tokenizer_config.json names the fast tokenizer over a
    tokenizer.json (Llama 3, the tiny Llama), that class itself: AutoTokenizer first loads the model's config to
    learn it, which imports the model's code (~3 s of the sweep's checks on a CPU). Otherwise AutoTokenizer. The
    sweep's checks (src/preflight/data.py) and the trial (`load`) both load through it."""
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in FAST_TOKENIZERS and (path / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def build_random_llama(path: Path, arch: dict[str, Any]) -> None:
    """A Llama of the given architecture with random weights, saved at `path` like any checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    arch = {k: v for k, v in arch.items() if v is not None}
    arch.setdefault("vocab_size", len(tokenizer))
    config = LlamaConfig(
        **arch,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # Big models are made on the GPU in bf16 (16 GB for 8B: seconds there, minutes on a CPU).
    device = "cuda" if torch.cuda.is_available() and config.hidden_size >= 1024 else "cpu"
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp, max_shard_size="5GB")
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def _quantized_copy(model_cfg: Any, cache_dir: Path) -> Path:
    key = json.dumps(
        {"path": str(model_cfg.path), "q": OmegaConf.to_container(model_cfg.quantization), "dtype": model_cfg.dtype},
        sort_keys=True,
    )
    return cache_dir / "quantized" / f"{model_cfg.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


def ensure_built(model_cfg: Any) -> None:
    """Build the random model at model.path if the config asks for one and it is not there yet."""
    path = Path(model_cfg.path)
    if path.exists():
        return
    if model_cfg.build is None:
        raise ConfigError(
            f"model.path: {path} does not exist. Point it at a local checkpoint directory "
            f"(model.path=/models/Meta-Llama-3-8B-Instruct), or use model=tiny_llama / model=llama3_8b_synthetic."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            build_random_llama(path, OmegaConf.to_container(model_cfg.build))


def prepared(model_cfg: Any, cache_dir: str | Path) -> bool:
    """Whether the model is there, and its cached 4-bit copy where the config asks for one: nothing to build."""
    if not Path(model_cfg.path).exists():
        return False
    return not model_cfg.cache_quantized or (_quantized_copy(model_cfg, Path(cache_dir)) / "config.json").exists()


def device_map(parallelism: str, configured: Any = None) -> dict[str, Any] | str:
    import torch

    if not torch.cuda.is_available():
        return {"": "cpu"}
    if configured is not None:
        return OmegaConf.to_container(configured) if hasattr(configured, "items") else configured
    if parallelism == "model_parallel":
        return "auto"
    return {"": torch.cuda.current_device()}


def prepare_apart(cfg: Any) -> bool:
    """Build the random model and the cached 4-bit copy in a process of their own when they are not there yet, so
    that what building takes (the 8B's 16 GB of bf16 weights made on the GPU, a full-precision load to quantize)
    never counts in the memory of the trial that asked. Says so in one line; True when it built."""
    import multiprocessing
    import sys

    mcfg = cfg.model
    if prepared(mcfg, cfg.paths.cache_dir) or (mcfg.build is None and not Path(mcfg.path).exists()):
        return False  # nothing to build, or nothing it could build from (load's own check names the key)
    what = "the random model and its 4-bit copy" if mcfg.build is not None else "the 4-bit copy"
    print(
        f"model {mcfg.name}: building {what} in a process of its own (once per cache; not counted in this "
        "trial's memory)",
        file=sys.stderr,
        flush=True,
    )
    # Only the groups the build reads (load): the rest may not resolve outside a Hydra run, e.g. Hydra's own node
    # where a tool or a test composed with hydra_config=True (its sweep subdir needs hydra.job.num) or a
    # ${hydra:runtime...} path (HydraConfig is not set).
    task = {group: OmegaConf.to_container(cfg[group], resolve=True) for group in ("model", "hardware", "paths")}
    child = multiprocessing.get_context("spawn").Process(target=_prepare, args=(task,), name="model-build")
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(
            f"building model {mcfg.name} failed in its own process (exit {child.exitcode}); "
            f"python -m src.models model={mcfg.name} shows why"
        )
    return True


def _prepare(container: dict[str, Any]) -> None:
    cfg = OmegaConf.create(container)
    ensure_built(cfg.model)
    if cfg.model.cache_quantized:
        model, _ = load(cfg, apart=False)
        del model


def load(cfg: Any, apart: bool = True) -> tuple[Any, Any]:
    """(4-bit model, tokenizer) for the trial; a cached 4-bit copy is made once and reused. `apart`: what must be
    built first is built in a process of its own (`prepare_apart`)."""
    import torch
    from transformers import AutoModelForCausalLM

    mcfg = cfg.model
    if apart:
        prepare_apart(cfg)
    ensure_built(mcfg)
    source = Path(mcfg.path)
    tokenizer = tokenizer_class(source).from_pretrained(source)
    if tokenizer.chat_template is None:
        raise ConfigError(f"model.path: the tokenizer in {source} has no chat template; use the Instruct model's.")
    if tokenizer.pad_token is None:
        pad = "<|finetune_right_pad_id|>"
        tokenizer.pad_token = pad if pad in tokenizer.get_vocab() else tokenizer.eos_token

    if mcfg.attn_implementation == "varlen":
        from src import attention

        attention.register()
    kwargs: dict[str, Any] = {
        "dtype": getattr(torch, mcfg.dtype),
        "attn_implementation": mcfg.attn_implementation,
        "device_map": device_map(cfg.hardware.parallelism, mcfg.device_map),
    }
    quantized = _quantized_copy(mcfg, Path(cfg.paths.cache_dir))
    if mcfg.cache_quantized and (quantized / "config.json").exists():
        # The saved copy carries its quantization_config; from_pretrained restores the 4-bit layers.
        model = AutoModelForCausalLM.from_pretrained(quantized, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            source, quantization_config=instantiate(mcfg.quantization), **kwargs
        )
        if mcfg.cache_quantized:
            quantized.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(quantized) + ".lock"):
                if not (quantized / "config.json").exists():
                    tmp = quantized.with_name(quantized.name + ".partial")
                    model.save_pretrained(tmp)
                    tmp.rename(quantized)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    return model, tokenizer


def prepare_for_kbit_training(model: Any, cfg: Any) -> Any:
    """peft's k-bit preparation (freeze the base, checkpointing without re-entrant autograd); with
    model.upcast_non_quantized=false, the same without its fp32 copy of embeddings, norms and lm_head.
    Checkpointing is switched on here, by the model's own method under today's name (`enable_checkpointing`):
    peft's would call the deprecated one."""
    from peft import prepare_model_for_kbit_training

    if cfg.model.upcast_non_quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model.requires_grad_(False)
    if cfg.trainer.gradient_checkpointing:
        enable_checkpointing(model, cfg)
    return model


def enable_checkpointing(model: Any, cfg: Any) -> None:
    """Activation checkpointing with the checkpoint call's arguments the trainer's also get (src/recompute.py
    checkpoint_kwargs: non-re-entrant autograd, and what `trainer.recompute` keeps from the forward):
    `activation_checkpointing_enable` since transformers 5.23, `gradient_checkpointing_enable` before
    (the name `src.config.checkpointing_name` gives the trainer's arguments)."""
    from src.config import checkpointing_name
    from src.recompute import checkpoint_kwargs

    name = checkpointing_name()
    getattr(model, f"{name}_enable")(**{f"{name}_kwargs": checkpoint_kwargs(cfg)})


def attach_lora(model: Any, lora_config: Any) -> Any:
    """peft's LoRA adapters on the model, created on the GPU of the layers they adapt.

    peft builds each adapter on the CPU and copies it to its layer's device: 448 small blocking copies for
    Llama-3-8B's 224 projections. A blocking copy waits for the GPU, and when other processes keep the GPU busy
    (trials sharing a card) each wait is a time slice: in the v3 map on the H200, five trials starting together
    spent ~20 s each in this step against ~1 s alone. Created under the GPU as the default device, the adapters
    are initialized there (the same distributions, drawn by the GPU's generator) and nothing is copied."""
    import torch
    from peft import get_peft_model

    device = model.get_input_embeddings().weight.device
    with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return get_peft_model(model, lora_config)


def compile_layers(model: Any) -> int:
    """`trainer.torch_compile=layers`: torch.compile each decoder layer (regional compilation).

    The layers share their code, and Dynamo treats their parameters as inputs, so one compiled graph serves all
    of them: it compiles once (and once more for dynamic shapes, as packed micro-batches vary in length) instead
    of tracing the whole unrolled model. Inside a layer, Inductor fuses what runs eagerly as separate kernels: the
    RMSNorm's casts and reductions, RoPE, SiLU x up, LoRA's dropout, scale and add. bitsandbytes' 4-bit ops and
    the attention kernels stay calls to their own kernels (they are registered torch ops). Checkpointing stays
    around each layer (transformers' GradientCheckpointingLayer calls the compiled layer, and recomputes it).
    Returns how many layers were compiled."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ConfigError(
            f"trainer.torch_compile=layers: {type(model).__name__} has no decoder layers that transformers marks "
            "(GradientCheckpointingLayer); use trainer.torch_compile=true to compile the whole model"
        )
    for layer in layers:
        layer.compile()
    return len(layers)


# model.sdpa_backends' words for torch.nn.attention.SDPBackend members (preflight refuses any other word)
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def attention_kernels(cfg: Any) -> contextlib.AbstractContextManager:
    """The SDPA kernels model.sdpa_backends allows, in its order (torch.nn.attention.sdpa_kernel); the flags it
    sets are process-wide, so the backward pass, run on autograd's own threads, keeps to them too."""
    if cfg.model.sdpa_backends is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [getattr(SDPBackend, SDPA_BACKENDS[name]) for name in cfg.model.sdpa_backends]
    return sdpa_kernel(backends, set_priority=True)


def context_length(cfg: Any) -> int | None:
    """The model's maximum context, read without loading weights (for preflight)."""
    if cfg.model.build is not None and cfg.model.build.get("max_position_embeddings"):
        return int(cfg.model.build.max_position_embeddings)
    config = Path(cfg.model.path) / "config.json"
    if config.exists():
        return json.loads(config.read_text()).get("max_position_embeddings")
    return None


def main() -> None:
    """`python -m src.models [overrides]`: build the configured random model and its 4-bit copy now, so that
    trials only load them (the sweep engine runs this once before its first trial)."""
    import time

    import hydra

    from src.config import register_configs

    register_configs()

    @hydra.main(version_base="1.3", config_path="../conf", config_name="train")
    def _prepare(cfg: Any) -> None:
        start = time.time()
        ensure_built(cfg.model)
        if cfg.model.cache_quantized:
            model, _ = load(cfg)
            del model
        print(f"model {cfg.model.name} ready at {cfg.model.path} ({time.time() - start:.1f}s)")

    _prepare()


if __name__ == "__main__":
    main()
