"""A quantized layer's ways to compute its product on a GPU (`QuantizedLinear.products`), the one chosen for each
row count (`kernels`), and the runtime's timed choice (`llama.runtime.choose_quantized_kernels`).

Every product must compute the dequantized weight's product, whichever the timing picks: the CPU runs them all
(PyTorch's int8 kernel, the widened weight, the compiled "fused" product, the compiled int4 widening); the GPU
tests run the timing itself and the CUDA graphs over the chosen products.
"""

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from helpers import GQA_PARAMS, int8_layer

from llama.checkpoint import load_model, model_args_from, open_checkpoint, random_weights, write_meta_checkpoint
from llama.quantize import dequantize, quantize_int4, unpack_nibbles
from llama.runtime import for_runtime, quantize_model
from llama.runtime.cpu import onednn_bf16_supported
from llama.runtime.cpu.widened import cpu_int4_block_rows, unpack_cpu_int4
from llama.runtime.quantized import Int4Linear, QuantizedLinear, dequantized_int4_weight
from llama.runtime.quantized_kernels import CPU_INT4_PRODUCTS, TIMED_ROWS, fastest

CHOSEN_FOR = dict(max_seq_len=4096, decode_rows=8)  # the context and batch the layers' products are chosen for


@pytest.mark.parametrize("rows", [1, 8])
def test_every_int8_product_computes_the_dequantized_weights_product(process_group, rows):
    layer = int8_layer()
    expected_weight = dequantize(layer.weight, layer.scales)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    expected = x @ expected_weight.t()
    # On the CPU ("widened" in the activations' dtype only where oneDNN multiplies bfloat16); a GPU has "fused"
    in_bfloat16 = {"widened", "widened_left"}
    # "split" for 16-bit activations only (test_integer_products.py)
    assert set(layer.products(rows)) - in_bfloat16 == {"int8", "widened32", "widened32_left"}
    assert (in_bfloat16 <= set(layer.products(rows))) == onednn_bf16_supported()
    every = dict(widened=layer.widened_product, widened_left=layer.widened_left_product, fused=layer.fused_product)
    products = {**every, **layer.products(rows)}
    with torch.inference_mode():  # as decoding runs them
        for name, product in products.items():
            torch.testing.assert_close(product(x), expected, atol=1e-4, rtol=1e-4, msg=name)


def test_each_row_count_runs_the_product_chosen_for_it(process_group):
    layer = int8_layer()
    assert layer.kernel_for(1) == layer.kernel_for(4096) == "int8"  # unmeasured: the CPU's default
    layer.kernels = {1: "int8", 8: "widened32", 64: "int8"}
    chosen = [layer.kernel_for(rows) for rows in (1, 2, 8, 9, 64, 5000)]
    assert chosen == ["int8", "widened32", "widened32", "int8", "int8", "int8"]
    ran = []
    for name in ("int8", "widened32"):
        setattr(layer, f"{name}_product", lambda x, name=name: ran.append(name) or x[..., :96])
    for rows in (1, 3, 100):
        layer(torch.zeros(rows, 128))
    assert ran == ["int8", "widened32", "int8"]


def test_the_cpu_widens_int8_prompts_in_blocks_to_the_same_product(process_group):
    """A weight of more rows than one block (`chunk_rows`): its blocks' products, joined, are the whole product, in
    the activations' dtype or in float32; for bfloat16 activations the float32 one, rounded once, is the closer."""
    layer = int8_layer(rows=2100, cols=1024)  # blocks of 2048 rows, then 52
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(8))
    expected = x @ dequantize(layer.weight, layer.scales).t()
    names = ("widened", "widened32", "widened_left", "widened32_left")
    for name in names:
        torch.testing.assert_close(getattr(layer, f"{name}_product")(x), expected, atol=1e-4, rtol=1e-4, msg=name)
    layer.scales = layer.scales.bfloat16()
    in_bf16 = x.bfloat16()
    exact = in_bf16.double() @ dequantize(layer.weight, layer.scales).double().t()
    errors = {}
    for name in names:
        y = getattr(layer, f"{name}_product")(in_bf16)
        assert y.dtype == torch.bfloat16 and y.is_contiguous()
        errors[name] = float((y.double() - exact).abs().mean())
    for order in ("", "_left"):
        assert errors[f"widened32{order}"] < 0.9 * errors[f"widened{order}"], errors


