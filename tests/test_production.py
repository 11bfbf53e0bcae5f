"""A single run survives the crash the user came with: checkpoints committed whole, a fresh process from the last
one on the process's faults (not on the setting's), an exact resume, one MLflow run, the adapter kept.

Each run is the tiny Llama in fp32 on the CPU, 12 rows for 2 epochs of 6 optimizer steps (batch 1 x accumulation
2, group_by_length as the user's recipe), a checkpoint every 4 steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from src import checkpoints as ck
from src.trial.attempts import stop_reason
from tests.conftest import PROJECT_DIR, new_store, run_cli, run_main

RUN = [
    "data.max_rows=12",
    "trainer.num_train_epochs=2",
    "trainer.bf16=false",
    "trainer.warmup_steps=0",
    "trainer.save_steps=4",
]
STEPS, ROWS = 12, 12


def _folder(root: Path) -> Path:
    (folder,) = (root / "sweeps" / "runs").iterdir()
    return folder


def _ledger(root: Path) -> dict:
    return json.loads((_folder(root) / ck.LEDGER).read_text())


def _adapter(root: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(_folder(root) / ck.ADAPTER / "adapter_model.safetensors"))


def _run(client_root: Path):
    """The run's one MLflow run (every attempt records into it)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{client_root / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("qlora-trials")
    (run,) = client.search_runs([exp.experiment_id])
    return client, run


def _losses(client, run_id: str) -> dict[int, list[float]]:
    by_step: dict[int, list[float]] = {}
    for m in sorted(client.get_metric_history(run_id, "loss"), key=lambda m: (m.step, m.timestamp)):
        by_step.setdefault(m.step, []).append(m.value)
    return by_step


def _rows_exact(ledger: dict) -> None:
    """Every epoch trained each of the 12 rows once: none twice, none skipped."""
    rows = ledger["attempts"][-1]["rows"]
    assert rows["per_epoch"] == {"0": {"rows": ROWS, "distinct": ROWS}, "1": {"rows": ROWS, "distinct": ROWS}}
    assert (rows["repeated"], rows["skipped"]) == (0, 0)


@pytest.mark.slow(seconds=70)
def test_a_launch_failure_resumes_and_trains_what_an_uninterrupted_run_trains(tmp_path: Path, cache_dir: Path) -> None:
    env = {"QLORA_CACHE": str(cache_dir)}
    plain, faulted = tmp_path / "plain", tmp_path / "faulted"
    cmd = [sys.executable, "-m", "src.train", *RUN]
    base = subprocess.Popen(cmd, cwd=PROJECT_DIR, env={**os.environ, **env, "QLORA_ROOT": str(plain)})
    done = run_cli("src.train", *RUN, "fault=launch_failure", "fault.step=10", root=faulted, env=env)
    assert base.wait(timeout=600) == 0
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attempt 1 failed (launch_failure at step 10)" in done.stdout
    assert "continuing from" in done.stdout and "checkpoint-8" in done.stdout

    ledger = _ledger(faulted)
    first, second = ledger["attempts"]
    assert first["failure"]["kind"] == "launch_failure" and first["failure"]["step"] == 10
    assert second["resumed_from_step"] == 8 and second["status"] == "ok"
    _rows_exact(ledger)
    _rows_exact(_ledger(plain))

    # the same adapter as the run that never failed, bit for bit (<= 1e-6), and the same losses after the resume
    a, b = _adapter(plain), _adapter(faulted)
    assert a.keys() == b.keys()
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-6
    client, run = _run(faulted)
    plain_client, plain_run = _run(plain)
    resumed, uninterrupted = _losses(client, run.info.run_id), _losses(plain_client, plain_run.info.run_id)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed[9] == [uninterrupted[9][0]] * 2  # step 9: trained by both attempts, the same loss both times
    for step in range(1, STEPS + 1):
        assert resumed[step][-1] == pytest.approx(uninterrupted[step][0], abs=1e-6)

    # one MLflow run: both attempts, the restart, what it cost, the checkpoints, the adapter
    m, tags = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and tags["trial.status"] == "ok"
    assert m["restarts"] == 1 and m["checkpoint.count"] >= 3 and m["checkpoint.size_mib"] > 0
    assert m["lost_s"] > 0 and "checkpoint_overhead_frac" in m
    assert tags["attempt.1.failure.kind"] == "launch_failure" and tags["attempt.1.failure.step"] == "10"
    assert tags["attempt.2.resumed_from_step"] == "8" and tags["attempt.2.status"] == "ok"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"adapter", "run.json"} <= artifacts
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= {
        a.path for a in client.list_artifacts(run.info.run_id, "adapter")
    }


