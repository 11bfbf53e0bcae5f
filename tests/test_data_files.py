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