def products_where(faster: str) -> dict:
    """CPU int8 products (stand-ins) of which `faster` takes no time and the other 3 ms."""

    def slow(x, **values):
        time.sleep(0.003)
        return x

    names = ("int8", "split", "widened", "widened32", "widened_left", "widened32_left")
    return {name: (lambda x, **values: x) if name == faster else slow for name in names}


def test_a_decode_step_s_products_are_timed_from_memory_each_on_a_weight_of_its_own(
    process_group, tmp_path, monkeypatch
):
    """At one row and a batch's, every product is timed on a larger sample, a copy of its own that no other product
    reads into the cache, which is flushed before each round, each timed call right after a call of the same product
    on a few rows of its own (its code back in the cache, its timed sample not): as a decode step meets each weight,
    in memory. At a prompt's rows, on a smaller sample of the weight itself, without flushes."""
    from llama.runtime import quantized_kernels

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(quantized_kernels, "CPU_DECODE_SAMPLE_VALUES", 64 * 128)  # 64 of the layer's 96 rows
    monkeypatch.setattr(quantized_kernels, "CPU_SAMPLE_VALUES", 16 * 128)
    monkeypatch.setattr(quantized_kernels, "WARM_ROWS", 8)
    events = []  # "flush", or (input rows, product, sample rows, the sample's storage) for each call

    def product(name):
        def call(x, **values):
            if "q" in values:  # "split" runs on fbgemm's copy instead
                events.append((len(x), name, len(values["q"]), values["q"].untyped_storage().data_ptr()))
            return x

        return call

    layer = int8_layer()
    monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", {name: product(name) for name in layer.products(1)})
    monkeypatch.setattr(quantized_kernels, "CacheFlush", lambda: lambda: events.append("flush"))
    quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
    recorded = len(set(layer.products(1)) - {"split"})  # the products that read the int8 values
    # each flush with the input rows of the call after it
    tagged = [
        (next(e for e in events[i:] if e != "flush")[0], e) if e == "flush" else (e[0], e) for i, e in enumerate(events)
    ]
    for rows in (1, 8):
        calls = [event for at, event in tagged if at == rows]
        flushes = [i for i, event in enumerate(calls) if event == "flush"]
        assert len(flushes) == 3  # one a timed round
        timed = {event[3] for event in calls if event != "flush" and event[2] == 64}
        assert len(timed) == recorded and layer.weight.untyped_storage().data_ptr() not in timed
        rounds = [calls[i + 1 : end] for i, end in zip(flushes, flushes[1:] + [len(calls)])]
        for round_calls in rounds:  # each timed call right after the same product's call on 8 rows of its own
            warm, then = round_calls[0::2], round_calls[1::2]
            assert [event[1] for event in warm] == [event[1] for event in then]
            assert {event[2] for event in warm} == {8} and not {event[3] for event in warm} & timed
            assert {event[2] for event in then} == {64}
        # every product in the first round; one more than twice as slow as the best may sit out the later ones
        named = [{event[1] for event in round_calls} for round_calls in rounds]
        assert len(named[0]) == recorded and named[0] >= named[1] >= named[2]
    for rows in (64, 256):
        samples = {(event[2], event[3]) for event in events if event != "flush" and event[0] == rows}
        assert samples == {(16, layer.weight.untyped_storage().data_ptr())}
    assert events.count("flush") == 6  # 3 rounds each at 1 and 8 rows, none at 64 or 256