def _start_and_wait_for_the_hang(tmp_path: Path, cache_dir: Path, same: list[str]) -> subprocess.Popen:
    """The run started as its own session; returned once checkpoint-4 is committed and the attempt hangs at step 6."""
    env = {**os.environ, "QLORA_ROOT": str(tmp_path), "QLORA_CACHE": str(cache_dir)}
    run = subprocess.Popen(
        [sys.executable, "-m", "src.train", *same], cwd=PROJECT_DIR, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline:
        runs = tmp_path / "sweeps" / "runs"
        if runs.exists() and any(runs.iterdir()) and ck.last_checkpoint(_folder(tmp_path)) is not None:
            progress = list((tmp_path / "sweeps" / "single").glob("*/progress.json"))
            if progress and json.loads(progress[0].read_text()).get("step") == 5:
                return run
        time.sleep(0.5)
    run.kill()
    pytest.fail("the run never reached its hang at step 6")


@pytest.mark.slow(seconds=40)
def test_sigterm_of_the_run_is_recorded_and_the_same_command_continues(tmp_path: Path, cache_dir: Path) -> None:
    """A scheduler's preemption or a Ctrl-C: the supervisor (whose agent turns the signal into SignalException)
    stops the attempt, records the run as interrupted, and the same command continues it."""
    same = [*RUN, "fault=hang", "fault.step=6"]
    run = _start_and_wait_for_the_hang(tmp_path, cache_dir, same)
    os.kill(run.pid, signal.SIGTERM)
    assert run.wait(timeout=120) != 0
    ledger = _ledger(tmp_path)
    assert (
        ledger["attempts"][0]["failure"]["kind"] == "killed"
        and "interrupted" in ledger["attempts"][0]["failure"]["message"]
    )
    _, mlflow_run = _run(tmp_path)
    assert mlflow_run.info.status == "FAILED"  # recorded, not left RUNNING
    done = run_cli("src.train", *same, root=tmp_path, env={"QLORA_CACHE": str(cache_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert _ledger(tmp_path)["attempts"][1]["resumed_from_step"] == 4
    _, mlflow_run = _run(tmp_path)
    assert mlflow_run.info.status == "FINISHED" and "failure.kind" not in mlflow_run.data.tags


@pytest.mark.slow(seconds=50)
def test_sigkill_of_the_run_then_the_same_command_continues_from_the_last_checkpoint(
    tmp_path: Path, cache_dir: Path
) -> None:
    # The first attempt hangs at step 6, once checkpoint-4 is committed; the test then kills the whole run (every
    # process of it, as a machine that dies would). The same command again continues; its fault has fired already.
    same = [*RUN, "fault=hang", "fault.step=6"]
    run = _start_and_wait_for_the_hang(tmp_path, cache_dir, same)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait(timeout=30)

    done = run_cli("src.train", *same, root=tmp_path, env={"QLORA_CACHE": str(cache_dir)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "attempt 1 ended without a record" in done.stdout
    ledger = _ledger(tmp_path)
    first, second = ledger["attempts"]
    assert first["failure"]["kind"] == "killed"
    assert second["resumed_from_step"] == 4 and second["status"] == "ok"
    _rows_exact(ledger)
    client, mlflow_run = _run(tmp_path)  # still one run
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.metrics["restarts"] == 1

    # finished: the same command again trains nothing, and says how to start over
    again = run_cli("src.train", *same, root=tmp_path, env={"QLORA_CACHE": str(cache_dir)})
    assert again.returncode == 0 and "this run finished" in again.stdout and "checkpoint.resume=false" in again.stdout


@pytest.mark.slow(seconds=50)
def test_a_kill_during_a_save_leaves_the_previous_checkpoint_in_use_and_the_adapter_is_registered(
    tmp_path: Path, cache_dir: Path, empty_store: Path
) -> None:
    # promoted before: version 1 of the registry holds the setting (as src.promote registers a trial's run)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(new_store(tmp_path, empty_store))
    trial = client.create_run(client.create_experiment("study")).info.run_id
    client.create_registered_model("llama3-qlora")
    tags = {"study": "study", "trial": "3", "mlflow_run_id": trial, "tokens_per_s": "123"}
    client.create_model_version("llama3-qlora", f"runs:/{trial}", run_id=trial, tags=tags)
    client.set_registered_model_alias("llama3-qlora", "production", "1")

    done = run_cli(
        "src.train", *RUN, "fault=kill", "fault.during=save", "fault.step=8", "tracking.registered_version=1",
        root=tmp_path, env={"QLORA_CACHE": str(cache_dir)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ledger = _ledger(tmp_path)
    first, second = ledger["attempts"]
    assert first["failure"]["kind"] == "killed"
    assert 8 not in [c["step"] for c in ledger["checkpoints"] if c["at_s"] < first["ended"]]
    assert second["resumed_from_step"] == 4  # checkpoint-8 was staged, never committed
    _rows_exact(ledger)
    assert not (_folder(tmp_path) / ck.STAGING).exists()

    # the adapter it trained: version 2, beside the promoted setting's version 1, the alias on it
    adapter = client.get_model_version_by_alias("llama3-qlora", "production")
    run = client.get_run(ledger["run_id"])
    assert str(adapter.version) == "2" and adapter.source == f"runs:/{run.info.run_id}/adapter"
    assert adapter.tags["setting_version"] == "1" and adapter.tags["mlflow_run_id"] == trial
    assert run.data.tags["registry.version"] == "2"
    _generates_with(client, cache_dir)


def _generates_with(client, cache_dir: Path) -> None:
    """The README's way to use the production adapter: download it from the registry, load it on the base model
    with peft, answer one question."""
    import mlflow
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    version = client.get_model_version_by_alias("llama3-qlora", "production")
    local = mlflow.artifacts.download_artifacts(version.source, tracking_uri=client._tracking_client.tracking_uri)
    base = cache_dir / "tiny_llama"
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), local)
    chat = [{"role": "user", "content": "Mild swelling of the left ankle."}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


@pytest.mark.slow(seconds=40)
def test_an_oom_at_the_same_step_twice_stops_without_a_third_attempt(tmp_path: Path, cache_dir: Path) -> None:
    done = run_cli(
        "src.train", *RUN, "fault=oom", "fault.step=6", "fault.times=5", root=tmp_path,
        env={"QLORA_CACHE": str(cache_dir)},
    )  # fmt: skip
    assert done.returncode == 1
    ledger = _ledger(tmp_path)
    assert [a["failure"]["kind"] for a in ledger["attempts"]] == ["oom", "oom"]
    assert "oom at step 6 on two attempts" in done.stderr and "data.max_seq_length" in done.stderr
    _, run = _run(tmp_path)
    assert run.info.status == "FAILED" and run.data.tags["failure.kind"] == "oom" and run.data.metrics["restarts"] == 1


@pytest.mark.slow(seconds=30)
def test_a_full_disk_during_a_save_says_so_in_one_line_and_keeps_the_previous_checkpoint(
    tmp_path: Path, cache_dir: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills up) needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    # room for one checkpoint of the tiny model (~0.75 MB) and the run's ledger, not for a second beside it
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1100k", "tmpfs", str(disk)], check=False)
    if mounted.returncode != 0:
        pytest.skip("tmpfs could not be mounted here")
    try:
        done = run_cli(
            "src.train", *RUN, f"checkpoint.dir={disk / 'run'}", root=tmp_path, env={"QLORA_CACHE": str(cache_dir)}
        )
        assert done.returncode == 1
        said = [line for line in done.stderr.splitlines() if "no space left" in line]
        assert len(said) == 1, done.stderr[-3000:]
        assert "checkpoint-4 is kept" in said[0] and "checkpoint.dir" in said[0]
        assert "Traceback" not in done.stderr
        ledger = json.loads((disk / "run" / ck.LEDGER).read_text())
        assert len(ledger["attempts"]) == 1  # not restarted: the disk is as full the second time
        assert [p.name for p in ck.committed(disk / "run")] == ["checkpoint-4"]
        state = json.loads((disk / "run" / "checkpoint-4" / "trainer_state.json").read_text())
        assert state["global_step"] == 4
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_the_process_faults_restart_and_the_settings_stop() -> None:
    def fail(kind: str, step: int = 6, message: str = "boom") -> dict:
        return {"kind": kind, "step": step, "message": message}

    for kind in ("launch_failure", "illegal_memory_access", "device_assert", "segfault", "killed", "timeout"):
        assert stop_reason(fail(kind), [{"failure": fail(kind)}]) is None  # as often as max_restarts allows
    assert stop_reason(fail("oom"), []) is None  # once: fragmentation, or a neighbour on the card
    assert "on two attempts" in stop_reason(fail("oom"), [{"failure": fail("oom")}])
    assert stop_reason(fail("oom", step=7), [{"failure": fail("oom", step=6)}]) is None
    for kind in ("nan_loss", "data_error", "config_error"):
        assert stop_reason(fail(kind), []) is not None
    assert stop_reason(fail("other", message=str(ck.disk_full(Path("/nonexistent")).strerror)), []) is not None


def test_a_sweeps_probe_saves_nothing_and_a_runs_attempt_saves_whole_checkpoints(tmp_path: Path) -> None:
    from src.config import sft_kwargs
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["trainer=probe", f"trainer.output_dir={tmp_path / 'trainer'}"])
    assert sft_kwargs(cfg, use_cpu=True)["save_strategy"] == "no"
    run = sft_kwargs(cfg, use_cpu=True, staging_dir=tmp_path / ck.STAGING)
    assert run["output_dir"] == str(tmp_path / ck.STAGING) and run["save_only_model"] is False
    assert run["save_total_limit"] is None  # rotated by src/checkpoints.py once the new one is committed


def test_the_same_model_check_fails_twice_the_rows_without_training_and_a_run_that_trained_other_steps() -> None:
    """The check's verdicts that need no training. That batch 2 x accumulation 1 passes against batch 1 x
    accumulation 2 on the same rows, and that twice the learning rate fails, is trained for real where the check
    runs, in the sweep (tests/test_same_model_sweep.py)."""
    from src.same_model import Trace, check, compare

    common = ["trainer.bf16=false", "trainer.warmup_steps=0"]
    one_by_two = ["trainer.per_device_train_batch_size=1", "trainer.gradient_accumulation_steps=2"]
    # twice the rows per optimizer step: another optimisation, failed without training
    doubled = check(
        one_by_two, ["trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=2"], 4, common
    )
    assert not doubled["passed"] and "4 rows per optimizer step against the reference's 2" in doubled["why"]
    reference = Trace(2, {1: 2.0, 2: 1.5})
    assert not compare(reference, Trace(2))["passed"], "a run that trained no steps"
    assert not compare(reference, Trace(2, {1: 2.0}))["passed"], "a run that trained other steps"


def test_promotion_writes_only_its_own_files_and_refuses_a_secret_name(
    root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from src.promote import __main__ as promote

    config = root / "train.yaml"
    config.write_text("defaults:\n  - train_schema\n")  # the project's main config, say
    link = root / "link.yaml"
    link.symlink_to(config)
    for target in (config, link):
        with pytest.raises(SystemExit) as refused:
            run_main(promote.main, ["--experiment-file", str(target)], root, monkeypatch, capsys)
        assert refused.value.code == 2
    assert config.read_text() == "defaults:\n  - train_schema\n"
    token = "hf_" + "a1B2c3D4e5F6g7H8i9J0kLmNoPqRsTuVwX"
    with pytest.raises(SystemExit):
        run_main(promote.main, ["--registered-model", token], root, monkeypatch, capsys)
    assert token not in capsys.readouterr().err
    assert not (root / "mlruns").exists()  # refused before any store was opened
    # a file promotion wrote (its header) is replaced, and the one it replaces is kept beside it for review
    ours = root / "production.yaml"
    ours.write_text(
        "# @package _global_\n# Production settings, written by: python -m src.promote demo\nlora:\n  r: 8\n"
    )
    assert promote.not_ours(ours) is None
    promote._write(
        ours, "# @package _global_\n# Production settings, written by: python -m src.promote\nlora:\n  r: 4\n"
    )
    assert "r: 8" in (root / "production.yaml.prev").read_text() and "r: 4" in ours.read_text()


def test_make_demo_suggests_the_fresh_study_name_the_sweep_does(tmp_path: Path) -> None:
    """#47.8: run twice, the sweep said study_name=demo-2 and the Makefile STUDY=demo2."""
    from src.sweep.storage import StudyStore

    store = StudyStore(None, "demo", tmp_path / "sweeps" / "demo", "here", None)  # no storage yet: nothing taken
    said = subprocess.run(["make", "-n", "demo", "STUDY=demo"], cwd=PROJECT_DIR, capture_output=True, text=True)
    hint = next(line for line in said.stdout.splitlines() if "a fresh one" in line)
    assert f"make demo STUDY={store.fresh_name()} " in hint, hint


def test_what_a_failure_cost_counts_from_the_last_commit_even_for_a_death_without_a_word(tmp_path: Path) -> None:
    """A segfault 300 s after the attempt's last checkpoint: its entry has only what it wrote as it went (the start
    of its training) and what the supervisor saw (its end); the commit is the ledger's."""
    from src.trial.supervised import summary

    ledger = ck.Ledger(tmp_path)
    ledger.data["attempts"] = [
        {"attempt": 1, "launched": 0.0, "train_began": 60.0, "ended": 1000.0, "failure": {"kind": "segfault"}},
        {"attempt": 2, "launched": 1001.0, "train_began": 1041.0, "ended": 1500.0, "status": "ok"},
    ]
    ledger.data["checkpoints"] = [
        {"step": 100, "at_s": 700.0, "save_s": 2.0, "size_bytes": 2**20},
        {"step": 200, "at_s": 1400.0, "save_s": 2.0, "size_bytes": 2**20},
    ]
    m = summary(ledger)
    assert m["restarts"] == 1 and m["redone_s"] == 300.0 and m["lost_s"] == 340.0  # + the next start-up
    assert m["training_s"] == 940.0 + 459.0 and m["checkpoint_overhead_frac"] == pytest.approx(4.0 / 1399.0)


def test_experiment_production_before_any_promotion_says_where_the_file_comes_from(root: Path, tmp_path: Path) -> None:
    """Before any promotion, `experiment=production` silently trained the default recipe (the experiment group was
    optional): it is refused in one line that names the file and the command that writes it, and nothing is run."""
    from src.train import missing_experiment

    (tmp_path / "experiment").mkdir()
    assert missing_experiment(["experiment=production"], tmp_path) == (
        "experiment=production: conf/experiment/production.yaml does not exist yet; it is written by python -m "
        "src.promote <study> (the best soaked setting of a sweep)"
    )
    (tmp_path / "experiment" / "production.yaml").write_text("# @package _global_\n")
    assert missing_experiment(["trainer.max_steps=2", "experiment=production"], tmp_path) is None
    done = run_cli("src.train", "experiment=no_such_setting", "trainer.max_steps=2", root=root, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (
        2,
        "experiment=no_such_setting: conf/experiment/no_such_setting.yaml does not exist",
    )
    assert not (root / "sweeps").exists() and not (root / "mlruns").exists()
