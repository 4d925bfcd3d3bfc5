"""The static-shape decode step (`Transformer.decode_step`), eager and through torch.compile, and the eager
path on CUDA against the CPU's, on tiny random weights.
"""

import logging
import re
import time

import pytest
import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear
from helpers import ATOL, GQA_PARAMS, load_tiny, smollm2_gguf
from torch._dynamo.utils import counters

from llama.checkpoint import load_model, model_args_from, open_checkpoint, random_weights
from llama.model import Transformer
from llama.runtime.compiled import is_compiled
from llama.runtime.parallel_layers import ParallelLinear
from llama.runtime.quantized import quantize_layer
from llama.runtime.steps import FROZEN_INT8_OPTIONS, compiled_decode_step, unpack_layers, with_code_of_its_own


def static_steps(step, model: Transformer, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits for positions prompt_len.. of `tokens`: the prompt through `forward`, then one `step` per token."""
    logits = [model(tokens[:, :prompt_len], 0)[:, -1:]]
    for pos in range(prompt_len, tokens.shape[1] - 1):
        logits.append(step(tokens[:, pos : pos + 1], torch.tensor([pos])))
    return torch.cat(logits, dim=1)


def test_decode_step_gives_the_logits_of_forward_and_ignores_stale_cache(process_group, tmp_path):
    """decode_step attends over the whole cache; what an earlier, longer sequence left there must not count."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=13), torch.float32)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=generator)
    expected = model(tokens, 0)[:, 5:-1]
    model(torch.randint(0, GQA_PARAMS["vocab_size"], (2, 32), generator=generator), 0)  # fills the whole cache
    got = static_steps(model.decode_step, model, tokens, prompt_len=6)
    assert expected.abs().max() > 1
    assert (got - expected).abs().max() < ATOL


def assert_same_completions(got, expected):
    """The same text_completion texts, and logprobs apart by float32 rounding only."""
    assert [c["generation"] for c in got] == [c["generation"] for c in expected]
    for a, b in zip(got, expected):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) < ATOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "device", ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
)
def test_compiled_decoding_keeps_greedy_tokens(tiny_checkpoint, tokenizer_path, process_group, device, caplog):
    """Llama.build(compile=True) decodes through torch.compile (on CUDA, CUDA graphs); float32 tokens stay those of
    the eager path. Compiling is announced, once per batch size, and left out of the speed reported."""
    from llama import Llama

    generator = Llama.build(
        str(tiny_checkpoint), tokenizer_path, max_seq_len=48, max_batch_size=2, device=device, dtype="float32"
    )
    prompts = ["The capital of France is", "1, 2, 3,"]
    eager = generator.text_completion(prompts, temperature=0, max_gen_len=16, logprobs=True)
    counters.clear()
    caplog.set_level(logging.INFO, logger="llama.progress")
    generator.compile_decode_step()
    started = time.perf_counter()
    compiled = generator.text_completion(prompts, temperature=0, max_gen_len=16, logprobs=True)
    wall_seconds = time.perf_counter() - started
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # the whole step, compiled
    assert counters["inductor"]["cudagraph_skips"] == 0  # on CUDA, replayed as a CUDA graph
    assert_same_completions(compiled, eager)
    notices = [r.getMessage() for r in caplog.records if r.name == "llama.progress"]
    assert notices[0].startswith("Compiling the decode step for batch size 2 ")
    assert re.fullmatch(r"Compiled the decode step for batch size 2 in \d+\.\d s", notices[1])
    assert generator.last_speed.tokens == sum(len(c["tokens"]) for c in compiled)
    compile_seconds = generator.decoder.decode_step.compile_seconds
    assert 0 < generator.last_speed.seconds <= wall_seconds - compile_seconds  # compiling left out
    counters.clear()
    generator.text_completion(["Prompts of other lengths", "and another length of output"], max_gen_len=9)
    assert counters["stats"]["unique_graphs"] == 0  # the same compiled step, not compiled again
    assert len([r for r in caplog.records if r.name == "llama.progress"]) == 2  # and not announced again


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_decodes_the_tokens_of_the_cpu(tiny_checkpoint, tokenizer_path, process_group):
    """The eager path on a GPU (the reference's device) gives the float32 tokens and logprobs of the CPU path,
    which the other tests check against the reference math."""
    from llama import Llama

    prompts = ["The capital of France is", "1, 2, 3,"]
    completions = {}
    for device in ("cpu", "cuda"):
        generator = Llama.build(
            str(tiny_checkpoint), tokenizer_path, max_seq_len=48, max_batch_size=2, device=device, dtype="float32"
        )
        completions[device] = generator.text_completion(prompts, temperature=0, max_gen_len=16, logprobs=True)
    assert_same_completions(completions["cuda"], completions["cpu"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "device", ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
)
def test_only_quantized_weights_on_one_gpu_compile_unasked(tiny_checkpoint, tokenizer_path, process_group, device):
    """`compile=None`, the default, compiles the decode step for quantized weights on one GPU only (where the
    compiled step decodes fastest); on the CPU, and for float weights anywhere, nothing compiles unasked (a minute
    at the first step), and compile=False keeps the decode step uncompiled everywhere."""
    from llama import Llama

    def decode_step(**options):
        return Llama.build(
            str(tiny_checkpoint), tokenizer_path, max_seq_len=32, max_batch_size=1, device=device, **options
        ).decode_step

    assert is_compiled(decode_step(quantize="int8")) == (device == "cuda")
    assert not is_compiled(decode_step())
    assert not is_compiled(decode_step(quantize="int8", compile=False))
    assert is_compiled(decode_step(compile=True))


@pytest.mark.slow
def test_compiled_step_is_one_graph_with_fairscale_layers(process_group, tmp_path):
    """A model put back on fairscale's layers (whose all-reduce torch.compile cannot trace) still compiles to one
    graph (one CUDA graph): compiling swaps in `llama.runtime.parallel_layers`, with the same weights and logits."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=16), torch.float32)
    unpack_layers(model)  # fairscale's layers, as in Meta's code
    weights = model.state_dict()
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(8))
    expected = static_steps(model.decode_step, model, tokens, prompt_len=6)
    counters.clear()
    got = static_steps(compiled_decode_step(model), model, tokens, prompt_len=6)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert expected.abs().max() > 1
    assert (got - expected).abs().max() < ATOL
    assert isinstance(model.layers[0].feed_forward.w2, ParallelLinear)
    assert {key: tensor.data_ptr() for key, tensor in model.state_dict().items()} == {
        key: tensor.data_ptr() for key, tensor in weights.items()
    }


@pytest.mark.slow
def test_compiled_bfloat16_step_rounds_like_the_eager_path(process_group, tmp_path):
    """In bfloat16 fused kernels round differently, so compare step by step on the same tokens: the same argmax,
    and logits apart by bfloat16 rounding only (its step is 1/128 of a value)."""
    model = load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=14), torch.bfloat16)
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(6))
    expected = model(tokens, 0)[:, 5:-1]
    step = compiled_decode_step(model)
    got = static_steps(step, model, tokens, prompt_len=6)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.slow
def test_a_one_token_prompt_goes_to_the_compiled_step_first(tiny_checkpoint, tokenizer_path, process_group):
    """With one prompt token the very first step is a one-token step, run by the compiled step before any `forward`:
    the model is ready for it (KV caches and RoPE table) as soon as it is built."""
    from llama import Llama

    generator = Llama.build(
        str(tiny_checkpoint), tokenizer_path, max_seq_len=16, max_batch_size=1, device="cpu", compile=True
    )
    compiled, _ = generator.generate([[128000]], 6, temperature=0)
    generator.decoder.decode_step = None  # back to the eager path
    eager, _ = generator.generate([[128000]], 6, temperature=0)
    assert compiled == eager and len(compiled[0]) == 6


@pytest.mark.slow
def test_compiled_int8_step_of_one_sequence_on_the_cpu_multiplies_weights_frozen_into_it(process_group, tmp_path):
    """On the CPU an int8 model's step of one sequence compiles to one graph with its weights frozen into it
    (inductor's C++ GEMM template multiplies its own packed copy of each int8 weight); a batch's step is compiled
    on the weights as they are. In float32 both give the eager step's logits up to the order of the sums; a weight
    edited in place afterwards changes the batch's logits but not the one sequence's (docs/speed.md)."""
    from llama.runtime import quantize_model

    model = quantize_model(load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=17), torch.float32), "int8")
    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(9))
    expected = static_steps(model.decode_step, model, tokens, prompt_len=6)
    counters.clear()
    step = compiled_decode_step(model)
    one_row, batch = (static_steps(step, model, rows, prompt_len=6) for rows in (tokens[:1], tokens))
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]  # one per batch size
    assert expected.abs().max() > 1
    assert (one_row - expected[:1]).abs().max() < ATOL and (batch - expected).abs().max() < ATOL
    with torch.no_grad():
        model.output.weight.neg_()
    edited = static_steps(model.decode_step, model, tokens, prompt_len=6)
    assert (edited - expected).abs().max() > 1
    assert (static_steps(step, model, tokens, prompt_len=6) - edited).abs().max() < ATOL
    frozen = static_steps(step, model, tokens[:1], prompt_len=6)
    assert (frozen[:, 1:] - one_row[:, 1:]).abs().max() < ATOL  # [:, 0] comes from forward, on the edited weight


@pytest.mark.slow
def test_two_int8_models_of_one_shape_compiled_one_after_the_other_each_decode_on_their_own_weights(
    process_group, tmp_path
):
    """Two int8 models of the same shape with different weights (a base model and its fine-tune), each compiled with
    its weights frozen into its step: the second must decode on its own weights, not on the first one's packed copy,
    which inductor's graph cache would hand it for a graph of the same shapes (docs/speed.md)."""
    from llama.runtime import quantize_model

    tokens = torch.randint(0, GQA_PARAMS["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(3))
    for seed in (21, 22):
        model = quantize_model(
            load_tiny(tmp_path / str(seed), random_weights(GQA_PARAMS, seed=seed), torch.float32), "int8"
        )
        expected = static_steps(model.decode_step, model, tokens, prompt_len=4)
        compiled = static_steps(compiled_decode_step(model), model, tokens, prompt_len=4)
        assert (compiled - expected).abs().max() < ATOL, f"the model of seed {seed}"


@pytest.mark.slow
def test_the_frozen_int8_step_compiles_once_whatever_mode_its_caller_made_the_position_in(process_group, tmp_path):
    """A position made in inference mode (as `generate` makes it) and one made outside it (a caller of its own) run
    the same graph: a second would hold a second copy of the weights."""
    from llama.runtime import quantize_model

    model = quantize_model(load_tiny(tmp_path, random_weights(GQA_PARAMS, seed=23), torch.float32), "int8")
    step = compiled_decode_step(model)
    model(torch.tensor([[1, 2, 3]]), 0)
    counters.clear()
    with torch.inference_mode():
        first = step(torch.tensor([[4]]), torch.tensor([3]))
    second = step(torch.tensor([[4]]), torch.tensor([3]))
    assert counters["stats"]["unique_graphs"] == 1 and torch.equal(first, second)


@pytest.mark.slow
def test_a_process_that_compiles_many_steps_runs_every_one_compiled(process_group, tmp_path):
    """Past its recompile limit for a code object, torch.compile runs it eagerly, without an error. Each compiled
    step has code of its own, so a process that builds model after model (an evaluation over checkpoints, a test
    suite) decodes every one through a compiled graph of its own (the limit lowered here from 8 to 2 to show it)."""
    from llama.runtime import quantize_model

    counters.clear()
    with torch._dynamo.config.patch(recompile_limit=2):
        for seed in range(40, 44):
            weights = random_weights(GQA_PARAMS, seed=seed)
            model = quantize_model(load_tiny(tmp_path / str(seed), weights, torch.float32), "int8")
            model(torch.tensor([[1, 2, 3]]), 0)
            expected = model.decode_step(torch.tensor([[4]]), torch.tensor([3]))
            model(torch.tensor([[1, 2, 3]]), 0)
            got = compiled_decode_step(model)(torch.tensor([[4]]), torch.tensor([3]))
            assert (got - expected).abs().max() < ATOL, f"the model of seed {seed}"
    assert counters["stats"]["unique_graphs"] == 4


def test_a_frozen_int8_product_compiled_again_for_another_weight_of_its_shape_multiplies_by_that_weight(process_group):
    """inductor's graph cache keys a graph with frozen weights on their shapes, and keeps the copies it packed from
    them: a second weight of the same shape, compiled in this process or a later one, must not be served the first
    one's (a real model's step would reach that cache; the tiny test models' steps hold oneDNN tensors it skips)."""
    x = torch.randn(1, 512, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    for seed in (31, 32):
        layer = ColumnParallelLinear(512, 256, bias=False, gather_output=False, init_method=lambda w: w)
        layer.weight.data.copy_(torch.randn(256, 512, generator=torch.Generator().manual_seed(seed)))
        layer = quantize_layer(layer.to(torch.bfloat16), "int8")
        frozen = with_code_of_its_own(type(layer).forward, f"product_{seed}")
        with torch.inference_mode(), torch._dynamo.config.patch(prepare_freezing=True):
            expected = layer(x).float()
            got = torch.compile(frozen, dynamic=False, options=FROZEN_INT8_OPTIONS)(layer, x).float()
        assert (got - expected).abs().max() < 0.01 * expected.abs().max(), f"the weight of seed {seed}"


@pytest.mark.slow
def test_compiled_int8_step_keeps_a_trained_models_logits_to_bfloat16_rounding(process_group):
    """SmolLM2-135M-Instruct (a trained Llama) in bfloat16 and int8 on the CPU: along the eager step's greedy answers,
    the step of one sequence with its weights frozen in gives the eager logits up to bfloat16 rounding (a few steps of
    0.125 at logits near 20), and so the same greedy token wherever the eager step's top two are further apart. (At a
    near tie it may choose the other: the poem's answer differs at its 27th token, where the eager logits of the top
    two are one rounding step apart.)"""
    from llama.runtime import for_runtime, quantize_model

    reader = open_checkpoint(smollm2_gguf())
    args, _ = model_args_from(reader.params, max_seq_len=128, max_batch_size=1)
    model = for_runtime(load_model(reader, args, 0, 1, torch.device("cpu"), torch.bfloat16))[0]
    model = quantize_model(model, "int8")
    step = compiled_decode_step(model)
    # Two ChatML prompts in SmolLM2's vocabulary: "What is the capital of France?", "Write a short poem about the sea."
    questions = [[1780, 314, 260, 3575, 282, 4649, 47], [19161, 253, 1890, 8216, 563, 260, 3426, 30]]
    for question in questions:
        prompt = [1, 4093, 198, *question, 2, 198, 1, 520, 9531, 198]
        tokens = list(prompt)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt]), 0)[:, -1]
            for position in range(len(prompt), len(prompt) + 32):  # the eager step's greedy answer
                tokens.append(int(logits.argmax(-1)))
                logits = model.decode_step(torch.tensor([tokens[-1:]]), torch.tensor([position]))[:, -1]
        tokens = torch.tensor([tokens])
        expected, got = (static_steps(s, model, tokens, len(prompt))[0].float() for s in (model.decode_step, step))
        assert (got - expected).abs().max() < 0.75  # 0.125 and 0.5 measured
        top2 = expected.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 1.5  # no two shifts within the bound above can swap these two
        assert clear.sum() >= 4 and torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])
