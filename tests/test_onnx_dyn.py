"""quantize="int8-dyn" and "int4-dyn" (llama/runtime/onnx_dyn.py): int8 weights with a scale per group of 32, or
int4 weights with an integer zero point per group of 32, times 8-bit activations per block of 32. The rounding
they promise, their products against integer arithmetic done here, ONNX Runtime's operator against the PyTorch
fallback, a model without ONNX Runtime, PyTorch's threads while ONNX Runtime multiplies, and the errors. Accuracy
on a trained model: benchmarks/quant_accuracy.py (docs/quantize.md).
"""

import copy
import io

import pytest
import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from helpers import import_or_skip
from test_quantize import fairscale_layer, random_weight, tiny_reader

import llama.runtime.onnx_dyn as onnx_dyn
from llama import Llama
from llama.checkpoint import load_model
from llama.checkpoint.convert import quantize_checkpoint
from llama.quantize import check_device, unpack_nibbles
from llama.runtime import for_runtime, quantize_model
from llama.runtime.onnx_dyn import DynLinear, dequantize_dyn, quantize_int4_dyn, quantize_int8_dyn, reference_product
from llama.runtime.quantized import Int8Linear
from llama.runtime.schemes import quantize_layer

ONNX = "pip install onnxruntime==1.32.0 onnx==1.23.2"


def test_each_group_takes_16_levels_with_an_integer_zero_point_and_a_refitted_step(monkeypatch):
    weight = random_weight(32, 128)
    weight[0, :32] += 1.0  # a group of positive values only: its range is widened to hold 0
    weight[1, 32:64] = 0  # a group of zeros
    codes, scales, zero_points = quantize_int4_dyn(weight)
    assert codes.shape == (32, 64) and scales.shape == zero_points.shape == (32, 4)
    assert zero_points.dtype == torch.uint8 and int(zero_points.max()) <= 15
    assert int(zero_points[0, 0]) == 0  # the lowest level stands for 0
    restored = dequantize_dyn(codes, scales, zero_points)
    assert torch.equal(restored[1, 32:64], torch.zeros(32))

    monkeypatch.setattr(onnx_dyn, "SCALE_ROUNDS", 0)  # the range cut in 15 steps, as first drawn
    plain = dequantize_dyn(*quantize_int4_dyn(weight))
    plain_scales = quantize_int4_dyn(weight)[1]
    assert ((plain - weight).abs() <= plain_scales.repeat_interleave(32, dim=1) / 2 + 1e-6).all()
    # The refitted steps fit better: less squared error in all, and in nearly every group
    squared, plain_squared = ((x - weight).view(32, 4, 32).square().sum(-1) for x in (restored, plain))
    assert squared.sum() < plain_squared.sum()
    assert (squared <= plain_squared + 1e-9).float().mean() > 0.9


def test_int8_groups_take_the_nearest_of_255_levels_around_zero():
    weight = random_weight(16, 96)
    weight[2, 32:64] = 0  # a group of zeros
    codes, scales = quantize_int8_dyn(weight)
    assert codes.dtype == torch.uint8 and codes.shape == (16, 96) and scales.shape == (16, 3)
    levels = codes.int() - 128
    assert levels.abs().max(dim=-1).values.eq(127).all()  # each row's largest magnitude is a level
    assert (levels.view(16, 3, 32).abs().amax(-1) == torch.where(scales > 0, 127, 0)).all()  # and each group's
    restored = dequantize_dyn(codes, scales, None)
    assert ((restored - weight).abs() <= scales.repeat_interleave(32, dim=1) / 2 + 1e-7).all()
    assert torch.equal(restored[2, 32:64], torch.zeros(32))
    # A slice of whole groups (a model-parallel process's) is quantized as the whole weight quantizes it.
    assert torch.equal(quantize_int8_dyn(weight[:, 32:])[0], codes[:, 32:])


