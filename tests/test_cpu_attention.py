"""One new position's attention on the CPU: in bfloat16, float32 matmuls rounded as Meta's bfloat16 attention rounds
(`one_position_attention`), from the cache length the kernel table gives the CPU (`MATMUL_ATTENTION_FROM`), SDPA's
kernel below it and on CPUs the table does not know; and the eager decode step, which attends over the positions
written so far, as the reference reads its cache."""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ATOL,
    GQA_PARAMS,
    as_if_the_cpu_offered,
    incremental_logits,
    load_reference,
    load_tiny,
    reference_attention,
    with_reference_attention,
)

from llama.checkpoint import random_weights
from llama.runtime import kernel_table
from llama.runtime.cpu.kernels import one_position_attention
from llama.runtime.kernel_table import AVX512_BF16, CPUOffers

AVX2_CPU = CPUOffers("AVX2", False, ("avx_vnni",))
AVX512_BF16_CPU = CPUOffers("AVX512", True, ("avx512_bf16", "avx512_vnni"))
UNKNOWN_CPU = CPUOffers("DEFAULT", False, ())


def attention_inputs(bsz, n_heads, n_kv_heads, positions, generator):
    """One new position's query and a cache of `positions` keys and values, in bfloat16, as Meta's `Attention.forward`
    holds them: (bsz, positions, heads, head_dim)."""
    xq = torch.randn(bsz, 1, n_heads, 64, generator=generator).bfloat16()
    keys, values = (torch.randn(bsz, positions, n_kv_heads, 64, generator=generator).bfloat16() for _ in "kv")
    return xq, keys, values


def test_one_position_attention_rounds_as_meta_bfloat16_attention():
    """Meta's bfloat16 attention bit for bit, grouped-query heads and batches included; SDPA's bfloat16 kernel rounds
    elsewhere, and runs below `from_positions`."""
    generator = torch.Generator().manual_seed(6)
    for bsz, n_heads, n_kv_heads, positions in [(1, 4, 1, 40), (2, 8, 2, 130), (1, 6, 6, 300)]:
        xq, keys, values = attention_inputs(bsz, n_heads, n_kv_heads, positions, generator)
        expected = reference_attention(xq, keys, values, None, n_heads // n_kv_heads)
        layout = [t.transpose(1, 2) for t in (xq, keys, values)]  # as Attention.forward passes them
        output = one_position_attention(*layout).transpose(1, 2).reshape(bsz, 1, -1)
        assert torch.equal(output, expected)
        sdpa = F.scaled_dot_product_attention(*layout, enable_gqa=n_heads > n_kv_heads)
        assert not torch.equal(sdpa.transpose(1, 2).reshape(bsz, 1, -1), expected)
        below = one_position_attention(*layout, from_positions=positions + 1)
        assert torch.equal(below, sdpa)


def test_bfloat16_decoding_on_the_matmuls_gives_meta_logits(process_group, tmp_path, monkeypatch):
    """Fed one token at a time, a bfloat16 model on a CPU whose table row runs the matmuls from 1 position on gives
    the logits of Meta's attention bit for bit (the same layers on both sides); on a CPU the table does not know,
    SDPA attends and they differ."""
    weights = random_weights(GQA_PARAMS, seed=12)
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "linear")  # F.linear on both sides: only the attention differs
    reference = with_reference_attention(load_reference(tmp_path / "reference", weights, torch.bfloat16))
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 14), generator=torch.Generator().manual_seed(2))
    one_at_a_time = [1] * tokens.shape[1]
    expected = incremental_logits(reference, tokens, one_at_a_time)
    monkeypatch.setattr(kernel_table, "MATMUL_ATTENTION_FROM", {AVX512_BF16: 1})
    for name, offers, meta in [("known", AVX512_BF16_CPU, True), ("unknown", UNKNOWN_CPU, False)]:
        as_if_the_cpu_offered(monkeypatch, offers)
        model = load_tiny(tmp_path / name, weights, torch.bfloat16)
        assert (model.layers[0].attention.one_position_attention is not None) == meta
        assert torch.equal(incremental_logits(model, tokens, one_at_a_time), expected) == meta


