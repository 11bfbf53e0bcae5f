"""Data files as users have them: one that is not UTF-8 is refused naming the file, the line and the byte, with how to
re-save it (#30.21); a large one is read a block of rows at a time, with bounded memory and a progress bar, to the
same rows as a whole read (#30.19)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.data import load_table
from src.failures import DataError


def _data(path: Path) -> dict:
    return OmegaConf.create(
        {"path": str(path), "input_column": "input", "output_column": "output", "sheet": None, "max_rows": None}
    )


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
@pytest.mark.parametrize("rows_before", [1, 40_000])  # the bad byte in the first block read, and past the first MiB
def test_a_latin1_file_is_refused_naming_the_file_line_and_byte_and_how_to_resave_it(
    tmp_path: Path, suffix: str, rows_before: int
) -> None:
    path = tmp_path / f"notes{suffix}"
    if suffix == ".csv":
        head, good, bad = b"input,output\n", b"chest pain,ok\n", "caf\xe9 au lait,ok\n".encode("latin-1")
    else:
        head, good, bad = (
            b"",
            b'{"input": "chest pain", "output": "ok"}\n',
            '{"input": "caf\xe9", "output": "ok"}\n'.encode("latin-1"),
        )
    data = head + good * rows_before + bad + good
    path.write_bytes(data)
    with pytest.raises(DataError) as refused:
        load_table(_data(path))
    message = str(refused.value)
    at = data.index(b"\xe9")
    line = data[:at].count(b"\n") + 1
    assert f"{path} is not UTF-8: line {line}, byte {at} (0xe9)" in message
    assert "re-save the file as UTF-8" in message and "iconv -f latin1 -t utf-8" in message
    assert "codec can't decode" not in message


def test_counting_the_tokens_of_a_large_data_set_keeps_memory_bounded_and_shows_progress(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Preflight counts every row's tokens: a block of chats at a time, keeping only the lengths, so its memory does
    not grow with the data (#30.19: a 300 MB jsonl peaked at 14.8 GB, ~50x the file, silently); a long count shows a
    progress bar. Python's own allocations (the token ids come back as Python lists) are traced; blocks and the
    progress threshold are made small so that a small data set has many blocks."""
    import tracemalloc

    from src import data
    from src.models import build_tokenizer

    monkeypatch.setattr(data, "LENGTH_BLOCK", 50, raising=False)
    monkeypatch.setattr(data, "PROGRESS_ROWS", 1000, raising=False)
    tokenizer = build_tokenizer()
    text = "chest pain radiating to the left arm, no fever, blood pressure 140 over 90 " * 3
    chats = [
        [{"role": "user", "content": f"{i} {text}"}, {"role": "assistant", "content": f'{{"n": {i}}}'}]
        for i in range(2000)
    ]
    one = data.token_lengths(chats[:1], tokenizer)[0][0]
    assert one > 50
    tracemalloc.start()
    full, prompt = data.token_lengths(chats, tokenizer)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens = int(full.sum())
    assert len(full) == len(prompt) == len(chats) and full[0] == one and (prompt < full).all()
    # every token id kept at once is at least 8 bytes a token (a list's slot; 64 measured, 17.7 MiB here); a block
    # at a time, ~2 (0.5 MiB)
    assert peak < 8 * tokens, f"peak {peak / 2**20:.1f} MiB for {tokens:,} tokens"
    assert "counting tokens" in capsys.readouterr().err


def _mixed_workbook(path: Path) -> None:
    """A sheet as people make them: numbers, whole and not, a date, a boolean, an error cell, empty cells and rows,
    a repeated and an empty header, trailing empty rows."""
    import datetime

    import openpyxl

    book = openpyxl.Workbook()
    sheet = book.active
    sheet.append(["input", "output", "extra", None, "input"])
    for row in (
        ["chest pain", 1, "x"],
        [2.5, 3.0, None],
        [True, datetime.datetime(2024, 1, 2, 3, 4), "z"],
        [None, None, None],
        ["#N/A", "NA", "null"],
        ["  padded ", 1e20, 7],
        [None, None, "only in a column nobody reads"],
        ["last", '{"a": 1}', None],
        [None, None, None],
        [None, None, None],
    ):
        sheet.append(row)
    book.save(path)


