"""The seed's data format, as chat messages rendered by the model's own template.

A table (xlsx, csv, jsonl or parquet) with an input column and an output column becomes system / user /
assistant messages. `python -m src.data` writes the shipped sample sets (deterministic).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from src.failures import DataError

# Cells are read as text, as written: `NA`, `null` or `None` in a cell is a sentence or an answer (`null` is valid
# JSON), not a missing value; only a cell with nothing in it is empty (preflight reports those).
READERS = {
    ".xlsx": lambda p, sheet: pd.read_excel(p, sheet_name=sheet or 0, dtype=str, na_filter=False),
    ".xls": lambda p, sheet: pd.read_excel(p, sheet_name=sheet or 0, dtype=str, na_filter=False),
    ".csv": lambda p, sheet: pd.read_csv(p, dtype=str, keep_default_na=False, na_filter=False),
    ".jsonl": lambda p, sheet: read_jsonl(p),
    ".parquet": lambda p, sheet: pd.read_parquet(p),
}
EXCEL = (".xlsx", ".xls")
FORMATS = "xlsx|csv|jsonl|parquet"


def load_table(data_cfg: Any) -> pd.DataFrame:
    """Read the data file; a missing file, unknown format or missing column names the key to fix."""
    max_rows = data_cfg.get("max_rows")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        # 0 read as "no limit" and -1 as "all but the last row" (pandas' head)
        raise DataError(f"data.max_rows={max_rows}: must be at least 1 (or null: every row)")
    path = Path(data_cfg.path)
    if path.is_dir():
        raise DataError(_a_directory(path))
    if not path.is_file():
        raise DataError(f"data.path: file not found: {path} (set data.path=/path/to/file.{FORMATS})")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"data.path: unsupported format '{path.suffix}' for {path}; use one of {sorted(READERS)}")
    sheets = _sheet_names(path, data_cfg.sheet) if path.suffix.lower() in EXCEL else []
    try:
        df = reader(path, data_cfg.sheet)
    except DataError:
        raise
    except UnicodeDecodeError as exc:
        raise DataError(not_utf8(path, exc)) from None
    except Exception as exc:  # a corrupt file is a data problem, whatever the parser raised
        raise DataError(f"data.path: cannot read {path}: {exc}") from exc
    for key in ("input_column", "output_column"):
        column = data_cfg[key]
        if column not in df.columns:
            raise DataError(_missing_column(data_cfg, key, path, list(df.columns), sheets))
    if data_cfg.max_rows:
        df = df.head(data_cfg.max_rows)
    # Row numbers as a person sees them in the sheet (header is row 1).
    df.index = pd.RangeIndex(2, len(df) + 2, name="row")
    return df


def not_utf8(path: Path, exc: UnicodeDecodeError) -> str:
    """What a file that is not UTF-8 gets: where its first byte that is not (line as an editor counts, byte offset
    in the file), and how to re-save it. The file is read again in blocks to find it: the parser's own position is
    one of its buffer's."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, line, shown = 0, 1, ""
    with path.open("rb") as f:
        while True:
            block = f.read(1 << 20)
            kept = len(decoder.getstate()[0])  # the previous block's unfinished character, decoded with this one
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as bad:
                at = offset - kept + bad.start
                line += block[: max(0, at - offset)].count(b"\n")
                offset = at
                f.seek(at)
                shown = f" (0x{f.read(1)[0]:02x})"
                break
            if not block:  # no byte it cannot read (not expected: the parser found one)
                offset = exc.start
                break
            offset += len(block)
            line += block.count(b"\n")
    spreadsheet = "a spreadsheet's Save As, CSV UTF-8, or " if path.suffix.lower() == ".csv" else ""
    return (
        f"data.path: {path} is not UTF-8: line {line}, byte {offset}{shown} is not a UTF-8 character ({exc.reason}); "
        f"re-save the file as UTF-8 ({spreadsheet}`iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}` "
        "for a Latin-1 / Windows file)"
    )


def read_jsonl(path: Path) -> pd.DataFrame:
    """One JSON object per line. A line that is not one is named by its number, as an editor shows it (pandas
    gives a byte position). A JSON null is a missing cell; the text "null" is text."""
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"data.path: line {number} of {path.name}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where} is not valid JSON ({exc.msg}, column {exc.colno}): {line.strip()[:120]}"
                ) from None
            if not isinstance(record, dict):
                kind = _JSON_TYPES.get(type(record), type(record).__name__)
                raise DataError(f"{where} is a JSON {kind}, not an object of column: value: {line.strip()[:120]}")
            records.append(record)
    return pd.DataFrame.from_records(records)


_JSON_TYPES = {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _a_directory(path: Path) -> str:
    found = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in READERS)
    if not found:
        kinds = [suffix.lstrip(".") for suffix in READERS]
        return (
            f"data.path: {path} is a directory with no {', '.join(kinds[:-1])} or {kinds[-1]} file in it; "
            f"set data.path=/path/to/file.{FORMATS}"
        )
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    return f"data.path: {path} is a directory, not a data file; it holds {shown}: set data.path={path / found[0]}"


def _sheet_names(path: Path, sheet: str | None) -> list[str]:
    """The workbook's sheets; a data.sheet that is not one of them is refused by name."""
    try:
        with pd.ExcelFile(path) as book:
            names = [str(n) for n in book.sheet_names]
    except Exception:  # unreadable: the reader's own error says why
        return []
    if sheet is not None and sheet not in names:
        listed = ", ".join(repr(n) for n in names)
        raise DataError(
            f"data.sheet: {path.name} has no sheet '{sheet}' (its sheets: {listed}); set data.sheet=<one of them>"
        )
    return names


def _missing_column(data_cfg: Any, key: str, path: Path, columns: list[str], sheets: list[str]) -> str:
    """A column that is not there; in a workbook, the sheets that do hold the columns."""
    column = data_cfg[key]
    if not sheets:
        return f"data.{key}: column '{column}' not in {path.name} (columns: {columns}); set data.{key}=<one of them>"
    read = data_cfg.sheet or sheets[0]
    where = f"sheet '{read}'" if data_cfg.sheet else f"the first sheet ('{read}')"
    wanted = {data_cfg.input_column, data_cfg.output_column}
    with pd.ExcelFile(path) as book:
        holding = [s for s in sheets if s != read and wanted <= set(book.parse(s, nrows=0).columns)]
    hint = (
        f"sheet '{holding[0]}' has both columns ('{data_cfg.input_column}', '{data_cfg.output_column}'): "
        f"set data.sheet={holding[0]}"
        if holding
        else f"no sheet holds both (sheets: {', '.join(repr(s) for s in sheets)}); set data.{key}=<one of them>"
        " or data.sheet=<the sheet with the data>"
    )
    return f"data.{key}: column '{column}' is not on {where} of {path.name} (its columns: {columns}); {hint}"


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
    they hold `n_rows` full packed rows' worth of tokens, so that its bins fill as a whole epoch's would.
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
