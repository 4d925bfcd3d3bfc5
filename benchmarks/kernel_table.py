"""The figures behind the kernel table (`llama/runtime/kernel_table.py`), measured again on the machine at hand: each
kernel of each kind of weights, at a row count of each row class, on the linear layers of Llama 3.2 1B's blocks.

    python benchmarks/kernel_table.py                          # every kind of weights, rows 1 8 64 256, 5 rounds
    python benchmarks/kernel_table.py --weights bfloat16 int8 --rows 1 8 --rounds 7   # also float32-of-bfloat16 ...
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/kernel_table.py   # the kernels an AVX2 CPU runs

One pass runs every linear layer of `--blocks` blocks once (wq, wk, wv, wo, w1, w3, w2, in a block's order), each
layer on weights of its own, as a decode step meets them: for one row and a batch's rows the blocks are many enough
to hold more than the CPU's caches, so each weight comes from memory; a prompt's rows run one block (they are bound by
arithmetic). Each kernel runs on layers of its own (with the copies of the weights it reads, made beforehand), and
the kernels take turns within every round, so that a slow spell of a shared machine falls on all of them. Printed:
for each kind of weights and row count, each kernel's median pass time and range over the rounds, in microseconds per
million weights, the fastest marked, and the table's kernel for that row class. Also the one-position bfloat16
attention of 1B's heads (32 of 64 values, 8 kv heads) on SDPA's kernel and on float32 matmuls, by cache length.
"""

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import machine  # noqa: E402

from llama.distributed import init_model_parallel  # noqa: E402
from llama.runtime.cpu.kernels import one_position_attention  # noqa: E402
from llama.runtime.cpu.layers import CPULinear  # noqa: E402
from llama.runtime.kernel_table import ROW_CLASSES, cpu_offers, row_class, table_kernels  # noqa: E402
from llama.runtime.quantized import quantize_layer  # noqa: E402

# Llama 3.2 1B's linear layers in one block (out, in): wq, wk, wv, wo, w1, w3, w2.
BLOCK = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
# --weights' names for the table's kinds of weights
WEIGHTS = {
    "bfloat16": "bfloat16",
    "float32-of-bfloat16": "float32 holding bfloat16",
    "float32": "float32",
    "int8": "int8 bfloat16",
    "int4": "int4",
}


def random_weight(out_features: int, in_features: int, weights: str, seed: int) -> torch.Tensor:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.02
    if weights == "float32":
        return weight
    return weight.bfloat16() if weights != "float32 holding bfloat16" else weight.bfloat16().float()


def layers_of(weights: str, blocks: int, kernel: str) -> list:
    """Every linear layer of `blocks` blocks, in `weights`, each running `kernel` at every row count (None where the
    kernel cannot run them)."""
    layers = []
    for index, (out_features, in_features) in enumerate(BLOCK * blocks):
        plain = ColumnParallelLinear(
            in_features, out_features, bias=False, gather_output=False, init_method=lambda x: x
        )
        plain.weight = torch.nn.Parameter(random_weight(out_features, in_features, weights, index), requires_grad=False)
        if weights.startswith("int"):
            layer = quantize_layer(plain, weights.split()[0], 32)
        else:
            layer = CPULinear(plain)
        if not layer.runs(kernel):
            return None
        layer.kernels = (kernel,) * len(ROW_CLASSES)
        layer.make_copies()
        layers.append(layer)
    return layers


def kernels_of(weights: str) -> list:
    if weights.startswith("int8"):
        return ["int8", "widened", "widened32", "fbgemm_int8"]
    if weights == "int4":
        return ["int4pack", "widened", "widened32"]
    return ["fp16", "onednn", "linear"]


def measure(passes: dict, rows: int, dtype: torch.dtype, rounds: int) -> dict:
    """Each kernel's pass times (seconds) over `rounds` rounds, the kernels taking turns within each round: `passes`
    maps each kernel to the layers a pass runs."""
    inputs = {kernel: [torch.randn(rows, layer.fairscale_layer.in_features, dtype=dtype) for layer in layers]
              for kernel, layers in passes.items()}  # fmt: skip
    times = {kernel: [] for kernel in passes}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # a warm-up round first: oneDNN builds its primitives
            for kernel, layers in passes.items():
                start = time.perf_counter()
                for layer, x in zip(layers, inputs[kernel]):
                    layer(x)
                times[kernel].append(time.perf_counter() - start)
    return {kernel: found[1:] for kernel, found in times.items()}


def attention_times(lengths, rounds: int) -> dict:
    """(SDPA's, the matmuls') median microseconds of one position's bfloat16 attention at each cache length."""
    found = {}
    for positions in lengths:
        generator = torch.Generator().manual_seed(positions)
        xq = torch.randn(1, 32, 1, 64, generator=generator).bfloat16()
        keys, values = (torch.randn(1, 8, positions, 64, generator=generator).bfloat16() for _ in "kv")
        calls = {
            "sdpa": lambda: F.scaled_dot_product_attention(xq, keys, values, enable_gqa=True),
            "matmul": lambda: one_position_attention(xq, keys, values),
        }
        times = {name: [] for name in calls}
        for call in calls.values():
            call()
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(16):
                    call()
                times[name].append((time.perf_counter() - start) / 16)
        found[positions] = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=4, help="blocks a pass of one row or a batch's rows runs")
    parser.add_argument("--no_attention", action="store_true")
    opts = parser.parse_args()
    init_model_parallel(torch.device("cpu"), None, timedelta(seconds=60))
    print(machine(torch.get_num_threads()))
    print(f"Kernel table's CPU: {cpu_offers()}; {opts.rounds} rounds, us per million weights: median (range)")
    for weights in (WEIGHTS[name] for name in opts.weights):
        dtype = torch.float32 if weights.startswith("float32") else torch.bfloat16
        layers = {kernel: layers_of(weights, opts.blocks, kernel) for kernel in kernels_of(weights)}
        layers = {kernel: found for kernel, found in layers.items() if found is not None}
        for rows in opts.rows:
            blocks = opts.blocks if rows < 64 else 1
            passes = {kernel: found[: len(BLOCK) * blocks] for kernel, found in layers.items()}
            times = measure(passes, rows, dtype, opts.rounds)
            million = sum(o * i for o, i in BLOCK) * blocks / 1e6
            medians = {kernel: statistics.median(t) / million * 1e6 for kernel, t in times.items()}
            best = min(medians, key=medians.get)
            table = table_kernels(torch.device("cpu"), weights)
            chosen = table[row_class(rows)] if table else "none (PyTorch's own)"
            figures = ", ".join(
                f"{kernel}{'*' if kernel == best else ''} {medians[kernel]:.1f} "
                f"({min(t) / million * 1e6:.1f}-{max(t) / million * 1e6:.1f})"
                for kernel, t in times.items()
            )
            print(f"{weights}, {rows} rows: {figures}; table: {chosen}", flush=True)
        del layers
    if not opts.no_attention:
        for positions, medians in attention_times([64, 128, 256, 512, 1024, 2048], opts.rounds).items():
            best = min(medians, key=medians.get)
            print(
                f"attention, {positions} positions: sdpa {medians['sdpa']:.0f} us, matmul {medians['matmul']:.0f} us"
                f" ({best} faster)",
                flush=True,
            )


if __name__ == "__main__":
    main()
