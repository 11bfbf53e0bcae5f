"""Secrets in error text and in names (issue 47 #11), and one huge cell (#16).

A malformed data line is quoted in its error, and a key's value in a column's: whatever they quote passes the same
redaction as MLflow's, in every text a run writes (terminal, result.json, traceback.txt, train.log, MLflow tags);
an experiment named like a credential is refused before MLflow creates it. A cell too large to train on is refused
in seconds, naming the file, row, column and limit, without reading it whole."""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from src import redact, tables, tracking
from src.config import PROJECT_DIR
from src.failures import ConfigError, DataError
from tests.test_secrets import _start, written_without


def _letters(n: int) -> str:
    return "".join(random.choice(string.ascii_letters) for _ in range(n))


@pytest.fixture
def planted() -> dict[str, str]:
    """The issue's shapes: `hf_` and 34 letters, and passwords that look like nothing in particular."""
    return {"token": "hf_" + _letters(34), "bare": "Pw" + _letters(14), "quoted": "Qw" + _letters(14)}


def _malformed_line(planted: dict[str, str]) -> str:
    """A record cut off mid-file: a token and a `password=` in its text, then a `"password": "` value never closed."""
    return f'{{"input": "oops {planted["token"]} password={planted["bare"]}", "password": "{planted["quoted"]}\n'


def _data(path: Path) -> object:
    return OmegaConf.create(
        {"path": str(path), "input_column": "input", "output_column": "output", "sheet": None, "max_rows": None}
    )


def _clean(text: str, planted: dict[str, str]) -> None:
    for name, secret in planted.items():
        assert secret not in text, f"the {name} secret is in: {text}"


# ---- redaction keeps what it redacts readable -----------------------------------------------------------------


def test_redaction_of_json_text_leaves_valid_json_and_no_secret(planted: dict[str, str]) -> None:
    """run.json is written as redacted JSON text: a `password=` value ending at an escaped quote took the backslash
    with it, and the next read of run.json failed ('stall watch: JSONDecodeError', then a traceback on the
    terminal)."""
    record = {"message": _malformed_line(planted).strip(), "other": 'a \\"quoted\\" token=abc\\\\'}
    text = redact.redact_text(json.dumps(record, indent=2))
    back = json.loads(text)
    _clean(text, planted)
    assert back["message"].startswith('{"input": "oops *** password=***", "password": "***')


def test_an_unclosed_quoted_secret_is_redacted(planted: dict[str, str]) -> None:
    for text in (f'"password": "{planted["quoted"]}', f"{{'api_key': '{planted['quoted']}\nnext line"):
        assert planted["quoted"] not in redact.redact_text(text), text


def test_a_job_that_raises_is_written_redacted_by_hydra(planted: dict[str, str], capsys: pytest.CaptureFixture) -> None:
    """An exception that escapes the task: Hydra itself writes the overrides and the traceback to stderr, past the
    logging filter; the callback redacts both first."""
    import traceback

    from hydra.core.utils import JobReturn, JobStatus

    try:
        raise ValueError(f"no column {planted['token']}") from KeyError(f"password={planted['bare']}")
    except ValueError as exc:
        job = JobReturn(overrides=[f"data.input_column={planted['token']}"], status=JobStatus.FAILED)
        job.return_value = exc
    redact.RedactSecrets().on_job_end(None, job)
    with pytest.raises(ValueError) as raised:
        job.return_value  # noqa: B018 - what Hydra reads: it writes the overrides, then raises
    written = capsys.readouterr().err + "".join(traceback.format_exception(raised.value))
    assert "Error executing job with overrides: ['data.input_column=***']" in written
    assert "no column ***" in written and "KeyError: 'password=***'" in written
    _clean(written, planted)


# ---- at the source: the data's errors, a trial's failure, an experiment's name ---------------------------------


def test_a_malformed_jsonl_line_is_quoted_redacted(tmp_path: Path, planted: dict[str, str]) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"input": "chest pain", "output": "{}"}) + "\n"
    path.write_text(good * 3 + _malformed_line(planted) + good)
    with pytest.raises(DataError) as refused:
        tables.load_table(_data(path))
    message = str(refused.value)
    assert message.startswith("data.path: line 4 of bad.jsonl is not valid JSON"), message
    assert "oops ***" in message
    _clean(message, planted)
    # A quote cut short never leaves the start of a token that redaction would no longer know by its shape.
    path.write_text(json.dumps({"input": "x" * 100 + " " + planted["token"]})[:-2] + "\n")
    with pytest.raises(DataError) as refused:
        tables.load_table(_data(path))
    assert "hf_" + planted["token"][3:8] not in str(refused.value)


