"""int8 weights multiplied in integers on the CPU ("split", `llama.runtime.cpu.integer`): the activations split
into two parts of 7-bit levels, both multiplied by fbgemm's integer kernel. What a user relies on: the product is the
weight-only product but for a rounding of the activations bounded by 1/15,876 of each row's largest magnitude; it
does not depend on the thread count; the load offers it only where fbgemm's sums are exact, and chooses among the
other products without it."""

import logging
import time

import pytest
import torch
from helpers import int8_layer

from llama.quantize import dequantize
from llama.runtime.cpu import integer
from llama.runtime.cpu.integer import pack_int8, split_activations, split_product, split_product_available

pytestmark = pytest.mark.skipif(not split_product_available(), reason="this torch build has no fbgemm")

BOUND = 1 / (63 * 126 * 2)  # the split's largest error, as a share of the row's largest magnitude


def hard_rows() -> torch.Tensor:
    """Rows that stress a per-row split: plain, one outlier, all one sign, all zero, tiny, huge, a value at a
    half-level."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(8, 256, generator=g)
    rows[1, 17] = 300.0
    rows[2] = rows[2].abs()
    rows[3] = 0.0
    rows[4] *= 1e-30
    rows[5] *= 1e30
    rows[6, :2] = torch.tensor([63.0, 0.5])  # 0.5 is half a coarse step of this row
    return rows


def test_the_two_parts_rebuild_each_row_to_within_half_a_fine_step():
    rows = hard_rows()
    parts, step = split_activations(rows)
    coarse, fine = parts[: len(rows)], parts[len(rows) :]
    for levels in (coarse, fine):
        assert torch.equal(levels, levels.round()) and levels.abs().max() <= 63
    rebuilt = (coarse.double() + fine.double() / 126) * step.double()
    absmax = rows.abs().amax(-1, keepdim=True).double()
    assert ((rebuilt - rows.double()).abs() <= absmax * BOUND * 1.001).all()
    assert torch.equal(rebuilt[3], torch.zeros(256, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_are_split_as_their_values_in_float32(dtype):
    """A model's activations reach the split in 16 bits, without a float32 copy first: the parts are those of the
    same values in float32."""
    rows = hard_rows()[[0, 1, 2, 3, 6]].to(dtype)  # the rows float16 can hold
    for ours, theirs in zip(split_activations(rows), split_activations(rows.float())):
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def test_the_split_product_is_the_weight_s_product_within_the_split_s_bound():
    """Weights at int8's extremes and the hard rows: each output within the bound its rounding allows, sum over the
    inputs of |w| times the row's bound, and float32's own rounding of the sums."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=g)
    q[0], q[1] = 127, -128
    scales = torch.rand(96, generator=g) + 0.5
    rows = hard_rows()
    weight = dequantize(q, scales).double()
    exact = rows.double() @ weight.t()
    bound = rows.abs().amax(-1, keepdim=True).double() * BOUND * weight.abs().sum(-1)
    y = split_product(rows, pack_int8(q, scales))
    assert y.dtype == torch.float32 and y.shape == (8, 96)
    error = (y.double() - exact).abs()
    assert (error <= bound * 1.001 + exact.abs() * 1e-6).all(), (error / bound).max()


def test_the_split_product_gives_the_same_bits_on_one_thread_and_on_two():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (2048, 1024), dtype=torch.int8, generator=g)
    packed, x = pack_int8(q, torch.rand(2048, generator=g)), torch.randn(64, 1024, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = split_product(x, packed)
        torch.set_num_threads(2)
        two = split_product(x, packed)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_a_weight_packed_in_pieces_gives_the_same_bits_as_packed_whole(monkeypatch):
    g = torch.Generator().manual_seed(4)
    q, scales = torch.randint(-127, 128, (100, 64), dtype=torch.int8, generator=g), torch.rand(100, generator=g)
    x = torch.randn(3, 64, generator=g)
    whole = pack_int8(q, scales)
    monkeypatch.setattr(integer, "PIECE_VALUES", 30 * 64)
    pieces = pack_int8(q, scales)
    assert len(whole) == 1 and len(pieces) == 4  # 30, 30, 30 and 10 rows
    assert torch.equal(split_product(x, pieces), split_product(x, whole))


def test_it_is_offered_for_16_bit_activations_only(process_group):
    """Its rounding of the activations is far below bfloat16's own, not below float32's: a float32 model's int8
    products stay as they were."""
    assert "split" in int8_layer(dtype=torch.bfloat16).products(1)
    assert "split" not in int8_layer(dtype=torch.float32).products(1)


def test_the_copy_for_fbgemm_is_made_only_where_a_chosen_product_reads_it(process_group):
    layer = int8_layer()
    layer.make_chosen_copies({"int8", "widened32"})
    assert layer.packed is None
    layer.make_chosen_copies({"split", "int8"})
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6))
    weight = dequantize(layer.weight, layer.scales).double()
    bound = x.abs().amax(-1, keepdim=True).double() * BOUND * weight.abs().sum(-1)
    assert ((layer.split_product(x).double() - x.double() @ weight.t()).abs() <= bound * 1.001 + 1e-6).all()
    layer.make_chosen_copies({"int8"})
    assert layer.packed is None


