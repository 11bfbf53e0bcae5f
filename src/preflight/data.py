"""Data lint, on the chats as the model's own tokenizer renders them: empty cells, duplicates, answers that are
not JSON when JSON is asked for, rows whose answer `max_seq_length` would cut, the length distribution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from src.failures import ConfigError
from src.models import build_tokenizer, context_length, tokenizer_class
from src.preflight.report import Report

# The checks whose refusal is the data's fault (DataError), not the config's.
DATA_CHECKS = {"empty_data", "empty_cells", "duplicates", "json_output", "truncated_answers"}

_TOKENIZERS: dict[str, Any] = {}


def check_data(cfg: DictConfig, report: Report) -> None:
    """Lint the data set as training will see it. Row numbers are the sheet's: the header is row 1."""
    from src.data import cell, load_table

    df = load_table(cfg.data)  # a missing file or column raises DataError naming the key
    if len(df) == 0:
        report.add("empty_data", "error", f"data.path={cfg.data.path} has no data rows; point it at the training set")
        return
    rows = df.index.to_numpy()
    inputs = [cell(v) for v in df[cfg.data.input_column]]
    outputs = [cell(v) for v in df[cfg.data.output_column]]
    _check_empty_cells(cfg, report, rows, inputs, outputs)
    _check_duplicates(cfg, report, rows, inputs, outputs)
    _check_json(cfg, report, rows, outputs)
    _check_lengths(cfg, report, df, rows)


def _check_empty_cells(
    cfg: DictConfig, report: Report, rows: np.ndarray, inputs: list[str], outputs: list[str]
) -> None:
    in_col, out_col = cfg.data.input_column, cfg.data.output_column
    empty_in = np.array([not x for x in inputs])
    empty_out = np.array([not x for x in outputs])
    _judge(
        report,
        "empty_cells",
        empty_in | empty_out,
        rows,
        cfg.preflight,
        "max_empty_frac",
        f"rows with an empty or missing cell ({int(empty_in.sum())} in input column '{in_col}', "
        f"{int(empty_out.sum())} in output column '{out_col}'): they would train on an empty message. "
        "Fill or drop them",
    )


def _check_duplicates(cfg: DictConfig, report: Report, rows: np.ndarray, inputs: list[str], outputs: list[str]) -> None:
    first: dict[tuple[str, str], int] = {}
    pairs = []  # (duplicate row, the row it repeats)
    for row, key in zip(rows, zip(inputs, outputs, strict=True), strict=True):
        if key in first:
            pairs.append((int(row), first[key]))
        else:
            first[key] = int(row)
    dup = np.isin(rows, [p[0] for p in pairs])
    shown = ", ".join(f"row {a} repeats row {b}" for a, b in pairs[:3]) + (", ..." if len(pairs) > 3 else "")
    _judge(report, "duplicates", dup, rows, cfg.preflight, "max_duplicate_frac", f"exact duplicate rows ({shown})")


def _check_json(cfg: DictConfig, report: Report, rows: np.ndarray, outputs: list[str]) -> None:
    policy = cfg.preflight
    prompt_asks = "json" in cfg.data.system_prompt.lower()
    if policy.require_json_output == "always" or (policy.require_json_output == "auto" and prompt_asks):
        bad_json = np.array([bool(x) and _not_json(x) for x in outputs])
        _judge(
            report,
            "json_output",
            bad_json,
            rows,
            policy,
            "max_invalid_json_frac",
            f"answers in '{cfg.data.output_column}' that are not valid JSON although "
            + ("the system prompt asks for JSON" if prompt_asks else "preflight.require_json_output=always"),
        )


def _check_lengths(cfg: DictConfig, report: Report, df: Any, rows: np.ndarray) -> None:
    """The rendered chats' length distribution, and the rows whose answer max_seq_length would cut."""
    from src.data import length_stats, to_messages, token_lengths

    full, prompt = token_lengths(to_messages(df, cfg.data), load_tokenizer(cfg))
    limit = cfg.data.max_seq_length
    context = context_length(cfg)
    fits = int(full.max()) if not context or full.max() <= context else context
    over = full > limit
    lost = over & (prompt >= limit)
    report.stats = length_stats(full)
    report.add(
        "lengths",
        "info",
        "rendered chats, tokens: "
        + ", ".join(f"{k.removeprefix('tokens_')}={v:g}" for k, v in report.stats.items())
        + f"; {int(over.sum())} of {len(df)} rows ({over.mean():.1%}) longer than data.max_seq_length={limit}",
    )
    # Truncation keeps the start (trl's default), so the answer at the end of a long row is what gets cut.
    _judge(
        report,
        "truncated_answers",
        over,
        rows,
        cfg.preflight,
        "max_truncated_answer_frac",
        f"rows longer than data.max_seq_length={limit} tokens, whose assistant answer would be cut (the model "
        f"would learn a broken target; {int(lost.sum())} lose the whole answer). Set data.max_seq_length={fits} "
        + ("(the longest row)" if fits == full.max() else "(the model's context) and shorten or drop the rest")
        + " or shorten or drop these rows",
    )


def load_tokenizer(cfg: DictConfig) -> Any:
    """The model's own tokenizer, without loading weights (a random model's is built as it would be).
    Kept per model path: building the tiny model's tokenizer trains a BPE, a second each time."""
    path = Path(cfg.model.path)
    if str(path) in _TOKENIZERS:
        return _TOKENIZERS[str(path)]
    if (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists():
        tokenizer = tokenizer_class(path).from_pretrained(path)
    elif cfg.model.build is not None:
        tokenizer = build_tokenizer()
    else:
        raise ConfigError(
            f"model.path: no tokenizer in {path}; point model.path at the local model directory "
            "(model.path=/models/Meta-Llama-3-8B-Instruct)"
        )
    _TOKENIZERS[str(path)] = tokenizer
    return tokenizer


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
        check,
        severity,
        f"{int(mask.sum())} {what} ({frac:.1%} of rows; refused above preflight.{key}={allowed:g})",
        rows[mask].tolist(),
    )
