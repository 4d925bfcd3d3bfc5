"""How much faster a batch-1 decode step can get from quantized weights, counting the weight products only.

    python benchmarks/quant_kernels.py                      # the shapes of bench.py's grid
    python benchmarks/quant_kernels.py --shapes d512 --steps 50
    python benchmarks/quant_kernels.py --shapes 1b --per_weight   # each weight shape alone, at 1 and 8 rows

For each shape it makes every weight a decode step multiplies by (q, k, v, o and the three feed-forward weights of
each layer, then the output head), random, in four forms: bfloat16 on PyTorch's matrix-vector product
(`llama.runtime.cpu.CPULinear` on "mv"), bfloat16 on a float16 copy (`CPULinear` on "fp16", which a bfloat16 model runs
where it measures fastest; x86 only), and the int8 and int4 layers
`llama.quantize` makes, int8 both on PyTorch's kernel and on "split" (in integers on fbgemm,
`llama.runtime.cpu.integer`). It then times one bfloat16 row through all of them in a step's order, as a step reads
them (from memory, not from cache), and the head alone. The ratio of the step times is the most a form can speed
up a decode step of that shape over the plain bfloat16 product, however small everything else in the step
becomes. Figures: median of --steps steps. With --per_weight, each distinct weight shape of a step alone instead, at
1 and 8 rows, on enough copies (64 MB) that each call reads its weight from memory; for "int8 split" also fbgemm's
call alone (`integer_sums`), the rest being the split of the activations.
"""

import argparse
import itertools
import sys
from datetime import timedelta
from pathlib import Path

import torch
from fairscale.nn.model_parallel.layers import ColumnParallelLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import GRID, SHAPES  # noqa: E402

from llama.distributed import init_model_parallel  # noqa: E402
from llama.model import ModelArgs  # noqa: E402
from llama.runtime.cpu import CPULinear, fbgemm_fp16_supported  # noqa: E402
from llama.runtime.cpu.integer import integer_sums, split_product_available  # noqa: E402
from llama.runtime.quantized import quantize_layer  # noqa: E402
from llama.runtime.timing import median_seconds  # noqa: E402

FORMS = ("bfloat16", "float16 copy") if fbgemm_fp16_supported() else ("bfloat16",)
FORMS += ("int8", "int8 split", "int4") if split_product_available() else ("int8", "int4")
PRODUCTS = {"int8": "int8", "int8 split": "split", "int4": "tinygemm"}  # each quantized form's one-row product


def step_weights(shape: str) -> list:
    """(out_features, in_features) of each weight a decode step multiplies by, in the order it does."""
    args = ModelArgs(**{k: v for k, v in SHAPES[shape].items() if k != "tied"})
    q_out, kv_out, hidden = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim
    layer = [(q_out, args.dim), (kv_out, args.dim), (kv_out, args.dim), (args.dim, q_out)]
    layer += [(hidden, args.dim), (hidden, args.dim), (args.dim, hidden)]
    return layer * args.n_layers + [(args.vocab_size, args.dim)]


def fused_step_weights(shape: str) -> list:
    """`step_weights` with wq, wk and wv stacked as one product, and w1 and w3 as another, as the library fuses them."""
    weights = step_weights(shape)
    per_layer, head = weights[:7], weights[-1]
    (q, width), (kv, _), _, wo, (hidden, _), _, w2 = per_layer
    layer = [(q + 2 * kv, width), wo, (2 * hidden, width), w2]
    return layer * ((len(weights) - 1) // 7) + [head]


def make_layer(form: str, weight: torch.Tensor):
    out_features, in_features = weight.shape
    layer = ColumnParallelLinear(in_features, out_features, bias=False, gather_output=False, init_method=id)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    if form == "bfloat16":
        return CPULinear(layer, {1: "mv"})
    if form == "float16 copy":
        return CPULinear(layer, {1: "fp16"})  # the copy is made at the first, untimed, call
    quantized = quantize_layer(layer, form.split()[0])
    quantized.kernels = {1: PRODUCTS[form]}
    if form == "int8 split":
        quantized.make_chosen_copies(["split"])
    return quantized


def time_products(form: str, weights: list, steps: int):
    """(ms for one row through every weight in turn, ms for the last weight alone), in `form`'s layers."""
    layers = [make_layer(form, weight) for weight in weights]
    inputs = [torch.randn(1, 1, weight.shape[1], dtype=torch.bfloat16) for weight in weights]
    step = median_ms(lambda: [layer.matmul(x) for layer, x in zip(layers, inputs)], steps)
    return step, median_ms(lambda: layers[-1].matmul(inputs[-1]), steps)


def time_per_weight(shape: str, steps: int) -> None:
    """Each distinct weight shape of `shape`'s step, alone, in every form, at 1 and 8 rows (see the docstring)."""
    print(f"{shape}: out x in, rows | " + " / ".join(FORMS) + (" / fbgemm's call" if "int8 split" in FORMS else ""))
    for out_features, in_features in dict.fromkeys(step_weights(shape)):
        copies = max(2, 2**26 // (out_features * in_features))
        weights = [torch.randn(out_features, in_features).mul_(0.02).bfloat16() for _ in range(copies)]
        layers = {form: [make_layer(form, weight) for weight in weights] for form in FORMS}
        for rows in (1, 8):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            calls = {form: [lambda layer=layer: layer.matmul(x) for layer in forms] for form, forms in layers.items()}
            if "int8 split" in FORMS:
                levels = torch.zeros(2 * rows, in_features)
                calls["fbgemm"] = [
                    lambda layer=layer: [integer_sums(levels, piece) for piece in layer.packed]
                    for layer in layers["int8 split"]
                ]
            for call in [call for kernel_calls in calls.values() for call in kernel_calls]:
                call()  # each copy's first call (a float16 copy is made there), untimed
            times = [median_ms(rotation(kernel_calls), steps) for kernel_calls in calls.values()]
            print(f"  {out_features} x {in_features}, {rows} | " + " / ".join(f"{t:.3f}" for t in times), flush=True)


def rotation(calls: list):
    """A call that runs the next of `calls` each time, so that no call finds its weight in the cache."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=GRID, choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--per_weight", action="store_true", help="each weight shape alone, at 1 and 8 rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))
    if args.per_weight:
        print(f"{torch.get_num_threads()} threads; milliseconds, median of {args.steps} calls")
        for shape in args.shapes:
            time_per_weight(shape, args.steps)
        return
    print(f"{torch.get_num_threads()} threads; milliseconds, median of {args.steps} steps, one bfloat16 row")
    print("shape  | products of a step: " + " / ".join(FORMS) + " | of which the head | most a step can gain")
    for shape in args.shapes:
        generator = torch.Generator().manual_seed(0)
        weights = [torch.randn(size, generator=generator).mul_(0.02).bfloat16() for size in step_weights(shape)]
        step, head = {}, {}
        for form in FORMS:
            step[form], head[form] = time_products(form, weights, args.steps)
        gains = " / ".join(f"{step['bfloat16'] / step[s]:.2f}x" for s in FORMS[1:])
        print(
            f"{shape:<6} | {' / '.join(f'{step[s]:.2f}' for s in FORMS)} | "
            f"{' / '.join(f'{head[s]:.2f}' for s in FORMS)} | {gains}",
            flush=True,
        )


if __name__ == "__main__":
    main()
