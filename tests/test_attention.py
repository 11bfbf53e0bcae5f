"""model.attn_implementation=varlen (src/attention.py): the wrapper around torch's varlen flash kernel must give
what attention over each sequence alone gives, for packed rows (trl's padding-free batches) and padded ones.
The kernel itself is CUDA-only; here a reference kernel (SDPA over each sequence) stands in for it, once with
each calling convention torch has had (is_causal + equal heads; window_size + enable_gqa)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from src import attention


def _reference(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=None, window_size=None, enable_gqa=False, scale=None):
    assert is_causal or window_size == (-1, 0), "the wrapper must ask for causal attention"
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == int(cu_q.diff().max())
    assert q.dtype in (torch.bfloat16, torch.float16), "flash kernels take 16-bit inputs"
    if not enable_gqa:
        assert k.shape[1] == q.shape[1], "without enable_gqa the kernel needs one KV head per query head"
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qi, ki, vi = (t[a:b].transpose(0, 1).float() for t in (q, k, v))
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        out.append(o.transpose(0, 1))
    return torch.cat(out).to(q.dtype)


def _old(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    return _reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal)


def _new(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False):
    return _reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size, enable_gqa=enable_gqa, scale=scale)


@pytest.fixture(params=[_old, _new], ids=["is_causal", "window_size+gqa"])
def models(request, monkeypatch: pytest.MonkeyPatch):
    import inspect

    fn = request.param
    monkeypatch.setattr(attention, "_kernel", lambda: (fn, set(inspect.signature(fn).parameters)))
    attention.register()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa",
    )  # fmt: skip
    sdpa = LlamaForCausalLM(config).eval()
    varlen = LlamaForCausalLM._from_config(config, attn_implementation=attention.NAME).eval()
    varlen.load_state_dict(sdpa.state_dict())
    return sdpa, varlen


def test_packed_row_attends_within_each_sequence_only(models) -> None:
    sdpa, varlen = models
    lengths = [5, 7, 4]
    seqs = [torch.randint(0, 97, (n,)) for n in lengths]
    alone = torch.cat([sdpa(s[None]).logits[0] for s in seqs])  # each sequence on its own: the truth
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = varlen(
        torch.cat(seqs)[None],
        position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths),
    ).logits[0]  # fmt: skip
    torch.testing.assert_close(packed, alone, atol=3e-2, rtol=3e-2)  # bf16 inside the kernel
    whole = varlen(torch.cat(seqs)[None]).logits[0]  # the same row taken as one sequence differs
    assert not torch.allclose(whole[5:], alone[5:], atol=3e-2, rtol=3e-2)


def test_padded_batch_is_unpadded_by_its_mask(models) -> None:
    sdpa, varlen = models
    ids = torch.randint(0, 97, (2, 8))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    want = sdpa(ids, attention_mask=mask).logits
    got = varlen(ids, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=3e-2, rtol=3e-2)


def test_a_packed_trial_hands_trl_sequence_boundaries_to_the_kernel(root, mlflow_client, monkeypatch) -> None:
    """The whole path (trl's padding-free collator -> Trainer -> peft -> Llama -> our attention, recompute
    included) with the reference kernel standing in for the CUDA-only one, in this process: every call sees
    several sequences, and the trial trains."""
    import inspect

    from tests.conftest import run_trial_here

    calls: list[tuple[int, int]] = []
    run = attention._run

    def spy(q, k, v, cu, max_len, scale):  # noqa: ANN001, ANN202
        calls.append((q.shape[0], cu.numel() - 1))
        return run(q, k, v, cu, max_len, scale)

    monkeypatch.setattr(attention, "available", lambda: None)
    monkeypatch.setattr(attention, "_kernel", lambda: (_new, set(inspect.signature(_new).parameters)))
    monkeypatch.setattr(attention, "_run", spy)
    overrides = ["trainer=probe", "trainer.max_steps=3", "model.attn_implementation=varlen", "trainer.packing=true"]
    overrides += ["trainer.group_by_length=false", "trainer.per_device_train_batch_size=4"]
    overrides += ["data.max_seq_length=256"]  # 4 packed rows of 256 tokens a step: several sequences in each call
    result = run_trial_here(root, overrides)
    assert result["status"] == "ok", result["failure"]
    assert calls and all(n > 1 for _, n in calls), calls[:5]
    (logged,) = mlflow_client.search_runs([mlflow_client.get_experiment_by_name("qlora-trials").experiment_id])
    assert logged.info.status == "FINISHED" and logged.data.params["model.attn_implementation"] == "varlen"
