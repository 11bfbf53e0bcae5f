"""One trial of the tiny Llama: it trains 4-bit layers with LoRA, measures, records everything in MLflow, and
ends its run FAILED with the right kind when it fails."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch
import yaml

from src import failures
from src.data import probe_rows
from src.trial import context, single
from tests.conftest import compose_cfg, run_cli, run_trial_here

CONTRACT_METRICS = {
    "peak_vram_allocated_gib",
    "peak_vram_reserved_gib",
    "peak_rss_gib",
    "vram_budget_gib",
    "vram_headroom_frac",
    "tokens_per_s",
    "samples_per_s",
    "step_time_s",
    "train_loss",
}


def _only_run(client, experiment: str = "qlora-trials"):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_lora_moves_and_4bit_base_stays_frozen(root: Path) -> None:
    from bitsandbytes.nn import Linear4bit

    from src import models

    out = root / "trial"
    cfg = compose_cfg(["trainer=probe", "trainer.max_steps=3", "measure.warmup_steps=1", f"trainer.output_dir={out}"])
    ctx = context.TrialContext(*context.open_run(cfg))
    out.mkdir()
    single.train(cfg, out, ctx)
    trained = ctx.trainer.model

    fresh, _ = models.load(cfg)
    base_layers = [m for m in fresh.modules() if isinstance(m, Linear4bit)]
    assert len(base_layers) == 2 * 7, "every projection of both blocks is an NF4 layer"
    # peft names a wrapped layer's frozen weight base_model.model.<name with .base_layer before .weight>
    trained_base = {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): p for n, p in trained.named_parameters()
    }
    checked = 0
    for name, param in fresh.named_parameters():
        if "_proj" in name:  # the quantized projection weights, byte for byte
            twin = trained_base[name]
            assert torch.equal(param.data, twin.data), f"base weight {name} changed"
            assert not twin.requires_grad
            checked += 1
    assert checked == 14
    lora_b = [p for n, p in trained.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.requires_grad for p in lora_b)
    assert sum(float(p.abs().sum()) for p in lora_b) > 0, "LoRA B starts at zero and must have moved"


@pytest.mark.slow(seconds=12)
def test_trial_records_every_contract_metric_and_tag_and_its_composed_config(root: Path, mlflow_client) -> None:
    done = run_cli("src.train", "trainer=probe", "trainer.max_steps=5", "measure.profile_step=4", "lora.r=8", root=root)
    assert done.returncode == 0, done.stderr[-3000:]
    run = _only_run(mlflow_client)
    m, tags, params = run.data.metrics, run.data.tags, run.data.params
    assert run.info.status == "FINISHED"
    # No GPU here: the CPU is the device, its memory the process's own (torch keeps no allocated figure on a CPU)
    assert set(m) >= CONTRACT_METRICS - {"peak_vram_allocated_gib"}, CONTRACT_METRICS - set(m)
    assert m["tokens_per_s"] > 10 and m["samples_per_s"] > 0 and 0 < m["step_time_s"] < 30
    assert 0.1 < m["peak_rss_gib"] < 24 and m["vram_budget_gib"] == 24
    assert 0.01 < m["peak_vram_reserved_gib"] < 2, "what training added to the process, beyond its start-up"
    assert m["host_limit_gib"] == pytest.approx(m["host_startup_gib"] + 24)
    assert m["vram_headroom_frac"] == pytest.approx(1 - m["peak_vram_reserved_gib"] / 24)
    assert math.isfinite(m["train_loss"]) and m["train_loss"] > 0
    assert m["measured_steps"] == 3  # 5 steps, 2 of warm-up
    assert 1 < m["startup_s"] < 120  # process start (imports, model, data) to the first step
    assert m["data.tokens_min"] <= m["data.tokens_median"] <= m["data.tokens_p95"] <= m["data.tokens_max"]
    assert tags["trial.status"] == "ok" and "failure.kind" not in tags
    assert "Warning" not in done.stderr, done.stderr[-3000:]  # nothing deprecated, nothing harmless left (src/quiet.py)
    for key in (
        "version.torch",
        "version.transformers",
        "version.trl",
        "version.peft",
        "version.bitsandbytes",
        "gpu.name",
    ):
        assert tags[key]
    assert tags["attention.kernel"] not in ("", "not_profiled")
    assert params["lora.r"] == "8" and params["data.max_seq_length"] == "1024" and params["model.name"] == "tiny_llama"
    steps = [x.step for x in mlflow_client.get_metric_history(run.info.run_id, "step_seconds")]
    assert steps == [1, 2, 3, 4, 5]
    result_file = next((root / "sweeps" / "single").glob("*/result.json"))
    result = json.loads(result_file.read_text())
    assert result["status"] == "ok" and result["run_id"] == run.info.run_id
    # ...and it says where all that went: its folder, its MLflow experiment and run
    assert f"results: {result_file.parent}/" in done.stdout
    assert f"experiment 'qlora-trials', run {run.info.run_id}" in done.stdout and "make ui" in done.stdout
    # Useful FLOP/s: 4 x the Linear weights per real token, plus causal attention (a few % at these lengths).
    matmul_only = 4 * m["model_params_matmul"] * m["tokens_per_s"] / 1e12
    assert matmul_only <= m["model_tflops_per_s"] < 1.5 * matmul_only
    # The standard definition beside it (issue 46): 6 FLOPs a token for LoRA's trainable weights, 4 for the frozen
    # ones; a little more than the above, by LoRA's share; no spec peak for a CPU, so no standard MFU
    assert m["model_tflops_per_s"] < m["model_tflops_per_s_standard"] < 1.1 * m["model_tflops_per_s"]
    assert "mfu_standard" not in m
    # Where the start-up went: each phase's own seconds, which add up to the whole start-up (launch to first step).
    phases = {k: v for k, v in m.items() if k.startswith("startup.")}
    named = ("python_and_mlflow", "torch_and_cuda", "model_load", "trainer_init", "train_begin")
    assert {f"startup.{p}_s" for p in named} <= set(phases) and all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx(m["startup_s"], abs=1e-3)
    profile = mlflow_client.download_artifacts(run.info.run_id, "profile.txt", str(root))
    text = Path(profile).read_text()
    assert text.startswith("Step 4:") and "By family:" in text and "matmul" in text
    # Promotion rebuilds a trial from its MLflow run alone: the config Hydra composed travels with the run.
    logged = {a.path for a in mlflow_client.list_artifacts(run.info.run_id, "config")}
    assert logged == {"config/config.yaml", "config/overrides.yaml", "config/hydra.yaml"}
    config = Path(mlflow_client.download_artifacts(run.info.run_id, "config/config.yaml", str(root)))
    assert yaml.safe_load(config.read_text())["lora"]["r"] == 8
    overrides = Path(mlflow_client.download_artifacts(run.info.run_id, "config/overrides.yaml", str(root)))
    assert "lora.r=8" in yaml.safe_load(overrides.read_text())


def test_without_hydras_saved_config_the_run_holds_the_config_unresolved(root: Path, mlflow_client) -> None:
    cfg = compose_cfg(["lora.r=8"])
    client, run_id = context.open_run(cfg)
    context.log_config(client, run_id, cfg, root / "no-hydra-dir")
    assert [a.path for a in client.list_artifacts(run_id, "config")] == ["config/config.yaml"]
    config = yaml.safe_load(Path(client.download_artifacts(run_id, "config/config.yaml", str(root))).read_text())
    assert config["lora"]["r"] == 8 and config["paths"]["root_dir"] == "${oc.env:QLORA_ROOT,.}"


@pytest.mark.parametrize("upcast,dtype", [(True, torch.float32), (False, torch.bfloat16)])
def test_upcast_non_quantized_decides_the_dtype_of_embeddings_norms_and_lm_head(upcast, dtype, root: Path) -> None:
    from src import models

    cfg = compose_cfg([f"model.upcast_non_quantized={upcast}", "trainer.gradient_checkpointing=true"])
    model, _ = models.load(cfg)
    model = models.prepare_for_kbit_training(model, cfg)
    for weight in (model.lm_head.weight, model.model.embed_tokens.weight, model.model.norm.weight):
        assert weight.dtype == dtype
    assert not any(p.requires_grad for p in model.parameters()), "the base is frozen either way"
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()), "its layers checkpoint"


@pytest.mark.xdist_group("inductor")  # after tests/test_recompute.py's compiled tests, whose kernels it reuses
def test_compiled_layers_train_the_same_adapter_with_one_graph_for_every_layer(root: Path) -> None:
    import torch._dynamo

    losses = {}
    for mode in (False, "layers"):
        out = root / f"trial-{mode}"
        out.mkdir()
        cfg = compose_cfg(
            ["trainer=probe", "trainer.max_steps=2", "measure.warmup_steps=1", f"trainer.torch_compile={mode}"]
            + [f"trainer.output_dir={out}", "trainer.packing=true"]
            + ["trainer.gradient_checkpointing=true", "model.attn_implementation=sdpa"]  # the compiled setting's
        )
        ctx = context.TrialContext(*context.open_run(cfg))
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        single.train(cfg, out, ctx)
        losses[mode] = ctx.trainer.state.log_history[-1]["train_loss"]
        layers = ctx.trainer.model.base_model.model.model.layers
        if mode == "layers":
            assert all(layer._compiled_call_impl is not None for layer in layers)
            # both decoder layers ran through one compiled graph, not one each
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        else:
            assert all(layer._compiled_call_impl is None for layer in layers)
    assert math.isclose(losses[False], losses["layers"], rel_tol=1e-2), losses


def test_sdpa_backends_decide_the_attention_kernel_that_runs(root: Path, mlflow_client) -> None:
    # On a CPU torch picks its flash kernel (flash_cpu); allowing only the math path must show in the tag.
    overrides = ["trainer=probe", "trainer.max_steps=3", "model.attn_implementation=sdpa", "model.sdpa_backends=[math]"]
    result = run_trial_here(root, overrides)
    assert result["status"] == "ok", result["failure"]
    run = _only_run(mlflow_client)
    assert run.data.tags["attention.kernel"] == "math"
    assert run.data.params["model.sdpa_backends"] == '["math"]'


def test_missing_data_file_is_a_clear_data_error(root: Path, mlflow_client) -> None:
    # The trial's own path in this process (tests/test_host_budget.py shows what the command prints when one fails).
    result = run_trial_here(root, ["data.path=/nowhere/seed.xlsx"])
    assert result["status"] == "failed" and result["failure"]["kind"] == "data_error"
    assert "data.path" in result["failure"]["message"] and "/nowhere/seed.xlsx" in result["failure"]["message"]
    run = _only_run(mlflow_client)
    assert run.info.status == "FAILED" and run.info.run_id == result["run_id"]
    assert run.data.tags["failure.kind"] == "data_error" and run.data.tags["trial.status"] == "failed"


def test_failing_trial_ends_failed_with_kind_step_and_traceback(root: Path, mlflow_client) -> None:
    # In this process: what the command prints and its exit code when a trial fails, tests/test_host_budget.py.
    result = run_trial_here(root, ["trainer=probe", "fault=nan_loss", "fault.step=3"])
    assert result["status"] == "failed"
    run = _only_run(mlflow_client)
    assert run.info.status == "FAILED" and run.info.run_id == result["run_id"]
    tags = run.data.tags
    assert tags["failure.kind"] == "nan_loss" and tags["failure.step"] == "3"
    assert "loss became nan" in tags["failure.message"]
    artifacts = {a.path for a in mlflow_client.list_artifacts(run.info.run_id)}
    assert {"traceback.txt", "preflight.txt"} <= artifacts
    assert "loss became nan" in (root / "trial" / "traceback.txt").read_text(), "beside result.json too"
    assert "peak_rss_gib" in run.data.metrics, "what was measured before the failure is kept"


def test_probe_rows_hold_the_longest_rows() -> None:
    lengths = np.array([10, 500, 20, 30, 480, 40, 50, 60, 70, 80])
    rows = probe_rows(lengths, n_rows=4, batch=2, seed=0)
    assert len(rows) == 4 and {1, 4} <= set(rows.tolist())
    assert probe_rows(lengths, n_rows=50, batch=2, seed=0).tolist() == list(range(10))


def test_packed_probe_holds_enough_rows_to_fill_its_packed_rows() -> None:
    """With packing, a batch is as big as what is packed into it: the probe takes rows until they fill
    n_rows packed rows of max_seq_length tokens, the longest rows always among them."""
    lengths = np.array([100, 900, 50, 300, 700, 120, 80, 400, 60, 1200] * 5)
    rows = probe_rows(lengths, n_rows=3, batch=1, seed=0, pack_to=1024)
    assert 9 in rows  # the longest row (1200, truncated to 1024)
    assert np.minimum(lengths[rows], 1024).sum() >= 3 * 1024
    assert np.minimum(lengths[rows], 1024).sum() < 4 * 1024  # no more rows than needed
    assert len(probe_rows(lengths[:4], n_rows=50, batch=1, seed=0, pack_to=1024)) == 4  # all there is


def test_a_packed_probes_first_step_holds_its_fullest_batch(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Best-fit packing leaves some bins part-empty, and the samplers put them anywhere: a one-step probe then
    measured a batch smaller than the setting's peak. A packed probe trains its bins fullest first, in every order
    the user may ask for; a run that is not a probe keeps the user's sampler."""
    from src.config import sft_kwargs
    from src.measure.steps import Measurements

    steps: list[int] = []
    after = Measurements.on_step_end

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        after(self, *args, **kwargs)
        steps.append(self.steps[-1]["tokens"])

    monkeypatch.setattr(Measurements, "on_step_end", spy)
    packed = ["trainer=probe", "trainer.max_steps=3", "trainer.packing=true", "trainer.per_device_train_batch_size=2"]
    packed += ["trainer.gradient_accumulation_steps=1", "trainer.group_by_length=false", "data.max_seq_length=256"]
    packed += ["model.attn_implementation=sdpa"]
    result = run_trial_here(root, packed)
    assert result["status"] == "ok", result["failure"]
    assert len(steps) == 3 and steps == sorted(steps, reverse=True) and steps[0] > steps[-1], steps
    out = f"trainer.output_dir={root / 'args'}"
    assert sft_kwargs(compose_cfg([*packed, out]), use_cpu=True)["train_sampling_strategy"] == "sequential"
    whole = ["trainer.packing=true", "trainer.max_steps=-1", "model.attn_implementation=sdpa", out]
    assert sft_kwargs(compose_cfg(whole), use_cpu=True)["train_sampling_strategy"] == "group_by_length"


