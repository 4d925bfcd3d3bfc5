"""int8 layers of one input stacked into one product on the CPU (`llama.runtime.stacked`): an attention's wq, wk and
wv, a feed-forward's w1 and w3. What a user relies on: each layer's output is what its own product gives, bit for
bit, on every kernel; the model's state dict, memory and load report are those of its layers; only the stack runs,
and only it holds fbgemm's copy."""

import pytest
import torch
from helpers import int8_layer

from llama.runtime.quantized import Int8Linear, quantized_bytes
from llama.runtime.stacked import StackedInt8, stacked


def three_layers(dtype: torch.dtype):
    """Layers shaped as a grouped-query attention's wq, wk and wv (more query rows than key or value rows)."""
    return [int8_layer(rows, 256, seed, dtype) for rows, seed in ((256, 0), (64, 1), (64, 2))]


def run_on(layer, kernel: str, x: torch.Tensor):
    layer.kernels = (kernel,) * 4
    layer.make_copies()
    return layer(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_each_output_of_a_stack_is_its_layer_s_own_product_bit_for_bit_on_every_kernel(process_group, dtype, rows):
    layers = three_layers(dtype)
    x = torch.randn(rows, 256, dtype=dtype, generator=torch.Generator().manual_seed(rows))
    kernels = [kernel for kernel in Int8Linear.KERNELS if layers[0].runs(kernel)]
    assert "int8" in kernels and "widened" in kernels and ("fbgemm_int8" in kernels) == (dtype == torch.bfloat16)
    own = {kernel: [run_on(layer, kernel, x) for layer in layers] for kernel in kernels}
    stack = stacked(*layers)
    for kernel, expected in own.items():
        outputs = run_on(stack, kernel, x)
        assert [y.shape for y in outputs] == [y.shape for y in expected]
        assert all(torch.equal(got, want) for got, want in zip(outputs, expected)), kernel


def test_the_layers_keep_their_state_dict_and_memory_and_view_the_stack_s_values(process_group):
    layers = three_layers(torch.bfloat16)
    model = torch.nn.ModuleDict({"wq": layers[0], "wk": layers[1], "wv": layers[2]})
    before = {key: value.clone() for key, value in model.state_dict().items()}
    held = quantized_bytes(model)
    model["wqkv"] = stacked(*layers)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    assert quantized_bytes(model) == held
    storage = model["wqkv"].weight.untyped_storage().data_ptr()
    assert all(layer.weight.untyped_storage().data_ptr() == storage for layer in layers)


def test_only_int8_column_parallel_layers_on_the_cpu_are_stacked(process_group):
    from fairscale.nn.model_parallel.layers import RowParallelLinear

    from llama.runtime.quantized import quantize_layer

    assert isinstance(stacked(*three_layers(torch.bfloat16)), StackedInt8)
    row_parallel = quantize_layer(RowParallelLinear(256, 64, bias=False, input_is_parallel=True), "int8")
    assert stacked(int8_layer(64, 256), row_parallel) is None
    assert stacked(int8_layer(64, 256), torch.nn.Linear(256, 64)) is None
    assert stacked(int8_layer(64, 256, dtype=torch.bfloat16), int8_layer(64, 256)) is None  # two dtypes
    assert stacked(stacked(*three_layers(torch.float32)), int8_layer(64, 256)) is None  # no stack of a stack


@pytest.mark.slow
def test_a_loaded_int8_model_runs_its_stacks_with_its_layers_logits_and_report(
    tiny_checkpoint, tokenizer_path, monkeypatch
):
    """A bfloat16 model loaded in int8, on each kernel pinned: the same logits with and without stacks; only the
    stacks hold fbgemm's copies; the load report still counts every layer."""
    from llama import Llama
    from llama.runtime import steps

    build = dict(max_seq_len=64, max_batch_size=1, device="cpu", dtype="bfloat16", quantize="int8")
    tokens = torch.tensor([[128000, 791, 6864, 315, 9822, 374]])

    def load(kernel):
        monkeypatch.setenv("LLAMA_CPU_KERNEL", kernel)
        generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build)
        return generator, generator.model.forward(tokens, 0)[0]

    with_stacks, logits = load("fbgemm_int8")
    modules = list(with_stacks.model.modules())
    stacks = [m for m in modules if isinstance(m, StackedInt8)]
    layers = [m for m in modules if type(m) is Int8Linear]
    n_layers = len(with_stacks.model.layers)
    assert sorted(stack.layer_count for stack in stacks) == [2] * n_layers + [3] * n_layers
    assert all(stack.packed is not None for stack in stacks)
    alone = [layer for layer in layers if layer.layer_count]  # wo, w2, the head
    assert len(alone) == 2 * n_layers + 1 and all(layer.packed is not None for layer in alone)
    assert all(layer.packed is None for layer in layers if not layer.layer_count)
    assert f"1 row: fbgemm_int8 {len(layers)}" in str(with_stacks.load_report)
    int8_logits = load("int8")[1]
    monkeypatch.setattr(steps, "stacked", None)
    assert torch.equal(load("fbgemm_int8")[1], logits)
    assert torch.equal(load("int8")[1], int8_logits)
