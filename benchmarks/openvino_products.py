"""Would OpenVINO's CPU kernels multiply int4 weights faster than ours, for a decode step's row and for prompts, and
at what cost in memory? The products of one weight of Llama 3.2 1B's shapes, timed in one process.

    pip install openvino==2026.4.1
    python benchmarks/openvino_products.py [--rounds 5] [--copies 8]

Each weight (random, quantized by `llama.quantize.quantize_int4`, groups of 32) runs on:
- "tinygemm", PyTorch's int4 kernel, and "widened", the weight dequantized a block at a time for oneDNN's bfloat16
  product (`Int4Linear`'s CPU products);
- "openvino" and "openvino_w": an OpenVINO model of the same weight, made from the layer's values (the codes with
  the zero point 8 and the scales in OpenVINO's weight-decompression pattern, which its CPU plugin runs as one
  product; int4's float zeros as a second product of each group's sum of the inputs, so the weight stays int4's),
  with the activations rounded to 8 bits per block of 32 (`DYNAMIC_QUANTIZATION_GROUP_SIZE` 32, as llama.cpp's Q4_0
  products round them) and without (0);
- "bf16", oneDNN's bfloat16 product on its packed copy of the bfloat16 weight, what a bfloat16 model runs prompts on.
For one row, each product cycles through --copies weights of its own (read from memory, as in a decode step); for
64 and 512 rows, one weight. Each round times every product once, interleaved; printed: the median ms over the rounds
and the range, the memory each OpenVINO model took (resident set growth over its making and first calls, per
weight), and the products' error against the float32 product of the dequantized weight and unrounded inputs.
"""

import argparse
import itertools
import statistics
import time

import numpy as np
import torch

from llama.quantize import dequantize, pack_nibbles, quantize_int4
from llama.runtime.cpu.widened import cpu_int4_block_rows, unpack_cpu_int4
from llama.runtime.quantized import Int4Linear

SHAPES = ((8192, 2048), (2048, 8192))  # w1 and w3's, w2's (outputs x inputs)
ROWS = (1, 64, 512)
GROUP = 32


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def owned_copy(array: np.ndarray, shape, element_type):
    """A constant's values in memory OpenVINO owns: a constant made on a numpy array's memory read garbage once the
    array was freed."""
    import openvino as ov

    tensor = ov.Tensor(element_type, ov.Shape(shape))
    tensor.data[:] = array.reshape(tensor.data.shape)
    return tensor


class OpenVinoInt4:
    """An `Int4Linear`'s CPU weight compiled into an OpenVINO model taking and giving bfloat16 rows."""

    def __init__(self, layer: Int4Linear, activation_block: int):
        import openvino as ov
        import openvino.opset13 as ops

        out_features, in_features, groups = layer.out_features, layer.in_features, layer.in_features // GROUP
        nibbles, scales, zeros = layer_values(layer)
        codes, scales, zeros = nibbles.numpy(), scales.float().contiguous(), zeros.float().contiguous()
        x = ops.parameter([-1, in_features], ov.Type.bf16, name="x")
        rows = ops.convert(x, ov.Type.f32)
        code = ops.constant(owned_copy(codes, [out_features, groups, GROUP], ov.Type.u4))
        zero_code = ops.constant(np.full((out_features, groups, 1), 8, np.uint8), ov.Type.u4)
        scale = ops.constant(scales.half().numpy()[..., None])  # float16 holds these bfloat16 scales exactly
        steps = ops.multiply(ops.subtract(ops.convert(code, ov.Type.f16), ops.convert(zero_code, ov.Type.f16)), scale)
        weight = ops.convert(ops.reshape(steps, ops.constant(np.array([out_features, in_features])), False), "f32")
        by_group = ops.reshape(rows, ops.constant(np.array([0, groups, GROUP])), True)
        sums = ops.reduce_sum(by_group, ops.constant(np.array([2])), False)
        y = ops.add(ops.matmul(rows, weight, False, True), ops.matmul(sums, ops.constant(zeros.numpy()), False, True))
        config = {
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "bf16",
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": activation_block,
        }
        model = ov.Model([ops.convert(y, ov.Type.bf16)], [x])
        self.request = ov.Core().compile_model(model, "CPU", config).create_infer_request()
        self.out_features = out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import openvino as ov

        y = torch.empty(len(x), self.out_features, dtype=torch.bfloat16)
        self.request.set_input_tensor(ov.Tensor(x.view(torch.int16).numpy(), list(x.shape), ov.Type.bf16))
        self.request.set_output_tensor(ov.Tensor(y.view(torch.int16).numpy(), list(y.shape), ov.Type.bf16))
        self.request.infer()
        return y


