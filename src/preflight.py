"""Everything that can be checked before training, checked before training.

    python -m src.preflight [overrides]      # alone: prints the report, exits 1 if training would be refused

Three parts: configuration guards (combinations that cannot work, each naming the key to change and to
what), data lint on the chats as the model's own tokenizer renders them, and an environment report.
`src.train` runs the same checks first in every trial and records the report with the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from src.failures import ConfigError, DataError

ROWS_SHOWN = 10


@dataclass
class Finding:
    check: str
    severity: str  # "error" | "warning" | "info"
    message: str
    rows: list[int] = field(default_factory=list)


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def add(self, check: str, severity: str, message: str, rows: list[int] | None = None) -> None:
        self.findings.append(Finding(check, severity, message, list(rows or [])))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def to_text(self) -> str:
        lines = ["# Preflight", ""]
        for f in self.findings:
            rows = f" rows {_rows(f.rows)}" if f.rows else ""
            lines.append(f"[{f.severity.upper():7}] {f.check}: {f.message}{rows}")
        if self.stats:
            lines += [
                "",
                "Token lengths of the rendered chats: " + ", ".join(f"{k}={v:g}" for k, v in self.stats.items()),
            ]
        if self.environment:
            lines += ["", "Environment:"] + [f"  {k}: {v}" for k, v in self.environment.items()]
        return "\n".join(lines)

    def tags(self) -> dict[str, str]:
        tags = {"preflight.errors": str(len(self.errors))}
        tags["preflight.warnings"] = str(sum(f.severity == "warning" for f in self.findings))
        if "bitsandbytes.native" in self.environment:
            tags["bitsandbytes.native"] = self.environment["bitsandbytes.native"]
        return tags


def _rows(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:ROWS_SHOWN]))
    return shown + (f" (+{len(rows) - ROWS_SHOWN} more)" if len(rows) > ROWS_SHOWN else "")


# ---- configuration guards ------------------------------------------------------------------------------


def check_config(cfg: DictConfig, report: Report) -> None:
    from src.models import context_length

    context = context_length(cfg)
    if context and cfg.data.max_seq_length > context:
        report.add(
            "max_seq_length",
            "error",
            f"data.max_seq_length={cfg.data.max_seq_length} exceeds the model's context of {context} tokens; "
            f"set data.max_seq_length<={context}",
        )
    if cfg.trainer.torch_empty_cache_steps:
        report.add(
            "empty_cache",
            "error",
            f"trainer.torch_empty_cache_steps={cfg.trainer.torch_empty_cache_steps} empties the CUDA cache every "
            "few steps: it fragments memory and slows every step without lowering the peak; "
            "set trainer.torch_empty_cache_steps=null",
        )
    if cfg.hardware.parallelism not in ("single", "model_parallel", "data_parallel"):
        report.add(
            "parallelism",
            "error",
            f"hardware.parallelism={cfg.hardware.parallelism} is not one of single, model_parallel, data_parallel",
        )
    if cfg.trainer.padding_free and cfg.model.attn_implementation not in ("flash_attention_2", "flash_attention_3"):
        report.add(
            "padding_free",
            "warning",
            "trainer.padding_free=true needs a varlen attention kernel to avoid cross-sample attention; "
            "set model.attn_implementation=flash_attention_2 (if installed) or trainer.padding_free=false",
        )
    from src.faults import FAULT_KINDS

    if cfg.fault.kind not in FAULT_KINDS:
        report.add("fault", "error", f"fault.kind={cfg.fault.kind} is not one of {', '.join(FAULT_KINDS)}")


def _load_tokenizer(cfg: DictConfig) -> Any:
    """The model's own tokenizer, without loading weights (a random model's is built as it would be)."""
    from transformers import AutoTokenizer

    from src.models import build_tokenizer

    path = Path(cfg.model.path)
    if (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(path)
    if cfg.model.build is not None:
        return build_tokenizer()
    raise ConfigError(
        f"model.path: no tokenizer in {path}; point model.path at the local model directory "
        "(model.path=/models/Meta-Llama-3-8B-Instruct)"
    )


# ---- data lint -----------------------------------------------------------------------------------------


def check_data(cfg: DictConfig, report: Report) -> None:
    from src.data import cell, length_stats, load_table, to_messages, token_lengths

    df = load_table(cfg.data)  # a missing file or column raises DataError naming the key
    policy = cfg.preflight
    n = len(df)
    rows = np.array(df.index)
    empty = np.array(
        [not cell(a) or not cell(b) for a, b in zip(df[cfg.data.input_column], df[cfg.data.output_column], strict=True)]
    )
    _judge(report, "empty_cells", empty, rows, policy, "max_empty_frac", "rows with an empty input or output cell")

    dup = df.duplicated(subset=[cfg.data.input_column, cfg.data.output_column], keep="first").to_numpy()
    _judge(report, "duplicates", dup, rows, policy, "max_duplicate_frac", "exact duplicate rows")

    wants_json = policy.require_json_output == "always" or (
        policy.require_json_output == "auto" and "json" in cfg.data.system_prompt.lower()
    )
    if wants_json:
        bad_json = np.array([_not_json(cell(v)) for v in df[cfg.data.output_column]]) & ~empty
        _judge(
            report,
            "json_output",
            bad_json,
            rows,
            policy,
            "max_invalid_json_frac",
            "answers that are not valid JSON although the system prompt asks for JSON",
        )

    tokenizer = _load_tokenizer(cfg)
    full, prompt = token_lengths(to_messages(df, cfg.data), tokenizer)
    limit = cfg.data.max_seq_length
    over = full > limit
    cut_answer = over & (prompt < limit)
    lost_answer = over & (prompt >= limit)
    report.stats = length_stats(full)
    if over.any():
        report.add(
            "truncation",
            "info",
            f"{over.sum()} of {n} rows ({over.mean():.1%}) are longer than data.max_seq_length={limit} tokens",
            rows[over].tolist(),
        )
    _judge(
        report,
        "truncated_answers",
        cut_answer | lost_answer,
        rows,
        policy,
        "max_truncated_answer_frac",
        f"rows whose assistant answer would be cut at data.max_seq_length={limit} (the model would learn a "
        f"broken target; {lost_answer.sum()} lose the whole answer). Raise data.max_seq_length to "
        f"{int(full.max())} or shorten/drop those rows",
    )


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def _judge(report: Report, check: str, mask: np.ndarray, rows: np.ndarray, policy: Any, key: str, what: str) -> None:
    """An error when the share of flagged rows exceeds preflight.<key>, else a warning."""
    if not mask.any():
        return
    frac, allowed = float(mask.mean()), float(policy[key])
    severity = "error" if frac > allowed else "warning"
    report.add(
        check, severity, f"{int(mask.sum())} {what} ({frac:.1%}; preflight.{key}={allowed:g})", rows[mask].tolist()
    )


# ---- environment -----------------------------------------------------------------------------------------


def environment(cfg: DictConfig, report: Report) -> None:
    """The machine's facts (the same tags every trial carries) and the checks that depend on them."""
    import torch

    from src.tracking import system_tags

    report.environment = system_tags()
    if not torch.cuda.is_available():
        return
    props = torch.cuda.get_device_properties(0)
    wants_bf16 = cfg.trainer.bf16 or cfg.model.quantization.bnb_4bit_compute_dtype == "bfloat16"
    if wants_bf16 and not torch.cuda.is_bf16_supported():
        report.add(
            "bf16",
            "error",
            f"{props.name} (compute capability {props.major}.{props.minor}) has no bf16; set trainer.bf16=false "
            "model.quantization.bnb_4bit_compute_dtype=float16 model.dtype=float16",
        )
    report.environment["bitsandbytes.native"] = _bnb_native(report)