def test_a_trials_failure_message_is_redacted_where_it_is_made(planted: dict[str, str]) -> None:
    from src.trial.single import failure_of

    failure = failure_of(DataError(f"column '{planted['token']}' not in x.jsonl, password={planted['bare']}"), None)
    assert failure.kind == "data_error" and "column '***'" in failure.message
    _clean(failure.message, planted)


def test_an_experiment_named_like_a_credential_is_refused_before_it_is_created(
    root: Path, planted: dict[str, str], mlflow_client: object
) -> None:
    artifacts = root / "mlruns" / "artifacts"
    with pytest.raises(ConfigError) as refused:
        tracking.experiment_id(planted["token"], str(artifacts))
    assert str(refused.value).startswith("tracking.experiment holds a Hugging Face token")
    _clean(str(refused.value), planted)
    assert [e.name for e in mlflow_client.search_experiments()] == ["Default"]
    assert not artifacts.exists()


# ---- end to end: the three single runs ----------------------------------------------------------------


@pytest.mark.slow(seconds=60)
def test_no_planted_secret_reaches_any_file_or_the_terminal(
    root: Path, planted: dict[str, str], mlflow_client: object
) -> None:
    """`python -m src.train` with a malformed jsonl holding a token and two passwords, with data.input_column=<a
    token>, and with tracking.experiment=<a token>: every byte under sweeps/ and mlruns/ (the SQLite store, the
    artifacts, result.json, traceback.txt, train.log, run.json) and both streams of each are searched."""
    mlflow_client.search_experiments()  # the store's schema once, before three processes open it at once
    good = "".join(json.dumps({"input": f"chest pain {i}", "output": "{}"}) + "\n" for i in range(8))
    bad, clean = root / "bad.jsonl", root / "good.jsonl"
    bad.write_text(good + _malformed_line(planted) + good)
    clean.write_text(good)
    common = ["model=tiny_llama", "trainer=probe", "trainer.max_steps=2", "data.output_column=output"]
    runs = {
        "malformed": [f"data.path={bad}", "data.input_column=input"],
        "column": [f"data.path={clean}", f"data.input_column={planted['token']}"],
        "experiment": [f"data.path={clean}", "data.input_column=input", f"tracking.experiment={planted['token']}"],
    }
    started = {
        name: _start(root, {}, *common, *extra, f"hydra.run.dir={root / 'sweeps' / 'single' / name}")
        for name, extra in runs.items()
    }
    out = {name: proc.communicate(timeout=300) for name, proc in started.items()}
    for name, proc in started.items():
        assert proc.returncode != 0, out[name][1][-3000:]
        assert "Traceback" not in out[name][1], out[name][1][-3000:]
        _clean(out[name][0] + out[name][1], planted)
    assert "line 9 of bad.jsonl is not valid JSON" in out["malformed"][1]
    assert "data.input_column holds a Hugging Face token" in out["column"][1], out["column"][1][-3000:]
    files = written_without(root, planted)
    assert any(p.name == "result.json" for p in files) and any(p.name == "traceback.txt" for p in files)
    # The experiment was refused before MLflow made it or its artifacts' folder.
    assert planted["token"] not in {e.name for e in mlflow_client.search_experiments()}
    assert not any(p.name.startswith("hf_") for p in (root / "mlruns").rglob("*"))


# ---- one huge cell (#16) ---------------------------------------------------------------------------------------

_READ = """
import json, re, sys, time
from omegaconf import OmegaConf
from src import tables
from src.failures import DataError

def status(key):  # kB
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10

cfg = OmegaConf.create({"path": sys.argv[1], "input_column": "input", "output_column": "output", "sheet": None,
                        "max_rows": None})
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here: the imports' own is not the read's
before, start = status("VmRSS"), time.perf_counter()
try:
    message = "read %d rows" % sum(len(block) for block in tables.read_blocks(cfg))
except DataError as exc:
    message = str(exc)
print(json.dumps({"message": message, "grew": status("VmHWM") - before, "s": time.perf_counter() - start}))
"""


