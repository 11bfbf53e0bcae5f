"""One peer of this project's trials in this process (benchmarks/suites/peers.yaml): Unsloth's QLoRA, or plain peft +
trl at the same setting, on the project's model and data, capped and measured as the project's own trials are.

    python -m benchmarks.peer_arm --stack unsloth|peft --out FILE [--model llama3_8b_synthetic] [--max-seq-length 4096]
        [--batch 4] [--accumulation 2] [--lora-dropout 0] [--max-steps 15] [--warmup-steps 3] [--stop-after-s S]
        [--wheels .whl_unsloth --site /tmp/site_unsloth]

- unsloth: `FastLanguageModel.from_pretrained(<the model's local path>, load_in_4bit=True)` +
  `FastLanguageModel.get_peft_model(..., use_gradient_checkpointing="unsloth")` + trl's SFTTrainer (which `import
  unsloth` patches), its documented path. It must be imported before transformers, trl and peft: this module imports
  nothing of them at its top, and Unsloth first.
- peft: `AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(NF4, double quant, bf16
  compute))` + `SFTTrainer(peft_config=LoraConfig(...))`, as trl's own sft script builds it (SDPA attention, trl's
  defaults: gradient checkpointing on).
Unsloth pins trl<=1.15 and datasets<5: with --wheels (benchmarks/unsloth_wheels.sh fills .whl_unsloth) they are
installed into --site, put first on the path, ahead of the project's stack. Both: the same LoRA (rank, alpha, the
seven projections), SFTConfig(packing=True unless --no-packing, max_length, batch, accumulation, optim adamw_8bit as
Unsloth's notebooks unless --optim), the data as the project's trials read it (data=clinical_notes, its chats); the
attention backend is recorded (`attention`: what the model says, Unsloth's fast-kernel flags, the kernel that ran).

Measured as a trial: the allocator capped to the budget before the model loads (src/measure/memory.cap_to_budget),
src/measure's Measurements callback (synchronized step times, the trainer's non-padding tokens, NVML's peak) and,
per micro-batch, the real sequence lengths the model's forward receives (`row_lengths`) for the useful FLOPs
(`useful_flops`: src/measure/flops.py's formula, tests/test_speed_v6.py shows they agree). The JSON at --out is
rewritten after every step, so a run cut short keeps what it measured; any failure, an import error included, is
written there with its kind and message.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

STARTED = time.time()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VERSIONS = ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "datasets", "unsloth",
            "unsloth_zoo", "triton", "xformers", "cut_cross_entropy")  # fmt: skip


def useful_flops(params: float, layers: int, attn_width: int, lengths: Sequence[float]) -> float:
    """Useful training FLOPs of sequences of `lengths` real tokens: src/measure/flops.py's formula (4 x P x L for the
    matmuls, forward and backward to the inputs; 6 x layers x width x L^2 for causal attention)."""
    return sum(4.0 * params * n + 6.0 * layers * attn_width * float(n) ** 2 for n in lengths)


def matmul_params(config: Any, lora_r: int, targets: Sequence[str]) -> float:
    """P of `useful_flops` from a Llama-type config and the LoRA on `targets`: in x out of each projection, LoRA's A
    and B (r x (in + out)) on the targeted ones, and lm_head. What FlopCounter sums over the nn.Linear modules of the
    project's model, computed from the architecture so that a library that fuses or wraps modules counts the same."""
    d, inter = int(config.hidden_size), int(config.intermediate_size)
    head_dim = getattr(config, "head_dim", None) or d // int(config.num_attention_heads)
    q, kv = int(config.num_attention_heads) * head_dim, int(config.num_key_value_heads) * head_dim
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, inter),
              "up_proj": (d, inter), "down_proj": (inter, d)}  # fmt: skip
    layer = sum(i * o for i, o in shapes.values()) + sum(lora_r * (shapes[t][0] + shapes[t][1]) for t in targets)
    return float(int(config.num_hidden_layers) * layer + d * int(config.vocab_size))


