"""Same seed, same tokens: with the defaults, a call gives the same answers every time it is made with the same seed
(as Meta's code does, running every prompt from position 0), its stream joins to the same text, and two loads of
a checkpoint give identical logits, in float32, bfloat16 and quantized.

Each test forces the condition that breaks this on some CPUs rather than waiting for a CPU that shows it: kernels
that round differently at different row counts, a KV cache filled by another batch, timings that change between
loads.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import with_repo

import llama.runtime.cpu.choice
from llama import Llama
from llama.runtime import quantized_kernels
from llama.runtime.cpu import CPULinear
from llama.runtime.quantized import Int4Linear, Int8Linear

PROMPTS = ["The best way to", "日本の首都は", "Once upon a time, in a land"]
DIALOGS = [
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Où est la gare ?"}],
    [{"role": "user", "content": "Write a haiku about llamas 🦙"}],
]
MAX_GEN = 16


def rounding_by_row_count(generator: Llama) -> None:
    """Run one row on other kernels than many rows: `torch.mv` against `F.linear` for the float layers, PyTorch's int8
    kernel against the widened weight for int8 ones, its int4 kernel against the weight widened to float32 for int4
    ones (where the layer has that product). They sum in other orders, as kernels chosen per row count by timing do,
    so that a position computed alone rounds otherwise than inside a prompt; and every count of several rows runs
    one kernel, as timings on a busy machine would not: a call with logprobs (every position through the last layer)
    and one without (the last position of each row) then round their last positions alike."""
    for layer in generator.model.modules():
        if isinstance(layer, CPULinear):
            layer.kernels = {1: "mv", 256: "linear"}
        elif isinstance(layer, Int8Linear):
            layer.kernels = {1: "int8", 256: "widened"}
        elif isinstance(layer, Int4Linear):
            layer.kernels = {1: "tinygemm", 256: "widened32" if "widened32" in layer.products(256) else "tinygemm"}


def tiny_generator(checkpoint, tokenizer_path, dtype, quantize) -> Llama:
    """The tiny model built with the defaults but `dtype` and `quantize`, its kernels rounding by row count."""
    generator = Llama.build(
        str(checkpoint), tokenizer_path, max_seq_len=64, max_batch_size=4, device="cpu", dtype=dtype, quantize=quantize
    )
    rounding_by_row_count(generator)
    return generator


@pytest.fixture(scope="module", params=["float32", "bfloat16", "int8", "int4", "int8-dyn", "int4-dyn"])
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


def fake_timings(seconds: dict):
    """A `time_kernels` that finds `seconds[kernel]` (a list of rounds, or one figure for every round) for each
    kernel of every product."""

    def rounds_of(kernel, rounds):
        found = seconds[kernel]
        return list(found) if isinstance(found, list) else [found] * rounds

    return lambda runs, _, rounds=5: [{k: rounds_of(k, rounds) for k in calls} for calls in runs]


def int8_timings_where(faster: str) -> dict:
    """Stand-ins for the CPU int8 products, timed only: `faster` takes no time, the other 2 ms."""

    def slow(x, q, scales):
        time.sleep(0.002)
        return x

    return {name: (lambda x, q, scales: x) if name == faster else slow for name in ("int8", "widened", "widened32")}


def step_logits(generator: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of a prompt, then of one position at a time, as decoding runs them."""
    model = generator.model
    pieces = [model.forward(tokens[:, :6], 0)]
    pieces += [model.forward(tokens[:, pos : pos + 1], pos) for pos in range(6, tokens.shape[1])]
    return torch.cat(pieces, dim=1)


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_two_loads_give_identical_logits_though_the_timings_change_between_them(
    tiny_checkpoint, tokenizer_path, process_group, tmp_path, monkeypatch, quantize
):
    """The first load measures on a busy machine (one kernel slowed in most rounds: rounds that disagree), the second
    on a quiet one whose timings would choose other kernels and products: the second runs the first's choices, and
    gives its logits bit for bit."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    busy = {"onednn": [1e-9, 1e-9, 5e-9, 5e-9, 5e-9], "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}
    quiet = {"onednn": 1e-9, "fp16": 3e-9, "mv": 2.5e-9, "linear": 4e-9}
    tokens = torch.randint(0, 128256, (1, 12), generator=torch.Generator().manual_seed(4))
    logits, kernels = [], []
    for timings, faster_int8 in ((busy, "int8"), (quiet, "widened")):
        monkeypatch.setattr(llama.runtime.cpu.choice, "time_kernels", fake_timings(timings))
        monkeypatch.setattr(quantized_kernels, "CPU_INT8_PRODUCTS", int8_timings_where(faster_int8))
        generator = Llama.build(
            str(tiny_checkpoint), tokenizer_path, max_seq_len=64, max_batch_size=4, device="cpu", quantize=quantize
        )
        with torch.inference_mode():
            logits.append(step_logits(generator, tokens))
        layers = [m for m in generator.model.modules() if isinstance(m, (CPULinear, Int8Linear))]
        kernels.append([dict(layer.kernels) for layer in layers])
    assert kernels[1] == kernels[0]
    assert torch.equal(logits[1], logits[0])


# One load in a process of its own, timing its kernels slowly (a second a measurement) and ranking them as it is told:
# the first candidate of each choice fastest, or the last, by 1.1x (a margin within which a later load's re-check
# finds cached figures still hold: `llama.runtime.cpu.choice.FLIPPED`).
RACING_LOAD = """
import json, sys, time
import llama.runtime.cpu.attention, llama.runtime.cpu.choice
from llama import Llama

def time_kernels(runs, flush, rounds):
    time.sleep(1.0)
    fastest = [list(calls)[0 if sys.argv[3] == "first" else -1] for calls in runs]
    return [{k: [1e-3 if k == f else 1.1e-3] * rounds for k in calls} for calls, f in zip(runs, fastest)]

for module in (llama.runtime.cpu.attention, llama.runtime.cpu.choice):
    module.time_kernels = time_kernels
generator = Llama.build(sys.argv[1], sys.argv[2], max_seq_len=64, max_batch_size=4, device="cpu", dtype="bfloat16")
attention = generator.model.layers[0].attention.one_position_attention
print(json.dumps([generator.model.kernels_in_use, attention is not None]))
"""


@pytest.mark.slow
def test_loads_started_together_choose_alike(tiny_checkpoint, tokenizer_path, tmp_path):
    """Two processes load at once on a machine that has measured nothing, and their timings rank the kernels
    oppositely: the one that starts measuring second waits for the first, and runs the kernels the first measured,
    as every later load here will."""
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=with_repo(Path(__file__).resolve().parents[1]))
    loads = [
        subprocess.Popen(
            [sys.executable, "-c", RACING_LOAD, str(tiny_checkpoint), tokenizer_path, rank],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for rank in ("first", "last")
    ]
    outputs = [load.communicate(timeout=120) for load in loads]
    assert [load.returncode for load in loads] == [0, 0], outputs
    choices = [json.loads(stdout) for stdout, _ in outputs]
    assert choices[0] == choices[1]


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
