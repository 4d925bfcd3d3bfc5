"""The CPU speed-ups keep the reference math: `llama.runtime.cpu`'s linear layers (oneDNN, its bfloat16 weights in
a packed copy; fbgemm on float16 copies of bfloat16 weights and of float32 ones holding bfloat16 values), fused
attention, and `llama.runtime.parallel_layers` against fairscale's layers, on tiny random weights. And the rule that
chooses among the kernels (`llama.runtime.kernel_table`): by what the CPU offers, the weights and the row count of
each call, with nothing timed at load.

The reference is the same checkpoint run as Meta's code runs it: `F.linear` and attention step by step
(`helpers.with_reference_attention`).
"""

import collections
import copy
import logging
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from helpers import (
    ATOL,
    GQA_PARAMS,
    TINY_PARAMS,
    as_if_the_cpu_offered,
    causal_mask,
    incremental_logits,
    load_reference,
    load_tiny,
    with_reference_attention,
)

import llama.runtime.cpu.kernels
import llama.runtime.cpu.layers
from llama.checkpoint import random_weights
from llama.model import Transformer
from llama.runtime import for_runtime
from llama.runtime.cpu.kernels import fbgemm_fp16_supported, fp16_linear, holds_bfloat16_values, pack_as_fp16
from llama.runtime.cpu.layers import CPULinear
from llama.runtime.kernel_table import CPU_TABLE, CPUOffers, cpu_offers
from llama.runtime.parallel_layers import ParallelEmbedding, ParallelLinear
from llama.runtime.stacked import Stack
from llama.runtime.steps import use_parallel_layers

# CPUs as the kernel table sees them: what PyTorch reports of each, and its flags.
AVX2_CPU = CPUOffers("AVX2", False, ("avx_vnni",))  # a Zen 3 or an Alder Lake, or AVX-512 capped to AVX2
AVX512_BF16_CPU = CPUOffers("AVX512", True, ("avx512_bf16", "avx512_vnni"))  # a Sapphire Rapids, a Zen 4
UNKNOWN_CPU = CPUOffers("DEFAULT", False, ())  # an ARM server, or instructions capped below AVX2
ROW_CLASSES = 4  # 1 row, 2-16, 17-127, 128 and more
ROW_CLASS_NAMES = ("1 row", "2-16 rows", "17-127 rows", "128+ rows")  # as the load report names them

needs_fbgemm = pytest.mark.skipif(not fbgemm_fp16_supported(), reason="this torch build has no fbgemm (not x86)")
needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_offers().onednn_bf16, reason="oneDNN has no bfloat16 kernels for this CPU (no AVX-512 bf16 or AMX)"
)


def reference_model(tmp_path, weights, dtype) -> Transformer:
    """The same checkpoint as `load_tiny` gives, run as Meta's code runs it: `F.linear`, attention step by step."""
    return with_reference_attention(load_reference(tmp_path, weights, dtype))


def cpu_layers(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, CPULinear)]


def every_layer_on(model: nn.Module, kernel: str) -> bool:
    layers = cpu_layers(model)
    return bool(layers) and all(m.kernels == (kernel,) * ROW_CLASSES for m in layers)


def held_copies(model: nn.Module) -> dict:
    """Each CPU layer's copy of its weight, by the layer's id: (its kernel, the copy), the layer's own or, for a layer
    of a stack (wq, wk, wv; w1, w3: `llama.runtime.stacked.Stack`), its stack's; layers without one left out."""
    held = {id(m): (m.copy[0], m.copy[3]) for m in cpu_layers(model) if m.copy is not None}
    for stack in (module for module in model.modules() if isinstance(module, Stack)):
        if stack.copy is not None:
            held.update({id(layer): (stack.copy[0], stack.copy[2]) for layer in stack.layers})
    return held


def copies_made(model: nn.Module) -> set:
    """The kinds of weight copies the model's layers hold ("fp16", "onednn"), none being empty."""
    return {kernel for kernel, copy_ in held_copies(model).values() if copy_ is not None}


def replacement_of(weight: torch.Tensor) -> torch.Tensor:
    """A random tensor to replace `weight` with, made to have its version count: only its identity tells it apart,
    so a packed copy made from `weight` must not be taken for its own."""
    replacement = torch.randn_like(weight)
    while replacement._version < weight._version:
        replacement.add_(0)
    return replacement


