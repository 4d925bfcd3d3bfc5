"""Why int8 and int4 prompts are slower than bfloat16 ones on the CPU: one prompt product of each way, at Llama 3.2
1B's weight shapes, for prompts of 64 and 512 tokens.

    python benchmarks/quant_prompt_products.py
    python benchmarks/quant_prompt_products.py --repeats 15

Per weight (out_features x in_features) and row count, the median milliseconds of:
- bfloat16 `F.linear` on the plain weight, and on oneDNN's prepacked copy (`torch.ops.mkldnn._linear_pointwise`,
  what `llama.runtime.cpu` makes for a bfloat16 model where it measures faster);
- int8 as `llama.quantize` runs prompts today: the weight widened a block of rows at a time into one reused buffer,
  each block's product x W^T (`widened_in_blocks`) or W x^T ("left", as `widened_left` runs it), and PyTorch's
  weight-only int8 kernel (`aten._weight_int8pack_mm`);
- widening alone: every int8 value to bfloat16, a block at a time (the least any widening product pays);
- integers: the activations quantized to int8 per row, then `torch._int_mm` (int8 x int8 -> int32), the way
  llama.cpp's Q8_0 multiplies. It changes the numbers (8-bit activations), so it is a lead, not a kernel here;
- int4 (groups of 32) as `llama.quantize` runs prompts: PyTorch's int4 kernel (`_weight_int4pack_mm_for_cpu`), and
  the weight dequantized a block at a time for the CPU's matrix kernels (`widened_int4_in_blocks`), each block's
  product x W^T or W x^T ("left").
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from llama.quantize import chunk_rows, quantize_int4, quantize_int8, unpack_nibbles
from llama.runtime.cpu.widened import widened_in_blocks, widened_int4_in_blocks
from llama.runtime.quantized import int4_cpu_product, int8_kernel_product

SHAPES = {"w1 or w3": (8192, 2048), "w2": (2048, 8192), "wq+wk+wv": (3072, 2048)}
ROWS = (64, 512)


def median_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def integer_product(x: torch.Tensor, q_t: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (rows, in) quantized to int8 per row, times the int8 weight (given transposed, in x out), rescaled."""
    row_scales = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 127
    xq = (x.float() / row_scales).round().to(torch.int8)
    return (torch._int_mm(xq, q_t).float() * row_scales * scales.float()).to(x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    opts = parser.parse_args()
    from llama.runtime.cpu import cpu_name

    print(f"CPU: {cpu_name()}; {torch.get_num_threads()} threads; median ms of {opts.repeats} runs")
    columns = ["bf16 plain", "bf16 prepacked", "int8 widened", "int8 left", "int8 kernel", "widening alone"]
    columns += ["int8 x int8", "int4 kernel", "int4 widened", "int4 left"]
    print(f"{'weight':>10} {'rows':>5} " + " ".join(f"{c:>15}" for c in columns))
    generator = torch.Generator().manual_seed(0)
    for name, (out_features, in_features) in SHAPES.items():
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).bfloat16()
        q, scales = quantize_int8(weight, torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        q_t = q.t()  # a view: _int_mm reads the (out, in) weight as (in, out)
        buffer = torch.empty(chunk_rows(in_features), in_features, dtype=torch.bfloat16)
        nibbles, group_scales, group_zeros = quantize_int4(weight, 32, torch.bfloat16)
        int4_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).to(torch.int32), 2)
        scales_and_zeros = torch.stack([group_scales.t(), group_zeros.t()], dim=-1).contiguous()
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=generator).bfloat16()
            products = [
                lambda: F.linear(x, weight),
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                lambda: widened_in_blocks(x, q, scales),
                lambda: widened_in_blocks(x, q, scales, left=True),
                lambda: int8_kernel_product(x, q, scales),
                lambda: [buffer[: len(block)].copy_(block) for block in q.split(chunk_rows(in_features))],
                lambda: integer_product(x, q_t, scales),
                lambda: int4_cpu_product(x, int4_packed, scales_and_zeros, 32),
                lambda: widened_int4_in_blocks(x, int4_packed, scales_and_zeros, 32),
                lambda: widened_int4_in_blocks(x, int4_packed, scales_and_zeros, 32, left=True),
            ]
            figures = [median_ms(product, opts.repeats) for product in products]
            print(f"{name:>10} {rows:>5} " + " ".join(f"{f:>15.2f}" for f in figures))


if __name__ == "__main__":
    main()
