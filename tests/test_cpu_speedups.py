"""The CPU speed-ups keep the reference math: llama.runtime.cpu's linear layers (packed oneDNN weights, float16 copies
of bfloat16 weights and of float32 ones holding bfloat16 values, matrix-vector kernels), fused attention, and
`llama.runtime.parallel_layers` against fairscale's layers, on tiny random weights.

The reference is the same checkpoint run as Meta's code runs it: `F.linear` and attention step by step
(`helpers.with_reference_attention`).
"""

import collections
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from helpers import (
    ATOL,
    GQA_PARAMS,
    TINY_PARAMS,
    causal_mask,
    incremental_logits,
    load_reference,
    load_tiny,
    with_reference_attention,
)

import llama.runtime.cpu
import llama.runtime.cpu.choice
import llama.runtime.cpu.kernels
import llama.runtime.cpu.layers
from llama.checkpoint import random_weights
from llama.model import Transformer
from llama.runtime.cpu import (
    CPULinear,
    FusedProduct,
    KernelCache,
    fbgemm_fp16_supported,
    fp16_linear,
    holds_bfloat16_values,
    onednn_bf16_supported,
    pack_as_fp16,
)
from llama.runtime.parallel_layers import ParallelEmbedding, ParallelLinear
from llama.runtime.steps import use_parallel_layers


def patch_cpu(monkeypatch, name: str, value) -> None:
    """Set the global `name` of every module of `llama.runtime.cpu` that uses it to `value`, for the test's duration."""
    for module in (llama.runtime.cpu.kernels, llama.runtime.cpu.layers, llama.runtime.cpu.choice):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def reference_model(tmp_path, weights, dtype) -> Transformer:
    """The same checkpoint as `load_tiny` gives, run as Meta's code runs it: `F.linear`, attention step by step."""
    return with_reference_attention(load_reference(tmp_path, weights, dtype))


