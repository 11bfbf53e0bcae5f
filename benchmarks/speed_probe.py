"""Named settings measured alone on the card, to find where a step's time goes (issue: benchmark).

    python -m benchmarks.speed_probe [--only NAME ...] [--out FILE]

On a GPU machine: the card's bf16 matmul rate, the model built once, then each setting of `SETTINGS` as one
trial with the card to itself (forked from a warm interpreter, `src/sweep/launcher.py`), with the same probe as the
map's solo trials (`benchmarks.map_h200.solo`). A setting whose name ends in `_profile` also writes the profile
of one step (GPU kernel time against wall time, top kernels, top host ops). The result file is written after
every trial: `benchmarks/results/speed_probe_h200.json` by default.

The questions it answers: does a step cost a fixed time per micro-batch whatever its tokens (then larger packed
micro-batches amortise it), and how much of that is the host launching kernels (then fewer launches help:
bf16 instead of peft's fp32 copies, torch.compile).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.map_h200 import COMPILED_PROBE, ROOT, SEED, card_rate, compiles, sh, solo, with_mfu
from src.sweep import launcher
from src.tracking import system_tags

PACKED = {"trainer.gradient_checkpointing": True, "trainer.group_by_length": False, "trainer.packing": True}
LEAN = {"model.upcast_non_quantized": False, "model.sdpa_backends": ["flash", "efficient"]}
# Padding-free attention per packed sequence (src/attention.py) instead of SDPA over a block-diagonal mask.
VARLEN = {"model.upcast_non_quantized": False, "model.attn_implementation": "varlen"}
V4096x4 = {**SEED, **PACKED, "data.max_seq_length": 4096, "trainer.per_device_train_batch_size": 4, **VARLEN}
# (name, knobs, extra overrides). Micro-batch tokens of packed rows = max_seq_length x batch, at most.
SETTINGS: list[tuple[str, dict, list[str]]] = [
    ("seed_profile", SEED, ["measure.profile_step=4"]),
    ("packed_1024x4_lean_profile", {**SEED, **PACKED, "trainer.per_device_train_batch_size": 4, **LEAN},
     ["measure.profile_step=4"]),
    ("packed_2048x4_lean", {**SEED, **PACKED, "data.max_seq_length": 2048,
                            "trainer.per_device_train_batch_size": 4, **LEAN}, []),
    ("packed_4096x2_lean", {**SEED, **PACKED, "data.max_seq_length": 4096,
                            "trainer.per_device_train_batch_size": 2, **LEAN}, []),
    ("packed_4096x4_lean", {**SEED, **PACKED, "data.max_seq_length": 4096,
                            "trainer.per_device_train_batch_size": 4, **LEAN}, []),
    ("seed", SEED, []),
    *[
        (f"varlen_{seq}x{batch}_lean", {**SEED, **PACKED, "data.max_seq_length": seq,
                                        "trainer.per_device_train_batch_size": batch, **VARLEN}, [])
        for seq, batch in ((1024, 4), (2048, 4), (4096, 2), (4096, 4), (8192, 2), (8192, 4))
    ],
    ("varlen_4096x4_lean_profile", V4096x4, ["measure.profile_step=4"]),
    ("flex_4096x4_lean", {**SEED, **PACKED, "data.max_seq_length": 4096, "trainer.per_device_train_batch_size": 4,
                          "model.upcast_non_quantized": False, "model.attn_implementation": "flex_attention"}, []),
    ("varlen_4096x4_lean_compiled", {**V4096x4, "trainer.torch_compile": True}, []),
    ("packed_1024x4_lean_compiled", {**SEED, **PACKED, "trainer.per_device_train_batch_size": 4, **LEAN,
                                     "trainer.torch_compile": True}, []),
    # What is left of a 31%-MFU step (NOTES §4c): the elementwise kernels around the matmuls (norms, RoPE,
    # SiLU x up, LoRA's dropout/scale/add), checkpointing's recompute, LoRA dropout's copies.
    ("varlen_4096x4_nodrop", {**V4096x4, "lora.lora_dropout": 0.0}, []),
    ("varlen_4096x4_liger", {**V4096x4, "trainer.use_liger_kernel": True}, []),
    ("varlen_4096x4_layers", {**V4096x4, "trainer.torch_compile": "layers"}, COMPILED_PROBE),
    ("varlen_4096x4_layers_nodrop", {**V4096x4, "trainer.torch_compile": "layers", "lora.lora_dropout": 0.0},
     COMPILED_PROBE),
    ("varlen_4096x4_layers_liger", {**V4096x4, "trainer.torch_compile": "layers", "trainer.use_liger_kernel": True},
     COMPILED_PROBE),
    ("varlen_4096x4_layers_liger_nodrop", {**V4096x4, "trainer.torch_compile": "layers",
                                           "trainer.use_liger_kernel": True, "lora.lora_dropout": 0.0},
     COMPILED_PROBE),
    ("varlen_1024x2_nockpt", {**V4096x4, "data.max_seq_length": 1024, "trainer.per_device_train_batch_size": 2,
                              "trainer.gradient_checkpointing": False}, []),
    ("varlen_1024x2_nockpt_layers", {**V4096x4, "data.max_seq_length": 1024, "trainer.per_device_train_batch_size": 2,
                                     "trainer.gradient_checkpointing": False, "trainer.torch_compile": "layers"},
     COMPILED_PROBE),
]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3_8b_synthetic")
    p.add_argument("--budget-gib", type=float, default=24)
    p.add_argument("--only", nargs="*", default=None, choices=[name for name, _, _ in SETTINGS])
    p.add_argument("--solo-timeout-s", type=float, default=90)
    p.add_argument("--compile-timeout-s", type=float, default=240, help="for settings that torch.compile")
    p.add_argument("--deadline-s", type=float, default=None, help="no trial starts past this (from start)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speed_probe_h200.json"))
    args = p.parse_args()
    t0 = time.time()
    root = Path(os.environ.get("QLORA_ROOT", ROOT))
    logs = root / "benchmark_logs"
    logs.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "command": "python -m benchmarks.speed_probe " + " ".join(sys.argv[1:]),
        "model": args.model,
        "vram_budget_gib": args.budget_gib,
        "trials": [],
    }

    def save() -> None:
        result["total_wall_s"] = time.time() - t0
        out.write_text(json.dumps(result, indent=2, default=str))

    result["matmul"] = card_rate(logs)
    peak = result["matmul"].get("bf16_tflops")
    rc, result["build_s"] = sh([sys.executable, "-m", "src.models", f"model={args.model}"], logs / "build.log")
    print(f"bf16 matmul {peak} TFLOP/s; model built in {result['build_s']:.0f}s (rc {rc})", flush=True)
    save()
    args.forkserver = launcher.forkserver(list(launcher.DEFAULT_PRELOAD))
    named = {name: (name, setting, extra) for name, setting, extra in SETTINGS}
    for name, setting, extra in [named[n] for n in args.only] if args.only is not None else SETTINGS:  # in order
        budget_s = args.compile_timeout_s if compiles(setting) else args.solo_timeout_s
        if args.deadline_s is not None and time.time() - t0 + budget_s > args.deadline_s:
            result.setdefault("not_run", []).append({"name": name, "why": "out of time"})
            continue
        entry = with_mfu(
            solo(setting, args, root / "benchmark", name, extra, map_recipe=False, timeout_s=budget_s), peak
        )
        entry["name"] = name
        steps = entry.get("step_time_s")
        if steps and entry.get("tokens_per_s"):  # the seed's accumulation: 2 micro-batches per step
            entry["tokens_per_micro_batch"] = entry["tokens_per_s"] * steps / 2
        result["trials"].append(entry)
        print(
            f"{name}: {entry['status']} {entry.get('tokens_per_s')} tokens/s, mfu {entry.get('mfu')}, "
            f"{entry.get('peak_vram_reserved_gib')} GiB, step {steps}s, first step {entry.get('first_step_s')}s",
            flush=True,
        )
        if entry.get("profile"):
            print(entry["profile"][:3000], flush=True)
        save()
    result["machine"] = system_tags()
    save()
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