def greedy_tokens(model: Transformer, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = prompt
    logits = model(tokens, 0)[:, -1]
    for _ in range(steps):
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
        logits = model(tokens[:, -1:], tokens.shape[1] - 1)[:, -1]
    return tokens[:, prompt.shape[1] :]


def trained_float32(weights: dict, seed: int = 24) -> dict:
    """`weights` in float32, moved off bfloat16's values as training in float32 would (float16 cannot hold them)."""
    generator = torch.Generator().manual_seed(seed)
    return {k: v.float() + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fast_path_gives_the_reference_logits_in_float32(process_group, tmp_path, tie):
    """Fused attention and the CPU linear layers keep float32 logits within 1e-4 of Meta's math."""
    params = GQA_PARAMS
    weights = random_weights(params, seed=11)
    if tie:
        del weights["output.weight"]
    loaded = load_tiny(tmp_path / "fast", weights, torch.float32)
    assert len(cpu_layers(loaded)) == 7 * params["n_layers"] + 1
    if tie:
        assert loaded.output.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()  # one table, not two
        weights["output.weight"] = weights["tok_embeddings.weight"]
    weights = {k: v.float() for k, v in weights.items()}
    assert {k: v.shape for k, v in loaded.state_dict().items()} == {k: v.shape for k, v in weights.items()}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())  # the ordinary layout
    reference = reference_model(tmp_path / "reference", weights, torch.float32)
    assert not cpu_layers(reference)

    tokens = torch.randint(0, params["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    expected = reference(tokens, 0)
    assert expected.abs().max() > 1  # logits large enough that a wrong model could not pass by being tiny
    assert (loaded(tokens, 0) - expected).abs().max() < ATOL
    steps = incremental_logits(loaded, tokens, [8, 1, 1, 1, 1])
    assert (steps - expected).abs().max() < ATOL
    assert torch.equal(steps.argmax(-1), expected.argmax(-1))
    one_row = incremental_logits(loaded, tokens[:1], [8, 1, 1, 1, 1])  # batch 1 decodes one row at a time
    assert (one_row - expected[:1]).abs().max() < ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fast_path_keeps_greedy_tokens_and_torch_settings(process_group, tmp_path, dtype):
    """On the kernels the table gives this CPU, greedy decoding gives Meta's tokens, one sequence or two; oneDNN's
    global switch stays as the user left it, and the weights are the checkpoint's."""
    weights = random_weights(GQA_PARAMS, seed=12)
    fast = load_tiny(tmp_path / "fast", weights, dtype)
    reference = reference_model(tmp_path / "reference", weights, dtype)
    prompt = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    onednn_enabled = torch.backends.mkldnn.enabled
    for batch in (prompt, prompt[:1]):  # batch 1 takes the one-row kernels
        assert torch.equal(greedy_tokens(fast, batch, 20), greedy_tokens(reference, batch, 20))
    assert torch.backends.mkldnn.enabled == onednn_enabled
    # The weights are the checkpoint's, in the ordinary layout: state_dict() and editing work as usual.
    expected = reference.state_dict()
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_prompt_attended_causally_equals_the_mask_tensor_bit_for_bit(process_group, tmp_path, dtype):
    """A prompt from position 0 goes through SDPA's is_causal; the reference's mask tensor gives the same bits."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=16), dtype)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 29), generator=torch.Generator().manual_seed(8))
    causal = model(tokens, 0)
    with torch.inference_mode():
        h = model.tok_embeddings(tokens)
        mask = causal_mask(tokens.shape[1], 0).to(dtype)
        for layer in model.layers:
            h = layer(h, 0, model.freqs_cis[: tokens.shape[1]], mask)
        masked = model.output(model.norm(h)).float()
    assert torch.equal(causal, masked)


def kernel_layer(dtype: torch.dtype, kernel: str = "linear") -> CPULinear:
    """A 96 x 384 `CPULinear` of random weights that hold bfloat16 values, in `dtype`, on `kernel` for every row
    count, its copies made as at load."""
    layer = ColumnParallelLinear(384, 96, bias=False, gather_output=False, init_method=lambda w: w)
    weight = torch.randn(96, 384, generator=torch.Generator().manual_seed(5)).bfloat16().to(dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer = CPULinear(layer)
    layer.kernels = (kernel,) * ROW_CLASSES
    layer.make_copies()
    return layer


def kernels_here(dtype: torch.dtype) -> list:
    """The kernels this CPU and torch build can run for weights of `dtype` that hold bfloat16 values."""
    layer = kernel_layer(dtype)
    return [kernel for kernel in CPULinear.KERNELS if layer.runs(kernel)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_each_kernel_gives_its_own_product_for_any_number_of_rows(process_group, dtype):
    """A layer on each kernel gives what that kernel's own call gives, bit for bit, for one row, a few and a
    prompt's many: `F.linear` (the reference's call) for "linear", and for "onednn" in bfloat16 (the same oneDNN
    kernel, on a packed copy); fbgemm's product on a float16 copy for "fp16"; oneDNN's on the weight for "onednn" in
    float32. Each is within rounding of `F.linear`."""
    generator = torch.Generator().manual_seed(6)
    kernels = kernels_here(dtype)
    assert "linear" in kernels
    for kernel in kernels:
        layer = kernel_layer(dtype, kernel)
        weight = layer.weight
        for rows in (1, 3, 300):
            x = torch.randn(1, rows, 384, generator=generator).to(dtype)
            with torch.inference_mode():
                y, reference = layer(x), F.linear(x, weight)
                if kernel == "fp16":
                    own = fp16_linear(x, pack_as_fp16(weight))
                elif kernel == "onednn" and dtype == torch.float32:
                    own = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
                else:
                    own = reference
            assert torch.equal(y, own), (kernel, rows)
            tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
            torch.testing.assert_close(y, reference, **tolerance)


def test_inputs_run_on_the_kernel_of_their_row_class(process_group):
    """One row runs on the kernel of one row; 2 to 16 rows (a batch's decode step) on the next; 17 to 127 (a short
    prompt) on the third; 128 and more (a long prompt) on the last, whatever the input's shape."""
    calls = []
    layer = kernel_layer(torch.float32)
    names = ("one row", "a batch", "a short prompt", "a long prompt")

    def recorded(name):
        return lambda self, x: calls.append(name) or F.linear(x, self.weight)

    layer.KERNELS = {name: recorded(name) for name in names}
    layer.kernels = names
    expected = {
        (1, 1): "one row",
        (2, 1): "a batch",
        (1, 16): "a batch",
        (4, 4): "a batch",
        (17,): "a short prompt",
        (1, 127): "a short prompt",
        (1, 128): "a long prompt",
        (2, 100): "a long prompt",
        (1000,): "a long prompt",
    }
    for shape, name in expected.items():
        calls.clear()
        x = torch.randn(*shape, 384)
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, layer.weight))
        assert calls == [name], shape