def weight_levels(codes, zero_points) -> torch.Tensor:
    """The integer level of each weight, by group: (rows, groups, 32)."""
    if zero_points is None:
        return codes.view(codes.shape[0], -1, 32).long() - 128
    return unpack_nibbles(codes).view(codes.shape[0], -1, 32).long() - zero_points.long()[..., None]


def integer_product(x: torch.Tensor, codes, scales, zero_points) -> torch.Tensor:
    """What MatMulNBits with 8-bit activations computes, written with integers: each block of 32 inputs rounded to
    int8 steps of its largest magnitude / 127, its products with the weight's integer levels summed exactly, each
    block's sum scaled by both scales, the blocks summed in float64."""
    rows, cols = x.shape
    blocks = x.double().view(rows, cols // 32, 32)
    x_scale = blocks.abs().amax(dim=-1) / 127
    x_levels = torch.round(blocks / torch.where(x_scale > 0, x_scale, 1.0)[..., None]).long()
    w_levels = weight_levels(codes, zero_points)
    sums = torch.einsum("rgk,ngk->rng", x_levels, w_levels)  # integers: exact
    return (sums.double() * x_scale[:, None, :] * scales.double()[None]).sum(-1)


def quantized(scheme: str, weight: torch.Tensor):
    """(codes, scales, zero_points) of `weight` in `scheme` (zero_points None for int8-dyn)."""
    return quantize_int4_dyn(weight) if scheme == "int4-dyn" else (*quantize_int8_dyn(weight), None)


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_the_product_is_the_integer_product_of_8_bit_activations(scheme, rows):
    codes, scales, zero_points = quantized(scheme, random_weight(48, 256))
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    x[0, :32] = 0  # a block of zeros
    expected = integer_product(x, codes, scales, zero_points)
    torch.testing.assert_close(
        reference_product(x, codes, scales, zero_points).double(), expected, rtol=1e-5, atol=1e-6
    )
    exact = x @ dequantize_dyn(codes, scales, zero_points).t()
    assert (expected - exact.double()).abs().max() > 1e-4  # the activations were rounded


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
@pytest.mark.parametrize("kind", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_onnx_runtime_computes_what_the_fallback_computes(process_group, scheme, kind, rows):
    import_or_skip("onnxruntime", ONNX)
    weight = random_weight(64, 256)
    layer = quantize_layer(fairscale_layer(kind, 256, 64, weight), scheme)
    assert type(layer) is DynLinear and layer.scheme == scheme and layer.default_kernel() == "matmulnbits"
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2))
    onnx_out = layer.products(rows)["matmulnbits"](x)
    torch.testing.assert_close(onnx_out, reference_product(x, *quantized(scheme, weight)), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x), onnx_out)  # the layer runs ONNX Runtime's
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
def test_the_weight_is_held_once_by_onnx_runtime(process_group, scheme):
    """The session multiplies from its own packed copy, so once it is made the layer lets its values go: overwriting
    the values it was made from changes nothing. A copy of the model shares the session, and saving one says what
    to do."""
    import_or_skip("onnxruntime", ONNX)
    values = quantized(scheme, random_weight(64, 256))
    layer = DynLinear(fairscale_layer(ColumnParallelLinear, 256, 64, random_weight(64, 256)), *values)
    assert layer.weight is values[0] and layer.session is None  # made at the first product, or by for_runtime
    layer.make_session()
    assert onnx_dyn.packs_its_own_copy(layer.bits)
    assert layer.weight is None and layer.scales is None and layer.zero_points is None
    assert layer.values_bytes() == sum(t.numel() * t.element_size() for t in values if t is not None)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    expected = reference_product(x, *values)
    for tensor in values:
        if tensor is not None:
            tensor.random_(0, 16)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    copied = copy.deepcopy(layer)
    assert copied.session is layer.session and torch.equal(copied(x), layer(x))
    with pytest.raises(ValueError, match="cannot be saved: save the checkpoint"):
        torch.save(layer, io.BytesIO())


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
def test_the_load_lets_the_output_head_s_values_go_as_it_quantizes_it(process_group, tmp_path, scheme):
    """The head is the largest weight, and no fused product takes it: its session is made as it loads, so the load
    never holds its values beside every other session (the peak memory of docs/quantize.md). The blocks' layers
    keep theirs until `for_runtime` stacks them."""
    import_or_skip("onnxruntime", ONNX)
    reader, args = tiny_reader(tmp_path)
    model = load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32, quantize=scheme)
    assert model.output.session is not None and model.output.weight is None
    assert model.layers[0].feed_forward.w1.session is None and model.layers[0].feed_forward.w1.weight is not None
    for_runtime(model)
    assert model.layers[0].feed_forward.w1.weight is None