def test_the_cpu_chooses_an_int8_product_per_row_count_by_timing_them(process_group, tmp_path, monkeypatch):
    """Timed on a sample of each weight's rows: whichever product is faster at a row count runs it."""
    from llama.runtime import quantized_kernels

    layer = int8_layer()
    for faster in layer.products(64):  # "widened" only where oneDNN multiplies bfloat16
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / faster))  # a machine that has measured nothing
        monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", products_where(faster))
        quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
        assert layer.kernels == {rows: faster for rows in quantized_kernels.CPU_TIMED_ROWS}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_nothing_is_widened_to_bfloat16_without_onednns_kernels(process_group, tmp_path, monkeypatch, scheme):
    """On AVX2 the bfloat16 product of the widened buffer takes seconds: the load must not even time it."""
    from llama.runtime import quantized, quantized_kernels

    def never(x, **values):
        raise AssertionError("the bfloat16 widened product was timed")

    monkeypatch.setattr(quantized, "onednn_bf16_supported", lambda: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    table = "CPU_INT8_PRODUCTS" if scheme == "int8" else "CPU_INT4_PRODUCTS"
    in_bfloat16 = {"widened", "widened_left"}
    monkeypatch.setattr(
        quantized_kernels, table, {**getattr(quantized_kernels, table), **dict.fromkeys(in_bfloat16, never)}
    )
    layer = int8_layer() if scheme == "int8" else int4_layer(rows=128, cols=256)[0]
    quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
    assert not in_bfloat16 & (set(layer.products(64)) | set(layer.kernels.values()))


def test_an_int8_choice_once_timed_is_kept_by_every_later_load(process_group, tmp_path, monkeypatch):
    """The products round differently, so the first timing's choice is cached and every later choice on this
    machine (in this process, or a new one reading the file) is the same, though the products now time otherwise."""
    from llama.runtime import quantized_kernels
    from llama.runtime.cpu import KernelCache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layer = int8_layer()
    monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", products_where("widened32"))
    quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
    first = layer.kernels
    monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", products_where("int8"))
    quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
    assert layer.kernels == first == {rows: "widened32" for rows in quantized_kernels.CPU_TIMED_ROWS}
    KernelCache.IN_PROCESS.clear()  # as a new process starts: from the file
    quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
    assert layer.kernels == first


def int4_layer(rows: int, cols: int, seed: int = 0):
    """An int4 layer (groups of 32) of a random weight, and the values it was quantized to."""
    layer = ColumnParallelLinear(cols, rows, bias=False, gather_output=False, init_method=lambda x: x)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(6 + seed)) * 0.05
    values = quantize_int4(weight, 32, torch.float32)
    return Int4Linear(layer, *values), values


def test_the_cpu_widens_int4_prompts_in_blocks_to_the_same_product(process_group):
    """The CPU kernel's layout is read back to the levels it was made from, and the widened product of a weight of
    several blocks (`chunk_rows`) is the dequantized weight's, as PyTorch's int4 kernel's is."""
    layer, (nibbles, scales, zeros) = int4_layer(rows=4160, cols=1024)  # blocks of 2048 rows, 2048, then 64
    block_rows = cpu_int4_block_rows()
    # "widened" (in the activations' dtype) only where oneDNN multiplies bfloat16
    in_bfloat16 = {"widened", "widened_left"}
    assert block_rows is not None and set(layer.products(64)) - in_bfloat16 == {
        "tinygemm",
        "widened32",
        "widened32_left",
    }
    assert (in_bfloat16 <= set(layer.products(64))) == onednn_bf16_supported()
    assert torch.equal(unpack_cpu_int4(layer.weight, block_rows), unpack_nibbles(nibbles))
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(9))
    weight = dequantize(nibbles, scales, zeros)
    expected = x @ weight.t()
    widened = [layer.widened32_product, layer.widened_product, layer.widened32_left_product, layer.widened_left_product]
    for product in [*widened, layer.tinygemm_product]:  # float32 activations
        torch.testing.assert_close(product(x), expected, atol=1e-4, rtol=1e-4)
    assert (
        layer.widened32_product(x.bfloat16()).dtype
        == layer.widened32_left_product(x.bfloat16()).dtype
        == torch.bfloat16
    )
    # In bfloat16, "widened" multiplies the dequantized weight rounded once to bfloat16.
    for product in (layer.widened_product, layer.widened_left_product):
        y = product(x.bfloat16())
        assert y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x.bfloat16(), weight.bfloat16()))


def widened_cases(x_rows: int, seed: int = 0):
    """An int8 and an int4 layer of two blocks or more each (`chunk_rows`), weights of `seed`: each one's widened
    product, an input of `x_rows` rows and the product expected of it."""
    int8 = int8_layer(rows=2100, cols=1024, seed=seed)
    int4, (nibbles, scales, zeros) = int4_layer(rows=2112, cols=1024, seed=seed)
    x = torch.randn(x_rows, 1024, generator=torch.Generator().manual_seed(x_rows + seed))
    return [
        (int8.widened32_product, x, x @ dequantize(int8.weight, int8.scales).t()),
        (int4.widened32_product, x, x @ dequantize(nibbles, scales, zeros).t()),
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


def test_the_cpu_chooses_an_int4_product_per_row_count_by_timing_them(process_group, tmp_path, monkeypatch):
    from llama.runtime import quantized_kernels

    def slow(x, **values):
        time.sleep(0.003)
        return x

    layer, _ = int4_layer(rows=128, cols=256)
    names = set(layer.products(64))  # "widened" only where oneDNN multiplies bfloat16
    for faster in names:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / faster))  # a machine that has measured nothing
        products = {name: (lambda x, **values: x) if name == faster else slow for name in CPU_INT4_PRODUCTS}
        monkeypatch.setattr(quantized_kernels, "CPU_INT4_PRODUCTS", products)
        quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
        assert layer.kernels == {rows: faster for rows in quantized_kernels.CPU_TIMED_ROWS}