def row_lengths(kwargs: dict[str, Any]) -> list[int] | None:
    """Real sequence lengths of a micro-batch from the model's forward arguments: FlopCounter's reading, except that
    packed rows are read from their boundaries (Unsloth's `packed_seq_lengths`, else position ids that restart at 0)
    even where a library also passes an all-ones attention mask, so a packed row never counts as one long sequence."""
    import torch

    mask, positions, ids = kwargs.get("attention_mask"), kwargs.get("position_ids"), kwargs.get("input_ids")
    if kwargs.get("packed_seq_lengths") is not None:
        return [int(x) for x in torch.as_tensor(kwargs["packed_seq_lengths"]).reshape(-1).tolist()]
    packed = positions is not None and positions.dim() == 2 and bool((positions[:, 1:] == 0).any())
    if mask is not None and mask.dim() == 2 and not packed:
        return [int(x) for x in mask.sum(dim=-1).tolist()]
    if positions is not None:
        flat = positions.reshape(-1)
        starts = torch.nonzero(flat == 0).reshape(-1).tolist()
        return [e - s for s, e in zip(starts, [*starts[1:], flat.numel()], strict=True)]
    if ids is not None:
        return [int(ids.shape[-1])] * int(ids.shape[0])
    return None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peer_arm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--stack", choices=["unsloth", "peft"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="llama3_8b_synthetic", help="a model= option of conf/model (its local path)")
    p.add_argument("--data", default="clinical_notes")
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--max-seq-length", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=15)
    p.add_argument("--warmup-steps", type=int, default=3, help="optimizer steps not measured")
    p.add_argument("--stop-after-s", type=float, default=None, help="stop training this long after the start")
    p.add_argument("--checkpoint-skip-layers", default="0", help="Unsloth's get_peft_model option ('auto': planned)")
    p.add_argument("--no-packing", action="store_true", help="padded rows, as the user's recipe (SFTConfig packing)")
    p.add_argument("--optim", default=None, help="the trainer's optimizer (default: adamw_8bit, Unsloth's notebooks)")
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--attention", default=None, help="peft: the model's attn_implementation (default: sdpa)")
    p.add_argument("--no-4bit", action="store_true", help="bf16 weights (a CPU smoke run: 4-bit needs CUDA there)")
    p.add_argument("--output-dir", default="/tmp/peer_arm_trainer")
    p.add_argument("--wheels", default=None, help="Unsloth's wheels, installed into --site first (unsloth_wheels.sh)")
    p.add_argument("--site", default="/tmp/site_unsloth", help="where --wheels go, first on the path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    record: dict[str, Any] = {"stack": args.stack, "setting": {k: v for k, v in vars(args).items() if k != "out"},
                              "status": "failed", "failure": None}  # fmt: skip
    state: dict[str, Any] = {}
    try:
        if args.wheels:
            install(Path(args.wheels), Path(args.site))
        train(args, record, state)
        record["status"] = "ok"
    except BaseException as exc:  # noqa: BLE001 - every failure is written with its kind, then the process exits
        from src.failures import classify_exception, first_line

        meas = state.get("meas")
        step = (meas.step + 1) if meas is not None and meas.startup_s is not None else None
        kind = "import" if isinstance(exc, ImportError) else classify_exception(exc)
        record["failure"] = {"kind": kind, "message": first_line(f"{type(exc).__name__}: {exc}"), "step": step}
        record["traceback"] = traceback.format_exc()[-6000:]
    finish(args, record, state)
    return 0 if record["status"] == "ok" else 1


def install(wheels: Path, site: Path) -> None:
    """Unsloth's environment (its trl and datasets pins) into `site`, first on this process's path."""
    import subprocess

    if not (site / "unsloth").exists():
        found = sorted(str(p) for p in wheels.glob("*.whl"))
        if not found:
            raise ImportError(f"no Unsloth wheels in {wheels}: run bash benchmarks/unsloth_wheels.sh and carry it")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *found], check=True)  # fmt: skip
    sys.path.insert(0, str(site))


