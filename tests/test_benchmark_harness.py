"""One harness for every benchmark (benchmarks/harness.py): a definition runs through `python -m benchmarks run`, its
result file is named by the card that measured it and records the card, the versions, the date and each command;
every definition's commands are the product's own and compose; every committed result file names its card truly and
is listed in benchmarks/README.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness
from src.config import PROJECT_DIR, compose

RESULTS = PROJECT_DIR / "benchmarks" / "results"
PRODUCT = {"src.train", "src.promote", "src.report", "src.same_model", "benchmarks.peer_arm", "benchmarks.ui_screenshot",
           "benchmarks.eager_attention_memory", "benchmarks.device_peak"}  # fmt: skip


@pytest.mark.slow(seconds=60)
def test_a_benchmark_runs_through_the_one_entry_point_into_a_file_named_by_its_card(root: Path) -> None:
    out = root / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "run", "smoke", "steps=3", "--out", str(out)],
                          cwd=PROJECT_DIR, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert [p.name for p in out.iterdir()] == ["smoke_cpu.json"], "<name>_<card>.json, nothing beside it"
    record = json.loads((out / "smoke_cpu.json").read_text())
    assert record["gpu"] == "none (cpu)" and record["card"] == "cpu" and record["versions"]["torch"]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", record["date"])
    assert record["command"] == f"python -m benchmarks run smoke steps=3 --out {out}" and record["vars"]["steps"] == "3"
    (row,) = record["rows"]
    assert record["commands"] == [row["command"]] and row["command"].startswith("python -m src.train model=tiny_llama")
    assert "trainer.max_steps=3" in row["command"] and row["exit_code"] == 0 and row["result"]["status"] == "ok"
    assert (root / "benchmarks" / "smoke" / "rows" / "tiny" / "result.json").exists(), "the benchmark's own QLORA_ROOT"
    tiny = record["summary"]["settings"]["tiny"]
    assert tiny["finished"] == 1 and tiny["rows_per_optimizer_step"] == 1
    assert tiny["tokens_per_s"]["median"] == pytest.approx(row["result"]["metrics"]["tokens_per_s"])


@pytest.mark.slow(seconds=120)
def test_the_production_resume_benchmark_restarts_a_faulted_run_and_says_what_it_cost(root: Path) -> None:
    """Issue 45's GPU benchmark, on the tiny Llama: its setting replaced, its summary read from the real ledger."""
    setting = "data.max_rows=12 trainer.bf16=false trainer.warmup_steps=0 trainer.save_steps=4"
    argv = ["run", "production_resume", f"setting={setting}", "steps=12", "fault_step=10", "--out", str(root / "out")]
    done = subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=PROJECT_DIR, capture_output=True, text=True,
                          timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    s = json.loads((root / "out" / "production_resume_cpu.json").read_text())["summary"]
    assert s["completed"] and s["restarts"] == 1 and s["failure"]["kind"] == "launch_failure"
    assert s["failure"]["step"] == 10 and s["resumed_from_step"] == 8 and len(s["attempts"]) == 2
    assert s["checkpoint_count"] >= 3 and s["lost_s"] is not None and s["lost_within_interval_plus_startup"]
    assert set(s["losses_around_resume"]) >= {"8", "9", "10"}, "the losses around the resume, step by step"


def test_every_definition_loads_runs_the_product_s_commands_and_its_trials_compose() -> None:
    from benchmarks import summaries

    names = sorted(p.stem for p in harness.SUITES.glob("*.yaml"))
    assert {"smoke", "production_resume", "journey", "same_model_speed", "memory_model_fresh3", "peers"} <= set(names)
    for name in names:
        suite = harness.load(name)
        assert suite.get("what"), name
        assert not suite.get("summary") or callable(getattr(summaries, suite["summary"])), name
        variables = {k: str(v) for k, v in (suite.get("vars") or {}).items()}
        run = harness.Run(name, suite, variables, Path("/r"), Path("/o") / f"{name}_h100.json", {"card": "h100"})
        groups = harness.plan(run)
        for item in (i for g in groups for i in g):
            assert item["argv"][0] in PRODUCT, f"{name}: {item['argv'][0]}"
            assert not any("${" in word for word in item["argv"]), f"{name}: a variable left unfilled"
        for group in groups:  # a trials block's first setting composes (a typo fails here, not on the GPU)
            argv = group[0]["argv"]
            if argv[0] == "src.train" and "-m" not in argv and "experiment=production" not in argv:
                compose([w for w in argv[1:] if not w.startswith(("hydra.", "checkpoint.dir="))])
    with pytest.raises(SystemExit, match="no benchmark 'nope'"):
        harness.load("nope")


def test_steps_marked_together_run_at_once_and_the_rest_one_after_another() -> None:
    suite = harness.load("same_model_gpu")
    variables = {k: str(v) for k, v in (suite.get("vars") or {}).items()}
    run = harness.Run("same_model_gpu", suite, variables, Path("/r"), Path("/o/x_h100.json"), {"card": "h100"})
    groups = harness.plan(run)
    assert [[i["name"] for i in g] for g in groups] == [["itself", "levers", "control"]]
    assert {i["slots"] for i in groups[0]} == {3}
    suite = {"steps": [{"name": "a", "run": "src.report x"}, {"name": "b", "run": "src.report y", "together": True},
                       {"name": "c", "run": "src.report z", "together": True}, {"name": "d", "run": "src.report w"}]}  # fmt: skip
    groups = harness.plan(harness.Run("t", suite, {}, Path("/r"), Path("/o/t_cpu.json")))
    assert [[i["name"] for i in g] for g in groups] == [["a"], ["b", "c"], ["d"]]
    assert [g[0]["slots"] for g in groups] == [1, 2, 1]


def test_the_card_s_short_name_is_the_one_in_file_names() -> None:
    assert harness.card_of("NVIDIA H100 80GB HBM3") == "h100" and harness.card_of("NVIDIA H200") == "h200"
    assert harness.card_of("NVIDIA A10G") == "a10g"
    assert harness.last_json('loading\n{\n  "passed": true\n}\n') == {"passed": True}
    assert harness.last_json("trial ok\n") is None


def misnamed(folder: Path) -> list[str]:
    """Result files whose name says a card (`_h100`, `_h200`) their `gpu` field does not name, or `_mixed` files
    that do not say which figures came from which card."""
    bad = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        gpu = data.get("gpu")
        gpu = gpu.get("gpu.name") if isinstance(gpu, dict) else gpu
        for card in re.findall(r"_(h100|h200)(?=[_.x])", path.name):
            if card.upper() not in str(gpu):
                bad.append(f"{path.name}: gpu {gpu!r}")
        if "_mixed" in path.name and not data.get("cards"):
            bad.append(f"{path.name}: no `cards`")
    return bad


def test_every_result_file_is_named_by_the_card_its_gpu_field_names() -> None:
    assert misnamed(RESULTS) == []


def test_every_result_file_is_indexed_in_the_benchmarks_readme() -> None:
    listed = (PROJECT_DIR / "benchmarks" / "README.md").read_text()
    missing = [p.name for p in RESULTS.iterdir() if f"`{p.name}{'/' if p.is_dir() else ''}`" not in listed]
    assert missing == [], "add a row for each (python -m benchmarks index prints them)"
