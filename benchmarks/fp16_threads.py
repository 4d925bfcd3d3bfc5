"""Whether fbgemm's one-row float16 product leaves a core idle, and whether splitting each weight's rows between
threads wins it back (issue 55: on an AVX-512 Zen 4 it read 25.3 GB/s on 1 thread and 25.8 on 2).

    python benchmarks/fp16_threads.py                  # the 1B shape
    python benchmarks/fp16_threads.py --shapes d1024 1b --steps 15

For each shape, every weight a batch-1 decode step multiplies by (wq+wk+wv, wo, w1+w3, w2 as the fused products
run them, then the output head), random, packed as the library packs its float16 copies (`pack_as_fp16`). One row
goes through all of them in a step's order, timed four ways (median of --steps steps, and the range):
- "intra-op": as the library runs them, `fp16_products` on PyTorch's thread count;
- "1 thread": the same on one thread, to see whether the second core does anything;
- "halves, per product": each weight packed as two halves of its rows, one on each of two Python threads, PyTorch
  on one thread each, joined after every product (what a step must do: each product needs the one before);
- "halves, per step": the same halves, each thread running its half of every product, joined once per step (an
  upper bound: a real step cannot run its products ahead of their inputs).
It also checks that the halves give the whole product's bits: each output column is summed the same way.
"""

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import SHAPES  # noqa: E402
from quant_kernels import fused_step_weights  # noqa: E402

from llama.runtime.cpu import fbgemm_fp16_supported  # noqa: E402
from llama.runtime.cpu.kernels import fp16_products, pack_as_fp16  # noqa: E402
from llama.runtime.timing import timed  # noqa: E402


def timings(step, steps: int) -> str:
    """The median and range of `steps` timed calls of `step`, after one untimed call, in ms."""
    step()
    ms = [timed(step) * 1000 for _ in range(steps)]
    return f"{statistics.median(ms):.1f} ms ({min(ms):.1f}-{max(ms):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1b"], choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    if not fbgemm_fp16_supported():
        sys.exit("fbgemm's float16 products need an x86 CPU with AVX2 and F16C")
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(2)
    for shape in args.shapes:
        generator = torch.Generator().manual_seed(0)
        sizes = fused_step_weights(shape)
        whole, halves = [], []
        for size in sizes:
            weight = torch.randn(size, generator=generator).mul_(0.02).bfloat16()
            whole.append(pack_as_fp16(weight))
            halves.append([pack_as_fp16(half) for half in weight.split((size[0] + 1) // 2)])
        rows = {width: torch.randn(1, width, generator=generator) for width in {size[1] for size in sizes}}
        inputs = [rows[size[1]] for size in sizes]
        gigabytes = sum(out * width for out, width in sizes) * 2 / 1e9

        def intra_op():
            for x, packed in zip(inputs, whole):
                fp16_products(x, packed)

        def half_of(part: int, x, each):
            return fp16_products(x, each[part])

        def per_product():
            for x, each in zip(inputs, halves):
                other = pool.submit(half_of, 1, x, each)
                half_of(0, x, each)
                other.result()

        def own_half(part: int):
            for x, each in zip(inputs, halves):
                half_of(part, x, each)

        def per_step():
            other = pool.submit(own_half, 1)
            own_half(0)
            other.result()

        x, each = inputs[-1], halves[-1]
        same = torch.equal(
            torch.cat(fp16_products(x, whole[-1]), -1), torch.cat(half_of(0, x, each) + half_of(1, x, each), -1)
        )
        print(
            f"{shape}: {len(sizes)} products, {gigabytes:.2f} GB of float16 a step; halves give the same bits: {same}"
        )
        for name, step, step_threads in [
            ("intra-op", intra_op, threads),
            ("1 thread", intra_op, 1),
            ("halves, per product", per_product, 1),
            ("halves, per step", per_step, 1),
        ]:
            torch.set_num_threads(step_threads)
            print(f"  {name} ({step_threads} PyTorch threads): {timings(step, args.steps)}", flush=True)
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