def _read_apart(path: Path) -> dict:
    """read_blocks of `path` in a process of its own: its message, its peak memory over what it held before the
    read, its seconds."""
    done = subprocess.run(
        [sys.executable, "-c", _READ, str(path)], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _write_huge(path: Path, size: int) -> None:
    """Two ordinary rows, one whose input is `size` bytes of text, and one more."""
    row = {"input": "chest pain", "output": "{}"}
    cell = ("lorem ipsum " * (size // 12 + 1))[:size]
    with path.open("w") as f:
        if path.suffix == ".csv":
            f.write("input,output\nchest pain,{}\nchest pain,{}\n" + cell + ",{}\nchest pain,{}\n")
        else:
            for value in ("chest pain", "cough", cell, "fever"):
                f.write(json.dumps(row | {"input": value}) + "\n")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_huge_cell_is_refused_quickly_with_bounded_memory(tmp_path: Path, suffix: str) -> None:
    """A 48 MB cell: refused in a second or two, having read no more than the row limit of it (before: read whole,
    and preflight's tokenizer took a 100 MB cell to 16.8 GB in 150 s, still growing)."""
    path = tmp_path / f"huge{suffix}"
    _write_huge(path, 48 << 20)
    try:
        seen = _read_apart(path)
    finally:
        path.unlink()
    message = seen["message"]
    limit = f"{tables.MAX_ROW_BYTES >> 20} MiB"
    # A csv's row may span lines (a quoted cell): its line is named, as an editor shows it.
    where = "line 3 of huge.jsonl (row 4)" if suffix == ".jsonl" else "line 4 of huge.csv"
    assert message.startswith(f"data.path: {where}, column 'input': "), message
    assert limit in message and len(message.splitlines()) == 1
    assert seen["s"] < 5, seen
    assert seen["grew"] < 80 << 20, f"peak grew {seen['grew'] / 2**20:.0f} MiB reading a 48 MiB cell"


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_a_cell_over_the_cell_limit_is_refused_naming_row_and_column(tmp_path: Path, suffix: str) -> None:
    """A cell under the row limit but over the cell's: refused before anything tokenizes it. In a csv it spans lines
    (a quoted cell with line breaks), which no line limit sees."""
    import pandas as pd

    path = tmp_path / f"long{suffix}"
    long = ("a long note\n" if suffix == ".csv" else "a long note ") * (tables.MAX_CELL_CHARS // 12 + 1)
    frame = pd.DataFrame({"input": ["chest pain", "cough"], "output": ["{}", long]})
    if suffix == ".parquet":
        frame.to_parquet(path)
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_json(path, orient="records", lines=True)
    with pytest.raises(DataError) as refused:
        tables.load_table(_data(path))
    message = str(refused.value)
    where = "line 2 of long.jsonl (row 3)" if suffix == ".jsonl" else f"row 3 of long{suffix}"
    assert message.startswith(f"data.path: {where}, column 'output': a cell of {len(long):,} characters"), message
    assert f"{tables.MAX_CELL_CHARS:,}" in message and len(message.splitlines()) == 1


@pytest.mark.slow(seconds=40)
def test_preflight_refuses_a_huge_row_in_seconds_without_growing(root: Path) -> None:
    """The issue's command, `python -m src.preflight`, on a jsonl with a 40 MB row: refused in one line, at about
    the memory it takes on a small file (watched from outside, and stopped past 2 GiB more, as it was not)."""

    def preflight(path: Path) -> tuple[subprocess.CompletedProcess, int, float]:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "src.preflight", "model=tiny_llama", f"data.path={path}"]
            + ["data.input_column=input", "data.output_column=output", "data.system_prompt=''"],
            cwd=PROJECT_DIR,
            env={**os.environ, "QLORA_ROOT": str(root)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        peak, watched = 0, psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                peak = max(peak, watched.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if peak > small_peak + (2 << 30) or time.perf_counter() - start > 120:
                proc.kill()
            time.sleep(0.05)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), peak, time.perf_counter() - start

    small = root / "small.jsonl"
    _write_huge(small, 20)
    small_peak = 8 << 30
    done, small_peak, small_s = preflight(small)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    huge = root / "huge.jsonl"
    _write_huge(huge, 40 << 20)
    try:
        done, peak, seconds = preflight(huge)
    finally:
        huge.unlink()
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    (refused,) = [line for line in done.stdout.splitlines() if line.startswith("REFUSED: ")]
    assert "line 3 of huge.jsonl (row 4)" in refused and "column 'input'" in refused, refused
    assert seconds < small_s + 10, (seconds, small_s)
    assert peak < small_peak + (100 << 20), f"peak {peak / 2**20:.0f} MiB, on a small file {small_peak / 2**20:.0f}"
