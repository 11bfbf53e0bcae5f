"""The seed's data format, as chat messages rendered by the model's own template.

A table (xlsx, csv, jsonl or parquet) with an input column and an output column becomes system / user /
assistant messages. `python -m src.data` writes the shipped sample sets (deterministic).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

# The data file's readers live in src/tables.py; callers find them here too, beside the chats they become.
from src.tables import FORMATS, load_table, read_blocks  # noqa: F401


def cell(value: Any) -> str:
    """A cell as text; missing cells are empty strings (preflight reports them before this matters)."""
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return ""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return str(value).strip()


def to_messages(df: pd.DataFrame, data_cfg: Any) -> list[list[dict[str, str]]]:
    chats = []
    for inp, out in zip(df[data_cfg.input_column], df[data_cfg.output_column], strict=True):
        chat = [{"role": "user", "content": cell(inp)}, {"role": "assistant", "content": cell(out)}]
        if data_cfg.system_prompt:
            chat.insert(0, {"role": "system", "content": data_cfg.system_prompt})
        chats.append(chat)
    return chats


# Chats tokenized at once: only their lengths are kept, so memory stays that of one block, whatever the data's size
# (#30.19: a 200,000-row jsonl held every token id as a Python int, ~50x the file, 14.8 GB).
LENGTH_BLOCK = 1024
# From this many rows on, counting tokens shows a progress bar (on stderr).
PROGRESS_ROWS = 20_000


def token_lengths(chats: list[list[dict[str, str]]], tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of each whole rendered chat, and of its prompt (everything before the answer), counted a block of
    chats at a time; a long count shows its progress."""
    full = np.zeros(len(chats), dtype=np.int64)
    prompts = np.zeros(len(chats), dtype=np.int64)
    bar = None
    if len(chats) >= PROGRESS_ROWS:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chats), desc="counting tokens", unit="row", leave=False)
    for start in range(0, len(chats), LENGTH_BLOCK):
        block = chats[start : start + LENGTH_BLOCK]
        ids = tokenizer.apply_chat_template(block, tokenize=True, return_dict=False)
        full[start : start + len(block)] = [len(x) for x in ids]
        ids = tokenizer.apply_chat_template(
            [c[:-1] for c in block], tokenize=True, add_generation_prompt=True, return_dict=False
        )
        prompts[start : start + len(block)] = [len(x) for x in ids]
        del ids
        if bar is not None:
            bar.update(len(block))
    if bar is not None:
        bar.close()
    return full, prompts