def int4_layer(out_features: int, in_features: int, seed: int) -> Int4Linear:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.02
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    return Int4Linear(layer, *quantize_int4(weight, GROUP, torch.bfloat16))


def openvino_models(layers, activation_block: int):
    """An OpenVINO model of each layer's weight, each run once on every row count (OpenVINO repacks a weight at its
    first call), and the MB of resident memory they took, per weight."""
    before = resident_mb()
    models = [OpenVinoInt4(layer, activation_block) for layer in layers]
    for model, rows in itertools.product(models, ROWS):
        model(torch.zeros(rows, layers[0].in_features, dtype=torch.bfloat16))
    return models, (resident_mb() - before) / len(layers)


def bf16_product(layer: Int4Linear):
    """oneDNN's bfloat16 product on its packed copy of `layer`'s weight, dequantized."""
    packed = torch.ops.mkldnn._reorder_linear_weight(dequantize(*layer_values(layer)).to(torch.bfloat16))
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def layer_values(layer: Int4Linear):
    """(nibbles, scales, zeros) of `layer`'s weight, as `quantize_int4` gave them."""
    nibbles = pack_nibbles(unpack_cpu_int4(layer.weight, cpu_int4_block_rows()))
    return nibbles, layer.scales_and_zeros[..., 0].t(), layer.scales_and_zeros[..., 1].t()


def median_range(runs) -> str:
    return f"{statistics.median(runs):.2f} ({min(runs):.2f}-{max(runs):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--copies", type=int, default=8, help="weights each product cycles through for one row")
    opts = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms a product, median of {opts.rounds} rounds")
    for out_features, in_features in SHAPES:
        layers = [int4_layer(out_features, in_features, seed) for seed in range(opts.copies)]
        calls, held = {}, {}
        for name, block in (("openvino", 32), ("openvino_w", 0)):
            calls[name], held[name] = openvino_models(layers, block)
        calls["tinygemm"] = [layer.tinygemm_product for layer in layers]
        calls["widened"] = [layer.widened_product for layer in layers]
        calls["bf16"] = [bf16_product(layer) for layer in layers]
        x = {rows: torch.randn(rows, in_features, dtype=torch.bfloat16) for rows in ROWS}
        times = {(name, rows): [] for name in calls for rows in ROWS}
        for round in range(opts.rounds + 1):  # round 0 warms every product up
            for (name, rows), runs in times.items():
                cycle = calls[name] if rows == 1 else calls[name][:1]
                start = time.perf_counter()
                for call in cycle:
                    call(x[rows])
                if round:
                    runs.append((time.perf_counter() - start) / len(cycle) * 1e3)
        exact = x[64].float() @ dequantize(*layer_values(layers[0])).t()
        int4_mb = out_features * in_features * (0.5 + 4 / GROUP) / 1e6
        print(f"\n{out_features}x{in_features} (int4 with its scales and zeros: {int4_mb:.1f} MB)")
        for name, made in calls.items():
            cells = "; ".join(f"{rows} rows {median_range(times[(name, rows)])}" for rows in ROWS)
            error = (made[0](x[64]).float() - exact).norm() / exact.norm()
            memory = f"; {held[name]:.1f} MB a weight" if name in held else ""
            print(f"  {name:10s} {cells}; error {error:.1e}{memory}")


if __name__ == "__main__":
    main()
