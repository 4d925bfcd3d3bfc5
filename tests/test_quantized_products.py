"""A quantized layer's kernels (`Int8Linear.KERNELS`, `Int4Linear.KERNELS`) and the one each row class runs, by the
kernel table (`llama.runtime.kernel_table`).

Every kernel must compute the dequantized weight's product, whichever the table gives a row class: the CPU runs
them all (PyTorch's int8 and int4 kernels, the weight widened a block at a time, fbgemm's integer product in
test_integer_products.py); the GPU tests run the table's CUDA kernels and the CUDA graphs over them.
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from helpers import GQA_PARAMS, int8_layer

from llama.checkpoint import load_model, model_args_from, open_checkpoint, random_weights, write_meta_checkpoint
from llama.quantize import dequantize, quantize_int4, unpack_nibbles
from llama.runtime import for_runtime, kernel_table, quantize_model
from llama.runtime.cpu.integer import fbgemm_integer_kernel
from llama.runtime.cpu.widened import cpu_int4_block_rows, unpack_cpu_int4
from llama.runtime.kernel_table import AVX2, AVX512_BF16, CPUOffers, table_kernels
from llama.runtime.quantized import Int4Linear, Int8Linear, QuantizedLinear, dequantized_int4_weight
from llama.runtime.steps import use_table_kernels


def int4_layer(rows: int, cols: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """An int4 layer (groups of 32, scales in `dtype`, its activations' dtype) of a random weight, and the values it
    was quantized to."""
    layer = ColumnParallelLinear(cols, rows, bias=False, gather_output=False, init_method=lambda x: x)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(6 + seed)) * 0.05
    values = quantize_int4(weight, 32, dtype)
    return Int4Linear(layer, *values), values


def runnable(layer: QuantizedLinear) -> set:
    return {kernel for kernel in layer.KERNELS if layer.runs(kernel)}


@pytest.mark.parametrize("rows", [1, 8])
def test_every_int8_kernel_computes_the_dequantized_weights_product(process_group, rows):
    layer = int8_layer()
    expected_weight = dequantize(layer.weight, layer.scales)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    expected = x @ expected_weight.t()
    # On the CPU, for float32 activations ("fbgemm_int8" takes 16-bit ones only: test_integer_products.py); a GPU
    # has "compiled" instead of "widened32"
    assert runnable(layer) == {"int8", "widened", "widened32"}
    with torch.inference_mode():  # as decoding runs them
        for name in runnable(layer):
            torch.testing.assert_close(layer.KERNELS[name](layer, x), expected, atol=1e-4, rtol=1e-4, msg=name)


# What the CPU offers, as the table knows it (the flags are for the load report only).
CPUS = {
    AVX512_BF16: CPUOffers("AVX512", True, ("avx512_bf16",)),
    AVX2: CPUOffers("AVX2", False, ()),
    "unknown": CPUOffers("DEFAULT", False, ()),
}
# (the CPU, the layer) -> its kernel in each row class. fbgemm's integer product where this torch build has fbgemm
# (whose sums must then be exact: test_integer_products.py), PyTorch's int8 kernel where not; bfloat16 widened only
# where oneDNN multiplies bfloat16.
FBGEMM_INT8 = "fbgemm_int8" if fbgemm_integer_kernel() else "int8"
EXPECTED = {
    (AVX512_BF16, "int8 bfloat16"): (FBGEMM_INT8, FBGEMM_INT8, "widened", "widened"),
    (AVX512_BF16, "int4 bfloat16"): ("int4pack", "int4pack", "int4pack", "widened"),
    (AVX2, "int8 bfloat16"): (FBGEMM_INT8, FBGEMM_INT8, "widened32", "widened32"),
    (AVX2, "int4 bfloat16"): ("int4pack", "int4pack", "int4pack", "widened32"),
}
DEFAULTS = {"int8": ("int8",) * 4, "int4": ("int4pack",) * 4}  # a CPU or weights the table does not know
# Inputs of each row class, as (batch, positions): 1 row; 2 and 16; 17 and 127; 128 and 300.
SHAPES = [((1, 1), 0), ((2, 1), 1), ((2, 8), 1), ((1, 17), 2), ((1, 127), 2), ((2, 64), 3), ((1, 300), 3)]


def quantized_layer(layer: str):
    """A layer of 128 outputs and 256 inputs: "int8 bfloat16", "int8 float32", "int4 bfloat16"."""
    scheme, dtype = layer.split()
    dtype = getattr(torch, dtype)
    if scheme == "int8":
        made = int8_layer(rows=128, cols=256, dtype=dtype)
        return made, dequantize(made.weight, made.scales)
    made, values = int4_layer(rows=128, cols=256, dtype=dtype)
    return made, dequantize(*values)


@pytest.mark.parametrize("layer_kind", ["int8 bfloat16", "int8 float32", "int4 bfloat16"])
@pytest.mark.parametrize("cpu", list(CPUS))
def test_each_row_class_runs_the_kernel_the_table_gives_it(process_group, monkeypatch, cpu, layer_kind):
    """The same layer gets the table's row for the CPU and its weights, and each call runs the kernel of its row
    class (rows counted over the batch and positions), which gives the dequantized weight's product. On an AVX2 CPU
    nothing is widened to bfloat16 (its products there take seconds on a prompt); a float32 model's int8 weights,
    and every layer on a CPU the table does not know, run PyTorch's own kernel; fbgemm's copy of an int8 weight is
    made only where a row class runs on it."""
    monkeypatch.setattr(kernel_table, "cpu_offers", lambda: CPUS[cpu])
    layer, weight = quantized_layer(layer_kind)
    use_table_kernels(layer)
    expected = EXPECTED.get((cpu, layer_kind), DEFAULTS[layer_kind.split()[0]])
    assert layer.kernels == expected
    if isinstance(layer, Int8Linear):
        assert (layer.packed is not None) == ("fbgemm_int8" in expected)
    ran = []

    def recording(name, kernel):
        return lambda layer, x: ran.append(name) or kernel(layer, x)

    layer.KERNELS = {name: recording(name, kernel) for name, kernel in type(layer).KERNELS.items()}
    dtype = layer.activation_dtype()
    for (batch, positions), row_class in SHAPES:
        x = torch.randn(batch, positions, 256, generator=torch.Generator().manual_seed(positions)).to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert ran.pop() == expected[row_class], (batch, positions)
        exact = (x.double() @ weight.double().t()).to(dtype)
        assert y.shape == (batch, positions, 128) and y.dtype == dtype
        torch.testing.assert_close(y, exact, atol=0.02, rtol=0.02, msg=(batch, positions))


def test_a_pinned_kernel_runs_every_row_class_of_every_layer_that_has_it(process_group, monkeypatch):
    """`LLAMA_CPU_KERNEL` pins one kernel for every CPU layer that has it, int8 and int4 alike; a layer that has
    none of that name, or that it cannot run (fbgemm's for float32 activations), keeps the table's or PyTorch's."""
    monkeypatch.setattr(kernel_table, "cpu_offers", lambda: CPUS[AVX512_BF16])
    layers = torch.nn.ModuleList(
        [quantized_layer("int8 bfloat16")[0], quantized_layer("int4 bfloat16")[0], quantized_layer("int8 float32")[0]]
    )
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "widened32")
    use_table_kernels(layers)
    assert [layer.kernels for layer in layers] == [("widened32",) * 4] * 3
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fbgemm_int8")
    use_table_kernels(layers)
    expected = [(FBGEMM_INT8,) * 4, EXPECTED[(AVX512_BF16, "int4 bfloat16")], ("int8",) * 4]
    assert [layer.kernels for layer in layers] == expected
    assert (layers[0].packed is not None) == (FBGEMM_INT8 == "fbgemm_int8") and layers[2].packed is None


def test_the_cpu_widens_int8_prompts_in_blocks_to_the_same_product(process_group):
    """A weight of more rows than one block (`chunk_rows`): its blocks' products, joined, are the whole product, in
    the activations' dtype or in float32; for bfloat16 activations the float32 one, rounded once, is the closer."""
    layer = int8_layer(rows=2100, cols=1024)  # blocks of 2048 rows, then 52
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(8))
    expected = x @ dequantize(layer.weight, layer.scales).t()
    names = ("widened", "widened32")
    for name in names:
        torch.testing.assert_close(layer.KERNELS[name](layer, x), expected, atol=1e-4, rtol=1e-4, msg=name)
    layer.scales = layer.scales.bfloat16()
    in_bf16 = x.bfloat16()
    exact = in_bf16.double() @ dequantize(layer.weight, layer.scales).double().t()
    errors = {}
    for name in names:
        y = layer.KERNELS[name](layer, in_bf16)
        assert y.dtype == torch.bfloat16 and y.is_contiguous()
        errors[name] = float((y.double() - exact).abs().mean())
    assert errors["widened32"] < 0.9 * errors["widened"], errors


