"""Same seed, same tokens: with the defaults, a call gives the same answers every time it is made with the same seed
(as Meta's code does, running every prompt from position 0), its stream joins to the same text, and two loads of
a checkpoint give identical logits, in float32, bfloat16 and quantized.

Each test forces the condition that breaks this on some CPUs rather than waiting for a CPU that shows it: kernels
that round differently at different row counts, a KV cache filled by another batch, a cache of another size, a busy
machine.
"""

import subprocess
import sys

import pytest
import torch

from llama import Llama
from llama.runtime.cpu.layers import CPULinear
from llama.runtime.quantized import Int4Linear, Int8Linear

PROMPTS = ["The best way to", "日本の首都は", "Once upon a time, in a land"]
DIALOGS = [
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Où est la gare ?"}],
    [{"role": "user", "content": "Write a haiku about llamas 🦙"}],
]
MAX_GEN = 16


def rounding_by_row_count(generator: Llama) -> None:
    """Run one row on other kernels than many rows: oneDNN's against `F.linear` for the float layers, PyTorch's int8
    kernel against the widened weight for int8 ones, its int4 kernel against the weight widened to float32 for int4
    ones (where the layer has that kernel). They sum in other orders, so that a position computed alone rounds
    otherwise than inside a prompt; and every count of several rows runs one kernel: a call with logprobs (every
    position through the last layer) and one without (the last position of each row) then round their last
    positions alike."""
    for layer in generator.model.modules():
        if isinstance(layer, CPULinear):
            layer.kernels = ("onednn", "linear", "linear", "linear")
        elif isinstance(layer, Int8Linear):
            layer.kernels = ("int8", "widened", "widened", "widened")
        elif isinstance(layer, Int4Linear):
            many = "widened32" if layer.runs("widened32") else "int4pack"
            layer.kernels = ("int4pack", many, many, many)
        else:
            continue
        layer.make_copies()


def tiny_generator(checkpoint, tokenizer_path, dtype, quantize) -> Llama:
    """The tiny model built with the defaults but `dtype` and `quantize`, its kernels rounding by row count."""
    generator = Llama.build(
        str(checkpoint), tokenizer_path, max_seq_len=64, max_batch_size=4, device="cpu", dtype=dtype, quantize=quantize
    )
    rounding_by_row_count(generator)
    return generator


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int8", "int4"])
def generator(request, tiny_checkpoint, tokenizer_path, process_group) -> Llama:
    quantize = request.param if request.param.startswith("int") else None
    return tiny_generator(tiny_checkpoint, tokenizer_path, None if quantize else request.param, quantize)


def seeded(call, seed: int = 7):
    torch.manual_seed(seed)
    return call()


@pytest.mark.slow
def test_the_same_seed_gives_the_same_text_every_call_and_in_the_stream(generator):
    """The second call's prompts are what the first left in the KV cache: each still runs from position 0."""
    first = seeded(lambda: generator.text_completion(PROMPTS, max_gen_len=MAX_GEN, logprobs=True))
    again = seeded(lambda: generator.text_completion(PROMPTS, max_gen_len=MAX_GEN, logprobs=True))
    assert again == first
    chunks = seeded(lambda: list(generator.text_completion_stream(PROMPTS, max_gen_len=MAX_GEN)))
    assert ["".join(c.text for c in chunks if c.index == i) for i in range(len(PROMPTS))] == [
        r["generation"] for r in first
    ]


@pytest.mark.slow
def test_the_same_seed_gives_the_same_chat_answers_every_call_and_in_the_stream(generator):
    first = seeded(lambda: generator.chat_completion(DIALOGS, max_gen_len=MAX_GEN, logprobs=True), seed=3)
    # The next turn of the first dialog fills its cache row with the dialog and an answer, in a batch of one.
    follow_up = DIALOGS[0] + [first[0]["generation"], {"role": "user", "content": "Et la poste ?"}]
    seeded(lambda: generator.chat_completion([follow_up], max_gen_len=MAX_GEN))
    again = seeded(lambda: generator.chat_completion(DIALOGS, max_gen_len=MAX_GEN, logprobs=True), seed=3)
    assert again == first
    chunks = seeded(lambda: list(generator.chat_completion_stream(DIALOGS, max_gen_len=MAX_GEN)), seed=3)
    for i, result in enumerate(first):
        assert "".join(c.text for c in chunks if c.index == i) == result["generation"]["content"]


