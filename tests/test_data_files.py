"""Data files as users have them: one that is not UTF-8 is refused naming the file, the line and the byte, with how to
re-save it (#30.21)."""

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