def chat_lengths(blocks: Iterable[pd.DataFrame], data_cfg: Any, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """`token_lengths` of every row of the data, its blocks (src/tables.py `read_blocks`) read and counted one at a
    time: memory stays that of one block, whatever the data's size."""
    counted = [token_lengths(to_messages(block, data_cfg), tokenizer) for block in blocks]
    if not counted:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate([c[0] for c in counted]), np.concatenate([c[1] for c in counted])


def truncation(full: np.ndarray, prompt: np.ndarray, max_seq_length: int) -> dict[str, float]:
    """What `max_seq_length` cuts from the data, as shares of its rows. trl keeps a row's start, so the answer at its
    end is what is cut: `truncated_answer_frac` (answers that lose tokens: what preflight.max_truncated_answer_frac
    limits) equals `truncated_row_frac` (rows cut at all); `truncated_answer_lost_frac`: answers cut whole."""
    if len(full) == 0:
        return {"truncated_row_frac": 0.0, "truncated_answer_frac": 0.0, "truncated_answer_lost_frac": 0.0}
    over = full > max_seq_length
    return {
        "truncated_row_frac": float(over.mean()),
        "truncated_answer_frac": float(over.mean()),
        "truncated_answer_lost_frac": float((over & (prompt >= max_seq_length)).mean()),
    }


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    if len(lengths) == 0:
        return {}
    return {
        "tokens_min": float(lengths.min()),
        "tokens_median": float(np.median(lengths)),
        "tokens_p95": float(np.percentile(lengths, 95)),
        "tokens_max": float(lengths.max()),
    }


def probe_rows(lengths: np.ndarray, n_rows: int, batch: int, seed: int, pack_to: int | None = None) -> np.ndarray:
    """Indices of the rows a short run trains on: the `batch` longest rows plus a seeded random rest.

    A probe sees only a few batches. Padding makes every batch as long as its longest row, so holding the
    longest rows guarantees the probe meets the data set's longest (padded) batch, and with it the peak a
    full epoch would reach. With group_by_length the sampler also puts that batch first.

    With packing (`pack_to` = max_seq_length) a batch holds `batch` packed rows, each as full as the data
    allows, and its size is what was packed into it, not its longest row: the probe then takes rows until
    they hold `n_rows` full packed rows' worth of tokens, so that its bins fill as a whole epoch's would, and trains
    the fullest bins first (`fullest_first`).
    """
    if n_rows >= len(lengths) and pack_to is None:
        return np.arange(len(lengths))
    longest = np.argsort(-lengths, kind="stable")[:batch]
    rest = np.setdiff1d(np.arange(len(lengths)), longest)
    rng = np.random.default_rng(seed)
    if pack_to is not None:
        order = np.concatenate([longest, rng.permutation(rest)])
        filled = np.cumsum(np.minimum(lengths[order], pack_to))
        take = int(np.searchsorted(filled, n_rows * pack_to)) + 1
        return np.sort(order[:take])
    picked = rng.choice(rest, size=n_rows - len(longest), replace=False)
    return np.sort(np.concatenate([longest, picked]))


def fullest_first(dataset: Any) -> Any:
    """A packed probe's bins, the fullest first (trained in this order: `train_sampling_strategy="sequential"`).

    A packed batch is as large as what was packed into its `batch` bins, and the bins are not equally full: best-fit
    packing leaves its last few part-empty. transformers' samplers do not put the fullest bins first (random order;
    group_by_length only puts the single longest bin's batch first, with random companions on a probe's few bins), so
    a one-step probe of packed 4096 x 4 met 12,678 tokens where its second step met 16,308 and measured 16% less than
    the setting's peak (benchmarks/results/memory_model_crosscheck.json, NOTES §17c). Fullest first, a probe's first
    step holds the largest batch the data packs to, as a padded probe's holds its longest rows."""
    sizes = np.array([len(ids) for ids in dataset["input_ids"]])
    return dataset.select(np.argsort(-sizes, kind="stable").tolist())


# ---- the shipped sample sets -------------------------------------------------------------------------

FINDINGS = [
    ("chest pain", "chest"),
    ("shortness of breath", "lungs"),
    ("headache", "head"),
    ("abdominal pain", "abdomen"),
    ("lower back pain", "lumbar spine"),
    ("rash", "skin"),
    ("swelling", "left ankle"),
    ("fever", None),
    ("cough", "lungs"),
    ("dizziness", None),
    ("nausea", "abdomen"),
    ("palpitations", "heart"),
    ("joint stiffness", "right knee"),
    ("blurred vision", "eyes"),
    ("numbness", "left hand"),
    ("wheezing", "lungs"),
    ("sore throat", "throat"),
    ("fatigue", None),
    ("edema", "both legs"),
    ("tenderness", "right lower quadrant"),
]
SEVERITY = ["mild", "moderate", "severe"]
OPENERS = [
    "Patient reports {sev} {f}{site}.",
    "Patient denies {f}{site}.",
    "Complains of {sev} {f}{site} since {when}.",
    "No evidence of {f}{site} on examination.",
    "{Sev} {f}{site} noted during the visit.",
    "History of {sev} {f}{site}, worse at night.",
    "Reports intermittent {f}{site} for {when}.",
]
WHEN = ["yesterday", "two days", "a week", "three weeks", "this morning", "several months"]
CONTEXT = [
    "Vital signs are within normal limits.",
    "The patient is afebrile and alert.",
    "Medication list was reviewed with the patient.",
    "Follow-up is scheduled in two weeks.",
    "Laboratory results are pending.",
    "The patient was advised to return if symptoms worsen.",
    "Past medical history includes hypertension and type 2 diabetes.",
    "No known drug allergies.",
    "Imaging of the area was ordered.",
    "Pain is rated six out of ten.",
]


def _sentence(rng: random.Random) -> tuple[str, dict[str, Any]]:
    finding, site = rng.choice(FINDINGS)
    sev = rng.choice(SEVERITY)
    template = rng.choice(OPENERS)
    negated = "denies" in template or "No evidence" in template
    text = template.format(
        f=finding, sev=sev, Sev=sev.capitalize(), site=f" in the {site}" if site else "", when=rng.choice(WHEN)
    )
    answer = {"finding": finding, "body_site": site, "severity": None if negated else sev, "negated": negated}
    return text, answer


def make_sample(n: int = 400, seed: int = 0) -> pd.DataFrame:
    """Short clinical-style sentences with JSON answers: the seed's spreadsheet, in miniature."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text, answer = _sentence(rng)
        if rng.random() < 0.3:
            text = f"{text} {rng.choice(CONTEXT)}"
        rows.append({"Sentence": text, "Description": json.dumps(answer)})
    return pd.DataFrame(rows)


def make_notes(n: int = 300, seed: int = 1) -> pd.DataFrame:
    """Multi-sentence notes with a long tail (log-normal sentence counts): some pass 2048 tokens."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    rows = []
    for k in np.clip(nrng.lognormal(mean=3.2, sigma=0.9, size=n), 2, 400).astype(int):
        parts, answers = [], []
        for _ in range(k):
            if rng.random() < 0.35:
                text, answer = _sentence(rng)
                parts.append(text)
                answers.append(answer)
            else:
                parts.append(rng.choice(CONTEXT))
        rows.append({"note": " ".join(parts), "answer": json.dumps({"findings": answers[:20]})})
    return pd.DataFrame(rows)


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "data"
    out.mkdir(exist_ok=True)
    make_sample().to_excel(out / "clinical_sample.xlsx", index=False)
    make_notes().to_json(out / "clinical_notes.jsonl", orient="records", lines=True)
    print(f"wrote {out / 'clinical_sample.xlsx'} and {out / 'clinical_notes.jsonl'}")


if __name__ == "__main__":
    main()