@pytest.mark.parametrize(
    "exc,kind",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (RuntimeError("CUDA error: unspecified launch failure\nCUDA kernel errors might be..."), "launch_failure"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), "illegal_memory_access"),
        (RuntimeError("CUDA error: operation not supported on global/shared address space"), "illegal_memory_access"),
        (RuntimeError("CUDA error: device-side assert triggered"), "device_assert"),
        (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), "cublas"),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error"), "nccl"),
        (failures.NanLossError("loss became nan at step 4"), "nan_loss"),
        (failures.DataError("data.path: file not found"), "data_error"),
        (failures.ConfigError("trainer.torch_empty_cache_steps=1 ..."), "config_error"),
        (ValueError("something nobody listed"), "other"),
    ],
)
def test_exception_taxonomy(exc: BaseException, kind: str) -> None:
    assert failures.classify_exception(exc) == kind


def _raised(make) -> BaseException:
    """What `make` raises: a real allocation past what any host has (1 PiB: beyond the address space), or an
    exception as a library raises it."""
    if isinstance(make, BaseException):
        return make
    try:
        make()
    except BaseException as exc:  # whatever the allocator raised is the point
        return exc
    raise AssertionError("the allocation succeeded")


@pytest.mark.parametrize(
    "make,kind",
    [
        (lambda: torch.empty(2**50, dtype=torch.uint8), "host_oom"),  # DefaultCPUAllocator: can't allocate memory
        (lambda: bytearray(2**50), "host_oom"),  # MemoryError
        (lambda: __import__("mmap").mmap(-1, 2**50), "host_oom"),  # OSError: [Errno 12] Cannot allocate memory
        (RuntimeError("out of memory"), "host_oom"),  # no device named: the host's
        (RuntimeError("CUDA error: out of memory"), "oom"),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
    ],
)
def test_host_memory_is_told_apart_from_device_memory(make, kind: str) -> None:
    """Only the card's memory is the setting's (`oom`: the VRAM constraint and the certain-OOM rule learn from
    it); the host running out (`host_oom`) is the machine's, like a segfault or a kill."""
    exc = _raised(make)
    assert failures.classify_exception(exc) == kind, f"{type(exc).__name__}: {exc}"
    assert failures.classify_exit(1, f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}") == kind
    assert "host_oom" in failures.KINDS and "host_oom" not in failures.MEMORY


