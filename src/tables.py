"""The data file read as a table (xlsx, csv, jsonl or parquet), a block of rows at a time: only the input and output
columns are kept, indexed by the row numbers a person sees in the sheet (the header is row 1), so whatever reads the
whole data set (preflight's lint, the sweep's token counts) holds one block of the file at once, not the file
(#30.19: a 300 MB jsonl read whole peaked at 14.8 GB). A long read shows a progress bar on stderr.

Each format streams as far as its library allows: a jsonl line by line, a csv in chunks (pandas), a parquet by
batches of its row groups (pyarrow), an xlsx row by row (openpyxl's read-only mode, cells converted as pandas
converts them); an old .xls only whole (xlrd reads the whole file).
"""

from __future__ import annotations

import codecs
import csv
import itertools
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from src.failures import DataError
from src.redact import redact_text

# A block: at most this many rows, and (where a row's size is known before it is parsed) about this many bytes.
BLOCK_ROWS = 4096
BLOCK_BYTES = 8 << 20
# A cell holds at most MAX_CELL_CHARS characters (about 250,000 tokens: past any model's context), a jsonl row or csv
# line MAX_ROW_BYTES; longer is refused, read no further (#47.16: one 100 MB cell took preflight to 16.8 GB, growing).
MAX_CELL_CHARS = 1 << 20
MAX_ROW_BYTES = 16 << 20
# A read that lasts longer than this shows its progress (tqdm's `delay`): the file's bytes or rows read so far.
PROGRESS_AFTER_S = 2.0
EXCEL = (".xlsx", ".xls")
FORMATS = "xlsx|csv|jsonl|parquet"

Advance = Callable[[int], None]  # the progress bar's update: bytes or rows read since the last call


def load_table(data_cfg: Any) -> pd.DataFrame:
    """Every row of the data file at once (its input and output columns); a missing file, unknown format or missing
    column names the key to fix. What trains needs every row; what only reads them takes `read_blocks`."""
    return pd.concat(list(read_blocks(data_cfg)))


def read_blocks(data_cfg: Any) -> Iterator[pd.DataFrame]:
    """The data file's rows, a block at a time: the input and output columns, indexed by the sheet's row numbers,
    `data.max_rows` honoured. The file, its format and its columns are checked at the call (DataError naming the key),
    before the first block is used; a file that turns out unreadable further on raises DataError when reached."""
    max_rows = data_cfg.get("max_rows")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        # 0 read as "no limit" and -1 as "all but the last row" (pandas' head)
        raise DataError(f"data.max_rows={max_rows}: must be at least 1 (or null: every row)")
    path = Path(data_cfg.path)
    if path.is_dir():
        raise DataError(_a_directory(path))
    if not path.is_file():
        raise DataError(f"data.path: file not found: {path} (set data.path=/path/to/file.{FORMATS})")
    suffix = path.suffix.lower()
    reader = _READERS.get(suffix)
    if reader is None:
        raise DataError(f"data.path: unsupported format '{path.suffix}' for {path}; use one of {sorted(_READERS)}")
    sheets = _sheet_names(path, data_cfg.sheet) if suffix in EXCEL else []
    bar = _progress(path, rows=suffix in (".parquet", *EXCEL))
    raw = _guarded(path, reader(path, data_cfg.sheet, bar.update, lambda total: setattr(bar, "total", total)))
    try:
        first = next(raw)  # every reader yields at least one block, empty where the file has no row
        for key in ("input_column", "output_column"):
            if data_cfg[key] not in first.columns:  # the name is the user's: a token there is not repeated
                raise DataError(redact_text(_missing_column(data_cfg, key, path, list(first.columns), sheets)))
    except BaseException:
        bar.close()
        raise
    return _numbered(first, raw, data_cfg, max_rows, bar)


def _numbered(
    first: pd.DataFrame, raw: Iterator[pd.DataFrame], data_cfg: Any, max_rows: int | None, bar: Any
) -> Iterator[pd.DataFrame]:
    columns = list(dict.fromkeys([data_cfg.input_column, data_cfg.output_column]))
    done = 0
    try:
        for block in itertools.chain([first], raw):
            if max_rows is not None:
                block = block.iloc[: max_rows - done]
            block = block.loc[:, columns]
            lines = block.index if block.index.name == "line" else None  # a jsonl's: its rows' lines
            # Row numbers as a person sees them in the sheet (header is row 1).
            block.index = pd.RangeIndex(done + 2, done + 2 + len(block), name="row")
            _check_cells(block, lines, Path(data_cfg.path))
            done += len(block)
            if len(block) or done == 0:  # an empty file still gives one (empty) block with its columns
                yield block
            if max_rows is not None and done >= max_rows:
                return
    finally:
        raw.close()  # the file, at once (a max_rows read stops early)
        bar.close()


