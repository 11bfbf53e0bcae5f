"""Speed v6, the peer side by side (issue 31): this project's best stable setting, Unsloth's QLoRA, plain peft+trl and
the user's recipe, in one run on the GPU machine, on the same synthetic Llama-3-8B, the same data, the same 24 GiB cap.

    python -m benchmarks.speed_v6_h200 run [--deadline-s 470] [--unsloth-wheels DIR] [--only ARM ...] [--result F]
    python -m benchmarks.speed_v6_h200 summarize FILE                     # here: the summary again from the arms
    python -m benchmarks.speed_v6_h200 pooled FILE... [--into F]          # here: no_down beside full over repeats

On the lent H200 through benchmarks/memory_h200.sh (a session of its own; what it wrote comes back through $OUT):
    MODULE=benchmarks.speed_v6_h200 COPY=/tmp/speed_v6_run COLLECT=speed_v6_h200.json LOGS=speed_v6 WAIT=505 \
      bash benchmarks/memory_h200.sh --deadline-s 470 --unsloth-wheels "$PWD/.whl_unsloth"
(carry [".whl", ".whl_unsloth"]: benchmarks/gpu_wheels.sh and benchmarks/unsloth_wheels.sh fill them). Selective
recompute beside d, alone (carry [".whl"]; ~4.5 minutes; NOTES §13):
    MODULE=benchmarks.speed_v6_h200 COPY=/tmp/speed_v6_run COLLECT=speed_v6_recompute_h200.json LOGS=speed_v6 \
      WAIT=420 bash benchmarks/memory_h200.sh --deadline-s 380 --only d d_selective --result speed_v6_recompute_h200.json

`run`, in one process: the card's bf16 matmul rate (the denominator of MFU, `benchmarks.matmul_rate`), the model
built once (`python -m src.models`), Unsloth's wheels installed into a --target dir of their own (it pins trl<=1.15 and
datasets<5), then each arm of ARMS in its order (importance: d, b, c, a, d_nodrop, d_selective), alone on the card, in a
process of its own, while the deadline leaves it time (`plan`):
  d         this project's best stable setting (README's speed table), through `python -m src.train` (forked from a
            warm interpreter, as a sweep's trials are);
  b         Unsloth's QLoRA at its documented settings (`FastLanguageModel` + `get_peft_model(...,
            use_gradient_checkpointing="unsloth", lora_dropout=0)` + trl's SFTTrainer as Unsloth patches it), packed
            4096 x 4 x accumulation 2 like d (`benchmarks.peer_arm`);
  c         plain peft + trl at b's setting (the project's own environment, `benchmarks.peer_arm`);
  a         the user's recipe (it OOMs at step 1 at 1024 tokens on 24 GiB: recorded as such);
  d_nodrop  d with LoRA dropout 0, the adapter b trains (a recipe change: compared, never the best setting);
  d_selective  d with trainer.recompute=selective (the same adapter; a candidate for the best setting). Last, so a
            whole run's deadline rarely reaches it: measure it beside d with `--only d d_selective` (NOTES §13).
  e, e_selective, d_no_down, e_no_down  eager layers, and trainer.recompute=no_down compiled and eager (NOTES §16):
            `--only d d_no_down e e_no_down`.
Every arm is measured the same way: per optimizer step, its seconds (synchronized) and non-padding tokens; tokens/s is
the median over >= 3 windows of each arm's `window_steps` steps after its `warmup_steps`; peaks are torch's allocator (reserved)
and NVML's (the whole process); MFU is one formula for every arm (`mfu`: tokens/s x useful FLOPs per token / the card's
measured rate; useful FLOPs counted by `useful_flops`, which is src/measure/flops.py's FlopCounter formula, the one
the project's own trials use: tests/test_speed_v6.py shows they agree). The result file is rewritten after every arm
with its `summary` (`summary`: the keys issue 31 names).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = "speed_v6_h200.json"
STEP_LINE = re.compile(r"step (\d+): (\{.*\})\s*$")  # src/measure/progress.py's per-step log line
BUDGET_GIB = 24.0
MODEL = "llama3_8b_synthetic"
# The default allocator: the user's recipe as a plain script runs it, and every arm as measured so far (expandable
# segments, the default since 0.10, came after these figures)
BASE = ["data=clinical_notes", f"hardware.vram_budget_gib={BUDGET_GIB:g}", "hardware.expandable_segments=false"]
# The long notes reach 4024 tokens: nothing is cut at 4096; the recipe's 1024 cuts 13% of the answers (measured, said).
PROBE = ["preflight.max_truncated_answer_frac=1.0"]
# README's speed table, last row: the fastest stable setting measured so far (10,293 tokens/s, 15.76 GiB).
BEST = [
    "data.max_seq_length=4096",
    "trainer.per_device_train_batch_size=4",
    "trainer.gradient_checkpointing=true",
    "trainer.packing=true",
    "model.attn_implementation=varlen",
    "trainer.torch_compile=layers",
    "model.upcast_non_quantized=false",
]
# The peers' setting: d's micro-batch (4 packed rows of <= 4096 tokens) and accumulation, LoRA r16 / alpha 32 on the
# seven projections as the project's; dropout 0 (Unsloth's fast LoRA path needs it: its documented default).
PEER = ["--max-seq-length", "4096", "--batch", "4", "--accumulation", "2", "--lora-dropout", "0"]
NOT_MEASURED = (
    "not measured by this benchmark: the cheaper map (issue 31's third part) is measured by the map benchmark, "
    "not by the side-by-side run"
)
MFU_COUNTING = (
    "MFU = tokens/s (median of the windows) x useful FLOPs per token / the card's bf16 matmul rate measured in this "
    "run. Useful FLOPs of a sequence of L real tokens: 4 x P x L + 6 x layers x attention width x L^2 (P = in x out "
    "over every Linear the forward runs: the 4-bit projections, LoRA A/B, lm_head); padding and the forward that "
    "checkpointing recomputes are not work. Packed rows count each sequence apart (position ids restart at 0). The "
    "project's trials count it in src/measure/flops.py; the peers with benchmarks.speed_v6_h200.useful_flops, the "
    "same formula (tests/test_speed_v6.py)."
)


@dataclass(frozen=True)
class Arm:
    """One side of the comparison: what runs, how long it needs at least (`estimate_s`, start-up and compiling
    included) and may take at most (`limit_s`), and its measurement (steps not measured, steps per window)."""

    name: str
    what: str
    kind: str  # "project": python -m src.train with `overrides`; "peer": python -m benchmarks.peer_arm with `argv`
    overrides: tuple[str, ...] = ()
    argv: tuple[str, ...] = ()
    estimate_s: float = 100.0
    limit_s: float = 200.0
    warmup_steps: int = 2
    window_steps: int = 4
    windows: int = 3
    same_recipe: bool = True  # trains what the user's recipe trains (its LoRA dropout included)
    candidate: bool = False  # this project's setting, eligible as the summary's best (the recipe itself is not)

    @property
    def max_steps(self) -> int:
        return self.warmup_steps + self.window_steps * self.windows


# d without compiled layers (eager layers): the baseline the recompute choices are measured beside without compiling
EAGER = tuple(o for o in BEST if not o.startswith("trainer.torch_compile"))


def _recompute_arm(name: str, what: str, word: str) -> Arm:
    """d (name d_*) or e (e_*) with `trainer.recompute=word`: the same adapter as full recompute
    (tests/test_recompute.py), so a candidate for the best setting if it is faster."""
    if name.startswith("d_"):  # as d: the same compiling, a step a few % shorter (NOTES §13, §16)
        return Arm(name, what, "project", overrides=(*BEST, f"trainer.recompute={word}"), estimate_s=95, limit_s=180,
                   warmup_steps=4, window_steps=3, candidate=True)  # fmt: skip
    return Arm(name, what, "project", overrides=(*EAGER, f"trainer.recompute={word}"), estimate_s=55, limit_s=140,
               window_steps=3, candidate=True)  # fmt: skip


# Times on the H200 (NOTES §11): a forked trial starts in ~5 s, a fresh interpreter imports the stack in ~20 s; loading
# the 8B from bf16 and quantizing it ~20 s; packed 4096 x 4 x 2 is ~31 k tokens a step (~3 s at 10 k tokens/s).
ARMS: tuple[Arm, ...] = (
    Arm(
        "d",
        "this project's best stable setting: packed 4096 x 4, varlen, compiled layers, bf16 rest, checkpointing",
        "project",
        overrides=tuple(BEST),
        estimate_s=95,  # start 5, load 5, compiling ~40 (first steps), 9 measured steps ~30
        limit_s=180,
        warmup_steps=4,  # compiles in its first steps (and again as packed lengths first change)
        window_steps=3,
        candidate=True,
    ),
    Arm(
        "b",
        "Unsloth's QLoRA: FastLanguageModel 4-bit + get_peft_model(use_gradient_checkpointing='unsloth', dropout 0) "
        "+ SFTTrainer, packed 4096 x 4",
        "peer",
        argv=("--stack", "unsloth", *PEER),
        estimate_s=170,  # imports ~20, Unsloth's patching ~30, load and quantize ~30, kernels' JIT ~30, 11 steps ~40
        limit_s=240,
        warmup_steps=2,  # Unsloth JIT-compiles its Triton kernels in its first steps
        window_steps=3,
        same_recipe=False,
    ),
    Arm(
        "c",
        "plain peft + trl at b's setting (4-bit NF4, LoRA dropout 0, packed 4096 x 4, trl's padding-free SDPA)",
        "peer",
        argv=("--stack", "peft", *PEER),
        estimate_s=110,  # imports ~20, load and quantize ~25, 7 steps of ~9 s (SDPA over a block-diagonal mask)
        limit_s=160,
        warmup_steps=1,
        window_steps=2,
        same_recipe=False,
    ),
    Arm(
        "a",
        "the user's recipe (max_seq_length 1024, eager, no checkpointing, fp32 copies of the non-quantized weights)",
        "project",
        estimate_s=25,  # OOMs at its first step (README): start, load, one step
        limit_s=60,
        window_steps=3,
    ),
    Arm(
        "d_nodrop",
        "d with LoRA dropout 0: the adapter Unsloth trains (a recipe change, compared only)",
        "project",
        overrides=(*BEST, "lora.lora_dropout=0.0"),
        estimate_s=95,
        limit_s=180,
        warmup_steps=4,
        window_steps=3,
        same_recipe=False,
    ),
    _recompute_arm(
        "d_selective",
        "d with trainer.recompute=selective: checkpointing keeps each layer's down_proj product from the forward "
        "(src/recompute.py) instead of recomputing it",
        "selective",
    ),
    # The policy alone, without compiled layers (on the GPU image's transformers 5.17 the compiled path moves the
    # checkpoint around the compiled layer, NOTES §13): full and selective recompute, eager layers, side by side.
    Arm(
        "e",
        "d without compiled layers (eager layers): full recompute, the baseline of e_selective",
        "project",
        overrides=EAGER,
        estimate_s=55,  # start 5, load 5, 11 steps of ~3.5 s
        limit_s=140,
        window_steps=3,
        candidate=True,
    ),
    _recompute_arm(
        "e_selective",
        "e with trainer.recompute=selective: the recompute policy's gain alone, eager layers",
        "selective",
    ),
    # trainer.recompute=no_down (src/recompute.py base_last): the recompute ends before the frozen down_proj product,
    # at full's memory. Compiled (d_no_down: the product between compiled pieces, a graph break) and eager (e_no_down).
    _recompute_arm(
        "d_no_down",
        "d with trainer.recompute=no_down: LoRA's term before the frozen down_proj product, which the recompute then "
        "never reaches",
        "no_down",
    ),
    _recompute_arm(
        "e_no_down", "e with trainer.recompute=no_down: the reordering's gain alone, eager layers", "no_down"
    ),
)


# ---- one formula for every arm --------------------------------------------------------------------------------------


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
    shapes = {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, inter),
        "up_proj": (d, inter),
        "down_proj": (inter, d),
    }
    layer = sum(i * o for i, o in shapes.values()) + sum(lora_r * (shapes[t][0] + shapes[t][1]) for t in targets)
    return float(int(config.num_hidden_layers) * layer + d * int(config.vocab_size))


def row_lengths(kwargs: dict[str, Any]) -> list[int] | None:
    """Real sequence lengths of a micro-batch from the model's forward arguments: FlopCounter's reading, except that
    packed rows are read from their boundaries (Unsloth's `packed_seq_lengths`, else position ids that restart at 0)
    even where a library also passes an all-ones attention mask, so a packed row never counts as one long sequence."""
    import torch

    mask, positions, ids = kwargs.get("attention_mask"), kwargs.get("position_ids"), kwargs.get("input_ids")
    packed_lengths = kwargs.get("packed_seq_lengths")
    if packed_lengths is not None:
        return [int(x) for x in torch.as_tensor(packed_lengths).reshape(-1).tolist()]
    packed = positions is not None and positions.dim() == 2 and bool((positions[:, 1:] == 0).any())
    if mask is not None and mask.dim() == 2 and not packed:
        return [int(x) for x in mask.sum(dim=-1).tolist()]
    if positions is not None:
        flat = positions.reshape(-1)
        starts = torch.nonzero(flat == 0).reshape(-1).tolist()
        ends = [*starts[1:], flat.numel()]
        return [e - s for s, e in zip(starts, ends, strict=True)]
    if ids is not None:
        return [int(ids.shape[-1])] * int(ids.shape[0])
    return None


def mfu(tokens_per_s: float | None, flops_per_token: float | None, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: the same for every arm."""
    if not tokens_per_s or not flops_per_token or not peak_tflops:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


# ---- windows and figures ----------------------------------------------------------------------------------------------


def windows(steps: Sequence[dict], warmup: int, size: int) -> list[dict]:
    """Consecutive windows of `size` optimizer steps after the first `warmup`, each with its tokens/s; an incomplete
    last window is dropped."""
    measured = list(steps[warmup:])
    out = []
    for start in range(0, len(measured) - size + 1, size):
        chunk = measured[start : start + size]
        seconds = sum(s["time_s"] for s in chunk)
        tokens = sum(s["tokens"] for s in chunk)
        out.append({"first_step": warmup + start + 1, "steps": size, "tokens": tokens, "seconds": seconds,
                    "tokens_per_s": tokens / seconds if seconds > 0 else None})  # fmt: skip
    return out


def figures(raw: dict, peak_tflops: float | None, min_windows: int = 3) -> dict:
    """An arm's figures from what it measured (`raw`: its `steps`, `warmup_steps`, `window_steps`, `flops_per_token`),
    the same computation for every arm."""
    steps = raw.get("steps") or []
    warmup, size = int(raw.get("warmup_steps", 0)), int(raw.get("window_steps", 1))
    wins = [w for w in windows(steps, warmup, size) if w["tokens_per_s"]]
    rates = [w["tokens_per_s"] for w in wins]
    measured = steps[warmup:]
    out: dict[str, Any] = {"windows": wins, "measured_steps": len(measured)}
    if rates:
        out["tokens_per_s"] = statistics.median(rates)
        out["tokens_per_s_range"] = [min(rates), max(rates)]
        out["windows_ok"] = len(rates) >= min_windows
        out["tokens_per_optimizer_step"] = sum(s["tokens"] for s in measured) / len(measured)
        out["step_time_s"] = statistics.median(s["time_s"] for s in measured)
        out["mfu"] = mfu(out["tokens_per_s"], raw.get("flops_per_token"), peak_tflops)
    return out


def steps_of_trial(run_dir: Path, mlflow_db: Path, run_id: str) -> list[dict]:
    """A `python -m src.train` trial's optimizer steps: seconds from its MLflow series `step_seconds` (src/measure's
    synchronized step times) and non-padding tokens from the trainer's cumulative `num_input_tokens_seen` in the
    per-step log lines of its log file (`step N: {...}`)."""
    with sqlite3.connect(mlflow_db) as db:
        rows = db.execute(
            "SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'step_seconds' ORDER BY step", (run_id,)
        ).fetchall()
    seconds = dict(rows)
    seen: dict[int, float] = {}
    for log in run_dir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            found = STEP_LINE.search(line)
            if not found:
                continue
            try:
                entry = json.loads(found.group(2))
            except ValueError:
                continue
            if "num_input_tokens_seen" in entry:
                seen[int(found.group(1))] = float(entry["num_input_tokens_seen"])
    steps, previous = [], 0.0
    for step in sorted(seconds):
        if step not in seen:
            break  # tokens unknown from here on: the windows stop here
        steps.append({"step": step, "time_s": seconds[step], "tokens": seen[step] - previous})
        previous = seen[step]
    return steps


# ---- the summary ------------------------------------------------------------------------------------------------------


def summary(arms: dict[str, dict], order: Sequence[Arm] = ARMS) -> dict:
    """The summary issue 31's Done-when names, from the arms' records (each with its `figures`).

    best_*: the fastest arm that is this project's and trains the user's recipe (d: not d_nodrop, whose dropout is
    a recipe change) and finished (`best_windows_ok`: over >= 3 windows); vs_unsloth: its tokens/s over Unsloth's in
    the same run (null, with `unsloth_error`, where Unsloth did not train). Only arms that finished count."""
    by_name = {a.name: a for a in order}
    ours = [
        (name, rec)
        for name, rec in arms.items()
        if name in by_name and by_name[name].candidate and by_name[name].same_recipe and _rate(rec)
    ]  # fmt: skip
    best_name, best = max(ours, key=lambda x: _rate(x[1]), default=(None, None))
    out: dict[str, Any] = {
        "best_arm": best_name,
        "best_setting": list(by_name[best_name].overrides) if best_name else None,
        "best_tokens_per_s": best["figures"]["tokens_per_s"] if best else None,
        "best_mfu": best["figures"].get("mfu") if best else None,
        "best_peak_vram_reserved_gib": best.get("peak_vram_reserved_gib") if best else None,
        "best_windows_ok": best["figures"].get("windows_ok") if best else None,
    }
    if best and best.get("peak_vram_reserved_gib") is not None:  # the report's stable: >= 10% of the budget left
        out["best_headroom_frac"] = 1 - best["peak_vram_reserved_gib"] / BUDGET_GIB
    uns = arms.get("b") or {}
    uns_rate = _rate(uns)
    if uns_rate:
        out["unsloth_tokens_per_s"] = uns_rate
        out["unsloth_mfu"] = uns["figures"].get("mfu")
        out["unsloth_peak_vram_reserved_gib"] = uns.get("peak_vram_reserved_gib")
    else:
        out["unsloth_tokens_per_s"] = None
        out["unsloth_error"] = _why_not(uns)
    out["vs_unsloth"] = out["best_tokens_per_s"] / uns_rate if uns_rate and out["best_tokens_per_s"] else None
    same = _rate(arms.get("d_nodrop") or {})
    out["vs_unsloth_same_adapter"] = same / uns_rate if same and uns_rate else None
    # trainer.recompute=selective beside d (the same setting and adapter, full recompute): its gain measured alone
    selective = arms.get("d_selective") or {}
    out["selective_recompute_tokens_per_s"] = _rate(selective)
    out["selective_vs_full_recompute"], out["selective_extra_reserved_gib"] = _beside(selective, arms.get("d") or {})
    # the policy alone, eager layers (e_selective beside e)
    out["selective_vs_full_recompute_eager_layers"], out["selective_extra_reserved_gib_eager_layers"] = _beside(
        arms.get("e_selective") or {}, arms.get("e") or {}
    )
    # trainer.recompute=no_down beside full recompute: compiled layers (d_no_down beside d), eager (e_no_down beside e)
    out["no_down_vs_full_recompute"], out["no_down_extra_reserved_gib"] = _beside(
        arms.get("d_no_down") or {}, arms.get("d") or {}
    )
    out["no_down_vs_full_recompute_eager_layers"], out["no_down_extra_reserved_gib_eager_layers"] = _beside(
        arms.get("e_no_down") or {}, arms.get("e") or {}
    )
    plain = _rate(arms.get("c") or {})
    out["plain_peft_trl_tokens_per_s"] = plain
    out["vs_plain_peft_trl"] = out["best_tokens_per_s"] / plain if plain and out["best_tokens_per_s"] else None
    recipe = arms.get("a") or {}
    out["recipe_outcome"] = (
        f"failed: {recipe['failure'].get('kind')} at step {recipe['failure'].get('step')}"
        if recipe.get("failure")
        else recipe.get("status")
    )
    for key in ("map_settings", "map_gpu_minutes", "map_verdict_agreement", "fixed_cost_s"):
        out[key] = None
    out["not_measured"] = {
        k: NOT_MEASURED for k in ("map_settings", "map_gpu_minutes", "map_verdict_agreement", "fixed_cost_s")
    }
    out["targets"] = targets(out)
    return out


def _beside(arm: dict, base: dict) -> tuple[float | None, float | None]:
    """An arm against its baseline, both measured: (tokens/s ratio, extra peak reserved GiB); None where either did
    not finish."""
    if not (_rate(arm) and _rate(base)):
        return None, None
    extra = (
        arm["peak_vram_reserved_gib"] - base["peak_vram_reserved_gib"]
        if arm.get("peak_vram_reserved_gib") and base.get("peak_vram_reserved_gib")
        else None
    )
    return _rate(arm) / _rate(base), extra


def _rate(arm: dict) -> float | None:
    """An arm's tokens/s where it finished (a run cut short keeps its steps in the file, not in the comparison)."""
    return arm.get("figures", {}).get("tokens_per_s") if arm.get("status") == "ok" else None


def _why_not(arm: dict) -> str:
    if not arm:
        return "not run"
    if arm.get("status") == "not_run":
        return f"not run: {arm.get('why', 'out of time')}"
    failure = arm.get("failure") or {}
    if failure:
        where = f" at step {failure['step']}" if failure.get("step") else ""
        return f"{failure.get('kind', 'other')}{where}: {failure.get('message', '')}".strip()
    return "no measured window (see its log)"


def targets(s: dict) -> dict:
    """Issue 31's targets for the figures this run measures: the value, the goal, met or by how much it is missed."""
    goals = {
        "best_tokens_per_s": (">=", 12000.0),
        "best_mfu": (">=", 0.50),
        "best_peak_vram_reserved_gib": ("<=", BUDGET_GIB),
        "vs_unsloth": (">=", 1.0),
        # the cheaper map's, filled from benchmarks/map_quick_h200.py's run (None here until it ran)
        "map_settings": (">=", 96.0),
        "map_gpu_minutes": ("<=", 3.0),
        "map_verdict_agreement": (">=", 0.98),
        "fixed_cost_s": ("<=", 5.0),
    }
    out = {}
    for key, (op, goal) in goals.items():
        value = s.get(key)
        if value is None:
            out[key] = {"goal": f"{op} {goal:g}", "value": None, "met": None}
            continue
        met = value >= goal if op == ">=" else value <= goal
        out[key] = {
            "goal": f"{op} {goal:g}",
            "value": value,
            "met": met,
            "missed_by": None if met else abs(goal - value),
        }
    return out


# ---- the deadline -----------------------------------------------------------------------------------------------------


def plan(arm: Arm, elapsed_s: float, deadline_s: float) -> float | None:
    """The time an arm may take, or None when the deadline leaves it less than its estimate (it is not started)."""
    left = deadline_s - elapsed_s
    if left < arm.estimate_s:
        return None
    return min(arm.limit_s, left)


def select(names: Sequence[str] | None, order: Sequence[Arm] = ARMS) -> list[Arm]:
    """The arms to run, always in the order of importance whatever order `names` gives."""
    return [a for a in order if names is None or a.name in names]


# ---- run (on the GPU machine) -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from benchmarks.map_h200 import card_rate, sh
    from src.sweep import launcher
    from src.tracking import system_tags

    t0 = time.time()
    root = Path(os.environ.get("QLORA_ROOT", "/tmp/qlora"))
    out = Path(os.environ.get("OUT") or root) / args.result
    logs = root / "speed_v6"
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": "python -m benchmarks.speed_v6_h200 run " + " ".join(sys.argv[2:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "budget_gib": BUDGET_GIB,
        "data": "data=clinical_notes",
        "model": f"model={args.model}",
        "mfu_counting": MFU_COUNTING,
        "arms": {},
    }

    def save() -> None:
        result["wall_s"] = time.time() - t0
        result["summary"] = summary(result["arms"])
        out.write_text(json.dumps(result, indent=2, default=str))

    save()
    launcher.begin(list(launcher.DEFAULT_PRELOAD))  # the forkserver imports the stack meanwhile (CPU only)
    result["matmul"] = card_rate(logs)
    peak = result["matmul"].get("bf16_tflops")
    unsloth_site = Path(args.unsloth_site)
    installing = install_unsloth(args.unsloth_wheels, unsloth_site, logs / "unsloth_install.log")
    rc, result["build_s"] = sh([sys.executable, "-m", "src.models", f"model={args.model}"], logs / "build.log")
    result["unsloth_install"] = finish_install(installing, args.unsloth_wheels)
    print(f"matmul {peak} TFLOP/s; model built in {result['build_s']:.0f}s (rc {rc}); "
          f"unsloth: {result['unsloth_install']}", flush=True)  # fmt: skip
    save()
    ctx = launcher.forkserver(list(launcher.DEFAULT_PRELOAD))
    for arm in select(args.only):
        budget_s = plan(arm, time.time() - t0, args.deadline_s)
        if budget_s is None:
            result["arms"][arm.name] = {"what": arm.what, "status": "not_run", "why": "out of time (deadline)"}
            print(f"{arm.name}: not run (deadline)", flush=True)
            continue
        if arm.kind == "project":
            raw = project_arm(arm, args.model, root, logs, budget_s, ctx)
        else:
            raw = peer_arm(arm, args.model, logs, budget_s, unsloth_site, result["unsloth_install"])
        raw["figures"] = figures(raw, peak)
        result["arms"][arm.name] = raw
        f = raw["figures"]
        print(f"{arm.name}: {raw['status']} {f.get('tokens_per_s')} tokens/s over {len(f['windows'])} windows, "
              f"mfu {f.get('mfu')}, {raw.get('peak_vram_reserved_gib')} GiB reserved, "
              f"{raw.get('peak_vram_device_gib')} GiB NVML, {raw.get('wall_s', 0):.0f}s", flush=True)  # fmt: skip
        save()
    result["machine"] = system_tags()  # creates a CUDA context here: after the arms, which have the card alone
    save()
    print(json.dumps(result["summary"], indent=2, default=str), flush=True)
    return 0


