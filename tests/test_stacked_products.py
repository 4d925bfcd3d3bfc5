"""int8 layers of one input stacked into one product on the CPU (`llama.runtime.stacked`): an attention's wq, wk and
wv, a feed-forward's w1 and w3. What a user relies on: each layer's output is what its own product gives, bit for
bit; the model's state dict, memory and load report are those of its layers; only the stack is timed and packed."""

import pytest
import torch
from helpers import int8_layer

from llama.runtime.quantized import Int8Linear, quantized_bytes
from llama.runtime.stacked import StackedInt8, stacked_int8


def three_layers(dtype: torch.dtype):
    """Layers shaped as a grouped-query attention's wq, wk and wv (more query rows than key or value rows)."""
    return [int8_layer(rows, 256, seed, dtype) for rows, seed in ((256, 0), (64, 1), (64, 2))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_each_output_of_a_stack_is_its_layer_s_own_product_bit_for_bit_on_every_product(process_group, dtype, rows):
    layers = three_layers(dtype)
    x = torch.randn(rows, 256, dtype=dtype, generator=torch.Generator().manual_seed(rows))
    own = {name: [layer.products(rows)[name](x) for layer in layers] for name in layers[0].products(rows)}
    stack = stacked_int8(*layers)
    assert set(stack.products(rows)) == set(own)
    for name, expected in own.items():
        stack.kernels = {1: name}
        outputs = stack(x)
        assert [y.shape for y in outputs] == [y.shape for y in expected]
        assert all(torch.equal(got, want) for got, want in zip(outputs, expected)), name


def test_the_layers_keep_their_state_dict_and_memory_and_view_the_stack_s_values(process_group):
    layers = three_layers(torch.bfloat16)
    model = torch.nn.ModuleDict({"wq": layers[0], "wk": layers[1], "wv": layers[2]})
    before = {key: value.clone() for key, value in model.state_dict().items()}
    held = quantized_bytes(model)
    model["qkv"] = stacked_int8(*layers)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    assert quantized_bytes(model) == held
    storage = model["qkv"].weight.untyped_storage().data_ptr()
    assert all(layer.weight.untyped_storage().data_ptr() == storage for layer in layers)


def test_only_int8_column_parallel_layers_on_the_cpu_are_stacked(process_group):
    from fairscale.nn.model_parallel.layers import RowParallelLinear

    from llama.runtime.quantized import quantize_layer

    layers = three_layers(torch.bfloat16)
    assert isinstance(stacked_int8(*layers), StackedInt8)
    row_parallel = quantize_layer(RowParallelLinear(256, 64, bias=False, input_is_parallel=True), "int8")
    assert stacked_int8(int8_layer(64, 256), row_parallel) is None
    assert stacked_int8(int8_layer(64, 256), torch.nn.Linear(256, 64)) is None
    assert stacked_int8(int8_layer(64, 256, dtype=torch.bfloat16), int8_layer(64, 256)) is None  # two dtypes


def test_a_loaded_int8_model_runs_its_stacks_with_its_layers_logits_and_report(
    tiny_checkpoint, tokenizer_path, monkeypatch
):
    """A bfloat16 model loaded in int8, each product pinned: the same logits with and without stacks (so what a
    load chooses for a stack, it could have chosen for each layer); the stacks alone are timed and packed; the load
    report still counts every layer."""
    from llama import Llama
    from llama.runtime import steps

    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="bfloat16", quantize="int8")
    tokens = torch.tensor([[128000, 791, 6864, 315, 9822, 374]])

    def load(product):
        monkeypatch.setenv("LLAMA_QUANTIZED_PRODUCT", product)
        generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build)
        return generator, generator.model.forward(tokens, 0)[0]

    stacked, logits = load("split")
    modules = list(stacked.model.modules())
    stacks = [m for m in modules if isinstance(m, StackedInt8)]
    layers = [m for m in modules if isinstance(m, Int8Linear) and not isinstance(m, StackedInt8)]
    n_layers = len(stacked.model.layers)
    assert sorted(len(stack.layers) for stack in stacks) == [2] * n_layers + [3] * n_layers
    assert all(stack.packed is not None for stack in stacks)
    in_stacks = {id(layer) for stack in stacks for layer in stack.layers}
    assert all((layer.packed is None) == (id(layer) in in_stacks) for layer in layers)  # wo, w2, the head: alone
    assert f"1 row: split {len(layers)}" in str(stacked.load_report)
    int8_logits = load("int8")[1]
    monkeypatch.setattr(steps, "stacked_int8", lambda *layers: None)
    assert torch.equal(load("split")[1], logits)
    assert torch.equal(load("int8")[1], int8_logits)
