"""The stability map and promotion: one real sweep of the tiny Llama (three stable settings, an injected OOM, a
setting that cuts answers, a segfault) is classified trial by trial, drawn, logged to its parent run and
promoted, also by a reader that has only the study's two stores; hand-made studies cover the classes a CPU cannot produce (marginal headroom, allocator retries,
timeouts, skipped repeats) and the refusals."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import shutil
from pathlib import Path
from typing import Any

import mlflow.artifacts
import numpy as np
import optuna
import pytest
from matplotlib.image import imread
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from src import promote, report, tracking
from src.config import PROJECT_DIR, compose
from src.study import STALE_MESSAGE
from tests.conftest import new_store, run_cli, run_main, sweep_argv

STUDY = "map"
# Enqueued in this order, so trial number i is SETTINGS[i]; each has the outcome its comment says.
SETTINGS = [
    {"data.max_seq_length": 256, "lora.r": 8, "fault.kind": "none"},  # stable
    {"data.max_seq_length": 512, "lora.r": 4, "fault.kind": "none"},  # stable
    {"data.max_seq_length": 512, "lora.r": 8, "fault.kind": "none"},  # stable
    {"data.max_seq_length": 256, "lora.r": 4, "fault.kind": "oom"},  # failed: oom (the setting's: COMPLETE)
    {"data.max_seq_length": 128, "lora.r": 8, "fault.kind": "none"},  # stable, but cuts answers: never promoted
    {"data.max_seq_length": 512, "lora.r": 4, "fault.kind": "segfault"},  # failed: segfault (the process's: FAIL)
]
# How the sweep ran each trial, never carried into production: the probe, and the truncation policy it relaxed.
PROBE_KEYS = {"trainer.max_steps", "trainer.warmup_steps", "trainer.output_dir", "preflight.max_truncated_answer_frac"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def expected(setting: dict[str, Any]) -> tuple[str, str | None]:
    if setting["fault.kind"] != "none":
        return "failed", setting["fault.kind"]
    return "stable", None


# ---- the real sweep (module scope: ~45 s on two CPU slots) ----------------------------------------------------------


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, empty_store: Path) -> Path:
    """A QLORA_ROOT holding study `map` (six trials) and its report, made by the contract's commands."""
    root = tmp_path_factory.mktemp("report_promote")
    new_store(root, empty_store)  # the file MLflow's migrations make (~2.5 s of a fresh sweep's start-up): copied
    enqueue = ",".join("{" + ",".join(f"{k}:{v}" for k, v in s.items()) + "}" for s in SETTINGS)
    env = {"QLORA_CACHE": str(cache_dir)}
    done = run_cli(
        *sweep_argv(study=STUDY, fast=True),
        f"hydra.sweeper.n_trials={len(SETTINGS)}",
        f"hydra.sweeper.enqueue_trials=[{enqueue}]",
        "data.max_seq_length=choice(128,256,512)",
        "lora.r=choice(4,8)",
        "fault.kind=choice(none,oom,segfault)",
        "model=tiny_llama",
        "trainer.save_adapter=true",
        root=root,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # The report command's main in this process (tests/test_mlflow_view.py starts it as a user does).
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as shown:
        mp.setenv("QLORA_ROOT", str(root))
        assert report.main([]) == 0  # no study named: the latest (the only one)
    (root / "report_stdout.txt").write_text(shown.getvalue())
    return root


def _sweep(root: Path, margin: float | None = None) -> report.Sweep:
    return report.load(STUDY, root / "sweeps", margin=margin)


def _client(root: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")


def _registry(client: MlflowClient, name: str = "llama3-qlora") -> tuple[list[tuple[str, str]], str | None]:
    """(version, run id) of every version, and the version the production alias points at."""
    versions = sorted((v.version, v.run_id) for v in client.search_model_versions(f"name='{name}'"))
    try:
        return versions, client.get_registered_model(name).aliases.get("production")
    except MlflowException as e:  # no such model yet; an unreadable store still fails the test
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        return versions, None


@pytest.mark.slow
def test_every_trial_is_classified_by_what_it_did(swept: Path) -> None:
    sweep = _sweep(swept)
    assert [r.number for r in sweep.rows] == list(range(len(SETTINGS)))
    for row, setting in zip(sweep.rows, SETTINGS, strict=True):
        assert row.params == setting
        assert (row.verdict, row.failure_kind) == expected(setting), (row.number, row.detail)
    assert sweep.rows[3].detail == "oom at step 1"
    assert sweep.margin == pytest.approx(0.10)  # the sweep's own hydra.sweeper.headroom_margin
    # 128 tokens cut answers: the sweep measured the setting instead of refusing it, and recorded the share
    assert sweep.max_truncated_answer_frac == 0.0  # the policy the trials would have refused by
    assert [sweep.cuts_too_much(r) for r in sweep.rows] == [False, False, False, False, True, False]
    assert sweep.rows[4].metrics["truncated_answer_frac"] > 0 and sweep.rows[0].metrics["truncated_answer_frac"] == 0
    assert sweep.rows[0].recipe and not any(r.recipe for r in sweep.rows[1:])  # the first enqueued setting
    stdout = (swept / "report_stdout.txt").read_text()
    assert "6 trials, 4 stable, 0 marginal, 2 failed (1 oom, 1 segfault)" in stdout
    assert f"python -m src.promote {STUDY}" in stdout
    assert "what to change:\n- Your recipe (trial 0: max_seq_length 256, r 8, kind none) is stable: " in stdout


@pytest.mark.slow
def test_report_files_are_pictures_with_content_and_logged_to_the_parent_run(swept: Path) -> None:
    study_dir = swept / "sweeps" / STUDY
    md = (study_dir / "report.md").read_text()
    pictures = ["stability_map.png", "peak_vram.png", "tokens_per_s.png"]
    for name in pictures:
        assert f"]({name})" in md
        data = (study_dir / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        pixels = imread(study_dir / name)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 10, f"{name} is (nearly) one colour"
    sweep = _sweep(swept)
    client = _client(swept)
    logged = {Path(a.path).name for a in client.list_artifacts(sweep.parent_run_id, "report")}
    # the memory model predicted every trial (on a CPU, set against its memory budget): its picture is there too
    assert logged == {"report.md", "report.html", *pictures, "predicted_vs_measured.png"}
    tags = client.get_run(sweep.parent_run_id).data.tags
    assert (tags["report.stable"], tags["report.failed"], tags["report.best_trial"]) == (
        "4",
        "2",
        str(sweep.best().number),
    )
    assert tags["report.what_to_change"] == "\n".join(report.what_to_change(sweep))
    assert "## What to change\n\n- Your recipe (trial 0: " in md
    for row in sweep.rows:  # each trial's run can be filtered by its class in the MLflow UI
        assert client.get_run(row.run_id).data.tags["report.class"] == row.verdict


@pytest.mark.slow
def test_importances_say_which_knobs_move_the_metrics(swept: Path) -> None:
    sweep = _sweep(swept)
    speed = report.importance(sweep, "tokens_per_s", "maximize")
    assert speed.n_trials == 4
    assert set(speed.values) == {"data.max_seq_length", "lora.r"}  # fault.kind never varied among finished trials
    assert sum(speed.values.values()) == pytest.approx(1.0, abs=1e-6)
    assert speed.method.startswith("fANOVA")
    # on a CPU the peak is the trial process's memory under the budget (src/measure/memory.py): it is explained too
    memory = report.importance(sweep, "peak_vram_reserved_gib", "minimize")
    assert memory.n_trials == 4 and set(memory.values) == {"data.max_seq_length", "lora.r"}
    md = (swept / "sweeps" / STUDY / "report.md").read_text()
    assert "## Which knobs matter" in md and "How these were computed" in md and "| lora.r |" in md


# ---- promotion --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dry_run_changes_nothing(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    client = _client(swept)
    before = _registry(client)
    target = tmp_path / "production.yaml"
    argv = [STUDY, "--dry-run", "--allow-unsoaked", "--experiment-file", str(target)]
    code, out, err = run_main(promote.main, argv, swept, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert "would register llama3-qlora version" in out and "+# @package _global_" in out
    assert not target.exists()
    assert _registry(client) == before


@pytest.mark.slow
def test_promotion_registers_the_best_stable_trial_and_its_settings_compose(swept: Path, tmp_path: Path) -> None:
    sweep = _sweep(swept)
    best = sweep.best()
    assert best.number == max((0, 1, 2), key=lambda n: sweep.rows[n].metrics["tokens_per_s"])
    conf = tmp_path / "conf"  # a copy of the project's configs, so the repo's conf/ is never written
    shutil.copytree(PROJECT_DIR / "conf", conf)
    (conf / "experiment" / "production.yaml").unlink(missing_ok=True)
    target = conf / "experiment" / "production.yaml"
    client = _client(swept)
    done = run_cli("src.promote", STUDY, "--allow-unsoaked", "--experiment-file", str(target), root=swept)
    assert done.returncode == 0, done.stderr[-3000:]

    versions, production = _registry(client)
    version = client.get_model_version("llama3-qlora", production)
    assert version.run_id == best.run_id and version.source == f"runs:/{best.run_id}/adapter"
    assert version.tags["study"] == STUDY and version.tags["trial"] == str(best.number)
    assert float(version.tags["tokens_per_s"]) == pytest.approx(best.metrics["tokens_per_s"], rel=1e-3)
    assert {"peak_vram_reserved_gib", "vram_headroom_frac"} <= set(version.tags)
    assert {Path(a.path).name for a in client.list_artifacts(best.run_id, "config")} >= {"config.yaml"}

    text = target.read_text()
    assert text.startswith("# @package _global_\n")
    for needle in (f"study:      {STUDY}", f"trial:      {best.number}", best.run_id, f"version {production}"):
        assert needle in text
    cfg = compose(["experiment=production"], config_dir=conf)
    for key, value in best.params.items():
        assert OmegaConf.select(cfg, key) == value, key
    assert cfg.trainer.save_adapter is True and cfg.model.name == "tiny_llama"
    assert cfg.trainer.max_steps == -1  # the sweep's short probe is not a production setting
    measured = tracking.params(
        OmegaConf.to_container(OmegaConf.load(sweep.trial_dir(best.number) / ".hydra/config.yaml"))
    )
    composed = tracking.params(OmegaConf.to_container(cfg))
    differ = {k for k in measured.keys() | composed.keys() if measured.get(k) != composed.get(k)}
    # the one key that is not the trial's: the version a production run registers its adapter beside
    assert cfg.tracking.registered_version == int(production)
    assert differ - {"tracking.registered_version"} <= PROBE_KEYS, differ


@pytest.mark.slow
def test_report_and_promotion_need_only_the_storage_and_the_tracking_store(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The study's two stores copied elsewhere, away from its folder (no trial logs, no .hydra/ files, no sweeps/):
    the report and the promotion read everything from the Optuna storage and the trials' MLflow runs, and the
    experiment file still composes what the promoted trial ran."""
    root = tmp_path / "reader"  # a machine that only reads the stores: an empty QLORA_ROOT
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    shutil.copyfile(swept / "sweeps" / STUDY / "optuna.db", tmp_path / "elsewhere" / "optuna.db")
    shutil.copyfile(swept / "mlruns" / "mlflow.db", tmp_path / "elsewhere" / "mlflow.db")
    storage, store = (f"sqlite:///{tmp_path}/elsewhere/{name}.db" for name in ("optuna", "mlflow"))
    where = ["--storage", storage, "--tracking-uri", store]

    code, shown, err = run_main(report.main, [STUDY, *where], root, monkeypatch, capsys)
    assert code == 0, err[-4000:]
    sweep = report.load(STUDY, root / "sweeps", storage=storage, tracking_uri=store)
    assert [{k: r.params[k] for k in SETTINGS[0]} for r in sweep.rows] == SETTINGS
    assert [r.verdict for r in sweep.rows] == [expected(s)[0] for s in SETTINGS]
    best = sweep.best()
    # The command the report prints is the one that promotes: nothing was soaked (FAST_SWEEP), so it says so
    printed = next(line for line in shown.splitlines() if line.startswith("best stable: "))
    assert printed == f"best stable: trial {best.number}; promote it: python -m src.promote {STUDY} --allow-unsoaked"
    command = printed.split("promote it: ", 1)[1].split()
    assert command[:3] == ["python", "-m", "src.promote"]

    conf = tmp_path / "conf"  # a copy of the project's configs, so the repo's conf/ is never written
    shutil.copytree(PROJECT_DIR / "conf", conf)
    target = conf / "experiment" / "production.yaml"
    target.unlink(missing_ok=True)
    argv = [*command[3:], *where, "--experiment-file", str(target)]
    code, promoted, err = run_main(promote.main, argv, root, monkeypatch, capsys)
    assert code == 0, err[-4000:]
    # (this module's promotion test may have promoted the same trial in the store copied here already)
    assert f"trial {best.number} of study {STUDY}" in promoted
    assert MlflowClient(store).get_model_version_by_alias("llama3-qlora", "production").run_id == best.run_id
    cfg = compose(["experiment=production"], config_dir=conf)
    for key, value in best.params.items():
        assert OmegaConf.select(cfg, key) == value, key
    logged = mlflow.artifacts.download_artifacts(
        run_id=best.run_id, artifact_path="config/config.yaml", dst_path=str(tmp_path / "logged"), tracking_uri=store
    )
    measured = tracking.params(OmegaConf.to_container(OmegaConf.load(logged)))
    composed = tracking.params(OmegaConf.to_container(cfg))
    differ = {k for k in measured.keys() | composed.keys() if measured.get(k) != composed.get(k)}
    assert differ - {"tracking.registered_version"} <= PROBE_KEYS, differ
    assert not (root / "sweeps" / STUDY / "trials").exists()


@pytest.mark.slow
def test_a_setting_that_cuts_answers_is_never_promoted(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    before = _registry(_client(swept))
    target = tmp_path / "production.yaml"
    argv = [STUDY, "--trial", "4", "--experiment-file", str(target)]
    code, _, err = run_main(promote.main, argv, swept, monkeypatch, capsys)
    assert code == 1
    assert "trial 4 cuts" in err and "of the assistant answers at data.max_seq_length=128" in err
    assert "refused above preflight.max_truncated_answer_frac=0" in err
    assert not target.exists() and _registry(_client(swept)) == before


@pytest.mark.slow
def test_promoting_again_moves_the_alias_and_keeps_the_older_version(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QLORA_ROOT", str(swept))
    client = _client(swept)
    sweep = _sweep(swept)
    stable = [r for r in sweep.rows if r.verdict == "stable"]
    target = tmp_path / "production.yaml"
    promoted = []
    for row in stable[:2]:
        assert (
            promote.main([STUDY, "--trial", str(row.number), "--allow-unsoaked", "--experiment-file", str(target)]) == 0
        )
        versions, production = _registry(client)
        assert client.get_model_version("llama3-qlora", production).run_id == row.run_id
        assert f"trial:      {row.number}, chosen with --trial" in target.read_text()
        promoted.append(production)
    assert int(promoted[1]) == int(promoted[0]) + 1
    assert (promoted[0], stable[0].run_id) in versions  # the older version stays in the registry


@pytest.mark.slow
def test_two_promotions_at_once_register_the_run_once(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `python -m src.promote` at once (threads here), each reading the registry before the other registers:
    one registers the trial, the other finds the alias already on its run (#30.16: versions 4 and 5 of one run)."""
    import threading
    import time
    import traceback

    import src.promote.__main__ as promote_main

    monkeypatch.setenv("QLORA_ROOT", str(swept))
    client = _client(swept)
    stable = [r for r in _sweep(swept).rows if r.verdict == "stable"]
    first, row = stable[0], stable[1]  # both promotable (the "promoting again" test promotes them too)
    assert first.run_id != row.run_id
    # the alias on another trial first, whatever this module promoted before
    assert (
        promote.main(
            [STUDY, "--trial", str(first.number), "--allow-unsoaked", "--experiment-file", str(tmp_path / "0.yaml")]
        )
        == 0
    )
    before, _ = _registry(client)
    real = promote_main.registry_state

    def slow_state(*args: Any) -> Any:  # the other promotion gets to read the registry in the meantime
        state = real(*args)
        time.sleep(1.5)
        return state

    monkeypatch.setattr(promote_main, "registry_state", slow_state)
    argv = [STUDY, "--trial", str(row.number), "--allow-unsoaked"]
    codes: list[int | str] = []

    def promote_into(path: Path) -> None:
        try:
            codes.append(promote.main([*argv, "--experiment-file", str(path)]))
        except BaseException:  # said in the assertion below, not lost in a thread
            codes.append(traceback.format_exc())

    both = [threading.Thread(target=promote_into, args=(f,)) for f in (tmp_path / "a.yaml", tmp_path / "b.yaml")]
    for t in both:
        t.start()
    for t in both:
        t.join()
    assert codes == [0, 0], "\n".join(map(str, codes))
    after, production = _registry(client)
    new = [v for v in after if v not in before]
    assert [run for _, run in new] == [row.run_id], "one new version of the run, not two"
    assert client.get_model_version("llama3-qlora", production).run_id == row.run_id


@pytest.mark.slow
def test_no_qualifying_trial_changes_nothing_and_says_why(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    client = _client(swept)
    before = _registry(client)
    target = tmp_path / "production.yaml"
    argv = [STUDY, "--margin", "1", "--allow-unsoaked", "--experiment-file", str(target)]
    code, _, err = run_main(promote.main, argv, swept, monkeypatch, capsys)
    assert code == 1
    assert "no stable trial: 4 marginal (headroom < 100%), 2 failed (1 oom, 1 segfault)" in err
    assert not target.exists() and _registry(client) == before

    # a study where everything failed, in a storage of its own: not even the MLflow store is touched
    storage = f"sqlite:///{tmp_path}/all_failed.db"
    _hand_made(storage, "all_failed", [_trial("oom", 1), _trial("oom", 2), _trial("timeout", 3), _trial("oom", 4)])
    mlflow_db = tmp_path / "mlruns" / "mlflow.db"
    argv = [
        "all_failed",
        "--storage",
        storage,
        "--tracking-uri",
        f"sqlite:///{mlflow_db}",
        "--experiment-file",
        str(target),
    ]
    code, _, err = run_main(promote.main, argv, tmp_path, monkeypatch, capsys)
    assert code == 1 and "all 4 trials failed: 3 oom, 1 timeout" in err
    assert not target.exists() and not mlflow_db.exists()


# ---- classes a CPU sweep cannot produce, from hand-made studies -----------------------------------------------------------

_SPACE = {
    "data.max_seq_length": CategoricalDistribution([1024, 2048, 4096]),
    "lora.r": CategoricalDistribution([16, 64]),
}


def _trial(kind: str | None, n: int, **figures: Any) -> dict[str, Any]:
    seq = [1024, 2048, 4096][n % 3]
    return {"params": {"data.max_seq_length": seq, "lora.r": 16 if n < 3 else 64}, "kind": kind, **figures}


def _hand_made(storage: str, name: str, specs: list[dict[str, Any]]) -> None:
    """A study as the sweep engine records it (user_attrs, states), without running anything."""
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    for spec in specs:
        attrs: dict[str, Any] = {"vram_budget_gib": 24.0, **spec.get("attrs", {})}
        state, value = TrialState.COMPLETE, spec.get("tokens_per_s")
        if spec["kind"] is None:
            reserved = spec["reserved"]
            attrs |= {
                "trial.status": "ok",
                "peak_vram_reserved_gib": reserved,
                "peak_vram_allocated_gib": reserved - 1.0,
                "peak_vram_device_gib": reserved + 0.6,
                "vram_headroom_frac": 1 - reserved / 24.0,
                "tokens_per_s": value,
                "step_time_s": 1.5,
            }
        elif spec["kind"] == "skipped":
            attrs |= {"trial.status": "skipped", "skipped.because_of": spec["of"], "skipped.reason": "same setting"}
            value = specs[spec["of"]].get("tokens_per_s", 0.0)
        elif spec["kind"] == "running":
            state, value = TrialState.RUNNING, None
        else:
            attrs |= {"trial.status": "failed", "failure.kind": spec["kind"], "failure.step": 2, "failure.message": "x"}
            if spec["kind"] == "oom":
                attrs |= {"peak_vram_reserved_gib": 23.1, "oom_request_gib": 2.0}
                value = 0.0
            else:
                state, value = TrialState.FAIL, None
        study.add_trial(
            optuna.trial.create_trial(
                params=spec["params"], distributions=_SPACE, value=value, state=state, user_attrs=attrs
            )
        )


def test_classes_from_headroom_retries_failures_and_repeats(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/gpu.db"
    _hand_made(
        storage,
        "gpu",
        [
            _trial(None, 0, reserved=14.0, tokens_per_s=2100.0),  # 42% left
            _trial(None, 1, reserved=22.5, tokens_per_s=2600.0),  # 6% left: under the 10% margin
            _trial(None, 3, reserved=15.0, tokens_per_s=1900.0, attrs={"alloc_retries": 3.0}),
            _trial("oom", 2),
            _trial("timeout", 4),
            {**_trial("skipped", 0), "of": 0},
            _trial("running", 5),
        ],
    )
    sweep = report.load("gpu", tmp_path / "sweeps", storage=storage)
    assert [(r.verdict, r.detail) for r in sweep.rows] == [
        ("stable", "headroom 42%"),
        ("marginal", "headroom 6% < 10%"),
        ("marginal", "3 allocator retries"),
        ("failed", "oom at step 2"),
        ("failed", "timeout at step 2"),
        ("skipped", "same setting"),
        ("running", "running"),
    ]
    assert sweep.effective(sweep.rows[5]) == "stable"  # a repeat shows on the map as the trial it repeats
    assert promote.choose(sweep, allow_unsoaked=True).number == 0  # the faster trial 1 is marginal: not promotable
    with pytest.raises(promote.NotPromotable, match="trial 1 is marginal"):
        promote.choose(sweep, trial=1, allow_unsoaked=True)
    assert report.load("gpu", tmp_path / "sweeps", storage=storage, margin=0.05).rows[1].verdict == "stable"

    written = report.write(sweep)  # on GPU figures the memory picture draws VRAM against the budget
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in written.files if p.suffix == ".png")
    assert "Dashed: the budget" in written.files[0].read_text()


def test_memory_on_a_machine_without_a_gpu_is_named_for_what_was_measured(tmp_path: Path) -> None:
    """On a CPU the budget holds the trial process's own memory beyond its start-up (src/measure/memory.py): the
    pictures call it that, not VRAM."""
    storage = f"sqlite:///{tmp_path}/cpu.db"
    cpu = {"host_limit_gib": 2.1, "host_startup_gib": 1.8}
    _hand_made(storage, "cpu", [_trial(None, n, reserved=0.1 * (n + 1), tokens_per_s=900.0, attrs=cpu) for n in (0, 1)])
    sweep = report.load("cpu", tmp_path / "sweeps", storage=storage)
    assert sweep.memory_words()[0] == "peak memory beyond start-up (GiB)"
    page = report.write(sweep).files
    html = next(p for p in page if p.suffix == ".html").read_text()
    assert "peak memory beyond start-up (GiB)" in html and "peak reserved VRAM (GiB)" not in html
    _hand_made(f"sqlite:///{tmp_path}/gpu.db", "gpu", [_trial(None, 0, reserved=14.0, tokens_per_s=2100.0)])
    gpu = report.load("gpu", tmp_path / "sweeps", storage=f"sqlite:///{tmp_path}/gpu.db")
    assert gpu.memory_words()[0] == "peak reserved VRAM (GiB)"


def test_throughput_read_on_a_shared_card_is_flagged_as_a_ranking(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/shared.db"
    slots = ["cuda0#0", "cuda0#1", "cuda0#2", "cuda1#0"]  # three trials at once on card 0
    _hand_made(
        storage,
        "shared",
        [
            _trial(None, n, reserved=10.0 + n, tokens_per_s=1000.0 * (n + 1), attrs={"sweep.slot": slot})
            for n, slot in enumerate(slots)
        ],
    )
    _hand_made(
        storage,
        "alone",
        [_trial(None, n, reserved=10.0, tokens_per_s=1000.0, attrs={"sweep.slot": f"cuda{n}"}) for n in range(2)],
    )
    shared, alone = (report.load(n, tmp_path / "sweeps", storage=storage) for n in ("shared", "alone"))
    assert (shared.card_shared_by(), alone.card_shared_by()) == (3, 1)

    text = report.write(shared).files[0].read_text()
    assert "up to 3 trials sharing each card" in text and "not speeds to quote" in text
    best_line = next(line for line in text.splitlines() if line.startswith("Best stable setting"))
    assert "tokens_per_s read on a card shared by up to 3 trials" in best_line
    caption = report.table(shared).caption
    assert caption and "3 trials sharing a card" in caption

    header = promote.header(
        shared, promote.choose(shared, allow_unsoaked=True), promote.Experiment(), "llama3-qlora", "1", [], False
    )
    assert any("3 trials sharing a card: not solo" in line for line in header), "the production file says so too"

    text = report.write(alone).files[0].read_text()
    assert "sharing" not in text and report.table(alone).caption is None
    header = promote.header(
        alone, promote.choose(alone, allow_unsoaked=True), promote.Experiment(), "llama3-qlora", "1", [], False
    )
    assert not any("sharing" in line for line in header)


@pytest.mark.slow
def test_unknown_study_lists_the_studies_that_exist(swept: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    code, _, err = run_main(report.main, ["no-such-study", "--no-mlflow"], swept, monkeypatch, capsys)
    assert code == 2
    assert "no study 'no-such-study'" in err and f"studies there (latest first): {STUDY}" in err


def test_a_storage_password_reaches_neither_the_report_nor_the_production_file(tmp_path: Path) -> None:
    password = "hunter2-" + tmp_path.name  # unique per run
    url = f"postgresql://sweeper:{password}@db-host:5432/optuna"
    storage = f"sqlite:///{tmp_path}/secret.db"
    failed = {**_trial("other", 1), "kind": "other"}
    _hand_made(storage, "secret", [_trial(None, 0, reserved=10.0, tokens_per_s=1000.0), failed])
    sweep = dataclasses.replace(report.load("secret", tmp_path / "sweeps", storage=storage), storage=url)
    sweep.rows[1].failure_message = f"could not connect to {url}"  # as a failed trial's traceback may say

    text = report.write(sweep).files[0].read_text()
    assert "could not connect to postgresql://" in text and "db-host" in text, "the message and storage are shown"
    assert password not in text
    lines = promote.header(
        sweep, promote.choose(sweep, allow_unsoaked=True), promote.Experiment(), "m", "1", ["--storage", url], False
    )
    assert any("db-host" in line for line in lines) and not any(password in line for line in lines)


def test_a_stale_trial_reads_killed_and_a_retried_one_says_so(tmp_path: Path) -> None:
    """Optuna's stale-trial machinery fails a trial without labels (a finished trial takes no attributes); a
    retried trial is known by its retry's `retry_of`."""
    storage = f"sqlite:///{tmp_path}/stale.db"
    _hand_made(storage, "stale", [_trial("segfault", 0), _trial(None, 1, reserved=10.0, tokens_per_s=1000.0)])
    study = optuna.load_study(study_name="stale", storage=storage)
    study.add_trial(
        optuna.trial.create_trial(params=_trial(None, 2)["params"], distributions=_SPACE, state=TrialState.FAIL)
    )
    study.add_trial(
        optuna.trial.create_trial(
            params=_trial(None, 0)["params"],
            distributions=_SPACE,
            state=TrialState.FAIL,
            user_attrs={"retry_of": 0, "failure.kind": "segfault"},
        )
    )
    sweep = report.load("stale", tmp_path / "sweeps", storage=storage)
    assert [(r.verdict, r.detail, r.failure_kind) for r in sweep.rows] == [
        ("failed", "segfault at step 2 (retried)", "segfault"),
        ("stable", "headroom 58%", None),
        ("failed", "killed", "killed"),
        ("failed", "segfault", "segfault"),
    ]
    assert sweep.rows[2].failure_message == STALE_MESSAGE
    assert "1 killed" in report.summary(sweep)


def test_a_trial_whose_config_is_nowhere_is_not_promoted_and_both_places_are_named(tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/lost.db"
    run_id = "0123456789abcdef"
    _hand_made(storage, "lost", [_trial(None, 0, reserved=10.0, tokens_per_s=1000.0, attrs={"mlflow_run_id": run_id})])
    sweep = report.load("lost", tmp_path / "sweeps", storage=storage)
    with pytest.raises(promote.NotPromotable) as refused:
        promote.trial_config(sweep, sweep.rows[0], f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    assert f"runs:/{run_id}/config/config.yaml" in str(refused.value)
    assert str(sweep.trial_dir(0) / ".hydra" / "config.yaml") in str(refused.value)
    assert not (tmp_path / "mlruns").exists(), "a store that is not there is not created"