def copy_holder(model: nn.Module, layer: CPULinear) -> nn.Module:
    """What holds `layer`'s copy for the kernels that run on one: the `FusedProduct` it is part of, or itself."""
    return next((m for m in model.modules() if isinstance(m, FusedProduct) and layer in m.layers), layer)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fast_path_gives_the_reference_logits_in_float32(process_group, tmp_path, tie):
    """Fused attention and the CPU linear layers keep float32 logits within 1e-4 of Meta's math."""
    params = GQA_PARAMS
    weights = random_weights(params, seed=11)
    if tie:
        del weights["output.weight"]
    loaded = load_tiny(tmp_path / "fast", weights, torch.float32)
    layers = [m for m in loaded.modules() if isinstance(m, CPULinear)]
    assert len(layers) == 7 * params["n_layers"] + 1
    if tie:
        assert loaded.output.weight.data_ptr() == loaded.tok_embeddings.weight.data_ptr()  # one table, not two
        weights["output.weight"] = weights["tok_embeddings.weight"]
    weights = {k: v.float() for k, v in weights.items()}
    assert {k: v.shape for k, v in loaded.state_dict().items()} == {k: v.shape for k, v in weights.items()}
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())  # the ordinary layout
    reference = reference_model(tmp_path / "reference", weights, torch.float32)
    assert not any(isinstance(m, CPULinear) for m in reference.modules())

    tokens = torch.randint(0, params["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    expected = reference(tokens, 0)
    assert expected.abs().max() > 1  # logits large enough that a wrong model could not pass by being tiny
    assert (loaded(tokens, 0) - expected).abs().max() < ATOL
    steps = incremental_logits(loaded, tokens, [8, 1, 1, 1, 1])
    assert (steps - expected).abs().max() < ATOL
    assert torch.equal(steps.argmax(-1), expected.argmax(-1))
    one_row = incremental_logits(loaded, tokens[:1], [8, 1, 1, 1, 1])  # batch 1 decodes one row at a time
    assert (one_row - expected[:1]).abs().max() < ATOL


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fast_path_keeps_greedy_tokens_and_torch_settings(process_group, tmp_path, dtype, monkeypatch):
    patch_cpu(monkeypatch, "fbgemm_fp16_supported", lambda: False)  # float16 copies: tested below
    weights = random_weights(GQA_PARAMS, seed=12)
    fast = load_tiny(tmp_path / "fast", weights, dtype)
    reference = reference_model(tmp_path / "reference", weights, dtype)
    prompt = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(3))
    onednn_enabled = torch.backends.mkldnn.enabled
    for batch in (prompt, prompt[:1]):  # batch 1 takes the matrix-vector kernels
        assert torch.equal(greedy_tokens(fast, batch, 20), greedy_tokens(reference, batch, 20))
    # A bfloat16 row switches oneDNN off for its own matmul only: the global switch is as the user left it.
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


def kernel_layer(dtype: torch.dtype, kernels: dict) -> CPULinear:
    """A 96 x 384 `CPULinear` of random weights that hold bfloat16 values, in `dtype`, on `kernels`."""
    layer = ColumnParallelLinear(384, 96, bias=False, gather_output=False, init_method=lambda w: w)
    weight = torch.randn(96, 384, generator=torch.Generator().manual_seed(5)).bfloat16().to(dtype)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return CPULinear(layer, kernels)


def kernels_here(dtype: torch.dtype) -> list:
    """The kernels this CPU and torch build can run for `dtype` (every candidate of one row, with copies)."""
    return llama.runtime.cpu.candidate_kernels(dtype, 1, fp16_holds=True, copies=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_each_kernel_gives_its_own_product_for_any_number_of_rows(process_group, dtype):
    """A layer on each kernel gives what that kernel's own call gives, bit for bit, for one row, a few and a
    prompt's many: `F.linear` (the reference's call) for "linear", and for "onednn" in bfloat16 (the same oneDNN
    kernel, on a packed copy); `torch.mv` for one row on "mv" (F.linear for more); fbgemm's product on a float16
    copy for "fp16"; oneDNN's on the weight for "onednn" in float32. Each is within rounding of `F.linear`."""
    generator = torch.Generator().manual_seed(6)
    for kernel in kernels_here(dtype):
        layer = kernel_layer(dtype, {1: kernel, 8: kernel, 256: kernel})
        weight = layer.weight
        for rows in (1, 3, 300):
            x = torch.randn(1, rows, 384, generator=generator).to(dtype)
            with torch.inference_mode():
                y, reference = layer(x), F.linear(x, weight)
                if kernel == "fp16":
                    own = fp16_linear(x, pack_as_fp16(weight))
                elif kernel == "onednn" and dtype == torch.float32:
                    own = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
                elif kernel == "mv" and rows == 1:
                    own = torch.mv(weight, x.reshape(-1)).view(1, 1, -1)
                else:
                    own = reference
            assert torch.equal(y, own), (kernel, rows)
            tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
            torch.testing.assert_close(y, reference, **tolerance)


def test_inputs_run_on_the_kernel_chosen_for_their_row_count(process_group, monkeypatch):
    """One row runs on the kernel chosen for one row, up to the batch's rows on the batch's, more on the prompt's."""
    calls = []
    run_kernel = llama.runtime.cpu.run_kernel
    patch_cpu(monkeypatch, "run_kernel", lambda kernel, *args: calls.append(kernel) or run_kernel(kernel, *args))
    layer = kernel_layer(torch.float32, {1: "mv", 8: "onednn", 256: "linear"})
    expected = {1: "mv", 2: "onednn", 8: "onednn", 9: "linear", 256: "linear", 1000: "linear"}
    for rows, kernel in expected.items():
        calls.clear()
        with torch.inference_mode():
            layer(torch.randn(rows, 384))
        assert calls == [kernel], rows


@pytest.mark.skipif(not onednn_bf16_supported(), reason="oneDNN has no bfloat16 kernels for this CPU (no AVX-512)")
def test_batched_bfloat16_steps_on_packed_weights_follow_weight_edits(process_group, tmp_path, monkeypatch):
    """On the "onednn" kernel, prompts and decode steps of bf16 sequences run on weights packed once for oneDNN
    (wq, wk and wv stacked in one copy, w1 and w3 in another): the logits of `F.linear` bit for bit, also after a
    weight is edited in place or replaced between calls."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "onednn")
    weights = random_weights(GQA_PARAMS, seed=15)
    packed = load_tiny(tmp_path / "packed", weights, torch.bfloat16)
    plain = load_reference(tmp_path / "plain", weights, torch.bfloat16)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(7))

    def steps(model):
        return incremental_logits(model, tokens, [6, 1, 1, 1, 1])

    before = steps(packed)
    assert torch.equal(before, steps(plain))
    assert all("onednn" in copy_holder(packed, m).packed for m in packed.modules() if isinstance(m, CPULinear))

    with torch.no_grad():
        for model in (packed, plain):
            model.layers[1].feed_forward.w2.weight.mul_(-1)
            model.layers[0].attention.wk.weight.mul_(0.5)  # one of three layers sharing a copy
    after = steps(packed)
    assert not torch.equal(after, before)
    assert torch.equal(after, steps(plain))

    output = replacement_of(packed.output.weight)
    packed.output.weight, plain.output.weight = nn.Parameter(output), nn.Parameter(output.clone())
    assert torch.equal(steps(packed), steps(plain))

    # The packed copies are dropped from copies of the model (they cannot be copied), and remade there.
    assert torch.equal(steps(copy.deepcopy(packed)), steps(plain))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_no_packed_copies_without_memory_for_them(process_group, tmp_path, monkeypatch, dtype):
    """A second copy of the weights is made only when the system has twice its size available."""
    monkeypatch.setattr("llama.distributed.available_memory", lambda: 0)
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=15), dtype)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(7))
    incremental_logits(model, tokens, [6, 1, 1])
    layers = [m for m in model.modules() if isinstance(m, CPULinear)]
    assert layers and not any(m.packed for m in layers)
    assert not any(isinstance(m, FusedProduct) for m in model.modules())
    assert not any({"fp16", "onednn"} & set(m.kernels.values()) for m in layers if m.weight.dtype == torch.bfloat16)


@pytest.mark.skipif(
    not (onednn_bf16_supported() and fbgemm_fp16_supported()), reason="needs oneDNN's bfloat16 and fbgemm's float16"
)
def test_where_memory_holds_one_copy_of_the_weights_each_product_runs_on_one(
    process_group, tmp_path, monkeypatch, caplog
):
    """Measured so that the float16 copy is fastest for one row, oneDNN's copy for a batch and a prompt, and
    `F.linear` on the weights as loaded next: with memory for both copies (twice their size available), each product
    holds both; with memory for one (or for two, shared by two ranks of one job on this machine), each keeps the
    float16 copy its decode steps run on, and runs the batch and the prompt on `F.linear`."""

    def fake_measure(jobs, flush):
        found = {}
        for job in jobs:
            seconds = {"fp16": 2e-9 if job.rows == 1 else 9e-9, "onednn": 3e-9, "mv": 8e-9, "linear": 4e-9}
            seconds = {k: seconds[k] for k in job.candidates}
            found[job.key] = llama.runtime.cpu.Measured(seconds, median=seconds, fp16_copy=1e-12)
        return found

    patch_cpu(monkeypatch, "measure", lambda jobs, flush, *_: fake_measure(jobs, flush))
    weights = random_weights(GQA_PARAMS, seed=12)
    copy_bytes = 2 * sum(w.numel() for w in weights.values())
    both = ({1: "fp16", 2: "onednn", 256: "onednn"}, {"fp16", "onednn"})
    one = ({1: "fp16", 2: "linear", 256: "linear"}, {"fp16"})
    # Room for two copies (for one process, or for each of two ranks on this machine), then for one.
    for copies, local_ranks, (kernels, packed) in [(2, "1", both), (2, "2", one), (1, "1", one)]:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / f"cache{copies}{local_ranks}"))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
        monkeypatch.setattr("llama.distributed.available_memory", lambda: (2 * copies + 1) * copy_bytes)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="llama.runtime.cpu"):
            model = load_tiny(tmp_path / f"copies{copies}{local_ranks}", weights, torch.bfloat16)
        layers = [m for m in model.modules() if isinstance(m, CPULinear)]
        assert layers and all(layer.kernels == kernels for layer in layers)
        assert all(set(copy_holder(model, layer).packed) == packed for layer in layers)
        assert ("Memory for one copy of the weights only" in caplog.text) == (packed == one[1])


def test_no_packed_weights_without_their_kernels(process_group, tmp_path, monkeypatch):
    """Without oneDNN's bfloat16 kernels (AVX-512 and later) or fbgemm's float16 ones (x86), a bfloat16 model runs
    on the bfloat16 weights as loaded, and asking for either kernel is a clear error, not a crash at the first
    batch."""
    patch_cpu(monkeypatch, "onednn_bf16_supported", lambda: False)
    patch_cpu(monkeypatch, "fbgemm_fp16_supported", lambda: False)
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=15), torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, CPULinear)]
    assert layers and all(set(layer.kernels.values()) <= {"mv", "linear"} for layer in layers)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(7))
    assert incremental_logits(model, tokens, [6, 1, 1, 1, 1]).isfinite().all()
    assert not any(layer.packed for layer in layers)
    with pytest.raises(ValueError, match="bfloat16 kernels, which this CPU lacks"):
        kernel_layer(torch.bfloat16, {1: "onednn"})
    with pytest.raises(ValueError, match="float16 kernels, which this torch build lacks"):
        kernel_layer(torch.bfloat16, {1: "fp16"})


needs_fbgemm = pytest.mark.skipif(not fbgemm_fp16_supported(), reason="this torch build has no fbgemm (not x86)")


@needs_fbgemm
def test_float16_copy_holds_each_bfloat16_weight(monkeypatch):
    """The float16 copy gives back every bfloat16 weight exactly, but for the smallest (below 2**-17), which move by
    at most half of 2**-24; blocks of rows join in order. The same holds for float32 weights of bfloat16 values. A
    weight float16 cannot hold is not copied."""
    patch_cpu(monkeypatch, "FP16_BLOCK_VALUES", 7 * 16)  # 7 rows a block: blocks of 7, 7 and 6
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
    """On the "fp16" kernel (pinned here: measuring picks it where it is fastest), a bfloat16 model runs every input
    on float16 copies of its weights, made at load. Its logits are as close to float32's as Meta's bfloat16 math
    is, they pick float32's next token at least as often, and greedy decoding gives Meta's tokens. The weights
    themselves stay as loaded."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    weights = random_weights(GQA_PARAMS, seed=12)
    fast = load_tiny(tmp_path / "fast", weights, torch.bfloat16)
    layers = [m for m in fast.modules() if isinstance(m, CPULinear)]
    assert layers and all(set(m.kernels.values()) == {"fp16"} for m in layers)
    assert all("fp16" in copy_holder(fast, m).packed for m in layers)  # made at load, before any input
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


@needs_fbgemm
def test_the_onednn_copies_are_made_at_load_not_by_the_first_prompt(process_group, tmp_path, monkeypatch):
    """In bfloat16 oneDNN runs on a copy of the weights in its blocked layout; made at load, the first prompt does
    not wait for it (half of a 3 s first prompt at 1B's shape, before)."""
    if not llama.runtime.cpu.onednn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bfloat16 kernels: its bfloat16 runs on no oneDNN copy")
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "onednn")
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=25), torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, CPULinear)]
    assert layers and all(copy_holder(model, m).packed["onednn"][1] is not None for m in layers)