@pytest.mark.parametrize(
    "kernel", [pytest.param("fp16", marks=needs_fbgemm), pytest.param("onednn", marks=needs_onednn_bf16)]
)
def test_packed_copies_follow_weight_edits(process_group, tmp_path, monkeypatch, kernel):
    """On a kernel that runs on a copy of the bfloat16 weights (fbgemm's float16, oneDNN's blocked layout), a weight
    edited in place or replaced is copied again at its next use: the logits are those of a model loaded with the new
    weights, bit for bit (on "onednn" those of `F.linear` too), and so are those of a deep copy of the model."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", kernel)
    weights = random_weights(GQA_PARAMS, seed=19)
    model = load_tiny(tmp_path / "edited", weights, torch.bfloat16)
    assert every_layer_on(model, kernel) and copies_made(model) == {kernel}
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(6))

    def steps(model):
        return incremental_logits(model, tokens, [6, 1, 1, 1, 1])

    def as_loaded(name):
        loaded = load_tiny(tmp_path / name, weights, torch.bfloat16)
        if kernel == "onednn":  # oneDNN's bfloat16 product on the copy is `F.linear`'s, bit for bit
            assert torch.equal(
                steps(loaded), steps(load_reference(tmp_path / f"{name} reference", weights, torch.bfloat16))
            )
        return steps(loaded)

    before = steps(model)
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight.mul_(-1)
        model.layers[0].attention.wk.weight.mul_(0.5)
    weights["layers.1.feed_forward.w2.weight"] = -weights["layers.1.feed_forward.w2.weight"]
    weights["layers.0.attention.wk.weight"] = weights["layers.0.attention.wk.weight"] * 0.5
    after = steps(model)
    assert not torch.equal(after, before)
    assert torch.equal(after, as_loaded("loaded"))

    output = replacement_of(model.output.weight)
    model.output.weight = nn.Parameter(output)
    weights["output.weight"] = output
    assert torch.equal(steps(model), as_loaded("replaced"))
    # The copies are dropped from copies of the model (they cannot be copied), and remade there.
    assert torch.equal(steps(copy.deepcopy(model)), steps(model))

    if kernel == "fp16":
        wq = model.layers[0].attention.wq
        with torch.no_grad():
            wq.weight[0, 0] = 1e5  # beyond float16's 65504: this layer falls back to F.linear
        x = torch.randn(3, GQA_PARAMS["dim"]).bfloat16()
        with torch.inference_mode():
            assert torch.equal(wq(x), F.linear(x, wq.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_layers_compute_what_fairscale_layers_do(process_group, tmp_path, dtype):
    """The layers a loaded model runs on (`llama.runtime.parallel_layers`, as on a GPU) give fairscale's logits bit for
    bit, under the same state-dict keys."""
    weights = random_weights(GQA_PARAMS, seed=17)
    model = load_reference(tmp_path / "ckpt", weights, dtype)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(9))
    expected = incremental_logits(model, tokens, [6, 1, 1, 1, 1])
    keys = model.state_dict().keys()
    use_parallel_layers(model)
    assert isinstance(model.tok_embeddings, ParallelEmbedding)
    assert isinstance(model.layers[1].attention.wo, ParallelLinear)
    assert model.state_dict().keys() == keys
    assert torch.equal(incremental_logits(model, tokens, [6, 1, 1, 1, 1]), expected)


@needs_fbgemm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_no_packed_copies_without_memory_for_them(process_group, tmp_path, monkeypatch, caplog, dtype):
    """Copies of the weights (here float16's, 2 bytes a weight) are made only where twice their size is free; with
    a byte less, none is made, a warning says so, and every layer runs `F.linear`: Meta's logits bit for bit."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    weights = random_weights(GQA_PARAMS, seed=15)
    linear_weights = [v for k, v in weights.items() if "norm" not in k and "tok_embeddings" not in k]
    assert len(linear_weights) == 7 * GQA_PARAMS["n_layers"] + 1
    copy_bytes = 2 * sum(w.numel() for w in linear_weights)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))

    monkeypatch.setattr("llama.runtime.steps.free_memory", lambda device: 2 * copy_bytes)
    assert copies_made(load_tiny(tmp_path / "room", weights, dtype)) == {"fp16"}

    monkeypatch.setattr("llama.runtime.steps.free_memory", lambda device: 2 * copy_bytes - 1)
    with caplog.at_level(logging.WARNING, logger="llama.runtime.steps"):
        model = load_tiny(tmp_path / "no room", weights, dtype)
    assert "No copies of the weights" in caplog.text
    assert every_layer_on(model, "linear") and copies_made(model) == set()
    with_reference_attention(model)  # only the linear layers could differ from the reference
    expected = incremental_logits(reference_model(tmp_path / "reference", weights, dtype), tokens, [6, 1, 1])
    assert torch.equal(incremental_logits(model, tokens, [6, 1, 1]), expected)
    assert copies_made(model) == set()  # nor made by the first inputs
    # Where the memory cannot be measured (no /proc/meminfo), no copy is made either.
    monkeypatch.setattr("llama.runtime.steps.free_memory", lambda device: None)
    assert copies_made(load_tiny(tmp_path / "unknown", weights, dtype)) == set()


