"""One new position's bfloat16 attention on the CPU: float32 matmuls rounded as Meta's bfloat16 attention rounds
(`one_position_attention`), and the cache length from which a load runs them rather than SDPA, measured
(`llama.runtime.cpu.attention`) and cached so that every later load attends alike."""

import time

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    GQA_PARAMS,
    import_or_skip,
    incremental_logits,
    load_reference,
    load_tiny,
    reference_attention,
    with_reference_attention,
)
from test_quantize import tiny_reader

import llama.runtime.cpu
import llama.runtime.cpu.attention as attention
from llama.checkpoint import load_model, random_weights
from llama.runtime import for_runtime
from llama.runtime.cpu import KernelCache


def test_one_position_attention_rounds_as_meta_bfloat16_attention():
    """Meta's bfloat16 attention bit for bit, grouped-query heads and batches included; SDPA's bfloat16 kernel rounds
    elsewhere, and runs below `from_positions`."""
    generator = torch.Generator().manual_seed(6)
    for bsz, n_heads, n_kv_heads, positions in [(1, 4, 1, 40), (2, 8, 2, 130), (1, 6, 6, 300)]:
        xq = torch.randn(bsz, 1, n_heads, 64, generator=generator).bfloat16()
        keys, values = (torch.randn(bsz, positions, n_kv_heads, 64, generator=generator).bfloat16() for _ in "kv")
        expected = reference_attention(xq, keys, values, None, n_heads // n_kv_heads)
        layout = [t.transpose(1, 2) for t in (xq, keys, values)]  # as Attention.forward passes them
        output = llama.runtime.cpu.one_position_attention(*layout).transpose(1, 2).reshape(bsz, 1, -1)
        assert torch.equal(output, expected)
        sdpa = F.scaled_dot_product_attention(*layout, enable_gqa=n_heads > n_kv_heads)
        assert not torch.equal(sdpa.transpose(1, 2).reshape(bsz, 1, -1), expected)
        below = llama.runtime.cpu.one_position_attention(*layout, from_positions=positions + 1)
        assert torch.equal(below, sdpa)


def test_bfloat16_decoding_on_the_matmuls_gives_meta_logits(process_group, tmp_path, monkeypatch):
    """Fed one token at a time, a bfloat16 model whose load measured the matmuls faster from 1 position on gives
    the logits of Meta's attention bit for bit (the same layers on both sides); measured slower everywhere, SDPA
    attends and they differ."""
    weights = random_weights(GQA_PARAMS, seed=12)
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "linear")  # F.linear on both sides: only the attention differs
    reference = with_reference_attention(load_reference(tmp_path / "reference", weights, torch.bfloat16))
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(2))
    one_at_a_time = [1] * tokens.shape[1]
    expected = incremental_logits(reference, tokens, one_at_a_time)
    for start, meta in [(1, True), (None, False)]:
        monkeypatch.setattr(attention, "matmul_attention_from", lambda *shape, start=start: start)
        model = load_tiny(tmp_path / str(start), weights, torch.bfloat16)
        assert (model.layers[0].attention.one_position_attention is not None) == meta
        assert torch.equal(incremental_logits(model, tokens, one_at_a_time), expected) == meta


def kernels_where(matmul_faster_from: list):
    """Stand-in calls for `attention_calls`: at each cache length, the kernel that loses sleeps 2 ms; the matmuls win
    at the lengths in `matmul_faster_from`."""

    def calls(n_heads, n_kv_heads, head_dim, positions):
        matmul_wins = positions in matmul_faster_from
        return {
            "sdpa": lambda: time.sleep(0.002 * matmul_wins),
            "matmul": lambda: time.sleep(0.002 * (not matmul_wins)),
        }

    return calls


@pytest.mark.parametrize(
    "matmul_wins, expected",
    [([32, 64, 128], 32), ([8, 16, 128], 128), ([8, 16, 32, 64, 128], 8), ([8, 16, 32, 64], None)],
    ids=["crossing", "not-monotone", "always", "never-at-the-longest"],
)
def test_the_matmuls_run_from_the_length_where_they_stay_faster(tmp_path, monkeypatch, matmul_wins, expected):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a machine that has measured nothing
    monkeypatch.setattr(attention, "attention_calls", kernels_where(matmul_wins))
    assert attention.timed_positions(128) == [8, 16, 32, 64, 128]
    assert attention.matmul_attention_from(4, 1, 64, max_seq_len=128) == expected


def test_the_measured_length_is_kept_by_every_later_load(tmp_path, monkeypatch):
    """The two kernels round differently, so what the first load measured decides every later load here, in this
    process and in a new one reading the cache file, though the kernels now time otherwise."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(attention, "attention_calls", kernels_where([32, 64]))
    assert attention.matmul_attention_from(4, 1, 64, max_seq_len=64) == 32
    monkeypatch.setattr(attention, "attention_calls", kernels_where([]))
    assert attention.matmul_attention_from(4, 1, 64, max_seq_len=64) == 32
    KernelCache.IN_PROCESS.clear()  # as a new process starts: from the file
    assert attention.matmul_attention_from(4, 1, 64, max_seq_len=64) == 32
    assert attention.matmul_attention_from(8, 2, 64, max_seq_len=64) is None  # other heads: measured afresh


@pytest.mark.parametrize("scheme", [None, "int8-dyn"])
def test_the_length_is_measured_on_the_threads_pytorch_decodes_on(process_group, tmp_path, monkeypatch, scheme):
    """Where ONNX Runtime runs the products (int8-dyn), PyTorch's own operations decode on one thread, and SDPA's
    kernel is slower there than on two: the load measures the attention on one thread then, else on all."""
    if scheme is not None:
        import_or_skip("onnxruntime", "pip install onnxruntime==1.32.0 onnx==1.23.2")
    measured_on = []

    def record(*shape):
        measured_on.append(torch.get_num_threads())
        return None

    monkeypatch.setattr(attention, "matmul_attention_from", record)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # where this machine has one core too
    try:
        reader, args = tiny_reader(tmp_path)
        for_runtime(load_model(reader, args, 0, 1, torch.device("cpu"), torch.bfloat16, quantize=scheme))
        assert measured_on == [2 if scheme is None else 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