@pytest.mark.parametrize("cpu", ["AVX2", "AVX-512 with bfloat16", "unknown"])
def test_the_table_sets_the_cache_length_from_which_the_matmuls_attend(process_group, tmp_path, monkeypatch, cpu):
    """On a CPU the table knows, a bfloat16 model attends one new position with SDPA's kernel up to the table's cache
    length, and from there on rounds as Meta's attention does; on a CPU it does not know, and for a float32 model on
    any CPU, SDPA's kernel attends at every length."""
    offers = {"AVX2": AVX2_CPU, "AVX-512 with bfloat16": AVX512_BF16_CPU, "unknown": UNKNOWN_CPU}[cpu]
    as_if_the_cpu_offered(monkeypatch, offers)
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "linear")  # runs on any CPU: the attention is what is looked at
    weights = random_weights(GQA_PARAMS, seed=12)
    float32 = load_tiny(tmp_path / "float32", weights, torch.float32)
    assert all(layer.attention.one_position_attention is None for layer in float32.layers)
    attend = load_tiny(tmp_path / "bfloat16", weights, torch.bfloat16).layers[0].attention.one_position_attention
    start = kernel_table.MATMUL_ATTENTION_FROM.get(offers.kind)
    if cpu == "unknown":
        assert start is None and attend is None
        return
    assert start is not None and attend is not None
    generator = torch.Generator().manual_seed(3)
    for positions, meta in [(start - 1, False), (start, True), (start + 37, True)]:
        xq, keys, values = attention_inputs(2, 4, 2, positions, generator)
        layout = [t.transpose(1, 2) for t in (xq, keys, values)]
        output = attend(*layout)
        sdpa = F.scaled_dot_product_attention(*layout, enable_gqa=True)
        expected = reference_attention(xq, keys, values, None, 2).view(2, 1, 4, 64).transpose(1, 2)
        assert torch.equal(output, expected if meta else sdpa), positions
        assert torch.equal(output, sdpa) != meta, positions  # the two kernels round apart at these lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_eager_decode_step_attends_the_written_positions_only(process_group, tmp_path, monkeypatch, dtype):
    """Eagerly on the CPU, a decode step (one position for the batch, or one per row, as the engine runs it) attends
    over the positions written so far, up to the furthest row's, as the reference reads its cache: a step costs no
    more for a larger cache (`max_seq_len`), models of 16 and 1024 cached positions give the same logits bit for bit,
    and in float32 those of Meta's math within 1e-4."""
    weights = random_weights(GQA_PARAMS, seed=14)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))
    sdpa = F.scaled_dot_product_attention
    attended = []

    def counted(query, key, *args, **kwargs):
        attended.append(key.shape[-2])
        return sdpa(query, key, *args, **kwargs)

    found = []
    for max_seq_len in (16, 1024):
        model = load_tiny(tmp_path / str(max_seq_len), weights, dtype, max_seq_len=max_seq_len)
        model(tokens[:, :6], 0)
        monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
        steps = []
        for step_tokens, position, positions in [
            (tokens[:, 6:7], [6], 7),
            (tokens[:, 7:8], [7], 8),
            (tokens[:, 8:9], [8, 5], 9),
        ]:
            attended.clear()
            steps.append(model.decode_step(step_tokens, torch.tensor(position)))  # [8, 5]: each row at its own
            assert attended == [positions] * GQA_PARAMS["n_layers"], (max_seq_len, position)
        monkeypatch.undo()
        found.append(steps)
    for small, large in zip(*found):
        assert torch.equal(small, large)
    if dtype == torch.float32:
        reference = load_reference(tmp_path / "reference", weights, dtype)
        expected = incremental_logits(with_reference_attention(reference), tokens[:, :8], [6, 1, 1])[:, 6:]
        assert (torch.cat(found[0][:2], dim=1) - expected).abs().max() < ATOL