@needs_fbgemm
def test_float16_copy_holds_each_bfloat16_weight(monkeypatch):
    """The float16 copy gives back every bfloat16 weight exactly, but for the smallest (below 2**-17), which move by
    at most half of 2**-24; blocks of rows join in order. The same holds for float32 weights of bfloat16 values. A
    weight float16 cannot hold is not copied."""
    monkeypatch.setattr(llama.runtime.cpu.kernels, "FP16_BLOCK_VALUES", 7 * 16)  # 7 rows a block: 7, 7 and 6
    weight = torch.randn(20, 16, generator=torch.Generator().manual_seed(4))
    weight[0, :6] = torch.tensor([6e4, -6e4, 2**-14, 3 * 2**-17, 1e-7, -5e-9])
    weight = weight.bfloat16()
    packed = pack_as_fp16(weight)
    assert len(packed) == 3
    copy_ = fp16_linear(torch.eye(16), packed).T  # x @ weight.T with x = I gives weight.T
    exact = weight.float().abs() >= 2**-17
    assert torch.equal(copy_[exact], weight.float()[exact])
    assert (copy_ - weight.float()).abs().max() <= 2**-25
    assert copy_[0, 4] != weight.float()[0, 4]  # 1e-7 does round
    # A float32 weight of the same (bfloat16) values gets the same copy; one value that is not a bfloat16 value
    # (the weights of a float32 checkpoint) and it gets none: float16 would round it.
    as_float32 = weight.float()
    assert holds_bfloat16_values(as_float32)
    assert torch.equal(fp16_linear(torch.eye(16), pack_as_fp16(as_float32)).T, copy_)
    as_float32[7, 2] += 2**-20
    assert not holds_bfloat16_values(as_float32) and pack_as_fp16(as_float32) is None
    for value in (7e4, float("nan"), float("inf")):
        weight[3, 3] = value
        assert pack_as_fp16(weight) is None