def install_unsloth(wheels: str | None, site: Path, log: Path) -> subprocess.Popen | str:
    """Start installing Unsloth's wheels into `site` (their own environment); a reason string where there are none."""
    if not wheels or not any(Path(wheels).glob("*.whl")):
        return f"no Unsloth wheels at {wheels!r}: carry .whl_unsloth (bash benchmarks/unsloth_wheels.sh)"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *sorted(str(p) for p in Path(wheels).glob("*.whl"))]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish_install(installing: subprocess.Popen | str, wheels: str | None) -> str:
    if isinstance(installing, str):
        return installing
    rc = installing.wait()
    return "installed" if rc == 0 else f"pip install of {wheels} failed (exit {rc}): see speed_v6/unsloth_install.log"


def project_arm(arm: Arm, model: str, root: Path, logs: Path, budget_s: float, ctx: Any) -> dict:
    """An arm through this project's trial path (`python -m src.train`, forked as a sweep's trials are)."""
    from benchmarks.map_h200 import run_trial

    run_dir = logs / arm.name
    argv = [f"model={model}", *BASE, *PROBE, *arm.overrides, f"trainer.max_steps={arm.max_steps}",
            f"measure.warmup_steps={arm.warmup_steps}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    rc, wall = run_trial(argv, logs / f"{arm.name}.log", budget_s, ctx)
    raw: dict[str, Any] = {"what": arm.what, "command": "python -m src.train " + " ".join(argv[:-1]),
                           "exit_code": rc, "wall_s": wall, "warmup_steps": arm.warmup_steps,
                           "window_steps": arm.window_steps}  # fmt: skip
    result_file = run_dir / "result.json"
    if not result_file.exists():
        from src.failures import classify_exit

        tail = (
            (logs / f"{arm.name}.log").read_text(errors="replace")[-2000:]
            if (logs / f"{arm.name}.log").exists()
            else ""
        )
        kind = classify_exit(rc, tail, timed_out=rc == 124)
        return {**raw, "status": "failed", "failure": {"kind": kind, "message": f"exit {rc}", "step": None}}
    result = json.loads(result_file.read_text())
    m = result.get("metrics", {})
    raw.update(status=result.get("status"), failure=result.get("failure"),
               attention_kernel=result.get("attention_kernel"))  # fmt: skip
    for key in ("peak_vram_reserved_gib", "peak_vram_allocated_gib", "peak_vram_device_gib", "startup_s",
                "first_step_s", "tokens_per_s", "model_tflops_per_s", "model_params_matmul", "train_loss",
                "cuda_context_gib", "allocator_cap_gib"):  # fmt: skip
        if key in m:
            raw[key if key != "tokens_per_s" else "tokens_per_s_whole_span"] = m[key]
    if m.get("model_tflops_per_s") and m.get("tokens_per_s"):  # FlopCounter's FLOPs over the same measured steps
        raw["flops_per_token"] = m["model_tflops_per_s"] * 1e12 / m["tokens_per_s"]
    db = root / "mlruns" / "mlflow.db"
    if result.get("run_id") and db.exists():
        raw["steps"] = steps_of_trial(run_dir, db, result["run_id"])
    return raw


def peer_arm(arm: Arm, model: str, logs: Path, budget_s: float, unsloth_site: Path, install: str) -> dict:
    """An arm through `benchmarks.peer_arm` in a fresh interpreter; Unsloth's with its own environment first on
    PYTHONPATH (its trl and datasets ahead of the project's)."""
    stack = arm.argv[arm.argv.index("--stack") + 1]
    raw: dict[str, Any] = {"what": arm.what, "warmup_steps": arm.warmup_steps, "window_steps": arm.window_steps}
    if stack == "unsloth" and install != "installed":
        return {**raw, "status": "failed", "failure": {"kind": "environment", "message": install, "step": None}}
    env = dict(os.environ)
    if stack == "unsloth":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(unsloth_site), env.get("PYTHONPATH", "")) if p)
    out_file = logs / f"{arm.name}.json"
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.peer_arm", *arm.argv, "--model", model, "--out", str(out_file),
           "--max-steps", str(arm.max_steps), "--warmup-steps", str(arm.warmup_steps),
           "--stop-after-s", f"{budget_s - 20:.0f}", "--output-dir", str(logs / f"{arm.name}_trainer")]  # fmt: skip
    start = time.time()
    with (logs / f"{arm.name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            rc = proc.wait()
            rc = 124 if rc < 0 else rc
    raw.update(command=" ".join(["python -m benchmarks.peer_arm", *arm.argv]), exit_code=rc, wall_s=time.time() - start)
    if out_file.exists():
        measured = {**raw, **json.loads(out_file.read_text())}
        if rc == 124 and not measured.get("failure"):  # killed between two of its steps: what it measured is kept
            measured["status"] = "failed"
            measured["failure"] = {
                "kind": "timeout",
                "message": f"killed at its limit of {budget_s:.0f} s",
                "step": None,
            }
        return measured
    from src.failures import classify_exit

    tail = (logs / f"{arm.name}.log").read_text(errors="replace")[-2000:]
    kind = classify_exit(rc, tail, timed_out=rc == 124)
    last = tail.strip().splitlines()[-1] if tail.strip() else f"exit {rc}, no output"
    return {**raw, "status": "failed", "failure": {"kind": kind, "message": last, "step": None}}


def resummarize(path: Path) -> int:
    """The summary again from the file's arms; keys its arms leave empty keep what other commands filled in (the map's
    from `benchmarks.map_quick_h200 summarize`, no_down's from `pooled --into`)."""
    data = json.loads(path.read_text())
    peak = (data.get("matmul") or {}).get("bf16_tflops")
    for raw in data.get("arms", {}).values():
        if raw.get("steps") is not None:
            raw["figures"] = figures(raw, peak)
    before = data.get("summary") or {}
    data["summary"] = summary(data.get("arms", {}))
    for key, value in before.items():
        if data["summary"].get(key) is None and value is not None:
            data["summary"][key] = value
    missing = {k: v for k, v in (data["summary"].get("not_measured") or {}).items() if data["summary"].get(k) is None}
    if missing:
        data["summary"]["not_measured"] = missing
    else:
        data["summary"].pop("not_measured", None)
    data["summary"]["targets"] = targets(data["summary"])
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(json.dumps(data["summary"], indent=2, default=str))
    return 0


def pooled(files: Sequence[Path], pairs: Sequence[tuple[str, str]] = (("d", "d_no_down"), ("e", "e_no_down"))) -> dict:
    """An arm beside its baseline over repeated runs (each run has both, alone on the card one after the other): per
    run the ratio of the median windows, and over all runs the ratio of the medians of every window; peaks per run.
    Only finished arms count."""
    out: dict[str, Any] = {}
    for base, arm in pairs:
        runs, windows = [], {base: [], arm: []}
        for f in files:
            arms = json.loads(Path(f).read_text()).get("arms", {})
            a, b = arms.get(arm) or {}, arms.get(base) or {}
            if not (_rate(a) and _rate(b)):
                continue
            for name, rec in ((base, b), (arm, a)):
                windows[name] += [w["tokens_per_s"] for w in rec["figures"].get("windows", [])]
            ratio, extra = _beside(a, b)
            runs.append({"file": Path(f).name, "ratio": ratio, "extra_reserved_gib": extra,
                         "tokens_per_s": {base: _rate(b), arm: _rate(a)}})  # fmt: skip
        if not runs:
            continue
        median = {name: statistics.median(w) for name, w in windows.items()}
        out[f"{arm}_vs_{base}"] = {
            "ratio_of_pooled_medians": median[arm] / median[base],
            "pooled_median_tokens_per_s": median,
            "windows": {name: len(w) for name, w in windows.items()},
            "runs": runs,
            "max_extra_reserved_gib": max(
                (r["extra_reserved_gib"] for r in runs if r["extra_reserved_gib"] is not None), default=None
            ),
        }
    return out


def into(path: Path, found: dict, files: Sequence[Path]) -> None:
    """no_down's pooled figures as the summary keys of a whole run's file (`no_down_source` says from where)."""
    data = json.loads(path.read_text())
    s = data["summary"]
    for (arm, base), suffix in ((("d_no_down", "d"), ""), (("e_no_down", "e"), "_eager_layers")):
        block = found.get(f"{arm}_vs_{base}")
        if block:
            s[f"no_down_vs_full_recompute{suffix}"] = block["ratio_of_pooled_medians"]
            s[f"no_down_extra_reserved_gib{suffix}"] = block["max_extra_reserved_gib"]
    gpus = sorted({json.loads(Path(f).read_text()).get("machine", {}).get("gpu.name", "?") for f in files})
    s["no_down_source"] = (
        f"{', '.join(str(f) for f in files)} ({', '.join(gpus)}): each run d and d_no_down (and e, e_no_down) alone on "
        "the card one after the other; the ratio of the medians of all their windows "
        "(python -m benchmarks.speed_v6_h200 pooled FILES)"
    )
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speed_v6_h200", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument(
        "--deadline-s", type=float, default=470, help="no arm starts unless it fits before this (from start)"
    )
    r.add_argument("--unsloth-wheels", default=None, help="folder of Unsloth's wheels (benchmarks/unsloth_wheels.sh)")
    r.add_argument("--unsloth-site", default="/tmp/site_unsloth", help="where they are installed (--target)")
    r.add_argument("--only", nargs="*", default=None, choices=[a.name for a in ARMS])
    r.add_argument("--model", default=MODEL, help="a model= option (tiny_llama: a dry run of the plumbing on a CPU)")
    r.add_argument(
        "--result", default=RESULT, help="the result file's name (a run of some arms keeps the whole run's file)"
    )
    s = sub.add_parser("summarize")
    s.add_argument("file", type=Path)
    o = sub.add_parser("pooled", help="d_no_down beside d and e_no_down beside e over repeated runs' files")
    o.add_argument("files", type=Path, nargs="+")
    o.add_argument("--into", type=Path, default=None, help="write its no_down_* keys into this result file's summary")
    args = p.parse_args()
    if args.cmd == "pooled":
        found = pooled(args.files)
        print(json.dumps(found, indent=2))
        if args.into:
            into(args.into, found, args.files)
        return 0
    return run(args) if args.cmd == "run" else resummarize(args.file)


if __name__ == "__main__":
    sys.exit(main())
