"""Step 5 of `for_runtime`: each quantized weight's product chosen by timing every way to compute it
(`QuantizedLinear.products`) at the row counts that matter: a decode step's, a batch's, a prompt's; on a GPU for
every scheme, on the CPU for int8 (PyTorch's kernel; the weight widened a block at a time for `F.linear`, in the
activations' dtype or in float32, each block multiplied with the weight on the right or on the left; or "split", in
integers on fbgemm's copy of the weight) and int4 (PyTorch's kernel, or widened likewise).

Which one is fastest depends on the device, the PyTorch build and the weight's shape (docs/cuda.md has the figures),
so it is measured, not assumed. The products give the same values up to the order of float32 sums, where the widened
weight is rounded, and the split's rounding of the activations (within 1/15,876 of a row's largest magnitude), so a
choice once timed is kept in the kernel cache (`KernelCache`, with the CPU's float kernels): every later load on this
machine runs the same products and gives the same results.
"""

import functools
import logging
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from llama.runtime.cpu.cache import KernelCache, Measured
from llama.runtime.cpu.choice import CacheFlush
from llama.runtime.cpu.copies import declined_copy, repaid_copies
from llama.runtime.cpu.integer import pack_int8, split_product
from llama.runtime.cpu.widened import cpu_int4_block_rows, widened_in_blocks, widened_int4_in_blocks
from llama.runtime.quantized import (
    QUANTIZED_PRODUCTS,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    int4_cpu_product,
    int8_kernel_product,
)
from llama.runtime.timing import graph_seconds_or_first, time_kernels, timed

logger = logging.getLogger(__name__)

# Row counts at which each product is timed: a decode step of one sequence (the only count at which the "fused"
# int8 product is compiled), a batch's step, a short prompt, a long one.
TIMED_ROWS = (1, 8, 64, 512)
# On the CPU: a decode step's row count, a batch's, a short prompt, a prompt as the float kernels time it.
CPU_TIMED_ROWS = (1, 8, 64, 256)
# Weights a CPU product is timed on for a prompt's rows: enough that a widened product's fixed costs per call weigh
# little, as on a whole weight; on 2**20, timed between the other products, int4's widened product took 1.5x as long
# a weight as it does alone.
CPU_SAMPLE_VALUES = 2**22
# For a decode step's rows and a batch's (fewer than CPU_PROMPT_ROWS): as many as a large weight of Llama 3.2 1B,
# each product on a copy of its own, the caches flushed before each round, as a decode step reads each weight from
# memory. On a sample in the cache the one-row products rank by their arithmetic and fixed costs instead: PyTorch's
# int8 kernel took half the "split" product's time there, and about twice it from memory.
CPU_DECODE_SAMPLE_VALUES = 2**24
CPU_PROMPT_ROWS = 64
# The rows each product runs on, untimed, right before each of its timed calls for a decode step, to bring its code
# back into the cache (not its timed sample): after a flush, or after another product's call, the "split" product (a
# dozen operations) took some 0.25 ms longer a call than in a decode step, and lost to PyTorch's int8 kernel on
# weights where it wins there.
WARM_ROWS = 64
CPU_INT8_PRODUCTS = {
    "int8": int8_kernel_product,
    "split": split_product,  # on fbgemm's copy of the sample (`cpu_timings`)
    "widened": widened_in_blocks,
    "widened32": functools.partial(widened_in_blocks, dtype=torch.float32),
    "widened_left": functools.partial(widened_in_blocks, left=True),
    "widened32_left": functools.partial(widened_in_blocks, dtype=torch.float32, left=True),
}
CPU_INT4_PRODUCTS = {
    "tinygemm": int4_cpu_product,
    "widened": widened_int4_in_blocks,
    "widened32": functools.partial(widened_int4_in_blocks, dtype=torch.float32),
    "widened_left": functools.partial(widened_int4_in_blocks, left=True),
    "widened32_left": functools.partial(widened_int4_in_blocks, dtype=torch.float32, left=True),
}
# Part of each CPU product's cache key, raised when a product's code changes its speed or how it is timed (2: the
# widened products' buffers reused from call to call, int4's unpacked outputs by inputs, the "_left" products added;
# 3: a decode step's products timed from memory, "split" added; 4: timings per weight, with the split's copy's time;
# 5: each product's code brought back into the cache before each timed call): timings cached before no longer hold.
CPU_PRODUCTS_REVISION = 5
PRODUCT_VARIABLE = "LLAMA_QUANTIZED_PRODUCT"  # pins one product (`pinned_product`)
SCREEN = 4  # products more than this many times slower than the best at a first, eager call are not timed further


