"""Speed side by side (benchmarks/suites/peers.yaml, speed_levers.yaml; benchmarks/peer_arm.py, the `arms`
summary): what runs on a CPU. The GPU runs themselves are benchmarks; here: a peer's FLOPs are the project's own
formula (src/measure/flops.py), the peer measures a real (tiny) training as a trial does, and the summary sets each
setting's repeats side by side, a peer's the same way as a trial's, with the same-model verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import harness, peer_arm, summaries

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)  # fmt: skip
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


def test_a_peer_counts_flops_with_the_project_s_own_formula() -> None:
    from src.measure.flops import FlopCounter

    model = _tiny_lora_llama()
    counter = FlopCounter(model)
    params = peer_arm.matmul_params(model.config, 8, TARGETS)
    assert params == counter.params, "P from the architecture equals the project's count over the Linear modules"
    width = model.config.num_attention_heads * (model.config.hidden_size // model.config.num_attention_heads)
    padded = {"input_ids": torch.ones(2, 10, dtype=torch.long),
              "attention_mask": torch.tensor([[1] * 10, [1] * 6 + [0] * 4])}  # fmt: skip
    packed = {"input_ids": torch.ones(1, 12, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])}  # fmt: skip
    for batch, lengths in ((padded, [10, 6]), (packed, [5, 3, 4])):
        with torch.no_grad():
            torch.set_grad_enabled(True)  # the counter counts training forwards only
            model(**batch)
        ours, _ = counter.take()
        assert peer_arm.row_lengths(batch) == lengths
        assert peer_arm.useful_flops(params, model.config.num_hidden_layers, width, lengths) == pytest.approx(ours)
    # A packed row that also carries an all-ones mask (as some libraries pass it) is still three sequences, and
    # Unsloth's explicit boundaries win: a packed row never counts as one long sequence.
    assert peer_arm.row_lengths({**packed, "attention_mask": torch.ones(1, 12, dtype=torch.long)}) == [5, 3, 4]
    assert peer_arm.row_lengths({**packed, "packed_seq_lengths": torch.tensor([5, 3, 4], dtype=torch.int32)}) == [
        5,
        3,
        4,
    ]
    one_long = peer_arm.useful_flops(params, 2, width, [12])
    assert one_long > peer_arm.useful_flops(params, 2, width, [5, 3, 4]), "attention grows with each sequence's length"


def test_the_peer_harness_measures_a_real_training_as_a_trial_does(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, "1")  # the harness sets these: restored after the test
    out = root / "c.json"
    argv = ["--stack", "peft", "--model", "tiny_llama", "--out", str(out), "--max-seq-length", "128", "--batch", "2",
            "--accumulation", "2", "--max-steps", "3", "--warmup-steps", "1", "--output-dir", str(root / "t")]  # fmt: skip
    assert peer_arm.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["status"] == "ok" and record["versions"]["trl"] != "absent"
    assert [s["step"] for s in record["steps"]] == [1, 2, 3]
    for s in record["steps"]:
        assert s["tokens"] == s["trainer_tokens"] == s["hook_tokens"] > 0, "the trainer's tokens, seen by the hook"
        assert s["flops"] == pytest.approx(s["flops_src_counter"]), "the project's FlopCounter counts the same"
        assert s["micro_batches"] == 2 and s["lengths_from"] == 0, "counted once, at the outermost forward"
    measured = record["steps"][1:]
    assert record["flops_per_token"] == pytest.approx(sum(s["flops"] for s in measured) / sum(s["tokens"] for s in
                                                                                               measured))  # fmt: skip
    rate = summaries._rate({"result": record})
    assert rate == pytest.approx(sum(s["tokens"] for s in measured) / sum(s["time_s"] for s in measured))


def _trial(rate: float | None, peak: float = 15.8) -> dict:
    if rate is None:
        return {
            "status": "failed",
            "failure": {"kind": "oom", "step": 1, "message": "CUDA out of memory"},
            "metrics": {},
        }
    return {"status": "ok", "metrics": {"tokens_per_s": rate, "peak_vram_reserved_gib": peak}}


def test_settings_side_by_side_pool_their_repeats_and_count_only_when_they_train_the_same_model() -> None:
    common = "python -m src.train model=tiny_llama trainer.max_steps=4"
    rows = [
        {"name": f"{arm}.{i}", "arm": arm, "overrides": words, "command": f"{common} {' '.join(words)} hydra.run.dir=/x",
         "exit_code": 0 if rate else 1, "wall_s": 60.0, "result": _trial(rate, peak)}
        for i, (arm, words, rate, peak) in enumerate(
            [("reference", ["trainer.per_device_train_batch_size=1"], 900.0, 12.0),
             ("candidate", ["trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=1"], 1500.0, 15.0),
             ("reference", ["trainer.per_device_train_batch_size=1"], 1100.0, 12.5),
             ("candidate", ["trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=1"], None, 0.0),
             ("reference", ["trainer.per_device_train_batch_size=1"], 1000.0, 12.1),
             ("candidate", ["trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=1"], 1700.0, 15.2)]
        )
    ]  # fmt: skip
    steps = [{"time_s": 9.0, "tokens": 100}, {"time_s": 1.0, "tokens": 1000}, {"time_s": 1.0, "tokens": 1200}]
    rows.append({"name": "unsloth", "arm": "unsloth", "exit_code": 0, "wall_s": 100.0,
                 "result": {"status": "ok", "warmup_steps": 1, "steps": steps, "peak_vram_reserved_gib": 11.0}})  # fmt: skip
    verdict = {"passed": False, "max_loss_diff": 0.2, "adapter_rel_diff": 0.4, "tolerance": {"max_loss_diff": 1e-4},
               "why": "2 rows per optimizer step against the reference's 2"}  # fmt: skip
    rows.append({"name": "same_model", "exit_code": 1, "wall_s": 30.0, "output": verdict})
    run = harness.Run("x", {"steps": []}, {"baseline": "reference"}, Path("/r"), Path("/o/x_h100.json"))
    s = summaries.arms({"rows": rows}, run)
    ref, cand, peer = s["settings"]["reference"], s["settings"]["candidate"], s["settings"]["unsloth"]
    assert ref["tokens_per_s"] == {"median": 1000.0, "min": 900.0, "max": 1100.0} and ref["repeats"] == 3
    assert ref["peak_vram_reserved_gib"] == 12.5 and ref["rows_per_optimizer_step"] == 2, "batch 1 x the seed's 2"
    assert cand["finished"] == 2 and cand["tokens_per_s"]["median"] == 1600.0, "a failed repeat is not a figure"
    assert cand["failures"] == [{"name": "candidate.3", "kind": "oom", "step": 1, "message": "CUDA out of memory"}]
    assert cand["rows_per_optimizer_step"] == 2 and cand["overrides"][0] == "trainer.per_device_train_batch_size=2"
    assert peer["tokens_per_s"]["median"] == pytest.approx(1100.0), "a peer's tokens over its measured steps"
    assert s["speedup"]["candidate"] == pytest.approx(1.6) and s["speedup"]["reference"] == 1.0
    assert s["same_model"]["passed"] is False and s["same_model"]["max_loss_diff"] == 0.2
    assert s["gpu_minutes"] == pytest.approx((6 * 60 + 100 + 30) / 60)
    json.dumps(s)