def test_the_cpu_widens_int4_prompts_in_blocks_to_the_same_product(process_group):
    """The CPU kernel's layout is read back to the levels it was made from, and the widened product of a weight of
    several blocks (`chunk_rows`) is the dequantized weight's, as PyTorch's int4 kernel's is."""
    layer, (nibbles, scales, zeros) = int4_layer(rows=4160, cols=1024)  # blocks of 2048 rows, 2048, then 64
    block_rows = cpu_int4_block_rows()
    assert block_rows is not None and runnable(layer) == {"int4pack", "widened", "widened32"}
    assert torch.equal(unpack_cpu_int4(layer.weight, block_rows), unpack_nibbles(nibbles))
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(9))
    weight = dequantize(nibbles, scales, zeros)
    expected = x @ weight.t()
    for name in ("widened32", "widened", "int4pack"):  # float32 activations
        torch.testing.assert_close(layer.KERNELS[name](layer, x), expected, atol=1e-4, rtol=1e-4, msg=name)
    assert layer.widened32(x.bfloat16()).dtype == torch.bfloat16
    # In bfloat16, "widened" multiplies the dequantized weight rounded once to bfloat16.
    y = layer.widened(x.bfloat16())
    assert y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x.bfloat16(), weight.bfloat16()))


def widened_cases(x_rows: int, seed: int = 0):
    """An int8 and an int4 layer of two blocks or more each (`chunk_rows`), weights of `seed`: each one's widened
    product, an input of `x_rows` rows and the product expected of it."""
    int8 = int8_layer(rows=2100, cols=1024, seed=seed)
    int4, (nibbles, scales, zeros) = int4_layer(rows=2112, cols=1024, seed=seed)
    x = torch.randn(x_rows, 1024, generator=torch.Generator().manual_seed(x_rows + seed))
    return [
        (int8.widened32, x, x @ dequantize(int8.weight, int8.scales).t()),
        (int4.widened32, x, x @ dequantize(nibbles, scales, zeros).t()),
    ]