@pytest.mark.slow
def test_a_prompt_gives_what_a_fresh_generator_gives_whatever_ran_before(generator, tiny_checkpoint, tokenizer_path):
    """A cache filled by a different batch (the prompt's start and more, three rows at once) changes nothing: the
    answers equal those of a generator that has run nothing, the same checkpoint loaded again."""
    seeded(lambda: generator.text_completion([PROMPTS[2] + " far away", PROMPTS[0], PROMPTS[1]], max_gen_len=4))
    after_others = seeded(lambda: generator.text_completion(PROMPTS[2:], max_gen_len=MAX_GEN, logprobs=True))
    report = generator.load_report
    fresh = tiny_generator(tiny_checkpoint, tokenizer_path, report.dtype, report.quantization)
    assert seeded(lambda: fresh.text_completion(PROMPTS[2:], max_gen_len=MAX_GEN, logprobs=True)) == after_others


def prompt_and_steps(generator: Llama, prompt: torch.Tensor, steps: int, decode_step: bool) -> torch.Tensor:
    """The logits of `prompt`, then of `steps` greedy decode steps after it, each one token (through the model's
    `forward`, as `generate` runs them, or its `decode_step`, as the server's engine does)."""
    model = generator.model
    logits = [model.forward(prompt, 0)]
    position = prompt.shape[1]
    for _ in range(steps):
        token = logits[-1][:, -1:].argmax(-1)
        if decode_step:
            logits.append(model.decode_step(token, torch.tensor([position])))
        else:
            logits.append(model.forward(token, position))
        position += 1
    return torch.cat(logits, dim=1)


BUSY = "while True: pass"  # a process that keeps a core busy


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_loads_give_identical_logits_whatever_the_cache_s_size_and_the_machine_s_load(
    tiny_checkpoint, tokenizer_path, process_group, dtype, quantize
):
    """Loads of one checkpoint with caches of 256 and 4096 positions, for 1 and 4 sequences, and one of them beside
    two busy processes, give the same logits bit for bit on a 64-token prompt and 16 decode steps, through `forward`
    and through `decode_step`: the kernels depend on the CPU, the weights and each call's rows only, never on a
    timing or on the cache's size."""
    prompt = torch.randint(0, 128256, (1, 64), generator=torch.Generator().manual_seed(4))
    found = []
    for max_seq_len, max_batch_size, busy in ((256, 1, False), (4096, 4, True)):
        others = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2 * busy)]
        try:
            generator = Llama.build(
                str(tiny_checkpoint),
                tokenizer_path,
                max_seq_len=max_seq_len,
                max_batch_size=max_batch_size,
                device="cpu",
                dtype=dtype,
                quantize=quantize,
            )
            with torch.inference_mode():
                found.append([prompt_and_steps(generator, prompt, 16, step) for step in (False, True)])
        finally:
            for other in others:
                other.kill()
                other.wait()
    for first, second in zip(*found):
        assert torch.equal(first, second)


@pytest.mark.slow
@pytest.mark.parametrize("generator", ["float32"], indirect=True)
def test_in_float32_a_prompt_s_greedy_tokens_are_the_same_alone_and_in_any_batch(generator):
    """What docs/differences.md promises for the batch a prompt shares: a batch runs its steps as products of more
    rows (here on another kernel than one row's) and starts decoding at its shortest prompt, and in float32 each
    prompt's greedy answer is still the one it gets alone."""
    alone = [generator.text_completion([p], temperature=0, max_gen_len=MAX_GEN, logprobs=True)[0] for p in PROMPTS]
    batched = generator.text_completion(PROMPTS, temperature=0, max_gen_len=MAX_GEN, logprobs=True)
    reordered = generator.text_completion(PROMPTS[::-1], temperature=0, max_gen_len=MAX_GEN, logprobs=True)[::-1]
    for answers in (batched, reordered):
        for got, expected in zip(answers, alone):
            assert got["tokens"] == expected["tokens"]
            assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=1e-4)