def test_float32_on_float16_copies_keeps_the_reference_results(process_group, tmp_path, caplog, monkeypatch):
    """On the "fp16" kernel (pinned here), a float32 model loaded from a bfloat16 checkpoint runs every input
    (decode steps, prompts long or short) on float16 copies of its weights, made at load: its logits stay within
    1e-4 of Meta's float32 math and greedy decoding gives Meta's tokens; state_dict() gives the float32 weights. A
    float32 checkpoint whose weights are not bfloat16 values gets no copies (and no line saying it made them): it
    runs on `F.linear`, float16 copies being the pinned kernel."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    caplog.set_level(logging.INFO, logger="llama.runtime.cpu")
    weights = random_weights(GQA_PARAMS, seed=23)  # bfloat16, as Meta ships checkpoints
    fast = load_tiny(tmp_path / "fast", weights, torch.float32)
    layers = [m for m in fast.modules() if isinstance(m, CPULinear)]
    assert layers and all(
        set(m.kernels.values()) == {"fp16"} and copy_holder(fast, m).packed["fp16"][1] is not None for m in layers
    )
    assert "Made the weight copies this CPU's kernels run on (float16: 9, oneDNN: 0)" in caplog.text
    # The copy is what runs: a weight below 2**-17 comes out as float16 holds it.
    wo = copy.deepcopy(fast.layers[0].attention.wo)
    tiny = torch.tensor(1e-7).bfloat16().float()
    with torch.no_grad():
        wo.weight[0, 0] = tiny
    with torch.inference_mode():
        for rows in (3, llama.runtime.cpu.PROMPT_ROWS):  # a decode step's few rows, and a long prompt's
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

    generator = torch.Generator().manual_seed(24)
    trained = {k: v.float() + 1e-3 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}
    caplog.clear()
    full_precision = load_tiny(tmp_path / "float32 values", trained, torch.float32)
    layers = [m for m in full_precision.modules() if isinstance(m, CPULinear)]
    assert not any(copy_holder(full_precision, m).packed for m in layers)  # F.linear where the pinned kernel cannot run
    assert "Made the weight copies" not in caplog.text
    expected = reference_model(tmp_path / "float32 reference", trained, torch.float32)(tokens, 0)
    assert (incremental_logits(full_precision, tokens, [24] + [1] * 8) - expected).abs().max() < ATOL


@needs_fbgemm
def test_float16_copies_follow_weight_edits(process_group, tmp_path, monkeypatch):
    """On the "fp16" kernel, a weight edited in place or replaced is copied again at its next use: the logits are
    those of a model loaded with the new weights. A weight float16 cannot hold runs on `F.linear`."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    weights = random_weights(GQA_PARAMS, seed=19)
    model = load_tiny(tmp_path / "edited", weights, torch.bfloat16)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(6))

    def steps(model):
        return incremental_logits(model, tokens, [6, 1, 1, 1, 1])

    before = steps(model)
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight.mul_(-1)
    weights["layers.1.feed_forward.w2.weight"] = -weights["layers.1.feed_forward.w2.weight"]
    after = steps(model)
    assert not torch.equal(after, before)
    assert torch.equal(after, steps(load_tiny(tmp_path / "loaded", weights, torch.bfloat16)))

    output = replacement_of(model.output.weight)
    model.output.weight = nn.Parameter(output)
    weights["output.weight"] = output
    assert torch.equal(steps(model), steps(load_tiny(tmp_path / "replaced", weights, torch.bfloat16)))
    # The copies are dropped from copies of the model (they cannot be copied), and remade there.
    assert torch.equal(steps(copy.deepcopy(model)), steps(model))

    # Layers that share one copy (wq, wk, wv; w1, w3) follow an edit or replacement of any of them.
    with torch.no_grad():
        model.layers[0].attention.wk.weight.mul_(0.5)
    weights["layers.0.attention.wk.weight"] = weights["layers.0.attention.wk.weight"] * 0.5
    w3 = replacement_of(model.layers[1].feed_forward.w3.weight)
    model.layers[1].feed_forward.w3.weight = nn.Parameter(w3)
    weights["layers.1.feed_forward.w3.weight"] = w3
    assert torch.equal(steps(model), steps(load_tiny(tmp_path / "group edited", weights, torch.bfloat16)))

    attention = model.layers[0].attention
    with torch.no_grad():
        attention.wq.weight[0, 0] = 1e5  # beyond float16's 65504: the three layers sharing its copy fall back
    x = torch.randn(3, GQA_PARAMS["dim"]).bfloat16()
    for layer, output in zip((attention.wq, attention.wk, attention.wv), attention.qkv(x)):
        assert torch.equal(output, F.linear(x, layer.weight))
    assert attention.qkv.packed["fp16"][1] is None