def test_widened_products_run_alike_inside_and_outside_inference_mode(process_group):
    """Their buffers are reused from call to call: one first made while generating (in inference mode) must still
    take a later product outside it (a user's own forward pass, a test under `torch.no_grad`)."""
    cases = widened_cases(6)
    for mode in (torch.inference_mode, torch.no_grad, torch.enable_grad):
        with mode():
            for product, x, expected in cases:
                torch.testing.assert_close(product(x), expected, atol=1e-4, rtol=1e-4)


def test_widened_products_in_two_threads_at_once_each_give_their_own_product(process_group):
    """Two threads (two requests a server runs at once) widen their weights at the same time: each must multiply
    by its own weight, not by a block the other thread wrote into a buffer they shared."""
    failures, start = [], threading.Barrier(2)

    def run(cases):
        start.wait()
        for _ in range(20):
            for product, x, expected in cases:
                y = product(x)
                if not torch.allclose(y, expected, atol=1e-4, rtol=1e-4):
                    failures.append(float((y - expected).abs().max()))

    threads = [threading.Thread(target=run, args=(widened_cases(3, seed),)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, f"{len(failures)} of 80 products wrong, by up to {max(failures):.3g}"


def test_int4_widening_is_the_dequantized_weight_in_the_activations_dtype(process_group):
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    assert dequantized_int4_weight(*quantize_int4(weight, 64, torch.bfloat16)).dtype == torch.bfloat16
    # the values the int4 kernel computes with
    layer = ColumnParallelLinear(256, 64, bias=False, gather_output=False, init_method=lambda x: x)
    layer.weight.data.copy_(weight)
    int4 = Int4Linear(layer, *quantize_int4(weight, 64, torch.float32))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    expected = F.linear(x, dequantized_int4_weight(*quantize_int4(weight, 64, torch.float32)))
    torch.testing.assert_close(int4(x), expected, atol=1e-4, rtol=1e-4)


def quantized_cuda_model(tmp_path, scheme: str, max_batch_size: int = 2, max_seq_len: int = 32):
    write_meta_checkpoint(tmp_path / "ckpt", GQA_PARAMS, random_weights(GQA_PARAMS, seed=31))
    reader = open_checkpoint(tmp_path / "ckpt")
    args = model_args_from(reader.params, max_seq_len=max_seq_len, max_batch_size=max_batch_size)[0]
    reference = load_model(reader, args, 0, 1, torch.device("cuda"), torch.bfloat16)
    return for_runtime(quantize_model(reference, scheme), cuda_graphs=True)


def table_or_default(layer: QuantizedLinear):
    """The CUDA table's kernels for `layer` (on an H100: CUDA_TABLE's row), or its default in every row class."""
    return table_kernels(layer.weight.device, layer.weights()) or (layer.default_kernel(),) * 4


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_each_row_class_s_table_kernel_on_the_gpu_gives_the_dequantized_logits(process_group, tmp_path, scheme):
    """Each layer runs the CUDA table's kernel in each row class; a prompt of each row class gives the logits of
    PyTorch's own kernels (the default) within bfloat16's rounding. An int4 layer keeps its quantized values' second
    copy only where a row class reads it ("dequantized")."""
    model, _ = quantized_cuda_model(tmp_path, scheme, max_seq_len=96)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers
    for layer in layers:
        assert layer.kernels == table_or_default(layer), layer.weights()
        if isinstance(layer, Int4Linear):
            assert hasattr(layer, "nibbles") == ("dequantized" in layer.kernels)
    table = {layer: layer.kernels for layer in layers}
    generator = torch.Generator().manual_seed(4)
    for batch, positions in ((1, 1), (2, 4), (2, 20), (2, 80)):  # 1, 8, 40 and 160 rows
        tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (batch, positions), generator=generator).cuda()
        with torch.inference_mode():
            for layer in layers:
                layer.kernels = table[layer]
            table_logits = model(tokens, 0).float()
            for layer in layers:
                layer.kernels = (layer.default_kernel(),) * 4
            default_logits = model(tokens, 0).float()
        assert (table_logits - default_logits).abs().max() < 0.05 * default_logits.abs().max(), (batch, positions)
    for layer in layers:
        layer.kernels = table[layer]


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_graphs_replay_the_table_s_quantized_kernels_bit_for_bit(process_group, tmp_path, scheme):
    """A decode step of one sequence and of two (the 1-row and 2-16 rows classes), replayed as CUDA graphs: the
    eager step's logits bit for bit, on the table's kernels."""
    model, step = quantized_cuda_model(tmp_path, scheme)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert all(layer.kernels == table_or_default(layer) for layer in layers)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(6)).cuda()
    for batch in (1, 2):
        with torch.inference_mode():
            model(tokens[:batch, :8], 0)
            position = torch.tensor([8], device="cuda")
            eager = model.decode_step(tokens[:batch, 8:9], position)
            model(tokens[:batch, :8], 0)  # the same cache again
            assert torch.equal(step(tokens[:batch, 8:9], position), eager), batch
