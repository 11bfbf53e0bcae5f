"""A data-parallel trial on a CPU: two ranks over gloo, launched by torch.distributed.run. Per-rank peaks
are recorded with the max as the trial's; a fault on rank 1 fails the whole trial with its rank, and no
process of the trial is left behind."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.conftest import run_cli

DP = ["trainer=probe", "trainer.max_steps=4", "hardware.parallelism=data_parallel", "hardware.processes=2"]
DP += ["model.device_map=null"]  # a data-parallel rank holds a whole copy: no device map across cards


def _only_run(client):
    exp = client.get_experiment_by_name("qlora-trials")
    (run,) = client.search_runs([exp.experiment_id])
    return run


def _leftovers(root: Path) -> list[str]:
    """Processes still running anything of this test's trial."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "src.train" in cmdline and str(root) in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.slow(seconds=31)
def test_two_rank_trial_records_per_rank_peaks(root: Path, mlflow_client) -> None:
    done = run_cli("src.train", *DP, root=root)
    assert done.returncode == 0, done.stderr[-3000:]
    run = _only_run(mlflow_client)
    m = run.data.metrics
    assert run.info.status == "FINISHED" and run.data.tags["ranks"] == "2"
    config = {a.path for a in mlflow_client.list_artifacts(run.info.run_id, "config")}
    assert config == {"config/config.yaml", "config/overrides.yaml", "config/hydra.yaml"}  # logged by the parent
    assert {"peak_rss_gib.rank0", "peak_rss_gib.rank1"} <= set(m)
    assert m["peak_rss_gib"] == max(m["peak_rss_gib.rank0"], m["peak_rss_gib.rank1"])
    assert m["tokens_per_s"] > 0 and m["samples_per_s"] > 0
    # global batch = per-device batch x ranks x accumulation = 1 x 2 x 2 samples per step
    assert m["samples_per_s"] == pytest.approx(4 / m["step_time_s"], rel=0.5)


@pytest.mark.slow(seconds=33)
def test_fault_on_rank_1_fails_the_trial_with_its_rank(root: Path, mlflow_client) -> None:
    """Rank 1 is SIGKILLed at step 2: it leaves no record, rank 0 fails on the lost peer and records that first,
    and only the launcher's report says which rank died how. A rank that records its own failure (an OOM) is the
    simpler case, read from the ranks' files: the root-cause cases below, from the launcher's own report."""
    done = run_cli("src.train", *DP, "fault=kill", "fault.step=2", "fault.rank=1", root=root)
    assert done.returncode == 1
    run = _only_run(mlflow_client)
    assert run.info.status == "FAILED"
    assert run.data.tags["failure.kind"] == "killed" and run.data.tags["failure.rank"] == "1"
    assert not _leftovers(root), "every rank of the trial has exited"


_LAUNCHER_REPORT = """\
E1202 20:26:23.455000 12661 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 12666) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
src.train FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_20:26:23
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code1} (pid: 12667)
  error_file: <N/A>
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_20:26:23
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 12666)
  error_file: <N/A>
=======================================================
"""


def _rank(rank: int, kind: str | None = None, at: float | None = None) -> dict:
    return {"rank": rank, "failure": {"kind": kind} if kind else None, "failed_at": at}


@pytest.mark.parametrize(
    "code1,ranks,expected",
    [
        # rank 1 was SIGKILLed; rank 0 lost its peer, recorded that, and exited first: the launcher blames rank 0
        ("-9", [_rank(0, "other", 5.0), _rank(1)], (1, -9)),
        # rank 1 ran out of memory first; rank 0 failed on the lost peer later
        ("1", [_rank(0, "other", 5.0), _rank(1, "oom", 4.0)], (1, 1)),
        # rank 0 failed first; rank 1, stopped by the launcher's SIGTERM, is not a cause
        ("-15", [_rank(0, "oom", 4.0), _rank(1)], (0, 1)),
    ],
)
def test_root_cause_is_the_rank_that_failed_first_not_the_first_to_exit(code1, ranks, expected) -> None:
    from src.trial.data_parallel import root_cause

    assert root_cause(_LAUNCHER_REPORT.format(code1=code1), ranks) == expected