def test_the_kernels_oom_killer_is_host_memory_and_a_plain_kill_is_not() -> None:
    dmesg = "Out of memory: Killed process 4242 (python) total-vm:81234567kB, anon-rss:23456789kB, oom_score_adj:0"
    slurm = "slurmstepd: error: Detected 1 oom_kill event in StepId=12.batch. Some of your processes may have been "
    slurm += "killed by the cgroup out-of-memory handler."
    assert failures.classify_exit(-9, dmesg) == "host_oom"
    assert failures.classify_exit(128 + 9, slurm) == "host_oom"
    assert failures.classify_exit(-9, "") == "killed"


def test_a_host_oom_trial_fails_as_the_process_s_not_as_the_setting_s(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told FAIL (no VRAM constraint), and a larger setting is still launched: not a certain OOM."""
    from src import report
    from src.sweep.process import Outcome
    from tests.test_sweep import _fake_sweep

    host = _raised(lambda: torch.empty(2**50, dtype=torch.uint8))

    def out_of_host_memory(overrides: list[str], log_dir: Path, env: dict, sweeper, heartbeat=None) -> Outcome:
        failure = single.failure_of(host, None).as_dict()
        return Outcome("failed", failure={**failure, "step": 3}, recorded=False)

    space = ["data.max_seq_length=choice(128,256)"]
    cfg = _fake_sweep(monkeypatch, "host", 2, space, "hydra/sweeper/sampler=grid", process=out_of_host_memory)
    trials = optuna.load_study(study_name="host", storage=f"sqlite:///{root}/sweeps/host/optuna.db").get_trials()
    assert [t.user_attrs["failure.kind"] for t in trials] == ["host_oom", "host_oom"], "both launched"
    assert all(t.state == optuna.trial.TrialState.FAIL and not t.constraints for t in trials)
    sweep = report.load("host", root / "sweeps", tracking_uri=str(cfg.tracking.uri))
    assert [r.detail for r in sweep.rows] == ["host_oom at step 3", "host_oom at step 3"]


def test_a_failure_s_line_carries_the_cause_that_follows_its_colon() -> None:
    # torch.compile's failures say on their first line only that the backend raised; the cause is on the next
    compiled = "BackendCompilerFailed: backend='inductor' raised:\nRuntimeError: Triton Error [CUDA]: bad\n\nSet TORCH"
    assert (
        failures.first_line(compiled)
        == "BackendCompilerFailed: backend='inductor' raised: RuntimeError: Triton Error [CUDA]: bad"
    )
    assert failures.first_line("\n  CUDA out of memory. Tried\nmore") == "CUDA out of memory. Tried"
    assert failures.first_line("ends with a colon:") == "ends with a colon:" and failures.first_line(" \n") == ""


def test_exit_taxonomy_and_oom_request() -> None:
    assert failures.classify_exit(-11) == "segfault"
    assert failures.classify_exit(-9) == "killed"
    assert failures.classify_exit(1, "", timed_out=True) == "timeout"
    assert failures.classify_exit(1, "Fatal Python error: Segmentation fault") == "segfault"
    assert failures.classify_exit(1, "Could not override 'lora.rnak'.") == "config_error"
    assert failures.classify_exit(1, "no idea") == "other"
    assert failures.oom_request_gib("Tried to allocate 112.00 MiB. GPU 0") == pytest.approx(112 / 1024)
    assert failures.oom_request_gib("Tried to allocate 2.00 GiB") == pytest.approx(2.0)


def test_attention_probe_names_the_kernel_sdpa_dispatched_to() -> None:
    """The fused kernel when SDPA picks one, `math` when it falls back to its decomposed path."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from src.measure import AttentionProbe

    class ToyAttention(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    model, q = torch.nn.Sequential(ToyAttention()), torch.randn(1, 4, 16, 8)

    def probed(backend: SDPBackend | None) -> str:
        probe = AttentionProbe(at_step=1)
        probe.on_step_begin(None, type("State", (), {"global_step": 0})(), None, model=model)
        if backend is None:
            model(q)
        else:
            with sdpa_kernel(backend):
                model(q)
        return probe.tag

    assert probed(None) == "flash_cpu"
    assert probed(SDPBackend.MATH) == "math"
    assert not list(model[0]._forward_hooks), "the probe removes its hooks after one call"