@pytest.mark.parametrize(
    "kernel",
    [
        pytest.param("fp16", marks=needs_fbgemm),
        pytest.param("onednn", marks=pytest.mark.skipif(not onednn_bf16_supported(), reason="no oneDNN bfloat16")),
    ],
)
def test_layers_sharing_a_copy_each_give_their_own_product(process_group, tmp_path, monkeypatch, kernel):
    """wq, wk and wv (and w1, w3) run as one product (`FusedQKV`, `FusedW13`, which `print(model)` names) on one copy
    of their stacked weights (float16 for fbgemm, oneDNN's layout for oneDNN), each taking its share: for a prompt's
    rows and for one row, each layer's output is bit for bit that of its weight's own copy."""
    monkeypatch.setenv("LLAMA_CPU_KERNEL", kernel)
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=21), torch.bfloat16)
    attention, feed_forward = model.layers[0].attention, model.layers[1].feed_forward
    qkv = (attention.wq, attention.wk, attention.wv)
    assert attention.qkv.layers == qkv and feed_forward.w13.layers == (feed_forward.w1, feed_forward.w3)
    grouped = [layer for m in model.modules() if isinstance(m, FusedProduct) for layer in m.layers]
    assert feed_forward.w2 not in grouped and model.output not in grouped
    assert "FusedQKV" in str(model) and "FusedW13" in str(model)  # print(model) says what runs

    def alone(layer, x):
        if kernel == "fp16":
            return fp16_linear(x, pack_as_fp16(layer.weight))
        return llama.runtime.cpu.run_kernel("onednn", x, None, torch.ops.mkldnn._reorder_linear_weight(layer.weight))

    generator = torch.Generator().manual_seed(9)
    x, y = (torch.randn(2, 5, GQA_PARAMS["dim"], generator=generator).bfloat16() for _ in range(2))
    with torch.inference_mode():
        for input in (x, y[:, :1]):  # a prompt's rows and one row
            assert all(torch.equal(out, alone(layer, input)) for layer, out in zip(qkv, attention.qkv(input)))
            w1, w3 = feed_forward.w13(input)
            assert torch.equal(w1, alone(feed_forward.w1, input)) and torch.equal(w3, alone(feed_forward.w3, input))