def choose_quantized_kernels(model: nn.Module, max_seq_len: int, decode_rows: int) -> Dict[Tuple, Dict[int, str]]:
    """Step 5: set each quantized layer's `kernels` where it has more than one product (on a GPU every one; on the
    CPU the int8 and int4 ones), chosen once per (type, weight shape) from the kernel cache or timed; free the int4
    weights' second copies no chosen product reads, and make fbgemm's copies of the int8 weights whose chosen
    products read them ("split", where the copy repays its making within a context of `max_seq_len` tokens decoded
    `decode_rows` rows a step at most; fbgemm packs on one core, so a layer per thread). Returns the choices by (type
    name, out, in)."""
    cache = KernelCache()
    choices, int8_on_cpu = {}, []
    for layer in model.modules():
        if not isinstance(layer, QuantizedLinear) or len(layer.products(2)) < 2:
            continue  # one way to compute it: nothing to choose
        if not layer.layer_count:
            continue  # run inside a stack of layers, whose product is chosen
        key = (type(layer).__name__, layer.out_features, layer.in_features)
        if key not in choices:
            pinned = pinned_product(layer)
            choices[key] = (
                {1: pinned} if pinned is not None else measured_choice(layer, cache, max_seq_len, decode_rows)
            )
        layer.kernels = choices[key]  # copied in order by `MeasuredLinear.kernels`
        if isinstance(layer, Int4Linear):
            layer.drop_unused_copies()
        elif isinstance(layer, Int8Linear) and layer.weight.device.type == "cpu":
            int8_on_cpu.append(layer)
    cache.save()
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(lambda layer: layer.make_chosen_copies(set(layer.kernels.values())), int8_on_cpu))
    return choices


def measured_choice(layer: QuantizedLinear, cache: KernelCache, max_seq_len: int, decode_rows: int) -> Dict[int, str]:
    """The fastest product of `layer` at each timed row count, from `cache` where it holds the row count's timings
    (measured by an earlier load here: the same choice, so the same results), else timed now and cached; under
    model parallelism, rank 0's figures on every rank (`KernelCache.agree`). "split" only where its copy repays its
    making within a context of `max_seq_len` tokens (`repaid_copies`, as a float16 copy), decode steps running the
    products chosen for up to `decode_rows` rows (`decode_counts`)."""
    on_cpu = layer.weight.device.type == "cpu"
    device = f"CPU, products r{CPU_PRODUCTS_REVISION}" if on_cpu else torch.cuda.get_device_name(layer.weight.device)
    product = f"{type(layer).__name__} {layer.activation_dtype()} {layer.out_features}x{layer.in_features} on {device}"
    row_counts = CPU_TIMED_ROWS if on_cpu else TIMED_ROWS
    keys = {rows: cache.key(product, rows, sorted(layer.products(rows))) for rows in row_counts}
    measured = {}
    for rows, key in keys.items():
        measured[rows] = cache.get(key)
        if measured[rows] is None:
            measured[rows] = cpu_timings(layer, rows) if on_cpu else gpu_timings(layer, rows)
            cache.put(key, measured[rows])
    changed = cache.agree(set(keys.values()))  # under model parallelism every rank runs what rank 0 measured
    measured.update({rows: cache.get(key) for rows, key in keys.items() if key in changed})
    making = max((found.split_copy or 0.0 for found in measured.values()), default=0.0)
    decoding = decode_counts(row_counts, decode_rows)
    chosen = repaid_copies(measured, max_seq_len, "split", making, decoding)
    why = declined_copy(measured, chosen, "split", making, max_seq_len, decoding, layer.weight.numel())
    if why:
        logger.info("No fbgemm copy for %s: the split product is %s", product, why)
    return chosen


def decode_counts(row_counts: Tuple[int, ...], decode_rows: int) -> List[int]:
    """The row counts of `row_counts` (ascending) whose products decode steps of up to `decode_rows` rows run: each
    count's choice runs the rows above the count before it (`MeasuredLinear.kernel_for`)."""
    return [rows for before, rows in zip((0, *row_counts), row_counts) if before < decode_rows]


def pinned_product(layer: QuantizedLinear) -> Optional[str]:
    """The product `LLAMA_QUANTIZED_PRODUCT` pins for every row count, where `layer` has it ("fused", one row's
    only, is then its default for other rows: not pinnable); None where it is unset, or names a product of the
    other scheme or device (this layer is measured). For tests and bisecting, as `LLAMA_CPU_KERNEL` is for floats."""
    name = os.environ.get(PRODUCT_VARIABLE, "").strip()
    if not name:
        return None
    known = sorted(set(QUANTIZED_PRODUCTS) - {"fused"})
    if name not in known:
        raise ValueError(f"{PRODUCT_VARIABLE}={name!r} is not a quantized product: set one of {known}, or unset it")
    return name if name in layer.products(2) else None