def _check_cells(block: pd.DataFrame, lines: pd.Index | None, path: Path) -> None:
    """A cell longer than MAX_CELL_CHARS is refused before anything tokenizes it (a JSON value by its text)."""
    for column in block.columns:
        sizes = block[column].map(lambda v: len(v if isinstance(v, str) else _json_text(v))).to_numpy()
        if len(sizes) and sizes[at := int(sizes.argmax())] > MAX_CELL_CHARS:
            row = block.index[at]
            where = f"line {lines[at]} of {path.name} (row {row})" if lines is not None else f"row {row} of {path.name}"
            what = f"a cell of {sizes[at]:,} characters, over the limit of {MAX_CELL_CHARS:,} (~250,000 tokens)"
            raise DataError(_too_long(where, column, what))


def _json_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else ""


def _too_long(where: str, column: str | None, what: str = f"a row over the limit of {MAX_ROW_BYTES >> 20} MiB") -> str:
    cell = f", column '{column}'" if column is not None else ""
    return f"data.path: {where}{cell}: {what}, past any model's context; shorten or drop the row"


def _guarded(path: Path, blocks: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
    """A reader's blocks, its errors as DataError: a file that is not UTF-8 says where and how to re-save it; a
    corrupt file is a data problem, whatever the parser raised."""
    try:
        yield from blocks
    except DataError:
        raise
    except UnicodeDecodeError as exc:
        raise DataError(not_utf8(path, exc)) from None
    except Exception as exc:
        raise DataError(f"data.path: cannot read {path}: {exc}") from exc


# ---- one reader per format: (path, sheet, advance, set_total) -> blocks, at least one ----------------------------


def _jsonl(path: Path, sheet: Any, advance: Advance, set_total: Advance) -> Iterator[pd.DataFrame]:
    """One JSON object per line, read line by line (none past MAX_ROW_BYTES). A line that is not one is named by its
    number, as an editor shows it. A JSON null is a missing cell; the text "null" is text."""
    set_total(path.stat().st_size)
    records: list[tuple[int, dict[str, Any]]] = []  # (line, record)
    size = kept = 0
    yielded = False
    decoder = codecs.getincrementaldecoder("utf-8")()
    with path.open("rb") as lines:
        for number, raw in enumerate(iter(lambda: lines.readline(MAX_ROW_BYTES + 1), b""), start=1):
            advance(len(raw))
            if len(raw) > MAX_ROW_BYTES:
                raise DataError(
                    _too_long(f"line {number} of {path.name} (row {kept + len(records) + 2})", _cut_key(raw))
                )
            line = decoder.decode(raw)
            if not line.strip():
                continue
            records.append((number, _record(line, number, path)))
            size += len(raw)
            if len(records) >= BLOCK_ROWS or size >= BLOCK_BYTES:
                yield _frame(records)
                kept += len(records)
                records, size, yielded = [], 0, True
        decoder.decode(b"", final=True)
    if records or not yielded:
        yield _frame(records)


def _cut_key(head: bytes) -> str | None:
    """The top-level key whose value runs past `head`, a line's first bytes; None where none can be told. Read by its
    strings (whole), brackets and colons; a lone quote opens the string `head` cuts short."""
    depth, key, previous = 0, None, b""
    for token in (m[0] for m in re.finditer(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[{}\[\]:]|"', head, re.DOTALL)):
        if token == b'"':
            break
        depth += (token in (b"{", b"[")) - (token in (b"}", b"]"))
        if token == b":" and depth == 1 and previous.startswith(b'"'):
            key = previous
        previous = token
    return json.loads(key.decode("utf-8", errors="replace")) if key is not None else None


def _record(line: str, number: int, path: Path) -> dict[str, Any]:
    where = f"data.path: line {number} of {path.name}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where} is not valid JSON ({exc.msg}, column {exc.colno}): {_quoted(line)}") from None
    if not isinstance(record, dict):
        kind = _JSON_TYPES.get(type(record), type(record).__name__)
        raise DataError(f"{where} is a JSON {kind}, not an object of column: value: {_quoted(line)}")
    return record


def _quoted(line: str) -> str:
    """A line's start, as an error quotes it: redacted before it is cut (a token cut short is known by no shape)."""
    return redact_text(line.strip()[:4096])[:120]


_JSON_TYPES = {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _frame(records: list[tuple[int, dict[str, Any]]]) -> pd.DataFrame:
    """A block of records, indexed by their lines; values as parsed (a column's type is not guessed per block)."""
    columns = list(dict.fromkeys(k for _, r in records for k in r))
    rows = [[r.get(k) for k in columns] for _, r in records]
    return pd.DataFrame(rows, columns=columns, dtype=object, index=pd.Index([n for n, _ in records], name="line"))


def _csv(path: Path, sheet: Any, advance: Advance, set_total: Advance) -> Iterator[pd.DataFrame]:
    """In chunks of rows, sized from the first MiB's lines to about BLOCK_BYTES. Cells are read as text, as written:
    `NA`, `null` or `None` in a cell is a sentence or an answer, not a missing value."""
    size = path.stat().st_size
    set_total(size)
    with path.open("rb") as f:
        head = f.read(1 << 20)
        f.seek(0)
        per_row = max(1, len(head) // max(1, head.count(b"\n")))
        rows = max(1, min(BLOCK_ROWS, BLOCK_BYTES // per_row))
        seen = 0
        lines = _Lines(f, path)
        chunks = pd.read_csv(lines, dtype=str, keep_default_na=False, na_filter=False, chunksize=rows, encoding="utf-8")
        with chunks:
            yielded = False
            for chunk in chunks:
                at = min(f.tell(), size)
                advance(at - seen)
                seen = at
                yield chunk
                yielded = True
    if not yielded:  # a header and no row
        yield pd.read_csv(path, dtype=str, nrows=0, encoding="utf-8")


class _Lines:
    """A csv file as pandas reads it (a MiB at a time), refused at its first line longer than MAX_ROW_BYTES: pandas
    reads a field whole, whatever its size. A quoted cell that spans lines is refused once read, by its length."""

    mode = "rb"  # pandas reads it as the binary file it is

    def __init__(self, f: Any, path: Path) -> None:
        self.f, self.path, self.line, self.run, self.head = f, path, 1, 0, b""

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(min(n, 1 << 20) if n >= 0 else 1 << 20)
        end = data.find(b"\n")
        self.run += len(data) if end < 0 else end
        self.head += data[: max(0, min(1 << 16, self.run) - len(self.head))]  # the line's start, to name the column
        if self.run > MAX_ROW_BYTES:
            raise DataError(_too_long(f"line {self.line} of {self.path.name}", self._column()))
        if end >= 0:  # a new line begins after the chunk's last line break
            self.line += data.count(b"\n")
            last = data.rfind(b"\n")
            self.run, self.head = len(data) - last - 1, data[last + 1 :][: 1 << 16]
        return data

    def _column(self) -> str | None:
        """The column the long line's start has reached, by the header's name (none for the header itself)."""
        with self.path.open(encoding="utf-8", errors="replace", newline="") as f:
            header = next(csv.reader([f.readline(MAX_ROW_BYTES)]), []) if self.line > 1 else []
        fields = next(csv.reader([self.head.decode("utf-8", errors="replace")]), [])
        return header[len(fields) - 1] if 0 < len(fields) <= len(header) else None


def _parquet(path: Path, sheet: Any, advance: Advance, set_total: Advance) -> Iterator[pd.DataFrame]:
    """Batches of its row groups (pyarrow), of about BLOCK_BYTES uncompressed."""
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as book:
        meta = book.metadata
        set_total(meta.num_rows)
        groups = [meta.row_group(i) for i in range(meta.num_row_groups)]
        per_row = max((g.total_byte_size / max(1, g.num_rows) for g in groups), default=1.0)
        rows = int(max(1, min(BLOCK_ROWS, BLOCK_BYTES // max(1.0, per_row))))
        yielded = False
        for batch in book.iter_batches(batch_size=rows):
            advance(batch.num_rows)
            yield batch.to_pandas()
            yielded = True
        if not yielded:
            yield book.schema_arrow.empty_table().to_pandas()


def _excel(path: Path, sheet: Any, advance: Advance, set_total: Advance) -> Iterator[pd.DataFrame]:
    """Row by row through openpyxl's read-only mode, each cell converted as pandas' read_excel(dtype=str,
    na_filter=False) converts it (checked against pandas 3.1 in tests): empty cells are empty text, whole numbers
    lose their `.0`, trailing empty rows are dropped. An .xls is read whole (xlrd reads the whole file)."""
    if path.suffix.lower() == ".xls":
        whole = pd.read_excel(path, sheet_name=sheet or 0, dtype=str, na_filter=False)
        set_total(len(whole))
        for start in range(0, max(1, len(whole)), BLOCK_ROWS):
            advance(len(whole.iloc[start : start + BLOCK_ROWS]))
            yield whole.iloc[start : start + BLOCK_ROWS]
        return
    import openpyxl

    book = openpyxl.load_workbook(path, read_only=True, data_only=True, keep_links=False)
    try:
        ws = book[sheet] if sheet is not None else book.worksheets[0]
        set_total(max(0, (ws.max_row or 1) - 1))
        ws.reset_dimensions()  # as pandas does: some writers record the sheet's size wrong
        rows = ws.iter_rows()
        header = [_excel_cell(c) for c in next(rows, ())]
        while header and header[-1] == "":
            header.pop()
        names = _column_names(header)
        block: list[list[Any]] = []
        empty_run = 0  # empty rows not yet kept: kept once a row with data follows, dropped at the end
        for cells in rows:
            advance(1)
            values = [_excel_cell(c) for c in cells[: len(names)]]
            if not any(v != "" for v in values) and all(c.value is None for c in cells[len(names) :]):
                empty_run += 1
                continue
            block += [[""] * len(names)] * empty_run + [values + [""] * (len(names) - len(values))]
            empty_run = 0
            while len(block) >= BLOCK_ROWS:
                yield pd.DataFrame(block[:BLOCK_ROWS], columns=names, dtype=object)
                block = block[BLOCK_ROWS:]
        yield pd.DataFrame(block, columns=names, dtype=object)
    finally:
        book.close()


def _excel_cell(cell: Any) -> Any:
    """pandas' conversion (io/excel/_openpyxl.py `_convert_cell`), then dtype=str's: a number that is whole is an
    int, an error cell (#N/A) is missing, anything else its text."""
    value = cell.value
    if value is None:
        return ""
    if cell.data_type == "e":
        return None
    if cell.data_type == "n":
        whole = int(value)
        value = whole if whole == value else float(value)
    return str(value)


def _column_names(header: list[Any]) -> list[str]:
    """The header's names as pandas makes them: an empty one `Unnamed: <i>`, a repeated one `name.1`, `name.2`."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for i, value in enumerate(header):
        name = value if value != "" else f"Unnamed: {i}"
        if name in seen:
            seen[name] += 1
            name = f"{name}.{seen[name]}"
        seen.setdefault(name, 0)
        names.append(name)
    return names


_READERS: dict[str, Callable[[Path, Any, Advance, Advance], Iterator[pd.DataFrame]]] = {
    ".xlsx": _excel,
    ".xls": _excel,
    ".csv": _csv,
    ".jsonl": _jsonl,
    ".parquet": _parquet,
}


def _progress(path: Path, rows: bool) -> Any:
    """A progress bar on stderr for a read that takes longer than PROGRESS_AFTER_S (tqdm's delay): bytes of a
    jsonl or csv, rows of a parquet or a sheet."""
    from tqdm.auto import tqdm

    unit = {"unit": "row"} if rows else {"unit": "B", "unit_scale": True, "unit_divisor": 1024}
    return tqdm(desc=f"reading {path.name}", delay=PROGRESS_AFTER_S, leave=False, file=sys.stderr, **unit)


def not_utf8(path: Path, exc: UnicodeDecodeError) -> str:
    """What a file that is not UTF-8 gets: where its first byte that is not (line as an editor counts, byte offset
    in the file), and how to re-save it. The file is read again in blocks to find it: the parser's own position is
    one of its buffer's."""
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


def _a_directory(path: Path) -> str:
    found = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in _READERS)
    if not found:
        kinds = [suffix.lstrip(".") for suffix in _READERS]
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
