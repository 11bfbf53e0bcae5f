"""Data lint, on the chats as the model's own tokenizer renders them: empty cells, duplicates, answers that are
not JSON when JSON is asked for, rows whose answer `max_seq_length` would cut, the length distribution."""

from __future__ import annotations

import hashlib
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
    """Lint the data set as training will see it, read a block of rows at a time (src/tables.py): what is kept of
    each row is a few numbers (flags, a digest, token lengths), so memory stays that of one block whatever the data's
    size. Row numbers are the sheet's: the header is row 1."""
    from src.data import read_blocks

    seen = _gather(cfg, read_blocks(cfg.data))  # a missing file or column raises DataError naming the key
    rows = seen["rows"]
    if len(rows) == 0:
        report.add("empty_data", "error", f"data.path={cfg.data.path} has no data rows; point it at the training set")
        return
    _check_empty_cells(cfg, report, rows, seen["empty_in"], seen["empty_out"])
    _check_duplicates(cfg, report, rows, seen["digests"])
    if "bad_json" in seen:
        _check_json(cfg, report, rows, seen["bad_json"])
    _check_lengths(cfg, report, rows, seen["full"], seen["prompt"])


def _gather(cfg: DictConfig, blocks: Any) -> dict[str, np.ndarray]:
    """What the checks need of each row, gathered block by block: its number (`rows`), its empty cells, a digest of
    its (input, output) pair, whether its answer is not JSON (`bad_json`, when JSON is asked for), the tokens of its
    rendered chat and of its prompt (`full`, `prompt`)."""
    from src.data import cell, to_messages, token_lengths

    parts: dict[str, list[np.ndarray]] = {}
    asks_json = _asks_json(cfg)
    tokenizer = None
    for block in blocks:
        inputs = [cell(v) for v in block[cfg.data.input_column]]
        outputs = [cell(v) for v in block[cfg.data.output_column]]
        found = {
            "rows": block.index.to_numpy(),
            "empty_in": np.array([not x for x in inputs], dtype=bool),
            "empty_out": np.array([not x for x in outputs], dtype=bool),
            "digests": np.array([_digest(i, o) for i, o in zip(inputs, outputs, strict=True)], dtype="S16"),
        }
        if asks_json:
            found["bad_json"] = np.array([bool(x) and _not_json(x) for x in outputs], dtype=bool)
        if len(block):
            if tokenizer is None:
                tokenizer = load_tokenizer(cfg)
            found["full"], found["prompt"] = token_lengths(to_messages(block, cfg.data), tokenizer)
        for key, values in found.items():
            parts.setdefault(key, []).append(values)
    return {key: np.concatenate(values) for key, values in parts.items()}


def _digest(inp: str, out: str) -> bytes:
    """16 bytes that stand for a row's (input, output) pair: exact duplicates share them, and only they (a 128-bit
    digest: no two different rows of any data set collide)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(inp.encode())
    h.update(b"\0")
    h.update(out.encode())
    return h.digest()


def _check_empty_cells(
    cfg: DictConfig, report: Report, rows: np.ndarray, empty_in: np.ndarray, empty_out: np.ndarray
) -> None:
    in_col, out_col = cfg.data.input_column, cfg.data.output_column
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


def _check_duplicates(cfg: DictConfig, report: Report, rows: np.ndarray, digests: np.ndarray) -> None:
    _, first, which = np.unique(digests, return_index=True, return_inverse=True)
    repeats = first[which]  # each row's first row with the same pair (itself when it is the first)
    dup = repeats != np.arange(len(rows))
    pairs = [(int(rows[i]), int(rows[repeats[i]])) for i in np.flatnonzero(dup)[:4]]  # (duplicate, the row it repeats)
    shown = ", ".join(f"row {a} repeats row {b}" for a, b in pairs[:3]) + (", ..." if len(pairs) > 3 else "")
    _judge(report, "duplicates", dup, rows, cfg.preflight, "max_duplicate_frac", f"exact duplicate rows ({shown})")


def _asks_json(cfg: DictConfig) -> bool:
    """Whether answers must be JSON: always, or (auto) when the system prompt asks for JSON."""
    policy = cfg.preflight.require_json_output
    return policy == "always" or (policy == "auto" and "json" in cfg.data.system_prompt.lower())


def _check_json(cfg: DictConfig, report: Report, rows: np.ndarray, bad_json: np.ndarray) -> None:
    prompt_asks = "json" in cfg.data.system_prompt.lower()
    _judge(
        report,
        "json_output",
        bad_json,
        rows,
        cfg.preflight,
        "max_invalid_json_frac",
        f"answers in '{cfg.data.output_column}' that are not valid JSON although "
        + ("the system prompt asks for JSON" if prompt_asks else "preflight.require_json_output=always"),
    )


def _check_lengths(cfg: DictConfig, report: Report, rows: np.ndarray, full: np.ndarray, prompt: np.ndarray) -> None:
    """The rendered chats' length distribution, and the rows whose answer max_seq_length would cut."""
    from src.data import length_stats

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
        + f"; {int(over.sum())} of {len(rows)} rows ({over.mean():.1%}) longer than data.max_seq_length={limit}",
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
