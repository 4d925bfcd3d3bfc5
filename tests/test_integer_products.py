"""int8 weights multiplied in integers on the CPU ("fbgemm_int8", `llama.runtime.cpu.integer`): the activations
written as two parts of 7-bit levels, both multiplied by fbgemm's integer kernel. What a user relies on: the product
is the weight-only product but for a rounding of the activations bounded by 1/15,876 of each row's largest magnitude;
it does not depend on the thread count; it runs only where fbgemm's sums are exact, and a layer the table gives it runs
PyTorch's int8 kernel elsewhere.

The module skips only where this torch build has no fbgemm integer kernel at all; where it has one, sums that are not
exact fail `test_fbgemm_sums_the_largest_levels_exactly`, never skip."""

import pytest
import torch
from helpers import int8_layer

from llama.quantize import dequantize
from llama.runtime.cpu import integer
from llama.runtime.cpu.integer import (
    exact_integer_sums,
    fbgemm_integer_kernel,
    pack_int8,
    two_part_product,
    two_part_product_available,
    two_parts,
)
from llama.runtime.steps import use_table_kernels

pytestmark = pytest.mark.skipif(
    not fbgemm_integer_kernel(), reason="this torch build reaches no fbgemm integer kernel (no quantized engine)"
)

BOUND = 1 / (63 * 126 * 2)  # the two parts' largest error, as a share of the row's largest magnitude


