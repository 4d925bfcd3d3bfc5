"""Would llama.cpp's own kernels, called per product from Python, decode faster than ONNX Runtime's (int8-dyn and
int4-dyn's)? A decode step's weight products at Llama 3.2 1B's shape, timed on both in one process.

    pip install llama-cpp-python==0.3.36     # builds llama.cpp, with ggml, natively
    python benchmarks/ggml_products.py [--rounds 12]

ggml is reached through ctypes in llama-cpp-python's shared libraries (its C API, the structs as ggml.h of that
version lays them out): each weight is quantized by ggml itself (`ggml_quantize_chunk`, Q8_0, or Q4_1 as int4-dyn's
scale-and-zero-point groups), a one-node graph (`ggml_mul_mat` of one float32 row) is planned once per weight on a
thread pool of PyTorch's thread count kept for the whole run, and each call copies the row in and computes the graph.
ONNX Runtime's sessions are `llama.runtime.onnx_dyn.MatMulNBits`, as the library makes them, with PyTorch's own
threads at one while they run (as `one_torch_thread` does). Both step through the same products in a step's order:
per block wq+wk+wv, wo, w1+w3, w2 (fused, as the library runs them), then the output head in 8 bits. Each round
runs every form's step once, interleaved; the figures are medians and ranges over the rounds.
"""

import argparse
import ctypes
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_kernels import fused_step_weights  # noqa: E402

from llama.runtime.onnx_dyn import MatMulNBits, quantize_int4_dyn, quantize_int8_dyn  # noqa: E402

F32, Q4_1, Q8_0 = 0, 3, 8  # ggml_type values


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Tensor(ctypes.Structure):  # struct ggml_tensor
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class ThreadpoolParams(ctypes.Structure):
    _fields_ = [
        ("cpumask", ctypes.c_bool * 512),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class Plan(ctypes.Structure):  # struct ggml_cplan
    _fields_ = [
        ("work_size", ctypes.c_size_t),
        ("work_data", ctypes.c_void_p),
        ("n_threads", ctypes.c_int),
        ("threadpool", ctypes.c_void_p),
        ("abort_callback", ctypes.c_void_p),
        ("abort_callback_data", ctypes.c_void_p),
        ("use_ref", ctypes.c_bool),
    ]


def load_ggml():
    """llama-cpp-python's ggml libraries, with the argument and result types of the functions used here."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None:
        raise SystemExit("llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36")
    lib = Path(spec.submodule_search_locations[0]) / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    tensor_p, void_p = ctypes.POINTER(Tensor), ctypes.c_void_p
    signatures = {
        (base, "ggml_init"): (void_p, [InitParams]),
        (base, "ggml_new_tensor_2d"): (tensor_p, [void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
        (base, "ggml_mul_mat"): (tensor_p, [void_p, tensor_p, tensor_p]),
        (base, "ggml_new_graph"): (void_p, [void_p]),
        (base, "ggml_build_forward_expand"): (None, [void_p, tensor_p]),
        (base, "ggml_tensor_overhead"): (ctypes.c_size_t, []),
        (base, "ggml_graph_overhead"): (ctypes.c_size_t, []),
        (base, "ggml_row_size"): (ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
        (base, "ggml_quantize_chunk"): (
            ctypes.c_size_t,
            [ctypes.c_int, void_p, void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, void_p],
        ),
        (base, "ggml_threadpool_params_default"): (ThreadpoolParams, [ctypes.c_int]),
        (cpu, "ggml_threadpool_new"): (void_p, [ctypes.POINTER(ThreadpoolParams)]),
        (cpu, "ggml_graph_plan"): (Plan, [void_p, ctypes.c_int, void_p]),
        (cpu, "ggml_graph_compute"): (ctypes.c_int, [void_p, ctypes.POINTER(Plan)]),
    }
    for (library, name), (result, arguments) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = result, arguments
    cpu.ggml_cpu_init()
    return base, cpu


class GgmlProduct:
    """`x @ weight.T` for one float32 row, `weight` quantized to `kind` by ggml, on `pool`'s threads."""

    def __init__(self, ggml, pool, threads: int, weight: torch.Tensor, kind: int):
        base, self.cpu = ggml
        rows, cols = weight.shape
        self.values = torch.empty(base.ggml_row_size(kind, cols) * rows, dtype=torch.uint8)
        weight = weight.float().contiguous()
        base.ggml_quantize_chunk(kind, weight.data_ptr(), self.values.data_ptr(), 0, rows, cols, None)
        self.x, self.y = torch.empty(1, cols), torch.empty(1, rows)
        size = 4 * base.ggml_tensor_overhead() + base.ggml_graph_overhead() + 1024
        self.context = base.ggml_init(InitParams(size, None, True))  # tensors whose data lives in our buffers
        a = base.ggml_new_tensor_2d(self.context, kind, cols, rows)
        b = base.ggml_new_tensor_2d(self.context, F32, cols, 1)
        a.contents.data, b.contents.data = self.values.data_ptr(), self.x.data_ptr()
        out = base.ggml_mul_mat(self.context, a, b)
        out.contents.data = self.y.data_ptr()
        self.graph = base.ggml_new_graph(self.context)
        base.ggml_build_forward_expand(self.graph, out)
        self.plan = self.cpu.ggml_graph_plan(self.graph, threads, pool)
        self.work = torch.empty(max(self.plan.work_size, 1), dtype=torch.uint8)
        self.plan.work_data = self.work.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.cpu.ggml_graph_compute(self.graph, ctypes.byref(self.plan))
        return self.y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    ggml = load_ggml()
    params = ggml[0].ggml_threadpool_params_default(threads)
    pool = ggml[1].ggml_threadpool_new(ctypes.byref(params))
    steps = {name: [] for name in ("int8-dyn", "int4-dyn", "ggml Q8_0", "ggml Q4_1")}
    generator = torch.Generator().manual_seed(0)
    shapes = fused_step_weights("1b")
    for index, (rows, cols) in enumerate(shapes):
        weight = torch.randn(rows, cols, generator=generator) * 0.02
        head = index == len(shapes) - 1  # in 8 bits in every form, as int4-dyn keeps it
        steps["int8-dyn"].append(MatMulNBits(*quantize_int8_dyn(weight), None))
        steps["int4-dyn"].append(steps["int8-dyn"][-1] if head else MatMulNBits(*quantize_int4_dyn(weight)))
        steps["ggml Q8_0"].append(GgmlProduct(ggml, pool, threads, weight, Q8_0))
        steps["ggml Q4_1"].append(steps["ggml Q8_0"][-1] if head else GgmlProduct(ggml, pool, threads, weight, Q4_1))
    widths = [cols for _, cols in shapes]
    inputs = {cols: torch.randn(1, cols, generator=generator) for cols in set(widths)}
    seconds = {name: [] for name in steps}
    torch.set_num_threads(1)  # PyTorch's own threads out of the way, as the library runs ONNX Runtime's
    for _ in range(args.rounds):
        for name, products in steps.items():
            start = time.perf_counter()
            for product, cols in zip(products, widths):
                product(inputs[cols])
            seconds[name].append(time.perf_counter() - start)
    print(f"{os.cpu_count()} CPUs, {threads} threads, {args.rounds} rounds; a 1B decode step's products, ms:")
    for name, times in seconds.items():
        ms = [t * 1e3 for t in times]
        print(f"  {name:10s} median {statistics.median(ms):6.1f}  (range {min(ms):.1f}-{max(ms):.1f})")


if __name__ == "__main__":
    main()