def train(args: argparse.Namespace, record: dict, state: dict) -> None:
    os.environ.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    if args.stack == "unsloth":
        os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # it would fetch a file from the Hub
        t = time.time()
        import unsloth  # noqa: F401 - first: it patches transformers, peft and trl as they are imported

        record["unsloth_import_s"] = time.time() - t
    import torch

    from src.config import compose
    from src.measure import AttentionProbe, Measurements
    from src.measure.memory import GIB, cap_to_budget
    from src.models import ensure_built

    record["versions"] = versions()
    cfg = compose([f"model={args.model}", f"data={args.data}"])
    ensure_built(cfg.model)  # a synthetic model is built where this machine has none yet, as a trial builds it
    record["model_path"] = str(cfg.model.path)
    record["budget"] = cap_to_budget(args.budget_gib)  # before the model loads, as a trial's budget is
    meas_cfg = SimpleNamespace(
        measure=SimpleNamespace(warmup_steps=args.warmup_steps, nvml_interval_s=0.05),
        trainer=SimpleNamespace(per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulation),
    )
    progress = args.out.with_suffix(".progress.json")
    meas = state["meas"] = Measurements(meas_cfg, progress)
    t = time.time()
    model, tokenizer, trainer_kwargs = (load_unsloth if args.stack == "unsloth" else load_peft)(args, cfg)
    record["load_s"] = time.time() - t
    if torch.cuda.is_available():
        record["peak_vram_reserved_after_load_gib"] = torch.cuda.max_memory_reserved() / GIB
    trainer = build_trainer(args, cfg, model, tokenizer, trainer_kwargs)
    counter = state["counter"] = useful_work(args, record, state)
    probe = state["attention"] = AttentionProbe(at_step=max(1, args.warmup_steps))
    record["attention"] = attention_backend(model)
    trainer.add_callback(probe)
    trainer.add_callback(meas)
    trainer.add_callback(counter)
    record["trainer_s"] = time.time() - t - record["load_s"]
    trainer.train()


def attention_backend(model: Any) -> dict[str, Any]:
    """What the model says it attends with (transformers' attn_implementation) and, under Unsloth, which fast kernels
    it found (its own flags); the kernel that ran is read at a warm-up step (src/measure AttentionProbe)."""
    found: dict[str, Any] = {"attn_implementation": getattr(model.config, "_attn_implementation", None)}
    try:
        from unsloth.models import _utils

        found |= {k: bool(getattr(_utils, k)) for k in ("HAS_FLASH_ATTENTION", "HAS_XFORMERS") if hasattr(_utils, k)}
    except ImportError:
        pass
    return found


def load_unsloth(args: argparse.Namespace, cfg: Any) -> tuple[Any, Any, dict]:
    import torch
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(cfg.model.path),
        max_seq_length=args.max_seq_length,
        dtype=torch.bfloat16,
        load_in_4bit=not args.no_4bit,
    )
    extra = {}
    if args.checkpoint_skip_layers not in ("0", ""):
        extra["checkpoint_skip_layers"] = (
            int(args.checkpoint_skip_layers) if args.checkpoint_skip_layers.isdigit() else args.checkpoint_skip_layers
        )
    model = FastLanguageModel.get_peft_model(
        model,
        r=args.lora_r,
        target_modules=TARGETS,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        **extra,
    )
    return model, tokenizer, {}


def load_peft(args: argparse.Namespace, cfg: Any) -> tuple[Any, Any, dict]:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quantization = None
    if not args.no_4bit:
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    device = {"": torch.cuda.current_device()} if torch.cuda.is_available() else {"": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(
        str(cfg.model.path),
        quantization_config=quantization,
        dtype=torch.bfloat16,
        device_map=device,
        attn_implementation=args.attention or "sdpa",
    )
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model.path))
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                      target_modules=TARGETS, bias="none", task_type="CAUSAL_LM")  # fmt: skip
    return model, tokenizer, {"peft_config": lora}