def hard_rows() -> torch.Tensor:
    """Rows that stress the two parts of a row: plain, one outlier, all one sign, all zero, tiny, huge, a value at a
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
    parts, step = two_parts(rows)
    coarse, fine = parts[: len(rows)], parts[len(rows) :]
    for levels in (coarse, fine):
        assert torch.equal(levels, levels.round()) and levels.abs().max() <= 63
    rebuilt = (coarse.double() + fine.double() / 126) * step.double()
    absmax = rows.abs().amax(-1, keepdim=True).double()
    assert ((rebuilt - rows.double()).abs() <= absmax * BOUND * 1.001).all()
    assert torch.equal(rebuilt[3], torch.zeros(256, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_are_split_as_their_values_in_float32(dtype):
    """A model's activations reach the two parts in 16 bits, without a float32 copy first: the parts are those of the
    same values in float32."""
    rows = hard_rows()[[0, 1, 2, 3, 6]].to(dtype)  # the rows float16 can hold
    for ours, theirs in zip(two_parts(rows), two_parts(rows.float())):
        assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def test_the_two_part_product_is_the_weight_s_product_within_the_parts_bound():
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
    y = two_part_product(rows, pack_int8(q, scales))
    assert y.dtype == torch.float32 and y.shape == (8, 96)
    error = (y.double() - exact).abs()
    assert (error <= bound * 1.001 + exact.abs() * 1e-6).all(), (error / bound).max()


def test_the_two_part_product_gives_the_same_bits_on_one_thread_and_on_two():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (2048, 1024), dtype=torch.int8, generator=g)
    packed, x = pack_int8(q, torch.rand(2048, generator=g)), torch.randn(64, 1024, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = two_part_product(x, packed)
        torch.set_num_threads(2)
        two = two_part_product(x, packed)
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
    assert torch.equal(two_part_product(x, pieces), two_part_product(x, whole))


def test_fbgemm_sums_the_largest_levels_exactly():
    """Where fbgemm is present its integer sums must be exact (weights at int8's extremes times the parts' largest
    levels): sums cut short would run as PyTorch's int8 kernel instead, and that must show here as a failure, not as
    "fbgemm_int8" quietly missing from every load."""
    assert exact_integer_sums()
    assert two_part_product_available()


def test_it_runs_for_16_bit_activations_only(process_group):
    """Its rounding of the activations is far below bfloat16's own, not below float32's: a float32 model's int8
    products stay as they were."""
    assert int8_layer(dtype=torch.bfloat16).runs("fbgemm_int8")
    assert int8_layer(dtype=torch.float16).runs("fbgemm_int8")
    assert not int8_layer(dtype=torch.float32).runs("fbgemm_int8")


def test_the_copy_for_fbgemm_is_made_only_where_a_kernel_of_the_layer_reads_it(process_group):
    layer = int8_layer(dtype=torch.bfloat16)
    layer.kernels = ("int8", "int8", "widened32", "widened32")
    layer.make_copies()
    assert layer.packed is None and layer.copy_bytes() == 0
    layer.kernels = ("fbgemm_int8", "fbgemm_int8", "widened", "widened")
    layer.make_copies()
    assert layer.packed is not None and layer.copy_bytes() == layer.weight.numel()
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    weight = dequantize(layer.weight, layer.scales).double()
    exact = x.double() @ weight.t()
    bound = x.abs().amax(-1, keepdim=True).double() * BOUND * weight.abs().sum(-1)
    y = layer(x)  # 3 rows: the 2-16 rows class, on fbgemm's copy
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= bound * 1.001 + exact.abs() * 2**-8).all()  # and bfloat16's rounding
    layer.kernels = ("int8",) * 4
    layer.make_copies()
    assert layer.packed is None and layer.copy_bytes() == 0


@pytest.mark.parametrize("fault", ["no fbgemm", "inexact sums", "another engine"])
def test_where_fbgemm_is_missing_or_inexact_a_layer_the_table_gives_it_runs_pytorch_s_int8_kernel(
    process_group, monkeypatch, fault
):
    """No quantized engine (a build without fbgemm, or PyTorch's quantized tensors gone), another quantized engine
    set (`torch.backends.quantized.engine`), or sums that are not the integers' (as fbgemm's AVX2 kernels would give
    for 8-bit levels): "fbgemm_int8" is not run, a layer the table gives it runs "int8" in those row classes, makes
    no copy, and computes the weight's product."""
    import llama.runtime.steps as steps

    if fault == "another engine":
        engines = torch.backends.quantized.supported_engines
        other = next((engine for engine in ("qnnpack", "onednn") if engine in engines), None)
        if other is None:
            pytest.skip("this torch build has no quantized engine but fbgemm's")
        monkeypatch.setattr(torch.backends.quantized, "engine", other)
    elif fault == "no fbgemm":

        def pack(q, scales):
            raise RuntimeError("Didn't find engine for operation quantized::linear_prepack")

        monkeypatch.setattr(integer, "pack_int8", pack)
    else:
        real = integer.integer_sums

        def sums(levels, packed):
            return real(levels.clamp(-60, 60), packed)  # as if the largest levels were cut short

        monkeypatch.setattr(integer, "integer_sums", sums)
    monkeypatch.setattr(steps, "table_kernels", lambda device, weights: ("fbgemm_int8", "fbgemm_int8", "int8", "int8"))
    fbgemm_integer_kernel.cache_clear()
    two_part_product_available.cache_clear()
    try:
        if fault != "another engine":  # there, whether the dependency counts as present is the library's choice
            assert fbgemm_integer_kernel() == (fault == "inexact sums")
        assert not two_part_product_available()
        layer = int8_layer(dtype=torch.bfloat16)
        assert not layer.runs("fbgemm_int8")
        use_table_kernels(layer)
        assert layer.kernels == ("int8",) * 4 and layer.packed is None
        x = torch.randn(1, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
        expected = x.double() @ dequantize(layer.weight, layer.scales).double().t()
        torch.testing.assert_close(layer(x).double(), expected, atol=1e-2, rtol=1e-2)
    finally:
        fbgemm_integer_kernel.cache_clear()
        two_part_product_available.cache_clear()


@pytest.mark.slow
def test_a_model_loaded_on_fbgemm_int8_names_it_gives_the_same_bits_on_every_load_and_stays_close(
    tiny_checkpoint, tokenizer_path, monkeypatch
):
    """A bfloat16 int8 model pinned to "fbgemm_int8" (the table's kernel for one row and a batch): its load report
    names it, a second load gives the same bits, and its logits move from those of the int8 weights' exact product
    (widened to float32, "widened32") by less than int8's own rounding of the weights moves them from the unquantized
    model's."""
    from llama import Llama

    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="bfloat16")
    tokens = torch.tensor([[128000, 791, 6864, 315, 9822, 374]])

    def load(kernel, **quantize):
        monkeypatch.setenv("LLAMA_CPU_KERNEL", kernel)
        generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build, **quantize)
        return generator.model.forward(tokens, 0)[0].float(), str(generator.load_report)

    two_parts_logits, report = load("fbgemm_int8", quantize="int8")
    assert "1 row: fbgemm_int8" in report and "128+ rows: fbgemm_int8" in report, report
    assert torch.equal(load("fbgemm_int8", quantize="int8")[0], two_parts_logits)
    exact, unquantized = load("widened32", quantize="int8")[0], load("")[0]
    assert 0 < (two_parts_logits - exact).abs().mean() < (exact - unquantized).abs().mean() / 2