def test_an_unknown_pinned_kernel_is_a_value_error_naming_the_kernels(process_group, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fast")
    with pytest.raises(ValueError, match="LLAMA_CPU_KERNEL='fast' is not a CPU kernel: set one of fp16, onednn, mv"):
        load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=12), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_each_pinned_kernel_keeps_the_reference_results(process_group, tmp_path, monkeypatch, dtype):
    """Each kernel pinned through LLAMA_CPU_KERNEL runs every product it can run (and `F.linear` the others): the
    logits of `F.linear`'s layers bit for bit on "linear", and on "onednn" in bfloat16 (the same oneDNN kernel);
    on the others float32 logits within 1e-4 of them and greedy tokens equal in both dtypes."""
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
        layers = [m for m in model.modules() if isinstance(m, CPULinear)]
        assert all(m.kernels[1] == kernel for m in layers), kernel
        logits = incremental_logits(model, tokens, [8, 1, 1, 1, 1])
        one_row = incremental_logits(model, tokens[:1], [8, 1, 1, 1, 1])
        if kernel == "linear" or (kernel == "onednn" and dtype == torch.bfloat16):
            assert torch.equal(logits, expected) and torch.equal(one_row, expected_one_row), kernel
        elif dtype == torch.float32:
            assert (logits - expected).abs().max() < ATOL and (one_row - expected_one_row).abs().max() < ATOL
        for batch in (prompt, prompt[:1]):
            assert torch.equal(greedy_tokens(model, batch, 12), greedy_tokens(reference, batch, 12)), kernel


def measured_products(monkeypatch) -> list:
    """A list that gets each (product, rows) that `llama.runtime.cpu` measures from now on."""
    measured = []
    measure = llama.runtime.cpu.measure

    def counting(jobs, flush, *rounds):
        measured.extend((job.name, job.rows) for job in jobs)
        return measure(jobs, flush, *rounds)

    patch_cpu(monkeypatch, "measure", counting)
    return measured


def steady_timings(monkeypatch) -> None:
    """Every measurement from now on finds the same figures, each kernel its own (on a shared CI machine, real
    timings of a tiny model's products can differ by more than the cache's re-check allows)."""
    fake = {"fp16": 3e-9, "onednn": 2e-9, "mv": 2.5e-9, "linear": 4e-9}
    patch_cpu(
        monkeypatch,
        "time_kernels",
        lambda runs, _, rounds=5: [{k: [fake[k]] * rounds for k in calls} for calls in runs],
    )


def chosen_kernels(model) -> list:
    return [m.kernels for m in model.modules() if isinstance(m, CPULinear)]


