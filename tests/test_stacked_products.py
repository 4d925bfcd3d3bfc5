"""Layers of one input stacked into one product on the CPU (`llama.runtime.stacked.Stack`): an attention's wq, wk and
wv, a feed-forward's w1 and w3, float and int8 alike. What a user relies on: each layer's output is what its own
product gives, bit for bit, on every kernel; the model's state dict and load report are those of its layers; the
stack alone holds the copy its kernels read, made again after an edit of a weight."""

import pytest
import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from helpers import int8_layer

from llama.runtime.cpu.layers import CPULinear
from llama.runtime.quantized import Int8Linear, quantize_layer
from llama.runtime.stacked import STACKED_KERNELS, Stack, stacked


def float_layer(rows: int, cols: int, seed: int, dtype: torch.dtype) -> CPULinear:
    """A `CPULinear` of random weights that hold bfloat16 values, in `dtype`."""
    layer = ColumnParallelLinear(cols, rows, bias=False, gather_output=False, init_method=lambda x: x)
    weight = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16().to(dtype)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return CPULinear(layer)


def three_layers(kind: str, dtype: torch.dtype):
    """Layers shaped as a grouped-query attention's wq, wk and wv (more query rows than key or value rows)."""
    make = int8_layer if kind == "int8" else float_layer
    return [make(rows, 256, seed, dtype) for rows, seed in ((256, 0), (64, 1), (64, 2))]


def run_on(module, layers, kernel: str, x: torch.Tensor):
    for layer in layers:
        layer.kernels = (kernel,) * 4
    if isinstance(module, Stack):
        module.claim()
        module.make_copies()
    for layer in layers:
        layer.make_copies()
    return module(x)


@pytest.mark.parametrize("kind", ["float", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_each_output_of_a_stack_is_its_layer_s_own_product_bit_for_bit_on_every_kernel(
    process_group, kind, dtype, rows
):
    layers = three_layers(kind, dtype)
    x = torch.randn(rows, 256, dtype=dtype, generator=torch.Generator().manual_seed(rows))
    kind_class = Int8Linear if kind == "int8" else CPULinear
    kernels = [kernel for kernel in kind_class.KERNELS if layers[0].runs(kernel)]
    own = {kernel: [run_on(layer, [layer], kernel, x) for layer in layers] for kernel in kernels}
    stack = stacked(*layers)
    on_copies = [kernel for kernel in kernels if layers[0].on_a_copy(kernel) and kernel in STACKED_KERNELS]
    # a kernel to run as one product: all but int8's with float32 activations (fbgemm_int8 takes 16-bit ones only)
    assert bool(on_copies) != (kind == "int8" and dtype == torch.float32), kernels
    for kernel, expected in own.items():
        outputs = run_on(stack, layers, kernel, x)
        assert (stack.copy is not None) == (kernel in on_copies)
        assert [y.shape for y in outputs] == [y.shape for y in expected]
        assert all(torch.equal(got, want) for got, want in zip(outputs, expected)), kernel


def test_a_stack_holds_no_parameters_and_the_only_copy(process_group):
    layers = three_layers("float", torch.bfloat16)
    model = torch.nn.ModuleDict({"wq": layers[0], "wk": layers[1], "wv": layers[2]})
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model["wqkv"] = stacked(*layers)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    run_on(model["wqkv"], layers, "fp16", x)
    assert model["wqkv"].copy is not None and all(layer.copy is None for layer in layers)


def test_a_stack_s_copy_follows_an_edit_of_one_of_its_weights(process_group):
    layers = three_layers("float", torch.float32)
    stack = stacked(*layers)
    x = torch.randn(2, 256)
    before = run_on(stack, layers, "fp16", x)
    with torch.no_grad():
        layers[1].weight.mul_(2)  # still bfloat16 values
    got = stack(x)
    expected = [layer.fp16(x) for layer in layers]  # each on a copy of its own, made now
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(got[1], before[1]) and torch.equal(got[0], before[0])


def test_only_cpu_column_parallel_layers_of_one_kind_are_stacked(process_group):
    assert isinstance(stacked(*three_layers("int8", torch.bfloat16)), Stack)
    assert isinstance(stacked(*three_layers("float", torch.float32)), Stack)
    row_parallel = quantize_layer(RowParallelLinear(256, 64, bias=False, input_is_parallel=True), "int8")
    assert stacked(int8_layer(64, 256), row_parallel) is None
    assert stacked(int8_layer(64, 256), torch.nn.Linear(256, 64)) is None
    assert stacked(int8_layer(64, 256, dtype=torch.bfloat16), int8_layer(64, 256)) is None  # two dtypes
    assert stacked(int8_layer(64, 256), float_layer(64, 256, 0, torch.float32)) is None  # two kinds
    int4 = [quantize_layer(ColumnParallelLinear(256, 64, bias=False, gather_output=False), "int4") for _ in "ab"]
    assert stacked(*int4) is None


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", None])
def test_a_loaded_model_runs_its_stacks_with_its_layers_logits_and_report(
    tiny_checkpoint, tokenizer_path, monkeypatch, quantize
):
    """A bfloat16 model, loaded in int8 or not, on each of two kernels pinned: the same logits with and without
    stacks; the stacks hold the copies, their layers none; the load report counts every layer."""
    from llama import Llama
    from llama.runtime import steps

    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="bfloat16", quantize=quantize)
    tokens = torch.tensor([[128000, 791, 6864, 315, 9822, 374]])
    on_copy, alone = ("fbgemm_int8", "int8") if quantize else ("fp16", "linear")

    def load(kernel):
        monkeypatch.setenv("LLAMA_CPU_KERNEL", kernel)
        generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build)
        return generator, generator.model.forward(tokens, 0)[0]

    with_stacks, logits = load(on_copy)
    modules = list(with_stacks.model.modules())
    stacks = [m for m in modules if isinstance(m, Stack)]
    n_layers = len(with_stacks.model.layers)
    assert sorted(len(stack.layers) for stack in stacks) == [2] * n_layers + [3] * n_layers
    assert all(stack.copy is not None for stack in stacks)
    in_stacks = {id(layer) for stack in stacks for layer in stack.layers}
    layers = [m for m in modules if isinstance(m, (CPULinear, Int8Linear))]
    copies = [layer.packed if quantize else layer.copy for layer in layers]
    assert all((copy is None) == (id(layer) in in_stacks) for layer, copy in zip(layers, copies))  # wo, w2, head
    assert f"1 row: {on_copy} {len(layers)}" in str(with_stacks.load_report)
    alone_logits = load(alone)[1]
    monkeypatch.setattr(steps, "stacked", None)
    assert torch.equal(load(on_copy)[1], logits)
    assert torch.equal(load(alone)[1], alone_logits)
