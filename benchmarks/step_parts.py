"""Where a batch-1 bfloat16 decode step's time goes on a CPU whose bfloat16 runs on float16 copies (AVX2).

    python benchmarks/step_parts.py                     # d256 and d1024, as bench.py writes them
    python benchmarks/step_parts.py --shapes 1b --steps 8

Four timings of the model's own steps (`Transformer.forward` of one token, from position 16), in one process,
each the median of --repeats passes of --steps steps:
- the whole step;
- every fbgemm product alone: the calls one step makes, replayed back to back on the same inputs;
- everything but the products: the step with each product replaced by its stored result;
- the same, with each product replaced by a plain read of as many bytes as its weight (`Tensor.sum`), which
  streams them through the caches as the product does.
What the whole step takes beyond the products alone and the rest alone is the cost of running the two
interleaved: among other things, the small operations between products run on caches the streamed weights have
just flushed. The last timing shows how much of that cost a plain read of the same bytes causes.
Then the output head's product alone for 1, 2 and 4 rows of input, on all threads and on one, beside a plain
read of its bytes, and `torch.mv` on its weight in bfloat16 and float16 for one row.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import DECODE_PROMPT, default_tokenizer, meta_checkpoint  # noqa: E402

import llama.runtime.cpu  # noqa: E402
from llama import Llama  # noqa: E402


def median_ms(fn, steps: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(steps)
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["d256", "d1024"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llama-bench")
    args = parser.parse_args()
    fp16_linear = llama.runtime.cpu.fp16_linear
    for shape in args.shapes:
        checkpoint = meta_checkpoint(shape, args.workdir, default_tokenizer(), "cpu")
        generator = Llama.build(str(checkpoint), max_seq_len=256, max_batch_size=1, device="cpu", dtype="bfloat16")
        model, token = generator.model, torch.tensor([DECODE_PROMPT[-1:]])
        if not any(isinstance(m, llama.runtime.cpu.CPULinear) and m.kernel_for(1) == "fp16" for m in model.modules()):
            sys.exit("One row runs on float16 copies only where that kernel measured fastest: LLAMA_CPU_KERNEL=fp16")
        model.forward(torch.tensor([DECODE_PROMPT]), 0)

        def decode(steps: int) -> None:
            for i in range(steps):
                model.forward(token, len(DECODE_PROMPT) + i)

        calls, stored = [], {}  # one step's (float32 input, packed weight) pairs; each product's result

        def recording(x, packed):
            calls.append((x.reshape(-1, x.shape[-1]).float(), packed))
            return stored.setdefault(id(packed), fp16_linear(x, packed))

        def replaying(x, packed):
            return stored[id(packed)]

        weight_bytes = {}  # each product's weight bytes, and a buffer to read that many from

        def read_as_many_bytes(packed) -> None:
            buffer[: weight_bytes[id(packed)] // 4].sum()

        def streaming(x, packed):
            read_as_many_bytes(packed)
            return stored[id(packed)]

        def products_alone(steps: int) -> None:
            for _ in range(steps):
                for rows, packed in calls:
                    llama.runtime.cpu.fp16_products(rows, packed)

        llama.runtime.cpu.layers.fp16_linear = llama.runtime.cpu.kernels.fp16_linear = recording
        decode(1)
        for _, packed in calls:
            unpacked = (torch.ops.quantized.linear_unpack_fp16(block)[0] for block in packed)
            weight_bytes[id(packed)] = 2 * sum(weight.numel() for weight in unpacked)
        buffer = torch.ones(max(weight_bytes.values()) // 4)
        timings = {}
        for name, product in (("whole step", fp16_linear), ("all but the products", replaying),
                              ("all but the products, with reads", streaming)):  # fmt: skip
            llama.runtime.cpu.layers.fp16_linear = llama.runtime.cpu.kernels.fp16_linear = product
            decode(2)
            timings[name] = median_ms(decode, args.steps, args.repeats)
        llama.runtime.cpu.layers.fp16_linear = llama.runtime.cpu.kernels.fp16_linear = fp16_linear
        timings["products alone"] = median_ms(products_alone, args.steps, args.repeats)
        reads = median_ms(
            lambda steps: [read_as_many_bytes(packed) for _ in range(steps) for _, packed in calls],
            args.steps,
            args.repeats,
        )
        whole, alone, rest = timings["whole step"], timings["products alone"], timings["all but the products"]
        print(f"{shape} bfloat16, {len(calls)} product calls a step, ms per step (median of {args.repeats}):")
        print(f"  whole step {whole:.2f}; products alone {alone:.2f}; all but the products {rest:.2f}; "
              f"interleaving costs {whole - alone - rest:.2f}")  # fmt: skip
        with_reads = timings["all but the products, with reads"]
        print(f"  with plain reads for products: {with_reads:.2f}, reads alone {reads:.2f}; "
              f"interleaving costs {with_reads - reads - rest:.2f}")  # fmt: skip
        # The largest product (the output head's) for 1, 2 and 4 rows of input: where more rows take about as long
        # as one, one row's product is bound by the kernel's own work, not by reading the weight.
        head_row, head = max(calls, key=lambda call: weight_bytes[id(call[1])])
        threads = torch.get_num_threads()
        for n_threads in (threads, 1):
            torch.set_num_threads(n_threads)
            times = [
                median_ms(
                    lambda steps: [llama.runtime.cpu.fp16_products(rows, head) for _ in range(steps)], 8, args.repeats
                )
                for rows in (head_row.expand(n, -1).contiguous() for n in (1, 2, 4))
            ]
            read = median_ms(lambda steps: [read_as_many_bytes(head) for _ in range(steps)], 8, args.repeats)
            print(f"  the head's product on {n_threads} thread(s), ms for 1, 2, 4 rows: "
                  f"{', '.join(f'{t:.2f}' for t in times)}; a read of its bytes {read:.2f}")  # fmt: skip
        torch.set_num_threads(threads)
        # PyTorch's own matrix-vector product on the head's 2-byte weight, as loaded and as float16.
        for weight in (model.output.weight, model.output.weight.half()):
            row = head_row[0].to(weight.dtype)
            mv_ms = median_ms(lambda steps: [torch.mv(weight, row) for _ in range(steps)], 8, args.repeats)
            print(f"  torch.mv on the head's {weight.dtype} weight, one row: {mv_ms:.2f} ms")


if __name__ == "__main__":
    main()