def _bnb_native(report: Report) -> str:
    """Which native bitsandbytes library serves this CUDA (a CPU-only build silently breaks 4-bit on GPU)."""
    try:
        from bitsandbytes.cextension import lib
    except Exception as exc:
        report.add("bitsandbytes", "error", f"bitsandbytes failed to load: {exc}")
        return "missing"
    name = Path(getattr(lib, "_name", "") or getattr(getattr(lib, "lib", None), "_name", "") or "").name
    if "cuda" not in name:
        report.add(
            "bitsandbytes",
            "error",
            f"bitsandbytes loaded '{name or 'no native library'}' on a CUDA machine; "
            "install a bitsandbytes build with a library for this CUDA version",
        )
    return name or "unknown"


def run(cfg: DictConfig, *, data: bool = True) -> Report:
    """All checks; raises ConfigError / DataError (whose message lists the errors) if training is refused."""
    report = Report()
    check_config(cfg, report)
    environment(cfg, report)
    if data:
        check_data(cfg, report)
    errors = report.errors
    if errors or (cfg.preflight.fail_on_warnings and report.findings):
        summary = "; ".join(f"{f.message}" + (f" (rows {_rows(f.rows)})" if f.rows else "") for f in errors)
        data_checks = {"empty_cells", "duplicates", "json_output", "truncated_answers"}
        error_type = DataError if errors and all(f.check in data_checks for f in errors) else ConfigError
        raise error_type(f"preflight refused training: {summary}\n\n{report.to_text()}")
    return report


def main() -> None:
    import hydra

    from src.config import register_configs

    register_configs()

    @hydra.main(version_base="1.3", config_path="../conf", config_name="train")
    def _main(cfg: DictConfig) -> None:
        try:
            report = run(cfg)
        except (ConfigError, DataError) as exc:
            print(str(exc).split("\n\n", 1)[-1])
            print(f"\nREFUSED: {str(exc).splitlines()[0]}")
            raise SystemExit(1) from None
        print(report.to_text())
        print("\nOK: training would start.")

    _main()


if __name__ == "__main__":
    main()