@pytest.mark.parametrize("suffix", [".xlsx", ".csv", ".jsonl", ".parquet"])
def test_reading_in_blocks_gives_the_rows_a_whole_read_gives(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of two rows, glued back: the same cells (as the chats will hold them) and the same sheet row numbers as
    pandas' own whole read of the file; data.max_rows stops inside a block."""
    import json

    import pandas as pd

    from src import tables
    from src.data import cell

    path = tmp_path / f"mixed{suffix}"
    frame = pd.DataFrame(
        {
            "input": ["chest pain", "NA", "", "two  words", None, "null", "last"],
            "output": ['{"a": 1}', "null", "None", "", "z", "1", "x"],
            "extra": [1, 2, 3, 4, 5, 6, 7],
        }
    )
    if suffix == ".xlsx":
        _mixed_workbook(path)
        whole = pd.read_excel(path, dtype=str, na_filter=False)
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
        whole = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    elif suffix == ".parquet":
        frame.to_parquet(path, row_group_size=3)
        whole = pd.read_parquet(path)
    else:
        records = [{k: v for k, v in r.items() if v != ""} for r in frame.to_dict("records")]  # a key left out
        path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 2 else "") for i, r in enumerate(records)))
        whole = pd.DataFrame.from_records([json.loads(line) for line in path.read_text().splitlines() if line])
    monkeypatch.setattr(tables, "BLOCK_ROWS", 2)
    blocks = list(tables.read_blocks(_data(path)))
    assert len(blocks) > 2 and all(len(b) <= 2 for b in blocks)
    read = pd.concat(blocks)
    assert list(read.index) == list(range(2, len(whole) + 2))
    for column in ("input", "output"):
        assert [cell(v) for v in read[column]] == [cell(v) for v in whole[column]], column
    first = load_table(OmegaConf.merge(_data(path), {"max_rows": 3}))
    assert list(first.index) == [2, 3, 4] and [cell(v) for v in first["input"]] == [cell(v) for v in whole["input"][:3]]


def test_preflight_finds_the_same_in_blocks_as_in_one_block(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Duplicates across blocks, empty cells, answers that are not JSON and the length statistics: the same findings
    on the same rows whether the file is read in blocks of 3 rows or in one."""
    import json

    from src import preflight, tables
    from tests.conftest import compose_cfg

    good = [(f"Patient {i} reports cough.", json.dumps({"finding": "cough", "n": i})) for i in range(10)]
    rows = [*good[:4], good[1], ("", "{}"), ("Reports rash.", "not json"), *good[4:], good[2], good[8]]
    path = root / "lint.jsonl"
    path.write_text("".join(json.dumps({"input": i, "output": o}) + "\n" for i, o in rows))
    cfg = compose_cfg(["model=tiny_llama", f"data.path={path}", "data.input_column=input", "data.output_column=output"])

    def findings() -> list[tuple[str, str, str, list[int]]]:
        report = preflight.Report()
        preflight.check_data(cfg, report)
        return [(f.check, f.severity, f.message, f.rows) for f in report.findings]

    whole = findings()
    monkeypatch.setattr(tables, "BLOCK_ROWS", 3)
    assert findings() == whole
    found = {check: rows for check, _, _, rows in whole}
    assert found["duplicates"] == [6, 15, 16] and found["empty_cells"] == [7] and found["json_output"] == [8]
    assert (
        "row 6 repeats row 3, row 15 repeats row 4, row 16 repeats row 13"
        in dict((c, m) for c, _, m, _ in whole)["duplicates"]
    )


def test_preflight_of_a_large_jsonl_reads_it_with_bounded_memory_and_shows_progress(
    root: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#30.19: preflight of a 300 MB jsonl read every record whole (14.8 GB at the peak, silently). Here an 8 MB jsonl
    whose rows carry a long column nobody trains on: the data lint holds one block of it at a time (blocks of 256 KiB
    here, 8 MiB by default), so Python's allocations peak far below the file's size, and the read shows its bar."""
    import json
    import tracemalloc

    from src import preflight, tables
    from src.preflight.data import load_tokenizer
    from tests.conftest import compose_cfg

    path = root / "large.jsonl"
    note = "chest pain radiating to the left arm, no fever, blood pressure 140 over 90. " * 50
    with path.open("w") as f:
        for i in range(2200):
            f.write(
                json.dumps({"input": f"Patient {i} reports cough.", "output": f'{{"n": {i}}}', "note": note}) + "\n"
            )
    size = path.stat().st_size
    assert size > 8e6
    cfg = compose_cfg(["model=tiny_llama", f"data.path={path}", "data.input_column=input", "data.output_column=output"])
    load_tokenizer(cfg)  # built before the measurement: not the data's memory
    monkeypatch.setattr(tables, "BLOCK_BYTES", 256 << 10)
    monkeypatch.setattr(tables, "PROGRESS_AFTER_S", 0.0)
    report = preflight.Report()
    tracemalloc.start()
    preflight.check_data(cfg, report)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert "2200 rows" in next(f.message for f in report.findings if f.check == "lengths")
    assert peak < size / 4, f"peak {peak / 2**20:.1f} MiB reading a {size / 2**20:.1f} MiB file"
    assert "reading large.jsonl" in capsys.readouterr().err