@pytest.mark.parametrize("fault", ["no fbgemm", "inexact sums"])
def test_where_fbgemm_is_missing_or_inexact_split_is_not_offered(process_group, monkeypatch, fault):
    """No quantized engine (a build without fbgemm, or PyTorch's quantized tensors gone), or sums that are not the
    integers' (as fbgemm's AVX2 kernels would give for 8-bit levels): the load chooses among the other products."""
    if fault == "no fbgemm":

        def sums(levels, packed):
            raise RuntimeError("Didn't find engine for operation quantized::linear_prepack")

    else:
        real = integer.integer_sums

        def sums(levels, packed):
            return real(levels.clamp(-60, 60), packed)  # as if the largest levels were cut short

    monkeypatch.setattr(integer, "integer_sums", sums)
    split_product_available.cache_clear()
    try:
        assert not split_product_available()
        assert "split" not in int8_layer(dtype=torch.bfloat16).products(1)
    finally:
        split_product_available.cache_clear()


def test_a_model_loaded_on_the_split_product_names_it_gives_the_same_bits_on_every_load_and_stays_close(
    tiny_checkpoint, tokenizer_path, monkeypatch
):
    """A bfloat16 model pinned to "split" (as a load may choose it): its load report names it, a second load gives the
    same bits, and its logits move from those of the int8 weights' exact product (widened to float32, "widened32")
    by less than int8's own rounding of the weights moves them from the unquantized model's."""
    from llama import Llama

    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="bfloat16")
    tokens = torch.tensor([[128000, 791, 6864, 315, 9822, 374]])

    def load(product, **quantize):
        monkeypatch.setenv("LLAMA_QUANTIZED_PRODUCT", product)
        generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build, **quantize)
        return generator.model.forward(tokens, 0)[0].float(), str(generator.load_report)

    split, report = load("split", quantize="int8")
    assert "1 row: split" in report, report
    assert torch.equal(load("split", quantize="int8")[0], split)
    exact, unquantized = load("widened32", quantize="int8")[0], load("")[0]
    assert 0 < (split - exact).abs().mean() < (exact - unquantized).abs().mean() / 2


def slow_copy_and_fast_split(monkeypatch, layer, from_rows: int = 1) -> None:
    """Stand-ins for `layer`'s timed products, the split product 3 ms a call faster than the others from `from_rows`
    rows and 3 ms slower below (a tie would leave the choice to the host's noise), and packing the weight for fbgemm
    made to take 0.2 s (0.1 s a layer on the load's two threads)."""
    from llama.runtime import quantized_kernels

    def stand_in(name):
        def call(x, **values):
            if name != "split":
                time.sleep(0.003)
            elif len(x) < from_rows:
                time.sleep(0.006)
            return x

        return call

    def slow_pack(q, scales):
        time.sleep(0.2)
        return pack_int8(q, scales)

    monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", {name: stand_in(name) for name in layer.products(1)})
    monkeypatch.setattr(quantized_kernels, "pack_int8", slow_pack)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def test_fbgemm_s_copy_is_declined_where_it_would_not_repay_its_making_and_a_later_load_declines_it_alike(
    process_group, tmp_path, monkeypatch, caplog
):
    """Over a context of 4 tokens the copy would cost more than it saves, so the load keeps the next fastest
    product, makes no copy and says why. The copy's time is cached with the timings: a later process declines it
    alike without timing again, and makes it for a context of 4096 tokens."""
    from llama.runtime import quantized_kernels
    from llama.runtime.cpu import KernelCache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layer = int8_layer(dtype=torch.bfloat16)
    slow_copy_and_fast_split(monkeypatch, layer)
    with caplog.at_level(logging.INFO, logger="llama.runtime.quantized_kernels"):
        quantized_kernels.choose_quantized_kernels(layer, max_seq_len=4, decode_rows=1)
    assert "split" not in layer.kernels.values() and layer.packed is None
    assert "No fbgemm copy" in caplog.text and "context of 4 tokens" in caplog.text
    KernelCache.IN_PROCESS.clear()  # as a new process starts: from the file
    monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", {})  # nothing is timed again
    quantized_kernels.choose_quantized_kernels(layer, max_seq_len=4, decode_rows=1)
    assert "split" not in layer.kernels.values() and layer.packed is None
    quantized_kernels.choose_quantized_kernels(layer, max_seq_len=4096, decode_rows=1)
    assert layer.kernels[1] == "split" and layer.packed is not None


@pytest.mark.parametrize(
    "from_rows, decode_rows, max_seq_len, repaid",
    [
        (1, 1, 4096, True),  # 3 ms a token for 4096 tokens
        (64, 1, 1024, False),  # prompts only: 16 prompts of 64 tokens save 48 ms
        (64, 1, 8192, True),  # 128 prompts, 0.38 s
        (8, 1, 128, False),  # one sequence decodes a row a step: 8 rows are a prompt's, 16 of them save 48 ms
        (8, 8, 128, True),  # a batch of 8: a decode step a token, 0.38 s
    ],
)
def test_fbgemm_s_copy_is_made_where_it_repays_its_making_over_the_context_s_decode_steps_and_prompts(
    process_group, tmp_path, monkeypatch, from_rows, decode_rows, max_seq_len, repaid
):
    """The split product 3 ms a call faster than the others from `from_rows` rows on, its copy 0.1 s to make: it is
    chosen, and the copy made, where the time it saves over a full context repays that."""
    from llama.runtime import quantized_kernels

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layer = int8_layer(dtype=torch.bfloat16)
    slow_copy_and_fast_split(monkeypatch, layer, from_rows)
    quantized_kernels.choose_quantized_kernels(layer, max_seq_len=max_seq_len, decode_rows=decode_rows)
    won = [rows for rows in quantized_kernels.CPU_TIMED_ROWS if rows >= from_rows]
    assert [rows for rows, product in layer.kernels.items() if product == "split"] == (won if repaid else [])
    assert (layer.packed is not None) == repaid