def test_kernels_are_measured_once_then_taken_from_the_cache(process_group, tmp_path, monkeypatch, caplog):
    """The first load measures each product's kernels and caches what it found under $XDG_CACHE_HOME; a second
    process's load (the same CPU and torch) chooses from there without measuring; a new torch version, or
    instructions capped by an environment variable, measure again. Each choice is logged."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured = measured_products(monkeypatch)
    steady_timings(monkeypatch)
    weights = random_weights(GQA_PARAMS, seed=12)
    with caplog.at_level(logging.INFO, logger="llama.runtime.cpu"):
        first = load_tiny(tmp_path / "first", weights, torch.bfloat16)
    # embedding-sized head, wq+wk+wv, wo, w1+w3, w2: one row, the batch of 2 and a prompt each
    assert len(measured) == 5 * 3 and len(set(measured)) == len(measured)
    assert (tmp_path / "cache" / "llama3" / "kernels.json").is_file()
    assert "CPU kernel for bfloat16 512x64, 1 rows:" in caplog.text and "(measured: " in caplog.text

    measured.clear()
    caplog.clear()
    KernelCache.IN_PROCESS.clear()  # as a new process starts: from the file
    with caplog.at_level(logging.INFO, logger="llama.runtime.cpu"):
        second = load_tiny(tmp_path / "second", weights, torch.bfloat16)
    # only the re-check of the cache: the largest product (the head), one row; it held, so the next load re-checks
    # no more
    assert measured == [("bfloat16 512x64", 1)] and chosen_kernels(second) == chosen_kernels(first)
    assert "kernels.json: " in caplog.text
    measured.clear()
    load_tiny(tmp_path / "third", weights, torch.bfloat16)
    assert measured == []

    monkeypatch.setattr(torch, "__version__", "9.9.9")
    load_tiny(tmp_path / "new torch", weights, torch.bfloat16)
    assert len(measured) == 5 * 3

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the kernels of another CPU: measured again
    load_tiny(tmp_path / "capped", weights, torch.bfloat16)
    assert len(measured) == 2 * 5 * 3


@pytest.mark.parametrize(
    "damage",
    [
        '{"format": 3, "measured": {"x": ',
        "[1, 2]",
        '{"format": 3, "measured": {"x": {"seconds": {"turbo": 1e-9}, "median": {"turbo": 1e-9}}}}',
        '{"format": 3, "measured": {"x": {"seconds": {"fp16": NaN}, "median": {"fp16": 1e-9}}}}',
        '{"format": 3, "measured": {"x": {"seconds": {"fp16": 1e-9}}}}',
        '{"format": 1, "choices": {"x": "fp16"}}',
        "\udcff",
    ],
    ids=["truncated", "not-a-table", "unknown-kernel", "not-a-time", "no-median", "older-format", "not-utf8"],
)
def test_a_damaged_cache_file_is_measured_again_and_rewritten(process_group, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "cache" / "llama3" / "kernels.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(damage.encode("utf-8", "surrogateescape"))
    measured = measured_products(monkeypatch)
    steady_timings(monkeypatch)
    load_tiny(tmp_path / "first", random_weights(GQA_PARAMS, seed=12), torch.float32)
    assert len(measured) == 5 * 3
    measured.clear()
    KernelCache.IN_PROCESS.clear()  # as a new process starts: from the file
    load_tiny(tmp_path / "second", random_weights(GQA_PARAMS, seed=12), torch.float32)
    assert measured == [("float32 512x64", 1)]  # the file was rewritten, whole: only its re-check is measured


def test_the_fastest_candidate_is_chosen(process_group, tmp_path, monkeypatch):
    """Whichever candidate measures fastest for a row count is the one that row count runs on."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for fastest in ("linear", "onednn"):
        fake = {"fp16": 3.0, "onednn": 2.0, "mv": 2.5, "linear": 4.0, fastest: 1.0}
        patch_cpu(monkeypatch, "time_kernels", lambda runs, *_: [{k: [fake[k]] for k in calls} for calls in runs])
        monkeypatch.setattr(torch, "__version__", f"measured for {fastest}")
        model = load_tiny(tmp_path / fastest, random_weights(GQA_PARAMS, seed=12), torch.float32)
        assert all(set(kernels.values()) == {fastest} for kernels in chosen_kernels(model))