def test_an_environment_variable_pins_one_product_and_nothing_is_timed(process_group, monkeypatch):
    from llama.runtime import quantized_kernels

    def never(x, q, scales):
        raise AssertionError("timed although pinned")

    monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", {"int8": never, "widened": never, "widened32": never})
    layer = int8_layer()
    monkeypatch.setenv("LLAMA_QUANTIZED_PRODUCT", "widened32")
    quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)
    assert [layer.kernel_for(rows) for rows in (1, 8, 300)] == ["widened32"] * 3
    monkeypatch.setenv("LLAMA_QUANTIZED_PRODUCT", "turbo")
    with pytest.raises(ValueError, match="LLAMA_QUANTIZED_PRODUCT='turbo' is not a quantized product"):
        quantized_kernels.choose_quantized_kernels(layer, **CHOSEN_FOR)


def test_int4_widening_is_the_dequantized_weight_in_the_activations_dtype():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    assert dequantized_int4_weight(*quantize_int4(weight, 64, torch.bfloat16)).dtype == torch.bfloat16
    # the values the int4 kernel computes with
    layer = ColumnParallelLinear(256, 64, bias=False, gather_output=False, init_method=lambda x: x)
    layer.weight.data.copy_(weight)
    int4 = Int4Linear(layer, *quantize_int4(weight, 64, torch.float32))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    expected = F.linear(x, dequantized_int4_weight(*quantize_int4(weight, 64, torch.float32)))
    torch.testing.assert_close(int4(x), expected, atol=1e-4, rtol=1e-4)


def test_no_runnable_product_is_a_clear_error():
    def missing(x):
        raise NotImplementedError("no kernel for this device")

    with pytest.raises(ValueError, match="None of the products"):
        fastest({"a": missing, "b": missing}, torch.ones(1, 4), repeats=1)


def quantized_cuda_model(tmp_path, scheme: str, max_batch_size: int = 2):
    write_meta_checkpoint(tmp_path / "ckpt", GQA_PARAMS, random_weights(GQA_PARAMS, seed=31))
    reader = open_checkpoint(tmp_path / "ckpt")
    args = model_args_from(reader.params, max_seq_len=32, max_batch_size=max_batch_size)[0]
    reference = load_model(reader, args, 0, 1, torch.device("cuda"), torch.bfloat16)
    return for_runtime(quantize_model(reference, scheme), cuda_graphs=True)


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_gpu_chooses_a_product_per_row_count_and_each_gives_the_dequantized_logits(process_group, tmp_path, scheme):
    model, _ = quantized_cuda_model(tmp_path, scheme)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(tuple(m.kernels) == TIMED_ROWS for m in layers)
    for layer in layers:
        chosen = set(layer.kernels.values())
        assert chosen <= set(layer.products(1)) | set(layer.products(512))
        if isinstance(layer, Int4Linear):  # the second copy stays only where a chosen product reads it
            assert hasattr(layer, "nibbles") == ("dequantized" in chosen)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.inference_mode():
        chosen_logits = model(tokens, 0).float()
        for layer in layers:
            layer.kernels = {}  # every product the default one
        default_logits = model(tokens, 0).float()
    assert (chosen_logits - default_logits).abs().max() < 0.05 * default_logits.abs().max()


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_graphs_replay_the_chosen_quantized_products_bit_for_bit(process_group, tmp_path, scheme):
    model, step = quantized_cuda_model(tmp_path, scheme)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(6)).cuda()
    with torch.inference_mode():
        model(tokens[:, :8], 0)
        position = torch.tensor([8], device="cuda")
        eager = model.decode_step(tokens[:, 8:9], position)
        model(tokens[:, :8], 0)  # the same cache again
        assert torch.equal(step(tokens[:, 8:9], position), eager)
