"""How much faster a batch-1 decode step can get from quantized weights, counting the weight products only.

    python benchmarks/quant_kernels.py                      # the shapes of bench.py's grid
    python benchmarks/quant_kernels.py --shapes d512 --calls 100

For every distinct weight of a shape (q, k, v, o, the three feed-forward weights, the output head) it times one
row of bfloat16 input through our layers' products: the bfloat16 matrix-vector product we run unquantized
(`llama.cpu.CPULinear`), and the int8 and int4 layers `llama.quantize` makes. A decode step runs each weight once
per layer, so their sum is the time a step spends in products; the ratio of the sums is the most quantization can
speed up a step of that shape, however small everything else becomes. Each figure is the median of --calls calls.
"""

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import GRID, SHAPES  # noqa: E402

from llama.cpu import CPULinear  # noqa: E402
from llama.distributed import init_model_parallel  # noqa: E402
from llama.model import ModelArgs  # noqa: E402
from llama.quantize import quantize_layer  # noqa: E402

SCHEMES = ("bfloat16", "int8", "int4")


def step_weights(shape: str) -> dict:
    """(out_features, in_features) of each weight a decode step multiplies by, with how many times it does."""
    params = {k: v for k, v in SHAPES[shape].items() if k != "tied"}
    args = ModelArgs(**params)
    q_out, kv_out = args.n_heads * args.head_dim, args.kv_heads * args.head_dim
    per_layer = [(q_out, args.dim), (kv_out, args.dim), (kv_out, args.dim), (args.dim, q_out)]
    per_layer += [(args.ffn_hidden_dim, args.dim), (args.dim, args.ffn_hidden_dim), (args.ffn_hidden_dim, args.dim)]
    counts = {}
    for weight in per_layer:
        counts[weight] = counts.get(weight, 0) + args.n_layers
    counts[(args.vocab_size, args.dim)] = counts.get((args.vocab_size, args.dim), 0) + 1
    return counts


def layers_for(out_features: int, in_features: int) -> dict:
    """The bfloat16, int8 and int4 layers of one random weight."""
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) * 0.02

    def fairscale_layer():  # a layer gives its weight to the layer made from it, so each scheme gets its own
        layer = ColumnParallelLinear(in_features, out_features, bias=False, gather_output=False, init_method=id)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        return layer

    return {
        "bfloat16": CPULinear(fairscale_layer()),
        "int8": quantize_layer(fairscale_layer(), "int8"),
        "int4": quantize_layer(fairscale_layer(), "int4"),
    }


def median_ms(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=GRID, choices=list(SHAPES))
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))
    print(f"{torch.get_num_threads()} threads; milliseconds, median of {args.calls} calls, one bfloat16 row")
    times = {}  # (out, in) -> {scheme: ms}
    for shape in args.shapes:
        counts = step_weights(shape)
        print(f"\n{shape}: weight (out x in) x times per step | " + " | ".join(SCHEMES))
        for weight, count in counts.items():
            if weight not in times:
                layers = layers_for(*weight)
                x = torch.randn(1, 1, weight[1], dtype=torch.bfloat16)
                times[weight] = {s: median_ms(lambda: layers[s].matmul(x), args.calls) for s in SCHEMES}
                del layers
            row = " | ".join(f"{times[weight][s]:.3f}" for s in SCHEMES)
            print(f"  {weight[0]} x {weight[1]} x {count} | {row}")
        total = {s: sum(times[w][s] * n for w, n in counts.items()) for s in SCHEMES}
        gains = ", ".join(f"{s} {total['bfloat16'] / total[s]:.2f}x" for s in SCHEMES[1:])
        sums = " | ".join(f"{total[s]:.2f}" for s in SCHEMES)
        print(f"  products per step | {sums}   (most a step can gain: {gains})")


if __name__ == "__main__":
    main()