def cpu_timings(layer: QuantizedLinear, rows: int) -> Measured:
    """Each CPU product's time for `rows` rows per weight, timed on the weight's first rows (for int4 whole blocks of
    its kernel's layout): each output row is computed alone, so its time per weight is the whole weight's. For a
    decode step's rows, on a larger sample read from memory (`CPU_DECODE_SAMPLE_VALUES`): each round after a flush of
    the caches, each timed call right after a call of the same product on a few rows of its own (`WARM_ROWS`), as a
    decode step meets each product: its weight in memory, its code in the cache. With "split", the time its copy
    takes to make per weight, on one of the threads a load packs on."""
    decoding = rows < CPU_PROMPT_ROWS
    sample = max(1, (CPU_DECODE_SAMPLE_VALUES if decoding else CPU_SAMPLE_VALUES) // layer.in_features)
    offered = [name for name in cpu_products(layer) if name in layer.products(rows)]
    calls, making = {}, None
    for name in offered:  # decoding, each on a copy of its own, which no other product's call brings into the cache
        start = time.perf_counter()
        calls[name] = sample_call(layer, name, sample, copy=decoding)
        if name == "split":  # the time fbgemm took to pack its copy
            making = time.perf_counter() - start
    x = torch.randn(rows, layer.in_features, dtype=layer.activation_dtype())
    if decoding:
        warm = {name: functools.partial(sample_call(layer, name, WARM_ROWS, copy=True), x) for name in offered}
        found = product_timings(calls, x, 3, CacheFlush(), warm)
    else:
        found = product_timings(calls, x, 3)
    weights = sample_rows(layer, sample) * layer.in_features  # in the sample timed
    per_weight = {kernel: seconds / weights for kernel, seconds in found.seconds.items()}
    median = {kernel: seconds / weights for kernel, seconds in found.median.items()}
    split_copy = None if making is None else making / weights / torch.get_num_threads()
    return Measured(per_weight, median, split_copy=split_copy)


def cpu_products(layer: QuantizedLinear) -> Dict[str, Callable]:
    """The CPU's products of `layer`'s scheme, by name."""
    return CPU_INT8_PRODUCTS if isinstance(layer, Int8Linear) else CPU_INT4_PRODUCTS


def sample_rows(layer: QuantizedLinear, rows: int) -> int:
    """The rows of a sample of about `rows` of `layer`'s rows: for int4 whole blocks of its kernel's layout."""
    if isinstance(layer, Int4Linear):
        block_rows = cpu_int4_block_rows()
        rows = max(block_rows, rows // block_rows * block_rows)
    return min(rows, layer.out_features)


def sample_call(layer: QuantizedLinear, name: str, rows: int, copy: bool) -> functools.partial:
    """Product `name` of `layer` on its first rows (`sample_rows`), as a function of the input: for "split" on
    fbgemm's copy of them, else on them, or on a copy of them (`copy`)."""
    rows = sample_rows(layer, rows)
    if isinstance(layer, Int8Linear):
        values = dict(q=layer.weight[:rows], scales=layer.scales[:rows])
    else:
        scales_and_zeros = layer.scales_and_zeros[:, :rows]
        values = dict(packed=layer.weight[:rows], scales_and_zeros=scales_and_zeros, group_size=layer.group_size)
    if name == "split":
        own = dict(pieces=pack_int8(**values))
    else:
        own = {k: v.clone() if copy and isinstance(v, torch.Tensor) else v for k, v in values.items()}
    return functools.partial(cpu_products(layer)[name], **own)


def gpu_timings(layer: QuantizedLinear, rows: int) -> Measured:
    x = torch.randn(rows, layer.in_features, device=layer.weight.device, dtype=layer.activation_dtype())
    return product_timings(layer.products(rows), x, repeats=3)


def fastest(products: Dict[str, Callable], x: torch.Tensor, repeats: int = 5) -> str:
    """The name of the product that runs `x` fastest (`product_timings`)."""
    return product_timings(products, x, repeats).fastest()


def product_timings(
    products: Dict[str, Callable],
    x: torch.Tensor,
    repeats: int = 5,
    flush: Optional[Callable] = None,
    warm: Optional[Dict[str, Callable]] = None,
) -> Measured:
    """The seconds each product takes to run `x`; one that raises (no such kernel on this device or build) is out of
    the running. On the CPU, each one's fastest and median of `repeats` rounds (`time_kernels`, the float kernels'
    timer). On CUDA each is timed as a recorded CUDA graph (`gpu_seconds`), as a decode step runs, unless its first
    call took `SCREEN` times the best first call: that call's time is then its figure. On the CPU, `flush` is called
    before each round, and `warm`'s call of a product (if any) right before each of its timed calls."""
    on_cpu = x.device.type == "cpu"
    calls, first = {}, {}
    for name, product in products.items():
        call = lambda product=product: product(x)  # noqa: E731
        try:
            call()  # a warm-up call (a compiled product compiles), which also finds whether it runs here
            if not on_cpu:
                first[name] = timed(call, x.device)
        except (RuntimeError, NotImplementedError):
            continue
        calls[name] = call
    if not calls:
        raise ValueError(f"None of the products {sorted(products)} runs on {x.device}")
    if on_cpu:
        (rounds,) = time_kernels([calls], flush, repeats, [warm or {}])
        return Measured({k: min(r) for k, r in rounds.items()}, {k: statistics.median(r) for k, r in rounds.items()})
    seconds = dict(first)
    for name in [name for name in calls if first[name] <= SCREEN * min(first.values())]:
        seconds[name] = graph_seconds_or_first(calls[name], first[name], repeats)
    return Measured(seconds, dict(seconds))