class ReadsTheValues:
    """Stands in for a session that reads the values it was given at every call, as ONNX Runtime does where MLAS
    has no kernel for 8-bit activations at the weight's bits."""

    def __init__(self, *values):
        self.values = values

    def __call__(self, rows):
        return reference_product(rows, *self.values)


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
def test_where_the_session_reads_the_values_the_layer_keeps_them(process_group, monkeypatch, scheme):
    monkeypatch.setattr(onnx_dyn, "MatMulNBits", ReadsTheValues)
    monkeypatch.setattr(onnx_dyn, "onnxruntime_available", lambda: True)
    onnx_dyn.packs_its_own_copy.cache_clear()
    try:
        values = quantized(scheme, random_weight(64, 256))
        layer = DynLinear(fairscale_layer(ColumnParallelLinear, 256, 64, random_weight(64, 256)), *values)
        layer.make_session()
        assert not onnx_dyn.packs_its_own_copy(layer.bits)
    finally:
        onnx_dyn.packs_its_own_copy.cache_clear()
    assert layer.weight is values[0] and layer.scales is values[1] and layer.zero_points is values[2]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(layer(x), reference_product(x, *values))


def test_a_layer_the_groups_cannot_hold_takes_the_next_scheme(process_group):
    """int4-dyn's groups need 16 rows as well as 32 inputs; int8-dyn's only the inputs; without those, int8."""
    odd_rows = quantize_layer(fairscale_layer(ColumnParallelLinear, 64, 24, random_weight(24, 64)), "int4-dyn")
    assert type(odd_rows) is DynLinear and odd_rows.scheme == "int8-dyn"
    for scheme in ("int8-dyn", "int4-dyn"):
        odd_inputs = fairscale_layer(ColumnParallelLinear, 40, 32, random_weight(32, 40))
        assert type(quantize_layer(odd_inputs, scheme)) is Int8Linear


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
def test_without_onnx_runtime_a_model_computes_the_same_logits(process_group, tmp_path, monkeypatch, scheme):
    """And while ONNX Runtime multiplies, PyTorch's own operations run on one thread, as many as before after."""
    import_or_skip("onnxruntime", ONNX)
    reader, args = tiny_reader(tmp_path)
    tokens = torch.randint(0, args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()

    def logits():
        model = for_runtime(load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32, quantize=scheme))[0]
        layers = [m for m in model.modules() if isinstance(m, DynLinear)]
        assert len(layers) == 7 * args.n_layers + 1 and model.output in layers
        assert {layer.scheme for layer in layers} == {scheme, "int8-dyn"}  # int4-dyn's head in 8 bits
        seen = []
        model.norm.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
        logits = model(tokens, 0)
        assert torch.get_num_threads() == threads
        return logits, {layer.default_kernel() for layer in layers}, seen

    torch.set_num_threads(2)  # where this machine has one core too
    try:
        with_onnx, kernels, seen = logits()
        assert kernels == {"matmulnbits"} and seen == [1]
        monkeypatch.setattr(onnx_dyn, "onnxruntime_available", lambda: False)
        without, kernels, seen = logits()
        assert kernels == {"reference"} and seen == [2]
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(with_onnx, without, rtol=1e-4, atol=1e-4)
    float_model = for_runtime(load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32))[0]
    float_logits = float_model(tokens, 0)
    error = ((without - float_logits).norm() / float_logits.norm()).item()
    assert 0 < error < (0.05 if scheme == "int8-dyn" else 0.3)


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_a_fused_product_gives_each_layer_s_own_bits(process_group, scheme, rows):
    """wq, wk and wv (or w1 and w3) run as one session give the bits each layer's own session gives, and a layer of
    the group called alone still gives its own output."""
    import_or_skip("onnxruntime", ONNX)
    weights = [random_weight(n, 256, seed) for seed, n in enumerate([64, 32, 32])]
    made = [(fairscale_layer(ColumnParallelLinear, 256, w.shape[0], w), quantized(scheme, w)) for w in weights]
    alone = [DynLinear(layer, *(t.clone() if t is not None else None for t in values)) for layer, values in made]
    grouped = [DynLinear(layer, *values) for layer, values in made]
    fused = onnx_dyn.fused_dyn(*grouped)
    assert isinstance(fused, onnx_dyn.FusedDyn) and all(layer.weight is None for layer in grouped)  # held once
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(5))
    outputs = fused(x)
    assert [y.shape for y in outputs] == [(rows, w.shape[0]) for w in weights]
    for y, one, member in zip(outputs, alone, grouped):
        assert torch.equal(y, one(x))
        assert torch.equal(member(x), y)
    assert onnx_dyn.fused_dyn(*alone) is None  # each runs on a session of its own already


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
def test_a_model_runs_its_blocks_on_four_sessions_with_the_same_logits(process_group, tmp_path, monkeypatch, scheme):
    """wq, wk and wv as one product, w1 and w3 as another: the logits are the same bits as with every layer on a
    session of its own."""
    import_or_skip("onnxruntime", ONNX)
    reader, args = tiny_reader(tmp_path)
    tokens = torch.randint(0, args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))

    def run():
        model = for_runtime(load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32, quantize=scheme))[0]
        sessions = {id(m.session): m for m in model.modules() if getattr(m, "session", None) is not None}
        return model(tokens, 0), model, len(sessions)

    fused_logits, model, sessions = run()
    block = model.layers[0]
    assert isinstance(block.attention.qkv, onnx_dyn.FusedDyn) and isinstance(block.feed_forward.w13, onnx_dyn.FusedDyn)
    assert sessions == 4 * args.n_layers + 1  # and the output head's
    monkeypatch.setattr(onnx_dyn, "fused_dyn", lambda *layers: None)
    monkeypatch.setattr("llama.runtime.steps.fused_dyn", lambda *layers: None)
    alone_logits, _, sessions = run()
    assert sessions == 7 * args.n_layers + 1
    assert torch.equal(fused_logits, alone_logits)


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
def test_build_runs_it_and_the_load_report_names_the_product(tiny_checkpoint, tokenizer_path, process_group, scheme):
    import_or_skip("onnxruntime", ONNX)
    generator = Llama.build(
        str(tiny_checkpoint), tokenizer_path, max_seq_len=32, max_batch_size=1, device="cpu", quantize=scheme
    )
    assert "matmulnbits" in str(generator.load_report).splitlines()[-1]
    text = generator.text_completion(["The moon is"], temperature=0, max_gen_len=4)[0]["generation"]
    assert isinstance(text, str)


@pytest.mark.parametrize("scheme", ["int8-dyn", "int4-dyn"])
def test_it_is_a_cpu_scheme_made_at_load_only(tiny_checkpoint, tmp_path, scheme, process_group):
    reader, args = tiny_reader(tmp_path)
    model = load_model(reader, args, 0, 1, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="takes groups of 32 only, got group_size=64"):
        quantize_model(model, scheme, group_size=64)
    with pytest.raises(ValueError, match="runs on the CPU only"):
        check_device(torch.device("cuda"), scheme, torch.bfloat16)
    with pytest.raises(ValueError, match="made as the checkpoint loads"):
        quantize_checkpoint(tiny_checkpoint, tmp_path / "out", scheme)