def build_trainer(args: argparse.Namespace, cfg: Any, model: Any, tokenizer: Any, trainer_kwargs: dict) -> Any:
    """trl's SFTTrainer over the project's chats: the same rows a project trial trains on (the data set is smaller
    than the steps' tokens, so every row, in the trainer's own shuffled order)."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from src.data import load_table, to_messages

    chats = to_messages(load_table(cfg.data), cfg.data)
    config = SFTConfig(
        output_dir=args.output_dir,
        max_length=args.max_seq_length,
        packing=not args.no_packing,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        max_steps=args.max_steps,
        warmup_steps=0,
        learning_rate=args.learning_rate,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        optim=(args.optim or "adamw_8bit") if torch.cuda.is_available() else "adamw_torch",
        bf16=True,
        logging_steps=1,
        seed=3407,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        include_num_input_tokens_seen="non_padding",
        use_cpu=not torch.cuda.is_available(),
    )
    return SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"messages": chats}),
        processing_class=tokenizer,
        **trainer_kwargs,
    )


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in VERSIONS:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def useful_work(args: argparse.Namespace, record: dict, state: dict) -> Any:
    """A trainer callback that records, per optimizer step: the real sequence lengths each micro-batch's forward
    received, their tokens and useful FLOPs, and torch's reserved peak so far; it stops training past --stop-after-s
    and rewrites --out after each step. Defined here, not at the module's top: transformers must come after Unsloth.

    The lengths come from a hook on the model's forward, which runs once per micro-batch (checkpointing recomputes
    layers, not the model). A library may call a wrapper's `forward` directly, which runs no hook: so the wrappers
    inside (peft's LoraModel, the causal LM, its decoder) are hooked too, and each step is counted at the outermost
    level that ran (`lengths_from`)."""
    from transformers import TrainerCallback

    class UsefulWork(TrainerCallback):
        def __init__(self) -> None:
            self.pending: dict[int, list[list[int]]] = {}
            self.extra: list[dict] = []
            self.params, self.layers, self.width = 0.0, 0, 0

        def on_train_begin(self, _args: Any, _state: Any, _control: Any, model: Any = None, **kwargs: Any) -> None:
            config = model.config
            self.params = matmul_params(config, args.lora_r, TARGETS)
            self.layers = int(config.num_hidden_layers)
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            self.width = int(config.num_attention_heads * head_dim)
            record["model_params_matmul"] = self.params
            record["startup_s"] = time.time() - STARTED
            level, seen = model, set()
            while level is not None and id(level) not in seen and len(seen) < 4:  # model, LoraModel, LM, decoder
                seen.add(id(level))
                level.register_forward_pre_hook(functools.partial(self.hook, len(seen) - 1), with_kwargs=True)
                level = getattr(level, "base_model", None) if len(seen) == 1 else getattr(level, "model", None)

        def hook(self, level: int, module: Any, inputs: Any, kwargs: dict) -> None:
            import torch

            if torch.is_grad_enabled():
                lengths = row_lengths(kwargs)
                if lengths is not None:
                    self.pending.setdefault(level, []).append(lengths)

        def on_step_end(self, _args: Any, _state: Any, control: Any, **kwargs: Any) -> None:
            import torch

            level = min(self.pending, default=None)
            batches = self.pending.get(level, []) if level is not None else []
            lengths = [n for batch in batches for n in batch]
            entry = {"hook_tokens": sum(lengths), "micro_batches": len(batches), "sequences": len(lengths),
                     "lengths_from": level, "flops": useful_flops(self.params, self.layers, self.width, lengths)}  # fmt: skip
            self.pending = {}
            if torch.cuda.is_available():
                entry["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 1024**3
            self.extra.append(entry)
            if args.stop_after_s is not None and time.time() - STARTED > args.stop_after_s:
                control.should_training_stop = True
                record["stopped"] = f"past --stop-after-s {args.stop_after_s:g}"
            finish(args, record, state, final=False)

    return UsefulWork()


def finish(args: argparse.Namespace, record: dict, state: dict, final: bool = True) -> None:
    """Write what was measured so far: the steps (time, tokens, useful FLOPs) and the peaks, as a trial records."""
    meas, counter = state.get("meas"), state.get("counter")
    if meas is not None:
        steps = []
        for i, s in enumerate(meas.steps):
            extra = counter.extra[i] if counter is not None and i < len(counter.extra) else {}
            tokens = s["tokens"] if s["tokens"] > 0 else extra.get("hook_tokens", 0)  # the trainer's count first
            steps.append({"step": s["step"], "time_s": s["time_s"], "tokens": tokens, "trainer_tokens": s["tokens"],
                          "flops_src_counter": s.get("flops"), **extra})  # fmt: skip
        record["steps"] = steps
        record["warmup_steps"] = args.warmup_steps
        measured = steps[args.warmup_steps :]
        tokens = sum(s["tokens"] for s in measured)
        if tokens and all("flops" in s for s in measured):
            record["flops_per_token"] = sum(s["flops"] for s in measured) / tokens
        probe = state.get("attention")
        if probe is not None and probe.kernels:
            record.setdefault("attention", {})["kernels_run"] = sorted(probe.kernels)
        if final:
            summary = meas.summary()
            record.update({k: v for k, v in summary.items() if k.startswith(("peak_", "alloc_"))})
            peaks = [s.get("max_reserved_gib", 0.0) for s in steps]
            peaks.append(record.get("peak_vram_reserved_after_load_gib", 0.0))
            if "peak_vram_reserved_gib" in record:  # torch's peak at the end, or a higher one a library reset away
                record["peak_vram_reserved_gib"] = max(record["peak_vram_reserved_gib"], *peaks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    tmp.replace(args.out)


if __name__ == "__main__":
    sys.exit(main())