@needs_fbgemm
def test_bfloat16_on_float16_copies_keeps_the_reference_results(process_group, tmp_path, monkeypatch):
    """On the "fp16" kernel (pinned here; the table gives it to AVX2 CPUs), a bfloat16 model runs every input on
    float16 copies of its weights, made at load. Its logits are as close to float32's as Meta's bfloat16 math is,
    they pick float32's next token at least as often, and greedy decoding gives Meta's tokens. The weights
    themselves stay as loaded."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    weights = random_weights(GQA_PARAMS, seed=12)
    fast = load_tiny(tmp_path / "fast", weights, torch.bfloat16)
    assert every_layer_on(fast, "fp16")
    held = held_copies(fast)  # made at load, before any input
    assert all(held.get(id(m), (None,))[0] == "fp16" for m in cpu_layers(fast))
    reference = reference_model(tmp_path / "reference", weights, torch.bfloat16)
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in reference.state_dict().items())

    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(5))
    exact = load_tiny(tmp_path / "float32", weights, torch.float32)(tokens, 0)
    expected = reference(tokens, 0)
    for logits in (
        incremental_logits(fast, tokens, [24] + [1] * 8),
        incremental_logits(fast, tokens[:1], [24] + [1] * 8),
    ):
        rows = len(logits)
        assert 0 < (logits - exact[:rows]).abs().max() < 1.5 * (expected[:rows] - exact[:rows]).abs().max()
        agree = (logits.argmax(-1) == exact[:rows].argmax(-1)).sum()
        assert agree >= (expected[:rows].argmax(-1) == exact[:rows].argmax(-1)).sum()

    prompt = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    for batch in (prompt, prompt[:1]):
        assert torch.equal(greedy_tokens(fast, batch, 20), greedy_tokens(reference, batch, 20))


@needs_onednn_bf16
def test_the_onednn_copies_are_made_at_load_not_by_the_first_prompt(process_group, tmp_path, monkeypatch):
    """In bfloat16 oneDNN runs on a copy of the weights in its blocked layout; made at load, the first prompt does
    not wait for it (half of a 3 s first prompt at 1B's shape, before), and runs on that very copy."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "onednn")
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=25), torch.bfloat16)
    layers = cpu_layers(model)
    assert every_layer_on(model, "onednn")
    made = [held_copies(model)[id(m)][1] for m in layers]
    assert all(copy_ is not None for copy_ in made)
    model(torch.randint(0, GQA_PARAMS["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1)), 0)
    assert all(held_copies(model)[id(m)][1] is copy_ for m, copy_ in zip(layers, made))


@needs_fbgemm
def test_float32_on_float16_copies_keeps_the_reference_results(process_group, tmp_path, monkeypatch):
    """On the "fp16" kernel (pinned here; the table gives it to one row and to a batch on every CPU it knows), a
    float32 model loaded from a bfloat16 checkpoint runs every input (decode steps, prompts long or short) on float16
    copies of its weights, made at load: its logits stay within 1e-4 of Meta's float32 math and greedy decoding gives
    Meta's tokens; state_dict() gives the float32 weights. A float32 checkpoint whose weights are not bfloat16 values
    gets no copies: it runs on `F.linear`, float16 copies being the pinned kernel."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    weights = random_weights(GQA_PARAMS, seed=23)  # bfloat16, as Meta ships checkpoints
    fast = load_tiny(tmp_path / "fast", weights, torch.float32)
    held = held_copies(fast)
    assert every_layer_on(fast, "fp16") and all(held.get(id(m), (None, None))[1] is not None for m in cpu_layers(fast))
    # The copy is what runs: a weight below 2**-17 comes out as float16 holds it.
    wo = copy.deepcopy(fast.layers[0].attention.wo)
    tiny = torch.tensor(1e-7).bfloat16().float()
    with torch.no_grad():
        wo.weight[0, 0] = tiny
    with torch.inference_mode():
        for rows in (3, 300):  # a decode step's few rows, and a long prompt's
            x = torch.eye(GQA_PARAMS["dim"]).repeat(rows // GQA_PARAMS["dim"] + 1, 1)[:rows]
            assert wo(x)[0, 0] == tiny.half().float() != tiny
    reference = reference_model(tmp_path / "reference", weights, torch.float32)
    assert all(torch.equal(fast.state_dict()[k], v) for k, v in reference.state_dict().items())

    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(5))
    expected = reference(tokens, 0)
    assert expected.abs().max() > 1
    for logits in (fast(tokens, 0), incremental_logits(fast, tokens, [24] + [1] * 8)):
        assert 0 < (logits - expected).abs().max() < ATOL  # not the reference's kernels, and within rounding
    one_row = incremental_logits(fast, tokens[:1], [24] + [1] * 8)
    assert (one_row - expected[:1]).abs().max() < ATOL
    prompt = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    for batch in (prompt, prompt[:1]):
        assert torch.equal(greedy_tokens(fast, batch, 20), greedy_tokens(reference, batch, 20))

    trained = trained_float32(weights)
    full_precision = load_tiny(tmp_path / "float32 values", trained, torch.float32)
    assert every_layer_on(full_precision, "linear") and copies_made(full_precision) == set()
    expected = reference_model(tmp_path / "float32 reference", trained, torch.float32)(tokens, 0)
    assert (incremental_logits(full_precision, tokens, [24] + [1] * 8) - expected).abs().max() < ATOL


def test_an_unknown_pinned_kernel_is_a_value_error_naming_the_kernels(process_group, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fast")
    with pytest.raises(ValueError, match="LLAMA_CPU_KERNEL='fast'") as raised:
        load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=12), torch.float32)
    assert all(kernel in str(raised.value) for kernel in ("fp16", "onednn", "linear"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_each_pinned_kernel_keeps_the_reference_results(process_group, tmp_path, monkeypatch, dtype):
    """Each kernel pinned through LLAMA_CPU_KERNEL runs every row class of every layer: the logits of `F.linear`'s
    layers bit for bit on "linear", and on "onednn" in bfloat16 (the same oneDNN kernel); on the others float32 logits
    within 1e-4 of them; greedy tokens equal in both dtypes."""
    weights = random_weights(GQA_PARAMS, seed=12)
    reference = reference_model(tmp_path / "reference", weights, dtype)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    expected = incremental_logits(reference, tokens, [8, 1, 1, 1, 1])
    expected_one_row = incremental_logits(reference, tokens[:1], [8, 1, 1, 1, 1])
    prompt = tokens[:, :6]
    for kernel in kernels_here(dtype):
        monkeypatch.setenv("LLAMA_CPU_KERNEL", kernel)
        model = load_tiny(tmp_path / kernel, weights, dtype)
        with_reference_attention(model)  # only the linear layers differ from the reference
        assert every_layer_on(model, kernel), kernel
        logits = incremental_logits(model, tokens, [8, 1, 1, 1, 1])
        one_row = incremental_logits(model, tokens[:1], [8, 1, 1, 1, 1])
        if kernel == "linear" or (kernel == "onednn" and dtype == torch.bfloat16):
            assert torch.equal(logits, expected) and torch.equal(one_row, expected_one_row), kernel
        elif dtype == torch.float32:
            assert (logits - expected).abs().max() < ATOL and (one_row - expected_one_row).abs().max() < ATOL
        for batch in (prompt, prompt[:1]):
            assert torch.equal(greedy_tokens(model, batch, 12), greedy_tokens(reference, batch, 12)), kernel


@needs_fbgemm
def test_the_load_report_names_the_kernel_each_row_class_runs_on(
    process_group, tiny_checkpoint, tokenizer_path, monkeypatch
):
    """After the load line, the report names the kernels the linear layers run on in each row class, with how many
    layers run each: all of them on the pinned one, or on what the table gives this CPU."""
    from llama import Llama

    build = dict(max_seq_len=32, max_batch_size=2, dtype="bfloat16")
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build)
    layers = 7 * TINY_PARAMS["n_layers"] + 1  # and the head
    assert kernels_line(generator) == (
        f"1 row: fp16 {layers}; 2-16 rows: fp16 {layers}; 17-127 rows: fp16 {layers}; 128+ rows: fp16 {layers}"
    )
    monkeypatch.delenv("LLAMA_CPU_KERNEL")
    generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build)
    by_class = zip(*(m.kernels for m in cpu_layers(generator.model)))
    counted = {name: collections.Counter(kernels) for name, kernels in zip(ROW_CLASS_NAMES, by_class)}
    said = {
        name: collections.Counter({k: int(n) for k, n in (pair.split() for pair in kernels.split(", "))})
        for name, kernels in (part.split(": ") for part in kernels_line(generator).split("; "))
    }
    assert said == counted and kernels_line(generator) == generator.load_report.kernels


def kernels_line(generator) -> str:
    """What the load report's second line, on the kernels, says of them."""
    line = str(generator.load_report).splitlines()[1]
    assert line.startswith("Kernels")
    return line.split(": ", 1)[1]


# The rule: what the CPU offers, the weights and the row count choose the kernel -------------------------------

CPUS = {"AVX2": AVX2_CPU, "AVX-512 with bfloat16": AVX512_BF16_CPU, "unknown": UNKNOWN_CPU}


@pytest.mark.parametrize("cpu", list(CPUS))
@pytest.mark.parametrize("checkpoint", ["bfloat16", "float32 of bfloat16 values", "float32 trained"])
def test_the_table_chooses_by_what_the_cpu_offers(process_group, tmp_path, monkeypatch, cpu, checkpoint):
    """The same model gets the kernel table's row for the CPU it runs on and its weights: bfloat16 weights run on
    float16 copies on an AVX2 CPU and on oneDNN's bfloat16 kernel on one with AVX-512 bfloat16; float32 weights that
    hold bfloat16 values (a float32 load of Meta's checkpoint) on float16 copies; float32 weights of other values on
    oneDNN's float32 kernel on an AVX-512 CPU (no copy) and on `F.linear` on an AVX2 one; every model on a CPU the
    table does not know runs `F.linear` (and holds no copies)."""
    offers = CPUS[cpu]
    if fbgemm_fp16_supported() is False and cpu != "unknown":
        pytest.skip("this torch build has no fbgemm (not x86): the table's float16 kernel cannot run")
    if cpu == "AVX-512 with bfloat16" and checkpoint == "bfloat16" and not cpu_offers().onednn_bf16:
        pytest.skip("oneDNN cannot copy bfloat16 weights for its kernel on this CPU")
    as_if_the_cpu_offered(monkeypatch, offers)
    weights = random_weights(GQA_PARAMS, seed=12)
    dtype = torch.bfloat16 if checkpoint == "bfloat16" else torch.float32
    if checkpoint == "float32 trained":
        weights = trained_float32(weights)
    model = load_tiny(tmp_path, weights, dtype)
    layers = cpu_layers(model)
    assert len(layers) == 7 * GQA_PARAMS["n_layers"] + 1
    kernels = {m.kernels for m in layers}
    assert len(kernels) == 1  # one row of the table for the whole model
    (chosen,) = kernels
    concrete = {
        ("AVX2", "bfloat16"): ("fp16",) * 4,
        ("AVX2", "float32 of bfloat16 values"): ("fp16",) * 4,
        ("AVX-512 with bfloat16", "bfloat16"): ("onednn",) * 4,
        ("AVX-512 with bfloat16", "float32 of bfloat16 values"): ("fp16",) * 4,
        ("AVX-512 with bfloat16", "float32 trained"): ("onednn",) * 4,
    }
    assert chosen == concrete.get((cpu, checkpoint), ("linear",) * 4)
    weights_kind = {
        "bfloat16": "bfloat16",
        "float32 of bfloat16 values": "float32 holding bfloat16",
        "float32 trained": "float32",
    }
    assert chosen == CPU_TABLE.get((offers.kind, weights_kind.get(checkpoint)), ("linear",) * 4)  # the spec
    assert copies_made(model) == (
        {"fp16", "onednn"} & set(chosen) if dtype == torch.bfloat16 else {"fp16"} & set(chosen)
    )


def test_a_cpu_capped_below_what_the_table_knows_runs_f_linear(process_group, tmp_path, monkeypatch):
    """An AVX-512 CPU whose oneDNN bfloat16 kernels are switched off (ONEDNN_MAX_CPU_ISA) is not the table's
    "AVX-512 with bfloat16" CPU: its bfloat16 layers do not run oneDNN's bfloat16 kernel."""
    as_if_the_cpu_offered(monkeypatch, CPUOffers("AVX512", False, ("avx512_bf16",)))
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=12), torch.bfloat16)
    assert all("onednn" not in m.kernels for m in cpu_layers(model))


def test_nothing_is_timed_at_load(process_group, tmp_path, monkeypatch):
    """A load times no kernel: with every clock a measurement could read out of order, two loads make the model
    ready to run, on the same kernels, which a load with the clocks working chooses too."""
    weights = random_weights(GQA_PARAMS, seed=12)

    def no_clock():
        raise AssertionError("a clock was read while the model was made ready to run")

    models = [load_reference(tmp_path / name, weights, torch.bfloat16) for name in ("first", "second")]
    for clock in ("perf_counter", "perf_counter_ns", "process_time", "thread_time", "monotonic"):
        monkeypatch.setattr(time, clock, no_clock)
    first, second = (for_runtime(model)[0] for model in models)
    monkeypatch.undo()
    chosen = [m.kernels for m in cpu_layers(first)]
    assert chosen == [m.kernels for m in cpu_layers(second)]
    assert chosen == [m.kernels for m in cpu_layers(load_tiny(tmp_path / "clocks", weights, torch.bfloat16))]


@needs_fbgemm
def test_a_kernel_the_table_names_that_cannot_run_a_layer_leaves_it_on_f_linear(process_group, tmp_path, monkeypatch):
    """On an AVX2 CPU the table gives float32 weights of bfloat16 values float16 copies: a layer whose weights were
    moved off bfloat16's values (fine-tuned in float32) cannot be copied to float16, and runs `F.linear` alone, the
    others their copies; logits stay within 1e-4 of Meta's. A torch build without fbgemm's float16 kernels runs
    every bfloat16 layer on `F.linear`, Meta's logits bit for bit."""
    as_if_the_cpu_offered(monkeypatch, AVX2_CPU)
    weights = random_weights(GQA_PARAMS, seed=12)
    tuned = {k: v.float() for k, v in weights.items()}
    tuned["layers.0.attention.wo.weight"] = trained_float32({"wo": weights["layers.0.attention.wo.weight"]})["wo"]
    model = load_tiny(tmp_path / "tuned", tuned, torch.float32)
    wo = model.layers[0].attention.wo
    held = held_copies(model)
    assert wo.kernels == ("linear",) * ROW_CLASSES and id(wo) not in held
    others = [m for m in cpu_layers(model) if m is not wo]
    assert all(m.kernels == ("fp16",) * ROW_CLASSES and held[id(m)][1] is not None for m in others)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    expected = reference_model(tmp_path / "tuned reference", tuned, torch.float32)(tokens, 0)
    assert (incremental_logits(model, tokens, [8, 1, 1, 1, 1]) - expected).abs().max() < ATOL

    monkeypatch.setattr(llama.runtime.cpu.layers, "fbgemm_fp16_supported", lambda: False)
    model = with_reference_attention(load_tiny(tmp_path / "no fbgemm", weights, torch.bfloat16))
    assert every_layer_on(model, "linear") and copies_made(model) == set()
    expected = incremental_logits(
        reference_model(tmp_path / "reference", weights, torch.bfloat16), tokens, [8, 1, 1, 1, 1]
    )
    assert torch.equal(incremental_logits(model, tokens, [8, 1, 1, 1, 1]), expected)