def test_one_lucky_round_does_not_choose_a_kernel(process_group, tmp_path, monkeypatch):
    """A kernel that was fastest in one round of five but slower in the other four is not chosen: decoding meets
    its usual speed, step after step."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rounds = {"fp16": [3.0] * 5, "onednn": [2.0] * 5, "mv": [2.5] * 5, "linear": [3.0, 0.5, 3.0, 3.0, 3.0]}
    patch_cpu(monkeypatch, "time_kernels", lambda runs, *_: [{k: rounds[k] for k in calls} for calls in runs])
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=12), torch.float32)
    assert all(set(kernels.values()) == {"onednn"} for kernels in chosen_kernels(model))


def test_a_kernel_more_than_twice_as_slow_as_the_best_sits_out_the_later_rounds(monkeypatch):
    """After each round, a kernel more than twice as slow as its product's best is not timed again (a load spends no
    time on a kernel that cannot win); one within twice the best is timed in every round, and so is each product's
    best, product by product."""
    from llama.runtime import timing

    seconds = {"best": 1.0, "close": 2.0, "slow": 2.1, "alone": 5.0}
    monkeypatch.setattr(timing, "timed", lambda call: seconds[call()])
    runs = [{name: lambda name=name: name for name in ("best", "close", "slow")}, {"alone": lambda: "alone"}]
    found = timing.time_kernels(runs, None, rounds=3)
    assert found == [{"best": [1.0] * 3, "close": [2.0] * 3, "slow": [2.1]}, {"alone": [5.0] * 3}]


def timings_of(rounds_by_kernel: dict):
    """A `time_kernels` that finds `rounds_by_kernel[kernel]` for each kernel of every product (a list of rounds, or
    one figure for every round)."""

    def rounds_of(kernel, rounds):
        found = rounds_by_kernel[kernel]
        return list(found) if isinstance(found, list) else [found] * rounds

    return lambda runs, _, rounds=5: [{k: rounds_of(k, rounds) for k in calls} for calls in runs]


def test_a_measurement_on_a_busy_machine_is_cached_and_re_checked(process_group, tmp_path, monkeypatch, caplog):
    """Rounds that disagree (another program took the cores for part of them) are timed again; where they still
    disagree, the figures choose all the same, a warning says so, and they are cached, so that every load of this
    process runs the same kernels. The next process's first load (a quiet one) re-checks them, finds them measured on
    a busier machine, and measures every product again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured = measured_products(monkeypatch)
    busy = {"onednn": [1e-9, 1e-9, 5e-9, 5e-9, 5e-9], "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}  # busy from round 3
    quiet = {**busy, "onednn": 1e-9}
    patch_cpu(monkeypatch, "time_kernels", timings_of(busy))
    weights = random_weights(GQA_PARAMS, seed=12)
    with caplog.at_level(logging.WARNING, logger="llama.runtime.cpu"):
        first = load_tiny(tmp_path / "busy", weights, torch.float32)
    assert "The CPU was busy while its kernels were measured" in caplog.text
    assert (tmp_path / "cache" / "llama3" / "kernels.json").is_file()
    assert all(kernels[1] == "mv" for kernels in chosen_kernels(first))  # by the busy medians
    measured.clear()
    patch_cpu(monkeypatch, "time_kernels", timings_of(quiet))
    again = load_tiny(tmp_path / "again", weights, torch.float32)  # the same process: settled, not re-checked
    assert measured == [] and chosen_kernels(again) == chosen_kernels(first)

    KernelCache.IN_PROCESS.clear()  # as a new process starts
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llama.runtime.cpu"):
        quiet_load = load_tiny(tmp_path / "quiet", weights, torch.float32)
    assert "were measured on a busier machine" in caplog.text
    assert len(measured) == 1 + 5 * 3  # the re-check, then every product
    assert all(set(kernels.values()) == {"onednn"} for kernels in chosen_kernels(quiet_load))


def test_a_re_check_on_a_machine_busy_now_keeps_the_cache(process_group, tmp_path, monkeypatch, caplog):
    """A load that re-checks while another process works beside it (as the second of two loads started together
    does, while the first finishes) finds the cached choice steadily 7x slower than the cache says, and another
    kernel ahead: the machine is busy now, not then. It keeps the cache and runs its kernels, unconfirmed; a quiet
    load after it confirms them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured = measured_products(monkeypatch)
    weights = random_weights(GQA_PARAMS, seed=12)
    quiet = {"onednn": 1e-9, "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}
    patch_cpu(monkeypatch, "time_kernels", timings_of(quiet))
    first = load_tiny(tmp_path / "first", weights, torch.float32)
    assert all(kernels[1] == "onednn" for kernels in chosen_kernels(first))

    measured.clear()
    KernelCache.IN_PROCESS.clear()  # as a new process starts
    patch_cpu(monkeypatch, "time_kernels", timings_of({**quiet, "onednn": 7e-9}))
    with caplog.at_level(logging.WARNING, logger="llama.runtime.cpu"):
        busy_now = load_tiny(tmp_path / "busy now", weights, torch.float32)
    assert "were measured on a busier machine" not in caplog.text
    assert len(measured) == 1 and chosen_kernels(busy_now) == chosen_kernels(first)  # the re-check alone

    measured.clear()
    KernelCache.IN_PROCESS.clear()
    patch_cpu(monkeypatch, "time_kernels", timings_of(quiet))
    load_tiny(tmp_path / "quiet", weights, torch.float32)
    assert len(measured) == 1  # re-checked again, and confirmed
    measured.clear()
    KernelCache.IN_PROCESS.clear()
    load_tiny(tmp_path / "and again", weights, torch.float32)
    assert measured == []


def test_a_cache_measured_on_a_busier_machine_is_measured_again_once(process_group, tmp_path, monkeypatch, caplog):
    """Issue 45's case: a first load measured while another program held the cores, slowing one kernel (here
    oneDNN, 9x) steadily, so its rounds agreed and were cached. The next process's first load, on a quiet machine,
    re-checks the largest product's kernels, finds the cached choice no longer the fastest, measures every product
    again (a warning says the results may change this once) and runs on the fastest; the process after that finds
    the cache holds and marks it so, and later ones re-check no more."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured = measured_products(monkeypatch)
    weights = random_weights(GQA_PARAMS, seed=12)
    patch_cpu(monkeypatch, "time_kernels", timings_of({"onednn": 9e-9, "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}))
    busy = load_tiny(tmp_path / "busy", weights, torch.float32)
    assert all(kernels[1] == "mv" for kernels in chosen_kernels(busy))  # one row: mv, where oneDNN is fastest

    measured.clear()
    KernelCache.IN_PROCESS.clear()
    patch_cpu(monkeypatch, "time_kernels", timings_of({"onednn": 1e-9, "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}))
    with caplog.at_level(logging.WARNING, logger="llama.runtime.cpu"):
        quiet = load_tiny(tmp_path / "quiet", weights, torch.float32)
    assert "were measured on a busier machine" in caplog.text
    assert len(measured) == 1 + 5 * 3  # the re-check, then every product
    assert all(kernels[1] == "onednn" for kernels in chosen_kernels(quiet))

    measured.clear()
    KernelCache.IN_PROCESS.clear()
    again = load_tiny(tmp_path / "again", weights, torch.float32)
    assert len(measured) == 1 and chosen_kernels(again) == chosen_kernels(quiet)  # re-checked: it holds
    measured.clear()
    KernelCache.IN_PROCESS.clear()
    load_tiny(tmp_path / "and again", weights, torch.float32)
    assert measured == []


def test_every_load_in_a_process_chooses_alike_where_the_cache_cannot_be_written(
    process_group, tmp_path, monkeypatch, caplog
):
    """With no writable cache folder, a second load in the same process still runs the first load's kernels, though
    its own timings would choose others."""
    blocked = tmp_path / "not a folder"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    weights = random_weights(GQA_PARAMS, seed=12)
    patch_cpu(monkeypatch, "time_kernels", timings_of({"onednn": 9e-9, "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}))
    with caplog.at_level(logging.WARNING, logger="llama.runtime.cpu"):
        first = load_tiny(tmp_path / "first", weights, torch.float32)
    assert "Could not write the CPU kernel cache" in caplog.text
    patch_cpu(monkeypatch, "time_kernels", timings_of({"onednn": 1e-9, "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}))
    second = load_tiny(tmp_path / "second", weights, torch.float32)
    assert chosen_kernels(second) == chosen_kernels(first)
    assert all(kernels[1] == "mv" for kernels in chosen_kernels(second))


def test_a_float16_copy_is_made_only_where_it_repays_its_making_within_a_full_context(
    process_group, tmp_path, monkeypatch, caplog
):
    """Measured so that fbgemm's float16 copy is the fastest for prompts only, by 1 ns a weight per 256-row product,
    and takes 10 ns a weight to make: with a context of 32 tokens it would save 0.125 ns a weight, so no copy is
    made and every row count runs on its fastest other kernel; a context of 5120 tokens (20 such products: 20 ns)
    repays it, and prompts run on the copy, chosen from the cached measurements without measuring again."""
    if not fbgemm_fp16_supported():
        pytest.skip("this torch build has no fbgemm float16 kernels")  # x86 builds have them
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def fake_measure(jobs, flush):
        found = {}
        for job in jobs:
            others = [k for k in job.candidates if k != "fp16"]  # the first of them the fastest
            seconds = {k: (3 + i) * 1e-9 for i, k in enumerate(others)}
            seconds["fp16"] = 2e-9 if job.rows == llama.runtime.cpu.PROMPT_ROWS else 4e-9
            found[job.key] = llama.runtime.cpu.Measured(seconds, median=seconds, fp16_copy=1e-8)
        return found

    measured = []
    patch_cpu(monkeypatch, "measure", lambda jobs, flush, *_: measured.extend(jobs) or fake_measure(jobs, flush))
    weights = random_weights(GQA_PARAMS, seed=12)
    with caplog.at_level(logging.INFO, logger="llama.runtime.cpu"):
        short = load_tiny(tmp_path / "short", weights, torch.bfloat16, max_seq_len=32)
    assert len(measured) == 5 * 3 and "No float16 copy for bfloat16 512x64: fastest for 256 rows" in caplog.text
    prompt = torch.randint(0, GQA_PARAMS["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(3))
    short(prompt, 0)
    for layer in (m for m in short.modules() if isinstance(m, CPULinear)):
        assert layer.kernels == fastest_but_fp16(layer) and "fp16" not in copy_holder(short, layer).packed

    measured.clear()
    KernelCache.IN_PROCESS.clear()  # as a new process starts: from the file
    long = load_tiny(tmp_path / "long", weights, torch.bfloat16, max_seq_len=20 * llama.runtime.cpu.PROMPT_ROWS)
    assert [job.rows for job in measured] == [1]  # the cache's re-check only
    for layer in (m for m in long.modules() if isinstance(m, CPULinear)):
        assert layer.kernels == {**fastest_but_fp16(layer), 256: "fp16"}
        assert copy_holder(long, layer).packed["fp16"][1] is not None  # made at load


def fastest_but_fp16(layer: CPULinear) -> dict:
    """The first candidate other than "fp16" for each row count (1, the batch of 2, a prompt)."""
    candidates = {
        rows: llama.runtime.cpu.candidate_kernels(layer.weight.dtype, rows, True, True) for rows in (1, 2, 256)
    }
    return {rows: next(k for k in kernels if k != "fp16") for rows, kernels in candidates.items()}


def test_a_float16_lead_within_the_spread_of_its_own_timings_makes_no_copy():
    """A one-row lead of 0.2 ns a weight over oneDNN would repay a copy that takes 10 ns a weight to make within
    1024 steps (20 ns); but where float16's median round was itself 0.15 ns behind its best, only 0.05 ns of the
    lead is sure (5 ns over the context): no copy, and one row runs on oneDNN."""
    seconds = {"fp16": 1.0e-10, "onednn": 1.2e-10, "linear": 2e-10}
    steady = llama.runtime.cpu.Measured(seconds, median=seconds, fp16_copy=1e-8)
    unsteady = llama.runtime.cpu.Measured(seconds, median={**seconds, "fp16": 1.15e-10}, fp16_copy=1e-8)
    assert llama.runtime.cpu.kernels_for({1: steady}, max_seq_len=1024) == {1: "fp16"}
    assert llama.runtime.cpu.kernels_for({1: unsteady}, max_seq_len=1024) == {1: "onednn"}


@needs_fbgemm
def test_the_load_report_names_the_kernel_each_product_runs_on(
    process_group, tiny_checkpoint, tokenizer_path, monkeypatch
):
    """After the load line, the report names the kernels the linear layers run on at each row count they were
    chosen for, with how many layers run each: all of them on the pinned one, or on what the measurement chose."""
    from llama import Llama
    from llama.runtime.cpu.layers import CPULinear

    build = dict(max_seq_len=32, max_batch_size=2, dtype="bfloat16")
    monkeypatch.setenv("LLAMA_CPU_KERNEL", "fp16")
    report = str(Llama.build(str(tiny_checkpoint), tokenizer_path, **build).load_report)
    layers = 7 * TINY_PARAMS["n_layers"] + 1  # and the head
    assert report.splitlines()[1] == (
        f"Kernels, by rows per product: 1 row: fp16 {layers}; 2 rows: fp16 {layers}; 256 rows: fp16 {layers}"
    )
    monkeypatch.delenv("LLAMA_CPU_KERNEL")
    generator = Llama.build(str(tiny_checkpoint), tokenizer_path, **build)
    chosen = [m.kernels for m in generator.model.modules() if isinstance(m, CPULinear)]
    one_row = collections.Counter(kernels[1] for kernels in chosen)
    named = ", ".join(f"{kernel} {n}" for kernel, n in one_row.most_common())
    assert str(generator.load_report).splitlines()[1].startswith(f"Kernels, by rows per product: 1 row: {named}; ")
